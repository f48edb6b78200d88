"""Projections: Gemm and MatMul by a constant weight (a dense; over a sequence, or over its rows [N * S, D]
as Hugging Face's Conv1D writes it), MatMul of two activations (attention's two products, attention.py),
and a fused q/k/v projection split (Split or Slice of its last axis) into one dense per part, with the
kernel's (and bias's) columns of that part; the fused node must be read by the split alone. A Slice of
the halves of attention heads is rotate_half's (attention.py reads the rotation)."""

from __future__ import annotations

import numpy as np

from aiperf_core.onnx.layouts import LAYOUT_TEXT, Act
from aiperf_core.onnx.ops.attention import attention_output, scores
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs
from aiperf_core.weights import transposed_copy


@converter("Gemm")
def gemm(imp, node) -> None:
    x = imp.act(node, 0, ("flat", "rows"))
    a = node_attrs(node)
    if a.get("transA", 0):
        imp.fail(node, "transA=1 is not supported")
    kernel = imp.const(node, 1)
    if kernel.ndim != 2:
        imp.fail(node, f"weight must be 2-D, got shape {list(kernel.shape)}")
    if a.get("transB", 0):
        kernel = transposed_copy(kernel)
    if a.get("alpha", 1.0) != 1.0:
        kernel = kernel * np.float32(a["alpha"])
    bias = imp.const(node, 2, optional=True)
    units = kernel.shape[1]
    if bias is not None:
        bias = np.asarray(bias) * np.float32(a.get("beta", 1.0))
        if bias.size == 1:
            bias = np.full(units, bias.reshape(()), dtype=bias.dtype)
        elif bias.size != units or (bias.ndim == 2 and bias.shape[0] != 1) or bias.ndim > 2:
            imp.fail(node, f"bias of shape {list(bias.shape)} does not fit {units} units")
    # Gemm has its own bias input: an Add after a bias-less Gemm stays an add_const.
    _dense(imp, node, x, kernel, None if bias is None else bias.reshape(units))


@converter("MatMul")
def matmul(imp, node) -> None:
    if node.input[1] in imp.consts:
        x = imp.act(node, 0, ("flat", "seq", "rows"))
        if x.layout == "rows":
            kernel = imp.const(node, 1)
            if kernel.ndim != 2:
                imp.fail(node, f"only MatMul of rows by a 2-D weight is supported, got {list(kernel.shape)}")
            imp.bias_slot[node.output[0]] = _dense(imp, node, x, kernel, None)
            return
        _matmul_by_weight(imp, node)
        return
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    if a is not None and b is not None and a.layout == "heads" and b.layout == "heads_t":
        scores(imp, node, a, b)
        return
    if a is not None and b is not None and a.layout == "probs" and b.layout == "heads":
        attention_output(imp, node, a, b)
        return
    imp.fail(node, "multiplies two activations; aiperf reads a product of activations only as attention's two "
                   "products (query heads by transposed key heads, probabilities by value heads)")


def _matmul_by_weight(imp, node) -> None:
    x = imp.act(node, 0, ("flat", "seq", "rows"))
    kernel = imp.const(node, 1)
    if kernel.ndim != 2:
        imp.fail(node, f"only MatMul of {LAYOUT_TEXT[x.layout]} by a 2-D weight is supported, "
                       f"got {list(kernel.shape)}")
    imp.bias_slot[node.output[0]] = _dense(imp, node, x, kernel, None)


def _dense(imp, node, x: Act, kernel: np.ndarray, bias: np.ndarray | None) -> str:
    features = imp.shapes[x.node][-1]
    if kernel.shape[0] != features:
        imp.fail(node, f"weight of shape {list(kernel.shape)} does not fit {features} input features")
    kernel = np.ascontiguousarray(kernel, dtype=np.float32)  # row gathers are fast on C order
    if x.order is not None:
        kernel = kernel[x.order]
    params = {"kernel": kernel}
    if bias is not None:
        params["bias"] = bias
    attrs = {"units": int(kernel.shape[1]), "use_bias": bias is not None}
    nid = imp.emit(node, "dense", [x.node], attrs, params)
    imp.set(node, Act(nid, x.layout))
    return nid


