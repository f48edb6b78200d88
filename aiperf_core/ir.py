"""The framework-neutral graph IR.

A graph is a DAG of nodes kept in topological order. Activations are NHWC,
conv kernels HWIO (I = input channels per group), dense kernels (in, out); padding is explicit per
side. Shapes are per sample (no batch axis) and are inferred here, never by a backend.

Two workload families share it. Images: an `input` node of shape (H, W, C) or (C,). Token
sequences: a `token_input` node of shape (S,) holding integer ids below its `vocab`; an
`embedding` turns them into (S, D), and `dense`, `layer_norm`, `gelu`, `softmax`, `dropout` and
`add` work over the last axis of an (S, D) tensor. Causal multi-head self-attention is one
`attention` node over the (S, heads * head_dim) outputs of three projections, so that every backend
can map it to its fused kernel. GELU is the tanh form, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
everywhere (GPT-2's, and the one every framework offers under one flag).

A mixture of experts is one `moe` node over (S, D): a router (D -> experts), the top_k experts of each
token by router probability with their probabilities renormalised to sum to 1 (the gates), and per
expert a GELU MLP (D -> units -> D) with biases; the output is the gate-weighted sum of the chosen
experts' outputs. Ties in the router's order go to the lower expert index.

The transformers of Llama's family use four more (docs/counting.md, "Llama-style transformers"): `rms_norm`
(x / sqrt(mean(x^2) + epsilon) times a learned `gamma`, over the last axis); `rotary`, the rotary position
embedding of each `head_dim`-wide head of a (S, heads * head_dim) query or key, in the half-split form of
GPT-NeoX and Hugging Face's Llama (pairs (i, i + head_dim/2) rotate by position * base^(-2i/head_dim));
`silu` (x sigmoid(x)); and `mul`, the elementwise product of two equal-shaped tensors. A SwiGLU MLP is IR
nodes, dense gate and up projections, silu on the gate, mul, and a dense down projection: each projection
is then an ordinary dense layer that every backend maps to its GEMM and every morph already widens.
Grouped-query attention is `attention` with `kv_heads` (dividing `heads`): the key and value are
(S, kv_heads * head_dim), and query head h reads key-value head h // (heads / kv_heads). A `moe` node with
`mlp: swiglu` has SwiGLU experts without biases (w_gate and w_in (E, D, F), w_out (E, F, D)), as Mixtral's.

Schema history: version 1 held the CNN ops; version 2 adds the sequence ops, grouped convolution,
lrn, avg_pool, mul_const, add_const and channel_shuffle; version 3 adds moe; version 4 adds rms_norm,
rotary, silu, mul, attention's kv_heads and moe's mlp. A graph is written at the oldest version that
holds it, so a version 1, 2 or 3 graph loads unchanged in an older aiperf.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from aiperf_core.errors import GraphError

SCHEMA_VERSION = 4
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)

Shape = tuple[int, ...]

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass(frozen=True)
class Node:
    id: str
    op: str
    inputs: tuple[str, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "op": self.op, "inputs": list(self.inputs), "attrs": _plain(self.attrs)}


def _plain(value):
    """Attributes as JSON-ready plain values (tuples become lists)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------------
# Op specifications: arity, attribute validation with defaults, shape rule,
# and parameter shapes. One table, so that adding an op touches one place.
# ---------------------------------------------------------------------------


def _int(node: str, attrs: Mapping, key: str, *, minimum: int, default=None) -> int:
    if key not in attrs:
        if default is None:
            raise GraphError(f"missing attribute '{key}'", node)
        return default
    value = attrs[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise GraphError(f"attribute '{key}' must be an integer, got {value!r}", node)
    if value < minimum:
        raise GraphError(f"attribute '{key}' must be >= {minimum}, got {value}", node)
    return value


def _ints(node: str, attrs: Mapping, key: str, length: int, *, minimum: int, default=None) -> tuple[int, ...]:
    if key not in attrs:
        if default is None:
            raise GraphError(f"missing attribute '{key}'", node)
        return tuple(default)
    value = attrs[key]
    if not isinstance(value, (list, tuple)) or len(value) != length:
        raise GraphError(f"attribute '{key}' must be a list of {length} integers, got {value!r}", node)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int):
            raise GraphError(f"attribute '{key}' must hold integers, got {value!r}", node)
        if v < minimum:
            raise GraphError(f"attribute '{key}' values must be >= {minimum}, got {value!r}", node)
    return tuple(value)


