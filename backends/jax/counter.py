"""Native op counter: XLA's own cost analysis (``jax.jit(f).lower(...).compile().cost_analysis()``).

XLA's HloCostAnalysis counts a convolution as 2 FLOPs per multiply-accumulate over the kernel taps
that land on real input only (taps on padding are skipped: the 'valid' convention; verified
against opcount's 'valid' rule on strided, asymmetric and 7x7 cases), and a dot as 2 * M * N * K
(times its batch dimensions). Transcendentals (exp, log, rsqrt) are reported separately
('transcendentals') and elementwise ops count 1 FLOP per element, so the whole-model total mixes
categories. To attribute exactly, the counter compiles the very ops the lowering runs, one node at a
time, with the node's shapes at the requested batch:

* conv:  forward ``lax.conv_general_dilated`` as lowered (no bias, its groups as
  ``feature_group_count``); backward the VJP of that conv w.r.t. the kernel, and w.r.t. the input
  unless only parameter-free nodes lie upstream (then no input gradient is needed, as the analytic
  rule says);
* dense: the matmul ``x @ kernel`` (no bias; over N * S rows of a sequence) and its VJP likewise;
* attention: the node is several ops (its two products, the scale, the mask, the softmax), so
  compiling it whole would mix categories. The counter traces the node as lowered
  (``lowering.attention``, jax.nn.dot_product_attention) to a jaxpr, takes its ``dot_general``
  equations (QK^T and PV) and compiles each alone with its own parameters: forward, the two
  products; backward, the products of the VJP's jaxpr less the forward's (the VJP's jaxpr is the
  forward followed by the transposed products: the input gradients of both products, four), and
  nothing when only data lies upstream (opcount's rule). Grouped-query attention is traced with its
  narrower key and value: jax.nn.dot_product_attention multiplies the heads / kv_heads query heads
  that share a key-value head by that head in one product, so its products hold as many
  multiply-adds as multi-head attention's with `heads` heads (opcount's rule for it). XLA lowers
  the causal mask as a select over the full S x S scores, so every score is multiplied and counted,
  masked or not: attention is counted in the paper convention (``CONVENTION.attention``), whatever
  the padding convention of the convolutions.

* moe: as attention, the node is traced as lowered (``lowering.mixture_of_experts``, routed) and its
  products compiled alone: forward the router's and the expert tiles'; backward the VJP's less the
  forward's (the input gradients only when a trained parameter lies upstream). The tiles run in a
  ``lax.scan``, whose body XLA's analysis of the loop counts once, so each product in a scan's body
  is counted times the scan's length: the times it runs (a ``while`` loop, of no static trip count,
  is refused). The routing, gates, biases and activations are not attributed, so 'moe' is the router's
  and chosen experts' products plus the tiles' padding rows (at most E (b - 1), `moe_tile_rows`).

Bias additions, normalisation, activations, rotary, mul, pooling, the softmax (attention's included) and the
embedding's gather are not attributed, so only 'conv', 'dense', 'attention' and 'moe' are measured. The
weight update is not counted. Compiled costs are cached per (op, shapes, attributes), so counting
many similar graphs (morphs) is cheap.

So the convention's `padding` is 'valid' (the convolutions) and its `attention` 'paper': the
conformance kit compares each covered category under the rule the counter declares for it.

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
    covers=("conv", "dense", "attention", "moe"),
    includes_update=False,
    attention="paper",
    notes=("XLA HloCostAnalysis via jax .lower().compile().cost_analysis(), per conv/dense node: 2 FLOPs per MAC, "
           "only taps on real input (padding skipped); transcendentals are reported separately by XLA and not "
           "attributed; bias, normalisation, activation, pooling and softmax are not counted; the backward count "
           "has no weight update. Attention's two products count every one of the S x S scores (the paper "
           "convention, not 'valid': XLA masks with a select after the full product). A moe node's count is its "
           "routed lowering's products (router, and the tiles of the chosen experts with their padding rows, at "
           "most E (b - 1)); its routing, gelu and gating are not counted"),
)

_CACHE: dict[tuple, int] = {}


def counting_device():
    """The first device of this process's CPU client, where every count is compiled; None without one."""
    import jax

    try:
        return jax.local_devices(backend="cpu")[0]  # across nodes, jax.devices() holds other processes' too
    except RuntimeError:  # JAX_PLATFORMS left the CPU platform out
        return None


