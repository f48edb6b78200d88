"""Level 'count': the backend's native op counter against the analytic count under the counter's
declared convention, per category it covers, forward and forward+backward, on two ResNets, a 2-layer
GPT, a 2-layer Llama, and a grouped and a depthwise convolution.

The matrix products (conv, dense, and attention's two products) must agree exactly under every
convention; attention's count depends on it (paper: the full S x S scores; valid: the S(S+1)/2 pairs
a causal mask keeps), and a counter declares it apart from its padding (CounterConvention.attention).

A native count of zero or below for a category that has operations is a failure with its own
message, never a match: a counter that cannot see some kernels (XLA reports -1 for a cuDNN custom
call) must not pass because the analytic side happens to be small.

The grouped and depthwise convolutions (`count/conv_grouped_strided`, `count/conv_depthwise_multiplier2`,
the model-zoo CNNs' ops) each follow a 1x1 convolution, so that both their gradients are counted: a
counter that counts a grouped weight gradient as if it were not grouped (torch 2.13's FlopCounterMode
did: `groups` times) fails them.

A mixture of experts is counted apart (`count/moe_*`): its category `moe` holds the router and only the
k experts each token chose, so a native count above 1.05 times it means the backend runs experts on
tokens that did not choose them, and one below the chosen experts' products means the counter does not
see them."""

from __future__ import annotations

import hashlib
from functools import partial

import numpy as np

import aiperf_opcount as opcount
from aiperf_core.backend import NativeCounter
from aiperf_core.ir import Graph, Node, moe_mlp
from aiperf_opcount.rules import MAC
from aiperf_conformance.cases import COUNT_CONV_CASES, OpCase, trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, new_ops
from aiperf_conformance.levels.graph import GRAPHS, checks_tags

BATCH = 2
EXACT_CATEGORIES = ("conv", "dense", "attention")  # MAC-based: every convention agrees on these exactly
# The graphs counted whole: the graph level's networks, and the grouped convolutions with a head.
COUNT_GRAPHS = {**GRAPHS, **{case.name: case.with_head for case in COUNT_CONV_CASES}}


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


def counted_natively(ctx: Context, counter: NativeCounter, graph: Graph, weights: dict, backward: bool) -> dict:
    """The counter's count of `graph` lowered with `weights`, for BATCH samples, counted once per kit run:
    a morph family's parent is every one of its morphs' parent, and the count level's GPT and Llama are
    the morph level's (a profiler's count costs seconds: TensorFlow's traces, freezes and profiles the
    graph). Keyed by the graph's JSON and the weights' bytes, so that another graph or weights is counted
    anew; a copy is returned."""
    digest = hashlib.sha256(graph.to_json(indent=None).encode())
    for node_id in sorted(weights):
        for name in sorted(weights[node_id]):
            value = np.ascontiguousarray(weights[node_id][name])
            digest.update(f"{node_id}/{name}/{value.dtype}/{value.shape}".encode())
            digest.update(value.tobytes())
    key = ("native-count", digest.hexdigest(), BATCH, backward)
    if key not in ctx.cache:
        ctx.cache[key] = counter.count(ctx.backend.lower(graph, weights), BATCH, backward)
    return dict(ctx.cache[key])


def native_vs_analytic(ctx: Context, name: str, backward: bool) -> Outcome:
    counter = ctx.backend.native_counter()
    if counter is None:
        return no_counter(ctx)
    conv = counter.convention
    graph = COUNT_GRAPHS[name]()
    native = counted_natively(ctx, counter, graph, trained_looking_weights(graph, ctx.seed), backward)
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


# The routed mixture of experts (issue 40): 8 experts, so that running every expert on every token books
# 4 (top-2) or 8 (top-1) times the counted expert work, far above the 1.05 the check allows.
MOE_CASES = {
    "gelu_top2": dict(experts=8, top_k=2, units=16),
    "gelu_top1": dict(experts=8, top_k=1, units=16),
    "swiglu_top2": dict(experts=8, top_k=2, units=16, mlp="swiglu"),
}
MOE_SEQ, MOE_WIDTH = 16, 8
MOE_GOAL = 1.05  # the native count may exceed the analytic one by this factor, no more


