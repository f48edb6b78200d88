"""The torch backend's lowering of schema 4's ops (rms_norm, rotary, silu, mul, grouped-query attention,
SwiGLU experts) against a float64 NumPy reading of the IR's spec written here, independently of the
NumPy reference backend; the fused projections' grouping where rotary, silu or a narrower key and
value sit between the projections and their reader; and the Llama graph's native count.

Tolerance: float32 against float64 over sums of at most a few hundred products, 1e-5 of the largest
output (the kit holds each op to 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: F401  (`make test` installs torch: missing it is a failure, never a skip)

from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.lowering import fused_projections, generated_source
from aiperf_conformance.cases import SEQUENCE_CASES, case_input, trained_looking_weights
from aiperf_core.builders import llama
from aiperf_core.ir import Graph, Node, kv_heads, moe_mlp

TOL = 1e-5
NEW_CASES = ("rms_norm", "rotary", "rotary_one_head_base_100", "silu", "mul", "attention_grouped_query",
             "attention_multi_query", "attention_rotary_grouped_query", "moe_swiglu_top2")


def silu(x):
    return x / (1.0 + np.exp(-x))


def rotary(x, head_dim: int, base: float):
    n, s, w = x.shape
    half = head_dim // 2
    theta = np.arange(s)[:, None] * base ** (-2.0 * np.arange(half) / head_dim)  # (S, d/2)
    heads = x.reshape(n, s, w // head_dim, head_dim)
    x1, x2 = heads[..., :half], heads[..., half:]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(n, s, w)


def attention(q, k, v, attrs):
    n, s, _ = q.shape
    heads, d, kv = attrs["heads"], attrs["head_dim"], kv_heads(attrs)
    out = np.empty_like(q)
    for h in range(heads):
        g = h // (heads // kv)  # the key-value head query head h reads
        scores = q[..., h * d:(h + 1) * d] @ k[..., g * d:(g + 1) * d].transpose(0, 2, 1) / np.sqrt(d)
        if attrs["causal"]:
            scores = np.where(np.tri(s, dtype=bool), scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[..., h * d:(h + 1) * d] = (p / p.sum(-1, keepdims=True)) @ v[..., g * d:(g + 1) * d]
    return out


def moe(x, attrs, w):
    logits = x @ w["router"]
    out = np.zeros_like(x)
    for index in np.ndindex(x.shape[:-1]):
        token, row = x[index], logits[index]
        chosen = np.argsort(-row, kind="stable")[:attrs["top_k"]]
        gates = np.exp(row[chosen] - row[chosen].max())
        for e, gate in zip(chosen, gates / gates.sum()):
            assert moe_mlp(attrs) == "swiglu"
            hidden = silu(token @ w["w_gate"][e]) * (token @ w["w_in"][e])
            out[index] += gate * (hidden @ w["w_out"][e])
    return out


def spec_forward(graph: Graph, weights, x):
    """The graph's output in float64, from the IR's definitions of its ops."""
    values = {}
    w64 = {n: {p: a.astype(np.float64) for p, a in ps.items()} for n, ps in weights.items()}
    for node in graph.nodes:
        a, w = node.attrs, w64.get(node.id, {})
        args = [values[i] for i in node.inputs]
        if node.op == "input":
            y = x.astype(np.float64)
        elif node.op == "token_input":
            y = x
        elif node.op == "embedding":
            y = w["table"][args[0]]
        elif node.op == "dense":
            y = args[0] @ w["kernel"] + (w["bias"] if "bias" in w else 0.0)
        elif node.op == "rms_norm":
            y = args[0] / np.sqrt((args[0] ** 2).mean(-1, keepdims=True) + a["epsilon"]) * w["gamma"]
        elif node.op == "rotary":
            y = rotary(args[0], a["head_dim"], a["base"])
        elif node.op == "silu":
            y = silu(args[0])
        elif node.op in ("mul", "add"):
            y = args[0] * args[1] if node.op == "mul" else args[0] + args[1]
        elif node.op == "attention":
            y = attention(*args, a)
        elif node.op == "moe":
            y = moe(args[0], a, w)
        elif node.op == "softmax":
            e = np.exp(args[0] - args[0].max(-1, keepdims=True))
            y = e / e.sum(-1, keepdims=True)
        else:
            raise AssertionError(f"no spec here for {node.op}")
        values[node.id] = y
    return values[graph.output_id]


def relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.mark.parametrize("name", NEW_CASES)
def test_each_new_op_case_matches_the_spec(backend, name):
    case = next(c for c in SEQUENCE_CASES if c.name == name)
    graph = case.graph()
    weights = trained_looking_weights(graph, 3)
    x = case_input(graph, np.random.default_rng(4), 3)
    got = backend.predict(backend.lower(graph, weights), x)
    assert relative_error(got, spec_forward(graph, weights, x)) < TOL


def test_a_wrong_rotary_form_would_fail_the_spec():
    """The spec's half-split pairs (i, i + d/2) against GPT-J's interleaved pairs (2i, 2i + 1): on these
    inputs they differ by far more than the tolerance, so the case above tells the forms apart."""
    x = np.random.default_rng(0).normal(size=(1, 5, 8))
    interleaved = rotary(x.reshape(1, 5, 2, 2, 2).swapaxes(-1, -2).reshape(1, 5, 8), 4, 10000.0)
    interleaved = interleaved.reshape(1, 5, 2, 2, 2).swapaxes(-1, -2).reshape(1, 5, 8)
    assert relative_error(interleaved, rotary(x, 4, 10000.0)) > 1e-2


def test_a_llama_matches_the_spec_and_its_projections_are_fused(backend):
    graph = llama(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64, ffn=48)
    weights = trained_looking_weights(graph, 1)
    x = case_input(graph, np.random.default_rng(2), 3)
    model = backend.lower(graph, weights)
    assert relative_error(backend.predict(model, x), spec_forward(graph, weights, x)) < TOL
    groups = set(fused_projections(graph, graph.nodes).values())
    assert groups == {tuple(f"h{i}_{p}" for p in parts) for i in range(2) for parts in (("q", "k", "v"), ("gate", "up"))}
    source = generated_source(model)
    assert "split([32, 16, 16], dim=-1)" in source and "split([48, 48], dim=-1)" in source


def test_projections_are_not_fused_where_a_rotated_query_has_another_reader(backend):
    """A rotary output read twice (by the attention and by the output sum) keeps its projection apart:
    fused, the split's view would live as long as that other reader."""
    nodes = (Node("x", "input", (), {"shape": [5, 8]}),
             Node("q", "dense", ("x",), {"units": 8}), Node("k", "dense", ("x",), {"units": 4}),
             Node("v", "dense", ("x",), {"units": 4}),
             Node("q_rope", "rotary", ("q",), {"head_dim": 4}), Node("k_rope", "rotary", ("k",), {"head_dim": 4}),
             Node("att", "attention", ("q_rope", "k_rope", "v"), {"heads": 2, "head_dim": 4, "kv_heads": 1}),
             Node("out", "add", ("att", "q_rope"), {}))
    graph = Graph(nodes, name="shared_rope")
    assert fused_projections(graph, graph.nodes) == {}
    weights = trained_looking_weights(graph, 5)
    x = case_input(graph, np.random.default_rng(6), 2)
    got = backend.predict(backend.lower(graph, weights), x)
    assert relative_error(got, spec_forward(graph, weights, x)) < TOL


