"""scikit-learn's digits (1,797 real 8x8 scans, 10 classes) as 32x32x3 images with a fixed split."""

from __future__ import annotations

import numpy as np

from aiperf_core.backend import Dataset
from aiperf_core.errors import AiperfError

NAME = "digits"
CLASSES = 10
VAL_FRACTION = 0.2
SPLIT_SEED = 20210601  # fixed: the split is part of the dataset's definition


def load_digits(size: int = 32, normalise: bool = True) -> Dataset:
    """Deterministic stratified split: 80% training, 20% validation, NHWC float32 images."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError:
        raise AiperfError("the digits dataset needs scikit-learn: pip install 'aiperf[search]'") from None
    if size < 8 or size % 8:
        raise AiperfError(f"digits size must be a multiple of 8 and at least 8, got {size}")
    bunch = sk_load_digits()
    images = bunch.images.astype(np.float32) / 16.0  # pixel values are 0..16
    labels = bunch.target.astype(np.int64)
    factor = size // 8
    images = np.repeat(np.repeat(images, factor, axis=1), factor, axis=2)
    images = np.repeat(images[..., None], 3, axis=3)
    if normalise:
        images = (images - images.mean()) / images.std()
    rng = np.random.default_rng(SPLIT_SEED)
    val_idx = []
    for c in range(CLASSES):
        members = np.flatnonzero(labels == c)
        val_idx.extend(rng.choice(members, size=int(round(len(members) * VAL_FRACTION)), replace=False))
    val_mask = np.zeros(len(labels), bool)
    val_mask[val_idx] = True
    return Dataset(images[~val_mask], labels[~val_mask], images[val_mask], labels[val_mask], CLASSES)