def moe_graph(name: str) -> Graph:
    """A dense layer (so that the moe's input gradient is computed), the moe under test, and a head."""
    nodes = (Node("pre", "dense", ("x",), {"units": MOE_WIDTH}), Node("op", "moe", ("pre",), MOE_CASES[name]))
    return OpCase(f"moe_{name}", (MOE_SEQ, MOE_WIDTH), nodes, workload="lm").with_head()


def moe_products(graph: Graph, backward: bool) -> int:
    """The matrix products of the graph's moe nodes that any routed implementation runs, per sample: the
    router's and the k chosen experts' (docs/counting.md, "Mixture of experts"), forward and, if asked,
    their weight gradients and, where a trained parameter lies upstream, their input gradients."""
    total = 0
    for node, input_grad in NativeCounter.counted_nodes(graph, backward, ops=("moe",)):
        seq, d = graph.shapes[node.inputs[0]]
        e, k, f = node.attrs["experts"], node.attrs["top_k"], node.attrs["units"]
        inputs = 2 if moe_mlp(node.attrs) == "swiglu" else 1  # the (D -> F) projections per expert
        forward = seq * MAC * (d * e + k * (inputs * d * f + f * d))
        total += forward * (1 + (1 + input_grad if backward else 0))
    return total


def moe_outcome(what: str, got: int, analytic: int, floor: int) -> Outcome:
    """A native moe count (or change) against the analytic one: at least the routed products `floor`, at
    most MOE_GOAL times `analytic`."""
    ratio = got / max(analytic, 1)
    detail = f"{what}: native {got:,}, analytic {analytic:,} (ratio {ratio:.3f}), the routed products {floor:,}"
    if got < floor:
        return Outcome(False, got, floor, None, f"{detail}: the counter books less than the chosen experts' "
                                                f"products, so it does not see the work")
    return Outcome(ratio <= MOE_GOAL, ratio, MOE_GOAL, None,
                   detail if ratio <= MOE_GOAL else f"{detail}: more than {MOE_GOAL} times the counted work "
                                                    f"(experts that run on tokens that did not choose them)")


def routed_moe(ctx: Context, name: str, backward: bool) -> Outcome:
    """The native counter's `moe` category on a moe of 8 experts: at most MOE_GOAL times the analytic count
    (so no backend runs more than the k chosen experts' work per token), and at least the products any
    routed implementation runs (so a counter that cannot see the experts does not pass)."""
    counter = ctx.backend.native_counter()
    if counter is None:
        return no_counter(ctx)
    what = f"moe {name} {'forward+backward' if backward else 'forward'}"
    if "moe" not in counter.convention.covers:
        return Outcome(False, None, None, None,
                       f"{what}: the native counter does not cover the category 'moe' "
                       f"(CounterConvention.covers), so it cannot show the experts' work")
    graph = moe_graph(name)
    analytic = analytic_by_category(graph, counter.convention.convention_for("moe"), backward,
                                    counter.convention.includes_update).get("moe", 0) * BATCH
    model = ctx.backend.lower(graph, trained_looking_weights(graph, ctx.seed))
    got = native_count(counter.count(model, BATCH, backward), "moe")
    return moe_outcome(what, got, analytic, moe_products(graph, backward) * BATCH)


def checks(ctx: Context):
    for name in MOE_CASES:
        for backward in (False, True):
            yield Check("count", f"moe_{name}/{'forward_backward' if backward else 'forward'}",
                        partial(routed_moe, name=name, backward=backward), needs_counter=True, workload="lm",
                        ops=new_ops(moe_graph(name)))
    workloads = {case.name: case.workload for case in COUNT_CONV_CASES}
    for name, graph in COUNT_GRAPHS.items():
        tags = checks_tags(name) if name in GRAPHS else dict(workload=workloads[name], ops=new_ops(graph()))
        yield Check("count", f"{name}/forward", partial(native_vs_analytic, name=name, backward=False),
                    needs_counter=True, **tags)
        yield Check("count", f"{name}/forward_backward", partial(native_vs_analytic, name=name, backward=True),
                    needs_counter=True, **tags)
