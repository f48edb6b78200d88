"""Streaming datasets: images decoded and augmented batch by batch while the model trains.

`ImageSource` says where the images are (counts, labels, the encoded bytes of image i of a split).
`StreamingDataset` wraps a source with the settings of one training run (resolution, data
workers) and cuts epochs into batches:

- An epoch is one pass over the training split by the replica, in the order
  np.random.default_rng(seed + epoch).permutation(n) (the same rule as for in-memory arrays; the
  workflow seeds each replica differently, so replicas read different files at any moment), in
  global batches of batch_size, the last one short. Synthetic data reads in order
  (ImageSource.shuffled).
- Each device of the replica reads a distinct, contiguous shard of every global batch
  (np.array_split(batch, world)[rank]): the shards of a batch partition it.
- An image that cannot be decoded is skipped and counted (Batch.skipped); it never stops an epoch.
  A batch therefore holds the images that did decode: the images processed are counted exactly.
- Batches carry uint8 NHWC pixels, cropped, resized and flipped but not normalised: each backend
  normalises on its device inside its step, `(float32(x) - MEAN) * INV_STD` with the constants of
  aiperf_core.data.preprocess (`preprocess.normalise` is the same on the host).

`iterate` is the shared host pipeline (used by the NumPy, JAX and MindSpore backends and by any
backend without a native one): whole batches are decoded by `workers` worker processes, up to
`workers + prefetch` batches ahead of the consumer. Processes, not threads: Python holds the GIL
for part of every image (Pillow's JPEG header parsing and load loop are Python, so are the
augmentation's generator and crop box), which caps threads however many cores there are: on a
16-core host the threaded pipeline reached 715 images/s, 2.5x a one-thread PIL loop (issue 17).
The pool is made on the first epoch and kept (`close()` ends it); workers are forked, except once
a deep-learning framework is loaded in the process (FORK_UNSAFE): then they come from a fork
server, because such frameworks keep threads and device state that a forked child inherits
broken. Framework pipelines (tf.data, torch's DataLoader) call `plan` and `load` instead.
"""

from __future__ import annotations

import abc
import logging
import multiprocessing
import os
import sys
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

import numpy as np

# The splits, Batch and shard live in aiperf_core.data.batch, which DALI's decoder (aiperf_core.data.dali)
# imports too: this module imports that one (lazily), never the other way round.
from aiperf_core.data.batch import SPLITS, TRAIN, VAL, Batch, check_split, shard  # noqa: F401
from aiperf_core.data.preprocess import CorruptImage, augmentation_rng, train_image, val_image
from aiperf_core.errors import AiperfError
from aiperf_core.orphans import leave_when_gone, process_identity

DEFAULT_PREFETCH = 2
NATIVE, DALI = "native", "dali"  # who decodes: the backend's own pipeline or the host workers, or NVIDIA DALI
LOADERS = (NATIVE, DALI)
log = logging.getLogger("aiperf.data")


def check_loader(value) -> str | None:
    """The policy item data_loader's check: None when `value` can serve, else why not (one line)."""
    if value not in LOADERS:
        return f"must be one of {', '.join(LOADERS)}"
    if value == DALI:
        from aiperf_core.data.dali import require_dali

        try:
            require_dali()
        except AiperfError:
            return "needs NVIDIA DALI, the extra aiperf[dali]: pip install 'aiperf[dali]'"
    return None


