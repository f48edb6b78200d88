"""ONNX export and import for the graph IR.

ONNX is NCHW with a batch axis; the IR is NHWC without one. Export writes a
model whose input "input" is [N, C, H, W] (N symbolic). Import reads the CNNs
that real exporters (torch.onnx, tf2onnx, Keras) write, opset 9 and newer, and
maps each ONNX tensor to an IR node plus the ONNX layout it stands for, so that
layout changes (transposes, flattening, pooling to 1x1) cost no IR node.

Anything the IR cannot express raises GraphError naming the ONNX node and op.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.atomic import write_bytes_atomic
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import OPS, Graph, Node
from aiperf_core.weights import Weights, init_weights, validate_weights

INPUT_NAME = "input"
DEFAULT_OPSET = 17
MIN_EXPORT_OPSET = 11  # Gemm's bias is optional from 11 on
MIN_IMPORT_OPSET = 9
# Metadata key keeping the IR input node's id, since the ONNX input is always "input".
INPUT_ID_KEY = "aiperf.input_id"

_PROTOBUF_LIMIT = 2**31 - 1
_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


def export_onnx(graph: Graph, weights: Mapping | None = None, path=None, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Return (and write atomically to `path`, if given) the graph as an NCHW ONNX model.

    Without weights, the initializers come from init_weights(graph, seed=0)
    (He-normal kernels, zero biases, identity batch norm), so the model is
    always valid and runnable. Weights are stored as float32.
    """
    latest = onnx.defs.onnx_opset_version()
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_EXPORT_OPSET <= opset <= latest:
        raise AiperfError(f"ONNX export supports opsets {MIN_EXPORT_OPSET} to {latest}, got {opset!r}")
    if weights is None:
        weights = init_weights(graph, seed=0)
    else:
        validate_weights(graph, weights)

    names = {n.id: _tensor_name(graph, n) for n in graph.nodes}
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []

    def param(node_id: str, pname: str, array) -> str:
        # IR ids cannot contain '/', so these names never clash with a node's tensor.
        name = f"{node_id}/{pname}"
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32, order="C"), name))
        return name

    for node in graph.nodes:
        if node.op == "input":
            continue
        nid, a, out = node.id, node.attrs, names[node.id]
        x = [names[i] for i in node.inputs]
        w = weights.get(nid, {})
        image_in = len(graph.shapes[node.inputs[0]]) == 3
        if node.op == "conv2d":
            ins = [x[0], param(nid, "kernel", np.transpose(w["kernel"], (3, 2, 0, 1)))]
            if a["use_bias"]:
                ins.append(param(nid, "bias", w["bias"]))
            nodes.append(helper.make_node(
                "Conv", ins, [out], name=nid, kernel_shape=list(a["kernel"]),
                strides=list(a["strides"]), pads=_onnx_pads(a["padding"]),
            ))
        elif node.op == "batch_norm":
            ins = [x[0]] + [param(nid, p, w[p]) for p in ("gamma", "beta", "moving_mean", "moving_variance")]
            nodes.append(helper.make_node(
                "BatchNormalization", ins, [out], name=nid, epsilon=a["epsilon"], momentum=a["momentum"],
            ))
        elif node.op == "relu":
            nodes.append(helper.make_node("Relu", x, [out], name=nid))
        elif node.op == "add":
            nodes.append(helper.make_node("Add" if len(x) == 2 else "Sum", x, [out], name=nid))
        elif node.op == "concat":
            nodes.append(helper.make_node("Concat", x, [out], name=nid, axis=1))
        elif node.op == "max_pool":
            nodes.append(helper.make_node(
                "MaxPool", x, [out], name=nid, kernel_shape=list(a["kernel"]),
                strides=list(a["strides"]), pads=_onnx_pads(a["padding"]),
            ))
        elif node.op == "global_avg_pool":
            nodes.append(helper.make_node("GlobalAveragePool", x, [f"{out}/pooled"], name=nid))
            nodes.append(helper.make_node("Flatten", [f"{out}/pooled"], [out], name=f"{nid}/flatten", axis=1))
        elif node.op == "flatten":
            src = x[0]
            if image_in:  # the IR flattens in NHWC order
                src = f"{out}/nhwc"
                nodes.append(helper.make_node("Transpose", x, [src], name=f"{nid}/to_nhwc", perm=[0, 2, 3, 1]))
            nodes.append(helper.make_node("Flatten", [src], [out], name=nid, axis=1))
        elif node.op == "dense":
            ins = [x[0], param(nid, "kernel", w["kernel"])]
            if a["use_bias"]:
                ins.append(param(nid, "bias", w["bias"]))
            nodes.append(helper.make_node("Gemm", ins, [out], name=nid))
        elif node.op == "softmax":
            nodes.append(helper.make_node("Softmax", x, [out], name=nid, axis=-1 if opset >= 13 else 1))
        elif node.op == "dropout":
            if opset >= 12:
                ratio = param(nid, "ratio", np.float32(a["rate"]))
                nodes.append(helper.make_node("Dropout", [x[0], ratio], [out], name=nid))
            else:
                nodes.append(helper.make_node("Dropout", x, [out], name=nid, ratio=a["rate"]))
        else:  # pragma: no cover - every IR op is handled above
            raise GraphError(f"ONNX export does not know op '{node.op}'", nid)

    def value_info(name: str, shape) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["N", *_nchw(shape)])

    onnx_graph = helper.make_graph(
        nodes, graph.name,
        [value_info(INPUT_NAME, graph.input_shape)],
        [value_info(names[graph.output_id], graph.output_shape)],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        onnx_graph, opset_imports=opsets, producer_name="aiperf",
        ir_version=helper.find_min_ir_version_for(opsets),
    )
    helper.set_model_props(model, {INPUT_ID_KEY: graph.input_id})
    if model.ByteSize() > _PROTOBUF_LIMIT:
        raise AiperfError("model is larger than ONNX's 2 GB protobuf limit; cannot export it as one file")
    if path is not None:
        write_bytes_atomic(path, model.SerializeToString())
    return model