def _float(node: str, attrs: Mapping, key: str, *, low: float, high: float, default: float) -> float:
    value = attrs.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GraphError(f"attribute '{key}' must be a number, got {value!r}", node)
    if not low <= value <= high:
        raise GraphError(f"attribute '{key}' must be in [{low}, {high}], got {value}", node)
    return float(value)


def _bool(node: str, attrs: Mapping, key: str, default: bool) -> bool:
    value = attrs.get(key, default)
    if not isinstance(value, bool):
        raise GraphError(f"attribute '{key}' must be true or false, got {value!r}", node)
    return value


def _check_no_extra(node: str, attrs: Mapping, allowed: Iterable[str]) -> None:
    extra = sorted(set(attrs) - set(allowed))
    if extra:
        raise GraphError(f"unknown attribute '{extra[0]}'", node)


def _image(node: str, shape: Shape, what: str = "input") -> Shape:
    if len(shape) != 3:
        raise GraphError(f"{what} must be an image HxWxC, got shape {list(shape)}", node)
    return shape


def _window_out(node: str, size: int, kernel: int, stride: int, pad_lo: int, pad_hi: int, axis: str) -> int:
    span = size + pad_lo + pad_hi - kernel
    if span < 0:
        raise GraphError(
            f"kernel {kernel} does not fit the padded {axis} size {size + pad_lo + pad_hi}", node
        )
    return span // stride + 1


def _conv_attrs(node, attrs):
    _check_no_extra(node, attrs, ("filters", "kernel", "strides", "padding", "use_bias", "groups"))
    out = {
        "filters": _int(node, attrs, "filters", minimum=1),
        "kernel": _ints(node, attrs, "kernel", 2, minimum=1),
        "strides": _ints(node, attrs, "strides", 2, minimum=1, default=(1, 1)),
        "padding": _ints(node, attrs, "padding", 4, minimum=0, default=(0, 0, 0, 0)),
        "use_bias": _bool(node, attrs, "use_bias", False),
    }
    groups = _int(node, attrs, "groups", minimum=1, default=1)
    if groups != 1:  # absent when 1, so that a version 1 graph keeps its exact JSON and signature
        out["groups"] = groups
    return out


def _pool_attrs(node, attrs):
    _check_no_extra(node, attrs, ("kernel", "strides", "padding"))
    kernel = _ints(node, attrs, "kernel", 2, minimum=1)
    return {
        "kernel": kernel,
        "strides": _ints(node, attrs, "strides", 2, minimum=1, default=kernel),
        "padding": _ints(node, attrs, "padding", 4, minimum=0, default=(0, 0, 0, 0)),
    }


def _windowed_shape(node: str, shape: Shape, attrs: Mapping, channels: int) -> Shape:
    h, w, _ = _image(node, shape)
    kh, kw = attrs["kernel"]
    sh, sw = attrs["strides"]
    pt, pb, pl, pr = attrs["padding"]
    if max(pt, pb) >= kh or max(pl, pr) >= kw:
        # A window that could lie wholly in padding reads nothing real.
        raise GraphError(f"padding {list(attrs['padding'])} must be smaller than kernel {[kh, kw]}", node)
    return (
        _window_out(node, h, kh, sh, pt, pb, "height"),
        _window_out(node, w, kw, sw, pl, pr, "width"),
        channels,
    )


def _same_shapes(node: str, shapes: list[Shape], what: str) -> None:
    for s in shapes[1:]:
        if s != shapes[0]:
            raise GraphError(f"{what} inputs have mismatched shapes {[list(x) for x in shapes]}", node)


@dataclass(frozen=True)
class OpSpec:
    name: str
    min_inputs: int
    max_inputs: int | None
    parse: Any  # (node_id, attrs) -> normalised attrs
    shape: Any  # (node_id, attrs, [input shapes]) -> output shape
    params: Any = None  # (attrs, [input shapes]) -> {name: shape}


def _input_attrs(node, attrs):
    _check_no_extra(node, attrs, ("shape",))
    shape = attrs.get("shape")
    if not isinstance(shape, (list, tuple)) or len(shape) not in (1, 2, 3):
        raise GraphError(f"attribute 'shape' must be [H, W, C], [S, D] or [C], got {shape!r}", node)
    return {"shape": _ints(node, attrs, "shape", len(shape), minimum=1)}


def _no_attrs(node, attrs):
    _check_no_extra(node, attrs, ())
    return {}


def _bn_attrs(node, attrs):
    _check_no_extra(node, attrs, ("epsilon", "momentum"))
    return {
        "epsilon": _float(node, attrs, "epsilon", low=1e-12, high=1.0, default=1e-3),
        "momentum": _float(node, attrs, "momentum", low=0.0, high=1.0, default=0.99),
    }


