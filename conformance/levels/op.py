"""Level 'op': every IR op, forward and backward, against the NumPy reference, at every precision
the backend declares on the device under test (tolerances per precision): the CNN ops, the
transformer ops on (S, D) sequences and token ids, and the model-zoo CNN ops.

The backward passes through a head (a dense layer and a softmax: per position over the last axis for
a sequence output, with labels (N, S)), so each op's gradient is checked through the loss."""

from __future__ import annotations

from functools import partial

import numpy as np

from aiperf_conformance.cases import OP_CASES, OpCase, case_input, case_labels, trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, new_ops, reference

BATCH = 4


def _inputs(ctx: Context, case: OpCase, salt: int) -> np.ndarray:
    return case_input(case.graph(), ctx.rng(salt), BATCH, case.input_mean)


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
    labels = case_labels(graph, ctx.rng(index), BATCH)
    ref_loss, ref_grads, _ = reference().loss_and_grads(graph, weights, x, labels, dtype=np.float64)
    loss, grads = ctx.backend.loss_and_grads(ctx.backend.lower(graph, weights, precision=precision), x, labels)
    # The transformer ops' gradients are worse conditioned than the CNN ops' (attention's softmax backward;
    # sums over every position): their own key (conformance/defaults.json).
    key = "op_grad_lm" if case.workload == "lm" else "op_grad"
    return compare_grads(loss, grads, ref_loss, ref_grads, ctx.tolerance(key, precision),
                         zero_in_exact=key_biases(graph))


def key_biases(graph) -> frozenset:
    """(node, 'bias') of every attention's key projection: compare_grads' zero_in_exact."""
    return frozenset((n.inputs[1], "bias") for n in graph.nodes
                     if n.op == "attention" and graph[n.inputs[1]].op == "dense"
                     and graph[n.inputs[1]].attrs["use_bias"])


def compare_grads(loss, grads, ref_loss, ref_grads, tol: float, normwise: bool = False,
                  zero_in_exact: frozenset = frozenset()) -> Outcome:
    """The loss, then every parameter's gradient (max-abs relative error, or normwise per tensor).
    `zero_in_exact`: (node, parameter) pairs whose gradient is zero in exact arithmetic (an attention
    key projection's bias: it adds the same amount to every score of a query's row, which the softmax
    ignores), so that the reference holds rounding alone; those are held to within `tol` of the largest
    reference gradient instead."""
    outcome = compare(np.array(loss), np.array(ref_loss), tol, "loss")
    if not outcome.passed:
        return outcome
    worst = outcome
    largest = max((float(np.max(np.abs(g))) for ps in ref_grads.values() for g in ps.values() if g.size),
                  default=0.0)
    for node_id, params in ref_grads.items():
        for name, expected in params.items():
            if node_id not in grads or name not in grads[node_id]:
                return Outcome(False, "missing", name, tol, f"node '{node_id}': no gradient for '{name}'")
            if (node_id, name) in zero_in_exact:
                got = float(np.max(np.abs(np.asarray(grads[node_id][name], np.float64))))
                if not got <= tol * max(largest, 1e-12):
                    return Outcome(False, got, 0.0, tol, f"node '{node_id}' gradient '{name}' (zero in exact "
                                   f"arithmetic): {got:.3g}, more than {tol:g} of the largest gradient {largest:.3g}")
                continue
            o = compare(grads[node_id][name], expected, tol, f"node '{node_id}' gradient '{name}'", normwise)
            if not o.passed:
                return o
            if o.measured > (worst.measured or 0):
                worst = o
    return worst


def checks(ctx: Context):
    for precision in ctx.precisions:
        for i, case in enumerate(OP_CASES):
            tags = dict(workload=case.workload, ops=new_ops(case.with_head()))
            yield Check("op", f"{case.name}/forward", partial(forward, case=case, index=i, precision=precision),
                        precision, **tags)
            if not case.stochastic:
                yield Check("op", f"{case.name}/backward", partial(backward, case=case, index=i,
                                                                     precision=precision), precision, **tags)
