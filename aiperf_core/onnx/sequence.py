"""Reading the transformers that real exporters write into the IR (aiperf_core.onnx.import_onnx).

torch.onnx's TorchScript exporter (opsets 14 to 18), its dynamo exporter (opset 18 on) and Hugging Face's
models write a transformer's attention, norms, activations and rotary embedding as many small ONNX nodes.
After constant folding (aiperf_core.onnx.fold: shape arithmetic, masks, rotary tables, weight transposes
become initializers), TransformerImporter reads what is left tensor by tensor, as the core importer does,
with a layout per ONNX tensor that says what it is in IR terms:

- Elementwise functions of one tensor (any arrangement of Mul, Add, Sub, Div, Pow, Sqrt, Reciprocal,
  Neg, Tanh, Sigmoid, Erf, Exp and float casts, with scalar constants) stay pending, as the function's
  values on a probe range, until something else reads them; then they must be one the IR has: GELU's
  tanh form (gelu), x * sigmoid(x) (silu), a x + b (mul_const, add_const) or x itself. So GELU and SiLU
  read the same whichever order an exporter writes their terms in; GELU's erf form is refused by name.
- Norms: x less its mean (Sub of a ReduceMean over the last axis), squared, averaged, plus epsilon,
  square-rooted, divided into (or its reciprocal multiplied by) x less its mean is a layer_norm; x times
  the reciprocal square root of the mean of x squared plus epsilon is an rms_norm. A following per-channel
  Mul is its gamma, an Add (layer norm) its beta. Fused LayerNormalization and RMSNormalization read as
  before.
- Attention written out: a projection reshaped to [N, S, H, d] and transposed to [N, H, S, d] is that
  projection's heads; the key transposed to [N, H, d, S] (directly, or through [N * H, S, d] as the dynamo
  exporter writes it); scalar Muls and Divs of either, or of the scores, are the scale, which must come to
  1/sqrt(d); MatMul of the two, an optional causal mask (Add of a constant 0 / -inf lower triangle, or
  Where of a constant boolean triangle), Softmax over the last axis and MatMul by the value's heads is one
  IR attention node over the three projections; its heads transposed and reshaped back to [N, S, H * d]
  are its output. F.scaled_dot_product_attention exports as the same nodes (its scale as sqrt(1/sqrt(d))
  on the query and on the key). Key-value heads repeated for grouped-query attention (Unsqueeze, Expand,
  Reshape: repeat_kv) give the node's kv_heads. ONNX's Attention on 3-D or 4-D heads reads directly.
- Rotary: heads times a cos table plus rotate_half(heads) (Slice of the halves, Neg of the upper, Concat)
  times a sin table is an IR rotary node on the projection, when the tables are the angles of positions
  0 to S - 1 (halves repeated) for some base (importer.rotary_base).
- A fused q/k/v projection split (Split or Slice of its last axis) is one dense node per part, with the
  kernel's (and bias's) columns of that part; the fused node must be read by the split alone. A projection
  over the rows [N * S, D] (Hugging Face's Conv1D: Reshape, Gemm, Reshape) is a dense over the sequence.

The batch axis is carried: every Reshape, Transpose, Unsqueeze and Expand that is read must keep the batch
as the first axis (or merge it with the sequence or the heads as above and split it back), or it is
refused naming the node. A language model's output is its logits; the IR's language models end in the
softmax whose logits their training loss reads, so a token graph whose output is a dense gets one
appended (id 'probs').

Anything else is refused in one line naming the ONNX node and op: ALiBi or any other additive bias of the
scores, sliding-window or padding masks, an attention scale other than 1/sqrt(d), partial or interleaved
rotary, scaled rotary tables (Llama 3's rope scaling), the erf GELU, a fused projection also read whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto, helper

from aiperf_core.errors import GraphError
from aiperf_core.onnx.importer import LAYOUT_TEXT, Act, Importer, clean_float, node_attrs, rotary_base

PROBE = np.linspace(-4.0, 4.0, 33)  # where a pending elementwise function of an activation is known
STAT_PROBE = np.linspace(0.05, 8.0, 33)  # where one of a row statistic (positive) is known
STAT_KINDS = ("mean", "mean_sq", "var")
BASE_LAYOUTS = ("seq", "flat", "nchw", "nhwc", "pooled")  # what an elementwise function may start from
HEADS_LAYOUTS = ("split_heads", "heads", "heads_t", "heads_rows", "heads_rows_t", "heads_unsq", "heads_rep")
MASKED = -1e4  # a mask value at or below this drops its score: exp(-1e4) is 0 in float32
_FLOAT_CASTS = (TensorProto.FLOAT, TensorProto.DOUBLE)
_INDEX_CASTS = (TensorProto.INT64, TensorProto.INT32)


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


@dataclass(frozen=True, eq=False)
class Scores:
    """Attention scores q k^T: the query and key projections (IR nodes) and what is known of them."""

    query: str
    key: str
    group: int
    head_dim: int
    causal: bool = False
    masked: bool = False


def _close(values: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(values))) and bool(np.allclose(values, want, rtol=1e-5, atol=1e-6))


def _gelu_tanh(t):
    return 0.5 * t * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t ** 3)))


def _gelu_erf(t):
    return 0.5 * t * (1.0 + np.vectorize(math.erf)(t / math.sqrt(2.0)))


def _silu(t):
    return t / (1.0 + np.exp(-t))


_UNARY = {
    "Tanh": np.tanh, "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)), "Erf": np.vectorize(math.erf), "Exp": np.exp,
    "Sqrt": np.sqrt, "Reciprocal": lambda v: 1.0 / v, "Neg": np.negative,
}
_BINARY = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Div": np.divide}


class TransformerImporter(Importer):
    def __init__(self, model: onnx.ModelProto, fallback_name: str | None):
        super().__init__(model, fallback_name)
        # ONNX tensor -> (the IR norm node computing it, the parameter a following constant sets: 'gamma' or
        # 'beta'), so that a norm's decomposition takes its scale and shift as the fused ops do.
        self.norm_slot: dict[str, tuple[str, str]] = {}
        # IR dense node of a fused projection -> the ONNX node that split it into one dense per part.
        self.split_from: dict[str, onnx.NodeProto] = {}

    # -- access --------------------------------------------------------------------------------------
    def _act(self, node, k: int, layouts=None, allow_pad: bool = False) -> Act:
        """The activation input k, a pending elementwise function made IR nodes first."""
        name = node.input[k] if k < len(node.input) else ""
        act = self.acts.get(name)
        if act is not None and act.layout == "pointwise":
            self.acts[name] = self._materialize(act.info)
        return super()._act(node, k, layouts, allow_pad)

    def _raw(self, node, k: int) -> Act | None:
        """Input k as it is (pending or private layouts included), or None for a constant."""
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            self._fail(node, f"input {k} is missing")
        if name in self.consts:
            return None
        act = self.acts.get(name)
        if act is None:
            self._fail(node, f"reads '{name}', which no earlier node produces")
        return act

    def _onnx_shape(self, act: Act) -> tuple[int, ...]:
        layout = act.layout
        if layout == "pointwise":
            shape = self._onnx_shape(act.info.source)
            return shape[:-1] + (1,) if act.info.kind in STAT_KINDS else shape
        if layout == "rows":
            return (self.shapes[act.node][-1],)
        if layout in HEADS_LAYOUTS or layout in ("half", "rotated", "rot_cos", "rot_sin", "scores", "probs"):
            seq_len = self.shapes[act.node][0]
            h, d = act.heads, self._head_dim(act)
            kv = h // act.group
            base = act.info[0] if layout in ("half", "rotated", "rot_cos", "rot_sin") else None
            if layout == "half":
                d //= 2
            shapes = {"split_heads": (seq_len, h, d), "heads": (h, seq_len, d), "heads_t": (h, d, seq_len),
                      "heads_rows": (seq_len, d), "heads_rows_t": (d, seq_len), "heads_unsq": (kv, 1, seq_len, d),
                      "heads_rep": (kv, act.group, seq_len, d), "scores": (h, seq_len, seq_len),
                      "probs": (h, seq_len, seq_len)}
            return shapes[base or layout]
        return super()._onnx_shape(act)

    def _full_shape(self, act: Act) -> list[int]:
        batch = self.batch or 1
        if act.layout == "rows":
            return [batch * self.shapes[act.node][0], self.shapes[act.node][-1]]
        if act.layout in ("heads_rows", "heads_rows_t"):
            return [batch * act.heads, *self._onnx_shape(act)]
        return super()._full_shape(act)

    def _head_dim(self, act: Act) -> int:
        return self.shapes[act.node][-1] * act.group // act.heads

    def _single_reader(self, name: str) -> bool:
        return len(self.readers.get(name, [])) == 1 and name != self.output

    # -- pending elementwise functions ---------------------------------------------------------------
    @staticmethod
    def _pointwise_of(act: Act | None) -> Pointwise | None:
        if act is None:
            return None
        if act.layout == "pointwise":
            return act.info
        if act.layout in BASE_LAYOUTS and act.pad is None:
            return Pointwise("act", act, PROBE, None)
        return None

    def _pending(self, node, of: Pointwise, values: np.ndarray, kind: str | None = None,
                 source: Act | None = None) -> None:
        info = Pointwise(kind or of.kind, source or of.source, values, node)
        self._set(node, Act(info.source.node, "pointwise", info=info))

    def _materialize(self, f: Pointwise) -> Act:
        node, x, values = f.last, f.source, f.values
        if f.kind != "act":
            self._fail(node, "computes part of a norm's statistics, which aiperf reads only inside a layer norm's or "
                             "an RMS norm's decomposition")
        if _close(values, PROBE):
            return x
        for op, want in (("gelu", _gelu_tanh), ("silu", _silu)):
            if _close(values, want(PROBE)):
                return Act(self._emit(node, op, [x.node], {}), x.layout, x.order)
        slope = float((values[-1] - values[0]) / (PROBE[-1] - PROBE[0]))
        intercept = float(values[len(PROBE) // 2])  # PROBE's middle is 0
        if slope != 0.0 and _close(values, slope * PROBE + intercept):
            out = x
            if not math.isclose(slope, 1.0, rel_tol=1e-7):
                out = Act(self._emit(node, "mul_const", [out.node], {"per_channel": False},
                                     {"value": np.array([slope], np.float32)}), x.layout, x.order)
            if abs(intercept) > 1e-7:
                out = Act(self._emit(node, "add_const", [out.node], {"per_channel": False},
                                     {"value": np.array([intercept], np.float32)}), x.layout, x.order)
            return out
        if _close(values, _gelu_erf(PROBE)):
            self._fail(node, "computes GELU's erf form; the IR's GELU is the tanh form (approximate='tanh')")
        self._fail(node, "unsupported op (an elementwise function the IR has no op for; aiperf reads GELU's tanh "
                         "form, x * sigmoid(x) and a x + b)")

    def _unary(self, node, fn) -> None:
        x = self._raw(node, 0)
        f = self._pointwise_of(x)
        if f is None:
            self._act(node, 0, BASE_LAYOUTS)  # refuses naming what it reads
            self._fail(node, "unsupported op")
        with np.errstate(all="ignore"):
            self._pending(node, f, fn(f.values))

    def _unary_of_table(self, node) -> None:
        """Tanh, Sigmoid, Erf, Exp, Sqrt, Reciprocal, Neg: the op's function in _UNARY."""
        self._unary(node, _UNARY[node.op_type])

    _op_Tanh = _op_Sigmoid = _op_Erf = _op_Exp = _op_Sqrt = _op_Reciprocal = _unary_of_table

    def _op_Neg(self, node) -> None:
        x = self._raw(node, 0)
        if x is not None and x.layout == "half" and x.info[1] == "high":
            self._set(node, replace(x, info=(x.info[0], "neg_high")))
            return
        self._unary_of_table(node)

    def _op_Pow(self, node) -> None:
        exponent = self._const(node, 1)
        if np.asarray(exponent).size != 1:
            self._fail(node, f"only a scalar exponent is supported, got shape {list(np.shape(exponent))}")
        power = float(np.asarray(exponent).reshape(()))
        self._unary(node, lambda v: np.power(v, power))

    def _op_Cast(self, node) -> None:
        x = self._raw(node, 0)
        if x is None:
            self._fail(node, "input 0 is a constant that was not folded")
        to = node_attrs(node).get("to")
        if x.layout == "tokens":
            if to not in _INDEX_CASTS:
                self._fail(node, f"casts token ids to {TensorProto.DataType.Name(to)}; only integer ids are read")
        elif to not in _FLOAT_CASTS:
            name = TensorProto.DataType.Name(to) if to in TensorProto.DataType.values() else to
            self._fail(node, f"casts to {name}; aiperf reads float32 models (a cast to float32 or float64 only)")
        self._alias(node, x)

    def _op_Identity(self, node) -> None:
        x = self._raw(node, 0)
        if x is None:
            self._fail(node, "input 0 is a constant that was not folded")
        self._alias(node, x)

    def _alias(self, node, x: Act) -> None:
        """The output is the input: pending work on the input (a norm's scale, a projection's bias) moves on."""
        self._set(node, x)
        source = node.input[0]
        if self._single_reader(source):
            for slot in (self.norm_slot, self.bias_slot):
                if source in slot:
                    slot[node.output[0]] = slot.pop(source)

    def _op_ReduceMean(self, node) -> None:
        x = self._raw(node, 0)
        f = self._pointwise_of(x)
        a = node_attrs(node)
        axes = self._axes(node, since_opset=18) or []
        if f is None or f.source.layout != "seq" or len(axes) != 1 or axes[0] % 3 != 2:
            super()._op_ReduceMean(node)
            return
        if not a.get("keepdims", 1):
            self._fail(node, "a mean over the last axis must keep its axis (keepdims=1), as a norm's does")
        if f.kind == "act" and _close(f.values, PROBE):
            kind = "mean"
        elif f.kind == "act" and _close(f.values, PROBE ** 2):
            kind = "mean_sq"
        elif f.kind == "centered" and _close(f.values, PROBE ** 2):
            kind = "var"
        else:
            self._fail(node, "averages over the last axis something other than a norm's x, x^2 or (x - mean)^2")
        self._pending(node, f, STAT_PROBE, kind=kind)

    def _binary(self, node, op: str) -> bool:
        """An elementwise op on pending functions: True when handled (pending, a centering, a norm)."""
        a, b = self._raw(node, 0), self._raw(node, 1)
        fa, fb = self._pointwise_of(a), self._pointwise_of(b)
        with np.errstate(all="ignore"):
            if a is not None and b is not None:
                if fa is None or fb is None:
                    return False
                if fa.same_source(fb):
                    self._pending(node, fa, _BINARY[op](fa.values, fb.values))
                    return True
                if op == "Sub" and fa.kind == "act" and fb.kind == "mean" and fa.source.node == fb.source.node \
                        and _close(fa.values, PROBE) and _close(fb.values, STAT_PROBE):
                    self._pending(node, fb, PROBE, kind="centered")
                    return True
                if op in ("Mul", "Div"):
                    if fb.kind in STAT_KINDS and fa.kind in ("act", "centered"):
                        self._norm(node, fa, fb, divide=op == "Div")
                        return True
                    if op == "Mul" and fa.kind in STAT_KINDS and fb.kind in ("act", "centered"):
                        self._norm(node, fb, fa, divide=False)
                        return True
                return False
            k_const = 0 if a is None else 1
            value = np.asarray(self.consts[node.input[k_const]])
            act, f = (b, fb) if a is None else (a, fa)
            if f is None or value.size != 1:
                return False
            if act.layout != "pointwise" and act.layout != "seq" and op in ("Mul", "Add"):
                return False  # the CNN importer's mul_const / add_const
            c = float(value.reshape(()))
            values = _BINARY[op](c, f.values) if k_const == 0 else _BINARY[op](f.values, c)
            self._pending(node, f, values)
            return True

    def _norm(self, node, x: Pointwise, stat: Pointwise, divide: bool) -> None:
        """x / sqrt(stat + eps) (or x * 1/sqrt(stat + eps)): a layer norm or an RMS norm with unit scale."""
        ops = {("centered", "var"): "layer_norm", ("act", "mean_sq"): "rms_norm"}
        op = ops.get((x.kind, stat.kind))
        if op is None or x.source.node != stat.source.node or not _close(x.values, PROBE):
            self._fail(node, "divides a tensor by a statistic that does not normalise it (aiperf reads (x - mean) / "
                             "sqrt(var + eps) and x / sqrt(mean(x^2) + eps))")
        with np.errstate(all="ignore"):
            root = stat.values if divide else 1.0 / stat.values
            epsilon = float(root[0] ** 2 - STAT_PROBE[0])
            if not (epsilon > 0.0 and _close(root, np.sqrt(STAT_PROBE + epsilon))):
                self._fail(node, "divides by a function of the variance other than sqrt(var + eps)")
        source = x.source
        width = self.shapes[source.node][-1]
        params = {"gamma": np.ones(width, np.float32)}
        if op == "layer_norm":
            params["beta"] = np.zeros(width, np.float32)
        nid = self._emit(node, op, [source.node], {"epsilon": clean_float(epsilon)}, params)
        self._set(node, Act(nid, source.layout, source.order))
        self.norm_slot[node.output[0]] = (nid, "gamma")

    def _norm_parameter(self, node, k: int, value: np.ndarray, param: str) -> bool:
        """A per-channel constant times (gamma) or plus (beta) a norm's output read by nothing else."""
        name = node.input[k]
        slot = self.norm_slot.get(name)
        if slot is None or not self._single_reader(name):
            return False
        nid, expected = slot
        op = self._ir_op(nid)
        width = self.shapes[nid][-1]
        rank = len(self._full_shape(self.acts[name]))
        if value.size != width or value.ndim > rank or value.shape[-1] != width:
            return False
        if param == "gamma" and expected != "gamma":
            return False
        if param == "beta" and op != "layer_norm":
            return False
        self.weights[nid][param] = np.array(value.reshape(width), dtype=np.float32)
        self._set(node, self.acts[name])
        del self.norm_slot[name]
        if param == "gamma" and op == "layer_norm":
            self.norm_slot[node.output[0]] = (nid, "beta")
        return True

    # -- elementwise ops -----------------------------------------------------------------------------
    def _op_Mul(self, node) -> None:
        if len(node.input) != 2:
            self._fail(node, f"expects 2 inputs, got {len(node.input)}")
        a, b = self._raw(node, 0), self._raw(node, 1)
        if (a is None) != (b is None):
            k = 0 if a is not None else 1
            act, value = (a or b), np.asarray(self.consts[node.input[1 - k]])
            if act.layout in HEADS_LAYOUTS + ("scores", "rotated"):
                self._heads_times(node, act, value)
                return
            if self._norm_parameter(node, k, value, "gamma"):
                return
        if self._binary(node, "Mul"):
            return
        super()._op_Mul(node)

    def _op_Div(self, node) -> None:
        a, b = self._raw(node, 0), self._raw(node, 1)
        if a is not None and b is None and a.layout in HEADS_LAYOUTS + ("scores",):
            divisor = np.asarray(self.consts[node.input[1]])
            if divisor.size != 1:
                self._fail(node, f"divides {LAYOUT_TEXT[a.layout]} by a constant of shape {list(divisor.shape)}; only "
                                 f"a scalar (the attention scale) is supported")
            self._set(node, replace(a, scale=a.scale / float(divisor.reshape(()))))
            return
        if self._binary(node, "Div"):
            return
        if a is not None and b is None:  # a per-channel divisor
            self._by_constant(node, self._act(node, 0), 1.0 / np.asarray(self.consts[node.input[1]]), "mul_const")
            return
        self._act(node, 0)
        self._act(node, 1)
        self._fail(node, "divides two activations; aiperf reads a division only inside a norm's decomposition")

    def _op_Sub(self, node) -> None:
        a, b = self._raw(node, 0), self._raw(node, 1)
        if self._binary(node, "Sub"):
            return
        if a is not None and b is None:  # a per-channel constant subtracted
            self._by_constant(node, self._act(node, 0), -np.asarray(self.consts[node.input[1]]), "add_const")
            return
        self._act(node, 0)
        self._act(node, 1)
        self._fail(node, "subtracts two activations; aiperf reads a subtraction only inside a layer norm's "
                         "decomposition (x - mean(x))")

    def _op_Add(self, node) -> None:
        if len(node.input) != 2:
            super()._op_Add(node)
            return
        a, b = self._raw(node, 0), self._raw(node, 1)
        if a is not None and b is not None and {a.layout, b.layout} == {"rot_cos", "rot_sin"}:
            self._rotary(node, *((a, b) if a.layout == "rot_cos" else (b, a)))
            return
        if (a is None) != (b is None):
            k = 0 if a is not None else 1
            act, value = (a or b), np.asarray(self.consts[node.input[1 - k]])
            if act.layout == "scores":
                self._mask(node, act, value, keep=None)
                return
            if self._norm_parameter(node, k, value, "beta"):
                return
        if self._binary(node, "Add"):
            return
        super()._op_Add(node)

    # -- projections over rows, fused projections split ----------------------------------------------
    def _op_Split(self, node) -> None:
        x = self._act(node, 0, ("seq",))
        a = node_attrs(node)
        width = self.shapes[x.node][-1]
        if a.get("axis", 0) % 3 != 2:
            self._fail(node, f"only a split of the last axis (a fused projection's parts) is supported, got axis "
                             f"{a.get('axis', 0)}")
        outputs = list(node.output)
        if self.opset >= 13:
            given = self._const(node, 1, optional=True)
            sizes = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
        else:
            sizes = list(a["split"]) if "split" in a else None
        if sizes is None:
            parts = len(outputs)
            step = -(-width // parts)  # opset 18's num_outputs: the last part may be smaller
            sizes = [min(step, width - k * step) for k in range(parts)]
        if sum(sizes) != width or len(sizes) != len(outputs) or min(sizes) < 1:
            self._fail(node, f"parts {sizes} do not split the width {width}")
        start = 0
        for name, size in zip(outputs, sizes):
            if name:
                self.acts[name] = self._column_part(node, x, start, start + size)
            start += size

    def _column_part(self, node, x: Act, start: int, stop: int) -> Act:
        """Columns [start, stop) of a projection's output: a dense of those columns of its kernel and bias."""
        source = next(n for n in self.nodes if n.id == x.node)
        if source.op != "dense" or x.order is not None:
            self._fail(node, f"splits the output of a {source.op} node; aiperf reads a split only of a projection "
                             f"(a fused q/k/v)")
        params = {k: v[..., start:stop] for k, v in self.weights[source.id].items()}
        attrs = {"units": stop - start, "use_bias": "bias" in params}
        nid = self._emit(node, "dense", [source.inputs[0]], attrs, params)
        self.split_from[source.id] = node
        return Act(nid, x.layout)

    def _op_Slice(self, node) -> None:
        x = self._raw(node, 0)
        if x is None:
            self._fail(node, "input 0 is a constant that was not folded")
        if self.opset >= 10:
            starts, ends = (np.asarray(self._const(node, k)).reshape(-1) for k in (1, 2))
            axes, steps = (self._const(node, k, optional=True) for k in (3, 4))
        else:
            a = node_attrs(node)
            starts, ends, axes, steps = (np.asarray(a.get(key)) if key in a else None
                                         for key in ("starts", "ends", "axes", "steps"))
        axes = list(range(len(starts))) if axes is None else [int(v) for v in np.asarray(axes).reshape(-1)]
        steps = [1] * len(starts) if steps is None else [int(v) for v in np.asarray(steps).reshape(-1)]
        if len(axes) != 1 or steps != [1]:
            self._act(node, 0, ("seq", "heads", "split_heads"))
            self._fail(node, f"only a slice of one axis with step 1 is supported, got axes {axes} and steps {steps}")
        rank = len(self._full_shape(x))
        axis = axes[0] % rank
        size = self._full_shape(x)[axis]
        start, stop = (int(np.clip(v + size if v < 0 else v, 0, size)) for v in (starts[0], ends[0]))
        if x.layout in ("heads", "split_heads") and axis == rank - 1 and x.group == 1 and x.scale == 1.0:
            half = size // 2
            if size % 2 == 0 and (start, stop) in ((0, half), (half, size)):
                part = "low" if start == 0 else "high"
                self._set(node, Act(x.node, "half", heads=x.heads, info=(x.layout, part)))
                return
            self._fail(node, f"slices [{start}, {stop}) of heads of width {size}; aiperf reads only the halves of "
                             f"rotate_half")
        x = self._act(node, 0, ("seq",))
        if axis != 2:
            self._fail(node, f"only a slice of a sequence's last axis (a fused projection's part) is supported, got "
                             f"axis {axes[0]}")
        if stop <= start:
            self._fail(node, f"slices nothing ([{start}, {stop}))")
        self._set(node, self._column_part(node, x, start, stop))

    # -- attention heads -----------------------------------------------------------------------------
    def _op_Reshape(self, node) -> None:
        x = self._act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "swapped", "rows", "tokens") + HEADS_LAYOUTS)
        target = [int(v) for v in np.asarray(self._const(node, 1)).reshape(-1)]
        dims = self._reshaped(node, x, target)
        batch = self.batch or 1
        if dims == self._full_shape(x):  # to its own shape, as Hugging Face's input_ids.view(-1, S)
            self._alias(node, x)
            return
        if x.layout == "tokens":
            self._fail(node, f"reshapes the token ids {self._full_shape(x)} to {dims}; only to their own shape")
        seq_len, width = self.shapes[x.node][0], self.shapes[x.node][-1]
        layout = x.layout
        if layout in HEADS_LAYOUTS:
            h, d = x.heads, self._head_dim(x)
            moves = {("split_heads", (batch, seq_len, h * d)): "seq", ("split_heads", (batch * seq_len, h * d)): "rows",
                     ("heads", (batch * h, seq_len, d)): "heads_rows",
                     ("heads_t", (batch * h, d, seq_len)): "heads_rows_t",
                     ("heads_rows", (batch, h, seq_len, d)): "heads",
                     ("heads_rows_t", (batch, h, d, seq_len)): "heads_t"}
            if layout == "heads_rep" and dims in ([batch, h, seq_len, d], [batch * h, seq_len, d]):
                self._set(node, replace(x, layout="heads" if len(dims) == 4 else "heads_rows"))
                return
            to = moves.get((layout, tuple(dims)))
            if to is None or (to in ("seq", "rows") and (x.group != 1 or x.scale != 1.0)):
                self._fail(node, f"reshapes {LAYOUT_TEXT[layout]} ({self._full_shape(x)}) to {dims}; aiperf reads "
                                 f"only the head reshapes of an attention, the batch axis kept first")
            self._set(node, Act(x.node, to) if to in ("seq", "rows") else replace(x, layout=to))
            return
        if layout == "rows":
            if dims != [batch, seq_len, width]:
                self._fail(node, f"reshapes the rows of a sequence to {dims}; only back to [{batch}, {seq_len}, "
                                 f"{width}] is supported")
            self._set(node, Act(x.node, "seq"))
            return
        if layout == "seq" and len(dims) == 4 and dims[:2] == [batch, seq_len] and dims[2] * dims[3] == width:
            self._set(node, Act(x.node, "split_heads", heads=dims[2]))
            return
        if layout == "seq" and dims == [batch * seq_len, width]:
            self._set(node, Act(x.node, "rows"))
            return
        if layout == "seq":
            self._fail(node, f"reshapes a sequence {self._full_shape(x)} to {dims}; aiperf reads a sequence's "
                             f"reshape only into heads [N, S, H, d] or rows [N * S, D], the batch axis kept")
        super()._op_Reshape(node)

    def _op_Transpose(self, node) -> None:
        x = self._raw(node, 0)
        perm = list(node_attrs(node).get("perm", []))
        moves = {("split_heads", (0, 2, 1, 3)): "heads", ("split_heads", (0, 2, 3, 1)): "heads_t",
                 ("heads", (0, 2, 1, 3)): "split_heads", ("heads", (0, 1, 3, 2)): "heads_t",
                 ("heads_t", (0, 1, 3, 2)): "heads", ("heads_rows", (0, 2, 1)): "heads_rows_t",
                 ("heads_rows_t", (0, 2, 1)): "heads_rows"}
        if x is not None and x.layout in HEADS_LAYOUTS + ("scores", "probs"):
            to = moves.get((x.layout, tuple(perm)))
            if to is None or (to == "split_heads" and x.group != 1):
                self._fail(node, f"transposes {LAYOUT_TEXT[x.layout]} by {perm}; aiperf reads only the head "
                                 f"transposes of an attention, the batch axis kept first")
            self._set(node, replace(x, layout=to))
            return
        super()._op_Transpose(node)

    def _op_Unsqueeze(self, node) -> None:
        x = self._act(node, 0, ("heads",))
        axes = self._const(node, 1) if self.opset >= 13 else node_attrs(node).get("axes")
        axes = [int(v) for v in np.asarray(axes).reshape(-1)]
        if axes not in ([2], [-3]) or x.group != 1 or x.scale != 1.0:
            self._fail(node, f"unsqueezes heads at axes {axes}; aiperf reads only repeat_kv's axis 2")
        self._set(node, replace(x, layout="heads_unsq"))

    def _op_Expand(self, node) -> None:
        x = self._act(node, 0, ("heads_unsq",))
        shape = [int(v) for v in np.asarray(self._const(node, 1)).reshape(-1)]
        batch, (kv, _, seq_len, d) = self.batch or 1, self._onnx_shape(x)
        if len(shape) != 5 or [shape[0], shape[1], shape[3], shape[4]] != [batch, kv, seq_len, d] or shape[2] < 1:
            self._fail(node, f"expands key-value heads [{batch}, {kv}, 1, {seq_len}, {d}] to {shape}; aiperf reads "
                             f"only repeat_kv's [{batch}, {kv}, G, {seq_len}, {d}]")
        group = shape[2]
        self._set(node, replace(x, layout="heads_rep", heads=kv * group, group=group))

    def _heads_times(self, node, x: Act, value: np.ndarray) -> None:
        """Heads or scores times a constant: the attention scale, or a rotary table."""
        if value.size == 1:
            if x.layout == "rotated":
                self._fail(node, "multiplies rotated heads by a scalar; aiperf reads them only times a sine table")
            self._set(node, replace(x, scale=x.scale * float(value.reshape(()))))
            return
        base = x.info[0] if x.layout == "rotated" else x.layout
        if base not in ("heads", "split_heads") or x.group != 1 or x.scale != 1.0:
            self._fail(node, f"multiplies {LAYOUT_TEXT[x.layout]} by a constant of shape {list(value.shape)}; aiperf "
                             f"reads only a scalar scale or a rotary table")
        table = self._table(node, base, x, value)
        self._set(node, Act(x.node, "rot_sin" if x.layout == "rotated" else "rot_cos", heads=x.heads,
                            info=(base, table)))

    def _table(self, node, base: str, x: Act, value: np.ndarray) -> np.ndarray:
        """A constant over heads of `base` layout as one (S, d) table, the same for every sequence and head."""
        full = self._full_shape(replace(x, layout=base))
        try:
            spread = np.broadcast_to(value, full) if value.ndim <= len(full) else None
        except ValueError:
            spread = None
        if spread is None:
            self._fail(node, f"a constant of shape {list(value.shape)} does not broadcast to heads {full}")
        if base == "split_heads":
            spread = spread.transpose(0, 2, 1, 3)
        if not np.array_equal(spread, np.broadcast_to(spread[:1, :1], spread.shape)):
            self._fail(node, "a rotary table that differs between sequences or heads is not supported")
        return np.asarray(spread[0, 0], np.float64)

    def _op_Concat(self, node) -> None:
        xs = [self._raw(node, k) for k in range(len(node.input))]
        if any(x is not None and x.layout == "half" for x in xs):
            axis = node_attrs(node).get("axis")
            upper, lower = xs if len(xs) == 2 else (None, None)
            if upper is None or lower is None or upper.layout != "half" or lower.layout != "half" or \
                    upper.node != lower.node or upper.info != (lower.info[0], "neg_high") or lower.info[1] != "low" or \
                    axis not in (-1, 3):
                self._fail(node, "concatenates halves of heads other than rotate_half's [-x2, x1] over the last axis")
            self._set(node, Act(upper.node, "rotated", heads=upper.heads, info=(upper.info[0],)))
            return
        super()._op_Concat(node)

    def _rotary(self, node, cos: Act, sin: Act) -> None:
        """x cos + rotate_half(x) sin: an IR rotary on the projection, its base read from the tables."""
        if cos.node != sin.node or cos.info[0] != sin.info[0]:
            self._fail(node, "adds a cosine and a sine term of different heads")
        d = self._head_dim(cos)
        half = d // 2
        cos_table, sin_table = cos.info[1], sin.info[1]
        if not (np.allclose(cos_table[:, :half], cos_table[:, half:], atol=1e-7) and
                np.allclose(sin_table[:, :half], sin_table[:, half:], atol=1e-7)):
            self._fail(node, "rotary tables whose halves differ (the interleaved form) are not supported")
        base = rotary_base(cos_table[:, :half], sin_table[:, :half], d)
        if base is None:
            self._fail(node, "the cos and sin tables are not the angles position * base^(-2i / head_dim) of any base "
                             "(scaled rotary, as Llama 3's, is not supported)")
        nid = self._emit(node, "rotary", [cos.node], {"head_dim": d, "base": base})
        self._set(node, Act(nid, cos.info[0], heads=cos.heads))

    # -- attention -----------------------------------------------------------------------------------
    def _op_MatMul(self, node) -> None:
        if node.input[1] in self.consts:
            x = self._act(node, 0, ("flat", "seq", "rows"))
            if x.layout == "rows":
                kernel = self._const(node, 1)
                if kernel.ndim != 2:
                    self._fail(node, f"only MatMul of rows by a 2-D weight is supported, got {list(kernel.shape)}")
                self.bias_slot[node.output[0]] = self._dense(node, x, kernel, None)
                return
            super()._op_MatMul(node)
            return
        a, b = self._raw(node, 0), self._raw(node, 1)
        if a is not None and b is not None and a.layout == "heads" and b.layout == "heads_t":
            self._scores(node, a, b)
            return
        if a is not None and b is not None and a.layout == "probs" and b.layout == "heads":
            self._attention_output(node, a, b)
            return
        self._fail(node, "multiplies two activations; aiperf reads a product of activations only as attention's two "
                         "products (query heads by transposed key heads, probabilities by value heads)")

    def _scores(self, node, q: Act, k: Act) -> None:
        d = self._head_dim(q)
        if q.group != 1 or q.heads != k.heads or self._head_dim(k) != d:
            self._fail(node, f"multiplies {q.heads} query heads of width {d} by {k.heads} key heads of width "
                             f"{self._head_dim(k)}")
        info = Scores(q.node, k.node, k.group, d)
        self._set(node, Act(q.node, "scores", heads=q.heads, scale=q.scale * k.scale, info=info))

    def _mask(self, node, x: Act, value: np.ndarray, keep: np.ndarray | None) -> None:
        """Scores plus a constant (keep None), or Where(keep, scores, fill): only a causal mask is read."""
        if x.info.masked:
            self._fail(node, "masks the attention scores a second time")
        causal = self._causal(node, self._full_shape(x), value, keep)
        self._set(node, replace(x, info=replace(x.info, causal=causal, masked=True)))

    def _causal(self, node, full: list[int], value: np.ndarray, keep: np.ndarray | None) -> bool:
        """Whether a mask of scores `full` [N, H, S, S] (added, or where `keep` is False the score replaced by
        `value`) is causal (True) or keeps every score (False); refused naming the node otherwise."""
        try:
            value = np.broadcast_to(np.asarray(value, np.float64), full)
            keep = None if keep is None else np.broadcast_to(np.asarray(keep, bool), full)
        except ValueError:
            self._fail(node, f"a mask of shape {list(np.shape(value))} does not broadcast to the scores {full}")
        if keep is None:
            kept = value > MASKED
            if np.any(value[kept] != 0.0):
                self._fail(node, "adds a bias to the attention scores (ALiBi or a relative position bias), which the "
                                 "IR's attention does not have")
        else:
            kept = keep
            if np.any(~keep & (value > MASKED)):
                self._fail(node, "replaces attention scores by finite values; aiperf reads Where only as a mask")
        if not np.array_equal(kept, np.broadcast_to(kept[:1, :1], kept.shape)):
            self._fail(node, "masks the scores differently per sequence or head (a padding mask)")
        pattern = kept[0, 0]
        if np.array_equal(pattern, np.tril(np.ones(pattern.shape, dtype=bool))):
            return True
        if pattern.all():
            return False
        self._fail(node, "masks the scores other than causally (a sliding window or a prefix mask); the IR's attention "
                         "is causal or unmasked")

    def _op_IsNaN(self, node) -> None:
        x = self._raw(node, 0)
        if x is None or x.layout != "probs":
            self._fail(node, "unsupported op (aiperf reads IsNaN only in SDPA's guard of fully masked rows)")
        self._set(node, Act(x.node, "probs_nan", heads=x.heads, info=node.input[0]))

    def _op_Where(self, node) -> None:
        guard = self._raw(node, 0)
        if guard is not None and guard.layout == "probs_nan":
            # Where(IsNaN(p), 0, p): rows with every score masked read 0; a causal mask leaves none.
            fill = np.asarray(self.consts.get(node.input[1], np.nan))
            if node.input[2] != guard.info or fill.size != 1 or fill.reshape(()) != 0.0:
                self._fail(node, "reads IsNaN of attention probabilities other than as Where(IsNaN(p), 0, p)")
            self._set(node, self.acts[guard.info])
            return
        condition = self._const(node, 0)
        a, b = self._raw(node, 1), self._raw(node, 2)
        if a is not None and b is None and a.layout == "scores":
            self._mask(node, a, self.consts[node.input[2]], np.asarray(condition, bool))
            return
        if b is not None and a is None and b.layout == "scores":
            self._mask(node, b, self.consts[node.input[1]], ~np.asarray(condition, bool))
            return
        self._fail(node, "unsupported op (aiperf reads Where only as a causal mask of attention scores)")

    def _op_Softmax(self, node) -> None:
        x = self._raw(node, 0)
        if x is not None and x.layout == "scores":
            axis = node_attrs(node).get("axis", 1 if self.opset < 13 else -1)
            if axis % 4 != 3:
                self._fail(node, f"only a softmax of attention scores over the keys (the last axis) is supported, got "
                                 f"axis {axis}")
            if not self._single_reader(node.input[0]):
                self._fail(node, "the attention scores are also read elsewhere")
            self._set(node, replace(x, layout="probs"))
            return
        super()._op_Softmax(node)

    def _attention_output(self, node, probs: Act, v: Act) -> None:
        info = probs.info
        d = info.head_dim
        if v.heads != probs.heads or self._head_dim(v) != d or v.group != info.group or v.scale != 1.0:
            self._fail(node, f"multiplies the probabilities of {probs.heads} heads of width {d} by {v.heads} value "
                             f"heads of width {self._head_dim(v)} (key heads repeated {info.group} times, value heads "
                             f"{v.group} times)")
        readers = self.readers.get(node.input[0], [])
        if not all(self.g.node[i].op_type in ("MatMul", "IsNaN", "Where") for i in readers):
            self._fail(node, "the attention probabilities are also read elsewhere")
        self._check_scale(node, probs.scale, d)
        attrs = {"heads": probs.heads, "head_dim": d, "causal": info.causal, "kv_heads": probs.heads // info.group}
        nid = self._emit(node, "attention", [info.query, info.key, v.node], attrs)
        self._set(node, Act(nid, "heads", heads=probs.heads))

    def _check_scale(self, node, scale: float, head_dim: int) -> None:
        if not math.isclose(scale, 1.0 / math.sqrt(head_dim), rel_tol=1e-5):
            self._fail(node, f"scales the attention scores by {scale:.6g}; the IR's attention scales by "
                             f"1/sqrt(head_dim) = {1.0 / math.sqrt(head_dim):.6g}")

    def _op_Attention(self, node) -> None:
        q = self._raw(node, 0)
        if q is None or q.layout != "heads":
            super()._op_Attention(node)
            return
        k, v = self._raw(node, 1), self._raw(node, 2)
        for x in (q, k, v):
            if x is None or x.layout != "heads" or x.scale != 1.0:
                self._fail(node, "reads 4-D inputs that are not all attention heads [N, H, S, d]")
        if any(node.input[4:]):
            self._fail(node, "caches and padding lengths are not supported (only q, k, v and a mask)")
        self._only_first_output(node)
        a = node_attrs(node)
        d = self._head_dim(q)
        # Key-value heads as ONNX's Attention repeats them (fewer heads), or repeated before it (repeat_kv).
        kv = k.heads // k.group
        if q.group != 1 or (k.heads, k.group) != (v.heads, v.group) or q.heads % kv or (k.heads != q.heads and
                                                                                      k.group != 1) or \
                self._head_dim(k) != d or self._head_dim(v) != d:
            self._fail(node, f"{q.heads} query heads, {k.heads} key and {v.heads} value heads of widths "
                             f"{d}, {self._head_dim(k)}, {self._head_dim(v)} are not grouped-query attention")
        self._check_scale(node, a.get("scale", 1.0 / math.sqrt(d)), d)
        if a.get("softcap", 0.0) != 0.0:
            self._fail(node, f"soft capping (softcap {a['softcap']}) is not supported")
        causal = bool(a.get("is_causal", 0))
        if len(node.input) > 3 and node.input[3]:
            mask = np.asarray(self._const(node, 3))
            full = [self.batch or 1, q.heads, self.shapes[q.node][0], self.shapes[k.node][0]]
            if mask.dtype == bool:  # True takes part
                masked = self._causal(node, full, np.full(mask.shape, -np.inf), mask)
            else:
                masked = self._causal(node, full, mask, None)
            if causal and masked:
                self._fail(node, "a causal mask beside is_causal is not supported")
            causal = causal or masked
        attrs = {"heads": q.heads, "head_dim": d, "causal": causal, "kv_heads": kv}
        nid = self._emit(node, "attention", [q.node, k.node, v.node], attrs)
        self._set(node, Act(nid, "heads", heads=q.heads))

    # -- the end -------------------------------------------------------------------------------------
    def _finish(self):
        act = self.acts.get(self.output)
        if act is not None and act.layout == "pointwise":
            act = self.acts[self.output] = self._materialize(act.info)
        if act is not None and act.layout in ("seq", "rows") and self.nodes[0].op == "token_input" and \
                self._ir_op(act.node) == "dense":
            if act.layout == "rows":
                self._fail(helper.make_node("Gemm", [], [self.output], name=self.output), "the logits are rows "
                           "[N * S, vocab], not a sequence; aiperf reads a language model's logits as [N, S, vocab]")
            # The IR's language models end in the softmax whose logits their loss reads.
            probs = helper.make_node("Softmax", [self.output], [f"{self.output}/probs"], name="probs")
            self.acts[self.output] = Act(self._emit(probs, "softmax", [act.node], {}), "seq")
        if act is not None:
            by_id = {n.id: n for n in self.nodes}
            keep, stack = set(), [self.acts[self.output].node]
            while stack:
                nid = stack.pop()
                if nid not in keep:
                    keep.add(nid)
                    stack.extend(by_id[nid].inputs)
            for fused, split in self.split_from.items():
                if fused in keep:
                    label = split.name or split.output[0]
                    error = GraphError(f"ONNX node '{label}' (op {split.op_type}): splits a fused projection whose "
                                       f"whole output is also read elsewhere, which the IR would compute twice")
                    error.node = label
                    raise error
        return super()._finish()
