"""Level 'count': the backend's native op counter against the analytic count under the counter's
declared convention, per category it covers, forward and forward+backward, on two ResNets and a
2-layer GPT.

The matrix products (conv, dense, and attention's two products) must agree exactly under every
convention; attention's count depends on it (paper: the full S x S scores; valid: the S(S+1)/2 pairs
a causal mask keeps), and a counter declares it apart from its padding (CounterConvention.attention).

A native count of zero or below for a category that has operations is a failure with its own
message, never a match: a counter that cannot see some kernels (XLA reports -1 for a cuDNN custom
call) must not pass because the analytic side happens to be small."""

from __future__ import annotations

from functools import partial

import aiperf_opcount as opcount
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome
from aiperf_conformance.levels.graph import GRAPHS, checks_tags

BATCH = 2
EXACT_CATEGORIES = ("conv", "dense", "attention")  # MAC-based: every convention agrees on these exactly


def analytic_by_category(graph, convention, backward: bool, includes_update: bool) -> dict[str, int]:
    counted = opcount.count(graph, convention)
    out: dict[str, int] = {}
    for n in counted.nodes:
        # A node's parts: attention's two products are 'attention', the softmax of its scores 'softmax'.
        for category, fp, grad in n.parts():
            out[category] = out.get(category, 0) + fp + (grad if backward else 0)
        if backward and includes_update:
            out[n.category] = out.get(n.category, 0) + n.update
    return out


def analytic_for_counter(graph, convention, backward: bool) -> dict[str, int]:
    """The analytic count of `graph` for BATCH samples in each category a counter covers, each under the
    convention the counter declares for it (CounterConvention.convention_for)."""
    out: dict[str, int] = {}
    for rule in sorted({convention.convention_for(c) for c in convention.covers}):
        counted = analytic_by_category(graph, rule, backward, convention.includes_update)
        out.update({k: v * BATCH for k, v in counted.items()
                    if k in convention.covers and convention.convention_for(k) == rule})
    return out


def no_counter(ctx: Context) -> Outcome:
    return Outcome(False, None, None, None, f"backend '{ctx.backend.name}' offers no native op counter")


def native_count(native: dict, category: str) -> int:
    value = native.get(category, 0)
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"native counter returned {value!r} for category '{category}', not an integer") from None


def non_positive(native: dict, analytic: dict, covers, what: str) -> Outcome | None:
    """A failure when the counter reports <= 0 for a covered category that has operations."""
    for category in covers:
        expected = analytic.get(category, 0)
        got = native_count(native, category)
        if expected > 0 and got <= 0:
            return Outcome(False, got, expected, None,
                           f"{what} {category}: the native counter returned {got:,} for a category with "
                           f"{expected:,} operations; a count of zero or below is never a match (a counter "
                           f"that cannot count a kernel must say so, not report it as free)")
    return None


def native_vs_analytic(ctx: Context, name: str, backward: bool) -> Outcome:
    counter = ctx.backend.native_counter()
    if counter is None:
        return no_counter(ctx)
    conv = counter.convention
    graph = GRAPHS[name]()
    model = ctx.backend.lower(graph, trained_looking_weights(graph, ctx.seed))
    native = counter.count(model, BATCH, backward)
    analytic = analytic_for_counter(graph, conv, backward)
    bad = non_positive(native, analytic, conv.covers, f"{name} {'forward+backward' if backward else 'forward'}")
    if bad:
        return bad
    worst, detail = 0.0, []
    for category in conv.covers:
        expected = analytic.get(category, 0)
        got = native_count(native, category)
        tol = ctx.tolerance("count" if category in EXACT_CATEGORIES else "count_other")
        err = abs(got - expected) / max(expected, 1)
        detail.append(f"{category} {got:,} vs {expected:,}")
        if err > tol:
            return Outcome(False, got, expected, tol,
                           f"{name} {category}: native {got:,}, analytic ({conv.convention_for(category)}) "
                           f"{expected:,}, relative difference {err:.3g} > {tol:g}")
        worst = max(worst, err)
    return Outcome(True, worst, 0.0, None, f"{name}: " + "; ".join(detail))


def checks(ctx: Context):
    for name in GRAPHS:
        yield Check("count", f"{name}/forward", partial(native_vs_analytic, name=name, backward=False),
                    needs_counter=True, **checks_tags(name))
        yield Check("count", f"{name}/forward_backward", partial(native_vs_analytic, name=name, backward=True),
                    needs_counter=True, **checks_tags(name))
