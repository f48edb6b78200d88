"""Transformer morphs on Llama graphs (builders.llama: RMS norm, rotary, grouped-query attention, SwiGLU): each
preserves the function on the NumPy reference and changes the count exactly; the shapes each makes; refusals
that name the node; candidates, chains and the CLI on a Llama seed; the architecture codes of the new kinds."""

import numpy as np
import pytest

from aiperf_core.builders import gpt, llama
from aiperf_core.cli import main
from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, Node, kv_heads, load_graph
from aiperf_core.morph import transformer as T
from aiperf_core.search.arch import (ATTENTION, DENSE, GQA_ATTENTION, MOE, SWIGLU_MOE, distance_matrix,
                                     encode)
from aiperf_core.weights import init_weights, load_weights
from aiperf_core.workloads.lm import seed_graph

import test_transformer_morph as gpt_morph
from test_transformer_morph import (assert_cli_refuses, assert_computes_as, assert_copied_units_part_under_training,
                                    assert_delta, assert_morph_case, assert_new_block_learns, next_token_gradients,
                                    replayed, trained_weights)

SIZES = dict(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=12, vocab=40, ffn=48)


def family(**sizes):
    graph = llama(**{**SIZES, **sizes})
    return graph, trained_weights(graph)


@pytest.fixture(scope="module")
def parent():
    return family()


def assert_same_function(parent_graph, parent_weights, child):
    """As for a GPT's morphs, and the child's graph reads back from its JSON as itself."""
    gpt_morph.assert_same_function(parent_graph, parent_weights, child)
    assert Graph.from_json(child.graph.to_json()).signature() == child.graph.signature()


CASES = [
    ("deeper", {"after": "embed", "seed": 1}),  # a Llama has no position table: the stream starts at the embedding
    ("deeper", {"after": "h0_res2", "seed": 2}),
    ("deeper", {"after": "h1_res1", "seed": 3}),  # between a block's attention and its MLP
    ("wider_mlp", {"fc1": "h0_gate", "seed": 4}),
    ("wider_mlp", {"fc1": "h1_gate", "units": 3, "seed": 5}),
    ("more_heads", {"attention": "h1_attn", "seed": 6}),
    ("double_width", {"seed": 7}),
    ("upcycle_moe", {"fc1": "h1_gate", "seed": 8}),
    ("upcycle_moe", {"fc1": "h0_gate", "experts": 3, "top_k": 1, "seed": 9}),
]


@pytest.mark.parametrize("op,args", CASES)
def test_each_morph_preserves_function_and_counts_its_change_exactly(parent, op, args):
    child = assert_morph_case(*parent, op, args)
    assert Graph.from_json(child.graph.to_json()).signature() == child.graph.signature()


