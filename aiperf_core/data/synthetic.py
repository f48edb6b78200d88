"""Synthetic ImageNet-shaped data, for measuring throughput only: a run on it is never scored valid.

Images are drawn from a small pool of normalised random images generated once (generating fresh
noise per image would cost more than decoding a JPEG and measure the generator, not the system);
labels are uniform random classes. Everything is deterministic in the seed.
"""

from __future__ import annotations

import numpy as np

from aiperf_core.data.stream import TRAIN, ImageSource
from aiperf_core.errors import AiperfError

NAME = "synthetic"
IMAGENET_CLASSES = 1000
IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_VAL_IMAGES = 50_000
POOL = 64


class SyntheticSource(ImageSource):
    name = NAME
    layout = "generated"

    def __init__(self, classes: int = IMAGENET_CLASSES, train_images: int = IMAGENET_TRAIN_IMAGES,
                 val_images: int = IMAGENET_VAL_IMAGES, seed: int = 0):
        for what, value in (("classes", classes), ("train_images", train_images), ("val_images", val_images)):
            if int(value) < 1:
                raise AiperfError(f"dataset.{what}: must be >= 1 for synthetic data, got {value}")
        self.class_names = tuple(str(c) for c in range(classes))
        self.seed = seed
        rng = np.random.default_rng(seed)
        self._labels = {TRAIN: rng.integers(0, classes, int(train_images)),
                        "val": rng.integers(0, classes, int(val_images))}
        self._pool: dict[int, np.ndarray] = {}

    def labels(self, split: str) -> np.ndarray:
        return self._labels[split]

    def encoded(self, split: str, index: int) -> bytes:
        raise AiperfError("synthetic images are generated, not stored")

    def pool(self, size: int) -> np.ndarray:
        if size not in self._pool:
            rng = np.random.default_rng([self.seed, size])
            self._pool[size] = rng.standard_normal((POOL, size, size, 3), dtype=np.float32)
        return self._pool[size]

    def example(self, split: str, index: int, size: int, seed: int, epoch: int,
                out: np.ndarray | None = None) -> np.ndarray:
        image = self.pool(size)[(index + epoch) % POOL]
        if out is None:
            return image.copy()
        out[...] = image
        return out
