"""Elementwise ops: Add, Sum, Sub, Mul, Div, Pow, Neg, Tanh, Sigmoid, Erf, Exp, Sqrt, Reciprocal, Cast and
Identity. With an activation and a per-channel or scalar constant: mul_const or add_const (an Add of a
constant after a bias-less MatMul is that dense's bias, an Add of a sequence-shaped table learned
positions). Two activations: an add (Sum for 3+), a mul (a SwiGLU's gate times its up projection). Any
arrangement of them on one tensor with scalar constants stays a pending function (pointwise.py); the
same ops on a norm's statistics make the norm (normalization.py), on attention heads and scores the
attention's scale, mask and rotary (attention.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from onnx import TensorProto

from aiperf_core.ir import Node
from aiperf_core.onnx.layouts import BASE_LAYOUTS, HEADS_LAYOUTS, LAYOUT_TEXT, Act
from aiperf_core.onnx.ops.attention import heads_times, mask, rotary
from aiperf_core.onnx.ops.normalization import norm, norm_parameter
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.pointwise import PROBE, STAT_KINDS, STAT_PROBE, close, pending, pointwise_of
from aiperf_core.onnx.protos import node_attrs

_FLOAT_CASTS = (TensorProto.FLOAT, TensorProto.DOUBLE)
_INDEX_CASTS = (TensorProto.INT64, TensorProto.INT32)
_UNARY = {
    "Tanh": np.tanh, "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "Erf": np.vectorize(math.erf), "Exp": np.exp,
    "Sqrt": np.sqrt, "Reciprocal": lambda v: 1.0 / v, "Neg": np.negative,
}
_BINARY = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Div": np.divide}


@converter("Add")
def add(imp, node) -> None:
    if len(node.input) != 2:
        _sum_or_constant(imp, node)
        return
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    if a is not None and b is not None and {a.layout, b.layout} == {"rot_cos", "rot_sin"}:
        rotary(imp, node, *((a, b) if a.layout == "rot_cos" else (b, a)))
        return
    if (a is None) != (b is None):
        k = 0 if a is not None else 1
        act, value = (a or b), np.asarray(imp.consts[node.input[1 - k]])
        if act.layout == "scores":
            mask(imp, node, act, value, keep=None)
            return
        if norm_parameter(imp, node, k, value, "beta"):
            return
    if _binary(imp, node, "Add"):
        return
    _sum_or_constant(imp, node)


def _sum_or_constant(imp, node) -> None:
    if len(node.input) != 2:
        imp.fail(node, f"expects 2 inputs, got {len(node.input)}")
    consts = [k for k, name in enumerate(node.input) if name in imp.consts]
    if len(consts) == 1:
        _add_constant(imp, node, 1 - consts[0], consts[0])
        return
    _sum(imp, node)


@converter("Sum")
def sum_(imp, node) -> None:
    if len(node.input) == 1:
        imp.set(node, imp.act(node, 0))
        return
    _sum(imp, node)


def _sum(imp, node) -> None:
    xs = [imp.act(node, k) for k in range(len(node.input))]
    first = xs[0]
    for x in xs[1:]:
        same_order = (x.order is None and first.order is None) or (
            x.order is not None and first.order is not None and np.array_equal(x.order, first.order)
        )
        if x.layout != first.layout or not same_order:
            imp.fail(node, f"adds {LAYOUT_TEXT[first.layout]} and {LAYOUT_TEXT[x.layout]} of different layouts")
    nid = imp.emit(node, "add", [x.node for x in xs], {})
    imp.set(node, Act(nid, first.layout, first.order))


def _add_constant(imp, node, k: int, k_const: int) -> None:
    """x + constant: learned positions, the bias of the MatMul before it, or add_const."""
    x = imp.act(node, k)
    value = np.asarray(imp.consts[node.input[k_const]])
    shape = imp.shapes[x.node]
    # A table of the sequence's own shape is learned positions. Export writes it [S, D]; a per-channel
    # constant [1, 1, D], so that the two never read as each other even when S is 1.
    if x.layout == "seq" and (value.shape == shape or (value.shape == (1, *shape) and shape[0] > 1)):
        params = {"table": value.reshape(shape)}
        imp.set(node, Act(imp.emit(node, "position_embedding", [x.node], {}, params), "seq"))
        return
    source = node.input[k]
    dense_id = imp.bias_slot.get(source)
    units = shape[-1]
    fits_bias = value.shape in ((units,), (1, units))
    if dense_id is not None and fits_bias and len(imp.readers.get(source, [])) == 1 and source != imp.output:
        position = next(i for i, n in enumerate(imp.nodes) if n.id == dense_id)
        old = imp.nodes[position]
        imp.nodes[position] = Node(old.id, old.op, old.inputs, {**old.attrs, "use_bias": True})
        imp.weights[dense_id]["bias"] = np.array(value.reshape(units), dtype=np.float32)
        del imp.bias_slot[source]
        imp.set(node, imp.acts[source])
        return
    _by_constant(imp, node, x, value, "add_const")


@converter("Sub")
def sub(imp, node) -> None:
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    if _binary(imp, node, "Sub"):
        return
    if a is not None and b is None:  # a per-channel constant subtracted
        _by_constant(imp, node, imp.act(node, 0), -np.asarray(imp.consts[node.input[1]]), "add_const")
        return
    imp.act(node, 0)
    imp.act(node, 1)
    imp.fail(node, "subtracts two activations; aiperf reads a subtraction only inside a layer norm's "
                   "decomposition (x - mean(x))")


@converter("Mul")
def mul(imp, node) -> None:
    if len(node.input) != 2:
        imp.fail(node, f"expects 2 inputs, got {len(node.input)}")
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    if (a is None) != (b is None):
        k = 0 if a is not None else 1
        act, value = (a or b), np.asarray(imp.consts[node.input[1 - k]])
        if act.layout in HEADS_LAYOUTS + ("scores", "rotated"):
            heads_times(imp, node, act, value)
            return
        if norm_parameter(imp, node, k, value, "gamma"):
            return
    if _binary(imp, node, "Mul"):
        return
    _product_or_constant(imp, node)


def _product_or_constant(imp, node) -> None:
    if len(node.input) != 2:
        imp.fail(node, f"expects 2 inputs, got {len(node.input)}")
    consts = [k for k, name in enumerate(node.input) if name in imp.consts]
    if not consts:
        _product(imp, node)
        return
    k = 1 - consts[0]
    _by_constant(imp, node, imp.act(node, k), np.asarray(imp.consts[node.input[consts[0]]]), "mul_const")


def _product(imp, node) -> None:
    """The product of two activations of one layout: a mul."""
    first, second = imp.act(node, 0), imp.act(node, 1)
    same_order = (first.order is None and second.order is None) or (
        first.order is not None and second.order is not None and np.array_equal(first.order, second.order))
    if first.layout != second.layout or not same_order:
        imp.fail(node, f"multiplies {LAYOUT_TEXT[first.layout]} and {LAYOUT_TEXT[second.layout]} of "
                       f"different layouts")
    imp.set(node, Act(imp.emit(node, "mul", [first.node, second.node], {}), first.layout, first.order))


@converter("Div")
def div(imp, node) -> None:
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    if a is not None and b is None and a.layout in HEADS_LAYOUTS + ("scores",):
        divisor = np.asarray(imp.consts[node.input[1]])
        if divisor.size != 1:
            imp.fail(node, f"divides {LAYOUT_TEXT[a.layout]} by a constant of shape {list(divisor.shape)}; only "
                           f"a scalar (the attention scale) is supported")
        imp.set(node, replace(a, scale=a.scale / float(divisor.reshape(()))))
        return
    if _binary(imp, node, "Div"):
        return
    if a is not None and b is None:  # a per-channel divisor
        _by_constant(imp, node, imp.act(node, 0), 1.0 / np.asarray(imp.consts[node.input[1]]), "mul_const")
        return
    imp.act(node, 0)
    imp.act(node, 1)
    imp.fail(node, "divides two activations; aiperf reads a division only inside a norm's decomposition")


def _by_constant(imp, node, x: Act, value: np.ndarray, op: str) -> None:
    """x * value or x + value, where value broadcasts per channel or is one number."""
    onnx_shape = (1, *imp.onnx_shape(x))
    axis = {"nchw": 1, "pooled": 1, "flat": 1, "nhwc": 3, "seq": 2, "rows": 1}[x.layout]
    channels = onnx_shape[axis]
    aligned = (1,) * (len(onnx_shape) - value.ndim) + value.shape  # ONNX broadcasts from the right
    if value.ndim == 0:
        per_channel = False
    elif len(aligned) == len(onnx_shape) and aligned == tuple(
            channels if i == axis else 1 for i in range(len(onnx_shape))):
        per_channel = True
    elif value.size == 1 and value.ndim <= len(onnx_shape):
        per_channel = False
    else:
        what = "adds" if op == "add_const" else "multiplies by"
        imp.fail(node, f"{what} a constant of shape {list(value.shape)} on {LAYOUT_TEXT[x.layout]}; only a "
                       f"per-channel or a scalar constant is supported")
    value = value.reshape(-1).astype(np.float32)
    if per_channel and x.order is not None:
        value = value[x.order]
    nid = imp.emit(node, op, [x.node], {"per_channel": per_channel}, {"value": value})
    imp.set(node, Act(nid, x.layout, x.order))


def _binary(imp, node, op: str) -> bool:
    """An elementwise op on pending functions: True when handled (pending, a centering, a norm)."""
    a, b = imp.raw(node, 0), imp.raw(node, 1)
    fa, fb = pointwise_of(a), pointwise_of(b)
    with np.errstate(all="ignore"):
        if a is not None and b is not None:
            if fa is None or fb is None:
                return False
            if fa.same_source(fb):
                pending(imp, node, fa, _BINARY[op](fa.values, fb.values))
                return True
            if op == "Sub" and fa.kind == "act" and fb.kind == "mean" and fa.source.node == fb.source.node \
                    and close(fa.values, PROBE) and close(fb.values, STAT_PROBE):
                pending(imp, node, fb, PROBE, kind="centered")
                return True
            if op in ("Mul", "Div"):
                if fb.kind in STAT_KINDS and fa.kind in ("act", "centered"):
                    norm(imp, node, fa, fb, divide=op == "Div")
                    return True
                if op == "Mul" and fa.kind in STAT_KINDS and fb.kind in ("act", "centered"):
                    norm(imp, node, fb, fa, divide=False)
                    return True
            return False
        k_const = 0 if a is None else 1
        value = np.asarray(imp.consts[node.input[k_const]])
        act, f = (b, fb) if a is None else (a, fa)
        if f is None or value.size != 1:
            return False
        if act.layout != "pointwise" and act.layout != "seq" and op in ("Mul", "Add"):
            return False  # an image's or a flat tensor's mul_const / add_const
        c = float(value.reshape(()))
        values = _BINARY[op](c, f.values) if k_const == 0 else _BINARY[op](f.values, c)
        pending(imp, node, f, values)
        return True


def _pending_unary(imp, node, fn) -> None:
    x = imp.raw(node, 0)
    f = pointwise_of(x)
    if f is None:
        imp.act(node, 0, BASE_LAYOUTS)  # refuses naming what it reads
        imp.fail(node, "unsupported op")
    with np.errstate(all="ignore"):
        pending(imp, node, f, fn(f.values))


@converter("Tanh", "Sigmoid", "Erf", "Exp", "Sqrt", "Reciprocal")
def unary(imp, node) -> None:
    """Tanh, Sigmoid, Erf, Exp, Sqrt, Reciprocal, Neg: the op's function in _UNARY."""
    _pending_unary(imp, node, _UNARY[node.op_type])


