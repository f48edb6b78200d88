"""Dense matrix-multiply timing on MindSpore, for `aiperf peak` (Backend.matmul_seconds).

PyNative, as training runs (backend.py). fp32, bf16 and fp16 multiply matrices stored in that
dtype (MindSpore's default accumulation); tf32 is a CUDA precision this backend never declares.
MindSpore binds one accelerator per process, so only a device this process computes on can be
timed. PyNative ops run asynchronously (on a CPU too), so each repeat waits for its result: the
accelerator's streams are synchronised, or on a CPU the result (Tensor.data_sync).
"""

from __future__ import annotations

import time

import numpy as np

from aiperf_core.backend import BackendError, matmul_shape


def matmul_seconds(device: str, precision: str, size: int | tuple[int, int, int], repeats: int) -> list[float]:
    """Backend.matmul_seconds: `size` a square side n or a shape (m, k, n)."""
    from aiperf_backends.mindspore.backend import _ms, runs_in_this_process

    ms = _ms()
    from mindspore import Tensor, ops

    from aiperf_backends.mindspore.lowering import COMPUTE_DTYPES

    if precision not in COMPUTE_DTYPES:
        raise BackendError(f"backend mindspore cannot multiply matrices at precision '{precision}'")
    if not runs_in_this_process(device):
        raise BackendError(f"backend mindspore can time matrix products only on the device this process is "
                           f"bound to ({ms.get_context('device_target')}:{ms.get_context('device_id')}), not {device}")
    m, k, n = matmul_shape(size)
    rng = np.random.default_rng(0)
    a = Tensor(rng.standard_normal((m, k), dtype=np.float32)).astype(COMPUTE_DTYPES[precision])
    b = Tensor(rng.standard_normal((k, n), dtype=np.float32)).astype(COMPUTE_DTYPES[precision])
    if ms.get_context("device_target") == "CPU":  # runtime.synchronize() is for accelerators only
        def synchronise(result) -> None:
            result.data_sync(True)
    else:
        def synchronise(result) -> None:
            ms.runtime.synchronize()
    synchronise(ops.matmul(a, b))  # warm-up: moves the inputs to the device, selects the kernel
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        synchronise(ops.matmul(a, b))
        seconds.append(time.perf_counter() - start)
    return seconds
