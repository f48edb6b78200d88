"""Batches on the training device: how every kind of data reaches a torch step.

A feed yields, for each global batch of an epoch, this rank's shard as a `DeviceBatch` whose
tensors are already on the device: images as uint8 NHWC pixels (streamed data, normalised by the
model on the device) or float32 (an in-memory Dataset, already normalised), int64 labels.

* `ArrayFeed`, in-memory arrays (a Dataset): the arrays go to the device once per trial (on CUDA,
  when they take at most DEVICE_RESIDENT_BYTES; else they stay in pinned host memory and each
  batch is copied ahead, as below); an epoch's order goes up once as an index tensor, and each
  batch is an index_select on the device.
* `TokenFeed`, streamed text (aiperf_core.data.text_stream.TokenStream): each shard's windows read
  from the corpus when its batch is due (`plan` + `load`), int64 token ids; on CUDA pinned and
  copied one batch ahead (`ahead_to_device`). A batch or two in memory, never an epoch.
* `SyntheticFeed`, `--data synthetic`: the pool of aiperf_core.data.synthetic goes to the device
  once; each batch is a slice of it. No host work per step.
* `LoaderFeed`, decoded images: a torch DataLoader whose worker processes decode whole shards
  (`stream_loader`), uint8 pixels in pinned memory on CUDA, copied to the device one batch ahead
  on a side CUDA stream, so that the copy of batch k+1 overlaps step k.
* `DaliFeed`, decoded by NVIDIA DALI (the data_loader policy item): on a GPU DALI's output is taken
  by DLPack and copied on the device before the next batch is drawn.
* `NvjpegFeed` (nvjpeg.py): JPEGs decoded on the GPU by torchvision's nvJPEG binding, when CUDA and
  torchvision are present and DALI was not asked for.

`open_feeds` picks the feed (`feed_kind` says which) for a training and a validation split.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import torch

from aiperf_core.backend import batches, is_streaming, is_token_stream

DEVICE_RESIDENT_BYTES = 2 << 30  # in-memory arrays up to this size live on the GPU for the trial
# Loaded after these, a forked DataLoader worker may inherit their threads or device state broken
# (torch's own workers are made for fork, as long as they touch no CUDA): use a fork server then.
_FORK_UNSAFE = ("jax", "jaxlib", "mindspore", "tensorflow")


@dataclass
class DeviceBatch:
    x: torch.Tensor  # on the device: uint8 NHWC pixels or float32 NHWC
    y: torch.Tensor  # int64 labels on the device
    size: int  # images the global batch asked for
    skipped: int = 0  # this shard's images that did not decode


def shard_bounds(length: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous part of a batch of `length` (np.array_split's rule)."""
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class Feed:
    may_skip = False  # whether a shard can hold fewer images than its share (undecodable files)

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ArrayFeed(Feed):
    """In-memory arrays, in batches of `batch_size`: shuffled by np.random.default_rng(seed + epoch)
    when `seed` is given (training), in order otherwise (validation)."""

    def __init__(self, x, y, device: torch.device, batch_size: int, seed: int | None, rank: int = 0,
                 world: int = 1):
        self.device, self.batch_size, self.seed, self.rank, self.world = device, batch_size, seed, rank, world
        x, y = torch.as_tensor(x), torch.as_tensor(y, dtype=torch.int64)
        self.resident = device.type != "cuda" or x.numel() * x.element_size() <= DEVICE_RESIDENT_BYTES
        if self.resident:
            self.x, self.y = x.to(device), y.to(device)
        else:
            self.x, self.y = x.pin_memory(), y.pin_memory()
        self.n = len(y)

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        rng = np.random.default_rng(self.seed + epoch) if self.seed is not None else None
        order = rng.permutation(self.n) if rng is not None else np.arange(self.n)
        order_t = torch.from_numpy(order)
        if self.resident:
            order_t = order_t.to(self.device, non_blocking=True)

        def shards() -> Iterator[DeviceBatch]:
            for start in range(0, self.n, self.batch_size):
                length = min(self.batch_size, self.n - start)
                a, b = shard_bounds(length, self.rank, self.world)
                index = order_t[start + a:start + b]
                yield DeviceBatch(self.x.index_select(0, index), self.y.index_select(0, index), length)

        if self.resident:
            return shards()
        return ahead_to_device(shards(), self.device)


class TokenFeed(Feed):
    """A TokenStream's split in batches of `batch_size`: this rank's windows of each global batch of
    the epoch's plan, loaded when the batch is due. Token ids and next tokens stay integers (int64
    on the device); nothing is skipped."""

    def __init__(self, data, split: str, seed: int, batch_size: int, device: torch.device, rank: int, world: int):
        self.data, self.split, self.seed, self.batch_size = data, split, seed, batch_size
        self.device, self.rank, self.world = device, rank, world

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        from aiperf_core.data.batch import shard

        pin = self.device.type == "cuda"

        def host() -> Iterator[DeviceBatch]:
            for offsets in self.data.plan(self.split, epoch, self.seed, self.batch_size):
                x, y, _, _ = self.data.load(self.split, shard(offsets, self.rank, self.world), epoch, self.seed)
                x, y = torch.from_numpy(x).to(torch.int64), torch.from_numpy(y).to(torch.int64)
                yield DeviceBatch(x.pin_memory() if pin else x, y.pin_memory() if pin else y, len(offsets))

        return ahead_to_device(host(), self.device)


