"""NumPy reference executor for the aiperf graph IR: forward, backward and loss.

This is the numerical oracle every framework backend is compared against, so
each op is written for clarity first and speed second. Layouts are the IR's:
NHWC activations, HWIO conv kernels, dense kernels (in, out), explicit
per-side padding [top, bottom, left, right].

Public API
----------
``forward(graph, weights, x, *, training=False, dtype=np.float64, seed=0)``
    The output node's value for a batch ``x`` of shape (N, H, W, C), or (N, C)
    for a flat input.
``run(..., checkpoint_blocks=False)`` (same arguments) -> :class:`Trace`
    Every node's output plus what :func:`backward` needs, and the batch-norm
    moving-statistics updates of a training step. With ``checkpoint_blocks``
    (activation checkpointing, TrainConfig.checkpoint_blocks) the trace keeps,
    of each block of ``Graph.blocks()``, only the outputs that something
    outside the block reads (its output, the next block's input): backward
    recomputes the block's forward pass from its input, with the dropout
    generator's state as the block started, just before it backpropagates
    through it, then drops those activations again. The arithmetic is the same,
    so the gradients are identical to the plain pass's.
``backward(trace, grad_output)`` -> ``(grad_input, param_grads)``
    Reverse-mode gradients. ``param_grads`` is shaped like the weights but
    holds only the trainable parameters (kernel, bias, gamma, beta).
``loss_and_grads(graph, weights, x, labels, *, label_smoothing=0.0,
training=True, dtype=np.float64, seed=0, checkpoint_blocks=False,
moe_aux_loss=0.0, expert_load=None)`` -> ``(loss, param_grads, moving_updates)``
    Mean categorical cross-entropy over the batch, its parameter gradients
    and the batch-norm moving-statistics updates. With ``moe_aux_loss`` the
    gradients include each moe's load-balancing loss (the loss returned does
    not); ``expert_load`` collects the routing counts.
``expert_load(graph, weights, x, *, dtype=np.float64)`` -> ``{moe id: counts}``
    The (token, choice) assignments each expert of each moe receives from
    the batch.

Semantics
---------
* Computation runs in ``dtype`` (float32 or float64); the input and the
  weights are cast to it, and every returned array has it.
* ``batch_norm`` normalises over every axis but the last (channels):
  (N, H, W) for images, (N,) for flat inputs.

  - Inference: ``y = (x - moving_mean) / sqrt(moving_variance + epsilon) * gamma + beta``.
  - Training: the same formula with the batch mean and the *biased* batch
    variance (divided by m = N*H*W). The moving statistics are not changed
    in place; the new values are reported as
    ``new = momentum * old + (1 - momentum) * batch_stat``, where the batch
    variance used for this update is the *unbiased* (Bessel-corrected,
    ``var * m / (m - 1)``) one, as PyTorch and TensorFlow's fused batch norm
    do. With m == 1 the correction factor is taken as 1 (TensorFlow's rule).
* ``dropout`` is the identity in inference. In training it is inverted
  dropout: ``y = x * keep / (1 - rate)`` with ``keep = u >= rate`` where
  ``u = rng.random(x.shape)`` (float64 draws, so float32 and float64 runs use
  the same mask) and ``rng = np.random.default_rng(seed)`` is created once
  per run and drawn from by dropout nodes in graph (topological) order. A
  given seed therefore always gives the same masks.
* ``max_pool`` treats padding as -inf. Its gradient goes to the first maximum
  of each window in row-major (kh, kw) order.
* ``relu``'s gradient at exactly 0 is 0.
* ``softmax`` runs over the last axis, shifted by the row maximum.
* Sequence graphs: the input is integer token ids (N, S) below the token input's ``vocab``;
  ``embedding`` looks rows up (its backward adds each token's gradient into its row and gives the
  ids no gradient); ``dense``, ``layer_norm`` (biased variance over the last axis), ``gelu`` (tanh
  form) and ``softmax`` work over the last axis of (N, S, D); ``attention`` splits its (N, S, A*d)
  query, key and value into A heads of width d, scales the scores by 1/sqrt(d), masks the pairs
  j > i when causal (their probability is exactly 0), and joins the heads again. With ``kv_heads``
  (grouped-query attention) the key and value have kv_heads heads and query head h reads key-value head
  h // (heads / kv_heads); a key-value head's gradient is the sum of its query heads' contributions.
* The Llama family's ops: ``rms_norm`` is ``x / sqrt(mean(x^2) + epsilon) * gamma`` over the last axis;
  ``rotary`` rotates each head's pairs (i, i + head_dim/2) of (N, S, heads * head_dim) by
  ``p * base^(-2i/head_dim)`` at position p, with the angles and their cos and sin computed in float64
  whatever the run's dtype (its backward rotates back); ``silu`` is ``x * sigmoid(x)``; ``mul`` is the
  elementwise product of its two inputs. A ``moe`` with ``mlp: swiglu`` has experts
  ``(silu(x w_gate[e]) * (x w_in[e])) w_out[e]``, routed and gated as the GELU experts.
* A ``moe``'s load-balancing loss (TrainConfig.moe_aux_loss, coefficient alpha) is
  ``alpha * mean_b(E * sum_e f[b, e] * P[b, e])`` over the batch's sequences b: ``f[b, e]`` the share of
  sequence b's S * top_k assignments routed to expert e (a constant: routing has no gradient),
  ``P[b, e]`` the mean over its tokens of the router's softmax over all E experts. Its gradient
  reaches the router and the moe's input through that softmax; it is 1 * alpha at an even load.
* ``conv2d`` with ``groups`` convolves each group of input channels with its block of filters;
  ``lrn`` is ONNX's LRN over the channel axis; ``avg_pool`` averages each window over its real taps,
  or over every tap, padded ones included, with ``count_padding``; ``mul_const`` and ``add_const``
  apply their constant ``value`` (per channel or one scalar) and have no trainable parameter;
  ``channel_shuffle`` is ShuffleNet's (g, C/g) -> (C/g, g) transpose of the channels.
* The loss targets are ``one_hot(labels) * (1 - label_smoothing) +
  label_smoothing / classes``, one label per image, or per token (labels (N, S)) for a sequence
  output (N, S, classes); the loss is the mean over every label. If the output node is a softmax, the loss is
  computed from its logits with a stable log-softmax and the gradient enters
  the graph at the logits as ``(p - y) / N``. Otherwise the output is taken
  as probabilities: ``loss = -mean_n sum_c y * log(clip(p, 1e-7, 1 - 1e-7))``,
  and the gradient is zero where ``p`` lies outside the clip range.

Speed: convolutions are im2col (``sliding_window_view`` on the padded input)
plus one GEMM; their backward passes are two GEMMs and a col2im that adds the
kh*kw shifted slices with strided slice-adds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from aiperf_core.errors import GraphError
from aiperf_core.ir import INPUT_OPS, Block, Graph, Node, is_trainable, kv_heads, moe_mlp
from aiperf_core.weights import validate_weights

__all__ = ["Replay", "Trace", "backward", "expert_load", "forward", "loss_and_grads", "run"]

GELU_C = float(np.sqrt(2.0 / np.pi))
PROBABILITY_CLIP = 1e-7
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))

Params = Mapping[str, np.ndarray]


@dataclass
class Trace:
    """A recorded forward pass: every node's output and what backward needs.

    ``outputs`` maps node id -> array (batch axis first). Treat the arrays as
    read-only: an identity op (inference dropout) may share its input's array.
    ``caches`` holds small per-node extras (batch-norm statistics, dropout
    masks, max-pool argmax). ``weights`` are the weights cast to ``dtype``.
    ``replays`` (activation checkpointing) maps the last node of each
    checkpointed block to its :class:`Replay`; the block's dropped outputs and
    its nodes' caches are absent outside the backward pass through it.
    ``expert_load`` maps each moe node to its experts' (token, choice)
    assignment counts, ``aux_losses`` each moe node to its load-balancing loss
    (coefficient included) when ``moe_aux_loss`` is positive.
    """

    graph: Graph
    weights: dict[str, dict[str, np.ndarray]]
    training: bool
    dtype: np.dtype
    seed: int
    outputs: dict[str, np.ndarray]
    moving_updates: dict[str, dict[str, np.ndarray]]
    caches: dict[str, dict[str, Any]] = field(default_factory=dict)
    replays: dict[str, "Replay"] = field(default_factory=dict)
    moe_aux_loss: float = 0.0
    expert_load: dict[str, np.ndarray] = field(default_factory=dict)
    aux_losses: dict[str, float] = field(default_factory=dict)

    @property
    def output(self) -> np.ndarray:
        return self.outputs[self.graph.output_id]


@dataclass
class Replay:
    """A checkpointed block of one forward pass: what backward needs to recompute it."""

    block: Block
    dropped: tuple[str, ...]  # its nodes whose outputs only the block itself reads
    rng: np.random.Generator | None = None  # the dropout generator as the block started


def _replays(graph: Graph) -> dict[str, Replay]:
    """A Replay (no generator yet) per block of the graph, by the block's last node."""
    replays = {}
    for block in graph.blocks():
        inside = set(block.nodes)
        dropped = tuple(nid for nid in block.nodes if nid not in (block.output, graph.output_id)
                        and all(reader.id in inside for reader in graph.consumers(nid)))
        replays[block.output] = Replay(block, dropped)
    return replays


