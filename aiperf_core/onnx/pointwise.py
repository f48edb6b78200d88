"""Pending elementwise functions: any arrangement of Mul, Add, Sub, Div, Pow, Sqrt, Reciprocal, Neg, Tanh,
Sigmoid, Erf, Exp and float casts of one tensor, with scalar constants, stays pending (layout
'pointwise'), as the function's values on a probe range, until something else reads it; then it must be
one the IR has: GELU's tanh form (gelu), x * sigmoid(x) (silu), a x + b (mul_const, add_const) or x
itself. So GELU and SiLU read the same whichever order an exporter writes their terms in; GELU's erf form
is refused by name. A norm's statistics over the last axis are pending functions too (normalization.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from aiperf_core.onnx.layouts import BASE_LAYOUTS, Act

PROBE = np.linspace(-4.0, 4.0, 33)  # where a pending elementwise function of an activation is known
STAT_PROBE = np.linspace(0.05, 8.0, 33)  # where one of a row statistic (positive) is known
STAT_KINDS = ("mean", "mean_sq", "var")


@dataclass(frozen=True, eq=False)
class Pointwise:
    """A pending elementwise function f: of the activation `source` (kind 'act'), of it less its mean
    ('centered'), or of a statistic of it over the last axis ('mean', 'mean_sq', 'var')."""

    kind: str
    source: Act
    values: np.ndarray  # f on PROBE, or on STAT_PROBE for a statistic
    last: onnx.NodeProto | None  # the node that computed f: named where f cannot be read

    def same_source(self, other: "Pointwise") -> bool:
        return self.kind == other.kind and self.source.node == other.source.node and \
            self.source.layout == other.source.layout


def close(values: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(values))) and bool(np.allclose(values, want, rtol=1e-5, atol=1e-6))


def _gelu_tanh(t):
    return 0.5 * t * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def _gelu_erf(t):
    return 0.5 * t * (1.0 + np.vectorize(math.erf)(t / math.sqrt(2.0)))


def _silu(t):
    return t / (1.0 + np.exp(-t))


def pointwise_of(act: Act | None) -> Pointwise | None:
    """The pending function an input stands for: its own, or the identity of an activation that may start one."""
    if act is None:
        return None
    if act.layout == "pointwise":
        return act.info
    if act.layout in BASE_LAYOUTS and act.pad is None:
        return Pointwise("act", act, PROBE, None)
    return None


def pending(imp, node, of: Pointwise, values: np.ndarray, kind: str | None = None, source: Act | None = None) -> None:
    """The node's output: `of` continued, with `values` (and a new kind or source where given)."""
    info = Pointwise(kind or of.kind, source or of.source, values, node)
    imp.set(node, Act(info.source.node, "pointwise", info=info))


def materialize(imp, f: Pointwise) -> Act:
    """The IR nodes computing a pending function, read when something other than an elementwise op reads it."""
    node, x, values = f.last, f.source, f.values
    if f.kind != "act":
        imp.fail(node, "computes part of a norm's statistics, which aiperf reads only inside a layer norm's or an RMS "
                       "norm's decomposition")
    if close(values, PROBE):
        return x
    for op, want in (("gelu", _gelu_tanh), ("silu", _silu)):
        if close(values, want(PROBE)):
            return Act(imp.emit(node, op, [x.node], {}), x.layout, x.order)
    slope = float((values[-1] - values[0]) / (PROBE[-1] - PROBE[0]))
    intercept = float(values[len(PROBE) // 2])  # PROBE's middle is 0
    if slope != 0.0 and close(values, slope * PROBE + intercept):
        out = x
        if not math.isclose(slope, 1.0, rel_tol=1e-7):
            out = Act(imp.emit(node, "mul_const", [out.node], {"per_channel": False},
                               {"value": np.array([slope], np.float32)}), x.layout, x.order)
        if abs(intercept) > 1e-7:
            out = Act(imp.emit(node, "add_const", [out.node], {"per_channel": False},
                               {"value": np.array([intercept], np.float32)}), x.layout, x.order)
        return out
    if close(values, _gelu_erf(PROBE)):
        imp.fail(node, "computes GELU's erf form; the IR's GELU is the tanh form (approximate='tanh')")
    imp.fail(node, "unsupported op (an elementwise function the IR has no op for; aiperf reads GELU's tanh "
                   "form, x * sigmoid(x) and a x + b)")