def _dense_attrs(node, attrs):
    _check_no_extra(node, attrs, ("units", "use_bias"))
    return {"units": _int(node, attrs, "units", minimum=1), "use_bias": _bool(node, attrs, "use_bias", True)}


def _dropout_attrs(node, attrs):
    _check_no_extra(node, attrs, ("rate",))
    return {"rate": _float(node, attrs, "rate", low=0.0, high=0.99, default=0.5)}


def _conv_shape(node, attrs, shapes):
    groups = attrs.get("groups", 1)
    channels = _image(node, shapes[0])[2]
    if channels % groups or attrs["filters"] % groups:
        raise GraphError(f"groups {groups} must divide the input channels ({channels}) and the filters "
                         f"({attrs['filters']})", node)
    return _windowed_shape(node, shapes[0], attrs, attrs["filters"])


def _conv_params(attrs, shapes):
    kh, kw = attrs["kernel"]
    p = {"kernel": (kh, kw, shapes[0][-1] // attrs.get("groups", 1), attrs["filters"])}
    if attrs["use_bias"]:
        p["bias"] = (attrs["filters"],)
    return p


def _bn_params(attrs, shapes):
    c = (shapes[0][-1],)
    return {"gamma": c, "beta": c, "moving_mean": c, "moving_variance": c}


def _dense_shape(node, attrs, shapes):
    if len(shapes[0]) not in (1, 2):
        raise GraphError(f"dense needs a flat input (D) or a sequence (S, D), got shape {list(shapes[0])}", node)
    return shapes[0][:-1] + (attrs["units"],)


def _dense_params(attrs, shapes):
    p = {"kernel": (shapes[0][-1], attrs["units"])}
    if attrs["use_bias"]:
        p["bias"] = (attrs["units"],)
    return p


def _add_shape(node, attrs, shapes):
    _same_shapes(node, shapes, "add")
    return shapes[0]


def _concat_shape(node, attrs, shapes):
    for s in shapes:
        _image(node, s)
    _same_shapes(node, [s[:2] for s in shapes], "concat")
    return (shapes[0][0], shapes[0][1], sum(s[2] for s in shapes))


def _flat_shape(node, attrs, shapes):
    if len(shapes[0]) not in (1, 2):
        raise GraphError(f"softmax needs a flat (classes) or sequence (S, classes) input, got shape "
                         f"{list(shapes[0])}", node)
    return shapes[0]


def _sequence(node: str, shape: Shape, what: str = "input") -> Shape:
    if len(shape) != 2:
        raise GraphError(f"{what} must be a sequence (S, D), got shape {list(shape)}", node)
    return shape


# -- image ops that the model-zoo CNNs need (ONNX import) --------------------------------------------


def _lrn_attrs(node, attrs):
    _check_no_extra(node, attrs, ("size", "alpha", "beta", "bias"))
    size = _int(node, attrs, "size", minimum=1)
    if size % 2 == 0:
        raise GraphError(f"attribute 'size' must be odd (a window centred on its channel), got {size}", node)
    return {"size": size, "alpha": _float(node, attrs, "alpha", low=0.0, high=1e3, default=1e-4),
            "beta": _float(node, attrs, "beta", low=0.0, high=1e3, default=0.75),
            "bias": _float(node, attrs, "bias", low=1e-12, high=1e6, default=1.0)}


def _avg_pool_attrs(node, attrs):
    _check_no_extra(node, attrs, ("kernel", "strides", "padding", "count_padding"))
    out = _pool_attrs(node, {k: v for k, v in attrs.items() if k != "count_padding"})
    out["count_padding"] = _bool(node, attrs, "count_padding", False)
    return out


def _const_attrs(node, attrs):
    _check_no_extra(node, attrs, ("per_channel",))
    return {"per_channel": _bool(node, attrs, "per_channel", True)}


def _const_params(attrs, shapes):
    return {"value": (shapes[0][-1],) if attrs["per_channel"] else (1,)}


def _shuffle_attrs(node, attrs):
    _check_no_extra(node, attrs, ("groups",))
    return {"groups": _int(node, attrs, "groups", minimum=1)}


def _shuffle_shape(node, attrs, shapes):
    channels = _image(node, shapes[0])[2]
    if channels % attrs["groups"]:
        raise GraphError(f"groups {attrs['groups']} must divide the channels ({channels})", node)
    return shapes[0]


# -- sequence ops (decoder-only transformers) --------------------------------------------------------


def _token_input_attrs(node, attrs):
    _check_no_extra(node, attrs, ("seq_len", "vocab"))
    return {"seq_len": _int(node, attrs, "seq_len", minimum=1), "vocab": _int(node, attrs, "vocab", minimum=2)}


def _embedding_attrs(node, attrs):
    _check_no_extra(node, attrs, ("vocab", "units"))
    return {"vocab": _int(node, attrs, "vocab", minimum=2), "units": _int(node, attrs, "units", minimum=1)}


def _embedding_shape(node, attrs, shapes):
    if len(shapes[0]) != 1:
        raise GraphError(f"embedding needs token ids (S), got shape {list(shapes[0])}", node)
    return (shapes[0][0], attrs["units"])


def _positions_shape(node, attrs, shapes):
    return _sequence(node, shapes[0])


def _layer_norm_attrs(node, attrs):
    _check_no_extra(node, attrs, ("epsilon",))
    return {"epsilon": _float(node, attrs, "epsilon", low=1e-12, high=1.0, default=1e-5)}


def _layer_norm_params(attrs, shapes):
    d = (shapes[0][-1],)
    return {"gamma": d, "beta": d}


def _attention_attrs(node, attrs):
    _check_no_extra(node, attrs, ("heads", "head_dim", "causal", "kv_heads"))
    out = {"heads": _int(node, attrs, "heads", minimum=1), "head_dim": _int(node, attrs, "head_dim", minimum=1),
           "causal": _bool(node, attrs, "causal", True)}
    kv = _int(node, attrs, "kv_heads", minimum=1, default=out["heads"])
    if out["heads"] % kv:
        raise GraphError(f"attribute 'kv_heads' ({kv}) must divide 'heads' ({out['heads']})", node)
    if kv != out["heads"]:  # multi-head attention keeps schema 3's form
        out["kv_heads"] = kv
    return out


def kv_heads(attrs: Mapping) -> int:
    """An attention node's key-value heads: `heads` unless it is grouped-query attention."""
    return attrs.get("kv_heads", attrs["heads"])


def _attention_shape(node, attrs, shapes):
    query_width = attrs["heads"] * attrs["head_dim"]
    kv_width = kv_heads(attrs) * attrs["head_dim"]
    for what, shape, width, form in zip(("query", "key", "value"), shapes, (query_width, kv_width, kv_width),
                                        ("heads", "kv_heads", "kv_heads")):
        if len(shape) != 2 or shape[1] != width:
            raise GraphError(f"attention {what} must be (S, {form} * head_dim = {width}), got shape {list(shape)}",
                             node)
    if shapes[1] != shapes[2] or shapes[0][0] != shapes[1][0]:
        raise GraphError(f"attention inputs have mismatched shapes {[list(x) for x in shapes]}", node)
    return shapes[0]


def _rms_norm_params(attrs, shapes):
    return {"gamma": (shapes[0][-1],)}


def _rotary_attrs(node, attrs):
    _check_no_extra(node, attrs, ("head_dim", "base"))
    head_dim = _int(node, attrs, "head_dim", minimum=2)
    if head_dim % 2:
        raise GraphError(f"attribute 'head_dim' must be even (rotary rotates pairs), got {head_dim}", node)
    return {"head_dim": head_dim, "base": _float(node, attrs, "base", low=1.0, high=1e12, default=10000.0)}


def _rotary_shape(node, attrs, shapes):
    shape = _sequence(node, shapes[0])
    if shape[1] % attrs["head_dim"]:
        raise GraphError(f"rotary input width {shape[1]} is not a whole number of heads of head_dim "
                         f"{attrs['head_dim']}", node)
    return shape


def _mul_shape(node, attrs, shapes):
    _same_shapes(node, shapes, "mul")
    return shapes[0]


MOE_MLPS = ("gelu", "swiglu")


def _moe_attrs(node, attrs):
    _check_no_extra(node, attrs, ("experts", "top_k", "units", "mlp"))
    experts = _int(node, attrs, "experts", minimum=2)
    top_k = _int(node, attrs, "top_k", minimum=1)
    if top_k > experts:
        raise GraphError(f"attribute 'top_k' ({top_k}) must not exceed 'experts' ({experts})", node)
    out = {"experts": experts, "top_k": top_k, "units": _int(node, attrs, "units", minimum=1)}
    mlp = attrs.get("mlp", "gelu")
    if mlp not in MOE_MLPS:
        raise GraphError(f"attribute 'mlp' must be one of {', '.join(MOE_MLPS)}, got {mlp!r}", node)
    if mlp != "gelu":  # GELU experts keep schema 3's form
        out["mlp"] = mlp
    return out


def moe_mlp(attrs: Mapping) -> str:
    """A moe node's experts: 'gelu' (with biases) or 'swiglu' (without)."""
    return attrs.get("mlp", "gelu")


def _moe_params(attrs, shapes):
    d, e, f = shapes[0][-1], attrs["experts"], attrs["units"]
    if moe_mlp(attrs) == "swiglu":
        return {"router": (d, e), "w_gate": (e, d, f), "w_in": (e, d, f), "w_out": (e, f, d)}
    return {"router": (d, e), "w_in": (e, d, f), "b_in": (e, f), "w_out": (e, f, d), "b_out": (e, d)}


OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec("input", 0, 0, _input_attrs, lambda n, a, s: a["shape"]),
        OpSpec("conv2d", 1, 1, _conv_attrs, _conv_shape, _conv_params),
        OpSpec("batch_norm", 1, 1, _bn_attrs, lambda n, a, s: s[0], _bn_params),
        OpSpec("relu", 1, 1, _no_attrs, lambda n, a, s: s[0]),
        OpSpec("add", 2, None, _no_attrs, _add_shape),
        OpSpec("concat", 2, None, _no_attrs, _concat_shape),
        OpSpec("max_pool", 1, 1, _pool_attrs, lambda n, a, s: _windowed_shape(n, s[0], a, s[0][-1])),
        OpSpec("global_avg_pool", 1, 1, _no_attrs, lambda n, a, s: (_image(n, s[0])[2],)),
        OpSpec("flatten", 1, 1, _no_attrs, lambda n, a, s: (math.prod(s[0]),)),
        OpSpec("dense", 1, 1, _dense_attrs, _dense_shape, _dense_params),
        OpSpec("softmax", 1, 1, _no_attrs, _flat_shape),
        OpSpec("dropout", 1, 1, _dropout_attrs, lambda n, a, s: s[0]),
        OpSpec("lrn", 1, 1, _lrn_attrs, lambda n, a, s: _image(n, s[0])),
        OpSpec("avg_pool", 1, 1, _avg_pool_attrs, lambda n, a, s: _windowed_shape(n, s[0], a, s[0][-1])),
        OpSpec("mul_const", 1, 1, _const_attrs, lambda n, a, s: s[0], _const_params),
        OpSpec("add_const", 1, 1, _const_attrs, lambda n, a, s: s[0], _const_params),
        OpSpec("channel_shuffle", 1, 1, _shuffle_attrs, _shuffle_shape),
        OpSpec("token_input", 0, 0, _token_input_attrs, lambda n, a, s: (a["seq_len"],)),
        OpSpec("embedding", 1, 1, _embedding_attrs, _embedding_shape,
               lambda a, s: {"table": (a["vocab"], a["units"])}),
        OpSpec("position_embedding", 1, 1, _no_attrs, _positions_shape, lambda a, s: {"table": tuple(s[0])}),
        OpSpec("layer_norm", 1, 1, _layer_norm_attrs, lambda n, a, s: s[0], _layer_norm_params),
        OpSpec("attention", 3, 3, _attention_attrs, _attention_shape),
        OpSpec("gelu", 1, 1, _no_attrs, lambda n, a, s: s[0]),
        OpSpec("moe", 1, 1, _moe_attrs, lambda n, a, s: _sequence(n, s[0]), _moe_params),
        OpSpec("rms_norm", 1, 1, _layer_norm_attrs, lambda n, a, s: s[0], _rms_norm_params),
        OpSpec("rotary", 1, 1, _rotary_attrs, _rotary_shape),
        OpSpec("silu", 1, 1, _no_attrs, lambda n, a, s: s[0]),
        OpSpec("mul", 2, 2, _no_attrs, _mul_shape),
    )
}