@pytest.mark.parametrize("kv", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("op,args", [("more_heads", {"attention": "h0_attn", "seed": 1}), ("double_width", {"seed": 2}),
                                     ("deeper", {"after": "h0_res2", "seed": 3})])
def test_the_attention_morphs_at_every_key_value_grouping(op, args, kv):
    graph, weights = family(kv_heads=kv, layers=1)
    child = replayed(graph, weights, op, args)
    assert_same_function(graph, weights, child)
    assert_delta(graph, child)


def test_deeper_inserts_a_llama_block_in_its_neighbours_form(parent):
    graph, weights = parent
    child = T.deeper(graph, weights, "h0_res2", seed=1)
    p = child.record["args"]["prefix"]
    g = child.graph
    assert len(g) == len(graph) + len(T.LLAMA_BLOCK_SUFFIXES)
    assert [g[f"{p}_{s}"].op for s in T.LLAMA_BLOCK_SUFFIXES] == [
        "rms_norm", "dense", "dense", "dense", "rotary", "rotary", "attention", "dense", "add", "rms_norm", "dense",
        "dense", "silu", "mul", "dense", "add"]
    assert g[f"{p}_attn"].attrs == graph["h1_attn"].attrs == {"heads": 4, "head_dim": 8, "causal": True, "kv_heads": 2}
    assert g[f"{p}_attn"].inputs == (f"{p}_q_rope", f"{p}_k_rope", f"{p}_v")
    assert g[f"{p}_q_rope"].attrs == g[f"{p}_k_rope"].attrs == graph["h1_q_rope"].attrs
    assert [g[f"{p}_{s}"].attrs["units"] for s in ("q", "k", "v", "proj", "gate", "up", "down")] == [32, 16, 16, 32,
                                                                                                      48, 48, 32]
    assert not any(n.attrs.get("use_bias") for n in g.nodes if n.op == "dense")
    assert g[f"{p}_norm1"].attrs == g[f"{p}_norm2"].attrs == {"epsilon": 1e-5}
    assert g["h1_norm1"].inputs == (f"{p}_res2",) and g["h1_res1"].inputs[0] == f"{p}_res2"
    for zero in ("proj", "down"):
        assert not np.any(child.weights[f"{p}_{zero}"]["kernel"])
    for drawn in ("q", "k", "v", "gate", "up"):
        assert np.any(child.weights[f"{p}_{drawn}"]["kernel"])
    np.testing.assert_array_equal(child.weights[f"{p}_norm1"]["gamma"], np.ones(32))


def test_deeper_without_an_mlp_left_takes_llamas_width():
    """Every MLP upcycled: the new block's SwiGLU takes builders.llama_ffn of the stream's width."""
    graph, weights = family(layers=1)
    moe = T.upcycle_moe(graph, weights, "h0_gate", seed=1)
    child = T.deeper(moe.graph, moe.weights, "h0_res2", seed=2)
    assert child.graph[child.record["args"]["prefix"] + "_gate"].attrs["units"] == 128
    assert_same_function(graph, weights, child)
    assert_delta(moe.graph, child)


def test_wider_mlp_copies_gate_and_up_together_and_splits_down(parent):
    graph, weights = parent
    child = T.wider_mlp(graph, weights, "h0_gate", units=5, seed=2)
    assert child.graph["h0_gate"].attrs["units"] == child.graph["h0_up"].attrs["units"] == 53
    gate, up = child.weights["h0_gate"]["kernel"], child.weights["h0_up"]["kernel"]
    down = child.weights["h0_down"]["kernel"]
    total = down[:48].copy()
    for new in range(48, 53):
        source = next(j for j in range(48) if np.array_equal(gate[:, j], gate[:, new]))
        np.testing.assert_array_equal(up[:, new], up[:, source])  # the same unit in both projections
        total[source] += down[new]
    np.testing.assert_allclose(total, weights["h0_down"]["kernel"], rtol=1e-12)  # each unit's shares sum to 1


def test_wider_mlp_copies_do_not_stay_copies_under_training(parent):
    graph, weights = parent
    child = T.wider_mlp(graph, weights, "h0_gate", units=4, seed=7)
    assert_copied_units_part_under_training(graph, child, ("h0_gate", "h0_up"))


def test_more_heads_adds_a_whole_key_value_group(parent):
    graph, weights = parent
    child = T.more_heads(graph, weights, "h0_attn", seed=3)
    g = child.graph
    assert g["h0_attn"].attrs == {"heads": 6, "head_dim": 8, "causal": True, "kv_heads": 3}
    assert [g[p].attrs["units"] for p in ("h0_q", "h0_k", "h0_v")] == [48, 24, 24]
    assert g.shapes["h0_q_rope"] == (12, 48) and g["h0_q_rope"].attrs == graph["h0_q_rope"].attrs
    for p in ("h0_q", "h0_k", "h0_v"):  # the old heads' columns stay, the new ones are drawn
        old = graph.shapes[p][-1]
        np.testing.assert_array_equal(child.weights[p]["kernel"][:, :old], weights[p]["kernel"])
        assert np.any(child.weights[p]["kernel"][:, old:])
    assert not np.any(child.weights["h0_proj"]["kernel"][32:])
    mqa, mqa_weights = family(kv_heads=1, layers=1)
    doubled = T.more_heads(mqa, mqa_weights, "h0_attn", seed=1).graph["h0_attn"].attrs
    assert doubled["heads"] == 8 and kv_heads(doubled) == 2  # multi-query's one group is every head
    mha, mha_weights = family(kv_heads=4, layers=1)
    assert T.more_heads(mha, mha_weights, "h0_attn", seed=1).graph["h0_attn"].attrs == {
        "heads": 5, "head_dim": 8, "causal": True}


def test_double_width_doubles_key_value_heads_and_rms_norms(parent):
    graph, weights = parent
    child = T.double_width(graph, weights, seed=4)
    g = child.graph
    assert g["h0_attn"].attrs == {"heads": 8, "head_dim": 8, "causal": True, "kv_heads": 4}
    assert g["h0_q_rope"].attrs == graph["h0_q_rope"].attrs and g.shapes["h0_k_rope"] == (12, 32)
    assert g.shapes["h1_res2"] == (12, 64) and g.shapes["lm_head"] == (12, 40) and g["h0_gate"].attrs["units"] == 96
    for norm in ("h0_norm1", "h1_norm2", "norm_f"):
        np.testing.assert_array_equal(child.weights[norm]["gamma"], np.tile(weights[norm]["gamma"], 2))


def test_upcycle_moe_makes_swiglu_experts(parent):
    graph, weights = parent
    child = T.upcycle_moe(graph, weights, "h0_gate", seed=5)
    moe = child.record["args"]["prefix"] + "_moe"
    assert child.graph[moe].attrs == {"experts": 4, "top_k": 2, "units": 48, "mlp": "swiglu"}
    assert not any(f"h0_{s}" in child.graph for s in ("gate", "up", "silu", "glu", "down"))
    assert child.graph["h0_res2"].inputs == ("h0_res1", moe) and child.graph[moe].inputs == ("h0_norm2",)
    for e in range(4):
        for name, node in (("w_gate", "h0_gate"), ("w_in", "h0_up"), ("w_out", "h0_down")):
            np.testing.assert_array_equal(child.weights[moe][name][e], weights[node]["kernel"])
    assert set(child.weights[moe]) == {"router", "w_gate", "w_in", "w_out"}
    wide = T.double_width(child.graph, child.weights, seed=6)
    assert wide.graph[moe].attrs["units"] == 96
    assert_same_function(graph, weights, wide)
    assert_delta(child.graph, wide)
    grads = next_token_gradients(graph, child)
    w_gate = grads[moe]["w_gate"]  # identical experts part: the router sends them different tokens and gates
    assert np.abs(w_gate).max() > 0 and not np.allclose(w_gate[0], w_gate[1], rtol=1e-3)


def test_the_new_block_learns_from_its_first_step(parent):
    graph, weights = parent
    assert_new_block_learns(graph, T.deeper(graph, weights, "embed", seed=1), ("proj", "down"))


def with_biased_mlp(graph):
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, "use_bias": True}) if n.id == "h0_up" else n for n in graph.nodes]
    return Graph(nodes, name="biased")


