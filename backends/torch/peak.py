"""Dense matrix-multiply timing on torch, for `aiperf peak` (Backend.matmul_seconds).

The precision means what it means in training (precision.py): fp32 holds every fp32 switch to IEEE
fp32 (cuBLAS on CUDA 8.0+ and oneDNN on CPUs would otherwise be free to use TF32 or bf16), tf32
lets cuBLAS use TF32 tensor cores, bf16 and fp16 multiply matrices stored in that dtype (cuBLAS and
oneDNN accumulate in fp32). CUDA launches are asynchronous, so the device is synchronised before
each clock reading.
"""

from __future__ import annotations

import time

from aiperf_core.backend import BackendError, matmul_shape


def matmul_seconds(device: str, precision: str, size: int | tuple[int, int, int], repeats: int) -> list[float]:
    """Backend.matmul_seconds: `size` a square side n or a shape (m, k, n)."""
    from aiperf_backends.torch.backend import _torch
    from aiperf_backends.torch.precision import compute_dtype, float32_math

    torch = _torch()
    if precision not in ("fp32", "tf32", "bf16", "fp16"):
        raise BackendError(f"backend torch cannot multiply matrices at precision '{precision}'")
    m, k, n = matmul_shape(size)
    dev = torch.device(device)

    def synchronise() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    generator = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(m, k, device=dev, generator=generator).to(compute_dtype(precision))
    b = torch.randn(k, n, device=dev, generator=generator).to(compute_dtype(precision))
    out = torch.empty(m, n, device=dev, dtype=a.dtype)
    seconds = []
    with torch.no_grad(), float32_math(dev, tf32=precision == "tf32"):
        torch.mm(a, b, out=out)  # warm-up: library handles, kernel selection, first-touch pages
        synchronise()
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            synchronise()
            seconds.append(time.perf_counter() - start)
    return seconds