PARAMETRIC_OPS = frozenset(name for name, spec in OPS.items() if spec.params is not None)
VERSION_1_OPS = frozenset({"input", "conv2d", "batch_norm", "relu", "add", "concat", "max_pool", "global_avg_pool",
                           "flatten", "dense", "softmax", "dropout"})
VERSION_3_OPS = frozenset({"moe"})
VERSION_4_OPS = frozenset({"rms_norm", "rotary", "silu", "mul"})
# What a backend declares it lowers (Backend.supported_ops): the ops, and the extensions of older ops
# apart, since a backend written for the older schema knows none of them: schema 2's conv2d `groups` and
# `input` of real-valued (S, D) sequences (which dense and softmax then take over their last axis), and
# schema 4's grouped-query attention (kv_heads) and SwiGLU experts (moe's mlp).
GROUPED_CONV = "grouped_conv2d"
SEQUENCE_INPUT = "sequence_input"
GROUPED_QUERY_ATTENTION = "grouped_query_attention"
SWIGLU_MOE = "swiglu_moe"
ALL_OPS = frozenset(OPS) | {GROUPED_CONV, SEQUENCE_INPUT, GROUPED_QUERY_ATTENTION, SWIGLU_MOE}
INPUT_OPS = frozenset({"input", "token_input"})
# Parameters that training never changes: batch norm's moving statistics (updated by their own rule,
# not by gradients) and the constants of mul_const and add_const (an imported model's folded values).
NON_TRAINABLE_PARAMS = frozenset({"moving_mean", "moving_variance", "value"})


