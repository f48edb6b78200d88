"""Level 'graph': whole networks against the reference; parameter counts and shapes against the IR."""

from __future__ import annotations

import math
from functools import partial

import numpy as np

from aiperf_core.builders import resnet50, resnet_small
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, reference

GRAPHS = {
    "resnet_small": lambda: resnet_small((32, 32, 3), 10),
    "resnet50_64px": lambda: resnet50((64, 64, 3), 10),
}


def _model(ctx: Context, name: str):
    key = ("graph", name)
    if key not in ctx.cache:
        graph = GRAPHS[name]()
        weights = trained_looking_weights(graph, ctx.seed)
        ctx.cache[key] = (graph, weights, ctx.backend.lower(graph, weights))
    return ctx.cache[key]


def outputs(ctx: Context, name: str) -> Outcome:
    graph, weights, model = _model(ctx, name)
    x = ctx.rng(7).normal(0, 1, (2,) + graph.input_shape).astype(np.float32)
    expected = reference().forward(graph, weights, x, dtype=np.float64)
    return compare(ctx.backend.predict(model, x), expected, ctx.expectations.tolerance("graph"),
                   f"{name} output (node '{graph.output_id}')")


def parameters(ctx: Context, name: str) -> Outcome:
    graph, _, model = _model(ctx, name)
    exported = ctx.backend.export_weights(model)
    for node_id, shapes in graph.all_param_shapes().items():
        for pname, shape in shapes.items():
            got = exported.get(node_id, {}).get(pname)
            if got is None:
                return Outcome(False, None, list(shape), None, f"node '{node_id}': weight '{pname}' missing")
            if tuple(got.shape) != tuple(shape):
                return Outcome(False, list(got.shape), list(shape), None,
                               f"node '{node_id}': weight '{pname}' has shape {list(got.shape)}, IR says {list(shape)}")
    extra = sorted(set(exported) - set(graph.all_param_shapes()))
    if extra:
        return Outcome(False, extra, [], None, f"node '{extra[0]}': weights for a node that has none in the IR")
    total = sum(math.prod(a.shape) for ps in exported.values() for n, a in ps.items() if not n.startswith("moving_"))
    return Outcome(total == graph.num_params(), total, graph.num_params(), 0,
                   f"{name}: {total:,} trainable parameters, IR says {graph.num_params():,}")


def output_shape(ctx: Context, name: str) -> Outcome:
    graph, _, model = _model(ctx, name)
    x = np.zeros((3,) + graph.input_shape, np.float32)
    got = tuple(np.shape(ctx.backend.predict(model, x)))
    want = (3,) + graph.output_shape
    return Outcome(got == want, list(got), list(want), None,
                   f"{name} output (node '{graph.output_id}'): shape {list(got)}, IR says {list(want)}")


def checks(ctx: Context):
    for name in GRAPHS:
        yield Check("graph", f"{name}/outputs", partial(outputs, name=name))
        yield Check("graph", f"{name}/parameters", partial(parameters, name=name))
        yield Check("graph", f"{name}/output_shape", partial(output_shape, name=name))
