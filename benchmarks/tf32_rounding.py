"""What TF32 arithmetic does to the kit's training-gradient check, measured on any CPU.

The kit's `train/gradients_match_reference` compares a backend's gradients of the small ResNet in
training mode with the float64 NumPy reference. At tf32 its tolerance (`train_grad`, in
conformance/defaults.json) must hold what a correct TF32 backend measures, and on the first GPU
run (an H200, 2026-11-26) torch measured 6u and jax 242u (u = 2^-11, tf32's unit roundoff).

This script runs that check with the jax backend on the CPU, with TF32's rounding emulated: every
convolution's and dense layer's two inputs rounded to 10 mantissa bits (round to nearest even,
accumulation in float32, as tensor cores do), in the forward pass only, the backward pass only, or
both. It prints each error in units of u beside the tf32 tolerance, so that the tolerance can be
checked against TF32's own arithmetic rather than against one GPU's choice of kernels (cuDNN runs
many small convolutions in plain fp32 even where TF32 is allowed).

Goal: each error below the tf32 tolerance.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import report  # noqa: E402

U_TF32 = 2.0 ** -11
SCOPES = ("backward", "forward", "both")


def emulate(scope: str) -> None:
    """Patch jax's lowering so that conv2d and dense round their inputs like TF32 in `scope`."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import aiperf_backends.jax.lowering as lowering

    def tf32(x):
        bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
        lsb = (bits >> 13) & jnp.uint32(1)
        bits = (bits + jnp.uint32(0xFFF) + lsb) & jnp.uint32(0xFFFFE000)
        return lax.bitcast_convert_type(bits, jnp.float32)

    keep = lambda x: x  # noqa: E731
    in_forward = tf32 if scope in ("forward", "both") else keep
    in_backward = tf32 if scope in ("backward", "both") else keep

    def rounded(op):
        @jax.custom_vjp
        def f(x, w):
            return op(in_forward(x), in_forward(w))

        def forward(x, w):
            return f(x, w), (x, w)

        def backward(saved, g):
            x, w = saved
            return jax.vjp(op, in_backward(x), in_backward(w))[1](in_backward(g))

        f.defvjp(forward, backward)
        return f

    conv2d, dense = lowering.conv2d, lowering.dense
    lowering.conv2d = lambda x, kernel, attrs, precision="fp32": rounded(
        lambda a, b: conv2d(a, b, attrs, "fp32"))(x, kernel)
    lowering.dense = lambda x, kernel, precision="fp32": rounded(lambda a, b: dense(a, b, "fp32"))(x, kernel)


def child(scope: str) -> int:
    emulate(scope)
    from aiperf_core.cli import main

    return main(["conformance", "--backend", "jax", "--level", "train", "--precision", "fp32", "--json"])


def measured(scope: str) -> float:
    done = subprocess.run([sys.executable, __file__, "--child", scope], capture_output=True, text=True)
    try:
        checks = json.loads(done.stdout)["checks"]
    except (ValueError, KeyError):
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"{scope}: the kit printed no report (exit {done.returncode}): {tail[0]}") from None
    check = next(c for c in checks if c["id"] == "train/gradients_match_reference")
    if not isinstance(check["measured"], float):
        raise SystemExit(f"{scope}: the check measured no gradient error: {check['message']}")
    return check["measured"]


def main() -> None:
    from aiperf_conformance.expectations import load_expectations

    tolerance = load_expectations("jax").tolerance("train_grad", "tf32")
    print(f"# the jax backend on the CPU, TF32 rounding emulated; tf32 train_grad tolerance {tolerance:g} "
          f"= {tolerance / U_TF32:.0f}u")
    for scope in SCOPES:
        error = measured(scope)
        where = "both passes" if scope == "both" else f"the {scope} pass"
        report(f"train_grad error, TF32 rounding in {where}", error / U_TF32, "u", tolerance / U_TF32)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2]))
    main()