class SyntheticFeed(Feed):
    """Synthetic data: the device pool (uploaded by the caller, shared by both splits), a slice per
    shard; the windows are aiperf_core.data.synthetic's, the same batches the host pipeline gives."""

    def __init__(self, data, split: str, pool: tuple[torch.Tensor, torch.Tensor], batch_size: int, rank: int,
                 world: int):
        from aiperf_core.data.synthetic import windows

        self.pixels, self.labels = pool
        self.windows = list(windows(data, split, batch_size, rank, world))  # the same every epoch

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        for w in self.windows:
            stop = w.offset + w.length
            yield DeviceBatch(self.pixels[w.offset:stop], self.labels[w.offset:stop], w.size)


def synthetic_pool(data, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic pool on the device, for shards of batches of up to `batch_size` images."""
    from aiperf_core.data.synthetic import device_pool

    pool = device_pool(data, batch_size)
    return torch.from_numpy(pool.pixels).to(device), torch.from_numpy(pool.labels).to(device)


class ShardBatches(torch.utils.data.Dataset):
    """Item (epoch, k): this rank's shard of global batch k of the epoch, decoded and augmented, as
    (images, labels, skipped, global batch size). Each DataLoader worker decodes whole shards."""

    def __init__(self, data, split: str, seed: int, batch_size: int, rank: int, world: int):
        self.data, self.split, self.seed, self.batch_size = data, split, seed, batch_size
        self.rank, self.world = rank, world
        self._plan: tuple[int, list] | None = None  # (epoch, global batches), per worker

    def plan(self, epoch: int) -> list:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.data.plan(self.split, epoch, self.seed, self.batch_size))
        return self._plan[1]

    def __len__(self) -> int:
        return -(-self.data.source.count(self.split) // self.batch_size)

    def __getitem__(self, key):
        from aiperf_core.data.stream import shard

        epoch, k = key
        indices = self.plan(epoch)[k]
        x, y, skipped, _ = self.data.load(self.split, shard(indices, self.rank, self.world), epoch, self.seed)
        return torch.from_numpy(x), torch.from_numpy(y), skipped, len(indices)


class EpochSampler(torch.utils.data.Sampler):
    """Keys (epoch, k) of one epoch's batches; set_epoch before iterating, as with DistributedSampler."""

    def __init__(self, batches: int):
        self.batches, self.epoch = batches, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return ((self.epoch, k) for k in range(self.batches))

    def __len__(self) -> int:
        return self.batches


def worker_context():
    """How DataLoader workers start: forked, unless a framework that does not survive fork is loaded."""
    return "forkserver" if any(name in sys.modules for name in _FORK_UNSAFE) else None


def stream_loader(data, split: str, seed: int, batch_size: int, device, rank: int = 0, world: int = 1,
                  items: torch.utils.data.Dataset | None = None):
    """A DataLoader over this rank's shards of the split's batches (`items`, default ShardBatches):
    data.workers worker processes per replica (shared among its ranks), each decoding whole
    shards, data.prefetch batches ahead per worker, pinned memory on CUDA. Workers persist across
    epochs (no re-fork per epoch). Yields (images, labels, skipped, global batch size)."""
    items = items if items is not None else ShardBatches(data, split, seed, batch_size, rank, world)
    workers = -(-data.workers // world) if data.workers else 0
    return torch.utils.data.DataLoader(
        items, batch_size=None, sampler=EpochSampler(len(items)), num_workers=workers,
        pin_memory=torch.device(device).type == "cuda", prefetch_factor=max(data.prefetch, 1) if workers else None,
        persistent_workers=bool(workers), multiprocessing_context=worker_context() if workers else None)


class LoaderFeed(Feed):
    may_skip = True

    def __init__(self, data, split: str, seed: int, batch_size: int, device: torch.device, rank: int, world: int):
        self.device = device
        self.loader = stream_loader(data, split, seed, batch_size, device, rank, world)

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        self.loader.sampler.set_epoch(epoch)
        host = (DeviceBatch(x, y, int(size), int(skipped)) for x, y, skipped, size in self.loader)
        return ahead_to_device(host, self.device)

    def close(self) -> None:
        self.loader = None  # ends the persistent workers


class DaliFeed(Feed):
    """Batches decoded by NVIDIA DALI (aiperf_core.data.dali): on CUDA by its `mixed` decoder, on
    the device already; on a CPU by its CPU operators, as NumPy arrays."""

    may_skip = True

    def __init__(self, data, split: str, seed: int, batch_size: int, device: torch.device, rank: int, world: int):
        self.data, self.split, self.seed, self.batch_size = data, split, seed, batch_size
        self.device, self.rank, self.world = device, rank, world
        self.copier = torch.cuda.Stream(device) if device.type == "cuda" else None

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        from aiperf_core.data import dali

        device_id = self.device.index if self.device.type == "cuda" else None
        for batch in dali.iterate(self.data, self.split, epoch, self.seed, self.batch_size, self.rank, self.world,
                                  device_id=device_id):
            y = torch.from_numpy(np.asarray(batch.y, np.int64))
            if self.copier is None:
                yield DeviceBatch(torch.from_numpy(np.asarray(batch.x)), y, batch.size, batch.skipped)
                continue
            # DALI reuses its output buffer when the next batch is drawn, and writes it on its own
            # stream: copy it on the device now, on a side stream (not behind the queued steps),
            # and wait for that copy only.
            with torch.cuda.stream(self.copier):
                if len(batch.y):
                    x = torch.from_dlpack(batch.x).clone()
                else:
                    x = torch.empty((0,) + tuple(self.data.image_shape), dtype=torch.uint8, device=self.device)
                yd = y.to(self.device, non_blocking=False)
            self.copier.synchronize()
            yield DeviceBatch(x, yd, batch.size, batch.skipped)


def ahead_to_device(host_batches: Iterable[DeviceBatch], device: torch.device) -> Iterator[DeviceBatch]:
    """The batches on `device`. On CUDA each batch's copy is issued on a side stream before the
    previous batch is handed out (so it overlaps that batch's step; pinned sources copy
    asynchronously), and the compute stream waits for the copy only when it gets the batch."""
    if device.type != "cuda":
        for b in host_batches:
            yield DeviceBatch(b.x.to(device), b.y.to(device), b.size, b.skipped)
        return
    side = torch.cuda.Stream(device)

    def issue(b: DeviceBatch):
        with torch.cuda.stream(side):
            x, y = b.x.to(device, non_blocking=True), b.y.to(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        return DeviceBatch(x, y, b.size, b.skipped), done

    pending = None
    for b in host_batches:
        issued = issue(b)
        if pending is not None:
            yield _handed_over(*pending, device)
        pending = issued
    if pending is not None:
        yield _handed_over(*pending, device)


def _handed_over(batch: DeviceBatch, done, device) -> DeviceBatch:
    compute = torch.cuda.current_stream(device)
    compute.wait_event(done)
    # The copies' memory was allocated on the side stream: tell the caching allocator that the
    # compute stream uses it, so it is not reused before the step that reads it has run.
    batch.x.record_stream(compute)
    batch.y.record_stream(compute)
    return batch


# -- which feed --------------------------------------------------------------------------------------

SYNTHETIC, DALI_FEED, NVJPEG, LOADER, ARRAYS, TOKENS = "synthetic", "dali", "nvjpeg", "loader", "arrays", "tokens"


def feed_kind(data, device: torch.device) -> str:
    """Which feed trains on `data` on `device`: in-memory arrays, streamed text, synthetic data on
    the device, DALI where the run asked for it, nvJPEG on CUDA where torchvision has it, else the
    DataLoader."""
    if not is_streaming(data):
        return ARRAYS
    if is_token_stream(data):
        return TOKENS
    from aiperf_core.data.stream import DALI
    from aiperf_core.data.synthetic import is_synthetic

    if is_synthetic(data):
        return SYNTHETIC
    if getattr(data, "loader", None) == DALI:
        return DALI_FEED
    from aiperf_backends.torch import nvjpeg

    if device.type == "cuda" and nvjpeg.available():
        return NVJPEG
    return LOADER


def open_feeds(data, config, device: torch.device, val_batch: int, rank: int = 0, world: int = 1) -> tuple[Feed, Feed]:
    """(training feed, validation feed) of `data` for this rank."""
    from aiperf_core.data.stream import TRAIN, VAL

    kind = feed_kind(data, device)
    if kind == ARRAYS:
        return (ArrayFeed(data.x_train, data.y_train, device, config.batch_size, config.seed, rank, world),
                ArrayFeed(data.x_val, data.y_val, device, val_batch, None, rank, world))
    if kind == TOKENS:
        return (TokenFeed(data, TRAIN, config.seed, config.batch_size, device, rank, world),
                TokenFeed(data, VAL, 0, val_batch, device, rank, world))
    if kind == SYNTHETIC:
        pool = synthetic_pool(data, max(config.batch_size, val_batch), device)
        return (SyntheticFeed(data, TRAIN, pool, config.batch_size, rank, world),
                SyntheticFeed(data, VAL, pool, val_batch, rank, world))
    if kind == DALI_FEED:
        return (DaliFeed(data, TRAIN, config.seed, config.batch_size, device, rank, world),
                DaliFeed(data, VAL, 0, val_batch, device, rank, world))
    if kind == NVJPEG:
        from aiperf_backends.torch.nvjpeg import NvjpegFeed

        return (NvjpegFeed(data, TRAIN, config.seed, config.batch_size, device, rank, world),
                NvjpegFeed(data, VAL, 0, val_batch, device, rank, world))
    return (LoaderFeed(data, TRAIN, config.seed, config.batch_size, device, rank, world),
            LoaderFeed(data, VAL, 0, val_batch, device, rank, world))
