"""Pooling: MaxPool, AveragePool, GlobalAveragePool, and ReduceMean over the spatial axes (over a sequence's
last axis, a norm's statistic: normalization.py). An average over the whole map is a global_avg_pool where
it is read as a vector, else a 1 x 1 map (an avg_pool), as DenseNet's classifier, a 1x1 Conv, reads it."""

from __future__ import annotations

import numpy as np

from aiperf_core.onnx.layouts import Act
from aiperf_core.onnx.ops.conv import no_dilation, pair, window_padding
from aiperf_core.onnx.ops.normalization import row_statistic
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs


@converter("MaxPool")
def max_pool(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",), allow_pad=True)
    if x.pad is not None and imp.ir_op(x.node) != "relu":
        # Zero padding equals MaxPool's -inf padding only for non-negative inputs.
        imp.fail(node, "reads a zero Pad of a tensor that may be negative; only Pad after Relu is supported")
    a = node_attrs(node)
    no_dilation(imp, node, a)
    imp.only_first_output(node)
    if "kernel_shape" not in a:
        imp.fail(node, "missing attribute kernel_shape")
    kernel = pair(imp, node, a, "kernel_shape", ())
    strides = pair(imp, node, a, "strides", (1, 1))
    padding = window_padding(imp, node, a, x, kernel, strides, ceil_mode=bool(a.get("ceil_mode", 0)))
    attrs = dict(kernel=kernel, strides=strides, padding=padding)
    imp.set(node, Act(imp.emit(node, "max_pool", [x.node], attrs), "nchw"))


@converter("AveragePool")
def average_pool(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",))
    a = node_attrs(node)
    no_dilation(imp, node, a)
    if "kernel_shape" not in a:
        imp.fail(node, "missing attribute kernel_shape")
    h, w, _ = imp.shapes[x.node]
    kernel = pair(imp, node, a, "kernel_shape", ())
    padded = a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", "") or any(a.get("pads", []))
    if kernel == [h, w] and not padded and _read_as_vector(imp, node.output[0], at_output=False):
        _global_pool(imp, node, x, keep_dims=True)
        return
    strides = pair(imp, node, a, "strides", (1, 1))
    ceil_mode = bool(a.get("ceil_mode", 0))
    count_padding = bool(a.get("count_include_pad", 0))
    padding = window_padding(imp, node, a, x, kernel, strides, ceil_mode=ceil_mode)
    if count_padding and padding != window_padding(imp, node, a, x, kernel, strides):
        # The windows that ceil mode adds overhang the explicit padding; runtimes disagree on their divisor.
        imp.fail(node, "ceil_mode with count_include_pad is not supported")
    attrs = dict(kernel=kernel, strides=strides, padding=padding, count_padding=count_padding)
    imp.set(node, Act(imp.emit(node, "avg_pool", [x.node], attrs), "nchw"))


def _read_as_vector(imp, name: str, at_output: bool) -> bool:
    """Whether a whole-map average is read as a vector (an IR global_avg_pool): every reader flattens it
    (Flatten, Squeeze, a 2-D Reshape), takes its softmax over the channels or reads its shape. Otherwise
    it stays a 1 x 1 map (an IR avg_pool), e.g. for the 1 x 1 Conv that is DenseNet's classifier."""
    if name == imp.output:
        return at_output
    for i in imp.readers.get(name, []):
        reader = imp.g.node[i]
        if reader.op_type == "Reshape" and len(reader.input) > 1:
            target = imp.consts.get(reader.input[1])
            if target is not None and np.asarray(target).size != 2:
                return False
        elif reader.op_type not in ("Flatten", "Squeeze", "Shape", "Softmax"):
            return False
    return True


@converter("GlobalAveragePool")
def global_average_pool(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",))
    if _read_as_vector(imp, node.output[0], at_output=True):
        _global_pool(imp, node, x, keep_dims=True)
        return
    h, w, _ = imp.shapes[x.node]
    attrs = dict(kernel=[h, w], strides=[1, 1], padding=[0, 0, 0, 0], count_padding=False)
    imp.set(node, Act(imp.emit(node, "avg_pool", [x.node], attrs), "nchw"))


@converter("ReduceMean")
def reduce_mean(imp, node) -> None:
    if row_statistic(imp, node):
        return
    x = imp.act(node, 0, ("nchw", "nhwc"))
    a = node_attrs(node)
    axes = imp.axes(node, since_opset=18) or []
    keep = bool(a.get("keepdims", 1))
    spatial = {2, 3} if x.layout == "nchw" else {1, 2}
    if {v % 4 for v in axes} != spatial or len(axes) != 2 or (keep and x.layout == "nhwc"):
        imp.fail(node, f"only a mean over the spatial axes is supported (axes {axes}, keepdims {int(keep)})")
    _global_pool(imp, node, x, keep_dims=keep)


def _global_pool(imp, node, x: Act, keep_dims: bool) -> None:
    nid = imp.emit(node, "global_avg_pool", [x.node], {})
    imp.set(node, Act(nid, "pooled" if keep_dims else "flat"))
