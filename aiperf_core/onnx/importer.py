"""Reading ONNX into the graph IR: the importer's core (aiperf_core.onnx.import_onnx is the entry point).

Each ONNX tensor maps to an IR node plus the ONNX layout it stands for (Act), so that layout changes
(transposes, flattening, pooling to 1x1) cost no IR node; each ONNX op has a handler `_op_<OpType>`
that emits IR nodes or refuses in one line naming the ONNX node and op. This module reads the CNNs of
real exporters and the ops aiperf's own export writes; aiperf_core.onnx.sequence extends it to the
transformers that torch.onnx and Hugging Face models write with their attention, norms and activations
decomposed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.errors import GraphError
from aiperf_core.ir import OPS, Graph, Node
from aiperf_core.onnx.fold import fold_constants
from aiperf_core.weights import Weights, validate_weights

MIN_IMPORT_OPSET = 9
# Metadata key keeping the IR input node's id, since the ONNX input is always "input".
INPUT_ID_KEY = "aiperf.input_id"

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
_INDEX_TYPES = (TensorProto.INT64, TensorProto.INT32)
_UNKNOWN_VOCAB = 2  # a token input's vocabulary until its embedding's Gather is read

def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """The IR rotary's cos and sin tables (S, head_dim / 2) as float32: the angles position * base^(-2i /
    head_dim) and their cos and sin are computed in float64 (as the NumPy reference does), then rounded."""
    positions = np.arange(seq_len, dtype=np.float64)[:, None]
    theta = positions * float(base) ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def rotary_base(cos: np.ndarray, sin: np.ndarray, head_dim: int) -> float | None:
    """The base of rotary tables cos and sin (S, head_dim / 2) of positions 0 to S - 1, or None when no base
    gives them: the shortest decimal whose rotary_tables equal them within float32 rounding of the angles.

    The estimate reads the slowest pair's angle at position 1, base^(-(head_dim - 2) / head_dim), whose sine
    is small and exact to float32's relative precision. Where no angle depends on the base (head_dim 2, or
    one position) the IR's default, 10000, stands for any."""
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    seq_len = cos.shape[0]
    # An angle computed in float32 (as the exporters' models do) is off by a few ulps of position * 1.
    tolerance = 1e-6 + 4e-7 * seq_len
    candidates = [10000.0]
    if seq_len > 1 and head_dim > 2:
        slowest = math.atan2(sin[1, -1], cos[1, -1])
        if not 0.0 < slowest < 1.0:
            return None
        estimate = slowest ** (-head_dim / (head_dim - 2))
        candidates = [float(f"{estimate:.{digits}g}") for digits in range(1, 10)] + [estimate]
    for base in candidates:
        if base < 1.0:
            continue
        want_cos, want_sin = rotary_tables(seq_len, head_dim, base)
        if np.abs(want_cos - cos).max() <= tolerance and np.abs(want_sin - sin).max() <= tolerance:
            return base
    return None



# How an IR tensor is laid out in ONNX (after the batch axis):
#   nchw    C, H, W   of an IR image H x W x C
#   nhwc    H, W, C   of an IR image (after a Transpose, as tf2onnx writes)
#   pooled  C, 1, 1   of an IR vector C (GlobalAveragePool keeps the 1x1)
#   flat    F         of an IR vector F
#   seq     S, D      of an IR sequence S x D
#   tokens  S         of the IR token input (integer ids)
#   split   G, C/G, H, W  and  swapped  C/G, G, H, W: the two halves of a channel shuffle of an IR
#           image H x W x C, which only the shuffle's Transpose and last Reshape may read
# and the layouts of a transformer's inner tensors (aiperf_core.onnx.sequence), each private to the
# handlers of the pattern it belongs to.
LAYOUT_TEXT = {
    "nchw": "an NCHW feature map",
    "nhwc": "an NHWC feature map",
    "pooled": "a pooled [N, C, 1, 1] tensor",
    "flat": "a flat [N, F] tensor",
    "seq": "a sequence [N, S, D]",
    "tokens": "token ids [N, S]",
    "split": "a channel split [N, G, C/G, H, W]",
    "swapped": "a transposed channel split [N, C/G, G, H, W]",
    "rows": "the rows [N * S, D] of a sequence",
    "pointwise": "an elementwise function of a tensor",
    "centered": "a tensor less its mean",
    "stat": "a statistic over the last axis",
    "split_heads": "attention heads [N, S, H, d]",
    "heads": "attention heads [N, H, S, d]",
    "heads_t": "transposed attention heads [N, H, d, S]",
    "heads_rows": "attention heads [N * H, S, d]",
    "heads_rows_t": "transposed attention heads [N * H, d, S]",
    "heads_unsq": "key-value heads [N, KV, 1, S, d]",
    "heads_rep": "repeated key-value heads [N, KV, G, S, d]",
    "half": "half of each attention head",
    "rotated": "attention heads with their halves swapped and one negated",
    "rot_cos": "attention heads times a cosine table",
    "rot_sin": "rotated attention heads times a sine table",
    "scores": "attention scores [N, H, S, S]",
    "probs": "attention probabilities [N, H, S, S]",
    "probs_nan": "where attention probabilities are NaN",
}
_ATTENTION_ONLY = ("the inside of an attention, which aiperf reads only as its written-out form (heads reshaped and "
                   "transposed, an optional rotary embedding, MatMul, scale, causal mask, Softmax, MatMul) or as "
                   "ONNX's Attention")
# Layouts that only the handler expecting them may read.
PRIVATE_LAYOUTS = {
    "tokens": "token ids, which aiperf reads only as the indices of a Gather (an embedding)",
    "split": "half of a channel shuffle; aiperf reads only Reshape [N, G, C/G, H, W] -> Transpose "
             "[0, 2, 1, 3, 4] -> Reshape [N, C, H, W]",
    "swapped": "half of a channel shuffle; aiperf reads only Reshape [N, G, C/G, H, W] -> Transpose "
               "[0, 2, 1, 3, 4] -> Reshape [N, C, H, W]",
    "rows": "the rows of a sequence, which aiperf reads only in a projection (Gemm or MatMul and its bias) and the "
            "Reshape back to [N, S, D]",
    "centered": "a tensor less its mean, which aiperf reads only inside a layer norm's decomposition",
    "stat": "a statistic over the last axis, which aiperf reads only inside a layer norm's or an RMS norm's "
            "decomposition",
    **{layout: _ATTENTION_ONLY for layout in ("split_heads", "heads", "heads_t", "heads_rows", "heads_rows_t",
                                              "heads_unsq", "heads_rep", "half", "rotated", "rot_cos", "rot_sin",
                                              "scores", "probs", "probs_nan")},
}