# Ops with parameters that training changes: a gradient flows back through whatever lies downstream of
# one of them (opcount's "reads the data" rule, and the native counters that follow it).
TRAINED_OPS = PARAMETRIC_OPS - {"mul_const", "add_const"}


def is_trainable(param: str) -> bool:
    return param not in NON_TRAINABLE_PARAMS


def lowering_need(node: "Node") -> str:
    """What lowering `node` needs of a backend: its op, GROUPED_CONV for a conv2d with groups,
    SEQUENCE_INPUT for an input of (S, D) sequences, GROUPED_QUERY_ATTENTION for an attention with fewer
    key-value heads than heads, or SWIGLU_MOE for a moe of SwiGLU experts."""
    if node.op == "conv2d" and node.attrs.get("groups", 1) > 1:
        return GROUPED_CONV
    if node.op == "attention" and "kv_heads" in node.attrs:
        return GROUPED_QUERY_ATTENTION
    if node.op == "moe" and "mlp" in node.attrs:
        return SWIGLU_MOE
    if node.op == "input" and len(node.attrs["shape"]) == 2:
        return SEQUENCE_INPUT
    return node.op


@dataclass(frozen=True)
class Block:
    """A checkpointed stretch of a graph (Graph.blocks): `nodes` in order, all reading only `input`
    or each other; the last one is its output."""

    input: str
    nodes: tuple[str, ...]

    @property
    def output(self) -> str:
        return self.nodes[-1]