def test_refusals_name_the_node(parent):
    graph, weights = parent
    with pytest.raises(GraphError, match="'fc1' is a SwiGLU MLP's up projection; name its gate 'h0_gate'") as info:
        T.wider_mlp(graph, weights, "h0_up")
    assert info.value.node == "h0_up"
    with pytest.raises(GraphError, match="'fc1' must open an MLP") as info:
        T.upcycle_moe(graph, weights, "h0_down")
    assert info.value.node == "h0_down"
    with pytest.raises(GraphError, match="'after' must be an add or position_embedding node") as info:
        T.deeper(graph, weights, "h0_norm1")
    assert info.value.node == "h0_norm1"
    biased = with_biased_mlp(graph)
    with pytest.raises(GraphError, match="a SwiGLU MLP's gate, up and down must have no biases") as info:
        T.upcycle_moe(biased, None, "h0_gate")
    assert info.value.node == "h0_gate"
    assert "h0_gate" not in T._targets(biased, T._Index(biased), ("upcycle_moe",))["upcycle_moe"]
    # a GPT's embedding feeds its positions: the stream starts there, not at the embedding
    with pytest.raises(GraphError, match="'after' must be an add or position_embedding node"):
        T.deeper(gpt(layers=1, hidden=8, heads=2, seq_len=4, vocab=10), None, "embed")


def test_targets_on_a_llama(parent):
    graph, _ = parent
    assert T.residual_points(graph) == ["embed", "h0_res1", "h0_res2", "h1_res1", "h1_res2"]
    assert T.mlp_inputs(graph) == ["h0_gate", "h1_gate"]
    assert T.growable_attention(graph) == ["h0_attn", "h1_attn"] and T.doublable(graph)


