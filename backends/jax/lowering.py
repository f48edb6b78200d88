"""Lowering the aiperf IR to a pure JAX function over a parameter pytree.

The IR's layouts are JAX's natural ones, so nothing is transposed anywhere: activations NHWC,
conv kernels HWIO (``lax.conv_general_dilated`` with dimension numbers ('NHWC', 'HWIO', 'NHWC')),
dense kernels (in, out), flatten in NHWC order (a plain reshape). Canonical weights therefore
round-trip bit for bit.

A lowered model (`JaxModel`) holds

* ``params``: {node id: {kernel, bias, gamma, beta, table}} float32 master weights (trainable:
  aiperf_core.ir.is_trainable);
* ``state``:  {node id: {moving_mean, moving_variance}} batch-norm statistics and {node id: {value}}
  the constants of mul_const and add_const (not trainable: outside the pytree that is differentiated,
  exported and imported as they are);
* ``placement``: the device(s) both live on (distributed.Placement: the first local device after
  lowering, the training devices after train()); every input is put there before it is used;

and `apply(graph, params, state, x, ...)` runs the graph node by node:

* conv2d: explicit per-side padding [t, b, l, r] becomes lax padding ((t, b), (l, r)) (zeros);
  groups through ``feature_group_count`` (the IR's HWIO kernel with I = C / groups is lax's);
* max_pool: ``lax.reduce_window`` with -inf padding;
* avg_pool: the zero-padded window sum (``lax.reduce_window`` of add, in float32) divided by
  kh * kw (count_padding) or by each window's number of real taps (the same window sum over ones);
* lrn: the channel window's sum of squares by ``lax.reduce_window`` over the last axis (zero
  padded by (size - 1) / 2 each side, so the window is clipped at the edges), in float32;
* mul_const, add_const: the node's constant from ``state``; channel_shuffle: reshape (G, C/G),
  swap, reshape;
* token_input: the int32 token ids (taken as int32 on the host: ids below the vocab fit, and jax
  without x64 has no int64); embedding: ``jnp.take`` of the table's rows (its gradient a
  scatter-add); position_embedding: x + table;
* layer_norm: over the last axis in float32 (biased variance), its backward the closed form (a
  custom VJP, as batch norm's);
* rms_norm: jax has no fused RMS norm, so it is written out as layer_norm is: over the last axis in
  float32, x * rsqrt(mean(x^2) + epsilon) * gamma, its backward the closed form (a custom VJP);
* rotary: the half-split form on (N, S, heads, head_dim), in float32 and cast back, with cos and sin
  tables (S, head_dim / 2) computed once per (S, head_dim, base) in float64 on the host and embedded
  in the compiled function as constants (`rotary`);
* attention: ``jax.nn.dot_product_attention`` on (N, S, heads, head_dim), its layout (B, T, N, H),
  with ``is_causal``; grouped-query attention passes key and value as (N, S, kv_heads, head_dim),
  which the same function takes natively (its query head h reads key-value head
  h // (heads / kv_heads), the IR's rule), so no key-value head is repeated in memory; see
  `attention` for how its products get the run's precision;
* gelu: ``jax.nn.gelu(approximate=True)``, the IR's tanh form; silu: ``jax.nn.silu``; mul: the
  elementwise product in the inputs' common dtype;
* moe: see `routed_experts` (GELU experts with biases, or SwiGLU experts without), or under expert
  parallelism expert_parallel.py (the experts sharded over the devices, tokens sent by all-to-all); a training pass
  also returns each moe's `MoeRouting` (the load-balancing loss's per-sequence terms, the experts' loads);
* batch_norm: inference uses the moving statistics; training normalises with the batch mean and
  the biased batch variance (statistics in float32 over the *global* batch array, so with the
  batch axis sharded over devices they are the statistics of the whole global batch) and returns
  moving = momentum * moving + (1 - momentum) * unbiased batch statistic (Bessel factor
  m / (m - 1), taken as 1 when m == 1), as the NumPy reference does; its training-mode backward is
  the closed form (a custom VJP), not autodiff of the forward formula;
* relu: ``jax.nn.relu`` (gradient 0 at exactly 0, as the reference);
* softmax in float32 over the last axis (per position of a sequence); with ``logits=True`` the
  softmax's input is returned so the loss can use a stable log-softmax;
* dropout: identity in inference; in training inverted dropout with masks either given
  (``masks``: node id -> keep/(1-rate) array, e.g. the NumPy reference's) or drawn from a JAX
  PRNG key folded with the node's index.

Precision (the contract's names; conv and dense carry an explicit ``lax.Precision`` per lowered
function, never jax's process-wide ``jax_default_matmul_precision``, which the user owns):

* fp32: ``Precision.HIGHEST``: IEEE float32 products. Without it XLA runs float32 convolutions
  and dots on TF32 tensor cores on CUDA GPUs of compute capability 8.0 and newer (issue 15: a
  gradient off by 3.8% against the reference on an H100);
* tf32: float32 storage, ``Precision.DEFAULT``: what the issue measured running TF32 on an H100
  (no precision given is DEFAULT). jax 0.10 spells ``HIGH`` 'tensorfloat32', but XLA's Triton
  GEMM emitter uses TF32 only at DEFAULT (its cuBLAS and cuDNN paths at DEFAULT and HIGH alike),
  so DEFAULT is the precision that means TF32 on every CUDA path;
* bf16 (``compute_dtype`` bfloat16): conv, dense and attention's products run in bfloat16 on
  bfloat16 copies of the float32 master weights, biases added in bfloat16 with their gradients
  summed in float32 (`add_parameter`); batch-norm statistics, layer norm, RMS norm, rotary, lrn, the
  pools' sums, attention's softmax, the output softmax and the loss stay float32.

Activation checkpointing (``checkpoint_blocks``): each block of ``Graph.blocks()`` runs as one
``jax.checkpoint``'ed function of its input and its nodes' parameters, so the backward pass keeps
the block's input and recomputes the rest (`apply`).

Input: a float32 batch is taken as already normalised (in-memory datasets); a uint8 batch (streamed
pixels) is normalised inside the compiled function, `normalised_input`, with exactly the host's
arithmetic (aiperf_core.data.preprocess.normalise), so only a quarter of the bytes cross to the
device. Token ids cross as int32 and are never normalised (`host_input`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import numpy as np

from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, is_trainable
from aiperf_core.weights import Weights, validate_weights


@dataclass
class JaxModel:
    """An IR graph lowered for JAX: the graph, float32 parameters and BN state as jax arrays."""

    graph: Graph
    precision: str
    placement: Any  # distributed.Placement: the devices the arrays live on
    params: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # jitted functions, keyed by what they compute

    @property
    def has_logits(self) -> bool:
        return self.graph[self.graph.output_id].op == "softmax"

    def load_canonical(self, weights: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        validate_weights(self.graph, weights)
        params: dict = {}
        state: dict = {}
        for node_id in self.graph.all_param_shapes():
            for pname, array in weights[node_id].items():
                value = np.asarray(array, dtype=np.float32)
                (params if is_trainable(pname) else state).setdefault(node_id, {})[pname] = value
        self.params, self.state = self.placement.replicate((params, state))

    def export_canonical(self) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            out[node_id] = {}
            for pname in shapes:
                source = self.params if is_trainable(pname) else self.state
                out[node_id][pname] = np.array(source[node_id][pname], dtype=np.float32)
        return out


def host_input(graph: Graph, x: np.ndarray) -> np.ndarray:
    """An in-memory batch as it crosses to the device: token ids as int32 (below the vocab, so
    exact; jax without x64 would narrow int64 itself), values as float32 (normalised already).
    Streamed uint8 pixels do not come through here: they cross as they are."""
    if graph.takes_tokens:
        return np.ascontiguousarray(x, dtype=np.int32)
    return np.ascontiguousarray(x, dtype=np.float32)


def compute_dtype(precision: str):
    """The dtype conv, dense and attention compute in, or None for float32 (fp32 and tf32 store
    float32)."""
    import jax.numpy as jnp

    return {"fp32": None, "tf32": None, "bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]


def lax_precision(precision: str):
    """The lax.Precision of conv and dot at a run precision (see the module docstring)."""
    from jax import lax

    return lax.Precision.HIGHEST if precision == "fp32" else lax.Precision.DEFAULT


def normalised_input(x):
    """A uint8 NHWC batch normalised on the device, (float32(x) - MEAN) * INV_STD per channel: the
    arithmetic of aiperf_core.data.preprocess.normalise, operation for operation. A float batch
    is already normalised and passes as it is."""
    import jax.numpy as jnp

    from aiperf_core.data.preprocess import INV_STD, MEAN

    if x.dtype != jnp.uint8:
        return x
    return (x.astype(jnp.float32) - jnp.asarray(MEAN)) * jnp.asarray(INV_STD)


def conv2d(x, kernel, attrs, precision: str = "fp32"):
    from jax import lax

    pt, pb, pl, pr = attrs["padding"]
    dtype = compute_dtype(precision)
    if dtype is not None:
        x, kernel = x.astype(dtype), kernel.astype(dtype)
    return lax.conv_general_dilated(x, kernel, tuple(attrs["strides"]), ((pt, pb), (pl, pr)),
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=attrs.get("groups", 1), precision=lax_precision(precision))


def dense(x, kernel, precision: str = "fp32"):
    import jax.numpy as jnp

    dtype = compute_dtype(precision)
    if dtype is not None:
        x, kernel = x.astype(dtype), kernel.astype(dtype)
    return jnp.matmul(x, kernel, precision=lax_precision(precision))


def max_pool(x, attrs):
    import jax.numpy as jnp
    from jax import lax

    kh, kw = attrs["kernel"]
    sh, sw = attrs["strides"]
    pt, pb, pl, pr = attrs["padding"]
    # A Python -inf init makes JAX use its differentiable max-window primitive (reduce_window_max).
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, kh, kw, 1), (1, sh, sw, 1),
                             ((0, 0), (pt, pb), (pl, pr), (0, 0)))


@functools.lru_cache(maxsize=None)
def _add_parameter():
    """x + p in x's dtype, with p's gradient summed in float32 (`add_parameter`)."""
    import jax
    import jax.numpy as jnp

    @jax.custom_vjp
    def add(x, p):
        return x + p.astype(x.dtype)

    def add_fwd(x, p):
        return add(x, p), p  # p: its rank and dtype, for the backward

    def add_bwd(p, dy):
        axes = tuple(range(dy.ndim - p.ndim))  # the axes p is broadcast over
        return dy, jnp.sum(dy.astype(jnp.float32), axis=axes).astype(p.dtype)

    add.defvjp(add_fwd, add_bwd)
    return add


def add_parameter(x, p):
    """x + p (a bias, or a position table) in x's dtype; p's gradient is summed in float32.

    Autodiff's gradient of a float32 parameter added in bfloat16 is a bfloat16 reduction with a
    bfloat16 accumulator (XLA's reduce keeps its operand's type), so at bf16 a dense layer's bias
    over a sequence summed N * S values in 8 bits of mantissa: 0.56% off over 1024 positive
    values, and a conv bias over 90 positions 4% of its graph's largest gradient away from the
    reference (tests/test_backend_sequence.py). Here only the summed values are bfloat16; the forward
    pass is the plain add, and at fp32 and tf32 nothing changes."""
    if x.dtype == p.dtype:
        return x + p
    return _add_parameter()(x, p)


def avg_pool(x, attrs):
    """Window sums in float32 over zero padding, divided by every tap or by the real ones."""
    import jax.numpy as jnp
    from jax import lax

    kh, kw = attrs["kernel"]
    sh, sw = attrs["strides"]
    pt, pb, pl, pr = attrs["padding"]
    window, strides = (1, kh, kw, 1), (1, sh, sw, 1)
    padding = ((0, 0), (pt, pb), (pl, pr), (0, 0))
    total = lax.reduce_window(x.astype(jnp.float32), 0.0, lax.add, window, strides, padding)
    if attrs["count_padding"]:
        divisor = float(kh * kw)
    else:  # the real taps of each window: the same window sum over an image of ones
        ones = jnp.ones((1,) + x.shape[1:3] + (1,), jnp.float32)
        divisor = lax.reduce_window(ones, 0.0, lax.add, window, strides, padding)
    return (total / divisor).astype(x.dtype)


def lrn(x, attrs):
    """ONNX's LRN over the channel axis, in float32: x / (bias + alpha / size * window sum of x^2)^beta."""
    import jax.numpy as jnp
    from jax import lax

    size = attrs["size"]
    half = (size - 1) // 2
    xf = x.astype(jnp.float32)
    window_sum = lax.reduce_window(xf * xf, 0.0, lax.add, (1,) * (x.ndim - 1) + (size,), (1,) * x.ndim,
                                   ((0, 0),) * (x.ndim - 1) + ((half, half),))
    scale = attrs["bias"] + (attrs["alpha"] / size) * window_sum
    return (xf * scale ** -attrs["beta"]).astype(x.dtype)