@dataclass
class _Context:
    training: bool
    keep: bool  # record what backward needs
    rng: np.random.Generator
    moe_aux_loss: float = 0.0  # the load-balancing loss's coefficient: a moe caches its gradient when > 0
    moving_updates: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    expert_load: dict[str, np.ndarray] = field(default_factory=dict)
    aux_losses: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------
# Helpers shared by the windowed ops
# ---------------------------------------------------------------------------


def _pad(x: np.ndarray, padding, value: float) -> np.ndarray:
    pt, pb, pl, pr = padding
    if not (pt or pb or pl or pr):
        return x
    return np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)), mode="constant", constant_values=value)


def _out_size(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _window(xp: np.ndarray, i: int, j: int, strides, out_hw) -> np.ndarray:
    """The strided slice of padded ``xp`` that kernel offset (i, j) reads, shape (N, Ho, Wo, C)."""
    sh, sw = strides
    ho, wo = out_hw
    return xp[:, i : i + sh * (ho - 1) + 1 : sh, j : j + sw * (wo - 1) + 1 : sw, :]


def _im2col(x: np.ndarray, kernel, strides, padding) -> tuple[np.ndarray, tuple[int, int]]:
    """Patches of shape (N*Ho*Wo, kh*kw*C), columns in (kh, kw, C) order.

    That order matches an HWIO kernel reshaped to (kh*kw*C, filters), so a
    convolution is one GEMM: ``patches @ kernel.reshape(-1, filters)``.
    """
    kh, kw = kernel
    sh, sw = strides
    n, c = x.shape[0], x.shape[-1]
    xp = _pad(x, padding, 0.0)
    if kh == 1 and kw == 1:  # padding < kernel, so there is none
        view = xp[:, ::sh, ::sw, :]
        ho, wo = view.shape[1:3]
        return np.ascontiguousarray(view).reshape(n * ho * wo, c), (ho, wo)
    windows = sliding_window_view(xp, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # (N, Ho, Wo, C, kh, kw)
    ho, wo = windows.shape[1:3]
    patches = np.ascontiguousarray(windows.transpose(0, 1, 2, 4, 5, 3))  # (N, Ho, Wo, kh, kw, C)
    return patches.reshape(n * ho * wo, kh * kw * c), (ho, wo)


def _col2im(dpatches: np.ndarray, x_shape, kernel, strides, padding, out_hw) -> np.ndarray:
    """Adjoint of :func:`_im2col`: add each kernel offset's patch gradient back onto the input."""
    n, h, w, c = x_shape
    kh, kw = kernel
    sh, sw = strides
    pt, pb, pl, pr = padding
    ho, wo = out_hw
    if kh == 1 and kw == 1 and sh == 1 and sw == 1:
        return dpatches.reshape(n, h, w, c)
    d = dpatches.reshape(n, ho, wo, kh, kw, c)
    dxp = np.zeros((n, h + pt + pb, w + pl + pr, c), dtype=dpatches.dtype)
    for i in range(kh):
        for j in range(kw):
            _window(dxp, i, j, strides, out_hw)[...] += d[:, :, :, i, j, :]
    return dxp[:, pt : pt + h, pl : pl + w, :]


# ---------------------------------------------------------------------------
# Forward ops: (node, inputs, params, ctx) -> (output, cache or None)
# ---------------------------------------------------------------------------


def _conv2d(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    a = node.attrs
    patches, (ho, wo) = _im2col(x, a["kernel"], a["strides"], a["padding"])
    kernel = params["kernel"]
    groups = a.get("groups", 1)
    if groups > 1:
        kh, kw, cig, co = kernel.shape
        g_patches = patches.reshape(len(patches), kh * kw, groups, cig)
        g_kernel = kernel.reshape(kh * kw, cig, groups, co // groups).transpose(0, 2, 1, 3)  # (k, g, c, o)
        y = np.einsum("rkgc,kgco->rgo", g_patches, g_kernel, optimize=True).reshape(len(patches), co)
        if a["use_bias"]:
            y += params["bias"]
        return y.reshape(x.shape[0], ho, wo, co), None
    y = patches @ kernel.reshape(-1, kernel.shape[-1])
    if a["use_bias"]:
        y += params["bias"]
    return y.reshape(x.shape[0], ho, wo, kernel.shape[-1]), None


def _batch_norm(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    axes = tuple(range(x.ndim - 1))
    if ctx.training:
        mean = x.mean(axis=axes)
        var = np.square(x - mean).mean(axis=axes)  # biased: normalises the batch
        m = x.size // x.shape[-1]
        unbiased = var * (m / max(m - 1, 1))  # Bessel-corrected: feeds the moving average
        momentum = node.attrs["momentum"]
        ctx.moving_updates[node.id] = {
            "moving_mean": momentum * params["moving_mean"] + (1.0 - momentum) * mean,
            "moving_variance": momentum * params["moving_variance"] + (1.0 - momentum) * unbiased,
        }
    else:
        mean, var = params["moving_mean"], params["moving_variance"]
    inv_std = 1.0 / np.sqrt(var + node.attrs["epsilon"])
    y = x - mean
    y *= params["gamma"] * inv_std
    y += params["beta"]
    return y, {"mean": mean, "inv_std": inv_std}


def _relu(node: Node, inputs, params: Params, ctx: _Context):
    return np.maximum(inputs[0], 0), None


def _add(node: Node, inputs, params: Params, ctx: _Context):
    y = inputs[0] + inputs[1]
    for other in inputs[2:]:
        y += other
    return y, None


def _concat(node: Node, inputs, params: Params, ctx: _Context):
    return np.concatenate(inputs, axis=-1), None


def _max_pool(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    a = node.attrs
    kh, kw = a["kernel"]
    sh, sw = a["strides"]
    xp = _pad(x, a["padding"], -np.inf)
    out_hw = (_out_size(xp.shape[1], kh, sh), _out_size(xp.shape[2], kw, sw))
    best = _window(xp, 0, 0, a["strides"], out_hw).copy()
    argmax = np.zeros(best.shape, np.min_scalar_type(kh * kw - 1)) if ctx.keep else None
    for k in range(1, kh * kw):  # row-major over the window; strict '>' keeps the first maximum
        v = _window(xp, *divmod(k, kw), a["strides"], out_hw)
        if argmax is not None:
            np.putmask(argmax, v > best, k)
        np.maximum(best, v, out=best)
    return best, ({"argmax": argmax} if argmax is not None else None)


def _global_avg_pool(node: Node, inputs, params: Params, ctx: _Context):
    return inputs[0].mean(axis=(1, 2)), None


def _flatten(node: Node, inputs, params: Params, ctx: _Context):
    x = inputs[0]
    return x.reshape(x.shape[0], -1), None


def _dense(node: Node, inputs, params: Params, ctx: _Context):
    y = inputs[0] @ params["kernel"]
    if node.attrs["use_bias"]:
        y += params["bias"]
    return y, None


def _softmax(node: Node, inputs, params: Params, ctx: _Context):
    z = inputs[0] - inputs[0].max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True), None


def _dropout(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    rate = node.attrs["rate"]
    if not ctx.training or rate == 0.0:
        return x, None
    keep = ctx.rng.random(x.shape) >= rate  # float64 draws: the same mask whatever the dtype
    mask = np.where(keep, 1.0 / (1.0 - rate), 0.0).astype(x.dtype)
    return x * mask, {"mask": mask}


def _lrn_window_sum(v: np.ndarray, size: int) -> np.ndarray:
    """Sum over the channel window [c - (size-1)/2, c + (size-1)/2] (clipped at the edges), last axis."""
    half = (size - 1) // 2
    padded = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(half + 1, half)])
    csum = np.cumsum(padded, axis=-1)
    return csum[..., size:] - csum[..., :-size]


def _lrn(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    a = node.attrs
    s = a["bias"] + (a["alpha"] / a["size"]) * _lrn_window_sum(x * x, a["size"])
    return x * s ** -a["beta"], {"s": s}


def _avg_pool_divisor(x_shape, a, out_hw, dtype) -> np.ndarray | float:
    """Each output's divisor: every tap (count_padding), or the real taps of its window."""
    kh, kw = a["kernel"]
    if a["count_padding"] or not any(a["padding"]):
        return float(kh * kw)
    ones = _pad(np.ones((1,) + tuple(x_shape[1:3]) + (1,), dtype), a["padding"], 0.0)
    count = np.zeros((1,) + tuple(out_hw) + (1,), dtype)
    for i in range(kh):
        for j in range(kw):
            count += _window(ones, i, j, a["strides"], out_hw)
    return count


def _avg_pool(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    a = node.attrs
    kh, kw = a["kernel"]
    xp = _pad(x, a["padding"], 0.0)
    out_hw = (_out_size(xp.shape[1], kh, a["strides"][0]), _out_size(xp.shape[2], kw, a["strides"][1]))
    total = np.zeros((x.shape[0],) + out_hw + (x.shape[-1],), x.dtype)
    for i in range(kh):
        for j in range(kw):
            total += _window(xp, i, j, a["strides"], out_hw)
    divisor = _avg_pool_divisor(x.shape, a, out_hw, x.dtype)
    return total / divisor, {"divisor": divisor}


def _mul_const(node: Node, inputs, params: Params, ctx: _Context):
    return inputs[0] * params["value"], None


def _add_const(node: Node, inputs, params: Params, ctx: _Context):
    return inputs[0] + params["value"], None


def _shuffle(x: np.ndarray, groups: int) -> np.ndarray:
    *lead, c = x.shape
    return x.reshape(*lead, groups, c // groups).swapaxes(-1, -2).reshape(*lead, c)


def _channel_shuffle(node: Node, inputs, params: Params, ctx: _Context):
    return _shuffle(inputs[0], node.attrs["groups"]), None


def _embedding(node: Node, inputs, params: Params, ctx: _Context):
    return params["table"][inputs[0]], None


def _position_embedding(node: Node, inputs, params: Params, ctx: _Context):
    return inputs[0] + params["table"], None


def _layer_norm(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    inv_std = 1.0 / np.sqrt(np.square(centred).mean(axis=-1, keepdims=True) + node.attrs["epsilon"])
    xhat = centred * inv_std
    return xhat * params["gamma"] + params["beta"], {"xhat": xhat, "inv_std": inv_std}


def _heads(t: np.ndarray, heads: int) -> np.ndarray:
    """(N, S, A*d) -> (N, A, S, d)."""
    n, s, width = t.shape
    return t.reshape(n, s, heads, width // heads).transpose(0, 2, 1, 3)


def _join_heads(t: np.ndarray) -> np.ndarray:
    """(N, A, S, d) -> (N, S, A*d)."""
    n, a, s, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(n, s, a * d)


def _attention_heads(attrs, inputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The query (N, A, S, d) and the key and value repeated to one head per query head: query head h
    reads key-value head h // (heads / kv_heads) (grouped-query attention; the identity without it)."""
    query, key, value = inputs
    group = attrs["heads"] // kv_heads(attrs)
    q = _heads(query, attrs["heads"])
    k, v = (np.repeat(_heads(t, kv_heads(attrs)), group, axis=1) for t in (key, value))
    return q, k, v


def _attention(node: Node, inputs, params: Params, ctx: _Context):
    a = node.attrs
    q, k, v = _attention_heads(a, inputs)
    scale = 1.0 / np.sqrt(a["head_dim"])
    scores = (q @ k.swapaxes(-1, -2)) * scale
    if a["causal"]:
        seq = scores.shape[-1]
        scores = np.where(np.tri(seq, dtype=bool), scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return _join_heads(p @ v), {"p": p}


def _gelu(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    t = np.tanh(GELU_C * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1.0 + t), {"t": t}


def _moe_route(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each token's chosen experts (T, k) by its router logits (T, E), best first, ties to the lower index,
    and their gates: the router's softmax over those experts, which is its softmax over all renormalised
    over the chosen."""
    chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    picked = np.take_along_axis(logits, chosen, axis=-1)
    gates = np.exp(picked - picked.max(axis=-1, keepdims=True))
    return chosen, gates / gates.sum(axis=-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))  # no overflow at either end, full relative precision near 0


def _gelu_expert(tokens: np.ndarray, params: Params, e: int):
    """A GELU expert's output for its (T, D) tokens, and what its backward needs."""
    h = tokens @ params["w_in"][e] + params["b_in"][e]
    t = np.tanh(GELU_C * (h + 0.044715 * h ** 3))
    return (0.5 * h * (1.0 + t)) @ params["w_out"][e] + params["b_out"][e], (h, t)


def _swiglu_expert(tokens: np.ndarray, params: Params, e: int):
    """A SwiGLU expert's output, (silu(x w_gate) * (x w_in)) w_out, and what its backward needs."""
    gate, up = tokens @ params["w_gate"][e], tokens @ params["w_in"][e]
    s = _sigmoid(gate)
    return (gate * s * up) @ params["w_out"][e], (gate, s, up)


def _load_balance(logits: np.ndarray, chosen: np.ndarray, sequences: int, alpha: float) -> tuple[float, np.ndarray]:
    """The load-balancing loss of one moe (TrainConfig.moe_aux_loss) and its gradient at the router logits.

    alpha times the mean over the `sequences` of E sum_e f_e P_e: f_e the share of the sequence's S k
    assignments (`chosen`, (T, k)) that went to expert e, a constant (no gradient); P_e the mean over the
    sequence's S tokens of the softmax of their logits (T, E) over all E experts. Its gradient at the
    probabilities is alpha E f_e / (sequences S), taken through the softmax to the logits."""
    tokens, experts = logits.shape
    per_sequence, top_k = tokens // sequences, chosen.shape[-1]
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = (shifted / shifted.sum(axis=-1, keepdims=True)).reshape(sequences, per_sequence, experts)
    assigned = chosen.reshape(sequences, per_sequence * top_k)
    counts = (assigned[..., None] == np.arange(experts)).sum(axis=1)  # (sequences, E)
    f = (counts / (per_sequence * top_k)).astype(logits.dtype)
    loss = alpha * experts * float((f * probs.mean(axis=1)).sum()) / sequences
    dprobs = np.broadcast_to((alpha * experts / (sequences * per_sequence)) * f[:, None, :], probs.shape)
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))
    return loss, dlogits.reshape(tokens, experts)


def _moe(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    flat = x.reshape(-1, x.shape[-1])  # every token of every sequence
    logits = flat @ params["router"]
    chosen, gates = _moe_route(logits, node.attrs["top_k"])
    ctx.expert_load[node.id] = np.bincount(chosen.ravel(), minlength=node.attrs["experts"])
    expert = _swiglu_expert if moe_mlp(node.attrs) == "swiglu" else _gelu_expert
    y = np.zeros_like(flat)
    experts = []  # per expert: (its tokens, their slot in `chosen`, its MLP's state, its output)
    for e in range(node.attrs["experts"]):
        tokens, slot = np.nonzero(chosen == e)  # a token chooses an expert once: `tokens` has no repeats
        out, state = expert(flat[tokens], params, e)
        y[tokens] += gates[tokens, slot][:, None] * out
        experts.append((tokens, slot, state, out))
    cache = {"chosen": chosen, "gates": gates, "experts": experts}
    if ctx.moe_aux_loss > 0.0:
        ctx.aux_losses[node.id], cache["aux_dlogits"] = _load_balance(logits, chosen, x.shape[0], ctx.moe_aux_loss)
    return y.reshape(x.shape), cache


def _rms_norm(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    inv_rms = 1.0 / np.sqrt(np.square(x).mean(axis=-1, keepdims=True) + node.attrs["epsilon"])
    xhat = x * inv_rms
    return xhat * params["gamma"], {"xhat": xhat, "inv_rms": inv_rms}


def _rotary_angles(seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of theta (S, head_dim/2) = position * base^(-2i/head_dim), in float64 whatever the run's
    dtype: the table is data, and a float32 power of a large position would put its rounding into it."""
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    inv_freq = base ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    theta = positions * inv_freq
    return np.cos(theta), np.sin(theta)


def _rotate(x: np.ndarray, attrs, sign: float) -> np.ndarray:
    """Each head of (N, S, heads * head_dim) with its pairs (i, i + head_dim/2) rotated by sign * theta."""
    n, seq, width = x.shape
    d = attrs["head_dim"]
    cos, sin = (t.astype(x.dtype)[:, None, :] for t in _rotary_angles(seq, d, attrs["base"]))  # (S, 1, d/2)
    sin = sign * sin
    heads = x.reshape(n, seq, width // d, d)
    x1, x2 = heads[..., : d // 2], heads[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)


def _rotary(node: Node, inputs, params: Params, ctx: _Context):
    return _rotate(inputs[0], node.attrs, 1.0), None


def _silu(node: Node, inputs, params: Params, ctx: _Context):
    (x,) = inputs
    s = _sigmoid(x)
    return x * s, {"sigmoid": s}


def _mul(node: Node, inputs, params: Params, ctx: _Context):
    return inputs[0] * inputs[1], None


_FORWARD: dict[str, Callable] = {
    "conv2d": _conv2d,
    "batch_norm": _batch_norm,
    "relu": _relu,
    "add": _add,
    "concat": _concat,
    "max_pool": _max_pool,
    "global_avg_pool": _global_avg_pool,
    "flatten": _flatten,
    "dense": _dense,
    "softmax": _softmax,
    "dropout": _dropout,
    "lrn": _lrn,
    "avg_pool": _avg_pool,
    "mul_const": _mul_const,
    "add_const": _add_const,
    "channel_shuffle": _channel_shuffle,
    "embedding": _embedding,
    "position_embedding": _position_embedding,
    "layer_norm": _layer_norm,
    "attention": _attention,
    "gelu": _gelu,
    "moe": _moe,
    "rms_norm": _rms_norm,
    "rotary": _rotary,
    "silu": _silu,
    "mul": _mul,
}


# ---------------------------------------------------------------------------
# Backward ops: (node, dy, inputs, output, params, cache, training)
#   -> ([gradient per input], {param: gradient})
# None of them modifies dy or any input in place.
# ---------------------------------------------------------------------------


def _conv2d_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    a = node.attrs
    kernel = params["kernel"]
    filters = kernel.shape[-1]
    dy2 = dy.reshape(-1, filters)
    patches, out_hw = _im2col(x, a["kernel"], a["strides"], a["padding"])
    groups = a.get("groups", 1)
    if groups > 1:
        kh, kw, cig, co = kernel.shape
        g_patches = patches.reshape(len(patches), kh * kw, groups, cig)
        g_dy = dy2.reshape(len(dy2), groups, co // groups)
        g_kernel = kernel.reshape(kh * kw, cig, groups, co // groups).transpose(0, 2, 1, 3)
        dkernel = np.einsum("rkgc,rgo->kgco", g_patches, g_dy, optimize=True)
        grads = {"kernel": dkernel.transpose(0, 2, 1, 3).reshape(kernel.shape)}
        dpatches = np.einsum("rgo,kgco->rkgc", g_dy, g_kernel, optimize=True).reshape(patches.shape)
    else:
        grads = {"kernel": (patches.T @ dy2).reshape(kernel.shape)}
        dpatches = dy2 @ kernel.reshape(-1, filters).T
    if a["use_bias"]:
        grads["bias"] = dy2.sum(axis=0)
    dx = _col2im(dpatches, x.shape, a["kernel"], a["strides"], a["padding"], out_hw)
    return [dx], grads


def _batch_norm_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    axes = tuple(range(x.ndim - 1))
    gamma, inv_std = params["gamma"], cache["inv_std"]
    xhat = (x - cache["mean"]) * inv_std
    dbeta = dy.sum(axis=axes)
    dgamma = (dy * xhat).sum(axis=axes)
    if training:
        # The batch mean and variance depend on x too:
        # dx = gamma * inv_std * (dy - mean(dy) - xhat * mean(dy * xhat)).
        m = x.size // x.shape[-1]
        dx = (gamma * inv_std) * (dy - dbeta / m - xhat * (dgamma / m))
    else:
        dx = dy * (gamma * inv_std)
    return [dx], {"gamma": dgamma, "beta": dbeta}


def _relu_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [np.where(out > 0, dy, 0)], {}


def _add_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy] * len(inputs), {}


def _concat_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    bounds = np.cumsum([x.shape[-1] for x in inputs])[:-1]
    return np.split(dy, bounds, axis=-1), {}


def _max_pool_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    a = node.attrs
    kh, kw = a["kernel"]
    pt, pb, pl, pr = a["padding"]
    n, h, w, c = x.shape
    argmax = cache["argmax"]
    out_hw = dy.shape[1:3]
    dxp = np.zeros((n, h + pt + pb, w + pl + pr, c), dtype=dy.dtype)
    for k in range(kh * kw):
        _window(dxp, *divmod(k, kw), a["strides"], out_hw)[...] += np.where(argmax == k, dy, 0)
    return [dxp[:, pt : pt + h, pl : pl + w, :]], {}


def _global_avg_pool_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    dx = np.empty_like(x)
    dx[...] = (dy / (x.shape[1] * x.shape[2]))[:, None, None, :]
    return [dx], {}


def _flatten_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy.reshape(inputs[0].shape)], {}


def _dense_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    rows_x, rows_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])  # every position of a sequence
    grads = {"kernel": rows_x.T @ rows_dy}
    if node.attrs["use_bias"]:
        grads["bias"] = rows_dy.sum(axis=0)
    return [dy @ params["kernel"].T], grads


def _softmax_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    # J = diag(p) - p p^T (symmetric), so J @ dy = p * (dy - <dy, p>).
    return [out * (dy - (dy * out).sum(axis=-1, keepdims=True))], {}


def _dropout_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy * cache["mask"] if cache is not None else dy], {}


def _lrn_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    a = node.attrs
    s = cache["s"]
    # dx_i = dy_i s_i^-beta - (2 alpha beta / size) x_i sum_{j in window(i)} dy_j y_j / s_j (the window
    # is symmetric, so j's window holds i exactly when i's holds j).
    inner = _lrn_window_sum(dy * out / s, a["size"])
    return [dy * s ** -a["beta"] - (2.0 * a["alpha"] * a["beta"] / a["size"]) * x * inner], {}


def _avg_pool_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    a = node.attrs
    kh, kw = a["kernel"]
    pt, pb, pl, pr = a["padding"]
    n, h, w, c = x.shape
    share = dy / cache["divisor"]
    dxp = np.zeros((n, h + pt + pb, w + pl + pr, c), dtype=dy.dtype)
    for i in range(kh):
        for j in range(kw):
            _window(dxp, i, j, a["strides"], dy.shape[1:3])[...] += share
    return [dxp[:, pt : pt + h, pl : pl + w, :]], {}


def _mul_const_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy * params["value"]], {}


def _add_const_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy], {}


def _channel_shuffle_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    groups = node.attrs["groups"]
    return [_shuffle(dy, dy.shape[-1] // groups)], {}  # the inverse transpose


def _embedding_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    table = np.zeros(params["table"].shape, dy.dtype)
    np.add.at(table, inputs[0], dy)
    return [None], {"table": table}  # token ids have no gradient


def _position_embedding_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy], {"table": dy.sum(axis=0)}


def _layer_norm_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    xhat, inv_std = cache["xhat"], cache["inv_std"]
    lead = tuple(range(dy.ndim - 1))
    grads = {"gamma": (dy * xhat).sum(axis=lead), "beta": dy.sum(axis=lead)}
    dxhat = dy * params["gamma"]
    dx = inv_std * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                    - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [dx], grads


def _attention_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    a = node.attrs
    q, k, v = _attention_heads(a, inputs)
    p = cache["p"]
    do = _heads(dy, a["heads"])
    scale = 1.0 / np.sqrt(a["head_dim"])
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale  # masked pairs have p = 0
    dq = ds @ k
    dk = ds.swapaxes(-1, -2) @ q
    # A key-value head gets the sum of its query heads' contributions.
    n, heads, seq, d = dk.shape
    dk, dv = (t.reshape(n, kv_heads(a), heads // kv_heads(a), seq, d).sum(axis=2) for t in (dk, dv))
    return [_join_heads(dq), _join_heads(dk), _join_heads(dv)], {}


def _gelu_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    t = cache["t"]
    slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x * x)
    return [dy * slope], {}


def _gelu_expert_grad(tokens: np.ndarray, dout: np.ndarray, state, params: Params, e: int, grads) -> np.ndarray:
    """A GELU expert's backward: its parameter gradients into grads[...][e], and its tokens' gradient."""
    h, t = state
    grads["w_out"][e] = (0.5 * h * (1.0 + t)).T @ dout
    grads["b_out"][e] = dout.sum(axis=0)
    slope = 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * h * h)
    dh = (dout @ params["w_out"][e].T) * slope
    grads["w_in"][e] = tokens.T @ dh
    grads["b_in"][e] = dh.sum(axis=0)
    return dh @ params["w_in"][e].T


def _swiglu_expert_grad(tokens: np.ndarray, dout: np.ndarray, state, params: Params, e: int,
                        grads) -> np.ndarray:
    """A SwiGLU expert's backward: its parameter gradients into grads[...][e], and its tokens' gradient."""
    gate, s, up = state
    grads["w_out"][e] = (gate * s * up).T @ dout
    dhidden = dout @ params["w_out"][e].T
    dgate = dhidden * up * s * (1.0 + gate * (1.0 - s))  # silu'(g) = s (1 + g (1 - s))
    dup = dhidden * gate * s
    grads["w_gate"][e] = tokens.T @ dgate
    grads["w_in"][e] = tokens.T @ dup
    return dgate @ params["w_gate"][e].T + dup @ params["w_in"][e].T


def _moe_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    flat, flat_dy = x.reshape(-1, x.shape[-1]), dy.reshape(-1, x.shape[-1])
    gates = cache["gates"]
    expert_grad = _swiglu_expert_grad if moe_mlp(node.attrs) == "swiglu" else _gelu_expert_grad
    dgates = np.zeros_like(gates)
    dx = np.zeros_like(flat)
    grads = {name: np.zeros_like(weight) for name, weight in params.items() if name != "router"}
    for e, (tokens, slot, state, expert_out) in enumerate(cache["experts"]):
        dgates[tokens, slot] = (flat_dy[tokens] * expert_out).sum(axis=-1)
        dout = flat_dy[tokens] * gates[tokens, slot][:, None]
        dx[tokens] += expert_grad(flat[tokens], dout, state, params, e, grads)  # no repeats in `tokens`
    # The gates are a softmax over the chosen logits; the others get no gradient.
    dpicked = gates * (dgates - (dgates * gates).sum(axis=-1, keepdims=True))
    dlogits = np.zeros((flat.shape[0], node.attrs["experts"]), dy.dtype)
    np.put_along_axis(dlogits, cache["chosen"], dpicked, axis=-1)
    if "aux_dlogits" in cache:  # the load-balancing loss's, through the softmax over every expert
        dlogits += cache["aux_dlogits"]
    grads["router"] = flat.T @ dlogits
    dx += dlogits @ params["router"].T
    return [dx.reshape(x.shape)], grads


def _rms_norm_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    xhat, inv_rms = cache["xhat"], cache["inv_rms"]
    lead = tuple(range(dy.ndim - 1))
    dxhat = dy * params["gamma"]
    dx = inv_rms * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return [dx], {"gamma": (dy * xhat).sum(axis=lead)}


def _rotary_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [_rotate(dy, node.attrs, -1.0)], {}  # a rotation's transpose is its inverse


def _silu_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    (x,) = inputs
    s = cache["sigmoid"]
    return [dy * s * (1.0 + x * (1.0 - s))], {}


def _mul_grad(node: Node, dy, inputs, out, params: Params, cache, training: bool):
    return [dy * inputs[1], dy * inputs[0]], {}


_BACKWARD: dict[str, Callable] = {
    "conv2d": _conv2d_grad,
    "batch_norm": _batch_norm_grad,
    "relu": _relu_grad,
    "add": _add_grad,
    "concat": _concat_grad,
    "max_pool": _max_pool_grad,
    "global_avg_pool": _global_avg_pool_grad,
    "flatten": _flatten_grad,
    "dense": _dense_grad,
    "softmax": _softmax_grad,
    "dropout": _dropout_grad,
    "lrn": _lrn_grad,
    "avg_pool": _avg_pool_grad,
    "mul_const": _mul_const_grad,
    "add_const": _add_const_grad,
    "channel_shuffle": _channel_shuffle_grad,
    "embedding": _embedding_grad,
    "position_embedding": _position_embedding_grad,
    "layer_norm": _layer_norm_grad,
    "attention": _attention_grad,
    "gelu": _gelu_grad,
    "moe": _moe_grad,
    "rms_norm": _rms_norm_grad,
    "rotary": _rotary_grad,
    "silu": _silu_grad,
    "mul": _mul_grad,
}


# ---------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------


def _check_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in _DTYPES:
        raise ValueError(f"dtype must be float32 or float64, got {dt}")
    return dt


def _check_input(graph: Graph, x, dt: np.dtype) -> np.ndarray:
    node = graph.input_id
    arr = np.asarray(x)
    want = tuple(graph.input_shape)
    expected = "[N, " + ", ".join(str(d) for d in want) + "]"
    if arr.ndim != len(want) + 1 or tuple(arr.shape[1:]) != want:
        raise GraphError(f"input batch has shape {list(arr.shape)}, expected {expected}", node)
    if arr.shape[0] < 1:
        raise GraphError(f"input batch is empty (shape {list(arr.shape)})", node)
    if graph.takes_tokens:
        if arr.dtype.kind not in "iu":
            raise GraphError(f"token ids must be integers, got dtype {arr.dtype}", node)
        if arr.min() < 0 or arr.max() >= graph.vocab:
            raise GraphError(f"token ids must lie in [0, {graph.vocab}), got values in [{arr.min()}, {arr.max()}]",
                             node)
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind not in "fiu":
        raise GraphError(f"input batch must hold real numbers, got dtype {arr.dtype}", node)
    return arr.astype(dt, copy=False)


def _cast_weights(graph: Graph, weights, dt: np.dtype) -> dict[str, dict[str, np.ndarray]]:
    if not isinstance(weights, Mapping):
        raise GraphError(f"weights must be a mapping {{node id: {{param: array}}}}, got {type(weights).__name__}")
    validate_weights(graph, weights)
    return {nid: {p: np.asarray(a, dtype=dt) for p, a in params.items()} for nid, params in weights.items()}


def _execute(graph: Graph, weights, x, *, training: bool, dtype, seed: int, keep: bool,
             checkpoint_blocks: bool = False, moe_aux_loss: float = 0.0):
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be an aiperf_core.ir.Graph, got {type(graph).__name__}")
    dt = _check_dtype(dtype)
    w = _cast_weights(graph, weights, dt)
    x = _check_input(graph, x, dt)
    if not (np.isfinite(moe_aux_loss) and moe_aux_loss >= 0.0):
        raise ValueError(f"moe_aux_loss must be a finite number >= 0, got {moe_aux_loss}")
    ctx = _Context(training=bool(training), keep=keep, rng=np.random.default_rng(seed),
                   moe_aux_loss=float(moe_aux_loss))
    replays = _replays(graph) if keep and checkpoint_blocks else {}
    starts = {replay.block.nodes[0]: replay for replay in replays.values()}
    in_blocks = {nid for replay in replays.values() for nid in replay.block.nodes}
    # Without keep, drop each value after its last reader to bound memory.
    last_reader = {}
    if not keep:
        for index, node in enumerate(graph.nodes):
            for i in node.inputs:
                last_reader[i] = index
    values: dict[str, np.ndarray] = {}
    caches: dict[str, dict[str, Any]] = {}
    for index, node in enumerate(graph.nodes):
        if node.id in starts:  # the block's dropout masks must be drawn again in its replay
            starts[node.id].rng = copy.deepcopy(ctx.rng)
        if node.op in INPUT_OPS:
            out, cache = x, None
        else:
            out, cache = _FORWARD[node.op](node, [values[i] for i in node.inputs], w.get(node.id, {}), ctx)
        values[node.id] = out
        if keep and cache is not None and node.id not in in_blocks:
            caches[node.id] = cache
        if not keep:
            for i in node.inputs:
                if last_reader[i] == index:
                    del values[i]
        if node.id in replays:  # a checkpointed block ends: backward recomputes what only it reads
            for nid in replays[node.id].dropped:
                del values[nid]
    return Trace(graph, w, ctx.training, dt, seed, values, ctx.moving_updates, caches, replays,
                 moe_aux_loss=ctx.moe_aux_loss, expert_load=ctx.expert_load, aux_losses=ctx.aux_losses)


def forward(graph: Graph, weights, x, *, training: bool = False, dtype=np.float64, seed: int = 0) -> np.ndarray:
    """The output node's value for the batch ``x`` (N, H, W, C) or (N, C)."""
    trace = _execute(graph, weights, x, training=training, dtype=dtype, seed=seed, keep=False)
    return trace.output


def run(graph: Graph, weights, x, *, training: bool = False, dtype=np.float64, seed: int = 0,
        checkpoint_blocks: bool = False, moe_aux_loss: float = 0.0) -> Trace:
    """Forward pass that keeps what :func:`backward` needs: every node's output, or with
    ``checkpoint_blocks`` only each checkpointed block's input and what is read outside it. With
    ``moe_aux_loss`` (alpha > 0) each moe's load-balancing loss is in ``Trace.aux_losses`` and its
    gradient is added by :func:`loss_and_grads`' backward pass."""
    return _execute(graph, weights, x, training=training, dtype=dtype, seed=seed, keep=True,
                    checkpoint_blocks=checkpoint_blocks, moe_aux_loss=moe_aux_loss)


def expert_load(graph: Graph, weights, x, *, dtype=np.float64) -> dict[str, tuple[int, ...]]:
    """Per moe node id, the (token, choice) assignments each of its experts receives from the batch ``x``:
    E counts summing to the batch's tokens times top_k (EpochReport.expert_load of one step on ``x``);
    empty for a graph without a moe."""
    trace = _execute(graph, weights, x, training=True, dtype=dtype, seed=0, keep=False)
    return {nid: tuple(int(c) for c in counts) for nid, counts in trace.expert_load.items()}


def _recompute(trace: Trace, replay: Replay) -> None:
    """A checkpointed block's forward pass again, from its kept input: its dropped outputs and its
    nodes' caches back in the trace (the same arithmetic and dropout masks as the first pass)."""
    # A copy of the generator: a trace may be backpropagated more than once. The moving statistics
    # of a batch norm in the block were recorded by the first pass; this context's are dropped.
    ctx = _Context(training=trace.training, keep=True, rng=copy.deepcopy(replay.rng), moe_aux_loss=trace.moe_aux_loss)
    for nid in replay.block.nodes:
        node = trace.graph[nid]
        out, cache = _FORWARD[node.op](node, [trace.outputs[i] for i in node.inputs], trace.weights.get(nid, {}), ctx)
        if nid in replay.dropped:
            trace.outputs[nid] = out
        if cache is not None:
            trace.caches[nid] = cache


def _forget(trace: Trace, replay: Replay) -> None:
    """Drop a block's recomputed activations once backward has passed through it."""
    for nid in replay.dropped:
        trace.outputs.pop(nid, None)
    for nid in replay.block.nodes:
        trace.caches.pop(nid, None)


def _backward_from(trace: Trace, start: str, grad: np.ndarray):
    """Propagate ``grad`` (d loss / d output of node ``start``) back to the input and the parameters."""
    graph = trace.graph
    grads: dict[str, np.ndarray] = {start: grad}
    param_grads: dict[str, dict[str, np.ndarray]] = {nid: {} for nid in graph.all_param_shapes()}
    grad_input = None
    block_starts = {replay.block.nodes[0]: replay for replay in trace.replays.values()}
    for node in reversed(graph.nodes):
        if node.id in trace.replays:  # a checkpointed block, met at its last node
            _recompute(trace, trace.replays[node.id])
        dy = grads.pop(node.id, None)
        if dy is None:  # downstream of start, or unreachable from it
            pass
        elif node.op in INPUT_OPS:
            grad_input = dy
        else:
            dxs, pgrads = _BACKWARD[node.op](
                node, dy, [trace.outputs[i] for i in node.inputs], trace.outputs[node.id],
                trace.weights.get(node.id, {}), trace.caches.get(node.id), trace.training,
            )
            if pgrads:
                param_grads[node.id].update(pgrads)
            for i, dx in zip(node.inputs, dxs):
                if dx is None:  # no gradient (token ids)
                    continue
                grads[i] = dx if i not in grads else grads[i] + dx  # never in place: dx may be shared
        if node.id in block_starts:
            _forget(trace, block_starts[node.id])
    for nid, shapes in graph.all_param_shapes().items():
        for pname, shape in shapes.items():
            if is_trainable(pname) and pname not in param_grads[nid]:
                param_grads[nid][pname] = np.zeros(shape, trace.dtype)
    if grad_input is None:
        grad_input = np.zeros(trace.outputs[graph.input_id].shape, trace.dtype)
    return np.ascontiguousarray(grad_input), param_grads


def backward(trace: Trace, grad_output) -> tuple[np.ndarray, dict[str, dict[str, np.ndarray]]]:
    """Gradients of ``sum(trace.output * grad_output)`` w.r.t. the input and the trainable parameters.

    Returns ``(grad_input, param_grads)``; ``param_grads`` is
    ``{node id: {"kernel"|"bias"|"gamma"|"beta": array}}``. In training mode
    batch norm is differentiated through its batch statistics; in inference
    mode it is the affine map of the moving statistics.
    """
    g = np.asarray(grad_output, dtype=trace.dtype)
    if g.shape != trace.output.shape:
        raise GraphError(
            f"grad_output has shape {list(g.shape)}, expected the output's {list(trace.output.shape)}",
            trace.graph.output_id,
        )
    return _backward_from(trace, trace.graph.output_id, g)


def _targets(labels, shape: tuple[int, ...], classes: int, label_smoothing: float, dt: np.dtype,
             node: str) -> np.ndarray:
    """Smoothed one-hot targets of shape `shape` + (classes,): one label per image or per token."""
    lab = np.asarray(labels)
    if lab.shape != shape:
        what = "one class index per image" if len(shape) == 1 else "one class index per position"
        raise GraphError(f"labels have shape {list(lab.shape)}, expected {list(shape)} ({what})", node)
    if lab.dtype.kind not in "iu":
        raise GraphError(f"labels must be integer class indices, got dtype {lab.dtype}", node)
    if lab.min() < 0 or lab.max() >= classes:
        raise GraphError(f"labels must lie in [0, {classes}), got values in [{lab.min()}, {lab.max()}]", node)
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    y = np.full(shape + (classes,), ls / classes, dtype=dt)
    np.put_along_axis(y, lab[..., None], ls / classes + (1.0 - ls), axis=-1)
    return y


def loss_and_grads(
    graph: Graph, weights, x, labels, *, label_smoothing: float = 0.0, training: bool = True,
    dtype=np.float64, seed: int = 0, checkpoint_blocks: bool = False, moe_aux_loss: float = 0.0,
    expert_load: dict[str, np.ndarray] | None = None,
) -> tuple[float, dict[str, dict[str, np.ndarray]], dict[str, dict[str, np.ndarray]]]:
    """Mean categorical cross-entropy against smoothed one-hot labels, its parameter gradients
    and the batch-norm moving-statistics updates (empty in inference mode); with
    ``checkpoint_blocks``, by a trace that recomputes each block in the backward pass (:func:`run`).

    ``moe_aux_loss`` (TrainConfig.moe_aux_loss): the gradients are those of the cross-entropy plus each
    moe's load-balancing loss with this coefficient; the returned loss stays the cross-entropy alone, as
    EpochReport.loss does (the aux term's value is in :func:`run`'s ``Trace.aux_losses``).
    ``expert_load``: a dict to which each moe node's routing counts of this batch are added (its E
    counts, int64), so that a training loop sums them over its steps and micro-batches."""
    trace = run(graph, weights, x, training=training, dtype=dtype, seed=seed, checkpoint_blocks=checkpoint_blocks,
                moe_aux_loss=moe_aux_loss)
    if expert_load is not None:
        for nid, counts in trace.expert_load.items():
            expert_load[nid] = expert_load[nid] + counts if nid in expert_load else counts.copy()
    out_id = graph.output_id
    if len(graph.output_shape) not in (1, 2):
        raise GraphError(f"the loss needs a class output per sample (classes) or per position (S, classes), "
                         f"got shape {list(graph.output_shape)}", out_id)
    p = trace.output
    classes = p.shape[-1]
    y = _targets(labels, p.shape[:-1], classes, label_smoothing, trace.dtype, out_id)
    n = p.size // classes  # every label: images, or tokens of every sequence
    out_node = graph[out_id]
    if out_node.op == "softmax":
        logits_id = out_node.inputs[0]
        z = trace.outputs[logits_id]
        shifted = z - z.max(axis=-1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        loss = -(y * log_p).sum() / n
        _, param_grads = _backward_from(trace, logits_id, (p - y) / n)
    else:
        lo, hi = PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP
        clipped = np.clip(p, lo, hi)
        loss = -(y * np.log(clipped)).sum() / n
        dp = np.where((p >= lo) & (p <= hi), -y / (clipped * n), 0).astype(trace.dtype)
        _, param_grads = _backward_from(trace, out_id, dp)
    return float(loss), param_grads, trace.moving_updates
