"""The NumPy reference's Llama-family ops (IR schema 4, issue #41): rms_norm, rotary, silu, mul, grouped-query
attention and SwiGLU experts, forward against straightforward implementations of their definitions and backward
against central finite differences in float64; activation checkpointing on a Llama graph."""

from __future__ import annotations

import numpy as np
import pytest

from aiperf_core.builders import llama
from aiperf_core.ir import Graph, Node
from aiperf_numpy.executor import backward, forward, loss_and_grads, run

from test_numpy_executor import assert_grad_close, chain, check_gradients, numeric_grad, random_weights
from test_sequence_ir import _check_gradients, _random_weights


def _sequence_graph(seq: int, width: int, *nodes: Node) -> Graph:
    return Graph([Node("x", "input", (), {"shape": [seq, width]}), *nodes])


# -- rms_norm ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("epsilon", [1e-5, 0.1])
def test_rms_norm_forward_is_the_formula(epsilon):
    rng = np.random.default_rng(0)
    graph = chain((5, 6), ("rms_norm", {"epsilon": epsilon}))
    weights = random_weights(graph, rng)
    x = rng.standard_normal((2, 5, 6))
    gamma = weights["n0"]["gamma"]
    want = np.empty_like(x)
    for n, s in np.ndindex(2, 5):
        row = x[n, s]
        want[n, s] = row / np.sqrt(np.sum(row * row) / len(row) + epsilon) * gamma
    np.testing.assert_allclose(forward(graph, weights, x), want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("epsilon", [1e-5, 0.1])
def test_rms_norm_gradients(epsilon):
    rng = np.random.default_rng(1)
    graph = chain((4, 6), ("rms_norm", {"epsilon": epsilon}))
    check_gradients(graph, random_weights(graph, rng), rng.standard_normal((2, 4, 6)), training=False)


# -- rotary --------------------------------------------------------------------------------------------------

ROTARY_CASES = [(2, 10000.0), (4, 10000.0), (8, 100.0), (4, 100.0), (6, 500000.0)]  # (head_dim, base)


def complex_rotary(x: np.ndarray, head_dim: int, base: float) -> np.ndarray:
    """Each head's pair (i, i + head_dim/2) as the complex number x_i + j x_(i+d/2), turned by p base^(-2i/d)."""
    n, seq, width = x.shape
    half = head_dim // 2
    out = np.empty_like(x)
    for p in range(seq):
        for start in range(0, width, head_dim):
            for i in range(half):
                for b in range(n):
                    z = complex(x[b, p, start + i], x[b, p, start + half + i])
                    turned = z * np.exp(1j * p * base ** (-2.0 * i / head_dim))
                    out[b, p, start + i], out[b, p, start + half + i] = turned.real, turned.imag
    return out


@pytest.mark.parametrize("head_dim,base", ROTARY_CASES)
def test_rotary_forward_is_the_complex_rotation_of_half_split_pairs(head_dim, base):
    graph = chain((7, 3 * head_dim), ("rotary", {"head_dim": head_dim, "base": base}))
    x = np.random.default_rng(2).standard_normal((2, 7, 3 * head_dim))
    np.testing.assert_allclose(forward(graph, {}, x), complex_rotary(x, head_dim, base), rtol=1e-13, atol=1e-14)


def test_rotary_leaves_position_zero_and_keeps_each_pairs_length():
    graph = chain((9, 8), ("rotary", {"head_dim": 4}))
    x = np.random.default_rng(3).standard_normal((1, 9, 8))
    y = forward(graph, {}, x)
    np.testing.assert_array_equal(y[:, 0], x[:, 0])

    def pair_lengths(t):  # (batch, position, head, half, i): pair i is (half 0, half 1)
        halves = t.reshape(1, 9, 2, 2, 2)
        return np.hypot(halves[..., 0, :], halves[..., 1, :])

    np.testing.assert_allclose(pair_lengths(y), pair_lengths(x), rtol=1e-14)


@pytest.mark.parametrize("head_dim,base", ROTARY_CASES)
def test_rotary_gradients(head_dim, base):
    rng = np.random.default_rng(4)
    graph = chain((5, 2 * head_dim), ("rotary", {"head_dim": head_dim, "base": base}))
    check_gradients(graph, {}, rng.standard_normal((2, 5, 2 * head_dim)), training=False)


def test_rotary_angles_are_float64_in_a_float32_run():
    # At position 4095 a float32 angle table is off by about 2e-5 in cos: far beyond float32's rounding of cos.
    seq, head_dim = 4096, 8
    graph = chain((seq, head_dim), ("rotary", {"head_dim": head_dim}))
    x = np.random.default_rng(5).standard_normal((1, seq, head_dim)).astype(np.float32)
    got = forward(graph, {}, x, dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, complex_rotary(x.astype(np.float64), head_dim, 10000.0), rtol=0, atol=2e-6)


# -- silu and mul --------------------------------------------------------------------------------------------

def test_silu_forward_is_x_times_sigmoid_without_overflow():
    graph = chain((1, 7), ("silu", {}))
    x = np.array([[[-1000.0, -40.0, -1.5, 0.0, 0.5, 30.0, 1000.0]]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        got = forward(graph, {}, x)
    want = [x_ / (1.0 + np.exp(np.float64(-x_))) if x_ > -700 else 0.0 for x_ in x.ravel()]
    np.testing.assert_allclose(got.ravel(), want, rtol=1e-14, atol=0)


def test_silu_gradients():
    rng = np.random.default_rng(6)
    graph = chain((4, 5), ("silu", {}))
    check_gradients(graph, {}, 3 * rng.standard_normal((2, 4, 5)), training=False)


def test_mul_forward_and_gradients_to_both_factors():
    rng = np.random.default_rng(7)
    graph = _sequence_graph(4, 5, Node("a", "dense", ("x",), {"units": 3}), Node("b", "dense", ("x",), {"units": 3}),
                            Node("m", "mul", ("a", "b"), {}))
    weights = random_weights(graph, rng)
    x = rng.standard_normal((2, 4, 5))
    outputs = run(graph, weights, x).outputs
    np.testing.assert_array_equal(outputs["m"], outputs["a"] * outputs["b"])
    check_gradients(graph, weights, x, training=False)


# -- grouped-query attention ---------------------------------------------------------------------------------

def gqa_graph(heads: int, kv_heads: int, head_dim: int, seq: int = 5, width: int = 6, causal: bool = True,
              rotary_base: float | None = None) -> Graph:
    """x -> query, key and value projections (optionally rotary on query and key) -> attention."""
    q, k = "q", "k"
    nodes = [Node("q", "dense", ("x",), {"units": heads * head_dim}),
             Node("k", "dense", ("x",), {"units": kv_heads * head_dim}),
             Node("v", "dense", ("x",), {"units": kv_heads * head_dim})]
    if rotary_base is not None:
        nodes += [Node("q_rope", "rotary", ("q",), {"head_dim": head_dim, "base": rotary_base}),
                  Node("k_rope", "rotary", ("k",), {"head_dim": head_dim, "base": rotary_base})]
        q, k = "q_rope", "k_rope"
    nodes.append(Node("attn", "attention", (q, k, "v"),
                      {"heads": heads, "head_dim": head_dim, "kv_heads": kv_heads, "causal": causal}))
    return _sequence_graph(seq, width, *nodes)


def naive_grouped_query_attention(q, k, v, heads, kv_heads, head_dim, causal):
    """One query head at a time, each reading its key-value head h // (heads / kv_heads)."""
    n, seq, _ = q.shape
    out = np.empty_like(q)
    for b in range(n):
        for h in range(heads):
            g = h // (heads // kv_heads)
            qh = q[b, :, h * head_dim:(h + 1) * head_dim]
            kh, vh = (t[b, :, g * head_dim:(g + 1) * head_dim] for t in (k, v))
            for i in range(seq):
                seen = i + 1 if causal else seq
                scores = np.array([qh[i] @ kh[j] for j in range(seen)]) / np.sqrt(head_dim)
                p = np.exp(scores - scores.max())
                out[b, i, h * head_dim:(h + 1) * head_dim] = (p / p.sum()) @ vh[:seen]
    return out


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention_forward_reads_the_shared_key_value_head(kv_heads, causal):
    rng = np.random.default_rng(8)
    graph = gqa_graph(4, kv_heads, 3, causal=causal)
    outputs = run(graph, random_weights(graph, rng), rng.standard_normal((2, 5, 6))).outputs
    want = naive_grouped_query_attention(outputs["q"], outputs["k"], outputs["v"], 4, kv_heads, 3, causal)
    np.testing.assert_allclose(outputs["attn"], want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attention_gradients(kv_heads, causal):
    # The key and value projections' kernel gradients hold the key-value heads' summed gradients.
    rng = np.random.default_rng(9)
    graph = gqa_graph(4, kv_heads, 2, causal=causal)
    check_gradients(graph, random_weights(graph, rng), rng.standard_normal((2, 5, 6)), training=False)


@pytest.mark.parametrize("kv_heads,base", [(2, 10000.0), (1, 100.0)])
def test_rotary_grouped_query_attention_gradients(kv_heads, base):
    rng = np.random.default_rng(10)
    graph = gqa_graph(4, kv_heads, 4, seq=6, rotary_base=base)
    check_gradients(graph, random_weights(graph, rng), rng.standard_normal((2, 6, 6)), training=False)


# -- SwiGLU experts ------------------------------------------------------------------------------------------

SEQ, WIDTH, EXPERTS, UNITS = 5, 4, 3, 6


def swiglu_moe_graph(top_k: int) -> Graph:
    return _sequence_graph(SEQ, WIDTH, Node("m", "moe", ("x",), {"experts": EXPERTS, "top_k": top_k, "units": UNITS,
                                                                 "mlp": "swiglu"}))


def swiglu_weights(graph: Graph, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"m": {name: rng.normal(0, 0.5, shape) for name, shape in graph.param_shapes("m").items()}}


@pytest.mark.parametrize("top_k", [1, 2])
def test_swiglu_moe_forward_is_the_gated_sum_of_the_chosen_experts(top_k):
    graph = swiglu_moe_graph(top_k)
    weights = swiglu_weights(graph, 11)
    assert set(weights["m"]) == {"router", "w_gate", "w_in", "w_out"}
    x = np.random.default_rng(12).standard_normal((2, SEQ, WIDTH))
    got = forward(graph, weights, x)
    p = weights["m"]
    for n, s in np.ndindex(2, SEQ):
        token = x[n, s]
        logits = token @ p["router"]
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        top = np.argsort(-probs)[:top_k]
        want = np.zeros(WIDTH)
        for gate, e in zip(probs[top] / probs[top].sum(), top):
            g = token @ p["w_gate"][e]
            want += gate * ((g / (1.0 + np.exp(-g)) * (token @ p["w_in"][e])) @ p["w_out"][e])
        np.testing.assert_allclose(got[n, s], want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("top_k", [1, 2])
def test_swiglu_moe_gradients(top_k):
    graph = swiglu_moe_graph(top_k)
    weights = swiglu_weights(graph, 13)
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, SEQ, WIDTH))
    r = rng.standard_normal((2, SEQ, WIDTH))
    grad_x, grads = backward(run(graph, weights, x), r)

    def objective():
        return float(np.sum(forward(graph, weights, x) * r))

    assert_grad_close(grad_x, numeric_grad(objective, x), "input gradient")
    assert set(grads["m"]) == {"router", "w_gate", "w_in", "w_out"}
    for name, grad in grads["m"].items():
        assert_grad_close(grad, numeric_grad(objective, weights["m"][name]), f"m/{name}")


# -- a Llama graph -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_llama_gradients_match_finite_differences(kv_heads):
    graph = llama(layers=2, hidden=16, heads=4, kv_heads=kv_heads, seq_len=6, vocab=11, ffn=12, rope_base=500.0)
    tokens = np.random.default_rng(15).integers(0, 11, (2, 6))
    _check_gradients(graph, tokens, _random_weights(graph))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_llama_checkpointing_gives_identical_gradients(dtype):
    graph = llama(layers=2, hidden=16, heads=4, kv_heads=2, seq_len=6, vocab=11, ffn=12)
    weights = _random_weights(graph)
    rng = np.random.default_rng(16)
    tokens, labels = rng.integers(0, 11, (2, 6)), rng.integers(0, 11, (2, 6))
    blocks = graph.blocks()
    inner = {nid for block in blocks for nid in block.nodes[:-1]}
    assert len(blocks) == 2 and {graph[nid].op for nid in inner} >= {"rms_norm", "rotary", "attention", "silu", "mul"}
    trace = run(graph, weights, tokens, dtype=dtype, checkpoint_blocks=True)
    assert not inner & set(trace.outputs)  # dropped: the backward pass recomputes them
    plain_loss, plain, _ = loss_and_grads(graph, weights, tokens, labels, dtype=dtype)
    loss, grads, _ = loss_and_grads(graph, weights, tokens, labels, dtype=dtype, checkpoint_blocks=True)
    assert loss == plain_loss
    assert grads.keys() == plain.keys()
    for node_id, params in plain.items():
        assert params.keys() == grads[node_id].keys()
        for name, grad in params.items():
            np.testing.assert_array_equal(grads[node_id][name], grad, err_msg=f"{node_id}/{name}")
