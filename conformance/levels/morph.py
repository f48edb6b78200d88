"""Level 'morph' (fp32): each morph preserves the backend's output, and the change in the native op
count equals the change in the analytic count under the counter's convention (a native count of zero
or below, before or after the morph, for a category with operations is a failure, never a match).
The CNN morphs grow the small ResNet; the transformer morphs (the LM workload's) the train level's GPT and its
Llama (RMS norm, rotary, grouped-query attention, SwiGLU)."""

from __future__ import annotations

from functools import partial

import numpy as np

from aiperf_core.builders import gpt, llama, resnet_small
from aiperf_core.ir import SWIGLU_MOE
from aiperf_core.morph import transformer as transformer_morph
from aiperf_core.morph.cnn import random_morph
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, new_ops
from aiperf_conformance.levels.count import (BATCH, EXACT_CATEGORIES, analytic_for_counter, counted_natively,
                                             moe_outcome, moe_products, native_count, no_counter, non_positive)
from aiperf_conformance.levels.train import GPT_SIZES, LLAMA_SIZES

MORPHS = ("deeper", "wider", "skip", "kernel")
# Check names: gpt_<op> and llama_<op>, the transformer operators on the GPT and on the Llama.
TRANSFORMER_MORPHS = transformer_morph.OPERATORS
TRANSFORMERS = {"gpt": lambda: gpt(**GPT_SIZES), "llama": lambda: llama(**LLAMA_SIZES)}


def _family(ctx: Context, op: str):
    """(parent graph, parent weights, child MorphResult). 'kernel' needs a morph-added conv first."""
    key = ("morph", op)
    if key in ctx.cache:
        return ctx.cache[key]
    model, _, operator = op.partition("_")
    if model in TRANSFORMERS:
        graph = TRANSFORMERS[model]()
        weights = trained_looking_weights(graph, ctx.seed)
        ctx.cache[key] = (graph, weights, transformer_morph.random_morph(graph, weights, ctx.rng(33), ops=(operator,)))
    else:
        graph = resnet_small((16, 16, 3), 5)
        weights = trained_looking_weights(graph, ctx.seed)
        rng = ctx.rng(31)
        if op == "kernel":
            grown = random_morph(graph, weights, rng, ops=("deeper",))
            graph, weights = grown.graph, grown.weights
        ctx.cache[key] = (graph, weights, random_morph(graph, weights, rng, ops=(op,)))
    return ctx.cache[key]


def _inputs(ctx: Context, graph):
    """A batch of 4: images N(0, 1), or token ids."""
    rng = ctx.rng(32)
    if graph.takes_tokens:
        return rng.integers(0, graph.vocab, (4,) + graph.input_shape)
    return rng.normal(0, 1, (4,) + graph.input_shape).astype(np.float32)


def preserves_function(ctx: Context, op: str) -> Outcome:
    graph, weights, child = _family(ctx, op)
    x = _inputs(ctx, graph)
    before = ctx.backend.predict(ctx.backend.lower(graph, weights), x)
    after = ctx.backend.predict(ctx.backend.lower(child.graph, child.weights), x)
    args = ", ".join(f"{k}={v}" for k, v in child.record["args"].items())
    return compare(after, before, ctx.tolerance("morph"), f"{op}({args}): child vs parent output")


def count_delta(ctx: Context, op: str) -> Outcome:
    counter = ctx.backend.native_counter()
    if counter is None:
        return no_counter(ctx)
    conv = counter.convention
    graph, weights, child = _family(ctx, op)
    deltas = []
    for backward in (False, True):
        pass_name = "forward+backward" if backward else "forward"
        native = [counted_natively(ctx, counter, g, w, backward)
                  for g, w in ((graph, weights), (child.graph, child.weights))]
        analytic = [analytic_for_counter(g, conv, backward) for g in (graph, child.graph)]
        for which, n, a in (("parent", native[0], analytic[0]), ("child", native[1], analytic[1])):
            bad = non_positive(n, a, conv.covers, f"{op} {which} {pass_name}")
            if bad:
                return bad
        for category in conv.covers:
            got = native_count(native[1], category) - native_count(native[0], category)
            want = analytic[1].get(category, 0) - analytic[0].get(category, 0)
            if category == "moe" and want:
                # A counter books a moe's products, not its gates and activations (count/moe_*'s rule).
                floor = (moe_products(child.graph, backward) - moe_products(graph, backward)) * BATCH
                outcome = moe_outcome(f"{op} {pass_name} moe change", got, want, floor)
                if not outcome.passed:
                    return outcome
                deltas.append(f"{pass_name} moe {got:+,}")
                continue
            tol = ctx.tolerance("count" if category in EXACT_CATEGORIES else "count_other")
            err = abs(got - want) / max(abs(want), 1)
            if err > tol:
                return Outcome(False, got, want, tol, f"{op} {pass_name} {category}: native change {got:,}, "
                                                      f"analytic change {want:,}")
            deltas.append(f"{pass_name} {category} {got:+,}")
    return Outcome(True, 0.0, 0.0, None, f"{op}: " + "; ".join(deltas))


def checks(ctx: Context):
    for op in MORPHS:
        yield Check("morph", f"{op}/preserves_function", partial(preserves_function, op=op))
        yield Check("morph", f"{op}/count_delta", partial(count_delta, op=op), needs_counter=True)
    for model, build in TRANSFORMERS.items():
        ops = new_ops(build())
        for op in TRANSFORMER_MORPHS:
            # A Llama's upcycled MLP becomes SwiGLU experts; the other morphs keep the parent's ops.
            lm = dict(workload="lm", ops=ops | {SWIGLU_MOE} if model == "llama" and op == "upcycle_moe" else ops)
            name = f"{model}_{op}"
            yield Check("morph", f"{name}/preserves_function", partial(preserves_function, op=name), **lm)
            yield Check("morph", f"{name}/count_delta", partial(count_delta, op=name), needs_counter=True, **lm)
