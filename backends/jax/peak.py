"""Dense matrix-multiply timing on jax (XLA), for `aiperf peak` (Backend.matmul_seconds).

The precision means what it means in training (lowering.py): fp32 is a float32 dot at
Precision.HIGHEST (IEEE products; XLA would otherwise use TF32 on CUDA 8.0+), tf32 a float32 dot at
Precision.DEFAULT, bf16 and fp16 a dot of inputs stored in that dtype (XLA's default accumulation).
jax dispatches asynchronously, so each repeat waits for its result (block_until_ready).
"""

from __future__ import annotations

import functools
import time

from aiperf_core.backend import BackendError, matmul_shape


@functools.lru_cache(maxsize=None)
def _product(precision: str):
    """The jitted product at `precision`, one per process: a caller timing one product at a time
    (benchmarks/transformer_step.py, between its steps) compiles each shape once, not per call."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import lax_precision

    return jax.jit(lambda a, b: jnp.matmul(a, b, precision=lax_precision(precision)))


def matmul_seconds(device: str, precision: str, size: int | tuple[int, int, int], repeats: int) -> list[float]:
    """Backend.matmul_seconds: `size` a square side n or a shape (m, k, n)."""
    from aiperf_backends.jax.backend import initialise
    from aiperf_backends.jax.distributed import local_device
    from aiperf_backends.jax.lowering import compute_dtype

    jax = initialise()
    import jax.numpy as jnp

    if precision not in ("fp32", "tf32", "bf16", "fp16"):
        raise BackendError(f"backend jax cannot multiply matrices at precision '{precision}'")
    m, k, n = matmul_shape(size)
    dtype = compute_dtype(precision) or jnp.float32
    target = local_device(device)
    product = _product(precision)
    key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
    with jax.default_device(target):
        a = jax.device_put(jax.random.normal(key_a, (m, k), jnp.float32).astype(dtype), target)
        b = jax.device_put(jax.random.normal(key_b, (k, n), jnp.float32).astype(dtype), target)
    a.block_until_ready()
    b.block_until_ready()
    product(a, b).block_until_ready()  # warm-up: compilation and the first run
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        seconds.append(time.perf_counter() - start)
    return seconds
