"""Shape and layout ops: Shape (of an activation: a constant, batch counted as 1), Flatten, Squeeze of the
1 x 1 axes, Reshape, Transpose, Concat, and repeat_kv's Unsqueeze and Expand. Most cost no IR node: they
move a tensor's layout (layouts.py): NCHW <-> NHWC, flattening, a transformer's heads [N, S, H, d] <->
[N, H, S, d] <-> [N * H, S, d], the rows [N * S, D] of a sequence, rotate_half's halves concatenated.
The batch axis is carried: every Reshape, Transpose, Unsqueeze and Expand that is read must keep it first
(or merge it with the sequence or the heads and split it back), or it is refused naming the node.
ShuffleNet's Reshape -> Transpose -> Reshape is one channel_shuffle; a Concat over the channels a concat."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from aiperf_core.onnx.layouts import HEADS_LAYOUTS, LAYOUT_TEXT, Act
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs


@converter("Shape")
def shape_of(imp, node) -> None:
    x = imp.act(node, 0)
    # A symbolic batch counts as 1: aiperf graphs are per image, and a
    # Reshape target built from it is checked against that below.
    shape = np.array(imp.full_shape(x), dtype=np.int64)
    a = node_attrs(node)
    imp.consts[node.output[0]] = shape[a.get("start", 0): a.get("end", len(shape))]


@converter("Flatten")
def flatten(imp, node) -> None:
    x = imp.act(node, 0)
    axis = node_attrs(node).get("axis", 1)
    rank = 1 + len(imp.onnx_shape(x))
    if not -rank <= axis <= rank or axis % rank != 1:
        imp.fail(node, f"only flattening to [N, features] (axis 1) is supported, got axis {axis}")
    _flatten(imp, node, x)


def _flatten(imp, node, x: Act) -> None:
    if x.layout in ("pooled", "flat"):
        imp.set(node, Act(x.node, "flat", x.order))
        return
    order = None
    if x.layout == "nchw":
        h, w, c = imp.shapes[x.node]
        order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
        if h * w == 1:
            order = None
    imp.set(node, Act(imp.emit(node, "flatten", [x.node], {}), "flat", order))


@converter("Squeeze")
def squeeze(imp, node) -> None:
    x = imp.act(node, 0, ("pooled",))
    axes = imp.axes(node, since_opset=13)
    if axes is None or sorted(v % 4 for v in axes) != [2, 3]:
        imp.fail(node, f"only squeezing the 1x1 spatial axes [2, 3] is supported, got {axes}")
    imp.set(node, Act(x.node, "flat"))


@converter("Reshape")
def reshape(imp, node) -> None:
    x = imp.act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "swapped", "rows", "tokens") + HEADS_LAYOUTS)
    target = [int(v) for v in np.asarray(imp.const(node, 1)).reshape(-1)]
    dims = _reshaped(imp, node, x, target)
    batch = imp.batch or 1
    if dims == imp.full_shape(x):  # to its own shape, as Hugging Face's input_ids.view(-1, S)
        imp.alias(node, x)
        return
    if x.layout == "tokens":
        imp.fail(node, f"reshapes the token ids {imp.full_shape(x)} to {dims}; only to their own shape")
    seq_len, width = imp.shapes[x.node][0], imp.shapes[x.node][-1]
    layout = x.layout
    if layout in HEADS_LAYOUTS:
        h, d = x.heads, imp.head_dim(x)
        moves = {("split_heads", (batch, seq_len, h * d)): "seq", ("split_heads", (batch * seq_len, h * d)): "rows",
                 ("heads", (batch * h, seq_len, d)): "heads_rows",
                 ("heads_t", (batch * h, d, seq_len)): "heads_rows_t",
                 ("heads_rows", (batch, h, seq_len, d)): "heads",
                 ("heads_rows_t", (batch, h, d, seq_len)): "heads_t"}
        if layout == "heads_rep" and dims in ([batch, h, seq_len, d], [batch * h, seq_len, d]):
            imp.set(node, replace(x, layout="heads" if len(dims) == 4 else "heads_rows"))
            return
        to = moves.get((layout, tuple(dims)))
        if to is None or (to in ("seq", "rows") and (x.group != 1 or x.scale != 1.0)):
            imp.fail(node, f"reshapes {LAYOUT_TEXT[layout]} ({imp.full_shape(x)}) to {dims}; aiperf reads "
                           f"only the head reshapes of an attention, the batch axis kept first")
        imp.set(node, Act(x.node, to) if to in ("seq", "rows") else replace(x, layout=to))
        return
    if layout == "rows":
        if dims != [batch, seq_len, width]:
            imp.fail(node, f"reshapes the rows of a sequence to {dims}; only back to [{batch}, {seq_len}, "
                           f"{width}] is supported")
        imp.set(node, Act(x.node, "seq"))
        return
    if layout == "seq" and len(dims) == 4 and dims[:2] == [batch, seq_len] and dims[2] * dims[3] == width:
        imp.set(node, Act(x.node, "split_heads", heads=dims[2]))
        return
    if layout == "seq" and dims == [batch * seq_len, width]:
        imp.set(node, Act(x.node, "rows"))
        return
    if layout == "seq":
        imp.fail(node, f"reshapes a sequence {imp.full_shape(x)} to {dims}; aiperf reads a sequence's "
                       f"reshape only into heads [N, S, H, d] or rows [N * S, D], the batch axis kept")
    _image_reshape(imp, node)


def _image_reshape(imp, node) -> None:
    x = imp.act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "swapped"))
    target = [int(v) for v in np.asarray(imp.const(node, 1)).reshape(-1)]
    dims = _reshaped(imp, node, x, target)
    batch = imp.batch or 1
    if x.layout == "swapped":
        # The last step of a channel shuffle: back to [N, C, H, W].
        h, w, c = imp.shapes[x.node]
        if dims != [batch, c, h, w]:
            imp.fail(node, f"only a reshape back to [N, {c}, {h}, {w}] ends a channel shuffle, got {target}")
        nid = imp.emit(node, "channel_shuffle", [x.node], {"groups": x.groups})
        imp.set(node, Act(nid, "nchw"))
        return
    if x.layout == "nchw" and len(target) == 5:
        h, w, c = imp.shapes[x.node]
        g = dims[1]
        if g < 1 or c % g or dims != [batch, g, c // g, h, w]:
            imp.fail(node, f"only ShuffleNet's channel split [N, G, {c} / G, {h}, {w}] is supported, "
                           f"got {target}")
        imp.set(node, Act(x.node, "split", groups=g))
        return
    features = math.prod(imp.onnx_shape(x))
    if not (len(target) == 2 and dims == [batch, features] and target[0] in (0, -1, batch)):
        imp.fail(node, f"only a reshape to [N, {features}] (flatten) is supported, got {target}")
    _flatten(imp, node, x)


def _reshaped(imp, node, x: Act, target: list[int]) -> list[int]:
    """Reshape's output dims (batch included; a symbolic batch counts as 1): 0 copies the input's dim
    unless allowzero, -1 takes what is left."""
    dims = imp.full_shape(x)
    allow_zero = bool(node_attrs(node).get("allowzero", 0))
    out = [dims[k] if v == 0 and not allow_zero and k < len(dims) else v for k, v in enumerate(target)]
    if out.count(-1) > 1 or any(v < -1 for v in out):
        imp.fail(node, f"invalid reshape target {target}")
    if -1 in out:
        known = math.prod(v for v in out if v != -1)
        total = math.prod(dims)
        if known == 0 or total % known:
            imp.fail(node, f"reshape target {target} does not fit {total} values")
        out[out.index(-1)] = total // known
    return out


@converter("Transpose")
def transpose(imp, node) -> None:
    x = imp.raw(node, 0)
    perm = list(node_attrs(node).get("perm", []))
    moves = {("split_heads", (0, 2, 1, 3)): "heads", ("split_heads", (0, 2, 3, 1)): "heads_t",
             ("heads", (0, 2, 1, 3)): "split_heads", ("heads", (0, 1, 3, 2)): "heads_t",
             ("heads_t", (0, 1, 3, 2)): "heads", ("heads_rows", (0, 2, 1)): "heads_rows_t",
             ("heads_rows_t", (0, 2, 1)): "heads_rows"}
    if x is not None and x.layout in HEADS_LAYOUTS + ("scores", "probs"):
        to = moves.get((x.layout, tuple(perm)))
        if to is None or (to == "split_heads" and x.group != 1):
            imp.fail(node, f"transposes {LAYOUT_TEXT[x.layout]} by {perm}; aiperf reads only the head "
                           f"transposes of an attention, the batch axis kept first")
        imp.set(node, replace(x, layout=to))
        return
    _image_transpose(imp, node)


def _image_transpose(imp, node) -> None:
    x = imp.act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "split"))
    perm = list(node_attrs(node).get("perm", []))
    if x.layout == "nchw" and perm == [0, 2, 3, 1]:
        imp.set(node, Act(x.node, "nhwc"))
    elif x.layout == "nhwc" and perm == [0, 3, 1, 2]:
        imp.set(node, Act(x.node, "nchw"))
    elif x.layout == "split" and perm == [0, 2, 1, 3, 4]:
        imp.set(node, Act(x.node, "swapped", groups=x.groups))
    else:
        imp.fail(node, f"only NCHW<->NHWC transposes and a channel shuffle's [0, 2, 1, 3, 4] are supported, "
                       f"got perm {perm} of {LAYOUT_TEXT[x.layout]}")


@converter("Concat")
def concat(imp, node) -> None:
    xs = [imp.raw(node, k) for k in range(len(node.input))]
    if any(x is not None and x.layout == "half" for x in xs):
        axis = node_attrs(node).get("axis")
        upper, lower = xs if len(xs) == 2 else (None, None)
        if upper is None or lower is None or upper.layout != "half" or lower.layout != "half" or \
                upper.node != lower.node or upper.info != (lower.info[0], "neg_high") or lower.info[1] != "low" or \
                axis not in (-1, 3):
            imp.fail(node, "concatenates halves of heads other than rotate_half's [-x2, x1] over the last axis")
        imp.set(node, Act(upper.node, "rotated", heads=upper.heads, info=(upper.info[0],)))
        return
    _channel_concat(imp, node)


def _channel_concat(imp, node) -> None:
    xs = [imp.act(node, k, ("nchw",)) for k in range(len(node.input))]
    axis = node_attrs(node).get("axis")
    if axis is None or axis % 4 != 1:
        imp.fail(node, f"only concatenation along channels (axis 1) is supported, got axis {axis}")
    imp.set(node, Act(imp.emit(node, "concat", [x.node for x in xs], {}), "nchw"))


@converter("Unsqueeze")
def unsqueeze(imp, node) -> None:
    x = imp.act(node, 0, ("heads",))
    axes = imp.const(node, 1) if imp.opset >= 13 else node_attrs(node).get("axes")
    axes = [int(v) for v in np.asarray(axes).reshape(-1)]
    if axes not in ([2], [-3]) or x.group != 1 or x.scale != 1.0:
        imp.fail(node, f"unsqueezes heads at axes {axes}; aiperf reads only repeat_kv's axis 2")
    imp.set(node, replace(x, layout="heads_unsq"))


@converter("Expand")
def expand(imp, node) -> None:
    x = imp.act(node, 0, ("heads_unsq",))
    shape = [int(v) for v in np.asarray(imp.const(node, 1)).reshape(-1)]
    batch, (kv, _, seq_len, d) = imp.batch or 1, imp.onnx_shape(x)
    if len(shape) != 5 or [shape[0], shape[1], shape[3], shape[4]] != [batch, kv, seq_len, d] or shape[2] < 1:
        imp.fail(node, f"expands key-value heads [{batch}, {kv}, 1, {seq_len}, {d}] to {shape}; aiperf reads "
                       f"only repeat_kv's [{batch}, {kv}, G, {seq_len}, {d}]")
    group = shape[2]
    imp.set(node, replace(x, layout="heads_rep", heads=kv * group, group=group))
