"""Attention: ONNX's Attention (3-D inputs, or 4-D attention heads), RotaryEmbedding, and attention written
out. A projection reshaped to [N, S, H, d] and transposed to [N, H, S, d] is that projection's heads
(shape.py moves the layouts); scalar Muls and Divs of heads or scores are the scale, which must come to
1/sqrt(d); MatMul of query and transposed key heads are the scores (matmul.py), an optional causal mask
(Add of a constant 0 / -inf lower triangle, or Where of a constant boolean triangle), Softmax over the last
axis and MatMul by the value's heads is one IR attention node over the three projections. Heads times a
cos table plus rotate_half(heads) times a sin table is an IR rotary node on the projection, when the
tables are the angles of positions 0 to S - 1 for some base (rotary.rotary_base).

Refused naming the node: ALiBi or any other additive bias of the scores, sliding-window or padding masks,
an attention scale other than 1/sqrt(d), partial or interleaved rotary, scaled rotary tables (Llama 3's
rope scaling)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from aiperf_core.onnx.layouts import LAYOUT_TEXT, Act
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs
from aiperf_core.onnx.rotary import rotary_base

MASKED = -1e4  # a mask value at or below this drops its score: exp(-1e4) is 0 in float32


@dataclass(frozen=True, eq=False)
class Scores:
    """Attention scores q k^T: the query and key projections (IR nodes) and what is known of them."""

    query: str
    key: str
    group: int
    head_dim: int
    causal: bool = False
    masked: bool = False


@converter("Attention")
def attention(imp, node) -> None:
    q = imp.raw(node, 0)
    if q is None or q.layout != "heads":
        _attention_3d(imp, node)
        return
    k, v = imp.raw(node, 1), imp.raw(node, 2)
    for x in (q, k, v):
        if x is None or x.layout != "heads" or x.scale != 1.0:
            imp.fail(node, "reads 4-D inputs that are not all attention heads [N, H, S, d]")
    if any(node.input[4:]):
        imp.fail(node, "caches and padding lengths are not supported (only q, k, v and a mask)")
    imp.only_first_output(node)
    a = node_attrs(node)
    d = imp.head_dim(q)
    # Key-value heads as ONNX's Attention repeats them (fewer heads), or repeated before it (repeat_kv).
    kv = k.heads // k.group
    if q.group != 1 or (k.heads, k.group) != (v.heads, v.group) or q.heads % kv or (k.heads != q.heads and
                                                                                  k.group != 1) or \
            imp.head_dim(k) != d or imp.head_dim(v) != d:
        imp.fail(node, f"{q.heads} query heads, {k.heads} key and {v.heads} value heads of widths "
                       f"{d}, {imp.head_dim(k)}, {imp.head_dim(v)} are not grouped-query attention")
    _check_scale(imp, node, a.get("scale", 1.0 / math.sqrt(d)), d)
    if a.get("softcap", 0.0) != 0.0:
        imp.fail(node, f"soft capping (softcap {a['softcap']}) is not supported")
    causal = bool(a.get("is_causal", 0))
    if len(node.input) > 3 and node.input[3]:
        mask = np.asarray(imp.const(node, 3))
        full = [imp.batch or 1, q.heads, imp.shapes[q.node][0], imp.shapes[k.node][0]]
        if mask.dtype == bool:  # True takes part
            masked = _causal(imp, node, full, np.full(mask.shape, -np.inf), mask)
        else:
            masked = _causal(imp, node, full, mask, None)
        if causal and masked:
            imp.fail(node, "a causal mask beside is_causal is not supported")
        causal = causal or masked
    attrs = {"heads": q.heads, "head_dim": d, "causal": causal, "kv_heads": kv}
    nid = imp.emit(node, "attention", [q.node, k.node, v.node], attrs)
    imp.set(node, Act(nid, "heads", heads=q.heads))


def _attention_3d(imp, node) -> None:
    q, k, v = (imp.act(node, i, ("seq",)) for i in range(3))
    if any(node.input[3:]):
        imp.fail(node, "masks, caches and padding lengths are not supported (only q, k, v)")
    imp.only_first_output(node)
    a = node_attrs(node)
    heads, kv = a.get("q_num_heads"), a.get("kv_num_heads")
    if heads is None or kv is None or kv < 1 or heads % kv:
        imp.fail(node, "only 3-D inputs with kv_num_heads dividing q_num_heads are supported "
                       f"(got {heads} and {kv})")
    width = imp.shapes[q.node][-1]
    if heads < 1 or width % heads:
        imp.fail(node, f"{heads} heads do not divide the width {width}")
    head_dim = width // heads
    scale = a.get("scale")
    if scale is not None and not math.isclose(scale, 1 / math.sqrt(head_dim), rel_tol=1e-6):
        imp.fail(node, f"only the scale 1/sqrt(head_dim) is supported, got {scale}")
    if a.get("softcap", 0.0) != 0.0:
        imp.fail(node, f"soft capping (softcap {a['softcap']}) is not supported")
    for side in ("left_window_size", "right_window_size"):
        if a.get(side, -1) != -1:
            imp.fail(node, f"a sliding window ({side} {a[side]}) is not supported")
    attrs = {"heads": int(heads), "head_dim": int(head_dim), "causal": bool(a.get("is_causal", 0)),
             "kv_heads": int(kv)}
    imp.set(node, Act(imp.emit(node, "attention", [q.node, k.node, v.node], attrs), "seq"))


def _check_scale(imp, node, scale: float, head_dim: int) -> None:
    if not math.isclose(scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-5):
        imp.fail(node, f"scales the attention scores by {scale:.6g}; the IR's attention scales by "
                       f"1/sqrt(head_dim) = {1.0 / math.sqrt(head_dim):.6g}")


def scores(imp, node, q: Act, k: Act) -> None:
    d = imp.head_dim(q)
    if q.group != 1 or q.heads != k.heads or imp.head_dim(k) != d:
        imp.fail(node, f"multiplies {q.heads} query heads of width {d} by {k.heads} key heads of width "
                       f"{imp.head_dim(k)}")
    info = Scores(q.node, k.node, k.group, d)
    imp.set(node, Act(q.node, "scores", heads=q.heads, scale=q.scale * k.scale, info=info))


def mask(imp, node, x: Act, value: np.ndarray, keep: np.ndarray | None) -> None:
    """Scores plus a constant (keep None), or Where(keep, scores, fill): only a causal mask is read."""
    if x.info.masked:
        imp.fail(node, "masks the attention scores a second time")
    causal = _causal(imp, node, imp.full_shape(x), value, keep)
    imp.set(node, replace(x, info=replace(x.info, causal=causal, masked=True)))


def _causal(imp, node, full: list[int], value: np.ndarray, keep: np.ndarray | None) -> bool:
    """Whether a mask of scores `full` [N, H, S, S] (added, or where `keep` is False the score replaced by
    `value`) is causal (True) or keeps every score (False); refused naming the node otherwise."""
    try:
        value = np.broadcast_to(np.asarray(value, np.float64), full)
        keep = None if keep is None else np.broadcast_to(np.asarray(keep, bool), full)
    except ValueError:
        imp.fail(node, f"a mask of shape {list(np.shape(value))} does not broadcast to the scores {full}")
    if keep is None:
        kept = value > MASKED
        if np.any(value[kept] != 0.0):
            imp.fail(node, "adds a bias to the attention scores (ALiBi or a relative position bias), which the "
                           "IR's attention does not have")
    else:
        kept = keep
        if np.any(~keep & (value > MASKED)):
            imp.fail(node, "replaces attention scores by finite values; aiperf reads Where only as a mask")
    if not np.array_equal(kept, np.broadcast_to(kept[:1, :1], kept.shape)):
        imp.fail(node, "masks the scores differently per sequence or head (a padding mask)")
    pattern = kept[0, 0]
    if np.array_equal(pattern, np.tril(np.ones(pattern.shape, dtype=bool))):
        return True
    if pattern.all():
        return False
    imp.fail(node, "masks the scores other than causally (a sliding window or a prefix mask); the IR's attention "
                   "is causal or unmasked")


def probabilities(imp, node) -> bool:
    """Softmax of attention scores over the keys: their probabilities; False for any other Softmax."""
    x = imp.raw(node, 0)
    if x is not None and x.layout == "scores":
        axis = node_attrs(node).get("axis", 1 if imp.opset < 13 else -1)
        if axis % 4 != 3:
            imp.fail(node, f"only a softmax of attention scores over the keys (the last axis) is supported, got "
                           f"axis {axis}")
        if not imp.single_reader(node.input[0]):
            imp.fail(node, "the attention scores are also read elsewhere")
        imp.set(node, replace(x, layout="probs"))
        return True
    return False


def attention_output(imp, node, probs: Act, v: Act) -> None:
    info = probs.info
    d = info.head_dim
    if v.heads != probs.heads or imp.head_dim(v) != d or v.group != info.group or v.scale != 1.0:
        imp.fail(node, f"multiplies the probabilities of {probs.heads} heads of width {d} by {v.heads} value "
                       f"heads of width {imp.head_dim(v)} (key heads repeated {info.group} times, value heads "
                       f"{v.group} times)")
    readers = imp.readers.get(node.input[0], [])
    if not all(imp.g.node[i].op_type in ("MatMul", "IsNaN", "Where") for i in readers):
        imp.fail(node, "the attention probabilities are also read elsewhere")
    _check_scale(imp, node, probs.scale, d)
    attrs = {"heads": probs.heads, "head_dim": d, "causal": info.causal, "kv_heads": probs.heads // info.group}
    nid = imp.emit(node, "attention", [info.query, info.key, v.node], attrs)
    imp.set(node, Act(nid, "heads", heads=probs.heads))


@converter("IsNaN")
def is_nan(imp, node) -> None:
    x = imp.raw(node, 0)
    if x is None or x.layout != "probs":
        imp.fail(node, "unsupported op (aiperf reads IsNaN only in SDPA's guard of fully masked rows)")
    imp.set(node, Act(x.node, "probs_nan", heads=x.heads, info=node.input[0]))


@converter("Where")
def where(imp, node) -> None:
    guard = imp.raw(node, 0)
    if guard is not None and guard.layout == "probs_nan":
        # Where(IsNaN(p), 0, p): rows with every score masked read 0; a causal mask leaves none.
        fill = np.asarray(imp.consts.get(node.input[1], np.nan))
        if node.input[2] != guard.info or fill.size != 1 or fill.reshape(()) != 0.0:
            imp.fail(node, "reads IsNaN of attention probabilities other than as Where(IsNaN(p), 0, p)")
        imp.set(node, imp.acts[guard.info])
        return
    condition = imp.const(node, 0)
    a, b = imp.raw(node, 1), imp.raw(node, 2)
    if a is not None and b is None and a.layout == "scores":
        mask(imp, node, a, imp.consts[node.input[2]], np.asarray(condition, bool))
        return
    if b is not None and a is None and b.layout == "scores":
        mask(imp, node, b, imp.consts[node.input[1]], ~np.asarray(condition, bool))
        return
    imp.fail(node, "unsupported op (aiperf reads Where only as a causal mask of attention scores)")


def heads_times(imp, node, x: Act, value: np.ndarray) -> None:
    """Heads or scores times a constant: the attention scale, or a rotary table."""
    if value.size == 1:
        if x.layout == "rotated":
            imp.fail(node, "multiplies rotated heads by a scalar; aiperf reads them only times a sine table")
        imp.set(node, replace(x, scale=x.scale * float(value.reshape(()))))
        return
    base = x.info[0] if x.layout == "rotated" else x.layout
    if base not in ("heads", "split_heads") or x.group != 1 or x.scale != 1.0:
        imp.fail(node, f"multiplies {LAYOUT_TEXT[x.layout]} by a constant of shape {list(value.shape)}; aiperf "
                       f"reads only a scalar scale or a rotary table")
    table = _table(imp, node, base, x, value)
    imp.set(node, Act(x.node, "rot_sin" if x.layout == "rotated" else "rot_cos", heads=x.heads,
                      info=(base, table)))


def _table(imp, node, base: str, x: Act, value: np.ndarray) -> np.ndarray:
    """A constant over heads of `base` layout as one (S, d) table, the same for every sequence and head."""
    full = imp.full_shape(replace(x, layout=base))
    try:
        spread = np.broadcast_to(value, full) if value.ndim <= len(full) else None
    except ValueError:
        spread = None
    if spread is None:
        imp.fail(node, f"a constant of shape {list(value.shape)} does not broadcast to heads {full}")
    if base == "split_heads":
        spread = spread.transpose(0, 2, 1, 3)
    if not np.array_equal(spread, np.broadcast_to(spread[:1, :1], spread.shape)):
        imp.fail(node, "a rotary table that differs between sequences or heads is not supported")
    return np.asarray(spread[0, 0], np.float64)


def rotary(imp, node, cos: Act, sin: Act) -> None:
    """x cos + rotate_half(x) sin: an IR rotary on the projection, its base read from the tables."""
    if cos.node != sin.node or cos.info[0] != sin.info[0]:
        imp.fail(node, "adds a cosine and a sine term of different heads")
    d = imp.head_dim(cos)
    half = d // 2
    cos_table, sin_table = cos.info[1], sin.info[1]
    if not (np.allclose(cos_table[:, :half], cos_table[:, half:], atol=1e-7) and
            np.allclose(sin_table[:, :half], sin_table[:, half:], atol=1e-7)):
        imp.fail(node, "rotary tables whose halves differ (the interleaved form) are not supported")
    base = rotary_base(cos_table[:, :half], sin_table[:, :half], d)
    if base is None:
        imp.fail(node, "the cos and sin tables are not the angles position * base^(-2i / head_dim) of any base "
                       "(scaled rotary, as Llama 3's, is not supported)")
    nid = imp.emit(node, "rotary", [cos.node], {"head_dim": d, "base": base})
    imp.set(node, Act(nid, cos.info[0], heads=cos.heads))


@converter("RotaryEmbedding")
def rotary_embedding(imp, node) -> None:
    x = imp.act(node, 0, ("seq",))
    a = node_attrs(node)
    if a.get("interleaved", 0):
        imp.fail(node, "the interleaved form (pairs (2i, 2i + 1)) is not supported; the IR's rotary is the "
                       "half-split form")
    heads = a.get("num_heads", 0)
    seq_len, width = imp.shapes[x.node]
    if heads < 1 or width % heads or (width // heads) % 2:
        imp.fail(node, f"num_heads {heads} does not split the width {width} into heads of an even width")
    head_dim = width // heads
    if a.get("rotary_embedding_dim", 0) not in (0, head_dim):
        imp.fail(node, f"partial rotation (rotary_embedding_dim {a['rotary_embedding_dim']} of head_dim "
                       f"{head_dim}) is not supported")
    cos, sin = imp.const(node, 1), imp.const(node, 2)
    positions = imp.const(node, 3, optional=True)
    if positions is not None:
        positions = np.asarray(positions).astype(np.int64)
        if positions.ndim != 2 or positions.shape[1] != seq_len or np.any(positions != np.arange(seq_len)):
            imp.fail(node, f"only the positions 0 to {seq_len - 1} of every sequence are supported")
        if cos.ndim != 2 or sin.shape != cos.shape or cos.shape[0] < seq_len:
            imp.fail(node, f"cos and sin caches of shapes {list(cos.shape)} and {list(sin.shape)} do not "
                           f"hold {seq_len} positions")
        cos, sin = cos[:seq_len], sin[:seq_len]
    else:
        if cos.ndim != 3 or sin.shape != cos.shape or cos.shape[1] != seq_len or np.any(cos != cos[:1]) \
                or np.any(sin != sin[:1]):
            imp.fail(node, f"cos and sin caches of shapes {list(cos.shape)} and {list(sin.shape)} are not one "
                           f"table of {seq_len} positions for every sequence")
        cos, sin = cos[0], sin[0]
    if cos.shape[1] != head_dim // 2:
        imp.fail(node, f"cos and sin caches of width {cos.shape[1]} do not fit head_dim {head_dim}")
    base = rotary_base(cos, sin, head_dim)
    if base is None:
        imp.fail(node, "the cos and sin caches are not the angles position * base^(-2i / head_dim) of any base")
    attrs = {"head_dim": head_dim, "base": base}
    imp.set(node, Act(imp.emit(node, "rotary", [x.node], attrs), "seq"))
