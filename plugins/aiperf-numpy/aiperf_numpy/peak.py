"""Dense matrix-multiply timing on NumPy, for `aiperf peak` (Backend.matmul_seconds).

NumPy's float32 matmul is the BLAS it was built with (sgemm): IEEE fp32, synchronous, on the host
CPU with the BLAS's own threads. fp32 is the only precision this backend declares.
"""

from __future__ import annotations

import time

import numpy as np

from aiperf_core.backend import BackendError, matmul_shape


def matmul_seconds(device: str, precision: str, size: int | tuple[int, int, int], repeats: int) -> list[float]:
    """Backend.matmul_seconds: `size` a square side n or a shape (m, k, n)."""
    if precision != "fp32":
        raise BackendError(f"backend numpy cannot multiply matrices at precision '{precision}'")
    m, k, n = matmul_shape(size)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)
    np.matmul(a, b, out=out)  # warm-up: BLAS threads, first-touch pages
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        seconds.append(time.perf_counter() - start)
    return seconds