@dataclass(frozen=True, eq=False)
class Act:
    """An ONNX activation tensor: the IR node computing it and its ONNX layout."""

    node: str
    layout: str
    # flat only: for each IR feature, the index of the same feature in ONNX's
    # order (a flattened NCHW map is CHW in ONNX but HWC in the IR); None = same.
    order: np.ndarray | None = None
    # nchw only: zero padding (top, bottom, left, right) of a Pad not yet applied,
    # to be folded into the Conv (or MaxPool) that reads it.
    pad: tuple[int, int, int, int] | None = None
    # split and swapped only: the channel shuffle's groups G.
    groups: int | None = None
    # The heads layouts: the ONNX tensor's heads H, of width d = the IR node's width * group / H.
    heads: int | None = None
    # The heads layouts: query heads per key-value head; ONNX head h is the IR node's head h // group.
    group: int = 1
    # The heads and scores layouts: a scalar factor not applied yet (attention's scale).
    scale: float = 1.0
    # What the other private layouts carry (aiperf_core.onnx.sequence): a pending elementwise function,
    # a rotary table, the query and key of attention scores.
    info: Any = None



def read_model(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise GraphError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf decode errors, missing external data, ...
        raise GraphError(f"{path}: not a readable ONNX model ({one_line(exc)})") from None
    if not model.graph.node or not model.opset_import:
        raise GraphError(f"{path}: not an ONNX model (no graph or no opset)")
    return model


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def clean_float(value) -> float:
    """A float32 attribute as the shortest decimal that rounds to it (1.001e-05, not 1.0009999e-05)."""
    return float(str(np.float32(value)))


def node_attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        out[attr.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


class Importer:
    def __init__(self, model: onnx.ModelProto, fallback_name: str | None):
        self.model = model
        self.g = model.graph
        self.name = self.g.name or fallback_name or "onnx_model"
        self.consts: dict[str, np.ndarray] = {}
        self.acts: dict[str, Act] = {}
        self.nodes: list[Node] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.weights: Weights = {}
        self.ids: set[str] = set()
        self.batch: int | None = None
        # ONNX tensors computed by a MatMul -> the IR dense node,
        # so that a following Add of a constant becomes that node's bias.
        self.bias_slot: dict[str, str] = {}
        self.position = 0  # index of the ONNX node being converted, to name unnamed nodes
        self.vocab_known = True  # False while a token input waits for its embedding's table
        self.opset = self._default_opset()

    # -- driver ------------------------------------------------------------
    def run(self) -> tuple[Graph, Weights]:
        if len(self.g.output) != 1:
            raise GraphError(f"ONNX model has {len(self.g.output)} outputs; aiperf needs exactly one")
        self.output = self.g.output[0].name
        initializers = {t.name for t in self.g.initializer}
        inputs = [v.name for v in self.g.input if v.name not in initializers]
        if len(inputs) == 1:
            self.model = fold_constants(self.model, inputs[0], self.opset)
            self.g = self.model.graph
        for tensor in self.g.initializer:
            self.consts[tensor.name] = self._initializer(tensor)
        live = self._live()
        self.readers: dict[str, list[int]] = {}
        for i in sorted(live):
            for name in self.g.node[i].input:
                if name:
                    self.readers.setdefault(name, []).append(i)
        self._add_input()
        for i, node in enumerate(self.g.node):
            if i in live:
                self.position = i
                self._convert(node)
        return self._finish()

    def _default_opset(self) -> int:
        versions = [o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")]
        if not versions:
            raise GraphError("ONNX model does not import the default operator set")
        if versions[0] < MIN_IMPORT_OPSET:
            raise GraphError(f"ONNX opset {versions[0]} is not supported (need {MIN_IMPORT_OPSET} or newer)")
        return versions[0]

    def _initializer(self, tensor: TensorProto) -> np.ndarray:
        try:
            return numpy_helper.to_array(tensor)
        except Exception as exc:
            raise GraphError(f"ONNX initializer '{tensor.name}' cannot be read ({one_line(exc)})") from None

    def _live(self) -> set[int]:
        """Indices of the nodes the graph output depends on; the rest is ignored."""
        producer = {out: i for i, n in enumerate(self.g.node) for out in n.output if out}
        live: set[int] = set()
        stack = [self.output]
        seen = set(stack)
        while stack:
            i = producer.get(stack.pop())
            if i is None or i in live:
                continue
            live.add(i)
            for name in self.g.node[i].input:
                if name and name not in seen:
                    seen.add(name)
                    stack.append(name)
        return live

    def _add_input(self) -> None:
        read = set(self.readers) | {self.output}
        inputs = [v for v in self.g.input if v.name not in self.consts and v.name in read]
        if len(inputs) != 1:
            raise GraphError(f"ONNX model has {len(inputs)} non-constant inputs in use; aiperf needs exactly one")
        value = inputs[0]
        tensor_type = value.type.tensor_type
        tokens = value.type.HasField("tensor_type") and tensor_type.elem_type in _INDEX_TYPES
        if not value.type.HasField("tensor_type") or tensor_type.elem_type not in FLOAT_TYPES and not tokens:
            raise GraphError(f"ONNX input '{value.name}' must be a floating-point tensor or integer token ids")
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim]
        if tokens and len(dims) != 2:
            raise GraphError(f"ONNX input '{value.name}' of token ids must be [N, S], got rank {len(dims)}")
        if len(dims) not in (2, 3, 4):
            raise GraphError(f"ONNX input '{value.name}' must be [N, C, H, W], [N, S, D] or [N, F], "
                             f"got rank {len(dims)}")
        if any(d is None for d in dims[1:]):
            raise GraphError(
                f"ONNX input '{value.name}' has symbolic size in {_dims_text(tensor_type)}; "
                "aiperf needs fixed sizes but for the batch"
            )
        self.batch = dims[0]
        op, layout = "input", {2: "flat", 3: "seq", 4: "nchw"}[len(dims)]
        shape = tuple(dims[1:])
        if tokens:
            op, layout = "token_input", "tokens"
        elif len(dims) == 4 and self._read_as_nhwc(value.name):
            layout = "nhwc"
        elif len(dims) == 4:
            shape = (dims[2], dims[3], dims[1])
        props = {p.key: p.value for p in self.model.metadata_props}
        stored = props.get(INPUT_ID_KEY, "")
        node_id = self._new_id(stored if _ID_RE.match(stored) else value.name)
        if tokens:
            # The vocabulary is the embedding table's height, known when its Gather is read.
            attrs = OPS[op].parse(node_id, {"seq_len": shape[0], "vocab": _UNKNOWN_VOCAB})
            self.vocab_known = False
        else:
            attrs = OPS[op].parse(node_id, {"shape": list(shape)})
        self.nodes.append(Node(node_id, op, (), attrs))
        self.shapes[node_id] = tuple(OPS[op].shape(node_id, attrs, []))
        self.acts[value.name] = Act(node_id, layout)

    def _read_as_nhwc(self, name: str) -> bool:
        """An NHWC input that every reader transposes to NCHW (as tf2onnx writes Keras models)."""
        readers = [self.g.node[i] for i in self.readers.get(name, [])]
        return bool(readers) and all(
            n.op_type == "Transpose" and list(node_attrs(n).get("perm", [])) == [0, 3, 1, 2] for n in readers
        )

    def _convert(self, node: onnx.NodeProto) -> None:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            self._fail(node, "unsupported op")
        used = [i for i in node.input if i]
        if op == "Constant" or (used and all(i in self.consts for i in used) and not op.startswith("Random")):
            self._fold(node)
            return
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            self._fail(node, "unsupported op")
        handler(node)

    def _finish(self) -> tuple[Graph, Weights]:
        if self.output in self.consts:
            raise GraphError(f"ONNX output '{self.output}' is a constant, not computed from the input")
        act = self.acts.get(self.output)
        if act is None:
            raise GraphError(f"ONNX output '{self.output}' is not produced by any node")
        if act.pad is not None:
            raise GraphError(f"ONNX output '{self.output}' comes from a Pad, which aiperf only folds into a Conv")
        if act.layout in PRIVATE_LAYOUTS:
            raise GraphError(f"ONNX output '{self.output}' is {PRIVATE_LAYOUTS[act.layout]}")
        # Drop IR nodes the output does not need (e.g. a tensor only read by Shape).
        by_id = {n.id: n for n in self.nodes}
        keep, stack = set(), [act.node]
        while stack:
            nid = stack.pop()
            if nid not in keep:
                keep.add(nid)
                stack.extend(by_id[nid].inputs)
        if self.nodes[0].id not in keep:
            raise GraphError("ONNX model output does not depend on its input")
        nodes = [n for n in self.nodes if n.id in keep]
        weights = {k: v for k, v in self.weights.items() if k in keep}
        try:
            graph = Graph(nodes, name=self.name)
            validate_weights(graph, weights)
        except GraphError as exc:
            raise GraphError(f"imported graph is invalid: {exc}") from None
        return graph, weights

    # -- helpers -----------------------------------------------------------
    def _fail(self, node: onnx.NodeProto, message: str):
        label = node.name or f"#{self.position}"
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        error = GraphError(f"ONNX node '{label}' (op {op}): {message}")
        error.node = label
        raise error

    def _new_id(self, base: str) -> str:
        stem = re.sub(r"[^A-Za-z0-9_.\-]", "_", base) or "node"
        candidate, k = stem[:128], 1
        while candidate in self.ids:
            k += 1
            suffix = f"_{k}"
            candidate = stem[: 128 - len(suffix)] + suffix
        self.ids.add(candidate)
        return candidate

    def _emit(self, node, op: str, inputs: list[str], attrs: dict, params: dict | None = None) -> str:
        """Append an IR node for the ONNX node, checking it as Graph would."""
        if len(set(inputs)) != len(inputs):
            self._fail(node, "reads the same tensor twice, which the IR cannot express")
        nid = self._new_id(node.name or (node.output[0] if node.output else op))
        spec = OPS[op]
        in_shapes = [self.shapes[i] for i in inputs]
        try:
            norm = spec.parse(nid, attrs)
            shape = tuple(int(d) for d in spec.shape(nid, norm, in_shapes))
        except GraphError as exc:
            self._fail(node, _bare(exc))
        if params is not None:
            want = spec.params(norm, in_shapes)
            for pname, array in params.items():
                if tuple(array.shape) != tuple(want[pname]):
                    self._fail(node, f"{pname} has shape {list(array.shape)}, expected {list(want[pname])}")
            # Copies: an initializer's array is read-only, and the weights are trained.
            self.weights[nid] = {k: np.array(v, dtype=np.float32, order="C") for k, v in params.items()}
        self.nodes.append(Node(nid, op, tuple(inputs), norm))
        self.shapes[nid] = shape
        return nid

    def _act(self, node, k: int, layouts=None, allow_pad: bool = False) -> Act:
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            self._fail(node, f"input {k} is missing")
        if name in self.consts:
            self._fail(node, f"input {k} ('{name}') is a constant; expected an activation")
        act = self.acts.get(name)
        if act is None:
            self._fail(node, f"reads '{name}', which no earlier node produces")
        if act.pad is not None and not allow_pad:
            self._fail(node, "reads the output of a Pad, which aiperf only folds into a following Conv or MaxPool")
        if act.layout in PRIVATE_LAYOUTS and (layouts is None or act.layout not in layouts):
            self._fail(node, f"reads {PRIVATE_LAYOUTS[act.layout]}")
        if layouts is not None and act.layout not in layouts:
            want = " or ".join(LAYOUT_TEXT[x] for x in layouts)
            self._fail(node, f"expects {want}, got {LAYOUT_TEXT[act.layout]}")
        return act

    def _const(self, node, k: int, optional: bool = False) -> np.ndarray | None:
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            if optional:
                return None
            self._fail(node, f"input {k} is missing")
        if name not in self.consts:
            self._fail(node, f"input {k} ('{name}') must be a constant (weights or attributes computed from constants)")
        return self.consts[name]

    def _axes(self, node, since_opset: int) -> list[int] | None:
        """The axes of an op that takes them as its input 1 from `since_opset` on and as an attribute before;
        None where the node gives none."""
        if self.opset >= since_opset:
            given = self._const(node, 1, optional=True)
            return None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
        given = node_attrs(node).get("axes")
        return None if given is None else list(given)

    def _set(self, node, act: Act) -> None:
        self.acts[node.output[0]] = act

    def _only_first_output(self, node) -> None:
        for name in node.output[1:]:
            if name and (name in self.readers or name == self.output):
                self._fail(node, f"uses output '{name}', which aiperf does not support (inference only)")

    def _full_shape(self, act: Act) -> list[int]:
        """The ONNX shape of the tensor, batch included (a symbolic batch counts as 1)."""
        return [self.batch or 1, *self._onnx_shape(act)]

    def _onnx_shape(self, act: Act) -> tuple[int, ...]:
        """The ONNX shape of the tensor without its batch axis."""
        shape = self.shapes[act.node]
        if act.layout == "nchw":
            h, w, c = shape
            return (c, h, w)
        if act.layout == "pooled":
            return (shape[0], 1, 1)
        if act.layout in ("split", "swapped"):
            h, w, c = shape
            g = act.groups
            return (g, c // g, h, w) if act.layout == "split" else (c // g, g, h, w)
        return shape

    def _pair(self, node, attrs: dict, key: str, default) -> list[int]:
        value = list(attrs.get(key, default))
        if len(value) != 2:
            self._fail(node, f"only 2-D {key} are supported, got {value}")
        return value

    def _no_dilation(self, node, attrs: dict) -> None:
        if any(d != 1 for d in attrs.get("dilations", [])):
            self._fail(node, f"dilations {list(attrs['dilations'])} are not supported (only 1)")

    def _padding(self, node, attrs: dict, x: Act, kernel, strides, ceil_mode: bool = False) -> list[int]:
        """IR padding [top, bottom, left, right] for a windowed op, resolving auto_pad and ceil_mode."""
        h, w, _ = self.shapes[x.node]
        pending = list(x.pad or (0, 0, 0, 0))
        sizes = (h + pending[0] + pending[1], w + pending[2] + pending[3])
        auto = attrs.get("auto_pad", "NOTSET")
        if auto in ("NOTSET", ""):
            pads = list(attrs.get("pads", [0, 0, 0, 0]))
            if len(pads) != 4:
                self._fail(node, f"only 2-D pads are supported, got {pads}")
            if min(pads) < 0:
                self._fail(node, f"negative pads {pads} are not supported")
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
            self._fail(node, f"unknown auto_pad '{auto}'")
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

    # -- constants ---------------------------------------------------------
    def _fold(self, node) -> None:
        """Evaluate a node whose inputs are all constant (weights, shapes) with ONNX's reference runtime."""
        if node.op_type == "Identity":
            self.consts[node.output[0]] = self.consts[node.input[0]]
            return
        from onnx.reference import ReferenceEvaluator

        feeds = {name: self.consts[name] for name in node.input if name}
        # Wrapped in a model, since a bare node would be run at the latest opset.
        graph = helper.make_graph(
            [node], "fold",
            [helper.make_value_info(name, onnx.TypeProto()) for name in feeds],
            [helper.make_value_info(name, onnx.TypeProto()) for name in node.output if name],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        try:
            results = ReferenceEvaluator(model).run(None, feeds)
        except Exception as exc:
            self._fail(node, f"cannot evaluate this constant computation ({one_line(exc)})")
        for name, value in zip([name for name in node.output if name], results):
            self.consts[name] = np.asarray(value)

    def _op_Shape(self, node) -> None:
        x = self._act(node, 0)
        # A symbolic batch counts as 1: aiperf graphs are per image, and a
        # Reshape target built from it is checked against that below.
        shape = np.array(self._full_shape(x), dtype=np.int64)
        a = node_attrs(node)
        self.consts[node.output[0]] = shape[a.get("start", 0): a.get("end", len(shape))]

    # -- layers ------------------------------------------------------------
    def _op_Conv(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        kernel = self._const(node, 1)
        bias = self._const(node, 2, optional=True)
        a = node_attrs(node)
        if kernel.ndim != 4:
            self._fail(node, f"only 2-D convolutions are supported (weight of rank {kernel.ndim})")
        self._no_dilation(node, a)
        groups = a.get("group", 1)
        filters, per_group, kh, kw = kernel.shape
        channels = self.shapes[x.node][2]
        if per_group * groups != channels:
            self._fail(node, f"weight reads {per_group} channels per group in {groups} group(s), "
                             f"the input has {channels}")
        if list(a.get("kernel_shape", [kh, kw])) != [kh, kw]:
            self._fail(node, f"kernel_shape {list(a['kernel_shape'])} does not match the weight's {[kh, kw]}")
        strides = self._pair(node, a, "strides", (1, 1))
        padding = self._padding(node, a, x, (kh, kw), strides)
        params = {"kernel": np.transpose(kernel, (2, 3, 1, 0))}
        if bias is not None:
            params["bias"] = bias.reshape(-1)
        attrs = dict(filters=int(filters), kernel=[kh, kw], strides=strides, padding=padding, use_bias=bias is not None,
                     groups=int(groups))
        self._set(node, Act(self._emit(node, "conv2d", [x.node], attrs, params), "nchw"))

    def _op_BatchNormalization(self, node) -> None:
        x = self._act(node, 0, ("nchw", "pooled", "flat"))
        a = node_attrs(node)
        if a.get("training_mode", 0):
            self._fail(node, "training-mode batch normalization is not supported")
        if a.get("spatial", 1) != 1:
            self._fail(node, "non-spatial batch normalization is not supported")
        self._only_first_output(node)
        params = {}
        for k, pname in enumerate(("gamma", "beta", "moving_mean", "moving_variance"), start=1):
            value = self._const(node, k).reshape(-1)
            params[pname] = value[x.order] if x.order is not None and value.size == x.order.size else value
        attrs = {"epsilon": clean_float(a.get("epsilon", 1e-5)), "momentum": clean_float(a.get("momentum", 0.9))}
        self._set(node, Act(self._emit(node, "batch_norm", [x.node], attrs, params), x.layout, x.order))

    def _op_LRN(self, node) -> None:
        x = self._act(node, 0, ("nchw",))
        a = node_attrs(node)
        if "size" not in a:
            self._fail(node, "missing attribute size")
        attrs = {"size": int(a["size"]), "alpha": clean_float(a.get("alpha", 1e-4)),
                 "beta": clean_float(a.get("beta", 0.75)), "bias": clean_float(a.get("bias", 1.0))}
        self._set(node, Act(self._emit(node, "lrn", [x.node], attrs), "nchw"))

    def _op_Relu(self, node) -> None:
        x = self._act(node, 0)
        self._set(node, Act(self._emit(node, "relu", [x.node], {}), x.layout, x.order))

    def _op_Gelu(self, node) -> None:
        x = self._act(node, 0)
        approximate = node_attrs(node).get("approximate", "none")
        if approximate != "tanh":
            self._fail(node, f"only the tanh GELU (approximate='tanh'), the IR's, is supported, got '{approximate}'")
        self._set(node, Act(self._emit(node, "gelu", [x.node], {}), x.layout, x.order))

    def _op_Dropout(self, node) -> None:
        x = self._act(node, 0)
        self._only_first_output(node)
        if self.opset < 12:
            ratio = node_attrs(node).get("ratio", 0.5)
        else:
            given = self._const(node, 1, optional=True)
            ratio = 0.5 if given is None else float(np.asarray(given).reshape(-1)[0])
            training = self._const(node, 2, optional=True)
            if training is not None and bool(np.asarray(training).reshape(-1)[0]):
                self._fail(node, "training-mode dropout is not supported")
        attrs = {"rate": clean_float(ratio)}
        self._set(node, Act(self._emit(node, "dropout", [x.node], attrs), x.layout, x.order))

    def _op_Identity(self, node) -> None:
        self._set(node, self._act(node, 0, tuple(LAYOUT_TEXT), allow_pad=True))

    def _op_Add(self, node) -> None:
        if len(node.input) != 2:
            self._fail(node, f"expects 2 inputs, got {len(node.input)}")
        consts = [k for k, name in enumerate(node.input) if name in self.consts]
        if len(consts) == 1:
            self._add_constant(node, 1 - consts[0], consts[0])
            return
        self._sum(node)

    def _op_Sum(self, node) -> None:
        if len(node.input) == 1:
            self._set(node, self._act(node, 0))
            return
        self._sum(node)

    def _sum(self, node) -> None:
        xs = [self._act(node, k) for k in range(len(node.input))]
        first = xs[0]
        for x in xs[1:]:
            same_order = (x.order is None and first.order is None) or (
                x.order is not None and first.order is not None and np.array_equal(x.order, first.order)
            )
            if x.layout != first.layout or not same_order:
                self._fail(node, f"adds {LAYOUT_TEXT[first.layout]} and {LAYOUT_TEXT[x.layout]} of different layouts")
        nid = self._emit(node, "add", [x.node for x in xs], {})
        self._set(node, Act(nid, first.layout, first.order))

    def _add_constant(self, node, k: int, k_const: int) -> None:
        """x + constant: learned positions, the bias of the MatMul before it, or add_const."""
        x = self._act(node, k)
        value = np.asarray(self.consts[node.input[k_const]])
        shape = self.shapes[x.node]
        # A table of the sequence's own shape is learned positions. Export writes it [S, D]; a per-channel
        # constant [1, 1, D], so that the two never read as each other even when S is 1.
        if x.layout == "seq" and (value.shape == shape or (value.shape == (1, *shape) and shape[0] > 1)):
            params = {"table": value.reshape(shape)}
            self._set(node, Act(self._emit(node, "position_embedding", [x.node], {}, params), "seq"))
            return
        source = node.input[k]
        dense_id = self.bias_slot.get(source)
        units = shape[-1]
        fits_bias = value.shape in ((units,), (1, units))
        if dense_id is not None and fits_bias and len(self.readers.get(source, [])) == 1 and source != self.output:
            position = next(i for i, n in enumerate(self.nodes) if n.id == dense_id)
            old = self.nodes[position]
            self.nodes[position] = Node(old.id, old.op, old.inputs, {**old.attrs, "use_bias": True})
            self.weights[dense_id]["bias"] = np.array(value.reshape(units), dtype=np.float32)
            del self.bias_slot[source]
            self._set(node, self.acts[source])
            return
        self._by_constant(node, x, value, "add_const")

    def _op_Mul(self, node) -> None:
        if len(node.input) != 2:
            self._fail(node, f"expects 2 inputs, got {len(node.input)}")
        consts = [k for k, name in enumerate(node.input) if name in self.consts]
        if not consts:
            self._product(node)
            return
        k = 1 - consts[0]
        self._by_constant(node, self._act(node, k), np.asarray(self.consts[node.input[consts[0]]]), "mul_const")

    def _by_constant(self, node, x: Act, value: np.ndarray, op: str) -> None:
        """x * value or x + value, where value broadcasts per channel or is one number."""
        onnx_shape = (1, *self._onnx_shape(x))
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
            self._fail(node, f"{what} a constant of shape {list(value.shape)} on {LAYOUT_TEXT[x.layout]}; only a "
                             f"per-channel or a scalar constant is supported")
        value = value.reshape(-1).astype(np.float32)
        if per_channel and x.order is not None:
            value = value[x.order]
        nid = self._emit(node, op, [x.node], {"per_channel": per_channel}, {"value": value})
        self._set(node, Act(nid, x.layout, x.order))

    def _op_Concat(self, node) -> None:
        xs = [self._act(node, k, ("nchw",)) for k in range(len(node.input))]
        axis = node_attrs(node).get("axis")
        if axis is None or axis % 4 != 1:
            self._fail(node, f"only concatenation along channels (axis 1) is supported, got axis {axis}")
        self._set(node, Act(self._emit(node, "concat", [x.node for x in xs], {}), "nchw"))

    def _op_MaxPool(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        if x.pad is not None and self._ir_op(x.node) != "relu":
            # Zero padding equals MaxPool's -inf padding only for non-negative inputs.
            self._fail(node, "reads a zero Pad of a tensor that may be negative; only Pad after Relu is supported")
        a = node_attrs(node)
        self._no_dilation(node, a)
        self._only_first_output(node)
        if "kernel_shape" not in a:
            self._fail(node, "missing attribute kernel_shape")
        kernel = self._pair(node, a, "kernel_shape", ())
        strides = self._pair(node, a, "strides", (1, 1))
        padding = self._padding(node, a, x, kernel, strides, ceil_mode=bool(a.get("ceil_mode", 0)))
        attrs = dict(kernel=kernel, strides=strides, padding=padding)
        self._set(node, Act(self._emit(node, "max_pool", [x.node], attrs), "nchw"))

    def _op_AveragePool(self, node) -> None:
        x = self._act(node, 0, ("nchw",))
        a = node_attrs(node)
        self._no_dilation(node, a)
        if "kernel_shape" not in a:
            self._fail(node, "missing attribute kernel_shape")
        h, w, _ = self.shapes[x.node]
        kernel = self._pair(node, a, "kernel_shape", ())
        padded = a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", "") or any(a.get("pads", []))
        if kernel == [h, w] and not padded and self._read_as_vector(node.output[0], at_output=False):
            self._global_pool(node, x, keep_dims=True)
            return
        strides = self._pair(node, a, "strides", (1, 1))
        ceil_mode = bool(a.get("ceil_mode", 0))
        count_padding = bool(a.get("count_include_pad", 0))
        padding = self._padding(node, a, x, kernel, strides, ceil_mode=ceil_mode)
        if count_padding and padding != self._padding(node, a, x, kernel, strides):
            # The windows that ceil mode adds overhang the explicit padding; runtimes disagree on their divisor.
            self._fail(node, "ceil_mode with count_include_pad is not supported")
        attrs = dict(kernel=kernel, strides=strides, padding=padding, count_padding=count_padding)
        self._set(node, Act(self._emit(node, "avg_pool", [x.node], attrs), "nchw"))

    def _read_as_vector(self, name: str, at_output: bool) -> bool:
        """Whether a whole-map average is read as a vector (an IR global_avg_pool): every reader flattens it
        (Flatten, Squeeze, a 2-D Reshape), takes its softmax over the channels or reads its shape. Otherwise
        it stays a 1 x 1 map (an IR avg_pool), e.g. for the 1 x 1 Conv that is DenseNet's classifier."""
        if name == self.output:
            return at_output
        for i in self.readers.get(name, []):
            reader = self.g.node[i]
            if reader.op_type == "Reshape" and len(reader.input) > 1:
                target = self.consts.get(reader.input[1])
                if target is not None and np.asarray(target).size != 2:
                    return False
            elif reader.op_type not in ("Flatten", "Squeeze", "Shape", "Softmax"):
                return False
        return True

    def _op_GlobalAveragePool(self, node) -> None:
        x = self._act(node, 0, ("nchw",))
        if self._read_as_vector(node.output[0], at_output=True):
            self._global_pool(node, x, keep_dims=True)
            return
        h, w, _ = self.shapes[x.node]
        attrs = dict(kernel=[h, w], strides=[1, 1], padding=[0, 0, 0, 0], count_padding=False)
        self._set(node, Act(self._emit(node, "avg_pool", [x.node], attrs), "nchw"))

    def _op_ReduceMean(self, node) -> None:
        x = self._act(node, 0, ("nchw", "nhwc"))
        a = node_attrs(node)
        axes = self._axes(node, since_opset=18) or []
        keep = bool(a.get("keepdims", 1))
        spatial = {2, 3} if x.layout == "nchw" else {1, 2}
        if {v % 4 for v in axes} != spatial or len(axes) != 2 or (keep and x.layout == "nhwc"):
            self._fail(node, f"only a mean over the spatial axes is supported (axes {axes}, keepdims {int(keep)})")
        self._global_pool(node, x, keep_dims=keep)

    def _global_pool(self, node, x: Act, keep_dims: bool) -> None:
        nid = self._emit(node, "global_avg_pool", [x.node], {})
        self._set(node, Act(nid, "pooled" if keep_dims else "flat"))

    def _op_Flatten(self, node) -> None:
        x = self._act(node, 0)
        axis = node_attrs(node).get("axis", 1)
        rank = 1 + len(self._onnx_shape(x))
        if not -rank <= axis <= rank or axis % rank != 1:
            self._fail(node, f"only flattening to [N, features] (axis 1) is supported, got axis {axis}")
        self._flatten(node, x)

    def _op_Reshape(self, node) -> None:
        x = self._act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "swapped"))
        target = [int(v) for v in np.asarray(self._const(node, 1)).reshape(-1)]
        dims = self._reshaped(node, x, target)
        batch = self.batch or 1
        if x.layout == "swapped":
            # The last step of a channel shuffle: back to [N, C, H, W].
            h, w, c = self.shapes[x.node]
            if dims != [batch, c, h, w]:
                self._fail(node, f"only a reshape back to [N, {c}, {h}, {w}] ends a channel shuffle, got {target}")
            nid = self._emit(node, "channel_shuffle", [x.node], {"groups": x.groups})
            self._set(node, Act(nid, "nchw"))
            return
        if x.layout == "nchw" and len(target) == 5:
            h, w, c = self.shapes[x.node]
            g = dims[1]
            if g < 1 or c % g or dims != [batch, g, c // g, h, w]:
                self._fail(node, f"only ShuffleNet's channel split [N, G, {c} / G, {h}, {w}] is supported, "
                                 f"got {target}")
            self._set(node, Act(x.node, "split", groups=g))
            return
        features = math.prod(self._onnx_shape(x))
        if not (len(target) == 2 and dims == [batch, features] and target[0] in (0, -1, batch)):
            self._fail(node, f"only a reshape to [N, {features}] (flatten) is supported, got {target}")
        self._flatten(node, x)

    def _reshaped(self, node, x: Act, target: list[int]) -> list[int]:
        """Reshape's output dims (batch included; a symbolic batch counts as 1): 0 copies the input's dim
        unless allowzero, -1 takes what is left."""
        dims = self._full_shape(x)
        allow_zero = bool(node_attrs(node).get("allowzero", 0))
        out = [dims[k] if v == 0 and not allow_zero and k < len(dims) else v for k, v in enumerate(target)]
        if out.count(-1) > 1 or any(v < -1 for v in out):
            self._fail(node, f"invalid reshape target {target}")
        if -1 in out:
            known = math.prod(v for v in out if v != -1)
            total = math.prod(dims)
            if known == 0 or total % known:
                self._fail(node, f"reshape target {target} does not fit {total} values")
            out[out.index(-1)] = total // known
        return out

    def _op_Squeeze(self, node) -> None:
        x = self._act(node, 0, ("pooled",))
        axes = self._axes(node, since_opset=13)
        if axes is None or sorted(v % 4 for v in axes) != [2, 3]:
            self._fail(node, f"only squeezing the 1x1 spatial axes [2, 3] is supported, got {axes}")
        self._set(node, Act(x.node, "flat"))

    def _flatten(self, node, x: Act) -> None:
        if x.layout in ("pooled", "flat"):
            self._set(node, Act(x.node, "flat", x.order))
            return
        order = None
        if x.layout == "nchw":
            h, w, c = self.shapes[x.node]
            order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
            if h * w == 1:
                order = None
        self._set(node, Act(self._emit(node, "flatten", [x.node], {}), "flat", order))

    def _op_Transpose(self, node) -> None:
        x = self._act(node, 0, ("nchw", "nhwc", "pooled", "flat", "seq", "split"))
        perm = list(node_attrs(node).get("perm", []))
        if x.layout == "nchw" and perm == [0, 2, 3, 1]:
            self._set(node, Act(x.node, "nhwc"))
        elif x.layout == "nhwc" and perm == [0, 3, 1, 2]:
            self._set(node, Act(x.node, "nchw"))
        elif x.layout == "split" and perm == [0, 2, 1, 3, 4]:
            self._set(node, Act(x.node, "swapped", groups=x.groups))
        else:
            self._fail(node, f"only NCHW<->NHWC transposes and a channel shuffle's [0, 2, 1, 3, 4] are supported, "
                             f"got perm {perm} of {LAYOUT_TEXT[x.layout]}")

    def _op_Pad(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        a = node_attrs(node)
        if a.get("mode", "constant") != "constant":
            self._fail(node, f"only constant padding is supported, got mode '{a['mode']}'")
        if self.opset < 11:
            pads, value = list(a.get("pads", [])), a.get("value", 0.0)
        else:
            pads = [int(v) for v in np.asarray(self._const(node, 1)).reshape(-1)]
            given = self._const(node, 2, optional=True)
            value = 0.0 if given is None else float(np.asarray(given).reshape(-1)[0])
            axes = self._const(node, 3, optional=True)
            if axes is not None:
                full = [0] * 8
                for k, axis in enumerate(int(v) % 4 for v in np.asarray(axes).reshape(-1)):
                    full[axis], full[axis + 4] = pads[k], pads[k + len(pads) // 2]
                pads = full
        if value != 0.0:
            self._fail(node, f"only zero padding is supported, got value {value}")
        if len(pads) != 8 or pads[0] or pads[1] or pads[4] or pads[5] or min(pads) < 0:
            self._fail(node, f"only non-negative padding of H and W is supported, got pads {pads}")
        before = x.pad or (0, 0, 0, 0)
        pad = (before[0] + pads[2], before[1] + pads[6], before[2] + pads[3], before[3] + pads[7])
        self._set(node, Act(x.node, "nchw", pad=pad))

    def _op_Gemm(self, node) -> None:
        x = self._act(node, 0, ("flat", "rows"))
        a = node_attrs(node)
        if a.get("transA", 0):
            self._fail(node, "transA=1 is not supported")
        kernel = self._const(node, 1)
        if kernel.ndim != 2:
            self._fail(node, f"weight must be 2-D, got shape {list(kernel.shape)}")
        if a.get("transB", 0):
            kernel = kernel.T
        if a.get("alpha", 1.0) != 1.0:
            kernel = kernel * np.float32(a["alpha"])
        bias = self._const(node, 2, optional=True)
        units = kernel.shape[1]
        if bias is not None:
            bias = np.asarray(bias) * np.float32(a.get("beta", 1.0))
            if bias.size == 1:
                bias = np.full(units, bias.reshape(()), dtype=bias.dtype)
            elif bias.size != units or (bias.ndim == 2 and bias.shape[0] != 1) or bias.ndim > 2:
                self._fail(node, f"bias of shape {list(bias.shape)} does not fit {units} units")
        # Gemm has its own bias input: an Add after a bias-less Gemm stays an add_const.
        self._dense(node, x, kernel, None if bias is None else bias.reshape(units))

    def _op_MatMul(self, node) -> None:
        x = self._act(node, 0, ("flat", "seq", "rows"))
        kernel = self._const(node, 1)
        if kernel.ndim != 2:
            self._fail(node, f"only MatMul of {LAYOUT_TEXT[x.layout]} by a 2-D weight is supported, "
                             f"got {list(kernel.shape)}")
        self.bias_slot[node.output[0]] = self._dense(node, x, kernel, None)

    def _dense(self, node, x: Act, kernel: np.ndarray, bias: np.ndarray | None) -> str:
        features = self.shapes[x.node][-1]
        if kernel.shape[0] != features:
            self._fail(node, f"weight of shape {list(kernel.shape)} does not fit {features} input features")
        kernel = np.ascontiguousarray(kernel, dtype=np.float32)  # row gathers are fast on C order
        if x.order is not None:
            kernel = kernel[x.order]
        params = {"kernel": kernel}
        if bias is not None:
            params["bias"] = bias
        attrs = {"units": int(kernel.shape[1]), "use_bias": bias is not None}
        nid = self._emit(node, "dense", [x.node], attrs, params)
        self._set(node, Act(nid, x.layout))
        return nid

    def _op_Softmax(self, node) -> None:
        x = self._act(node, 0, ("flat", "pooled", "seq"))
        rank = 1 + len(self._onnx_shape(x))
        axis = node_attrs(node).get("axis", 1 if self.opset < 13 else -1)
        # Before opset 13 Softmax flattens from `axis` on, so axis 1 of a pooled
        # [N, C, 1, 1] tensor also means "over the channels".
        want = 2 if x.layout == "seq" else 1
        if not -rank <= axis < rank or axis % rank != want:
            what = "the last axis (2)" if x.layout == "seq" else "the features (axis 1)"
            self._fail(node, f"only a softmax over {what} is supported, got axis {axis}")
        self._set(node, Act(self._emit(node, "softmax", [x.node], {}), x.layout, x.order))

    # -- sequence layers ---------------------------------------------------
    def _op_Gather(self, node) -> None:
        """Gather(table, token ids) is an embedding; the table's height is the token input's vocabulary."""
        tokens = self._act(node, 1, ("tokens",))
        table = self._const(node, 0)
        axis = node_attrs(node).get("axis", 0)
        if axis != 0:
            self._fail(node, f"only a lookup of table rows (axis 0) is supported, got axis {axis}")
        if table.ndim != 2:
            self._fail(node, f"the embedding table must be 2-D, got shape {list(table.shape)}")
        vocab, units = (int(d) for d in table.shape)
        token_node = self.nodes[0]
        if not self.vocab_known:
            attrs = {**token_node.attrs, "vocab": vocab}
            self.nodes[0] = Node(token_node.id, token_node.op, (), OPS["token_input"].parse(token_node.id, attrs))
            self.vocab_known = True
        elif token_node.attrs["vocab"] != vocab:
            self._fail(node, f"table of {vocab} rows, but an earlier embedding's has {token_node.attrs['vocab']}")
        nid = self._emit(node, "embedding", [tokens.node], {"vocab": vocab, "units": units}, {"table": table})
        self._set(node, Act(nid, "seq"))

    def _op_LayerNormalization(self, node) -> None:
        self._norm_over_last_axis(node, "layer_norm")

    def _op_RMSNormalization(self, node) -> None:
        self._norm_over_last_axis(node, "rms_norm")

    def _norm_over_last_axis(self, node, op: str) -> None:
        """LayerNormalization (scale, optional bias) or RMSNormalization (scale) as the IR's `op`."""
        x = self._act(node, 0, ("seq", "flat"))
        a = node_attrs(node)
        rank = 1 + len(self._onnx_shape(x))
        axis = a.get("axis", -1)
        if not -rank <= axis < rank or axis % rank != rank - 1:
            what = "a layer norm" if op == "layer_norm" else "an RMS norm"
            self._fail(node, f"only {what} over the last axis is supported, got axis {axis}")
        self._only_first_output(node)  # LayerNormalization's mean and inverse deviation
        gamma = self._const(node, 1).reshape(-1)
        params = {"gamma": gamma}
        if op == "layer_norm":
            beta = self._const(node, 2, optional=True)
            params["beta"] = np.zeros_like(gamma) if beta is None else beta.reshape(-1)
        if x.order is not None:
            params = {k: v[x.order] if v.size == x.order.size else v for k, v in params.items()}
        attrs = {"epsilon": clean_float(a.get("epsilon", 1e-5))}
        self._set(node, Act(self._emit(node, op, [x.node], attrs, params), x.layout, x.order))

    def _op_Attention(self, node) -> None:
        q, k, v = (self._act(node, i, ("seq",)) for i in range(3))
        if any(node.input[3:]):
            self._fail(node, "masks, caches and padding lengths are not supported (only q, k, v)")
        self._only_first_output(node)
        a = node_attrs(node)
        heads, kv = a.get("q_num_heads"), a.get("kv_num_heads")
        if heads is None or kv is None or kv < 1 or heads % kv:
            self._fail(node, "only 3-D inputs with kv_num_heads dividing q_num_heads are supported "
                             f"(got {heads} and {kv})")
        width = self.shapes[q.node][-1]
        if heads < 1 or width % heads:
            self._fail(node, f"{heads} heads do not divide the width {width}")
        head_dim = width // heads
        scale = a.get("scale")
        if scale is not None and not math.isclose(scale, 1 / math.sqrt(head_dim), rel_tol=1e-6):
            self._fail(node, f"only the scale 1/sqrt(head_dim) is supported, got {scale}")
        if a.get("softcap", 0.0) != 0.0:
            self._fail(node, f"soft capping (softcap {a['softcap']}) is not supported")
        for side in ("left_window_size", "right_window_size"):
            if a.get(side, -1) != -1:
                self._fail(node, f"a sliding window ({side} {a[side]}) is not supported")
        attrs = {"heads": int(heads), "head_dim": int(head_dim), "causal": bool(a.get("is_causal", 0)),
                 "kv_heads": int(kv)}
        self._set(node, Act(self._emit(node, "attention", [q.node, k.node, v.node], attrs), "seq"))

    def _op_RotaryEmbedding(self, node) -> None:
        x = self._act(node, 0, ("seq",))
        a = node_attrs(node)
        if a.get("interleaved", 0):
            self._fail(node, "the interleaved form (pairs (2i, 2i + 1)) is not supported; the IR's rotary is the "
                             "half-split form")
        heads = a.get("num_heads", 0)
        seq_len, width = self.shapes[x.node]
        if heads < 1 or width % heads or (width // heads) % 2:
            self._fail(node, f"num_heads {heads} does not split the width {width} into heads of an even width")
        head_dim = width // heads
        if a.get("rotary_embedding_dim", 0) not in (0, head_dim):
            self._fail(node, f"partial rotation (rotary_embedding_dim {a['rotary_embedding_dim']} of head_dim "
                             f"{head_dim}) is not supported")
        cos, sin = self._const(node, 1), self._const(node, 2)
        positions = self._const(node, 3, optional=True)
        if positions is not None:
            positions = np.asarray(positions).astype(np.int64)
            if positions.ndim != 2 or positions.shape[1] != seq_len or np.any(positions != np.arange(seq_len)):
                self._fail(node, f"only the positions 0 to {seq_len - 1} of every sequence are supported")
            if cos.ndim != 2 or sin.shape != cos.shape or cos.shape[0] < seq_len:
                self._fail(node, f"cos and sin caches of shapes {list(cos.shape)} and {list(sin.shape)} do not "
                                 f"hold {seq_len} positions")
            cos, sin = cos[:seq_len], sin[:seq_len]
        else:
            if cos.ndim != 3 or sin.shape != cos.shape or cos.shape[1] != seq_len or np.any(cos != cos[:1]) \
                    or np.any(sin != sin[:1]):
                self._fail(node, f"cos and sin caches of shapes {list(cos.shape)} and {list(sin.shape)} are not one "
                                 f"table of {seq_len} positions for every sequence")
            cos, sin = cos[0], sin[0]
        if cos.shape[1] != head_dim // 2:
            self._fail(node, f"cos and sin caches of width {cos.shape[1]} do not fit head_dim {head_dim}")
        base = rotary_base(cos, sin, head_dim)
        if base is None:
            self._fail(node, "the cos and sin caches are not the angles position * base^(-2i / head_dim) of any base")
        attrs = {"head_dim": head_dim, "base": base}
        self._set(node, Act(self._emit(node, "rotary", [x.node], attrs), "seq"))

    def _op_Swish(self, node) -> None:
        x = self._act(node, 0)
        alpha = node_attrs(node).get("alpha", 1.0)
        if alpha != 1.0:
            self._fail(node, f"only SiLU (alpha 1) is supported, got alpha {alpha}")
        self._set(node, Act(self._emit(node, "silu", [x.node], {}), x.layout, x.order))

    def _product(self, node) -> None:
        """The product of two activations of one layout: a mul."""
        first, second = self._act(node, 0), self._act(node, 1)
        same_order = (first.order is None and second.order is None) or (
            first.order is not None and second.order is not None and np.array_equal(first.order, second.order))
        if first.layout != second.layout or not same_order:
            self._fail(node, f"multiplies {LAYOUT_TEXT[first.layout]} and {LAYOUT_TEXT[second.layout]} of "
                             f"different layouts")
        self._set(node, Act(self._emit(node, "mul", [first.node, second.node], {}), first.layout, first.order))

    def _ir_op(self, node_id: str) -> str:
        return next(n.op for n in reversed(self.nodes) if n.id == node_id)


def _bare(exc: GraphError) -> str:
    """The message of an IR GraphError without its "node '<id>': " prefix."""
    text = str(exc)
    prefix = f"node '{exc.node}': "
    return text[len(prefix):] if exc.node is not None and text.startswith(prefix) else text


def _dims_text(tensor_type) -> str:
    dims = (d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in tensor_type.shape.dim)
    return "[" + ", ".join(dims) + "]"