class ImageSource(abc.ABC):
    """Images of a dataset, by split and index. Subclasses hold only picklable state (paths,
    arrays), so that worker processes can receive them."""

    name: str = ""  # the dataset's name, which the score rules check ('imagenet', 'synthetic')
    layout: str = ""  # how it is stored ('imagefolder', 'tfrecord', 'generated')
    path: str | None = None
    class_names: tuple[str, ...] = ()

    @abc.abstractmethod
    def labels(self, split: str) -> np.ndarray:
        """Class index of every image of the split, int64."""

    @abc.abstractmethod
    def encoded(self, split: str, index: int) -> bytes:
        """The stored (encoded) bytes of an image; raises CorruptImage if they cannot be read."""

    def where(self, split: str, index: int) -> str:
        """A name for the image in messages (its file)."""
        return f"{split}[{index}]"

    def read(self, split: str, index: int) -> tuple[bytes, str]:
        """(encoded bytes, the image's own file name) for conversions; raises CorruptImage."""
        return self.encoded(split, index), os.path.basename(self.where(split, index))

    def count(self, split: str) -> int:
        return len(self.labels(split))

    shuffled = True  # an epoch reads the training split in a random order (see StreamingDataset.plan)

    def example(self, split: str, index: int, size: int, seed: int, epoch: int,
                out: np.ndarray | None = None) -> np.ndarray:
        """Image `index` decoded and preprocessed: uint8 size x size x 3 pixels, written into `out`
        when given; raises CorruptImage."""
        where = self.where(split, index)
        data = self.encoded(split, index)
        if split == TRAIN:
            return train_image(data, size, augmentation_rng(seed, epoch, index), where, out)
        return val_image(data, size, where, out)

    def decode_batch(self, split: str, indices: np.ndarray, size: int, seed: int,
               epoch: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """(uint8 pixels N x size x size x 3, labels, messages of the images that did not decode)
        for the given indices; the images that do not decode are left out."""
        labels = self.labels(split)
        x = np.empty((len(indices), size, size, 3), np.uint8)  # each image is written in place
        kept, corrupt = [], []
        for index in indices:
            try:
                self.example(split, int(index), size, seed, epoch, out=x[len(kept)])
                kept.append(labels[index])
            except CorruptImage as exc:
                corrupt.append(str(exc))
        return x[:len(kept)], np.asarray(kept, dtype=np.int64), corrupt


# Modules whose import leaves threads or device state behind that a forked child inherits broken.
FORK_UNSAFE = ("jax", "jaxlib", "mindspore", "tensorflow", "torch")
_worker_state: Any = None  # in a worker process: the object its pool was made for


def start_method() -> str:
    """How worker processes start: forked (fast, nothing to re-import) while no deep-learning
    framework is loaded in this process, else from a fork server (a clean process that imported
    only the data modules)."""
    return "forkserver" if any(name in sys.modules for name in FORK_UNSAFE) else "fork"


def _init_worker(state: Any, owner: int, identity: str | None) -> None:
    global _worker_state
    _worker_state = state
    # A replica killed with SIGKILL cannot close its pool: its workers leave by themselves (orphans.py).
    leave_when_gone(owner, identity, 0, "aiperf-data-orphan-check")


def _call(fn: Callable[[Any, Any], Any], item: Any) -> Any:
    return fn(_worker_state, item)


class WorkerPool:
    """`workers` processes that each hold a copy of `state` (picklable; sent once, when the pool
    starts) and compute fn(state, item) for module-level functions fn (picklable by name)."""

    def __init__(self, state: Any, workers: int):
        if workers < 1:
            raise AiperfError(f"data workers: a worker pool needs >= 1, got {workers}")
        method = start_method()
        context = multiprocessing.get_context(method)
        if method == "forkserver":
            context.set_forkserver_preload(["__main__", __name__])
        self.workers = workers
        self._executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                             initargs=(state, os.getpid(), process_identity(os.getpid())))

    def map(self, fn: Callable[[Any, Any], Any], items: Iterable[Any],
            prefetch: int = DEFAULT_PREFETCH) -> Iterator[Any]:
        """fn(state, item) for each item, in order, up to workers + prefetch items ahead. Closing
        the iterator cancels the work not started."""
        pending: deque = deque()
        try:
            for item in items:
                pending.append(self._executor.submit(_call, fn, item))
                if len(pending) >= self.workers + prefetch:
                    yield self._result(pending.popleft())
            while pending:
                yield self._result(pending.popleft())
        finally:
            for future in pending:
                future.cancel()

    @staticmethod
    def _result(future):
        try:
            return future.result()
        except BrokenProcessPool:
            raise AiperfError("a data worker process died (killed, or out of memory); see the log") from None

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def prefetch_map(fn: Callable[[Any, Any], Any], state: Any, items: Iterable[Any], workers: int,
                 prefetch: int = DEFAULT_PREFETCH) -> Iterator[Any]:
    """fn(state, item) for each item, in order: by a WorkerPool of `workers` processes made for
    this call, or inline with workers < 1."""
    if workers < 1:
        for item in items:
            yield fn(state, item)
        return
    pool = WorkerPool(state, workers)
    try:
        yield from pool.map(fn, items, prefetch)
    finally:
        pool.close()


def _load_shard(data: "StreamingDataset", task: tuple) -> "Batch":
    split, epoch, seed, global_batch, rank, world = task
    x, y, skipped, corrupt = data.load(split, shard(global_batch, rank, world), epoch, seed)
    return Batch(x, y, len(global_batch), skipped, corrupt)