def compiled_for_counting(fn, *shapes, dtypes=None):
    """`fn` on arguments of `shapes` (float32 unless `dtypes` says), compiled for the counting
    device (not jax's default)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    device = counting_device()
    if device is None:
        raise BackendError("the jax native counter needs jax's CPU client (JAX_PLATFORMS leaves out 'cpu')")
    sharding = SingleDeviceSharding(device)
    dtypes = dtypes or [jnp.float32] * len(shapes)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in zip(shapes, dtypes)]
    return jax.jit(fn).lower(*args).compile()


def cost_analysis(fn, *shapes, dtypes=None) -> dict:
    """XLA's cost analysis of `fn` compiled for the counting device."""
    cost = compiled_for_counting(fn, *shapes, dtypes=dtypes).cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax returned one dict per computation
        cost = cost[0] if cost else {}
    return cost


def _flops(fn, *shapes) -> int:
    return int(round(float(cost_analysis(fn, *shapes).get("flops", 0.0))))


def _flops_typed(fn, *avals) -> int:
    """_flops on arguments of the shapes and dtypes of `avals`."""
    cost = cost_analysis(fn, *(a.shape for a in avals), dtypes=[a.dtype for a in avals])
    return int(round(float(cost.get("flops", 0.0))))


def _dot_equations(jaxpr, times: int = 1):
    """(dot_general equation, how many times it runs) for each product of a jaxpr, those of its
    sub-jaxprs included (jnp.einsum is itself jitted, so its dot sits one level down), in order. A
    scan runs its body `length` times (the routed moe's tiles), so its products count that many times;
    a while loop's trip count is not static, so its products cannot be counted."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            yield eqn, times
        if eqn.primitive.name == "while":
            raise BackendError("jax native counter: a while loop's trip count is not static, so the products "
                               "in its body cannot be counted")
        runs = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, ClosedJaxpr):
                    yield from _dot_equations(sub.jaxpr, runs)
                elif isinstance(sub, Jaxpr):
                    yield from _dot_equations(sub, runs)


def _dots_flops(node_id: str, fn, *shapes) -> int:
    """XLA's FLOPs of the products `fn` traces, each dot_general compiled alone with its own operand
    shapes, dtypes and parameters, times the number of times it runs (a scan's body: XLA's analysis of
    a whole loop counts its body once); a product counted <= 0 is an error naming the node."""
    import jax

    closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(s, "float32") for s in shapes))
    total = 0
    for eqn, times in _dot_equations(closed.jaxpr):
        operands = [v.aval for v in eqn.invars]
        key = ("dot_general", tuple((a.shape, str(a.dtype)) for a in operands), str(sorted(eqn.params.items())))
        if key not in _CACHE:
            def product(a, b, eqn=eqn):
                return eqn.primitive.bind(a, b, **eqn.params)

            _CACHE[key] = _flops_typed(product, *operands)
        if _CACHE[key] <= 0:  # a product always has operations
            raise BackendError(f"jax native counter: XLA's cost analysis gave {_CACHE[key]} FLOPs for a product of "
                               f"node '{node_id}' (operands {[list(a.shape) for a in operands]}); not a count")
        total += times * _CACHE[key]
    return total


def _attention_flops(node_id: str, query_shape: tuple, kv_shape: tuple, attrs: Any, backward: bool,
                     input_grad: bool) -> int:
    """XLA's FLOPs of an attention node's products: forward QK^T and PV; backward their four input
    gradients (none when only data lies upstream). A grouped-query node's key and value are narrower
    than its query (kv_shape); its products still pair every query head with every key."""
    import jax

    from aiperf_backends.jax.lowering import attention

    frozen = tuple(sorted(dict(attrs).items()))
    key = ("attention", query_shape, kv_shape, frozen, backward, input_grad)
    if key in _CACHE:
        return _CACHE[key]

    def forward(q, k, v):
        return attention(q, k, v, attrs)

    def pullback(q, k, v, dy):
        return jax.vjp(forward, q, k, v)[1](dy)

    shapes = (query_shape, kv_shape, kv_shape)
    parts = {"forward": _dots_flops(node_id, forward, *shapes)}
    if backward and input_grad:
        # The VJP's jaxpr is the forward's followed by the transposed products.
        parts["backward"] = _dots_flops(node_id, pullback, *shapes, query_shape) - parts["forward"]
    for part, flops in parts.items():
        if flops <= 0:  # an attention node always multiplies
            raise BackendError(f"jax native counter: XLA's cost analysis gave {flops} FLOPs for the {part} pass of "
                               f"node '{node_id}' (attention, query {list(query_shape)}); not a count")
    _CACHE[key] = total = sum(parts.values())
    return total


def _moe_flops(node_id: str, in_shape: tuple, param_shapes: dict, attrs: Any, backward: bool,
                input_grad: bool) -> int:
    """XLA's FLOPs of a moe node's products as lowered (`lowering.mixture_of_experts`, routed): forward the
    router's product and the batched products over the expert tiles; backward the products of the VJP
    (weight gradients, and the input gradients unless only data lies upstream) less the forward's. The
    tiles are static, so the products are the same whatever the routing."""
    import jax

    from aiperf_backends.jax.lowering import mixture_of_experts

    names = sorted(param_shapes)
    frozen = tuple(sorted(dict(attrs).items()))
    key = ("moe", in_shape, tuple((n, tuple(param_shapes[n])) for n in names), frozen, backward, input_grad)
    if key in _CACHE:
        return _CACHE[key]

    def forward(x, *weights):
        return mixture_of_experts(x, dict(zip(names, weights)), attrs)

    def pullback(x, *weights_and_dy):
        *weights, dy = weights_and_dy
        if input_grad:
            return jax.vjp(forward, x, *weights)[1](dy)
        return jax.vjp(lambda *w: forward(x, *w), *weights)[1](dy)

    shapes = (in_shape,) + tuple(tuple(param_shapes[n]) for n in names)
    parts = {"forward": _dots_flops(node_id, forward, *shapes)}
    if backward:
        # The VJP's jaxpr is the forward's followed by the transposed products.
        parts["backward"] = _dots_flops(node_id, pullback, *shapes, in_shape) - parts["forward"]
    for part, flops in parts.items():
        if flops <= 0:  # a moe node always multiplies
            raise BackendError(f"jax native counter: XLA's cost analysis gave {flops} FLOPs for the {part} pass of "
                               f"node '{node_id}' (moe, input {list(in_shape)}); not a count")
    _CACHE[key] = total = sum(parts.values())
    return total


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
        out = {"conv": 0, "dense": 0, "attention": 0, "moe": 0, "other": 0}
        for node, up in self.counted_nodes(graph, backward, ops=("conv2d", "dense", "attention", "moe")):
            in_shape = (batch,) + tuple(graph.shapes[node.inputs[0]])
            if node.op == "moe":
                params = graph.all_param_shapes()[node.id]
                out["moe"] += _moe_flops(node.id, in_shape, params, node.attrs, backward, input_grad=up)
                continue
            if node.op == "attention":
                kv_shape = (batch,) + tuple(graph.shapes[node.inputs[1]])
                out["attention"] += _attention_flops(node.id, in_shape, kv_shape, node.attrs, backward, input_grad=up)
                continue
            kernel_shape = tuple(graph.all_param_shapes()[node.id]["kernel"])
            flops = _node_flops(node.id, node.op, in_shape, kernel_shape, node.attrs, backward, input_grad=up)
            out["conv" if node.op == "conv2d" else "dense"] += flops
        return out
