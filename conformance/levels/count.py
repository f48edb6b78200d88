"""Level 'count': the backend's native op counter against the analytic count under the counter's
declared convention, per category it covers, forward and forward+backward."""

from __future__ import annotations

from functools import partial

import aiperf_opcount as opcount
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome
from aiperf_conformance.levels.graph import GRAPHS

BATCH = 2
EXACT_CATEGORIES = ("conv", "dense")  # MAC-based: every convention agrees on these exactly


def analytic_by_category(graph, convention, backward: bool, includes_update: bool) -> dict[str, int]:
    counted = opcount.count(graph, convention)
    out: dict[str, int] = {}
    for n in counted.nodes:
        ops = n.fp + (n.grad + (n.update if includes_update else 0) if backward else 0)
        out[n.category] = out.get(n.category, 0) + ops
    return out


def native_vs_analytic(ctx: Context, name: str, backward: bool) -> Outcome:
    counter = ctx.backend.native_counter()
    if counter is None:
        return Outcome(False, None, None, None, f"backend '{ctx.backend.name}' offers no native op counter")
    conv = counter.convention
    graph = GRAPHS[name]()
    model = ctx.backend.lower(graph, trained_looking_weights(graph, ctx.seed))
    native = counter.count(model, BATCH, backward)
    analytic = analytic_by_category(graph, conv.padding, backward, conv.includes_update)
    worst, detail = 0.0, []
    for category in conv.covers:
        expected = analytic.get(category, 0) * BATCH
        got = int(native.get(category, 0))
        tol = ctx.expectations.tolerance("count" if category in EXACT_CATEGORIES else "count_other")
        err = abs(got - expected) / max(expected, 1)
        detail.append(f"{category} {got:,} vs {expected:,}")
        if err > tol:
            return Outcome(False, got, expected, tol,
                           f"{name} {category}: native {got:,}, analytic ({conv.padding}) {expected:,}, "
                           f"relative difference {err:.3g} > {tol:g}")
        worst = max(worst, err)
    return Outcome(True, worst, 0.0, None, f"{name}: " + "; ".join(detail))


def checks(ctx: Context):
    for name in GRAPHS:
        yield Check("count", f"{name}/forward", partial(native_vs_analytic, name=name, backward=False))
        yield Check("count", f"{name}/forward_backward", partial(native_vs_analytic, name=name, backward=True))
