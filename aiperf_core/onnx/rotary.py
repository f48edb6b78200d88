"""The IR rotary's cos and sin tables: written by export (RotaryEmbedding's caches) and read back by import,
whose base the tables give (ONNX's RotaryEmbedding, or a rotary embedding written out)."""

from __future__ import annotations

import math

import numpy as np


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """The IR rotary's cos and sin tables (S, head_dim / 2) as float32: the angles position * base^(-2i /
    head_dim) and their cos and sin are computed in float64 (as the NumPy reference does), then rounded."""
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    theta = positions * float(base) ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rotary_base(cos: np.ndarray, sin: np.ndarray, head_dim: int) -> float | None:
    """The base of rotary tables cos and sin (S, head_dim / 2) of positions 0 to S - 1, or None when no base
    gives them: the shortest decimal whose rotary_tables equal them within float32 rounding of the angles.

    The estimate reads the slowest pair's angle at position 1, base^(-(head_dim - 2) / head_dim), whose sine
    is small and exact to float32's relative precision. Where no angle depends on the base (head_dim 2, or
    one position) the IR's default, 10000, stands for any."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    seq_len = cos.shape[0]
    # An angle computed in float32 (as the exporters' models do) is off by a few ulps of position * 1.
    tolerance = 1e-6 + 4e-7 * seq_len
    candidates = [10000.0]
    if seq_len > 1 and head_dim > 2:
        slowest = math.atan2(sin[1, -1], cos[1, -1])
        if not 0.0 < slowest < 1.0:
            return None
        estimate = slowest ** (-head_dim / (head_dim - 2))
        candidates = [float(f"{estimate:.{digits}g}") for digits in range(1, 10)] + [estimate]
    for base in candidates:
        if base < 1.0:
            continue
        want_cos, want_sin = rotary_tables(seq_len, head_dim, base)
        if np.abs(want_cos - cos).max() <= tolerance and np.abs(want_sin - sin).max() <= tolerance:
            return base
    return None
