"""NVIDIA DALI as the decoder of a StreamingDataset (the optional extra `aiperf[dali]`).

A run asks for it with the policy item `data_loader = "dali"` (`load_dataset(spec, loader="dali")`);
without the extra that is a one-line error naming it. Reading stays aiperf's: the epoch order, the
sharding of every global batch over the ranks and the bytes of each image (ImageFolder files, or
TFRecord records through the CRC-checking reader) come from the StreamingDataset, and DALI gets the
encoded images through `external_source`. So both layouts work, the images and labels of a batch
are the host pipeline's, and every image is counted: one that cannot be read, or that DALI's decoder
rejects, is skipped and counted in Batch.skipped, exactly (a batch that fails is retried image by
image to find the culprits, then run again without them).

Where it decodes:
- `device_id=None` (CPU): DALI's CPU operators (libjpeg-turbo), `data.workers` threads per batch, in
  a thread that runs `data.prefetch` batches ahead. Batch.x is a NumPy uint8 NHWC array, like the
  host pipeline's, so every backend consumes it unchanged.
- `device_id=k` (CUDA device k): the `mixed` decoder (nvJPEG; the hardware JPEG decoder where the GPU
  has one), resize and flip on the GPU. Batch.x is a DALI GPU tensor (uint8 NHWC) that speaks DLPack:
  `torch.from_dlpack(x)`, `jax.dlpack.from_dlpack(x)`, `tf.experimental.dlpack.from_dlpack(
  x.__dlpack__())` take it without a host copy (DLPack's stream handshake orders the consumer's
  reads after DALI's writes). It is valid until the next batch is drawn, which overwrites its
  buffer: the backend copies it into its own device memory first (e.g. `torch.from_dlpack(x).clone()`,
  as DALI's own framework plugins copy into a framework tensor). The DLPack handoff itself is
  tested on DALI's CPU tensors, for torch, jax and tensorflow. This path is written to DALI's
  documented API but has not run here (no GPU; the wheel is too large for the lent GPU machines):
  it is unverified.

Augmentation, against aiperf_core.data.preprocess (Pillow):
- training: `decoders.image_random_crop` with the same area (8%-100%) and aspect-ratio (3/4-4/3)
  ranges and 10 attempts, but DALI's own sampler, generator and fallback after 10 failures; the
  crop is decoded at full resolution (ROI decoding), where Pillow decodes at a reduced DCT scale;
  resize to size x size, linear with antialiasing (as Pillow's BILINEAR with a box); a horizontal
  flip with probability 1/2 (`random.coin_flip`). The distributions match; the pixels do not, and
  the draws depend on DALI's seed (seed, rank) and on the order of the batches, not on
  (seed, epoch, index).
- validation: the shorter side resized to size / 0.875 and a central crop, as Pillow; DALI rounds
  the longer side on its own (a pixel of difference at most).
- a JPEG truncated after the crop's last row may decode under ROI decoding where Pillow, which
  decodes the whole image, rejects it.
Normalisation is not DALI's: batches are uint8 pixels, normalised by the backend on its device.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator

import numpy as np

from aiperf_core.data.preprocess import CROP_RATIO, CROP_SCALE, CROP_TRIES, VAL_CROP_FRACTION, CorruptImage
from aiperf_core.data.batch import TRAIN, Batch, check_split, shard
from aiperf_core.errors import AiperfError

EXTRA_HINT = "the DALI data loader needs the extra: pip install 'aiperf[dali]'"
log = logging.getLogger("aiperf.data")


def require_dali():
    """The nvidia.dali module, or AiperfError naming the extra."""
    try:
        import nvidia.dali  # noqa: F401
        from nvidia.dali import fn, pipeline_def, types  # noqa: F401
    except ImportError:
        raise AiperfError(EXTRA_HINT) from None
    return nvidia.dali


def _pipeline(split: str, size: int, batch_size: int, threads: int, device_id: int | None, seed: int):
    """A DALI pipeline from encoded images (external source 'encoded') to uint8 size x size x 3."""
    require_dali()
    from nvidia.dali import fn, pipeline_def, types

    gpu = device_id is not None
    decoder = "mixed" if gpu else "cpu"
    ops = "gpu" if gpu else "cpu"

    # One batch in flight: the pipeline is fed one batch per run (a deeper prefetch queue would
    # want several fed ahead); overlap comes from the background thread (CPU) or CUDA's asynchrony.
    @pipeline_def(batch_size=batch_size, num_threads=max(threads, 1), device_id=device_id, seed=seed,
                  prefetch_queue_depth=1, exec_dynamic=True)
    def graph():
        encoded = fn.external_source(name="encoded", dtype=types.UINT8, batch=True)
        if split == TRAIN:
            images = fn.decoders.image_random_crop(
                encoded, device=decoder, output_type=types.RGB, random_area=list(CROP_SCALE),
                random_aspect_ratio=list(CROP_RATIO), num_attempts=CROP_TRIES)
            images = fn.resize(images, device=ops, resize_x=size, resize_y=size,
                               interp_type=types.INTERP_LINEAR, antialias=True)
            mirror = fn.random.coin_flip(probability=0.5)
            return fn.crop_mirror_normalize(images, device=ops, mirror=mirror, dtype=types.UINT8,
                                            output_layout="HWC")
        images = fn.decoders.image(encoded, device=decoder, output_type=types.RGB)
        short = max(int(round(size / VAL_CROP_FRACTION)), size)
        images = fn.resize(images, device=ops, resize_shorter=short, interp_type=types.INTERP_LINEAR,
                           antialias=True)
        return fn.crop_mirror_normalize(images, device=ops, crop=(size, size), crop_pos_x=0.5, crop_pos_y=0.5,
                                        dtype=types.UINT8, output_layout="HWC")

    pipe = graph()
    pipe.build()
    return pipe


class DaliDecoder:
    """One DALI pipeline for one (split, rank, batch size, device): decodes shards of batches."""

    def __init__(self, data, split: str, batch_size: int, rank: int, device_id: int | None, seed: int):
        self.data, self.split, self.device_id = data, check_split(split), device_id
        self.pipe = _pipeline(split, data.image_size, batch_size, data.workers, device_id,
                              (seed * 1_000_003 + rank) & 0x7FFFFFFF)

    def _run(self, encoded: list[np.ndarray]):
        self.pipe.feed_input("encoded", encoded)
        (out,) = self.pipe.run()
        return out

    def decode(self, indices: np.ndarray) -> tuple[object | None, np.ndarray, list[str]]:
        """(DALI batch of the images that decoded or None when none did, their labels, messages of
        the skipped) for the given image indices."""
        source, labels = self.data.source, self.data.source.labels(self.split)
        encoded, kept, corrupt = [], [], []
        for index in indices:
            try:
                encoded.append(np.frombuffer(source.encoded(self.split, int(index)), np.uint8))
                kept.append(int(index))
            except CorruptImage as exc:
                corrupt.append(str(exc))
        if not encoded:
            return None, np.zeros(0, np.int64), corrupt
        try:
            out = self._run(encoded)
        except RuntimeError:
            # DALI fails the whole batch; find the images its decoder rejects, one by one.
            good = []
            for index, data in zip(kept, encoded):
                try:
                    self._run([data])
                    good.append((index, data))
                except RuntimeError as exc:
                    reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                    corrupt.append(f"{source.where(self.split, index)}: DALI cannot decode ({reason})")
            if not good:
                return None, np.zeros(0, np.int64), corrupt
            kept = [index for index, _ in good]
            out = self._run([data for _, data in good])
        return out.as_tensor(), labels[np.asarray(kept, np.int64)], corrupt


def iterate(data, split: str, epoch: int, seed: int, batch_size: int, rank: int = 0, world: int = 1,
            device_id: int | None = None) -> Iterator[Batch]:
    """This rank's shard of every batch of the epoch, decoded by DALI: on the CPU (device_id None;
    x a NumPy array, decoded `data.prefetch` batches ahead in a thread) or on CUDA device
    `device_id` (x a DLPack-capable DALI GPU tensor, valid until the next batch is drawn)."""
    decoder = data.dali_decoder(split, batch_size, rank, device_id, seed)
    plan = data.plan(split, epoch, seed, batch_size)

    def batch(global_batch: np.ndarray, as_numpy: bool) -> Batch:
        x, y, corrupt = decoder.decode(shard(global_batch, rank, world))
        if corrupt:
            log.warning("skipped %d corrupt image(s): %s", len(corrupt), "; ".join(corrupt[:3]))
        if x is None:
            x = np.zeros((0,) + data.image_shape, np.uint8)
        elif as_numpy:
            x = np.array(x)  # a copy: DALI reuses its output buffers on the next run
        return Batch(x, y, len(global_batch), len(corrupt), corrupt)

    if device_id is not None:
        return (batch(b, as_numpy=False) for b in plan)
    return _ahead((lambda b=b: batch(b, as_numpy=True)) for b in plan)


_DONE = object()


def _ahead(jobs, depth: int = 2) -> Iterator[Batch]:
    """Run the jobs in order in one background thread, up to `depth` results ahead (DALI releases
    the GIL while it decodes). Closing the iterator stops the thread after its current job."""
    results: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work():
        try:
            for job in jobs:
                if stop.is_set():
                    return
                results.put((job(), None))
        except BaseException as exc:  # handed to the consumer, raised there
            results.put((None, exc))
            return
        results.put((_DONE, None))

    thread = threading.Thread(target=work, name="aiperf-dali", daemon=True)
    thread.start()
    try:
        while True:
            item, error = results.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                results.get(timeout=0.1)
            except queue.Empty:
                pass
        thread.join()