class Graph:
    """An immutable, validated graph with inferred per-image shapes.

    Construction validates everything; a Graph that exists is well formed.
    """

    def __init__(self, nodes: Iterable[Node | Mapping], name: str = "graph", history: Iterable[Mapping] = ()):
        raw = [n if isinstance(n, Node) else _node_from_dict(n, i) for i, n in enumerate(nodes)]
        if not raw:
            raise GraphError("graph has no nodes")
        self.name = name
        self.history: tuple[dict, ...] = tuple(dict(h) for h in history)
        ordered = _topological(raw)
        self.nodes: tuple[Node, ...]
        self.shapes: dict[str, Shape] = {}
        normalised: list[Node] = []
        consumers: dict[str, int] = {n.id: 0 for n in ordered}
        for node in ordered:
            spec = OPS[node.op]
            attrs = spec.parse(node.id, node.attrs)
            in_shapes = [self.shapes[i] for i in node.inputs]
            out = tuple(int(d) for d in spec.shape(node.id, attrs, in_shapes))
            if any(d <= 0 for d in out):
                raise GraphError(f"output shape {list(out)} has a non-positive size", node.id)
            self.shapes[node.id] = out
            for i in node.inputs:
                consumers[i] += 1
            normalised.append(Node(node.id, node.op, tuple(node.inputs), attrs))
        self.nodes = tuple(normalised)
        self._by_id = {n.id: n for n in self.nodes}
        for node in self.nodes:
            if node.op == "embedding":
                _check_embedding_source(node, self._by_id[node.inputs[0]])
        inputs = [n.id for n in self.nodes if n.op in INPUT_OPS]
        if len(inputs) != 1:
            raise GraphError(f"graph must have exactly one input node, found {len(inputs)}")
        sinks = [n.id for n in self.nodes if consumers[n.id] == 0]
        if len(sinks) != 1:
            raise GraphError(
                f"graph must have exactly one output, found {len(sinks)} nodes that nothing reads",
                sinks[0] if sinks[0] != self.nodes[-1].id else sinks[-1],
            )
        self.input_id = inputs[0]
        self.output_id = sinks[0]

    # -- access --------------------------------------------------------------
    def __getitem__(self, node_id: str) -> Node:
        try:
            return self._by_id[node_id]
        except KeyError:
            raise GraphError("no such node in the graph", node_id) from None

    def __contains__(self, node_id: str) -> bool:
        return node_id in self._by_id

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    @property
    def input_shape(self) -> Shape:
        return self.shapes[self.input_id]

    @property
    def takes_tokens(self) -> bool:
        """Whether the input is a sequence of token ids (a language model) rather than images."""
        return self._by_id[self.input_id].op == "token_input"

    @property
    def vocab(self) -> int | None:
        """The token input's vocabulary size (ids lie in [0, vocab)); None for an image graph."""
        node = self._by_id[self.input_id]
        return node.attrs["vocab"] if node.op == "token_input" else None

    @property
    def output_shape(self) -> Shape:
        return self.shapes[self.output_id]

    def consumers(self, node_id: str) -> list[Node]:
        return [n for n in self.nodes if node_id in n.inputs]

    def blocks(self) -> list["Block"]:
        """The stretches of a sequence graph that activation checkpointing recomputes in the backward
        pass: two residual sub-layers each (a transformer block, whatever morphs inserted), cut at
        every second point of the residual stream (where it starts, the position embedding's sum or,
        with rotary positions, the embedding; then the `add`s of (S, D) shape). A stretch is a block
        only when its nodes, contiguous in the stored order, read nothing from before it but its input:
        then a backend keeps just its input for the backward pass. An image graph, or a sequence graph
        with no residual stream, has none."""
        if not self.takes_tokens:
            return []
        order = {n.id: k for k, n in enumerate(self.nodes)}
        adds = [n.id for n in self.nodes if n.op == "add" and len(self.shapes[n.id]) == 2]
        starts = [n.id for n in self.nodes if n.op in ("embedding", "position_embedding")
                  and (not adds or order[n.id] < order[adds[0]])]
        points = starts[-1:] + adds
        found = []
        for k in range(0, len(points) - 1, 2):
            start, stop = points[k], points[min(k + 2, len(points) - 1)]  # an odd last sub-layer alone
            nodes = tuple(n.id for n in self.nodes[order[start] + 1:order[stop] + 1])
            inside = set(nodes) | {start}
            if all(i in inside for nid in nodes for i in self._by_id[nid].inputs):
                found.append(Block(start, nodes))
        return found

    def param_shapes(self, node_id: str) -> dict[str, Shape]:
        node = self[node_id]
        spec = OPS[node.op]
        if spec.params is None:
            return {}
        return spec.params(node.attrs, [self.shapes[i] for i in node.inputs])

    def all_param_shapes(self) -> dict[str, dict[str, Shape]]:
        return {n.id: self.param_shapes(n.id) for n in self.nodes if n.op in PARAMETRIC_OPS}

    def num_params(self, trainable_only: bool = True) -> int:
        total = 0
        for node_id, params in self.all_param_shapes().items():
            for pname, shape in params.items():
                if trainable_only and not is_trainable(pname):
                    continue
                total += math.prod(shape)
        return total

    def signature(self) -> str:
        """A canonical string of the architecture (ids excluded), for de-duplication."""
        index = {n.id: i for i, n in enumerate(self.nodes)}
        parts = [
            f"{n.op}({','.join(str(index[i]) for i in n.inputs)}){json.dumps(_plain(n.attrs), sort_keys=True)}"
            for n in self.nodes
        ]
        return ";".join(parts)

    # -- serialisation -------------------------------------------------------
    def schema_version(self) -> int:
        """The oldest schema that holds this graph: a CNN of version 1's ops is written as version 1, so
        that an older aiperf still reads what this one writes."""
        if any(n.op in VERSION_4_OPS or "kv_heads" in n.attrs or "mlp" in n.attrs for n in self.nodes):
            return 4
        if any(n.op in VERSION_3_OPS for n in self.nodes):
            return 3
        return 2 if any(n.op not in VERSION_1_OPS or "groups" in n.attrs for n in self.nodes) else 1

    def to_dict(self) -> dict:
        return {
            "schema_version": self.schema_version(),
            "name": self.name,
            "nodes": [n.to_dict() for n in self.nodes],
            "history": [_plain(h) for h in self.history],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Any) -> "Graph":
        if not isinstance(data, Mapping):
            raise GraphError("graph JSON must be an object")
        version = data.get("schema_version")
        if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
            readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
            raise GraphError(f"unsupported schema_version {version!r} (this aiperf reads {readable})")
        nodes = data.get("nodes")
        if not isinstance(nodes, list):
            raise GraphError("graph JSON needs a list 'nodes'")
        name = data.get("name", "graph")
        if not isinstance(name, str):
            raise GraphError("graph 'name' must be a string")
        history = data.get("history", [])
        if not isinstance(history, list) or not all(isinstance(h, Mapping) for h in history):
            raise GraphError("graph 'history' must be a list of objects")
        return cls(nodes, name=name, history=history)

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise GraphError(f"not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def replace(self, nodes: Iterable[Node], history_entry: Mapping | None = None, name: str | None = None) -> "Graph":
        history = self.history + ((dict(history_entry),) if history_entry else ())
        return Graph(nodes, name=name or self.name, history=history)

    def __eq__(self, other) -> bool:
        return isinstance(other, Graph) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes, input {list(self.input_shape)})"


