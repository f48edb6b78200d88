"""Level 'graph': whole networks against the reference; parameter counts and shapes against the IR;
at every precision the backend declares on the device under test (a model lowered at a mixed
precision still exports fp32 master weights of the IR's shapes).

The outputs compared are the logits, the input of the final softmax (the graph is lowered without
it): with trained-looking weights the softmax of a deep network saturates (ResNet-50's top
probability is 0.99999), which would hide a logit error of any size."""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from aiperf_core.builders import resnet50, resnet_small
from aiperf_core.ir import Graph
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, reference

GRAPHS = {
    "resnet_small": lambda: resnet_small((32, 32, 3), 10),
    "resnet50_64px": lambda: resnet50((64, 64, 3), 10),
}
BATCH, QUICK_BATCH = 2, 1


def _model(ctx: Context, name: str, precision: str):
    key = ("graph", name, precision)
    if key not in ctx.cache:
        graph = GRAPHS[name]()
        weights = trained_looking_weights(graph, ctx.seed)
        ctx.cache[key] = (graph, weights, ctx.backend.lower(graph, weights, precision=precision))
    return ctx.cache[key]


def logits_graph(graph: Graph) -> Graph:
    """The graph without its final softmax (the graph itself when it ends otherwise)."""
    if graph[graph.output_id].op != "softmax":
        return graph
    return Graph(graph.nodes[:-1], name=f"{graph.name}_logits")


def outputs(ctx: Context, name: str, precision: str) -> Outcome:
    graph = logits_graph(GRAPHS[name]())
    weights = trained_looking_weights(graph, ctx.seed)
    batch = QUICK_BATCH if ctx.quick else BATCH
    x = ctx.rng(7).normal(0, 1, (batch,) + graph.input_shape).astype(np.float32)
    key = ("graph-reference", name)  # the same float64 answer for every precision
    if key not in ctx.cache:
        ctx.cache[key] = reference().forward(graph, weights, x, dtype=np.float64)
    measured = ctx.backend.predict(ctx.backend.lower(graph, weights, precision=precision), x)
    return compare(measured, ctx.cache[key], ctx.tolerance("graph", precision),
                   f"{name} logits (node '{graph.output_id}', the softmax input)")


def parameters(ctx: Context, name: str, precision: str) -> Outcome:
    graph, _, model = _model(ctx, name, precision)
    exported = ctx.backend.export_weights(model)
    for node_id, shapes in graph.all_param_shapes().items():
        for pname, shape in shapes.items():
            got = exported.get(node_id, {}).get(pname)
            if got is None:
                return Outcome(False, None, list(shape), None, f"node '{node_id}': weight '{pname}' missing")
            if tuple(got.shape) != tuple(shape):
                return Outcome(False, list(got.shape), list(shape), None,
                               f"node '{node_id}': weight '{pname}' has shape {list(got.shape)}, IR says {list(shape)}")
            if np.asarray(got).dtype != np.float32:
                return Outcome(False, str(np.asarray(got).dtype), "float32", None,
                               f"node '{node_id}': weight '{pname}' exported as {np.asarray(got).dtype}; "
                               f"canonical weights are float32 (master weights at every precision)")
    extra = sorted(set(exported) - set(graph.all_param_shapes()))
    if extra:
        return Outcome(False, extra, [], None, f"node '{extra[0]}': weights for a node that has none in the IR")
    total = sum(math.prod(a.shape) for ps in exported.values() for n, a in ps.items() if not n.startswith("moving_"))
    return Outcome(total == graph.num_params(), total, graph.num_params(), 0,
                   f"{name}: {total:,} trainable parameters, IR says {graph.num_params():,}")


def output_shape(ctx: Context, name: str, precision: str) -> Outcome:
    graph, _, model = _model(ctx, name, precision)
    batch = QUICK_BATCH + 1 if ctx.quick else BATCH + 1  # another batch size than the outputs check's
    x = np.zeros((batch,) + graph.input_shape, np.float32)
    got = tuple(np.shape(ctx.backend.predict(model, x)))
    want = (batch,) + graph.output_shape
    return Outcome(got == want, list(got), list(want), None,
                   f"{name} output (node '{graph.output_id}'): shape {list(got)}, IR says {list(want)}")


def checks(ctx: Context):
    for precision in ctx.precisions:
        for name in GRAPHS:
            for what, run in (("outputs", outputs), ("parameters", parameters), ("output_shape", output_shape)):
                yield Check("graph", f"{name}/{what}", partial(run, name=name, precision=precision), precision)
