"""The sequence ops and the model-zoo CNN ops of the IR (issue 31): shapes, refusals naming the node, the
schema version, the count against the standard GPT formula, and the NumPy reference's gradients
against finite differences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aiperf_core.builders import gpt
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import Graph, Node
from aiperf_core.weights import init_weights
from aiperf_numpy.executor import backward, forward, loss_and_grads, run
from aiperf_opcount import count


def _graph(*nodes, name="g"):
    return Graph([Node(*n) if isinstance(n, tuple) else n for n in nodes], name=name)


# -- the GPT and its count ----------------------------------------------------------------------------

@pytest.mark.parametrize("layers,hidden,heads,seq,vocab", [
    (2, 128, 4, 128, 256), (12, 768, 12, 1024, 50257), (3, 64, 2, 17, 100), (1, 32, 1, 5, 7)])
def test_gpt_count_equals_the_standard_formula_on_the_matrix_products(layers, hidden, heads, seq, vocab):
    cats = count(gpt(layers, hidden, heads, seq, vocab)).by_category()
    want = 2 * seq * (12 * layers * hidden ** 2 + hidden * vocab) + 4 * seq ** 2 * hidden * layers
    assert cats["dense"]["fp"] + cats["attention"]["fp"] == want
    assert cats["dense"]["bp"] + cats["attention"]["bp"] == 2 * want
    assert cats["attention"]["fp"] == 4 * seq ** 2 * hidden * layers
    assert cats["conv"] == {"fp": 0, "bp": 0}


def test_gpt_count_with_another_mlp_width_and_the_valid_convention():
    s, h, layers, f = 16, 32, 2, 80
    paper = count(gpt(layers, h, 4, s, 50, ffn=f)).by_category()
    valid = count(gpt(layers, h, 4, s, 50, ffn=f), "valid").by_category()
    assert paper["dense"]["fp"] == 2 * s * layers * (4 * h * h + 2 * h * f) + 2 * s * h * 50
    # valid: only the S(S+1)/2 pairs the causal mask keeps, per head, in both products
    assert valid["attention"]["fp"] == layers * 2 * 2 * (s * (s + 1) // 2) * h
    assert paper["dense"] == valid["dense"]


def test_attention_softmax_is_split_from_its_products():
    result = count(gpt(1, 32, 2, 8, 10))
    node = next(n for n in result.nodes if n.op == "attention")
    parts = {c: (fp, g) for c, fp, g in node.parts()}
    assert parts["attention"][0] == 2 * 2 * 2 * 8 * 8 * 16  # 2 products x MAC x heads x S^2 x head_dim
    assert parts["softmax"][0] == 2 * 8 * 8 * 15  # scale, mask, exp, add, div per score
    assert sum(fp for fp, _ in parts.values()) == node.fp
    assert json.loads(json.dumps(result.to_dict()))["nodes"][node_index(result, node.id)]["by_category"]


def node_index(result, node_id):
    return [n.id for n in result.nodes].index(node_id)


def test_gpt_shapes_and_parameters():
    g = gpt(2, 64, 4, 16, 100)
    assert g.takes_tokens and g.vocab == 100 and g.input_shape == (16,)
    assert g.output_shape == (16, 100)
    # embedding + positions + per layer (4 H^2 + 4 H + 2 * 4H^2 + 4H + H + 4 H norms) + final norm + head
    h = 64
    per_layer = 4 * h * h + 4 * h + (h * 4 * h + 4 * h) + (4 * h * h + h) + 4 * h
    assert g.num_params() == 100 * h + 16 * h + 2 * per_layer + 2 * h + h * 100
    assert g.schema_version() == 2
    assert Graph.from_json(g.to_json()) == g


@pytest.mark.parametrize("kwargs,field", [
    ({"hidden": 30, "heads": 4}, "heads"), ({"layers": 0}, "layers"), ({"vocab": 1}, "vocab")])
def test_gpt_builder_refuses_bad_sizes_naming_the_field(kwargs, field):
    with pytest.raises(AiperfError, match=field):
        gpt(**kwargs)


# -- refusals that name the node ----------------------------------------------------------------------

def _tokens(seq=6, vocab=10):
    return {"id": "t", "op": "token_input", "attrs": {"seq_len": seq, "vocab": vocab}}


@pytest.mark.parametrize("nodes,node,message", [
    ([_tokens(), {"id": "e", "op": "embedding", "inputs": ["t"], "attrs": {"vocab": 11, "units": 4}}],
     "e", "vocab 11"),
    ([_tokens(), {"id": "e", "op": "embedding", "inputs": ["t"], "attrs": {"vocab": 10, "units": 4}},
      {"id": "q", "op": "dense", "inputs": ["e"], "attrs": {"units": 4}},
      {"id": "k", "op": "dense", "inputs": ["e"], "attrs": {"units": 4}},
      {"id": "a", "op": "attention", "inputs": ["q", "k", "e"], "attrs": {"heads": 3, "head_dim": 2}}],
     "a", "heads \\* head_dim"),
    ([{"id": "x", "op": "input", "attrs": {"shape": [4, 4, 6]}},
      {"id": "c", "op": "conv2d", "inputs": ["x"], "attrs": {"filters": 4, "kernel": [1, 1], "groups": 4}}],
     "c", "groups 4"),
    ([{"id": "x", "op": "input", "attrs": {"shape": [4, 4, 6]}},
      {"id": "l", "op": "lrn", "inputs": ["x"], "attrs": {"size": 4}}], "l", "odd"),
    ([{"id": "x", "op": "input", "attrs": {"shape": [4, 4, 6]}},
      {"id": "p", "op": "position_embedding", "inputs": ["x"]}], "p", "sequence"),
    ([{"id": "x", "op": "input", "attrs": {"shape": [6]}},
      {"id": "e", "op": "embedding", "inputs": ["x"], "attrs": {"vocab": 10, "units": 4}}], "e", "token_input"),
])
def test_bad_sequence_graphs_are_refused_naming_the_node(nodes, node, message):
    with pytest.raises(GraphError, match=message) as info:
        Graph.from_dict({"schema_version": 2, "nodes": nodes})
    assert info.value.node == node


def test_version_1_graphs_load_and_are_written_as_version_1():
    from aiperf_core.builders import resnet_small

    g = resnet_small()
    data = g.to_dict()
    assert data["schema_version"] == 1
    assert Graph.from_dict(data) == g
    with pytest.raises(GraphError, match="schema_version 5"):
        Graph.from_dict(dict(data, schema_version=5))


# -- the NumPy reference against finite differences -----------------------------------------------------

def _random_weights(graph, seed=0):
    rng = np.random.default_rng(seed)
    weights = init_weights(graph, seed=seed)
    for params in weights.values():
        for name, value in params.items():
            if name in ("bias", "beta", "value"):
                params[name] = rng.normal(0, 0.3, value.shape).astype(np.float32)
            elif name == "gamma":
                params[name] = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
            elif name == "table":
                params[name] = rng.normal(0, 0.5, value.shape).astype(np.float32)
    return weights


def _check_gradients(graph, x, weights, eps=1e-6):
    """Input (for real-valued inputs) and parameter gradients of sum(output * g) against central
    differences, in float64."""
    rng = np.random.default_rng(1)
    trace = run(graph, weights, x, training=True)
    g = rng.normal(0, 1, trace.output.shape)
    dx, dparams = backward(trace, g)

    def objective(w, xx):
        return float(np.sum(forward(graph, w, xx, training=True) * g))

    if not graph.takes_tokens:
        for _ in range(6):
            idx = tuple(rng.integers(0, s) for s in x.shape)
            xp, xm = x.astype(np.float64).copy(), x.astype(np.float64).copy()
            xp[idx] += eps
            xm[idx] -= eps
            numeric = (objective(weights, xp) - objective(weights, xm)) / (2 * eps)
            assert dx[idx] == pytest.approx(numeric, rel=1e-5, abs=1e-7), f"input {idx}"
    for node_id, params in dparams.items():
        for name, grad in params.items():
            for _ in range(4):
                idx = tuple(rng.integers(0, s) for s in grad.shape)
                wp = {n: {p: a.astype(np.float64).copy() for p, a in ps.items()} for n, ps in weights.items()}
                wm = {n: {p: a.astype(np.float64).copy() for p, a in ps.items()} for n, ps in weights.items()}
                wp[node_id][name][idx] += eps
                wm[node_id][name][idx] -= eps
                numeric = (objective(wp, x) - objective(wm, x)) / (2 * eps)
                assert grad[idx] == pytest.approx(numeric, rel=1e-5, abs=1e-7), f"{node_id}/{name} {idx}"


IMAGE_CASES = {
    "grouped_conv": [{"id": "c", "op": "conv2d", "inputs": ["x"],
                      "attrs": {"filters": 6, "kernel": [3, 3], "padding": [1, 0, 1, 1], "strides": [2, 1],
                                "groups": 2, "use_bias": True}}],
    "depthwise_conv": [{"id": "c", "op": "conv2d", "inputs": ["x"],
                        "attrs": {"filters": 4, "kernel": [3, 3], "padding": [1, 1, 1, 1], "groups": 4}}],
    "lrn": [{"id": "l", "op": "lrn", "inputs": ["x"], "attrs": {"size": 3, "alpha": 0.5, "beta": 0.75, "bias": 2.0}}],
    "avg_pool_real_taps": [{"id": "p", "op": "avg_pool", "inputs": ["x"],
                            "attrs": {"kernel": [3, 3], "strides": [2, 1], "padding": [1, 1, 0, 1]}}],
    "avg_pool_all_taps": [{"id": "p", "op": "avg_pool", "inputs": ["x"],
                           "attrs": {"kernel": [2, 2], "strides": [1, 1], "padding": [1, 0, 1, 0],
                                     "count_padding": True}}],
    "consts": [{"id": "m", "op": "mul_const", "inputs": ["x"]},
               {"id": "a", "op": "add_const", "inputs": ["m"], "attrs": {"per_channel": False}}],
    "shuffle": [{"id": "c", "op": "conv2d", "inputs": ["x"], "attrs": {"filters": 6, "kernel": [1, 1]}},
                {"id": "s", "op": "channel_shuffle", "inputs": ["c"], "attrs": {"groups": 3}}],
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
def test_reference_gradients_of_the_image_ops(case):
    graph = Graph.from_dict({"schema_version": 2, "nodes": [
        {"id": "x", "op": "input", "attrs": {"shape": [5, 5, 4]}}] + IMAGE_CASES[case]})
    x = np.random.default_rng(2).normal(0, 1, (2, 5, 5, 4))
    _check_gradients(graph, x, _random_weights(graph))


def test_reference_gradients_of_a_small_gpt():
    graph = gpt(2, 8, 2, 5, 7)
    tokens = np.random.default_rng(3).integers(0, 7, (2, 5))
    _check_gradients(graph, tokens, _random_weights(graph))


def test_causal_attention_ignores_the_future():
    graph = gpt(1, 8, 2, 6, 11)
    weights = _random_weights(graph)
    tokens = np.random.default_rng(4).integers(0, 11, (1, 6))
    changed = tokens.copy()
    changed[0, 4:] = (changed[0, 4:] + 1) % 11
    a, b = forward(graph, weights, tokens), forward(graph, weights, changed)
    np.testing.assert_allclose(a[0, :4], b[0, :4], rtol=1e-12)
    assert not np.allclose(a[0, 4:], b[0, 4:])


def test_channel_shuffle_is_shufflenets_transpose():
    graph = Graph.from_dict({"schema_version": 2, "nodes": [
        {"id": "x", "op": "input", "attrs": {"shape": [1, 1, 6]}},
        {"id": "s", "op": "channel_shuffle", "inputs": ["x"], "attrs": {"groups": 2}}]})
    x = np.arange(6, dtype=np.float64).reshape(1, 1, 1, 6)
    assert forward(graph, {}, x).reshape(-1).tolist() == [0, 3, 1, 4, 2, 5]


def test_the_loss_is_the_mean_over_tokens_and_refuses_bad_labels():
    graph = gpt(1, 8, 2, 5, 7)
    weights = _random_weights(graph)
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 7, (3, 5))
    labels = rng.integers(0, 7, (3, 5))
    loss, _, _ = loss_and_grads(graph, weights, tokens, labels)
    p = forward(graph, weights, tokens)
    assert loss == pytest.approx(-np.mean(np.log(np.take_along_axis(p, labels[..., None], -1))), rel=1e-10)
    with pytest.raises(GraphError, match="per position"):
        loss_and_grads(graph, weights, tokens, labels[:, 0])
    with pytest.raises(GraphError, match="token ids must lie"):
        forward(graph, weights, tokens + 7)
    with pytest.raises(GraphError, match="integers"):
        forward(graph, weights, tokens.astype(np.float32))