def channel_shuffle(x, groups: int):
    """Channel g * (C / G) + j moves to j * G + g (ShuffleNet's reshape, transpose, reshape)."""
    *lead, channels = x.shape
    return x.reshape(*lead, groups, channels // groups).swapaxes(-1, -2).reshape(*lead, channels)


@functools.lru_cache(maxsize=None)
def _layer_norm_float32():
    """Layer norm over the last axis of a float32 x, with the closed-form backward: autodiff of the
    two-pass formula left the lowered GPT step about 10% more work than Flax's (docs/performance.md),
    as it did batch norm's (`_batch_norm_train`)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def forward(x, gamma, beta, eps):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        inv = lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
        xhat = centred * inv
        return xhat * gamma + beta, (xhat, inv)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def ln(x, gamma, beta, eps):
        return forward(x, gamma, beta, eps)[0]

    def ln_fwd(x, gamma, beta, eps):
        y, saved = forward(x, gamma, beta, eps)
        return y, (saved, gamma)

    def ln_bwd(eps, residuals, dy):
        (xhat, inv), gamma = residuals
        leading = tuple(range(dy.ndim - 1))
        dxhat = dy * gamma
        dx = inv * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
                    - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
        return dx, jnp.sum(dy * xhat, axis=leading), jnp.sum(dy, axis=leading)

    ln.defvjp(ln_fwd, ln_bwd)
    return ln


def layer_norm(x, gamma, beta, epsilon: float):
    """Over the last axis, in float32 (biased variance), cast back to x's dtype."""
    import jax.numpy as jnp

    return _layer_norm_float32()(x.astype(jnp.float32), gamma, beta, float(epsilon)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _rms_norm_float32():
    """RMS norm over the last axis of a float32 x, with the closed-form backward (as `_layer_norm_float32`):
    with xhat = x * inv, dx = inv * (dxhat - xhat * mean(dxhat * xhat)) for dxhat = dy * gamma."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def forward(x, gamma, eps):
        inv = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        xhat = x * inv
        return xhat * gamma, (xhat, inv)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def rms(x, gamma, eps):
        return forward(x, gamma, eps)[0]

    def rms_fwd(x, gamma, eps):
        y, saved = forward(x, gamma, eps)
        return y, (saved, gamma)

    def rms_bwd(eps, residuals, dy):
        (xhat, inv), gamma = residuals
        dxhat = dy * gamma
        dx = inv * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
        return dx, jnp.sum(dy * xhat, axis=tuple(range(dy.ndim - 1)))

    rms.defvjp(rms_fwd, rms_bwd)
    return rms


def rms_norm(x, gamma, epsilon: float):
    """Over the last axis, in float32, cast back to x's dtype."""
    import jax.numpy as jnp

    return _rms_norm_float32()(x.astype(jnp.float32), gamma, float(epsilon)).astype(x.dtype)


@functools.lru_cache(maxsize=None)
def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) of theta = p * base ** (-2 i / head_dim), (seq_len, head_dim / 2) float32, computed in
    float64 so that the angles of late positions lose nothing before the one rounding to float32."""
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    frequencies = float(base) ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    theta = positions * frequencies
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rotary(x, attrs):
    """The IR's rotary on (..., S, heads * head_dim), half-split: each head's first half x1 and second
    half x2 become (x1 cos - x2 sin, x2 cos + x1 sin), in float32, cast back to x's dtype."""
    import jax.numpy as jnp

    dim = attrs["head_dim"]
    cos, sin = rotary_tables(x.shape[-2], dim, attrs["base"])
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over the heads
    heads = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // dim, dim))
    x1, x2 = heads[..., :dim // 2], heads[..., dim // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def moe_tile_rows(assignments: int, experts: int) -> int:
    """The rows b of a routed tile: the largest power of two whose padding bound, experts * (b - 1)
    rows (each expert's last tile part empty), is at most 4% of the `assignments` (tokens x top_k), so
    the products stay within the 5% over the counted work that the kit's count/moe_* allows on large
    batches; and at least 2: over tiles of one row, XLA turns the weight gradient's contraction into an
    elementwise multiply (the sum over rows then a scatter-add into the experts), which its cost analysis
    counts at half the product's work, so the native count would not show the work."""
    rows = 2
    while experts * (2 * rows - 1) * 25 <= assignments:
        rows *= 2
    return rows


def expert_weights(params, dtype) -> dict:
    """A moe node's expert stacks (every parameter but the router, leading axis E) in the compute dtype."""
    return {name: value.astype(dtype) for name, value in params.items() if name != "router"}


def expert_mlp(rows, w, swiglu: bool, precision: str = "fp32"):
    """One expert on its rows (R, D): GELU with biases, or SwiGLU without ((silu(x w_gate) * (x w_in))
    w_out); `w` holds that expert's matrices (no leading axis)."""
    import jax
    import jax.numpy as jnp

    def product(a, b):
        return jnp.matmul(a, b, precision=lax_precision(precision))

    if swiglu:
        hidden = jax.nn.silu(product(rows, w["w_gate"])) * product(rows, w["w_in"])
    else:
        hidden = jax.nn.gelu(product(rows, w["w_in"]) + w["b_in"], approximate=True)
    out = product(hidden, w["w_out"])
    return out + w["b_out"] if "b_out" in w else out


def moe_tile_levels(assignments: int, experts: int, rows: int) -> tuple:
    """((tile rows, tiles), ...) of the routed layout, largest tiles first, ending with tiles of `rows`
    (moe_tile_rows). Each level of B rows but the last has as many tiles as any routing fills whole:
    with R assignments not yet placed, the experts' whole tiles of B number at least (R - E (B - 1)) / B,
    so that many are always full and R - B x that many rows go on down; the last level has
    (R + E (b - 1)) / b tiles, enough for any R split over E experts. The padding bound is the one
    tiles of b rows alone have, E (b - 1) rows, but the tiles number 55 instead of 263 at T k 2048,
    E 8, b 8 (128 x 8, 64 x 8, 32 x 8, 16 x 8, 8 x 23)."""
    levels = []
    remaining = assignments
    size = rows
    while size * 2 <= assignments:
        size *= 2
    while size > rows:
        count = (remaining - experts * (size - 1)) // size
        if count > 0:
            levels.append((size, count))
            remaining -= size * count
        size //= 2
    count = (remaining + experts * (rows - 1)) // rows
    if count > 0:
        levels.append((rows, count))
    return tuple(levels)


def _zero_like_all(*values):
    """A scalar 0 typed as varying over every manual mesh axis any of `values` varies over (inside
    shard_map both branches of a lax.cond must agree on that), whatever their values (no 0 * inf)."""
    import jax.numpy as jnp

    total = sum(value.reshape(-1)[0].astype(jnp.float32) for value in values)
    return jnp.where(jnp.zeros((), bool), total, 0.0)


def _tiles_forward(routed_levels, expert_levels, used_levels, weights, swiglu: bool, precision: str):
    """(each level's outputs (tiles, B, D), each level's pre-activations: (x w_in + b_in,) for GELU
    experts, (x w_gate, x w_in) for SwiGLU ones); a lax.scan per level over its tiles, each with its
    own expert's weights (a dynamic index into the stacks). With `used_levels` (each level's tiles in
    use, a traced count), a lax.cond computes only those and gives the others zeros."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def product(a, b):
        return jnp.matmul(a, b, precision=lax_precision(precision))

    def run(rows, w):
        if swiglu:
            gate, up = product(rows, w["w_gate"]), product(rows, w["w_in"])
            hidden, pre = jax.nn.silu(gate) * up, (gate, up)
        else:
            pre = (product(rows, w["w_in"]) + w["b_in"],)
            hidden = jax.nn.gelu(pre[0], approximate=True)
        out = product(hidden, w["w_out"])
        return out + w["b_out"] if "b_out" in w else out, pre

    def skip(rows, w):
        zero = _zero_like_all(rows, *w.values())
        hidden = jnp.zeros((rows.shape[0], w["w_in"].shape[-1]), rows.dtype) + zero.astype(rows.dtype)
        out = jnp.zeros((rows.shape[0], w["w_out"].shape[-1]), rows.dtype) + zero.astype(rows.dtype)
        return out, ((hidden, hidden) if swiglu else (hidden,))

    def tile(used, xs):
        rows, expert, index = xs
        w = {name: lax.dynamic_index_in_dim(value, expert, keepdims=False) for name, value in weights.items()}
        return used, (run(rows, w) if used is None else lax.cond(index < used, run, skip, rows, w))

    outs, pres = [], []
    for level, (routed, experts) in enumerate(zip(routed_levels, expert_levels)):
        used = None if used_levels is None else used_levels[level]
        _, (out, pre) = lax.scan(tile, used, (routed, experts, jnp.arange(routed.shape[0])))
        outs.append(out)
        pres.append(pre)
    return tuple(outs), tuple(pres)


def _tiles_backward(swiglu: bool, precision: str, residuals, d_outs):
    """The gradients of `_tiles_forward`'s outputs to the routed rows and the weight stacks: a lax.scan
    per level whose carry is the stacks' gradients, each tile adding its weight gradients into its
    expert's slice in place (autodiff of the forward's dynamic index would instead add a whole
    zero-padded (E, ...) stack per tile: about 6 times the time on the benchmark's layer). The
    products are autodiff's (GELU: h^T dy, dy w_out^T, x^T dz, dz w_in^T; SwiGLU two more), on the
    saved pre-activations, so none of the forward's is recomputed: the native counter's backward
    count is the same as autodiff's."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    routed_levels, expert_levels, used_levels, weights, pres = residuals

    def product(a, b):
        return jnp.matmul(a, b, precision=lax_precision(precision))

    def compute(rows, w, pre, d_out):
        d_out = d_out.astype(rows.dtype)
        if swiglu:
            gate, up = pre
            silu_gate, silu_vjp = jax.vjp(jax.nn.silu, gate)
            hidden = silu_gate * up
        else:
            hidden, gelu_vjp = jax.vjp(lambda z: jax.nn.gelu(z, approximate=True), pre[0])
        tile_grads = {"w_out": product(hidden.T, d_out)}
        if "b_out" in w:
            tile_grads["b_out"] = jnp.sum(d_out, axis=0)
        d_hidden = product(d_out, w["w_out"].T)
        if swiglu:
            (d_gate,) = silu_vjp(d_hidden * up)
            d_up = d_hidden * silu_gate
            tile_grads["w_gate"], tile_grads["w_in"] = product(rows.T, d_gate), product(rows.T, d_up)
            d_rows = product(d_gate, w["w_gate"].T) + product(d_up, w["w_in"].T)
        else:
            (d_pre,) = gelu_vjp(d_hidden)
            tile_grads["w_in"], tile_grads["b_in"] = product(rows.T, d_pre), jnp.sum(d_pre, axis=0)
            d_rows = product(d_pre, w["w_in"].T)
        return tile_grads, d_rows

    def skip(rows, w, pre, d_out):
        zero = _zero_like_all(rows, d_out, *w.values(), *pre)
        return ({name: jnp.zeros(value.shape, value.dtype) + zero.astype(value.dtype) for name, value in w.items()},
                jnp.zeros(rows.shape, rows.dtype) + zero.astype(rows.dtype))

    def tile(carry, tile_in):
        grads, used = carry
        rows, expert, pre, d_out, index = tile_in
        w = {name: lax.dynamic_index_in_dim(value, expert, keepdims=False) for name, value in weights.items()}
        if used is None:
            tile_grads, d_rows = compute(rows, w, pre, d_out)
        else:  # the cond holds the products only: the carry's update stays outside, so it is not copied
            tile_grads, d_rows = lax.cond(index < used, compute, skip, rows, w, pre, d_out)
        grads = {name: lax.dynamic_update_index_in_dim(
                     value, lax.dynamic_index_in_dim(value, expert, keepdims=False) + tile_grads[name], expert, 0)
                 for name, value in grads.items()}
        return (grads, used), d_rows

    grads = {name: jnp.zeros_like(value) for name, value in weights.items()}
    d_routed = []
    for level, (routed, experts, pre, d_out) in enumerate(zip(routed_levels, expert_levels, pres, d_outs)):
        used = None if used_levels is None else used_levels[level]
        (grads, _), d_rows = lax.scan(tile, (grads, used), (routed, experts, pre, d_out, jnp.arange(routed.shape[0])))
        d_routed.append(d_rows)
    used_cotangent = None if used_levels is None else tuple(None for _ in used_levels)
    return tuple(d_routed), tuple(None for _ in expert_levels), used_cotangent, grads


@functools.cache
def _expert_tiles():
    """expert_tiles(routed levels, tile experts per level, tiles in use per level or None, weight stacks,
    swiglu, precision) -> each level's outputs: `_tiles_forward` with `_tiles_backward` as its VJP (built on first use, so that
    importing this module does not import jax)."""
    import jax

    def forward(routed_levels, expert_levels, used_levels, weights, swiglu, precision):
        return _tiles_forward(routed_levels, expert_levels, used_levels, weights, swiglu, precision)[0]

    def forward_saving(routed_levels, expert_levels, used_levels, weights, swiglu, precision):
        outs, pres = _tiles_forward(routed_levels, expert_levels, used_levels, weights, swiglu, precision)
        return outs, (routed_levels, expert_levels, used_levels, weights, pres)

    tiles = jax.custom_vjp(forward, nondiff_argnums=(4, 5))
    tiles.defvjp(forward_saving, _tiles_backward)
    return tiles


def tiled_experts(rows, row_of, expert_of, weights, levels, swiglu: bool, precision: str, skip_unused: bool = False):
    """(outputs (L, D_out) of the padded layout, each assignment's slot in it) of assignments (A,): row
    row_of[a] of `rows` (R, D) through expert expert_of[a] of the stacks `weights` (leading axis E), or
    through none where expert_of[a] == E (its slot is then L, past the layout). The assignments are laid
    out expert by expert in `levels` (moe_tile_levels): each expert's rows fill whole tiles of the
    largest size first, as far as that level's tiles go, and what is left goes on to the next; the last
    level's tiles take the remainders. Empty slots read row 0; the tiles run in `_expert_tiles`, which
    with `skip_unused` computes only the tiles a routing reached (a lax.cond per tile: for layouts sized
    far beyond what a routing fills, as an expert-parallel device's; the single-device layout runs every
    tile, its padding bound being E (b - 1) rows)."""
    import jax
    import jax.numpy as jnp

    experts = next(iter(weights.values())).shape[0]
    one_hot = jax.nn.one_hot(expert_of, experts + 1, dtype=jnp.int32)[:, :experts]  # no expert: all zeros
    valid = jnp.sum(one_hot, axis=1) > 0
    expert = jnp.minimum(expert_of, experts - 1)
    rank = jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)  # earlier assignments, same expert
    left = jnp.sum(one_hot, axis=0)  # each expert's rows not yet in a tile
    placed = jnp.zeros_like(left)  # each expert's rows in the levels before
    length = sum(size * count for size, count in levels)
    slot = jnp.full_like(expert_of, length)  # each assignment's row in the padded layout
    tile_experts, used = [], []
    offset = 0  # the level's first row in the layout
    for level, (size, count) in enumerate(levels):
        if level < len(levels) - 1:  # whole tiles only, expert by expert until the level's tiles run out
            whole = left // size
            taken = jnp.clip(count - (jnp.cumsum(whole) - whole), 0, whole)
        else:  # every row left, the last tile part empty
            taken = (left + size - 1) // size
        tile_end = jnp.cumsum(taken)
        low = placed[expert]
        here = valid & (rank >= low) & (rank < low + (taken * size)[expert])
        slot = jnp.where(here, offset + (tile_end - taken)[expert] * size + rank - low, slot)
        tile_experts.append(jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(count), side="right"), experts - 1))
        used.append(tile_end[-1])
        placed, left = placed + taken * size, left - taken * size
        offset += size * count
    row_of_slot = jnp.zeros(length, jnp.int32).at[slot].set(row_of.astype(jnp.int32), mode="drop")
    routed = rows[row_of_slot]
    routed_levels, start = [], 0
    for size, count in levels:
        routed_levels.append(routed[start:start + size * count].reshape(count, size, -1))
        start += size * count
    outs = _expert_tiles()(tuple(routed_levels), tuple(tile_experts), tuple(used) if skip_unused else None, weights,
                           swiglu, precision)
    return jnp.concatenate([level_out.reshape(-1, level_out.shape[-1]) for level_out in outs], axis=0), slot


