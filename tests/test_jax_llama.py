"""The JAX backend on the IR's Llama-family ops (schema 4: rms_norm, rotary, silu, mul, grouped-query
attention, SwiGLU experts): what the conformance kit does not check.

The kit certifies each op case (conformance/cases.py), the Llama's logits (graph/llama), its training
step and gradients (train/llama_*) and its native count (count/llama) at every precision the backend
declares on the device under test, which on a CPU is fp32 alone. Here:

* bf16 lowered directly on a CPU (XLA converts bfloat16 where the CPU lacks it): the kit's new op
  cases and a Llama against the float64 reference at the kit's bf16 tolerances, so that the
  mixed-precision lowering is tested on every CI machine, not only where bf16 is declared;
* rotary's angles at late positions (the cos and sin tables are computed in float64 on the host);
* RMS norm's closed-form backward against autodiff of its formula;
* the product precisions of a Llama's and a SwiGLU mixture's training step;
* the native counter on multi-query attention (the kit's Llama has 2 key-value heads for 4 heads).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from aiperf_core.builders import llama
from aiperf_core.ir import VERSION_4_OPS, Graph, Node
from aiperf_core.registry import load_backend
from aiperf_conformance.cases import case_input, case_labels, trained_looking_weights
from aiperf_conformance.expectations import load_expectations
from aiperf_conformance.kit import compare, reference
from aiperf_conformance.levels.count import BATCH as COUNT_BATCH, analytic_for_counter
from aiperf_conformance.levels.op import compare_grads, key_biases

from llama_spec import NEW_CASES, rotary as spec_rotary


@functools.cache
def _backend():
    backend = load_backend("jax")  # BackendError when jax cannot import: a failure, never a skip
    availability = type(backend).availability()
    assert availability.available, availability.reason
    return backend


def _tolerance(key: str, precision: str) -> float:
    return load_expectations("jax", _backend()).tolerance(key, precision)


def _against_reference(graph: Graph, precision: str, output_key: str, gradient_key: str, seed: int,
                       forward_graph: Graph | None = None) -> None:
    """The inference output of `forward_graph` (default: `graph`), and the training loss and every gradient
    of `graph`, lowered at `precision`, against the float64 reference with the kit's comparisons and
    tolerances (the kit's op level: the op's own output forward, through a head backward)."""
    from aiperf_backends.jax.lowering import lower_graph

    backend, rng = _backend(), np.random.default_rng(seed)
    forward_graph = forward_graph or graph
    weights = trained_looking_weights(graph, seed)
    x, labels = case_input(graph, rng, 3), case_labels(graph, rng, 3)
    own = {n.id: weights[n.id] for n in forward_graph.nodes if n.id in weights}
    expected = reference().forward(forward_graph, own, x, dtype=np.float64)
    outcome = compare(backend.predict(lower_graph(forward_graph, own, precision), x), expected,
                      _tolerance(output_key, precision), "output")
    assert outcome.passed, outcome.message
    model = lower_graph(graph, weights, precision)
    ref_loss, ref_grads, _ = reference().loss_and_grads(graph, weights, x, labels, dtype=np.float64)
    loss, grads = backend.loss_and_grads(model, x, labels)
    outcome = compare_grads(loss, grads, ref_loss, ref_grads, _tolerance(gradient_key, precision),
                            zero_in_exact=key_biases(graph))
    assert outcome.passed, outcome.message


def test_the_kit_has_a_case_for_each_new_op_and_attribute():
    ops = {n.op for case in NEW_CASES.values() for n in case.nodes}
    assert VERSION_4_OPS <= ops
    assert any(n.attrs.get("kv_heads") == 1 for case in NEW_CASES.values() for n in case.nodes)
    assert any(n.attrs.get("mlp") == "swiglu" for case in NEW_CASES.values() for n in case.nodes)


@pytest.mark.parametrize("name", sorted(NEW_CASES))
def test_bf16_lowered_on_a_cpu_each_new_op_against_the_reference(name):
    case = NEW_CASES[name]
    _against_reference(case.with_head(), "bf16", "op", "op_grad_lm", seed=sorted(NEW_CASES).index(name),
                       forward_graph=case.graph())


def test_a_bf16_grouped_query_llama_lowered_on_a_cpu_against_the_reference():
    _against_reference(llama(layers=1, hidden=16, heads=4, kv_heads=2, seq_len=7, vocab=13, ffn=24), "bf16",
                       "graph_lm", "op_grad_lm", seed=5)


def test_rotary_angles_hold_float32_accuracy_at_late_positions():
    """theta = p * base^(-2i/d) for p up to 8191, in float64 before one rounding of cos and sin: an angle
    formed in float32 would be off by up to p * 2^-24 (about 5e-4 here)."""
    _backend()
    from aiperf_backends.jax.lowering import rotary

    seq, dim, base = 8192, 8, 10000.0
    x = np.random.default_rng(0).normal(0, 1, (1, seq, 2 * dim)).astype(np.float32)
    want = spec_rotary(x.astype(np.float64), dim, base)
    got = np.asarray(rotary(x, {"head_dim": dim, "base": base}), np.float64)
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))


def test_rms_norm_closed_form_backward_equals_autodiff_of_its_formula():
    _backend()
    import jax
    import jax.numpy as jnp
    from jax import lax

    from aiperf_backends.jax.lowering import rms_norm

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(0.5, 2, (3, 5, 8)), jnp.float32)
    gamma = jnp.asarray(rng.normal(1, 0.3, 8), jnp.float32)
    weight = jnp.asarray(rng.normal(0, 1, (3, 5, 8)), jnp.float32)

    def formula(x, gamma):
        return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * gamma

    closed = jax.grad(lambda x, g: jnp.sum(rms_norm(x, g, 1e-5) * weight), (0, 1))(x, gamma)
    autodiff = jax.grad(lambda x, g: jnp.sum(formula(x, g) * weight), (0, 1))(x, gamma)
    for got, want in zip(closed, autodiff):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def _swiglu_moe_graph() -> Graph:
    return Graph((Node("tokens", "token_input", (), {"seq_len": 6, "vocab": 13}),
                  Node("embed", "embedding", ("tokens",), {"vocab": 13, "units": 8}),
                  Node("moe", "moe", ("embed",), {"experts": 3, "top_k": 2, "units": 12, "mlp": "swiglu"}),
                  Node("head", "dense", ("moe",), {"units": 13, "use_bias": False}),
                  Node("probs", "softmax", ("head",), {})), name="swiglu_moe")


def test_a_llama_step_at_fp32_asks_for_highest_on_every_product_grouped_query_attention_included():
    _backend()
    from test_jax_step_memory import step_products

    fp32 = step_products(llama(layers=1, hidden=16, heads=4, kv_heads=2, seq_len=6, vocab=13, ffn=24), "fp32")
    # 8 dense layers (q, k, v, proj, gate, up, down, lm_head: forward, input and weight gradients; the
    # embedding below them is trained) and attention (2 forward, 4 backward)
    assert len(fp32) == 8 * 3 + 6
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in fp32), fp32
    tf32 = step_products(llama(layers=1, hidden=16, heads=4, kv_heads=2, seq_len=6, vocab=13, ffn=24), "tf32")
    assert len(tf32) == len(fp32) and all("HIGHEST" not in line for line in tf32), tf32


def test_a_swiglu_mixture_step_at_fp32_asks_for_highest_on_every_product():
    _backend()
    from test_jax_step_memory import step_products

    products = step_products(_swiglu_moe_graph(), "fp32")
    assert products and all("precision = [HIGHEST, HIGHEST]" in line for line in products), products


@pytest.mark.parametrize("backward", [False, True])
def test_the_native_counter_counts_multi_query_attention_as_the_analytic_rule(backward):
    backend = _backend()
    graph = Graph((Node("x", "input", (), {"shape": [5, 8]}),
                   Node("q", "dense", ("x",), {"units": 8}),
                   Node("k", "dense", ("x",), {"units": 2}),
                   Node("v", "dense", ("x",), {"units": 2}),
                   Node("att", "attention", ("q", "k", "v"), {"heads": 4, "head_dim": 2, "kv_heads": 1}),
                   Node("head", "dense", ("att",), {"units": 3}),
                   Node("probs", "softmax", ("head",), {})), name="multi_query")
    counter = backend.native_counter()
    native = counter.count(backend.lower(graph, trained_looking_weights(graph, 0)), COUNT_BATCH, backward)
    analytic = analytic_for_counter(graph, counter.convention, backward)
    assert native["attention"] > 0
    assert {c: native[c] for c in ("dense", "attention")} == {c: analytic[c] for c in ("dense", "attention")}


@pytest.mark.slow
def test_a_llama_with_checkpointed_blocks_gives_the_plain_gradients():
    """Rotary's constant tables and the grouped-query attention inside jax.checkpoint'ed blocks."""
    _backend()
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import lower_graph
    from test_jax_step_memory import assert_checkpointed_blocks_give_the_plain_gradients

    graph = llama(layers=2, hidden=16, heads=4, kv_heads=2, seq_len=6, vocab=13, ffn=24)
    assert graph.blocks()
    model = lower_graph(graph, trained_looking_weights(graph, 3), "fp32")
    rng = np.random.default_rng(4)
    x, y = (jnp.asarray(rng.integers(0, 13, (3, 6)), jnp.int32) for _ in range(2))
    assert_checkpointed_blocks_give_the_plain_gradients(graph, model, x, y)
