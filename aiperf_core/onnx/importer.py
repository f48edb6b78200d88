"""Reading ONNX into the graph IR: import_onnx, and the Importer that its op handlers (ops/) work through.

The importer folds every node computed from constants and fixed shapes (fold.py), then reads the rest
in graph order: each ONNX tensor maps to an IR node plus the ONNX layout it stands for (an Act,
layouts.py), so that layout changes (transposes, flattening, pooling to 1x1, a transformer's head
reshapes) cost no IR node. Each ONNX op type has one handler, registered in ops/ by op family, that
emits IR nodes or refuses in one line naming the ONNX node and op; an op type with no handler is
refused as unsupported. Adding an op is adding its handler to the module of its family.

Import also reads what the model-zoo CNNs write: a Mul or Add of a per-channel or scalar constant
(batch norm folded into Unsqueeze'd constants) becomes mul_const / add_const, an Add of a constant
right after a bias-less MatMul is that dense layer's bias, and the Reshape -> Transpose -> Reshape
of ShuffleNet is one channel_shuffle node; any other Reshape or Transpose stays refused. An average
over the whole map (GlobalAveragePool, or AveragePool without padding whose window is the map) is a
global_avg_pool when it is flattened next, else a 1 x 1 map (an avg_pool), as DenseNet's classifier,
a 1x1 Conv, reads it. A language model's output is its logits; the IR's language models end in the
softmax whose logits their training loss reads, so a token graph whose output is a dense gets one
appended (id 'probs').
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.errors import GraphError
from aiperf_core.ir import OPS, Graph, Node
from aiperf_core.onnx.fold import fold_constants
from aiperf_core.onnx.layouts import HEADS_LAYOUTS, LAYOUT_TEXT, PRIVATE_LAYOUTS, Act
from aiperf_core.onnx.ops import HANDLERS
from aiperf_core.onnx.pointwise import STAT_KINDS, materialize
from aiperf_core.onnx.protos import FLOAT_TYPES, INDEX_TYPES, INPUT_ID_KEY, node_attrs, one_line, read_model
from aiperf_core.weights import Weights, validate_weights

MIN_IMPORT_OPSET = 9

_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_UNKNOWN_VOCAB = 2  # a token input's vocabulary until its embedding's Gather is read


def import_onnx(path_or_model) -> tuple[Graph, Weights]:
    """Read an ONNX model (a path, a ModelProto or its serialized bytes) as an IR graph and weights.

    The NCHW input [N, C, H, W] becomes an IR input of shape [H, W, C], an
    [N, S, D] input one of shape [S, D], and integer ids [N, S] read by a
    Gather a token_input of sequence length S; the batch dimension may be
    fixed or symbolic. A flattened feature map is NHWC
    in the IR, so the rows of the dense weights that read it are reordered
    to keep the same function. Node ids are the ONNX node names (or output
    names) with characters outside [A-Za-z0-9_.-] replaced by '_', made unique
    in graph order. Nodes the output does not depend on are ignored.
    """
    if isinstance(path_or_model, onnx.ModelProto):
        return Importer(path_or_model, None).run()
    if isinstance(path_or_model, (bytes, bytearray)):
        try:
            model = onnx.load_model_from_string(bytes(path_or_model))
        except Exception as exc:
            raise GraphError(f"not a readable ONNX model ({one_line(exc)})") from None
        return Importer(model, None).run()
    path = Path(path_or_model)
    model = read_model(path)
    try:
        return Importer(model, path.stem).run()
    except GraphError as exc:
        located = GraphError(f"{path}: {exc}")
        located.node = exc.node
        raise located from None


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
        # ONNX tensor -> (the IR norm node computing it, the parameter a following constant sets: 'gamma' or
        # 'beta'), so that a norm's decomposition takes its scale and shift as the fused ops do.
        self.norm_slot: dict[str, tuple[str, str]] = {}
        # IR dense node of a fused projection -> the ONNX node that split it into one dense per part.
        self.split_from: dict[str, onnx.NodeProto] = {}
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
        tokens = value.type.HasField("tensor_type") and tensor_type.elem_type in INDEX_TYPES
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
            self.fail(node, "unsupported op")
        used = [i for i in node.input if i]
        if op == "Constant" or (used and all(i in self.consts for i in used) and not op.startswith("Random")):
            self._fold(node)
            return
        handler = HANDLERS.get(op)
        if handler is None:
            self.fail(node, "unsupported op")
        handler(self, node)

    def _finish(self) -> tuple[Graph, Weights]:
        act = self.acts.get(self.output)
        if act is not None and act.layout == "pointwise":
            act = self.acts[self.output] = materialize(self, act.info)
        if act is not None and act.layout in ("seq", "rows") and self.nodes[0].op == "token_input" and \
                self.ir_op(act.node) == "dense":
            if act.layout == "rows":
                self.fail(helper.make_node("Gemm", [], [self.output], name=self.output), "the logits are rows "
                          "[N * S, vocab], not a sequence; aiperf reads a language model's logits as [N, S, vocab]")
            # The IR's language models end in the softmax whose logits their loss reads.
            probs = helper.make_node("Softmax", [self.output], [f"{self.output}/probs"], name="probs")
            self.acts[self.output] = Act(self.emit(probs, "softmax", [act.node], {}), "seq")
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
            self.fail(node, f"cannot evaluate this constant computation ({one_line(exc)})")
        for name, value in zip([name for name in node.output if name], results):
            self.consts[name] = np.asarray(value)

    # -- what handlers work through ------------------------------------------
    def fail(self, node: onnx.NodeProto, message: str):
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

    def emit(self, node, op: str, inputs: list[str], attrs: dict, params: dict | None = None) -> str:
        """Append an IR node for the ONNX node, checking it as Graph would."""
        if len(set(inputs)) != len(inputs):
            self.fail(node, "reads the same tensor twice, which the IR cannot express")
        nid = self._new_id(node.name or (node.output[0] if node.output else op))
        spec = OPS[op]
        in_shapes = [self.shapes[i] for i in inputs]
        try:
            norm = spec.parse(nid, attrs)
            shape = tuple(int(d) for d in spec.shape(nid, norm, in_shapes))
        except GraphError as exc:
            self.fail(node, _bare(exc))
        if params is not None:
            want = spec.params(norm, in_shapes)
            for pname, array in params.items():
                if tuple(array.shape) != tuple(want[pname]):
                    self.fail(node, f"{pname} has shape {list(array.shape)}, expected {list(want[pname])}")
            # Copies: an initializer's array is read-only, and the weights are trained.
            self.weights[nid] = {k: np.array(v, dtype=np.float32, order="C") for k, v in params.items()}
        self.nodes.append(Node(nid, op, tuple(inputs), norm))
        self.shapes[nid] = shape
        return nid

    def act(self, node, k: int, layouts=None, allow_pad: bool = False) -> Act:
        """The activation input k in one of `layouts` (any public one where None), a pending elementwise
        function made IR nodes first."""
        name = node.input[k] if k < len(node.input) else ""
        act = self.acts.get(name)
        if act is not None and act.layout == "pointwise":
            self.acts[name] = materialize(self, act.info)
        if not name:
            self.fail(node, f"input {k} is missing")
        if name in self.consts:
            self.fail(node, f"input {k} ('{name}') is a constant; expected an activation")
        act = self.acts.get(name)
        if act is None:
            self.fail(node, f"reads '{name}', which no earlier node produces")
        if act.pad is not None and not allow_pad:
            self.fail(node, "reads the output of a Pad, which aiperf only folds into a following Conv or MaxPool")
        if act.layout in PRIVATE_LAYOUTS and (layouts is None or act.layout not in layouts):
            self.fail(node, f"reads {PRIVATE_LAYOUTS[act.layout]}")
        if layouts is not None and act.layout not in layouts:
            want = " or ".join(LAYOUT_TEXT[x] for x in layouts)
            self.fail(node, f"expects {want}, got {LAYOUT_TEXT[act.layout]}")
        return act

    def raw(self, node, k: int) -> Act | None:
        """Input k as it is (pending or private layouts included), or None for a constant."""
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            self.fail(node, f"input {k} is missing")
        if name in self.consts:
            return None
        act = self.acts.get(name)
        if act is None:
            self.fail(node, f"reads '{name}', which no earlier node produces")
        return act

    def const(self, node, k: int, optional: bool = False) -> np.ndarray | None:
        name = node.input[k] if k < len(node.input) else ""
        if not name:
            if optional:
                return None
            self.fail(node, f"input {k} is missing")
        if name not in self.consts:
            self.fail(node, f"input {k} ('{name}') must be a constant (weights or attributes computed from constants)")
        return self.consts[name]

    def axes(self, node, since_opset: int) -> list[int] | None:
        """The axes of an op that takes them as its input 1 from `since_opset` on and as an attribute before;
        None where the node gives none."""
        if self.opset >= since_opset:
            given = self.const(node, 1, optional=True)
            return None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]
        given = node_attrs(node).get("axes")
        return None if given is None else list(given)

    def set(self, node, act: Act) -> None:
        self.acts[node.output[0]] = act

    def alias(self, node, x: Act) -> None:
        """The output is the input: pending work on the input (a norm's scale, a projection's bias) moves on."""
        self.set(node, x)
        source = node.input[0]
        if self.single_reader(source):
            for slot in (self.norm_slot, self.bias_slot):
                if source in slot:
                    slot[node.output[0]] = slot.pop(source)

    def only_first_output(self, node) -> None:
        for name in node.output[1:]:
            if name and (name in self.readers or name == self.output):
                self.fail(node, f"uses output '{name}', which aiperf does not support (inference only)")

    def single_reader(self, name: str) -> bool:
        return len(self.readers.get(name, [])) == 1 and name != self.output

    def full_shape(self, act: Act) -> list[int]:
        """The ONNX shape of the tensor, batch included (a symbolic batch counts as 1)."""
        batch = self.batch or 1
        if act.layout == "rows":
            return [batch * self.shapes[act.node][0], self.shapes[act.node][-1]]
        if act.layout in ("heads_rows", "heads_rows_t"):
            return [batch * act.heads, *self.onnx_shape(act)]
        return [batch, *self.onnx_shape(act)]

    def onnx_shape(self, act: Act) -> tuple[int, ...]:
        """The ONNX shape of the tensor without its batch axis."""
        layout = act.layout
        if layout == "pointwise":
            shape = self.onnx_shape(act.info.source)
            return shape[:-1] + (1,) if act.info.kind in STAT_KINDS else shape
        if layout == "rows":
            return (self.shapes[act.node][-1],)
        if layout in HEADS_LAYOUTS or layout in ("half", "rotated", "rot_cos", "rot_sin", "scores", "probs"):
            seq_len = self.shapes[act.node][0]
            h, d = act.heads, self.head_dim(act)
            kv = h // act.group
            base = act.info[0] if layout in ("half", "rotated", "rot_cos", "rot_sin") else None
            if layout == "half":
                d //= 2
            shapes = {"split_heads": (seq_len, h, d), "heads": (h, seq_len, d), "heads_t": (h, d, seq_len),
                      "heads_rows": (seq_len, d), "heads_rows_t": (d, seq_len), "heads_unsq": (kv, 1, seq_len, d),
                      "heads_rep": (kv, act.group, seq_len, d), "scores": (h, seq_len, seq_len),
                      "probs": (h, seq_len, seq_len)}
            return shapes[base or layout]
        shape = self.shapes[act.node]
        if layout == "nchw":
            h, w, c = shape
            return (c, h, w)
        if layout == "pooled":
            return (shape[0], 1, 1)
        if layout in ("split", "swapped"):
            h, w, c = shape
            g = act.groups
            return (g, c // g, h, w) if layout == "split" else (c // g, g, h, w)
        return shape

    def head_dim(self, act: Act) -> int:
        return self.shapes[act.node][-1] * act.group // act.heads

    def ir_op(self, node_id: str) -> str:
        return next(n.op for n in reversed(self.nodes) if n.id == node_id)


def _bare(exc: GraphError) -> str:
    """The message of an IR GraphError without its "node '<id>': " prefix."""
    text = str(exc)
    prefix = f"node '{exc.node}': "
    return text[len(prefix):] if exc.node is not None and text.startswith(prefix) else text


def _dims_text(tensor_type) -> str:
    dims = (d.dim_param or (str(d.dim_value) if d.HasField("dim_value") else "?") for d in tensor_type.shape.dim)
    return "[" + ", ".join(dims) + "]"
