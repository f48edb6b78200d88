"""Activations: Relu, Gelu (the tanh form, the IR's), Swish of alpha 1 (silu), Softmax (over the features
or a sequence's last axis; over attention scores it is the attention's, attention.py), and Dropout.
GELU and SiLU written out as formulas are pending functions (pointwise.py)."""

from __future__ import annotations

import numpy as np

from aiperf_core.onnx.layouts import Act
from aiperf_core.onnx.ops.attention import probabilities
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import clean_float, node_attrs


@converter("Relu")
def relu(imp, node) -> None:
    x = imp.act(node, 0)
    imp.set(node, Act(imp.emit(node, "relu", [x.node], {}), x.layout, x.order))


@converter("Gelu")
def gelu(imp, node) -> None:
    x = imp.act(node, 0)
    approximate = node_attrs(node).get("approximate", "none")
    if approximate != "tanh":
        imp.fail(node, f"only the tanh GELU (approximate='tanh'), the IR's, is supported, got '{approximate}'")
    imp.set(node, Act(imp.emit(node, "gelu", [x.node], {}), x.layout, x.order))


@converter("Swish")
def swish(imp, node) -> None:
    x = imp.act(node, 0)
    alpha = node_attrs(node).get("alpha", 1.0)
    if alpha != 1.0:
        imp.fail(node, f"only SiLU (alpha 1) is supported, got alpha {alpha}")
    imp.set(node, Act(imp.emit(node, "silu", [x.node], {}), x.layout, x.order))


@converter("Softmax")
def softmax(imp, node) -> None:
    if probabilities(imp, node):
        return
    x = imp.act(node, 0, ("flat", "pooled", "seq"))
    rank = 1 + len(imp.onnx_shape(x))
    axis = node_attrs(node).get("axis", 1 if imp.opset < 13 else -1)
    # Before opset 13 Softmax flattens from `axis` on, so axis 1 of a pooled
    # [N, C, 1, 1] tensor also means "over the channels".
    want = 2 if x.layout == "seq" else 1
    if not -rank <= axis < rank or axis % rank != want:
        what = "the last axis (2)" if x.layout == "seq" else "the features (axis 1)"
        imp.fail(node, f"only a softmax over {what} is supported, got axis {axis}")
    imp.set(node, Act(imp.emit(node, "softmax", [x.node], {}), x.layout, x.order))


@converter("Dropout")
def dropout(imp, node) -> None:
    x = imp.act(node, 0)
    imp.only_first_output(node)
    if imp.opset < 12:
        ratio = node_attrs(node).get("ratio", 0.5)
    else:
        given = imp.const(node, 1, optional=True)
        ratio = 0.5 if given is None else float(np.asarray(given).reshape(-1)[0])
        training = imp.const(node, 2, optional=True)
        if training is not None and bool(np.asarray(training).reshape(-1)[0]):
            imp.fail(node, "training-mode dropout is not supported")
    attrs = {"rate": clean_float(ratio)}
    imp.set(node, Act(imp.emit(node, "dropout", [x.node], attrs), x.layout, x.order))