@converter("Split")
def split(imp, node) -> None:
    x = imp.act(node, 0, ("seq",))
    a = node_attrs(node)
    width = imp.shapes[x.node][-1]
    if a.get("axis", 0) % 3 != 2:
        imp.fail(node, f"only a split of the last axis (a fused projection's parts) is supported, got axis "
                       f"{a.get('axis', 0)}")
    outputs = list(node.output)
    if imp.opset >= 13:
        given = imp.const(node, 1, optional=True)
        sizes = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
    else:
        sizes = list(a["split"]) if "split" in a else None
    if sizes is None:
        parts = len(outputs)
        step = -(-width // parts)  # opset 18's num_outputs: the last part may be smaller
        sizes = [min(step, width - k * step) for k in range(parts)]
    if sum(sizes) != width or len(sizes) != len(outputs) or min(sizes) < 1:
        imp.fail(node, f"parts {sizes} do not split the width {width}")
    start = 0
    for name, size in zip(outputs, sizes):
        if name:
            imp.acts[name] = _column_part(imp, node, x, start, start + size)
        start += size


def _column_part(imp, node, x: Act, start: int, stop: int) -> Act:
    """Columns [start, stop) of a projection's output: a dense of those columns of its kernel and bias."""
    source = next(n for n in imp.nodes if n.id == x.node)
    if source.op != "dense" or x.order is not None:
        imp.fail(node, f"splits the output of a {source.op} node; aiperf reads a split only of a projection "
                       f"(a fused q/k/v)")
    params = {k: v[..., start:stop] for k, v in imp.weights[source.id].items()}
    attrs = {"units": stop - start, "use_bias": "bias" in params}
    nid = imp.emit(node, "dense", [source.inputs[0]], attrs, params)
    imp.split_from[source.id] = node
    return Act(nid, x.layout)


@converter("Slice")
def slice_(imp, node) -> None:
    x = imp.raw(node, 0)
    if x is None:
        imp.fail(node, "input 0 is a constant that was not folded")
    if imp.opset >= 10:
        starts, ends = (np.asarray(imp.const(node, k)).reshape(-1) for k in (1, 2))
        axes, steps = (imp.const(node, k, optional=True) for k in (3, 4))
    else:
        a = node_attrs(node)
        starts, ends, axes, steps = (np.asarray(a.get(key)) if key in a else None
                                     for key in ("starts", "ends", "axes", "steps"))
    axes = list(range(len(starts))) if axes is None else [int(v) for v in np.asarray(axes).reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(v) for v in np.asarray(steps).reshape(-1)]
    if len(axes) != 1 or steps != [1]:
        imp.act(node, 0, ("seq", "heads", "split_heads"))
        imp.fail(node, f"only a slice of one axis with step 1 is supported, got axes {axes} and steps {steps}")
    rank = len(imp.full_shape(x))
    axis = axes[0] % rank
    size = imp.full_shape(x)[axis]
    start, stop = (int(np.clip(v + size if v < 0 else v, 0, size)) for v in (starts[0], ends[0]))
    if x.layout in ("heads", "split_heads") and axis == rank - 1 and x.group == 1 and x.scale == 1.0:
        half = size // 2
        if size % 2 == 0 and (start, stop) in ((0, half), (half, size)):
            part = "low" if start == 0 else "high"
            imp.set(node, Act(x.node, "half", heads=x.heads, info=(x.layout, part)))
            return
        imp.fail(node, f"slices [{start}, {stop}) of heads of width {size}; aiperf reads only the halves of "
                       f"rotate_half")
    x = imp.act(node, 0, ("seq",))
    if axis != 2:
        imp.fail(node, f"only a slice of a sequence's last axis (a fused projection's part) is supported, got "
                       f"axis {axes[0]}")
    if stop <= start:
        imp.fail(node, f"slices nothing ([{start}, {stop}))")
    imp.set(node, _column_part(imp, node, x, start, stop))
