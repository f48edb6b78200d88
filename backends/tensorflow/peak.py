"""Dense matrix-multiply timing on TensorFlow, for `aiperf peak` (Backend.matmul_seconds).

The precision means what it means in training (lowering.py): the product runs inside
precision_scope, which turns TF32 execution off for fp32 (IEEE products; cuBLAS would otherwise use
TF32 on CUDA 8.0+) and on for tf32; bf16 and fp16 multiply matrices stored in that dtype (oneDNN and
cuBLAS accumulate in fp32). Eager GPU ops return before the device finishes, so every device is
synchronised before each clock reading.
"""

from __future__ import annotations

import time

from aiperf_core.backend import BackendError, matmul_shape


def matmul_seconds(device: str, precision: str, size: int | tuple[int, int, int], repeats: int) -> list[float]:
    """Backend.matmul_seconds: `size` a square side n or a shape (m, k, n)."""
    from aiperf_backends.tensorflow.backend import framework, tf_device_name

    tf = framework()
    from aiperf_backends.tensorflow.lowering import COMPUTE_DTYPES, precision_scope

    if precision not in COMPUTE_DTYPES:
        raise BackendError(f"backend tensorflow cannot multiply matrices at precision '{precision}'")
    m, k, n = matmul_shape(size)
    synchronise = tf.test.experimental.sync_devices
    seconds = []
    with tf.device(tf_device_name(device)), precision_scope(precision):
        a = tf.cast(tf.random.stateless_normal((m, k), seed=(0, 0)), COMPUTE_DTYPES[precision])
        b = tf.cast(tf.random.stateless_normal((k, n), seed=(0, 1)), COMPUTE_DTYPES[precision])
        tf.linalg.matmul(a, b)  # warm-up: library handles, kernel selection, first-touch pages
        synchronise()
        for _ in range(repeats):
            start = time.perf_counter()
            tf.linalg.matmul(a, b)
            synchronise()
            seconds.append(time.perf_counter() - start)
    return seconds
