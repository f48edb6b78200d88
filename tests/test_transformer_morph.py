"""Transformer morphs (aiperf_core.morph.transformer): function preserved on the NumPy reference, the count
change exact, replay, errors that name the node, candidates, and the symmetry a morph must not leave."""

import numpy as np
import pytest

from aiperf_core.builders import gpt, resnet_small
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import load_graph
from aiperf_core.ir import Graph, Node
from aiperf_core.morph import transformer as T
from aiperf_core.morph import CapExceeded, MorphCaps
from aiperf_core.weights import load_weights
from aiperf_core.weights import init_weights, validate_weights
from aiperf_opcount import count

import aiperf_numpy  # noqa: E402  (installed by `make test`)

SIZES = dict(layers=2, hidden=32, heads=2, seq_len=12, vocab=40)


def trained_weights(graph, seed=0):
    """Non-trivial biases and norms, as training leaves them: a zero bias or a gain of 1 would hide a wrong copy."""
    rng = np.random.default_rng(seed)
    weights = init_weights(graph, seed, dtype=np.float64)
    for params in weights.values():
        for name, value in params.items():
            if name in ("bias", "beta"):
                params[name] = rng.normal(0.0, 0.2, value.shape)
            elif name == "gamma":
                params[name] = rng.uniform(0.5, 1.5, value.shape)
    return weights


@pytest.fixture(scope="module")
def parent():
    graph = gpt(**SIZES)
    return graph, trained_weights(graph)


def tokens(graph, n=3, seed=5):
    return np.random.default_rng(seed).integers(0, graph.vocab, (n,) + graph.input_shape)


def logits(graph, weights, x):
    trace = aiperf_numpy.run(graph, weights, x, training=False, dtype=np.float64)
    return trace.outputs[graph[graph.output_id].inputs[0]]


def assert_computes_as(parent_graph, parent_weights, graph, weights, rtol=1e-9, atol=1e-9):
    """The logits of (graph, weights) are the parent's on the same tokens; atol is relative to the largest logit."""
    x = tokens(parent_graph)
    want = logits(parent_graph, parent_weights, x)
    np.testing.assert_allclose(logits(graph, weights, x), want, rtol=rtol, atol=atol * np.abs(want).max())


def assert_same_function(parent_graph, parent_weights, child):
    validate_weights(child.graph, child.weights)
    assert_computes_as(parent_graph, parent_weights, child.graph, child.weights)


def assert_delta(parent_graph, child):
    before, after = count(parent_graph), count(child.graph)
    assert (after.fp - before.fp, after.bp - before.bp) == (child.record["delta"]["fp"], child.record["delta"]["bp"])
    assert child.record["delta"]["fp"] > 0


def replayed(graph, weights, op, args):
    return T.replay(graph, weights, {"op": op, "args": args, "parent": T._Index(graph).signature_hash})


def assert_morph_case(graph, weights, op, args):
    """The morph made by replaying (op, args): the parent's function and the count change it records; its record
    is the last of its history and replays to the same graph and weights. Returns the child."""
    child = replayed(graph, weights, op, args)
    assert_same_function(graph, weights, child)
    assert_delta(graph, child)
    assert child.graph.history[-1] == child.record and child.record["op"] == op
    again = T.replay(graph, weights, child.record)
    assert again.graph.signature() == child.graph.signature()
    for node, params in child.weights.items():
        for name, value in params.items():
            np.testing.assert_array_equal(again.weights[node][name], value)
    return child


def next_token_gradients(parent_graph, child):
    """The child's gradients on a batch of the parent's tokens, each labelled with the next one."""
    x = tokens(parent_graph, n=4)
    _, grads, _ = aiperf_numpy.loss_and_grads(child.graph, child.weights, x, np.roll(x, -1, axis=1))
    return grads


def assert_copied_units_part_under_training(parent_graph, child, projections):
    """wider_mlp's new units of projections[0], and their copies in the other projections, get gradients other
    than their source units': an even split would keep a unit and its copy equal forever."""
    grads = next_token_gradients(parent_graph, child)
    kernel = child.weights[projections[0]]["kernel"]
    width = parent_graph[projections[0]].attrs["units"]
    for new in range(width, kernel.shape[1]):
        source = next(j for j in range(width) if np.array_equal(kernel[:, j], kernel[:, new]))
        for node in projections:
            g_new, g_source = grads[node]["kernel"][:, new], grads[node]["kernel"][:, source]
            assert np.abs(g_new).max() > 0 and not np.allclose(g_new, g_source, rtol=1e-3), node


