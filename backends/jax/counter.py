"""Native op counter: XLA's own cost analysis (``jax.jit(f).lower(...).compile().cost_analysis()``).

XLA's HloCostAnalysis counts a convolution as 2 FLOPs per multiply-accumulate over the kernel taps
that land on real input only (taps on padding are skipped: the 'valid' convention; verified
against opcount's 'valid' rule on strided, asymmetric and 7x7 cases), and a dot as 2 * M * N * K.
Transcendentals (exp, log, rsqrt) are reported separately ('transcendentals') and elementwise ops
count 1 FLOP per element, so the whole-model total mixes categories. To attribute exactly, the
counter compiles the very ops the lowering runs, one node at a time, with the node's shapes at
the requested batch:

* conv:  forward ``lax.conv_general_dilated`` as lowered (no bias); backward the VJP of that conv
  w.r.t. the kernel, and w.r.t. the input unless only parameter-free nodes lie upstream (then no
  input gradient is needed, as the analytic rule says);
* dense: the matmul ``x @ kernel`` (no bias) and its VJP likewise.

Bias additions, normalisation, activations, pooling and softmax are not attributed, so only
'conv' and 'dense' are covered. The weight update is not counted. Compiled costs are cached per
(op, shapes, attributes), so counting many similar graphs (morphs) is cheap.

The functions are always compiled for the CPU client of this process (`counting_device`), whatever
device trains: on a GPU, XLA hands convolutions to cuDNN as custom calls, whose cost analysis is
-1 each (issue 15: 'native -53' for a ResNet's convolutions on an H100). The operations of a conv
or a dot do not depend on the device that runs it, so the CPU's analysis counts the GPU's work. A
count <= 0 for a node, which always has operations, is an error that names the node: it is never
reported as a count. Where jax has no CPU client (JAX_PLATFORMS without 'cpu'), the backend
declares no native counter.
"""

from __future__ import annotations

from typing import Any

from aiperf_core.backend import BackendError, CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="valid",
    covers=("conv", "dense"),
    includes_update=False,
    notes=("XLA HloCostAnalysis via jax .lower().compile().cost_analysis(), per conv/dense node: 2 FLOPs per MAC, "
           "only taps on real input (padding skipped); transcendentals are reported separately by XLA and not "
           "attributed; bias, normalisation, activation, pooling and softmax are not counted; the backward count "
           "has no weight update"),
)

_CACHE: dict[tuple, int] = {}


def counting_device():
    """The first device of jax's CPU client, where every count is compiled; None without one."""
    import jax

    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS left the CPU platform out
        return None


def compiled_for_counting(fn, *shapes):
    """`fn` on float32 arguments of `shapes`, compiled for the counting device (not jax's default)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    device = counting_device()
    if device is None:
        raise BackendError("the jax native counter needs jax's CPU client (JAX_PLATFORMS leaves out 'cpu')")
    sharding = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]
    return jax.jit(fn).lower(*args).compile()


def cost_analysis(fn, *shapes) -> dict:
    """XLA's cost analysis of `fn` compiled for the counting device."""
    cost = compiled_for_counting(fn, *shapes).cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
        cost = cost[0] if cost else {}
    return cost


def _flops(fn, *shapes) -> int:
    return int(round(float(cost_analysis(fn, *shapes).get("flops", 0.0))))


def _node_flops(node_id: str, op: str, in_shape: tuple, kernel_shape: tuple, attrs: Any, backward: bool,
                input_grad: bool) -> int:
    import jax

    from aiperf_backends.jax.lowering import conv2d, dense

    frozen = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(attrs).items()))
    key = (op, in_shape, kernel_shape, frozen, backward, input_grad)
    if key in _CACHE:
        return _CACHE[key]

    def forward(x, k):
        return conv2d(x, k, attrs) if op == "conv2d" else dense(x, k)

    parts = {"forward": _flops(forward, in_shape, kernel_shape)}
    if backward:
        out_shape = jax.eval_shape(forward, jax.ShapeDtypeStruct(in_shape, "float32"),
                                   jax.ShapeDtypeStruct(kernel_shape, "float32")).shape

        if input_grad:
            def grads(x, k, dy):
                return jax.vjp(forward, x, k)[1](dy)
        else:
            def grads(x, k, dy):
                return jax.vjp(lambda kk: forward(x, kk), k)[1](dy)

        parts["backward"] = _flops(grads, in_shape, kernel_shape, out_shape)
    for part, flops in parts.items():
        if flops <= 0:  # a conv or dense node always has operations
            raise BackendError(f"jax native counter: XLA's cost analysis gave {flops} FLOPs for the {part} pass of "
                               f"node '{node_id}' ({op}, input {list(in_shape)}); not a count")
    _CACHE[key] = total = sum(parts.values())
    return total


class XlaCostCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        graph = model.graph
        out = {"conv": 0, "dense": 0, "other": 0}
        for node, up in self.counted_nodes(graph, backward):
            in_shape = (batch,) + tuple(graph.shapes[node.inputs[0]])
            kernel_shape = tuple(graph.all_param_shapes()[node.id]["kernel"])
            flops = _node_flops(node.id, node.op, in_shape, kernel_shape, node.attrs, backward, input_grad=up)
            out["conv" if node.op == "conv2d" else "dense"] += flops
        return out
