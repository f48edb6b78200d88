"""Constant folding of an ONNX model with static shapes, before aiperf reads it (aiperf_core.onnx).

Exporters write a model's shape arithmetic (Shape, Gather, Unsqueeze, Concat, Range, Slice of a shape),
its causal masks (Trilu, Where, Equal of constants), its rotary tables (the angles of a position range)
and its weights' transposes and casts as nodes. With every input shape fixed, all of that depends on
initializers alone. fold_constants evaluates each such node with onnx.reference and replaces it by an
initializer, so that what remains computes on the model's input only: the nodes aiperf maps to IR ops.

A symbolic batch axis counts as 1 here (aiperf graphs are per sample; the importer checks that the batch
axis is only carried); every other dimension of the input must be fixed. A Shape (or Size) of a tensor
whose shape ONNX's shape inference gives in full folds too.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Ops whose output differs run to run: never folded.
_RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                         "Bernoulli"})


def fold_constants(model: onnx.ModelProto, input_name: str, opset: int) -> onnx.ModelProto:
    """`model` with its nodes that depend only on initializers, Constant nodes and fixed shapes made
    initializers (module docstring); `model` itself where nothing folds. `input_name` is the model's one
    input, whose symbolic batch axis counts as 1."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for value in g.input:
        dims = value.type.tensor_type.shape.dim
        if value.name == input_name and dims and not (dims[0].HasField("dim_value") and dims[0].dim_value > 0):
            dims[0].Clear()
            dims[0].dim_value = 1
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    kept, changed = list(g.node), False
    while True:
        shapes = _LazyShapes(out)
        still, folded = [], False
        for node in kept:
            value = _evaluate(node, consts, shapes, opset)
            if value is None:
                still.append(node)
                continue
            folded = True
            for name, array in zip([o for o in node.output if o], value):
                consts[name] = array
        if not folded:
            return out if changed else model
        kept, changed = still, True
        _store(out, kept, consts)


class _LazyShapes:
    """Tensor name -> shape, for every tensor whose shape ONNX's shape inference gives in full; inferred on
    first use (a model without a Shape of an activation never pays for it)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.shapes: dict[str, tuple[int, ...]] | None = None

    def get(self, name: str) -> tuple[int, ...] | None:
        if self.shapes is None:
            self.shapes = _static_shapes(self.model)
        return self.shapes.get(name)


def _evaluate(node, consts, shapes, opset) -> list[np.ndarray] | None:
    """The node's outputs if it folds, else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type in _RANDOM_OPS:
        return None
    used = [name for name in node.input if name]
    if node.op_type in ("Shape", "Size") and used and used[0] not in consts:
        shape = shapes.get(used[0])
        if shape is None:
            return None
        full = np.array(shape, dtype=np.int64)
        if node.op_type == "Size":
            return [np.array(full.prod(), dtype=np.int64)]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        return [full[attrs.get("start", 0): attrs.get("end", len(full))]]
    if node.op_type != "Constant" and not (used and all(name in consts for name in used)):
        return None
    if node.op_type == "Identity":
        return [consts[used[0]]]
    return _run_node(node, {name: consts[name] for name in used}, opset)


def _run_node(node, feeds: dict, opset: int) -> list[np.ndarray] | None:
    """The node run by onnx.reference in a model of the source's opset (a bare node would run at the latest)."""
    from onnx.reference import ReferenceEvaluator

    outputs = [name for name in node.output if name]
    graph = helper.make_graph([node], "fold", [helper.make_value_info(name, onnx.TypeProto()) for name in feeds],
                              [helper.make_value_info(name, onnx.TypeProto()) for name in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        results = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # left for the importer, which names the node if it cannot read it
        return None
    return [np.asarray(r) for r in results]


def _static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, for every tensor whose shape ONNX's shape inference gives in full."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # an op without an inference rule, a malformed node: the importer reports it
        inferred = model
    shapes = {}
    g = inferred.graph
    for value in [*g.input, *g.value_info, *g.output]:
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            continue
        dims = value.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)
    return shapes


def _store(model: onnx.ModelProto, nodes: list, consts: dict) -> None:
    """Write the kept nodes and the constants they (or the outputs) read as the model's graph."""
    g = model.graph
    needed = {name for node in nodes for name in node.input if name} | {o.name for o in g.output}
    initializers = [numpy_helper.from_array(np.asarray(consts[name]), name) for name in sorted(needed & set(consts))]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(initializers)
    del g.value_info[:]
    if model.ir_version < 4:  # before IR 4 every initializer is also a graph input
        kept_inputs = [v for v in g.input if v.name not in consts or v.name in needed]
        listed = {v.name for v in kept_inputs}
        kept_inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in initializers
                        if t.name not in listed]
        del g.input[:]
        g.input.extend(kept_inputs)
    else:
        kept_inputs = [v for v in g.input if v.name not in consts]
        del g.input[:]
        g.input.extend(kept_inputs)
