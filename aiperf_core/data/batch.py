"""The two splits, and the Batch every input pipeline yields: a rank's shard of a global batch.

The host pipeline (aiperf_core.data.stream) and DALI's (aiperf_core.data.dali) both build on this
module; stream dispatches to dali for `data_loader = "dali"`, and dali needs none of stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from aiperf_core.errors import AiperfError

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise AiperfError(f"unknown split {split!r} (choose from {', '.join(SPLITS)})")
    return split


@dataclass
class Batch:
    """A (shard of a) batch. `size` is the number of images the global batch asked for; x and y
    hold this shard's images that decoded (x: uint8 NHWC pixels from a StreamingDataset, float32
    normalised arrays from an in-memory Dataset); `skipped` counts this shard's images that did not."""

    x: np.ndarray
    y: np.ndarray
    size: int
    skipped: int = 0
    corrupt: list[str] = field(default_factory=list)


def shard(indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """The rank's contiguous part of a global batch."""
    return np.array_split(indices, world)[rank] if world > 1 else indices
