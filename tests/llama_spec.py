"""A float64 NumPy reading of the IR's spec of the Llama family's ops (schema 4: rms_norm, rotary, silu, mul,
grouped-query attention, SwiGLU experts) and of the ops a Llama graph or the kit's cases put around them, written
from the IR's docstring independently of the NumPy reference backend: the backends' tests hold their lowerings
to it as a second reading of the spec, not to the reference's."""

from __future__ import annotations

import numpy as np

from aiperf_conformance.cases import SEQUENCE_CASES, case_input, trained_looking_weights
from aiperf_core.ir import VERSION_4_OPS, Graph, kv_heads, moe_mlp

# The kit's cases of schema 4: its new ops, and attention and moe with their new attributes.
NEW_CASES = {case.name: case for case in SEQUENCE_CASES
             if any(n.op in VERSION_4_OPS or "kv_heads" in n.attrs or "mlp" in n.attrs for n in case.nodes)}


def silu(x):
    return x / (1.0 + np.exp(-x))


def rotary(x, head_dim: int, base: float):
    """Half-split rotary embedding of an (N, S, W) array, each head_dim-wide slice of W one head."""
    n, s, w = x.shape
    half = head_dim // 2
    theta = np.arange(s)[:, None] * base ** (-2.0 * np.arange(half) / head_dim)  # (S, d/2)
    heads = x.reshape(n, s, w // head_dim, head_dim)
    x1, x2 = heads[..., :half], heads[..., half:]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(n, s, w)


def attention(q, k, v, attrs):
    n, s, _ = q.shape
    heads, d, kv = attrs["heads"], attrs["head_dim"], kv_heads(attrs)
    out = np.empty_like(q)
    for h in range(heads):
        g = h // (heads // kv)  # the key-value head query head h reads
        scores = q[..., h * d:(h + 1) * d] @ k[..., g * d:(g + 1) * d].transpose(0, 2, 1) / np.sqrt(d)
        if attrs["causal"]:
            scores = np.where(np.tri(s, dtype=bool), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[..., h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ v[..., g * d:(g + 1) * d]
    return out


def moe(x, attrs, w):
    """SwiGLU experts (the only kind read here)."""
    if moe_mlp(attrs) != "swiglu":
        raise AssertionError(f"no spec here for a moe with mlp {moe_mlp(attrs)!r}")
    logits = x @ w["router"]
    out = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        token, row = x[index], logits[index]
        chosen = np.argsort(-row, kind="stable")[:attrs["top_k"]]
        gates = np.exp(row[chosen] - row[chosen].max())
        for e, gate in zip(chosen, gates / gates.sum()):
            hidden = silu(token @ w["w_gate"][e]) * (token @ w["w_in"][e])
            out[index] += gate * (hidden @ w["w_out"][e])
    return out


def pointwise_conv2d(x, attrs, w):
    """A 1x1 convolution without stride or padding: a product over the channels (the last axis)."""
    if tuple(attrs["kernel"]) != (1, 1) or tuple(attrs["strides"]) != (1, 1) or any(attrs["padding"]):
        raise AssertionError(f"no spec here for a conv2d other than 1x1 unpadded at stride 1: {attrs}")
    return x @ w["kernel"][0, 0] + (w["bias"] if "bias" in w else 0.0)


def spec_forward(graph: Graph, weights, x):
    """The graph's output in float64, from the IR's definitions of its ops."""
    values = {}
    w64 = {n: {p: a.astype(np.float64) for p, a in ps.items()} for n, ps in weights.items()}
    for node in graph.nodes:
        a, w = node.attrs, w64.get(node.id, {})
        args = [values[i] for i in node.inputs]
        if node.op == "input":
            y = x.astype(np.float64)
        elif node.op == "token_input":
            y = x
        elif node.op == "embedding":
            y = w["table"][args[0]]
        elif node.op == "dense":
            y = args[0] @ w["kernel"] + (w["bias"] if "bias" in w else 0.0)
        elif node.op == "conv2d":
            y = pointwise_conv2d(args[0], a, w)
        elif node.op == "rms_norm":
            y = args[0] / np.sqrt((args[0] ** 2).mean(-1, keepdims=True) + a["epsilon"]) * w["gamma"]
        elif node.op == "rotary":
            y = rotary(args[0], a["head_dim"], a["base"])
        elif node.op == "silu":
            y = silu(args[0])
        elif node.op in ("mul", "add"):
            y = args[0] * args[1] if node.op == "mul" else args[0] + args[1]
        elif node.op == "attention":
            y = attention(*args, a)
        elif node.op == "moe":
            y = moe(args[0], a, w)
        elif node.op == "softmax":
            e = np.exp(args[0] - args[0].max(-1, keepdims=True))
            y = e / e.sum(-1, keepdims=True)
        else:
            raise AssertionError(f"no spec here for {node.op}")
        values[node.id] = y
    return values[graph.output_id]


def relative_error(got, want) -> float:
    """Worst difference over the largest magnitude: float32 sums in another order differ by a few ulps of it."""
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def lowered_against_the_spec(backend, graph: Graph, weights_seed: int, input_seed: int, batch: int = 3):
    """The backend's model of `graph` with the kit's trained-looking weights (drawn from weights_seed), and the
    relative error against the spec of its forward on a batch of the kit's inputs (drawn from input_seed)."""
    weights = trained_looking_weights(graph, weights_seed)
    x = case_input(graph, np.random.default_rng(input_seed), batch)
    model = backend.lower(graph, weights)
    return model, relative_error(backend.predict(model, x), spec_forward(graph, weights, x))
