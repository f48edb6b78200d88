"""Level 'op': every IR op, forward and backward, against the NumPy reference, at every precision
the backend declares on the device under test (tolerances per precision)."""

from __future__ import annotations

from functools import partial

import numpy as np

from aiperf_conformance.cases import OP_CASES, OpCase, trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, reference

BATCH = 4


def _inputs(ctx: Context, case: OpCase, salt: int) -> np.ndarray:
    return ctx.rng(salt).normal(0, 1, (BATCH,) + case.input_shape).astype(np.float32)


def forward(ctx: Context, case: OpCase, index: int, precision: str) -> Outcome:
    graph = case.graph()
    weights = trained_looking_weights(graph, ctx.seed + index)
    x = _inputs(ctx, case, index)
    expected = reference().forward(graph, weights, x, dtype=np.float64)
    model = ctx.backend.lower(graph, weights, precision=precision)
    measured = ctx.backend.predict(model, x)
    return compare(measured, expected, ctx.tolerance("op", precision), f"node 'op' ({graph['op'].op})")


def backward(ctx: Context, case: OpCase, index: int, precision: str) -> Outcome:
    graph = case.with_head()
    weights = trained_looking_weights(graph, ctx.seed + index)
    x = _inputs(ctx, case, index)
    labels = ctx.rng(index).integers(0, 3, BATCH)
    ref_loss, ref_grads, _ = reference().loss_and_grads(graph, weights, x, labels, dtype=np.float64)
    loss, grads = ctx.backend.loss_and_grads(ctx.backend.lower(graph, weights, precision=precision), x, labels)
    return compare_grads(loss, grads, ref_loss, ref_grads, ctx.tolerance("op_grad", precision))


def compare_grads(loss, grads, ref_loss, ref_grads, tol: float, normwise: bool = False) -> Outcome:
    """The loss, then every parameter's gradient (max-abs relative error, or normwise per tensor)."""
    outcome = compare(np.array(loss), np.array(ref_loss), tol, "loss")
    if not outcome.passed:
        return outcome
    worst = outcome
    for node_id, params in ref_grads.items():
        for name, expected in params.items():
            if node_id not in grads or name not in grads[node_id]:
                return Outcome(False, "missing", name, tol, f"node '{node_id}': no gradient for '{name}'")
            o = compare(grads[node_id][name], expected, tol, f"node '{node_id}' gradient '{name}'", normwise)
            if not o.passed:
                return o
            if o.measured > (worst.measured or 0):
                worst = o
    return worst


def checks(ctx: Context):
    for precision in ctx.precisions:
        for i, case in enumerate(OP_CASES):
            yield Check("op", f"{case.name}/forward", partial(forward, case=case, index=i, precision=precision),
                        precision)
            if not case.stochastic:
                yield Check("op", f"{case.name}/backward", partial(backward, case=case, index=i,
                                                                     precision=precision), precision)