def _check_embedding_source(node: Node, source: Node) -> None:
    """An embedding reads the token input directly, with its vocabulary: a larger table would hold rows
    no id can reach, a smaller one would be indexed out of range."""
    if source.op != "token_input":
        raise GraphError(f"embedding must read the token_input node, not a {source.op} node", node.id)
    if source.attrs["vocab"] != node.attrs["vocab"]:
        raise GraphError(f"embedding vocab {node.attrs['vocab']} differs from the token input's "
                         f"{source.attrs['vocab']}", node.id)


def _node_from_dict(data: Any, index: int) -> Node:
    if not isinstance(data, Mapping):
        raise GraphError(f"node #{index} must be an object")
    node_id = data.get("id")
    if not isinstance(node_id, str) or not _ID_RE.match(node_id):
        raise GraphError(f"node #{index} has a bad id {node_id!r} (letters, digits, '_', '.', '-')")
    op = data.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise GraphError(f"unknown op {op!r}", node_id)
    inputs = data.get("inputs", [])
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise GraphError("'inputs' must be a list of node ids", node_id)
    attrs = data.get("attrs", {})
    if not isinstance(attrs, Mapping):
        raise GraphError("'attrs' must be an object", node_id)
    extra = sorted(set(data) - {"id", "op", "inputs", "attrs"})
    if extra:
        raise GraphError(f"unknown field '{extra[0]}'", node_id)
    return Node(node_id, op, tuple(inputs), dict(attrs))