@converter("Neg")
def neg(imp, node) -> None:
    x = imp.raw(node, 0)
    if x is not None and x.layout == "half" and x.info[1] == "high":
        imp.set(node, replace(x, info=(x.info[0], "neg_high")))
        return
    unary(imp, node)


@converter("Pow")
def pow_(imp, node) -> None:
    exponent = imp.const(node, 1)
    if np.asarray(exponent).size != 1:
        imp.fail(node, f"only a scalar exponent is supported, got shape {list(np.shape(exponent))}")
    power = float(np.asarray(exponent).reshape(()))
    _pending_unary(imp, node, lambda v: np.power(v, power))


@converter("Cast")
def cast(imp, node) -> None:
    x = imp.raw(node, 0)
    if x is None:
        imp.fail(node, "input 0 is a constant that was not folded")
    to = node_attrs(node).get("to")
    if x.layout == "tokens":
        if to not in _INDEX_CASTS:
            imp.fail(node, f"casts token ids to {TensorProto.DataType.Name(to)}; only integer ids are read")
    elif to not in _FLOAT_CASTS:
        name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else to
        imp.fail(node, f"casts to {name}; aiperf reads float32 models (a cast to float32 or float64 only)")
    imp.alias(node, x)


@converter("Identity")
def identity(imp, node) -> None:
    x = imp.raw(node, 0)
    if x is None:
        imp.fail(node, "input 0 is a constant that was not folded")
    imp.alias(node, x)