class StreamingDataset:
    """A source plus the run's input settings; what a backend's train() accepts besides Dataset."""

    def __init__(self, source: ImageSource, image_size: int = 224, workers: int = 1,
                 prefetch: int = DEFAULT_PREFETCH, loader: str = NATIVE):
        if workers < 0:
            raise AiperfError(f"data workers must be >= 0, got {workers}")
        if loader not in LOADERS:
            raise AiperfError(f"data_loader: must be one of {', '.join(LOADERS)}, got {loader!r}")
        if loader == DALI:
            if source.layout not in ("imagefolder", "tfrecord"):
                raise AiperfError(f"data_loader: dali decodes stored images; the {source.name} dataset has none")
            from aiperf_core.data.dali import require_dali

            require_dali()
        self.source = source
        self.image_size = int(image_size)
        self.workers = int(workers)
        self.prefetch = int(prefetch)
        self.loader = loader
        self._pool: WorkerPool | None = None  # made by the first iterate(), kept across epochs
        self._dali: dict = {}  # DALI pipelines by (split, batch size, rank, device id, seed)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        # A copy (in a worker, a DataLoader, a spawned rank) has no pool or pipelines of its own.
        state["_pool"], state["_dali"] = None, {}
        return state

    def close(self) -> None:
        """End the worker processes of the host pipeline, if any."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def dali_decoder(self, split: str, batch_size: int, rank: int, device_id: int | None, seed: int):
        """The DALI pipeline for these settings, built once (aiperf_core.data.dali)."""
        from aiperf_core.data.dali import DaliDecoder

        key = (split, batch_size, rank, device_id, seed)
        if key not in self._dali:
            self._dali[key] = DaliDecoder(self, split, batch_size, rank, device_id, seed)
        return self._dali[key]

    # -- what a backend and the score rules need to know ------------------------------------------
    @property
    def name(self) -> str:
        return self.source.name

    @property
    def classes(self) -> int:
        return len(self.source.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.image_size, self.image_size, 3)

    @property
    def train_images(self) -> int:
        return self.source.count(TRAIN)

    @property
    def val_images(self) -> int:
        return self.source.count(VAL)

    def describe(self) -> dict:
        return {"name": self.name, "path": self.source.path, "layout": self.source.layout,
                "classes": self.classes, "train_images": self.train_images, "val_images": self.val_images,
                "image_size": self.image_size, "data_loader": self.loader}

    # -- epochs -----------------------------------------------------------------------------------
    def plan(self, split: str, epoch: int, seed: int, batch_size: int) -> list[np.ndarray]:
        """The global batches of an epoch, as image indices: shuffled for training (unless the
        source reads in order: synthetic data), in order for validation."""
        from aiperf_core.backend import batches

        check_split(split)
        shuffled = split == TRAIN and self.source.shuffled
        rng = np.random.default_rng(seed + epoch) if shuffled else None
        return list(batches(self.source.count(split), batch_size, rng))

    def load(self, split: str, indices: np.ndarray, epoch: int,
             seed: int) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
        """(images, labels, skipped, names of the skipped) for the given indices: uint8 NHWC
        pixels; images that do not decode are left out."""
        indices = np.asarray(indices, dtype=np.int64)
        x, y, corrupt = self.source.decode_batch(split, indices, self.image_size, seed, epoch)
        if corrupt:
            log.warning("skipped %d corrupt image(s): %s", len(corrupt), "; ".join(corrupt[:3]))
        return x, y, len(corrupt), corrupt

    def iterate(self, split: str, epoch: int, seed: int, batch_size: int, rank: int = 0,
                world: int = 1) -> Iterator[Batch]:
        """This rank's shard of every batch of the epoch, decoded by the worker processes (inline
        with workers = 0), or by DALI's CPU operators with loader DALI (aiperf_core.data.dali.iterate
        decodes on a GPU)."""
        if self.loader == DALI:
            from aiperf_core.data import dali

            return dali.iterate(self, split, epoch, seed, batch_size, rank, world)
        tasks = ((split, epoch, seed, b, rank, world) for b in self.plan(split, epoch, seed, batch_size))
        if self.workers < 1:
            return (_load_shard(self, task) for task in tasks)
        if self._pool is None:
            self._pool = WorkerPool(self, self.workers)
        return self._pool.map(_load_shard, tasks, self.prefetch)


# -- one epoch's batches, for in-memory and streamed data alike -----------------------------------


def train_batches(data, epoch: int, seed: int, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
    """This rank's shard of every training batch of the epoch. For a Dataset (in-memory arrays)
    the order is the same rule as the stream's, np.random.default_rng(seed + epoch), and nothing is
    ever skipped. A streamed dataset (images, or a trial's text: aiperf_core.data.text_stream) cuts
    its own batches."""
    if hasattr(data, "iterate"):
        yield from data.iterate(TRAIN, epoch, seed, batch_size, rank, world)
        return
    from aiperf_core.backend import batches

    for idx in batches(len(data.y_train), batch_size, np.random.default_rng(seed + epoch)):
        part = shard(idx, rank, world)
        yield Batch(data.x_train[part], data.y_train[part], len(idx))


def val_batches(data, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
    """The validation set in order, in batches of batch_size (this rank's shard of each)."""
    if hasattr(data, "iterate"):
        yield from data.iterate(VAL, 0, 0, batch_size, rank, world)
        return
    from aiperf_core.backend import batches

    for idx in batches(len(data.y_val), batch_size):
        part = shard(idx, rank, world)
        yield Batch(data.x_val[part], data.y_val[part], len(idx))
