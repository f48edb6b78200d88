"""Convolutions: Conv (2-D, grouped or not) and the zero Pad that a Conv (or a MaxPool) folds in; the
window arithmetic (pairs, dilations, padding with auto_pad and ceil_mode) that pooling shares."""

from __future__ import annotations

import math

import numpy as np

from aiperf_core.onnx.layouts import Act
from aiperf_core.onnx.ops.registry import converter
from aiperf_core.onnx.protos import node_attrs


@converter("Conv")
def conv(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",), allow_pad=True)
    kernel = imp.const(node, 1)
    bias = imp.const(node, 2, optional=True)
    a = node_attrs(node)
    if kernel.ndim != 4:
        imp.fail(node, f"only 2-D convolutions are supported (weight of rank {kernel.ndim})")
    no_dilation(imp, node, a)
    groups = a.get("group", 1)
    filters, per_group, kh, kw = kernel.shape
    channels = imp.shapes[x.node][2]
    if per_group * groups != channels:
        imp.fail(node, f"weight reads {per_group} channels per group in {groups} group(s), "
                       f"the input has {channels}")
    if list(a.get("kernel_shape", [kh, kw])) != [kh, kw]:
        imp.fail(node, f"kernel_shape {list(a['kernel_shape'])} does not match the weight's {[kh, kw]}")
    strides = pair(imp, node, a, "strides", (1, 1))
    padding = window_padding(imp, node, a, x, (kh, kw), strides)
    params = {"kernel": np.transpose(kernel, (2, 3, 1, 0))}
    if bias is not None:
        params["bias"] = bias.reshape(-1)
    attrs = dict(filters=int(filters), kernel=[kh, kw], strides=strides, padding=padding, use_bias=bias is not None,
                 groups=int(groups))
    imp.set(node, Act(imp.emit(node, "conv2d", [x.node], attrs, params), "nchw"))


@converter("Pad")
def pad(imp, node) -> None:
    x = imp.act(node, 0, ("nchw",), allow_pad=True)
    a = node_attrs(node)
    if a.get("mode", "constant") != "constant":
        imp.fail(node, f"only constant padding is supported, got mode '{a['mode']}'")
    if imp.opset < 11:
        pads, value = list(a.get("pads", [])), a.get("value", 0.0)
    else:
        pads = [int(v) for v in np.asarray(imp.const(node, 1)).reshape(-1)]
        given = imp.const(node, 2, optional=True)
        value = 0.0 if given is None else float(np.asarray(given).reshape(-1)[0])
        axes = imp.const(node, 3, optional=True)
        if axes is not None:
            full = [0] * 8
            for k, axis in enumerate(int(v) % 4 for v in np.asarray(axes).reshape(-1)):
                full[axis], full[axis + 4] = pads[k], pads[k + len(pads) // 2]
            pads = full
    if value != 0.0:
        imp.fail(node, f"only zero padding is supported, got value {value}")
    if len(pads) != 8 or pads[0] or pads[1] or pads[4] or pads[5] or min(pads) < 0:
        imp.fail(node, f"only non-negative padding of H and W is supported, got pads {pads}")
    before = x.pad or (0, 0, 0, 0)
    pad = (before[0] + pads[2], before[1] + pads[6], before[2] + pads[3], before[3] + pads[7])
    imp.set(node, Act(x.node, "nchw", pad=pad))


def pair(imp, node, attrs: dict, key: str, default) -> list[int]:
    value = list(attrs.get(key, default))
    if len(value) != 2:
        imp.fail(node, f"only 2-D {key} are supported, got {value}")
    return value


def no_dilation(imp, node, attrs: dict) -> None:
    if any(d != 1 for d in attrs.get("dilations", [])):
        imp.fail(node, f"dilations {list(attrs['dilations'])} are not supported (only 1)")


def window_padding(imp, node, attrs: dict, x: Act, kernel, strides, ceil_mode: bool = False) -> list[int]:
    """IR padding [top, bottom, left, right] for a windowed op, resolving auto_pad and ceil_mode."""
    h, w, _ = imp.shapes[x.node]
    pending = list(x.pad or (0, 0, 0, 0))
    sizes = (h + pending[0] + pending[1], w + pending[2] + pending[3])
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        pads = list(attrs.get("pads", [0, 0, 0, 0]))
        if len(pads) != 4:
            imp.fail(node, f"only 2-D pads are supported, got {pads}")
        if min(pads) < 0:
            imp.fail(node, f"negative pads {pads} are not supported")
        own = [pads[0], pads[2], pads[1], pads[3]]
    elif auto == "VALID":
        own = [0, 0, 0, 0]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        own = []
        for size, k, s in zip(sizes, kernel, strides):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            small, big = total // 2, total - total // 2
            own += [small, big] if auto == "SAME_UPPER" else [big, small]
    else:
        imp.fail(node, f"unknown auto_pad '{auto}'")
    padding = [p + q for p, q in zip(pending, own)]
    if ceil_mode:
        # Extra bottom/right padding makes floor rounding give the ceil-mode size;
        # like ONNX, drop a last window that would start in the end padding.
        for axis, (size, k, s) in enumerate(zip((h, w), kernel, strides)):
            lo, hi = padding[2 * axis], padding[2 * axis + 1]
            out = -(-(size + lo + hi - k) // s) + 1
            if (out - 1) * s >= size + lo:
                out -= 1
            padding[2 * axis + 1] += max((out - 1) * s + k - (size + lo + hi), 0)
    return padding
