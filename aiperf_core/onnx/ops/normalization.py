"""Normalisation: BatchNormalization, LRN, LayerNormalization and RMSNormalization, and the norms that
exporters write out. x less its mean (Sub of a ReduceMean over the last axis), squared, averaged, plus
epsilon, square-rooted, divided into (or its reciprocal multiplied by) x less its mean is a layer_norm;
x times the reciprocal square root of the mean of x squared plus epsilon is an rms_norm. A following
per-channel Mul is its gamma, an Add (layer norm) its beta. The statistics stay pending functions
(pointwise.py) of their own kinds until the division reads them (elementwise.py)."""

from __future__ import annotations

import numpy as np

from aiperf_core.onnx.layouts import Act
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.pointwise import PROBE, STAT_PROBE, Pointwise, close, pending, pointwise_of
from aiperf_core.onnx.protos import clean_float, node_attrs


@converter("BatchNormalization")
def batch_normalization(imp, node) -> None:
    x = imp.act(node, 0, ("nchw", "pooled", "flat"))
    a = node_attrs(node)
    if a.get("training_mode", 0):
        imp.fail(node, "training-mode batch normalization is not supported")
    if a.get("spatial", 1) != 1:
        imp.fail(node, "non-spatial batch normalization is not supported")
    imp.only_first_output(node)
    params = {}
    for k, pname in enumerate(("gamma", "beta", "moving_mean", "moving_variance"), start=1):
        value = imp.const(node, k).reshape(-1)
        params[pname] = value[x.order] if x.order is not None and value.size == x.order.size else value
    attrs = {"epsilon": clean_float(a.get("epsilon", 1e-5)), "momentum": clean_float(a.get("momentum", 0.9))}
    imp.set(node, Act(imp.emit(node, "batch_norm", [x.node], attrs, params), x.layout, x.order))


@converter("LRN")
def lrn(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",))
    a = node_attrs(node)
    if "size" not in a:
        imp.fail(node, "missing attribute size")
    attrs = {"size": int(a["size"]), "alpha": clean_float(a.get("alpha", 1e-4)),
             "beta": clean_float(a.get("beta", 0.75)), "bias": clean_float(a.get("bias", 1.0))}
    imp.set(node, Act(imp.emit(node, "lrn", [x.node], attrs), "nchw"))


@converter("LayerNormalization")
def layer_normalization(imp, node) -> None:
    _norm_over_last_axis(imp, node, "layer_norm")


@converter("RMSNormalization")
def rms_normalization(imp, node) -> None:
    _norm_over_last_axis(imp, node, "rms_norm")


def _norm_over_last_axis(imp, node, op: str) -> None:
    """LayerNormalization (scale, optional bias) or RMSNormalization (scale) as the IR's `op`."""
    x = imp.act(node, 0, ("seq", "flat"))
    a = node_attrs(node)
    rank = 1 + len(imp.onnx_shape(x))
    axis = a.get("axis", -1)
    if not -rank <= axis < rank or axis % rank != rank - 1:
        what = "a layer norm" if op == "layer_norm" else "an RMS norm"
        imp.fail(node, f"only {what} over the last axis is supported, got axis {axis}")
    imp.only_first_output(node)  # LayerNormalization's mean and inverse deviation
    gamma = imp.const(node, 1).reshape(-1)
    params = {"gamma": gamma}
    if op == "layer_norm":
        beta = imp.const(node, 2, optional=True)
        params["beta"] = np.zeros_like(gamma) if beta is None else beta.reshape(-1)
    if x.order is not None:
        params = {k: v[x.order] if v.size == x.order.size else v for k, v in params.items()}
    attrs = {"epsilon": clean_float(a.get("epsilon", 1e-5))}
    imp.set(node, Act(imp.emit(node, op, [x.node], attrs, params), x.layout, x.order))


def row_statistic(imp, node) -> bool:
    """A ReduceMean over a sequence's last axis of x, x^2 or (x - mean)^2: a norm's statistic, pending
    until a division reads it; False where the mean is over other axes (pooling.py reads it)."""
    x = imp.raw(node, 0)
    f = pointwise_of(x)
    a = node_attrs(node)
    axes = imp.axes(node, since_opset=18) or []
    if f is None or f.source.layout != "seq" or len(axes) != 1 or axes[0] % 3 != 2:
        return False
    if not a.get("keepdims", 1):
        imp.fail(node, "a mean over the last axis must keep its axis (keepdims=1), as a norm's does")
    if f.kind == "act" and close(f.values, PROBE):
        kind = "mean"
    elif f.kind == "act" and close(f.values, PROBE ** 2):
        kind = "mean_sq"
    elif f.kind == "centered" and close(f.values, PROBE ** 2):
        kind = "var"
    else:
        imp.fail(node, "averages over the last axis something other than a norm's x, x^2 or (x - mean)^2")
    pending(imp, node, f, STAT_PROBE, kind=kind)
    return True


def norm(imp, node, x: Pointwise, stat: Pointwise, divide: bool) -> None:
    """x / sqrt(stat + eps) (or x * 1/sqrt(stat + eps)): a layer norm or an RMS norm with unit scale."""
    ops = {("centered", "var"): "layer_norm", ("act", "mean_sq"): "rms_norm"}
    op = ops.get((x.kind, stat.kind))
    if op is None or x.source.node != stat.source.node or not close(x.values, PROBE):
        imp.fail(node, "divides a tensor by a statistic that does not normalise it (aiperf reads (x - mean) / "
                       "sqrt(var + eps) and x / sqrt(mean(x^2) + eps))")
    with np.errstate(all="ignore"):
        root = stat.values if divide else 1.0 / stat.values
        epsilon = float(root[0] ** 2 - STAT_PROBE[0])
        if not (epsilon > 0.0 and close(root, np.sqrt(STAT_PROBE + epsilon))):
            imp.fail(node, "divides by a function of the variance other than sqrt(var + eps)")
    source = x.source
    width = imp.shapes[source.node][-1]
    params = {"gamma": np.ones(width, np.float32)}
    if op == "layer_norm":
        params["beta"] = np.zeros(width, np.float32)
    nid = imp.emit(node, op, [source.node], {"epsilon": clean_float(epsilon)}, params)
    imp.set(node, Act(nid, source.layout, source.order))
    imp.norm_slot[node.output[0]] = (nid, "gamma")


def norm_parameter(imp, node, k: int, value: np.ndarray, param: str) -> bool:
    """A per-channel constant times (gamma) or plus (beta) a norm's output read by nothing else."""
    name = node.input[k]
    slot = imp.norm_slot.get(name)
    if slot is None or not imp.single_reader(name):
        return False
    nid, expected = slot
    op = imp.ir_op(nid)
    width = imp.shapes[nid][-1]
    rank = len(imp.full_shape(imp.acts[name]))
    if value.size != width or value.ndim > rank or value.shape[-1] != width:
        return False
    if param == "gamma" and expected != "gamma":
        return False
    if param == "beta" and op != "layer_norm":
        return False
    imp.weights[nid][param] = np.array(value.reshape(width), dtype=np.float32)
    imp.set(node, imp.acts[name])
    del imp.norm_slot[name]
    if param == "gamma" and op == "layer_norm":
        imp.norm_slot[node.output[0]] = (nid, "beta")
    return True