def test_candidates_and_a_chain_on_the_workloads_llama_seed():
    graph = seed_graph("llama_tiny", 12, 40)
    weights = trained_weights(graph)
    candidates = T.generate_candidates(graph, weights, 6, seed=3)
    assert {c.record["op"] for c in candidates} == set(T.OPERATORS)
    assert len({c.graph.signature() for c in candidates}) == len(candidates) == 6
    for child in candidates:
        assert_same_function(graph, weights, child)
        assert_delta(graph, child)
    grown, grown_weights = graph, weights
    for step in range(10):
        child = T.random_morph(grown, grown_weights, np.random.default_rng(step),
                               ops=(T.OPERATORS[step % len(T.OPERATORS)],))
        assert_delta(grown, child)
        grown, grown_weights = child.graph, child.weights
    assert [h["op"] for h in grown.history] == [T.OPERATORS[s % 5] for s in range(10)]
    assert_computes_as(graph, weights, grown, grown_weights)


def test_arch_codes_of_the_new_kinds(parent):
    graph, weights = parent
    code = encode(graph)
    # Per block: q, k, v, attention, o projection, gate, up, down (norms, rotary, silu and mul are no rows).
    assert code.layers[:8].tolist() == [[DENSE, 32, 1], [DENSE, 16, 1], [DENSE, 16, 1], [GQA_ATTENTION, 32, 4],
                                        [DENSE, 32, 1], [DENSE, 48, 1], [DENSE, 48, 1], [DENSE, 32, 1]]
    assert len(code.layers) == 17 and len(code.skips) == 4
    assert encode(llama(**{**SIZES, "kv_heads": 4})).layers[3, 0] == ATTENTION  # multi-head: a GPT's kind
    moe = T.upcycle_moe(graph, weights, "h0_gate", seed=1).graph
    assert SWIGLU_MOE in encode(moe).layers[:, 0] and MOE not in encode(moe).layers[:, 0]
    children = {op: T.random_morph(graph, None, np.random.default_rng(1), ops=(op,)).graph for op in T.OPERATORS}
    moved = {op: float(distance_matrix([code], [encode(child)])[0, 0]) for op, child in children.items()}
    assert all(value > 0 for value in moved.values()), moved
    assert moved["deeper"] > moved["double_width"] > max(moved["more_heads"], moved["wider_mlp"]), moved
    assert moved["more_heads"] < 2 and moved["wider_mlp"] < 1, moved


LLAMA_ARGS = ["llama", "--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "12",
              "--vocab", "40", "--ffn", "48"]


def test_cli_grows_a_llama_and_the_child_computes_what_its_parent_did(tmp_path, capsys):
    assert main(["morph", *LLAMA_ARGS, "--steps", "5", "--seed", "4", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("llama: ") and sum(line.startswith("step ") for line in out) == 5
    graph = load_graph(tmp_path / "out" / "graph.json")
    weights = load_weights(tmp_path / "out" / "weights.npz", graph)
    parent = llama(**SIZES)
    assert_computes_as(parent, init_weights(parent, 4), graph, weights, rtol=1e-4, atol=1e-5)
    for op, node in (("wider_mlp", "h0_gate"), ("upcycle_moe", "h1_gate"), ("more_heads", "h1_attn"),
                     ("deeper", "embed")):
        assert main(["morph", *LLAMA_ARGS, "--op", op, "--node", node, "--out", str(tmp_path / op)]) == 0
        assert f"step 1: {op} " in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--op", "wider_mlp", "--node", "h0_up"], "node 'h0_up': wider_mlp: 'fc1' is a SwiGLU MLP's up projection; "
                                               "name its gate 'h0_gate'"),
    (["--op", "deeper", "--node", "h0_norm1"], "node 'h0_norm1': deeper: 'after' must be an add or position_embedding"),
    (["--op", "more_heads", "--node", "h0_q_rope"], "node 'h0_q_rope': more_heads: 'attention' must be an attention"),
])
def test_cli_errors_on_a_llama_are_one_line_with_status_2(tmp_path, capsys, argv, message):
    assert_cli_refuses([*LLAMA_ARGS, *argv], tmp_path / "out", capsys, message)