def _topological(nodes: list[Node]) -> list[Node]:
    """Kahn's algorithm, keeping the given order where it is already valid."""
    by_id: dict[str, Node] = {}
    for node in nodes:
        if not isinstance(node.id, str) or not _ID_RE.match(node.id):
            raise GraphError(f"bad node id {node.id!r} (letters, digits, '_', '.', '-')")
        if not isinstance(node.op, str) or node.op not in OPS:
            raise GraphError(f"unknown op {node.op!r}", node.id)
        if node.id in by_id:
            raise GraphError("duplicate node id", node.id)
        by_id[node.id] = node
    for node in nodes:
        spec = OPS[node.op]
        n = len(node.inputs)
        if n < spec.min_inputs or (spec.max_inputs is not None and n > spec.max_inputs):
            want = spec.min_inputs if spec.max_inputs == spec.min_inputs else f"at least {spec.min_inputs}"
            raise GraphError(f"{node.op} takes {want} input(s), got {n}", node.id)
        if len(set(node.inputs)) != n:
            raise GraphError("the same input is listed twice", node.id)
        for i in node.inputs:
            if i not in by_id:
                raise GraphError(f"input '{i}' does not exist (dangling input)", node.id)
            if i == node.id:
                raise GraphError("node reads its own output (cycle)", node.id)
    position = {n.id: k for k, n in enumerate(nodes)}
    if all(position[i] < position[n.id] for n in nodes for i in n.inputs):
        return list(nodes)
    pending = {n.id: len(n.inputs) for n in nodes}
    readers: dict[str, list[str]] = {n.id: [] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            readers[i].append(n.id)
    import heapq

    ready = [(position[n.id], n.id) for n in nodes if pending[n.id] == 0]
    heapq.heapify(ready)
    out: list[Node] = []
    while ready:
        _, nid = heapq.heappop(ready)
        out.append(by_id[nid])
        for r in readers[nid]:
            pending[r] -= 1
            if pending[r] == 0:
                heapq.heappush(ready, (position[r], r))
    if len(out) != len(nodes):
        stuck = next(n.id for n in nodes if pending[n.id] > 0)
        raise GraphError("graph has a cycle through this node", stuck)
    return out


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def load_graph(path) -> Graph:
    from pathlib import Path

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GraphError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphError(f"{p}: cannot read: {exc}") from None
    try:
        return Graph.from_json(text)
    except GraphError as exc:
        located = GraphError(f"{p}: {exc}")
        located.node = exc.node
        raise located from None


def save_graph(graph: Graph, path) -> None:
    from aiperf_core.atomic import write_text_atomic

    write_text_atomic(path, graph.to_json())
