"""Streaming datasets: images decoded and augmented batch by batch while the model trains.

`ImageSource` says where the images are (counts, labels, the encoded bytes of image i of a split).
`StreamingDataset` wraps a source with the settings of one training run (resolution, data
workers) and cuts epochs into batches:

- An epoch is one pass over the training split by the replica, in the order
  np.random.default_rng(seed + epoch).permutation(n) (the same rule as for in-memory arrays; the
  workflow seeds each replica differently, so replicas read different files at any moment), in
  global batches of batch_size, the last one short.
- Each device of the replica reads a distinct, contiguous shard of every global batch
  (np.array_split(batch, world)[rank]): the shards of a batch partition it.
- An image that cannot be decoded is skipped and counted (Batch.skipped); it never stops an epoch.
  A batch therefore holds the images that did decode: the images processed are counted exactly.

`iterate` is the shared threaded pipeline (used by the NumPy and JAX backends and by any backend
without a native one): whole batches are decoded by `workers` threads, up to `workers + prefetch`
batches ahead of the consumer. Pillow releases the GIL while it decodes and resizes, so threads
scale. Framework pipelines (tf.data, torch's DataLoader) call `plan` and `load` instead.
"""

from __future__ import annotations

import abc
import logging
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from aiperf_core.data.preprocess import CorruptImage, augmentation_rng, train_image, val_image
from aiperf_core.errors import AiperfError

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)
DEFAULT_PREFETCH = 2
log = logging.getLogger("aiperf.data")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise AiperfError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    return split


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

    def example(self, split: str, index: int, size: int, seed: int, epoch: int,
                out: np.ndarray | None = None) -> np.ndarray:
        """Image `index` decoded and preprocessed: float32 size x size x 3, written into `out` when
        given; raises CorruptImage."""
        where = self.where(split, index)
        data = self.encoded(split, index)
        if split == TRAIN:
            return train_image(data, size, augmentation_rng(seed, epoch, index), where, out)
        return val_image(data, size, where, out)


@dataclass
class Batch:
    """A (shard of a) batch. `size` is the number of images the global batch asked for; x and y
    hold this shard's images that decoded; `skipped` counts this shard's images that did not."""

    x: np.ndarray
    y: np.ndarray
    size: int
    skipped: int = 0
    corrupt: list[str] = field(default_factory=list)


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The rank's contiguous part of a global batch."""
    return np.array_split(indices, world)[rank] if world > 1 else indices


def prefetch_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int,
                 prefetch: int = DEFAULT_PREFETCH) -> Iterator[Any]:
    """fn(item) for each item, in order, computed by `workers` threads up to workers + prefetch
    items ahead; with workers < 1, inline. Closing the iterator cancels the work not started."""
    if workers < 1:
        for item in items:
            yield fn(item)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="aiperf-data")
    pending: deque = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= workers + prefetch:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class StreamingDataset:
    """A source plus the run's input settings; what a backend's train() accepts besides Dataset."""

    def __init__(self, source: ImageSource, image_size: int = 224, workers: int = 1,
                 prefetch: int = DEFAULT_PREFETCH):
        if workers < 0:
            raise AiperfError(f"data workers must be >= 0, got {workers}")
        self.source = source
        self.image_size = int(image_size)
        self.workers = int(workers)
        self.prefetch = int(prefetch)

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
                "image_size": self.image_size}

    # -- epochs -----------------------------------------------------------------------------------
    def plan(self, split: str, epoch: int, seed: int, batch_size: int) -> list[np.ndarray]:
        """The global batches of an epoch, as image indices: shuffled for training, in order for
        validation."""
        from aiperf_core.backend import batches

        check_split(split)
        rng = np.random.default_rng(seed + epoch) if split == TRAIN else None
        return list(batches(self.source.count(split), batch_size, rng))

    def load(self, split: str, indices: np.ndarray, epoch: int,
             seed: int) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
        """(images, labels, skipped, names of the skipped) for the given indices; images that do
        not decode are left out."""
        labels = self.source.labels(split)
        indices = np.asarray(indices, dtype=np.int64)
        x = np.empty((len(indices),) + self.image_shape, np.float32)  # each image is written in place
        kept, corrupt = [], []
        for index in indices:
            try:
                self.source.example(split, int(index), self.image_size, seed, epoch, out=x[len(kept)])
                kept.append(labels[index])
            except CorruptImage as exc:
                corrupt.append(str(exc))
        if corrupt:
            log.warning("skipped %d corrupt image(s): %s", len(corrupt), "; ".join(corrupt[:3]))
        return x[:len(kept)], np.asarray(kept, dtype=np.int64), len(corrupt), corrupt

    def iterate(self, split: str, epoch: int, seed: int, batch_size: int, rank: int = 0,
                world: int = 1) -> Iterator[Batch]:
        """This rank's shard of every batch of the epoch, decoded by the threaded pipeline."""

        def load(global_batch: np.ndarray) -> Batch:
            x, y, skipped, corrupt = self.load(split, shard(global_batch, rank, world), epoch, seed)
            return Batch(x, y, len(global_batch), skipped, corrupt)

        return prefetch_map(load, self.plan(split, epoch, seed, batch_size), self.workers, self.prefetch)


# -- one epoch's batches, for in-memory and streamed data alike -----------------------------------


def train_batches(data, epoch: int, seed: int, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
    """This rank's shard of every training batch of the epoch. For a Dataset (in-memory arrays)
    the order is the same rule as the stream's, np.random.default_rng(seed + epoch), and nothing is
    ever skipped."""
    if isinstance(data, StreamingDataset):
        yield from data.iterate(TRAIN, epoch, seed, batch_size, rank, world)
        return
    from aiperf_core.backend import batches

    for idx in batches(len(data.y_train), batch_size, np.random.default_rng(seed + epoch)):
        part = shard(idx, rank, world)
        yield Batch(data.x_train[part], data.y_train[part], len(idx))


def val_batches(data, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Batch]:
    """The validation set in order, in batches of batch_size (this rank's shard of each)."""
    if isinstance(data, StreamingDataset):
        yield from data.iterate(VAL, 0, 0, batch_size, rank, world)
        return
    from aiperf_core.backend import batches

    for idx in batches(len(data.y_val), batch_size):
        part = shard(idx, rank, world)
        yield Batch(data.x_val[part], data.y_val[part], len(idx))