def _tensor_name(graph: Graph, node: Node) -> str:
    if node.op == "input":
        return INPUT_NAME
    return f"{node.id}/out" if node.id == INPUT_NAME else node.id


def _onnx_pads(padding) -> list[int]:
    top, bottom, left, right = padding
    return [top, left, bottom, right]


def _nchw(shape) -> list[int]:
    if len(shape) == 3:
        h, w, c = shape
        return [c, h, w]
    return list(shape)


# ---------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------

# How an IR tensor is laid out in ONNX (after the batch axis):
#   nchw    C, H, W   of an IR image H x W x C
#   nhwc    H, W, C   of an IR image (after a Transpose, as tf2onnx writes)
#   pooled  C, 1, 1   of an IR vector C (GlobalAveragePool keeps the 1x1)
#   flat    F         of an IR vector F
_LAYOUT_TEXT = {
    "nchw": "an NCHW feature map",
    "nhwc": "an NHWC feature map",
    "pooled": "a pooled [N, C, 1, 1] tensor",
    "flat": "a flat [N, F] tensor",
}


@dataclass(frozen=True)
class _Act:
    """An ONNX activation tensor: the IR node computing it and its ONNX layout."""

    node: str
    layout: str
    # flat only: for each IR feature, the index of the same feature in ONNX's
    # order (a flattened NCHW map is CHW in ONNX but HWC in the IR); None = same.
    order: np.ndarray | None = None
    # nchw only: zero padding (top, bottom, left, right) of a Pad not yet applied,
    # to be folded into the Conv (or MaxPool) that reads it.
    pad: tuple[int, int, int, int] | None = None


def import_onnx(path_or_model) -> tuple[Graph, Weights]:
    """Read an ONNX CNN (a path, a ModelProto or its serialized bytes) as an IR graph and weights.

    The NCHW input [N, C, H, W] becomes an IR input of shape [H, W, C]; the
    batch dimension may be fixed or symbolic. A flattened feature map is NHWC
    in the IR, so the rows of the dense weights that read it are reordered
    to keep the same function. Node ids are the ONNX node names (or output
    names) with characters outside [A-Za-z0-9_.-] replaced by '_', made unique
    in graph order. Nodes the output does not depend on are ignored.
    """
    if isinstance(path_or_model, onnx.ModelProto):
        return _Importer(path_or_model, None).run()
    if isinstance(path_or_model, (bytes, bytearray)):
        try:
            model = onnx.load_model_from_string(bytes(path_or_model))
        except Exception as exc:
            raise GraphError(f"not a readable ONNX model ({_one_line(exc)})") from None
        return _Importer(model, None).run()
    path = Path(path_or_model)
    model = _read_model(path)
    try:
        return _Importer(model, path.stem).run()
    except GraphError as exc:
        located = GraphError(f"{path}: {exc}")
        located.node = exc.node
        raise located from None