def assert_new_block_learns(parent_graph, child, output_projections):
    """The new block's zero output projections get gradients at once, so the block does not stay dead."""
    grads = next_token_gradients(parent_graph, child)
    prefix = child.record["args"]["prefix"]
    for node in output_projections:
        assert np.abs(grads[f"{prefix}_{node}"]["kernel"]).max() > 0, node


def assert_cli_refuses(argv, out, capsys, message):
    """`aiperf morph` with argv: status 2, one line naming the fault, nothing written to out."""
    assert main(["morph", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aiperf: error: ") and message in err
    assert not out.exists()


CASES = [
    ("deeper", {"after": "h0_res2", "seed": 1}),
    ("deeper", {"after": "positions", "seed": 2}),
    ("deeper", {"after": "h1_res1", "seed": 3}),  # between a block's attention and its MLP
    ("wider_mlp", {"fc1": "h0_fc1", "seed": 4}),
    ("wider_mlp", {"fc1": "h1_fc1", "units": 3, "seed": 5}),
    ("more_heads", {"attention": "h1_attn", "seed": 6}),
    ("double_width", {"seed": 7}),
    ("upcycle_moe", {"fc1": "h1_fc1", "seed": 8}),
    ("upcycle_moe", {"fc1": "h0_fc1", "experts": 3, "top_k": 1, "seed": 9}),
]


@pytest.mark.parametrize("op,args", CASES)
def test_each_morph_preserves_function_and_counts_its_change_exactly(parent, op, args):
    assert_morph_case(*parent, op, args)


def test_the_shapes_each_morph_makes(parent):
    graph, weights = parent
    deeper = T.deeper(graph, weights, "h0_res2", seed=1)
    assert len(deeper.graph) == len(graph) + len(T.BLOCK_SUFFIXES)
    new = deeper.record["args"]["prefix"]
    assert deeper.graph[f"{new}_attn"].attrs == {"heads": 2, "head_dim": 16, "causal": True}
    assert deeper.graph[f"{new}_fc1"].attrs["units"] == 128
    assert deeper.graph["h1_ln1"].inputs == (f"{new}_res2",)  # the next block reads the new one
    for zero in ("proj", "fc2"):
        assert not any(np.any(v) for v in deeper.weights[f"{new}_{zero}"].values())
    assert np.any(deeper.weights[f"{new}_fc1"]["kernel"])

    wider = T.wider_mlp(graph, weights, "h0_fc1", seed=2)
    assert wider.graph["h0_fc1"].attrs["units"] == 128 + 64 and wider.record["args"]["units"] == 64
    heads = T.more_heads(graph, weights, "h0_attn", seed=3)
    assert heads.graph["h0_attn"].attrs["heads"] == 3 and heads.graph["h0_attn"].attrs["head_dim"] == 16
    assert {heads.graph[p].attrs["units"] for p in ("h0_q", "h0_k", "h0_v")} == {48}
    assert not np.any(heads.weights["h0_proj"]["kernel"][32:])
    moe = T.upcycle_moe(graph, weights, "h0_fc1", seed=5)
    new = moe.record["args"]["prefix"] + "_moe"
    assert moe.graph[new].attrs == {"experts": 4, "top_k": 2, "units": 128}
    assert "h0_fc1" not in moe.graph and "h0_fc2" not in moe.graph and moe.graph["h0_res2"].inputs == ("h0_res1", new)
    for e in range(4):  # every expert a copy of the MLP
        np.testing.assert_array_equal(moe.weights[new]["w_out"][e], weights["h0_fc2"]["kernel"])
    assert moe.graph.schema_version() == 3
    double = T.double_width(graph, weights, seed=4)
    assert double.graph.shapes["h1_res2"] == (12, 64) and double.graph.shapes["lm_head"] == (12, 40)
    assert double.graph["h0_attn"].attrs == {"heads": 4, "head_dim": 16, "causal": True}
    assert double.graph["h0_fc1"].attrs["units"] == 256
    np.testing.assert_array_equal(double.weights["embed"]["table"][:, 32:], weights["embed"]["table"])
    kernel = double.weights["h0_q"]["kernel"]  # two copies of each input row, shares summing to the original
    np.testing.assert_allclose(kernel[:32, :32] + kernel[32:, :32], weights["h0_q"]["kernel"], rtol=1e-12)
    assert not np.allclose(kernel[:32, :32], kernel[32:, :32])
    for name, value in weights.items():  # the parent's weights are never modified
        for p, array in value.items():
            np.testing.assert_array_equal(array, parent[1][name][p])


def test_double_width_doubles_a_mixture_of_experts_too(parent):
    graph, weights = parent
    moe = T.upcycle_moe(graph, weights, "h0_fc1", seed=3)
    wide = T.double_width(moe.graph, moe.weights, seed=4)
    node = moe.record["args"]["prefix"] + "_moe"
    assert wide.graph[node].attrs == {"experts": 4, "top_k": 2, "units": 256}
    assert_same_function(graph, weights, wide)
    assert_delta(moe.graph, wide)


def test_a_chain_of_random_morphs_still_computes_the_seed(parent):
    graph, weights = parent
    grown, grown_weights = graph, weights
    ops = []
    for step in range(8):
        op = T.OPERATORS[step % len(T.OPERATORS)]
        child = T.random_morph(grown, grown_weights, np.random.default_rng(step), ops=(op,))
        assert_delta(grown, child)
        grown, grown_weights = child.graph, child.weights
        ops.append(child.record["op"])
    assert [h["op"] for h in grown.history] == ops
    assert_computes_as(graph, weights, grown, grown_weights)
    assert Graph.from_json(grown.to_json()).signature() == grown.signature()


def test_wider_mlp_copies_do_not_stay_copies_under_training(parent):
    """An even split would give a unit and its copy equal gradients forever; the random split does not."""
    graph, weights = parent
    assert_copied_units_part_under_training(graph, T.wider_mlp(graph, weights, "h0_fc1", units=4, seed=7), ("h0_fc1",))


def test_upcycled_experts_part_under_training(parent):
    """Identical experts get different gradients: the router sends them different tokens and gates."""
    graph, weights = parent
    child = T.upcycle_moe(graph, weights, "h0_fc1", seed=2)
    grads = next_token_gradients(graph, child)
    w_in = grads[child.record["args"]["prefix"] + "_moe"]["w_in"]
    assert np.abs(w_in).max() > 0 and not np.allclose(w_in[0], w_in[1], rtol=1e-3)
    assert np.abs(grads[child.record["args"]["prefix"] + "_moe"]["router"]).max() > 0


def test_the_new_block_learns_from_its_first_step(parent):
    graph, weights = parent
    assert_new_block_learns(graph, T.deeper(graph, weights, "h0_res2", seed=1), ("proj", "fc2"))


def test_candidates_are_reproducible_distinct_and_capped(parent):
    graph, _ = parent
    first = T.generate_candidates(graph, None, 6, seed=11)
    again = T.generate_candidates(graph, None, 6, seed=11)
    assert [c.record for c in first] == [c.record for c in again]
    assert len({c.graph.signature() for c in first}) == len(first) == 6
    assert all(c.weights is None for c in first)
    parent_ops = count(graph).total
    caps = MorphCaps(max_ops_per_image=parent_ops + min(c.record["delta"]["fp"] + c.record["delta"]["bp"]
                                                          for c in first))
    capped = T.generate_candidates(graph, None, 6, seed=11, caps=caps)
    assert capped and all(parent_ops + c.record["delta"]["fp"] + c.record["delta"]["bp"]
                          <= caps.max_ops_per_image for c in capped)
    with pytest.raises(CapExceeded, match="max_nodes"):
        T.deeper(graph, None, "h0_res2", caps=MorphCaps(max_nodes=len(graph)))


def test_errors_name_the_node(parent):
    graph, weights = parent
    hash_ = T._Index(graph).signature_hash
    with pytest.raises(GraphError, match="'after' must be an add or position_embedding") as info:
        T.deeper(graph, weights, "h0_fc1")
    assert info.value.node == "h0_fc1"
    with pytest.raises(GraphError, match="must open an MLP"):
        T.wider_mlp(graph, weights, "h0_q")
    with pytest.raises(GraphError, match="units must be a positive integer"):
        T.wider_mlp(graph, weights, "h0_fc1", units=0)
    with pytest.raises(GraphError, match="must be an attention node, this is a dense"):
        T.more_heads(graph, weights, "h0_q")
    with pytest.raises(GraphError, match="seed must be a non-negative integer"):
        T.more_heads(graph, weights, "h0_attn", seed=-1)
    with pytest.raises(GraphError, match="made from another parent"):
        T.replay(gpt(**{**SIZES, "layers": 1}), None, {"op": "deeper", "args": {"after": "h0_res2"}, "parent": hash_})
    with pytest.raises(GraphError, match="unknown argument 'kernel'"):
        T.replay(graph, None, {"op": "deeper", "args": {"after": "h0_res2", "kernel": 3}, "parent": hash_})
    with pytest.raises(GraphError, match="unknown op 'wider'"):
        T.replay(graph, None, {"op": "wider", "args": {}, "parent": hash_})
    with pytest.raises(GraphError, match="top_k \\(3\\) must not exceed experts \\(2\\)"):
        T.upcycle_moe(graph, weights, "h0_fc1", experts=2, top_k=3)
    with pytest.raises(GraphError, match="double_width: a input node has no width rule"):
        T.double_width(resnet_small(), None)
    assert not T.doublable(resnet_small())
    with pytest.raises(AiperfError, match="unknown transformer morph op 'skip'"):
        T.generate_candidates(graph, None, 2, seed=0, ops=("skip",))


def test_more_heads_refuses_a_projection_another_node_reads():
    graph = gpt(layers=1, hidden=8, heads=2, seq_len=4, vocab=10)
    nodes = list(graph.nodes)
    at = next(i for i, n in enumerate(nodes) if n.id == "h0_res1")
    nodes[at] = Node("h0_res1", "add", ("h0_v", "h0_proj"), {})  # v's output read twice
    shared = Graph(nodes, name="shared")
    with pytest.raises(GraphError, match="'h0_v' must be a dense node read by the attention alone"):
        T.more_heads(shared, None, "h0_attn")
    assert "h0_attn" not in T.growable_attention(shared)


GPT_ARGS = ["gpt", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "12", "--vocab", "40"]


def test_cli_grows_a_gpt_and_the_child_computes_what_its_parent_did(tmp_path, capsys):
    assert main(["morph", *GPT_ARGS, "--steps", "5", "--seed", "4", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpt: ") and out[0].endswith("per sequence")
    assert sum(line.startswith("step ") for line in out) == 5 and out[-1].startswith("wrote ")
    graph = load_graph(tmp_path / "out" / "graph.json")
    weights = load_weights(tmp_path / "out" / "weights.npz", graph)
    assert len(graph.history) == 5 and all(h["op"] in T.OPERATORS for h in graph.history)
    parent = gpt(**SIZES)
    assert_computes_as(parent, init_weights(parent, 4), graph, weights, rtol=1e-4, atol=1e-5)
    assert main(["morph", *GPT_ARGS, "--op", "upcycle_moe", "--node", "h1_fc1", "--out", str(tmp_path / "moe")]) == 0
    assert "upcycle_moe fc1=h1_fc1 experts=4 top_k=2" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--op", "wider"], "--op wider is not a morph of a transformer (its morphs: deeper, wider_mlp, more_heads, "
                        "double_width, upcycle_moe)"),
    (["--op", "double_width", "--node", "h0_fc1"], "--op double_width takes no --node"),
    (["--op", "more_heads", "--node", "h0_fc1"], "node 'h0_fc1': more_heads: 'attention' must be an attention node"),
    (["--op", "deeper", "--node", "h0_q"], "node 'h0_q': deeper: 'after' must be an add or position_embedding"),
])
def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys, argv, message):
    assert_cli_refuses([*GPT_ARGS, *argv], tmp_path / "out", capsys, message)
    assert main(["morph", "resnet_small", "--op", "upcycle_moe", "--out", str(tmp_path / "out")]) == 2
    assert "--op upcycle_moe is not a morph of a CNN" in capsys.readouterr().err
