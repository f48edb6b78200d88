"""Synthetic ImageNet-shaped data, for measuring throughput only: a run on it is never scored valid.

The data is a small pool of POOL random uint8 images at the run's resolution, each with a random
class, deterministic in the seed (fresh noise per image would cost more than decoding a JPEG and
measure the generator, not the system). Image i of either split is pool image i % POOL, with its
label; epochs read the splits in order (shuffling a cycle of random images changes nothing that is
measured), so every global batch is a run of consecutive pool positions.

On the device (the contract a backend implements for `--data synthetic`): upload `device_pool(data,
batch_size)` once, the pool repeated to POOL + batch_size - 1 images, so that every shard of every
batch is one contiguous window of it; then each step trains on `pixels[w.offset:w.offset + w.length]`
and `labels[...]` for the windows of `windows(...)`: a slice of device memory, no host work per step.
The windows give exactly the batches `StreamingDataset.iterate` gives on the host (tested), so the
two paths train on the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from aiperf_core.data.stream import TRAIN, VAL, ImageSource, check_split, shard
from aiperf_core.errors import AiperfError

NAME = "synthetic"
IMAGENET_CLASSES = 1000
IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_VAL_IMAGES = 50_000
POOL = 64


class SyntheticSource(ImageSource):
    name = NAME
    layout = "generated"
    shuffled = False

    def __init__(self, classes: int = IMAGENET_CLASSES, train_images: int = IMAGENET_TRAIN_IMAGES,
                 val_images: int = IMAGENET_VAL_IMAGES, seed: int = 0):
        for what, value in (("classes", classes), ("train_images", train_images), ("val_images", val_images)):
            if int(value) < 1:
                raise AiperfError(f"dataset.{what}: must be >= 1 for synthetic data, got {value}")
        self.class_names = tuple(str(c) for c in range(classes))
        self.seed = seed
        self.pool_labels = np.random.default_rng(seed).integers(0, classes, POOL).astype(np.int64)
        self._counts = {TRAIN: int(train_images), VAL: int(val_images)}
        self._pool: dict[int, np.ndarray] = {}

    def count(self, split: str) -> int:
        return self._counts[check_split(split)]

    def labels(self, split: str) -> np.ndarray:
        return self.pool_labels[np.arange(self.count(split)) % POOL]

    def encoded(self, split: str, index: int) -> bytes:
        raise AiperfError("synthetic images are generated, not stored")

    def pool(self, size: int) -> np.ndarray:
        """The POOL images at size x size: uint8 (POOL, size, size, 3), made once per size."""
        if size not in self._pool:
            rng = np.random.default_rng([self.seed, size])
            self._pool[size] = rng.integers(0, 256, (POOL, size, size, 3), dtype=np.uint8)
        return self._pool[size]

    def example(self, split: str, index: int, size: int, seed: int, epoch: int,
                out: np.ndarray | None = None) -> np.ndarray:
        image = self.pool(size)[index % POOL]
        if out is None:
            return image.copy()
        out[...] = image
        return out

    def decode_batch(self, split: str, indices: np.ndarray, size: int, seed: int,
               epoch: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
        positions = np.asarray(indices, dtype=np.int64) % POOL
        return self.pool(size)[positions], self.pool_labels[positions], []


def is_synthetic(data) -> bool:
    """Whether `data` is a StreamingDataset of synthetic images (to be made on the device)."""
    return isinstance(getattr(data, "source", None), SyntheticSource)


@dataclass(frozen=True)
class DevicePool:
    """What a backend uploads once: every shard of a batch of at most `batch_size` images is the
    window pixels[offset:offset + length] (labels likewise)."""

    pixels: np.ndarray  # uint8 (POOL + batch_size - 1, size, size, 3): pool image j % POOL at j
    labels: np.ndarray  # int64 (POOL + batch_size - 1,)
    batch_size: int


@dataclass(frozen=True)
class Window:
    """This rank's shard of one global batch: pool positions offset .. offset + length - 1, of a
    global batch that asked for `size` images (Batch.size)."""

    offset: int
    length: int
    size: int


def device_pool(data, batch_size: int) -> DevicePool:
    """The repeated pool of a synthetic StreamingDataset, for windows of up to `batch_size` images
    (the largest batch the backend slices: its training and its prediction batch)."""
    if not is_synthetic(data):
        raise AiperfError("device_pool: the dataset is not synthetic")
    if batch_size < 1:
        raise AiperfError(f"device_pool: batch_size must be >= 1, got {batch_size}")
    positions = np.arange(POOL + batch_size - 1) % POOL
    return DevicePool(data.source.pool(data.image_size)[positions], data.source.pool_labels[positions], batch_size)


def windows(data, split: str, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Window]:
    """This rank's window of every global batch of an epoch of `split` (the same for every epoch),
    in the order and with the sharding of StreamingDataset.iterate."""
    if not is_synthetic(data):
        raise AiperfError("windows: the dataset is not synthetic")
    for batch in data.plan(split, 0, 0, batch_size):
        part = shard(batch, rank, world)
        start = int(part[0]) if len(part) else 0
        yield Window(start % POOL, len(part), len(batch))