def mixture_of_experts(x, params, attrs, precision: str = "fp32"):
    """The IR's moe on (N, S, D), its output alone (`routed_experts`)."""
    return routed_experts(x, params, attrs, precision)[0]


def routed_experts(x, params, attrs, precision: str = "fp32"):
    """(output, router logits (T, E) float32, chosen experts (T, top_k)) of the IR's moe on (N, S, D),
    T = N S: the router's top_k experts per token (lax.top_k puts the lower index first among equals,
    as the IR does), gated by the softmax over their logits. Experts are GELU MLPs
    with biases, or SwiGLU MLPs without ((silu(x w_gate) * (x w_in)) w_out, aiperf_core.ir.moe_mlp).

    Routed, with static shapes and no host synchronisation: the T * k (token, choice) assignments are
    placed expert by expert in a padded layout of tiles in levels of decreasing rows
    (`moe_tile_levels`): each expert's rows fill whole tiles of the largest size first, as far as that
    level's tiles go, and what is left goes on to the next, the last level's tiles of b rows
    (`moe_tile_rows`) taking the remainders; enough tiles for any routing, with the products the chosen
    experts' plus at most E (b - 1) padding rows. A lax.scan per level runs its tiles, each on its
    tokens with its own expert's weights (a dynamic index into the stacks); the backward is
    `_tiles_backward` (a custom VJP that adds each tile's weight gradients into its expert's slice).
    Each assignment's output is gathered back from its slot and weighted by its gate;
    padding slots are never read, so their gradient is zero. Tiles left unused by a routing compute on
    token 0 with the last expert (their share of the bound). jax.lax.ragged_dot would say the same in
    one op, but XLA:CPU expands it to a dense product over every group (E times the work), and a tiled
    batched product over gathered per-tile weights copies the weights once per tile (1.2 to 1.7 times
    the scan's time on a MoE layer of T 4096, D 256, F 1024, E 8, top 2, on the CPU)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from aiperf_core.ir import moe_mlp

    dtype = compute_dtype(precision) or x.dtype
    experts, top_k = attrs["experts"], attrs["top_k"]
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    logits = dense(x, params["router"], precision).astype(jnp.float32)
    picked, chosen = lax.top_k(logits, top_k)
    gates = jax.nn.softmax(picked, axis=-1)

    assignments = x.shape[0] * top_k
    levels = moe_tile_levels(assignments, experts, moe_tile_rows(assignments, experts))
    out, slot = tiled_experts(x.astype(dtype), jnp.arange(assignments) // top_k, chosen.reshape(-1),
                              expert_weights(params, dtype), levels, moe_mlp(attrs) == "swiglu", precision)
    picked_out = out[slot].reshape(-1, top_k, out.shape[-1])
    y = jnp.sum(picked_out * gates.astype(out.dtype)[..., None], axis=1).reshape(shape[:-1] + (out.shape[-1],))
    return y, logits, chosen


class MoeRouting(NamedTuple):
    """What a training pass's moe node tells the step besides its output (`moe_routing`).

    balance: (N,) float32, per sequence b, E sum_e f_{b,e} P_{b,e} (TrainConfig.moe_aux_loss), its
      gradient through P only (to the router and the moe's input);
    load: (E,) int32, the (token, choice) assignments each expert received over the batch
      (EpochReport.expert_load)."""

    balance: Any
    load: Any


def moe_routing(logits, chosen, leading: tuple, experts: int) -> MoeRouting:
    """The load-balance record of a routing: logits (T, E) and chosen (T, top_k) of the T = N x S tokens
    (`leading`: (N, S)). f_{b,e}, the share of sequence b's S x top_k assignments that went to expert e,
    is a count, so it carries no gradient (stop_gradient says so); P_{b,e} is the mean over the
    sequence's tokens of the router's softmax over all E experts, in float32."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    sequences = leading[0]
    picks = chosen.size // sequences  # S x top_k per sequence
    per_sequence = jnp.sum(jax.nn.one_hot(chosen.reshape(sequences, picks), experts, dtype=jnp.int32), axis=1)
    share = lax.stop_gradient(per_sequence.astype(jnp.float32) / picks)
    probability = jnp.mean(jax.nn.softmax(logits, axis=-1).reshape(sequences, -1, experts), axis=1)
    return MoeRouting(experts * jnp.sum(share * probability, axis=-1), jnp.sum(per_sequence, axis=0))


def attention(q, k, v, attrs, precision: str = "fp32"):
    """Multi-head scaled dot-product attention: query (N, S, heads * head_dim), key and value
    (N, S, kv_heads * head_dim), out (N, S, heads * head_dim).

    Head h is features [h * d, (h + 1) * d), so (N, S, heads, d) is a reshape, and it is
    jax.nn.dot_product_attention's layout (B, T, N, H): no transpose. With fewer key-value heads the
    key and value are (B, S, K, H), which the function takes as grouped-query attention: it views the
    query as (B, T, K, heads / K, H), so query head h reads key-value head h // (heads / K), the IR's
    rule, without repeating the key and value. Its softmax runs in float32
    and its causal mask sets the masked scores to a large negative number, whose probability is
    exactly 0 in float32, as the IR asks.

    jax.nn.dot_product_attention takes no precision argument: its float32 products use jax's
    configured default matmul precision (TF32 on CUDA GPUs of compute capability 8.0+ when nothing
    is configured, the issue 15 error). The call is therefore traced inside a scoped
    `jax.default_matmul_precision` of the run's precision (HIGHEST at fp32, DEFAULT otherwise; its
    bfloat16 score product keeps its own explicit BF16_BF16_F32). The scope covers this trace only,
    so the user's own setting elsewhere is left alone, and autodiff's transposed products inherit
    the precision recorded on the forward ones (a test reads the training step's StableHLO)."""
    import jax
    import jax.numpy as jnp

    heads, dim = attrs["heads"], attrs["head_dim"]
    dtype = compute_dtype(precision) or jnp.result_type(q, k, v)
    q, k, v = (t.astype(dtype).reshape(t.shape[:-1] + (t.shape[-1] // dim, dim)) for t in (q, k, v))
    with jax.default_matmul_precision(lax_precision(precision).name.lower()):
        out = jax.nn.dot_product_attention(q, k, v, scale=1.0 / float(np.sqrt(dim)), is_causal=attrs["causal"])
    return out.reshape(out.shape[:-2] + (heads * dim,))


@functools.lru_cache(maxsize=None)
def _batch_norm_train():
    """(y, batch mean, biased batch variance) of training-mode BN, with the closed-form backward
    (as cuDNN's): autodiff of the forward formula made XLA emit ~20% more elementwise work in the
    backward pass, and ResNet-50 training 5% slower than Flax's (docs/performance.md)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def forward(x, gamma, beta, eps):
        axes = tuple(range(x.ndim - 1))
        mean = jnp.mean(x, axis=axes)
        centred = x - mean
        var = jnp.mean(centred * centred, axis=axes)
        inv = lax.rsqrt(var + eps)
        return centred * (gamma * inv) + beta, mean, var, (centred, inv)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def bn(x, gamma, beta, eps):
        return forward(x, gamma, beta, eps)[:3]

    def bn_fwd(x, gamma, beta, eps):
        y, mean, var, saved = forward(x, gamma, beta, eps)
        return (y, mean, var), (saved, gamma)

    def bn_bwd(eps, residuals, cotangents):
        (centred, inv), gamma = residuals
        dy, dmean, dvar = cotangents
        axes = tuple(range(centred.ndim - 1))
        m = centred.size // centred.shape[-1]
        xhat = centred * inv
        dbeta = jnp.sum(dy, axis=axes)
        dgamma = jnp.sum(dy * xhat, axis=axes)
        dx = (gamma * inv / m) * (m * dy - dbeta - xhat * dgamma)
        # The statistics are outputs too (the moving averages stop their gradient, but be exact).
        dx = dx + dmean / m + centred * (2.0 * dvar / m)
        return dx, dgamma, dbeta

    bn.defvjp(bn_fwd, bn_bwd)
    return bn


def batch_norm(x, p, s, attrs, training: bool):
    """(y, new state or None). Statistics in float32 whatever x's dtype."""
    import jax.numpy as jnp
    from jax import lax

    dtype = x.dtype
    xf = x.astype(jnp.float32)
    eps = attrs["epsilon"]
    if training:
        y, mean, var = _batch_norm_train()(xf, p["gamma"], p["beta"], float(eps))
        m = x.size // x.shape[-1]
        unbiased = var * (m / max(m - 1, 1))
        momentum = attrs["momentum"]
        new = {"moving_mean": momentum * s["moving_mean"] + (1.0 - momentum) * lax.stop_gradient(mean),
               "moving_variance": momentum * s["moving_variance"] + (1.0 - momentum) * lax.stop_gradient(unbiased)}
        return y.astype(dtype), new
    scale = p["gamma"] * lax.rsqrt(s["moving_variance"] + eps)
    return ((xf - s["moving_mean"]) * scale + p["beta"]).astype(dtype), None


def node_value(node, index: int, ins: list, params, state, x, *, training: bool, precision: str,
               masks: Mapping[str, Any] | None, key, expert_parallel=None):
    """(the value of one node from its inputs' values, its new BN statistics, or in training its moe
    routing (MoeRouting), or None). `index` is the node's position in the graph (it seeds the node's
    dropout, so a recomputed block draws the same mask); `x` is the graph's input batch;
    `expert_parallel` (an expert_parallel.ExpertParallel, or None) runs a moe's experts sharded."""
    import jax
    import jax.numpy as jnp

    op, a = node.op, node.attrs
    if op == "input":
        return normalised_input(x), None
    if op == "token_input":
        return x, None
    if op == "conv2d":
        y = conv2d(ins[0], params[node.id]["kernel"], a, precision)
        return (add_parameter(y, params[node.id]["bias"]) if a["use_bias"] else y), None
    if op == "dense":
        y = dense(ins[0], params[node.id]["kernel"], precision)
        return (add_parameter(y, params[node.id]["bias"]) if a["use_bias"] else y), None
    if op == "batch_norm":
        return batch_norm(ins[0], params[node.id], state[node.id], a, training)
    if op == "relu":
        return jax.nn.relu(ins[0]), None
    if op == "add":
        dtype = jnp.result_type(*ins)
        y = ins[0].astype(dtype)
        for other in ins[1:]:
            y = y + other.astype(dtype)
        return y, None
    if op == "concat":
        dtype = jnp.result_type(*ins)
        return jnp.concatenate([v.astype(dtype) for v in ins], axis=-1), None
    if op == "max_pool":
        return max_pool(ins[0], a), None
    if op == "global_avg_pool":
        return jnp.mean(ins[0].astype(jnp.float32), axis=(1, 2)).astype(ins[0].dtype), None
    if op == "flatten":
        return ins[0].reshape(ins[0].shape[0], -1), None
    if op == "softmax":
        return jax.nn.softmax(ins[0].astype(jnp.float32), axis=-1), None
    if op == "avg_pool":
        return avg_pool(ins[0], a), None
    if op == "lrn":
        return lrn(ins[0], a), None
    if op == "mul_const":
        return ins[0] * state[node.id]["value"].astype(ins[0].dtype), None
    if op == "add_const":
        return ins[0] + state[node.id]["value"].astype(ins[0].dtype), None
    if op == "channel_shuffle":
        return channel_shuffle(ins[0], a["groups"]), None
    if op == "embedding":
        return jnp.take(params[node.id]["table"], ins[0], axis=0), None
    if op == "position_embedding":
        return add_parameter(ins[0], params[node.id]["table"]), None
    if op == "layer_norm":
        return layer_norm(ins[0], params[node.id]["gamma"], params[node.id]["beta"], a["epsilon"]), None
    if op == "attention":
        return attention(*ins, a, precision), None
    if op == "gelu":
        return jax.nn.gelu(ins[0], approximate=True), None
    if op == "rms_norm":
        return rms_norm(ins[0], params[node.id]["gamma"], a["epsilon"]), None
    if op == "rotary":
        return rotary(ins[0], a), None
    if op == "silu":
        return jax.nn.silu(ins[0]), None
    if op == "mul":
        dtype = jnp.result_type(*ins)
        return ins[0].astype(dtype) * ins[1].astype(dtype), None
    if op == "moe":
        if expert_parallel is not None:
            from aiperf_backends.jax import expert_parallel as sharded_experts

            y, logits, chosen = sharded_experts.routed_experts(ins[0], params[node.id], a, precision, expert_parallel)
            if not training:
                return y, None
        elif not training:
            return mixture_of_experts(ins[0], params[node.id], a, precision), None
        else:
            y, logits, chosen = routed_experts(ins[0], params[node.id], a, precision)
        return y, moe_routing(logits, chosen, ins[0].shape[:-1], a["experts"])
    if op == "dropout":
        y = ins[0]
        rate = a["rate"]
        if training and rate > 0.0:
            if masks is not None and node.id in masks:
                y = y * masks[node.id].astype(y.dtype)
            elif key is not None:
                keep = jax.random.uniform(jax.random.fold_in(key, index), y.shape) >= rate
                y = jnp.where(keep, y / (1.0 - rate), jnp.zeros((), y.dtype)).astype(y.dtype)
            else:
                raise GraphError("training-mode dropout needs masks or a PRNG key", node.id)
        return y, None
    raise GraphError(f"op '{op}' is not supported by the jax backend", node.id)  # pragma: no cover


def checkpointed_blocks(graph: Graph, stop: str) -> dict:
    """{first node id: (block, the ids of its nodes read after it)} for Graph.blocks() (activation
    checkpointing). A block that holds `stop` (where apply ends early) is left out: it runs plain."""
    found = {}
    for block in graph.blocks():
        inside = set(block.nodes)
        if stop in inside:
            continue
        read_after = [n for n in block.nodes
                      if n == block.output or any(c.id not in inside for c in graph.consumers(n))]
        found[block.nodes[0]] = (block, tuple(read_after))
    return found


def apply(graph: Graph, params, state, x, *, training: bool = False, logits: bool = False,
          precision: str = "fp32", masks: Mapping[str, Any] | None = None, key=None,
          checkpoint_blocks: bool = False, expert_parallel=None):
    """Run the graph on x, a float32 (normalised) or uint8 (pixels, normalised here) NHWC batch, a
    float32 sequence batch (N, S, D), or int32 token ids (N, S). Returns (output, new_state, routing);
    new_state holds the BN updates of a training pass (the old statistics where a node was not
    reached) and is `state` itself in inference; routing is {moe node id: MoeRouting} of a training
    pass (the load-balancing loss's terms and the experts' loads), empty in inference.

    checkpoint_blocks (TrainConfig.checkpoint_blocks): each of Graph.blocks() runs as one
    jax.checkpoint'ed function of its input and its nodes' parameters, so that autodiff keeps only
    the block's input and recomputes its activations in the backward pass (jax's default remat
    policy saves nothing inside). The values, dropout masks and precisions are those of the plain
    pass: the same node functions run, traced once, and their products' precision is recorded in
    the traced code. A graph without blocks (an image graph) runs as it would without the flag.

    expert_parallel (an expert_parallel.ExpertParallel): the moe nodes run with their experts sharded
    over its mesh, tokens exchanged by all-to-all (expert_parallel.py); None: the plain lowering."""
    import jax
    import jax.numpy as jnp

    out_node = graph[graph.output_id]
    stop = out_node.inputs[0] if logits and out_node.op == "softmax" else graph.output_id
    values: dict[str, Any] = {}
    new_state = dict(state) if training else state
    routing: dict[str, MoeRouting] = {}

    def record(node_id: str, update) -> None:
        if update is None:
            return
        if isinstance(update, MoeRouting):
            routing[node_id] = update
        else:
            new_state[node_id] = update

    order = {n.id: k for k, n in enumerate(graph.nodes)}
    blocks = checkpointed_blocks(graph, stop) if checkpoint_blocks else {}
    options = dict(training=training, precision=precision, expert_parallel=expert_parallel)
    index = 0
    while index < len(graph.nodes):
        node = graph.nodes[index]
        if node.id in blocks:
            block, read_after = blocks[node.id]
            own = lambda tree: {n: tree[n] for n in block.nodes if n in tree}  # noqa: E731

            def run_block(block_params, block_state, block_input, block_masks, block_key,
                          block=block, read_after=read_after):
                local = {block.input: block_input}
                updates = {}
                for node_id in block.nodes:
                    inner = graph[node_id]
                    y, upd = node_value(inner, order[node_id], [local[i] for i in inner.inputs], block_params,
                                        block_state, None, masks=block_masks, key=block_key, **options)
                    if upd is not None:
                        updates[node_id] = upd
                    local[node_id] = y
                return {n: local[n] for n in read_after}, updates

            outputs, updates = jax.checkpoint(run_block)(own(params), own(state), values[block.input],
                                                         None if masks is None else own(masks), key)
            values.update(outputs)
            for node_id, update in updates.items():
                record(node_id, update)
            index = order[block.output] + 1
            continue
        y, upd = node_value(node, index, [values[i] for i in node.inputs], params, state, x, masks=masks, key=key,
                            **options)
        record(node.id, upd)
        values[node.id] = y
        if node.id == stop:
            break
        index += 1
    out = values[stop]
    if out.dtype != jnp.float32:
        out = out.astype(jnp.float32)
    return out, new_state, routing


def reference_dropout_masks(graph: Graph, batch_shape_of: Mapping[str, tuple], seed: int = 0) -> dict:
    """The NumPy reference's dropout masks for `seed` (float64 draws in graph order), as float32
    arrays of keep / (1 - rate): loss_and_grads then matches the reference even with dropout."""
    rng = np.random.default_rng(seed)
    masks = {}
    for node in graph.nodes:
        if node.op == "dropout" and node.attrs["rate"] > 0.0:
            rate = node.attrs["rate"]
            keep = rng.random(batch_shape_of[node.id]) >= rate
            masks[node.id] = np.where(keep, 1.0 / (1.0 - rate), 0.0).astype(np.float32)
    return masks


def lower_graph(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str,
                placement=None) -> JaxModel:
    """A JaxModel on `placement` (default: the first local device)."""
    from aiperf_backends.jax.distributed import Placement

    model = JaxModel(graph, precision, placement or Placement.default())
    model.load_canonical(weights)
    return model