def _read_model(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise GraphError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf decode errors, missing external data, ...
        raise GraphError(f"{path}: not a readable ONNX model ({_one_line(exc)})") from None
    if not model.graph.node or not model.opset_import:
        raise GraphError(f"{path}: not an ONNX model (no graph or no opset)")
    return model


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _clean_float(value) -> float:
    """A float32 attribute as the shortest decimal that rounds to it (1.001e-05, not 1.0009999e-05)."""
    return float(str(np.float32(value)))


def _attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        out[attr.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


class _Importer:
    def __init__(self, model: onnx.ModelProto, fallback_name: str | None):
        self.model = model
        self.g = model.graph
        self.name = self.g.name or fallback_name or "onnx_model"
        self.consts: dict[str, np.ndarray] = {}
        self.acts: dict[str, _Act] = {}
        self.nodes: list[Node] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.weights: Weights = {}
        self.ids: set[str] = set()
        self.batch: int | None = None
        # ONNX tensors computed by a bias-less MatMul/Gemm -> the IR dense node,
        # so that a following Add of a constant becomes that node's bias.
        self.bias_slot: dict[str, str] = {}
        self.position = 0  # index of the ONNX node being converted, to name unnamed nodes
        self.opset = self._default_opset()

    # -- driver ------------------------------------------------------------
    def run(self) -> tuple[Graph, Weights]:
        if len(self.g.output) != 1:
            raise GraphError(f"ONNX model has {len(self.g.output)} outputs; aiperf needs exactly one")
        self.output = self.g.output[0].name
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
            raise GraphError(f"ONNX initializer '{tensor.name}' cannot be read ({_one_line(exc)})") from None

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
        if not value.type.HasField("tensor_type") or tensor_type.elem_type not in _FLOAT_TYPES:
            raise GraphError(f"ONNX input '{value.name}' must be a floating-point tensor")
        dims = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in tensor_type.shape.dim]
        if len(dims) not in (2, 4):
            raise GraphError(f"ONNX input '{value.name}' must be [N, C, H, W] or [N, F], got rank {len(dims)}")
        if any(d is None for d in dims[1:]):
            raise GraphError(
                f"ONNX input '{value.name}' has symbolic size in {_dims_text(tensor_type)}; "
                "aiperf needs fixed image sizes"
            )
        self.batch = dims[0]
        if len(dims) == 2:
            shape, layout = (dims[1],), "flat"
        elif self._read_as_nhwc(value.name):
            shape, layout = tuple(dims[1:]), "nhwc"
        else:
            shape, layout = (dims[2], dims[3], dims[1]), "nchw"
        props = {p.key: p.value for p in self.model.metadata_props}
        stored = props.get(INPUT_ID_KEY, "")
        node_id = self._new_id(stored if _ID_RE.match(stored) else value.name)
        attrs = OPS["input"].parse(node_id, {"shape": list(shape)})
        self.nodes.append(Node(node_id, "input", (), attrs))
        self.shapes[node_id] = tuple(attrs["shape"])
        self.acts[value.name] = _Act(node_id, layout)

    def _read_as_nhwc(self, name: str) -> bool:
        """An NHWC input that every reader transposes to NCHW (as tf2onnx writes Keras models)."""
        readers = [self.g.node[i] for i in self.readers.get(name, [])]
        return bool(readers) and all(
            n.op_type == "Transpose" and list(_attrs(n).get("perm", [])) == [0, 3, 1, 2] for n in readers
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
            self.weights[nid] = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()}
        self.nodes.append(Node(nid, op, tuple(inputs), norm))
        self.shapes[nid] = shape
        return nid

    def _act(self, node, k: int, layouts=None, allow_pad: bool = False) -> _Act:
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
        if layouts is not None and act.layout not in layouts:
            want = " or ".join(_LAYOUT_TEXT[x] for x in layouts)
            self._fail(node, f"expects {want}, got {_LAYOUT_TEXT[act.layout]}")
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

    def _set(self, node, act: _Act) -> None:
        self.acts[node.output[0]] = act

    def _only_first_output(self, node) -> None:
        for name in node.output[1:]:
            if name and (name in self.readers or name == self.output):
                self._fail(node, f"uses output '{name}', which aiperf does not support (inference only)")

    def _onnx_shape(self, act: _Act) -> tuple[int, ...]:
        shape = self.shapes[act.node]
        if act.layout == "nchw":
            h, w, c = shape
            return (c, h, w)
        if act.layout == "pooled":
            return (shape[0], 1, 1)
        return shape

    def _pair(self, node, attrs: dict, key: str, default) -> list[int]:
        value = list(attrs.get(key, default))
        if len(value) != 2:
            self._fail(node, f"only 2-D {key} are supported, got {value}")
        return value

    def _no_dilation(self, node, attrs: dict) -> None:
        if any(d != 1 for d in attrs.get("dilations", [])):
            self._fail(node, f"dilations {list(attrs['dilations'])} are not supported (only 1)")

    def _padding(self, node, attrs: dict, x: _Act, kernel, strides, ceil_mode: bool = False) -> list[int]:
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
            self._fail(node, f"cannot evaluate this constant computation ({_one_line(exc)})")
        for name, value in zip([name for name in node.output if name], results):
            self.consts[name] = np.asarray(value)

    def _op_Shape(self, node) -> None:
        x = self._act(node, 0)
        # A symbolic batch counts as 1: aiperf graphs are per image, and a
        # Reshape target built from it is checked against that below.
        shape = np.array([self.batch or 1, *self._onnx_shape(x)], dtype=np.int64)
        a = _attrs(node)
        self.consts[node.output[0]] = shape[a.get("start", 0): a.get("end", len(shape))]

    # -- layers ------------------------------------------------------------
    def _op_Conv(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        kernel = self._const(node, 1)
        bias = self._const(node, 2, optional=True)
        a = _attrs(node)
        if kernel.ndim != 4:
            self._fail(node, f"only 2-D convolutions are supported (weight of rank {kernel.ndim})")
        if a.get("group", 1) != 1:
            self._fail(node, f"grouped convolution (group={a['group']}) is not supported")
        self._no_dilation(node, a)
        filters, _, kh, kw = kernel.shape
        if list(a.get("kernel_shape", [kh, kw])) != [kh, kw]:
            self._fail(node, f"kernel_shape {list(a['kernel_shape'])} does not match the weight's {[kh, kw]}")
        strides = self._pair(node, a, "strides", (1, 1))
        padding = self._padding(node, a, x, (kh, kw), strides)
        params = {"kernel": np.transpose(kernel, (2, 3, 1, 0))}
        if bias is not None:
            params["bias"] = bias.reshape(-1)
        attrs = dict(filters=int(filters), kernel=[kh, kw], strides=strides, padding=padding, use_bias=bias is not None)
        self._set(node, _Act(self._emit(node, "conv2d", [x.node], attrs, params), "nchw"))

    def _op_BatchNormalization(self, node) -> None:
        x = self._act(node, 0, ("nchw", "pooled", "flat"))
        a = _attrs(node)
        if a.get("training_mode", 0):
            self._fail(node, "training-mode batch normalization is not supported")
        if a.get("spatial", 1) != 1:
            self._fail(node, "non-spatial batch normalization is not supported")
        self._only_first_output(node)
        params = {}
        for k, pname in enumerate(("gamma", "beta", "moving_mean", "moving_variance"), start=1):
            value = self._const(node, k).reshape(-1)
            params[pname] = value[x.order] if x.order is not None and value.size == x.order.size else value
        attrs = {"epsilon": _clean_float(a.get("epsilon", 1e-5)), "momentum": _clean_float(a.get("momentum", 0.9))}
        self._set(node, _Act(self._emit(node, "batch_norm", [x.node], attrs, params), x.layout, x.order))

    def _op_Relu(self, node) -> None:
        x = self._act(node, 0)
        self._set(node, _Act(self._emit(node, "relu", [x.node], {}), x.layout, x.order))

    def _op_Dropout(self, node) -> None:
        x = self._act(node, 0)
        self._only_first_output(node)
        if self.opset < 12:
            ratio = _attrs(node).get("ratio", 0.5)
        else:
            given = self._const(node, 1, optional=True)
            ratio = 0.5 if given is None else float(np.asarray(given).reshape(-1)[0])
            training = self._const(node, 2, optional=True)
            if training is not None and bool(np.asarray(training).reshape(-1)[0]):
                self._fail(node, "training-mode dropout is not supported")
        attrs = {"rate": _clean_float(ratio)}
        self._set(node, _Act(self._emit(node, "dropout", [x.node], attrs), x.layout, x.order))

    def _op_Identity(self, node) -> None:
        self._set(node, self._act(node, 0, allow_pad=True))

    def _op_Add(self, node) -> None:
        if len(node.input) != 2:
            self._fail(node, f"expects 2 inputs, got {len(node.input)}")
        consts = [name for name in node.input if name in self.consts]
        if len(consts) == 1:
            self._fold_bias(node, consts[0])
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
                self._fail(node, f"adds {_LAYOUT_TEXT[first.layout]} and {_LAYOUT_TEXT[x.layout]} of different layouts")
        nid = self._emit(node, "add", [x.node for x in xs], {})
        self._set(node, _Act(nid, first.layout, first.order))

    def _fold_bias(self, node, const_name: str) -> None:
        """Add(MatMul(x, W), b) is a dense layer with bias: fold b into the dense node."""
        source = next(name for name in node.input if name != const_name)
        dense_id = self.bias_slot.get(source)
        if dense_id is None or len(self.readers.get(source, [])) != 1 or source == self.output:
            self._fail(
                node, "adds a constant tensor; only sums of activations, or a bias right after MatMul, are supported"
            )
        units = self.shapes[dense_id][0]
        bias = np.asarray(self.consts[const_name])
        if bias.size != units or (bias.ndim == 2 and bias.shape[0] != 1) or bias.ndim > 2:
            self._fail(node, f"bias of shape {list(bias.shape)} does not fit {units} units")
        position = next(k for k, n in enumerate(self.nodes) if n.id == dense_id)
        old = self.nodes[position]
        self.nodes[position] = Node(old.id, old.op, old.inputs, {**old.attrs, "use_bias": True})
        self.weights[dense_id]["bias"] = np.ascontiguousarray(bias.reshape(units), dtype=np.float32)
        del self.bias_slot[source]
        self._set(node, self.acts[source])

    def _op_Concat(self, node) -> None:
        xs = [self._act(node, k, ("nchw",)) for k in range(len(node.input))]
        axis = _attrs(node).get("axis")
        if axis is None or axis % 4 != 1:
            self._fail(node, f"only concatenation along channels (axis 1) is supported, got axis {axis}")
        self._set(node, _Act(self._emit(node, "concat", [x.node for x in xs], {}), "nchw"))

    def _op_MaxPool(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        if x.pad is not None and self._ir_op(x.node) != "relu":
            # Zero padding equals MaxPool's -inf padding only for non-negative inputs.
            self._fail(node, "reads a zero Pad of a tensor that may be negative; only Pad after Relu is supported")
        a = _attrs(node)
        self._no_dilation(node, a)
        self._only_first_output(node)
        if "kernel_shape" not in a:
            self._fail(node, "missing attribute kernel_shape")
        kernel = self._pair(node, a, "kernel_shape", ())
        strides = self._pair(node, a, "strides", (1, 1))
        padding = self._padding(node, a, x, kernel, strides, ceil_mode=bool(a.get("ceil_mode", 0)))
        attrs = dict(kernel=kernel, strides=strides, padding=padding)
        self._set(node, _Act(self._emit(node, "max_pool", [x.node], attrs), "nchw"))

    def _op_AveragePool(self, node) -> None:
        x = self._act(node, 0, ("nchw",))
        a = _attrs(node)
        h, w, _ = self.shapes[x.node]
        kernel = list(a.get("kernel_shape", []))
        padded = a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID", "") or any(a.get("pads", []))
        if kernel != [h, w] or padded:
            self._fail(node, f"only global average pooling is supported (kernel {kernel} on a {h}x{w} input)")
        self._global_pool(node, x, keep_dims=True)

    def _op_GlobalAveragePool(self, node) -> None:
        self._global_pool(node, self._act(node, 0, ("nchw",)), keep_dims=True)

    def _op_ReduceMean(self, node) -> None:
        x = self._act(node, 0, ("nchw", "nhwc"))
        a = _attrs(node)
        if self.opset >= 18:
            given = self._const(node, 1, optional=True)
            axes = [] if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
        else:
            axes = list(a.get("axes", []))
        keep = bool(a.get("keepdims", 1))
        spatial = {2, 3} if x.layout == "nchw" else {1, 2}
        if {v % 4 for v in axes} != spatial or len(axes) != 2 or (keep and x.layout == "nhwc"):
            self._fail(node, f"only a mean over the spatial axes is supported (axes {axes}, keepdims {int(keep)})")
        self._global_pool(node, x, keep_dims=keep)

    def _global_pool(self, node, x: _Act, keep_dims: bool) -> None:
        nid = self._emit(node, "global_avg_pool", [x.node], {})
        self._set(node, _Act(nid, "pooled" if keep_dims else "flat"))

    def _op_Flatten(self, node) -> None:
        x = self._act(node, 0)
        axis = _attrs(node).get("axis", 1)
        rank = 1 + len(self._onnx_shape(x))
        if not -rank <= axis <= rank or axis % rank != 1:
            self._fail(node, f"only flattening to [N, features] (axis 1) is supported, got axis {axis}")
        self._flatten(node, x)

    def _op_Reshape(self, node) -> None:
        x = self._act(node, 0)
        target = [int(v) for v in np.asarray(self._const(node, 1)).reshape(-1)]
        allow_zero = bool(_attrs(node).get("allowzero", 0))
        features = math.prod(self._onnx_shape(x))
        batch_ok = (0,) if not allow_zero else ()
        batch_ok += (-1, self.batch or 1)
        if not (
            len(target) == 2
            and target[0] in batch_ok
            and (target[1] == features or (target[1] == -1 and target[0] != -1))
        ):
            self._fail(node, f"only a reshape to [N, {features}] (flatten) is supported, got {target}")
        self._flatten(node, x)

    def _op_Squeeze(self, node) -> None:
        x = self._act(node, 0, ("pooled",))
        if self.opset >= 13:
            given = self._const(node, 1, optional=True)
            axes = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
        else:
            axes = _attrs(node).get("axes")
        if axes is None or sorted(v % 4 for v in axes) != [2, 3]:
            self._fail(node, f"only squeezing the 1x1 spatial axes [2, 3] is supported, got {axes}")
        self._set(node, _Act(x.node, "flat"))

    def _flatten(self, node, x: _Act) -> None:
        if x.layout in ("pooled", "flat"):
            self._set(node, _Act(x.node, "flat", x.order))
            return
        order = None
        if x.layout == "nchw":
            h, w, c = self.shapes[x.node]
            order = np.arange(c * h * w).reshape(c, h, w).transpose(1, 2, 0).reshape(-1)
            if h * w == 1:
                order = None
        self._set(node, _Act(self._emit(node, "flatten", [x.node], {}), "flat", order))

    def _op_Transpose(self, node) -> None:
        x = self._act(node, 0)
        perm = list(_attrs(node).get("perm", []))
        if x.layout == "nchw" and perm == [0, 2, 3, 1]:
            self._set(node, _Act(x.node, "nhwc"))
        elif x.layout == "nhwc" and perm == [0, 3, 1, 2]:
            self._set(node, _Act(x.node, "nchw"))
        else:
            self._fail(node, f"only NCHW<->NHWC transposes are supported, got perm {perm} of {_LAYOUT_TEXT[x.layout]}")

    def _op_Pad(self, node) -> None:
        x = self._act(node, 0, ("nchw",), allow_pad=True)
        a = _attrs(node)
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
        self._set(node, _Act(x.node, "nchw", pad=pad))

    def _op_Gemm(self, node) -> None:
        x = self._act(node, 0, ("flat",))
        a = _attrs(node)
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
        self._dense(node, x, kernel, None if bias is None else bias.reshape(units))

    def _op_MatMul(self, node) -> None:
        x = self._act(node, 0, ("flat",))
        kernel = self._const(node, 1)
        if kernel.ndim != 2:
            self._fail(node, f"only MatMul of a flat tensor by a 2-D weight is supported, got {list(kernel.shape)}")
        self._dense(node, x, kernel, None)

    def _dense(self, node, x: _Act, kernel: np.ndarray, bias: np.ndarray | None) -> None:
        features = self.shapes[x.node][0]
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
        if bias is None:
            self.bias_slot[node.output[0]] = nid
        self._set(node, _Act(nid, "flat"))

    def _op_Softmax(self, node) -> None:
        x = self._act(node, 0, ("flat", "pooled"))
        rank = 2 if x.layout == "flat" else 4
        axis = _attrs(node).get("axis", 1 if self.opset < 13 else -1)
        # Before opset 13 Softmax flattens from `axis` on, so axis 1 of a pooled
        # [N, C, 1, 1] tensor also means "over the channels".
        if not -rank <= axis < rank or axis % rank != 1:
            self._fail(node, f"only a softmax over the features (axis 1) is supported, got axis {axis}")
        self._set(node, _Act(self._emit(node, "softmax", [x.node], {}), x.layout, x.order))

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