def test_the_group_is_computed_before_a_rotary_of_its_later_member(backend):
    """A key projection stored before the query (and rotated before the query is computed): the fused
    product is emitted at the group's first member in graph order."""
    nodes = (Node("x", "input", (), {"shape": [5, 8]}),
             Node("k", "dense", ("x",), {"units": 4}), Node("k_rope", "rotary", ("k",), {"head_dim": 4}),
             Node("q", "dense", ("x",), {"units": 8}), Node("v", "dense", ("x",), {"units": 4}),
             Node("att", "attention", ("q", "k_rope", "v"), {"heads": 2, "head_dim": 4, "kv_heads": 1}))
    graph = Graph(nodes, name="key_first")
    assert set(fused_projections(graph, graph.nodes).values()) == {("q", "k", "v")}
    weights = trained_looking_weights(graph, 7)
    x = case_input(graph, np.random.default_rng(8), 2)
    got = backend.predict(backend.lower(graph, weights), x)
    assert relative_error(got, spec_forward(graph, weights, x)) < TOL


def test_grouped_query_attention_runs_the_fused_kernel_without_copying_key_value_heads(backend):
    """SDPA's enable_gqa: on a CPU the flash kernel reads each key-value head for its query heads,
    forward and backward, at every precision this CPU declares; nothing repeats the keys and values."""
    from torch.profiler import profile

    case = next(c for c in SEQUENCE_CASES if c.name == "attention_grouped_query")
    graph = case.with_head()
    x = case_input(graph, np.random.default_rng(0), 2)
    labels = np.random.default_rng(1).integers(0, graph.output_shape[-1], (2,) + graph.output_shape[:-1])
    for precision in backend.precisions(backend.devices()[0]):
        model = backend.lower(graph, trained_looking_weights(graph, 0), precision=precision)
        with profile() as run:
            backend.loss_and_grads(model, x, labels)
        ran = {event.name for event in run.events()}
        assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
                "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= ran, precision
        assert "aten::repeat_interleave" not in ran, precision
