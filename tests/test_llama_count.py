"""The Llama family in the IR (issue 41): the builder's shape checks, the new ops' refusals naming the node,
schema 4, and the count against the standard Llama formula and against torch's FlopCounterMode on a Llama
written independently in plain torch (tests/torch_transformers.py)."""

from __future__ import annotations

import json

import pytest

from aiperf_core.builders import build, gpt, llama, llama_ffn
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import Graph, Node, kv_heads
from aiperf_opcount import count

# Llama 3 8B's shape, and two small ones (multi-head, and multi-query attention).
SIZES = [dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq_len=8192, vocab=128256),
         dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn=160, seq_len=32, vocab=97),
         dict(layers=3, hidden=48, heads=6, kv_heads=1, ffn=128, seq_len=17, vocab=50)]


def standard_formula(layers, hidden, heads, kv_heads, ffn, seq_len, vocab):
    """FP on the matrix products per sequence (docs/counting.md, "Llama-style transformers")."""
    d = hidden // heads
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_heads * d + 3 * hidden * ffn
    return 2 * seq_len * (layers * per_layer + hidden * vocab) + 4 * seq_len ** 2 * hidden * layers


@pytest.mark.parametrize("sizes", SIZES, ids=["llama3_8b", "mha", "mqa"])
def test_llama_count_equals_the_standard_formula_on_the_matrix_products(sizes):
    cats = count(llama(**sizes)).by_category()
    want = standard_formula(**sizes)
    assert cats["dense"]["fp"] + cats["attention"]["fp"] == want
    # No product reads the data (the embedding comes first): BP is twice FP on them.
    assert cats["dense"]["bp"] + cats["attention"]["bp"] == 2 * want
    assert cats["attention"]["fp"] == 4 * sizes["seq_len"] ** 2 * sizes["hidden"] * sizes["layers"]


def test_llama3_8b_parameters_are_llama3_8bs():
    graph = llama(**SIZES[0])
    assert graph.num_params() == 8_030_261_248  # Meta's published count for Llama 3 8B


def test_llama_graph_is_schema_4_and_round_trips():
    graph = llama(layers=1, hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=20)
    assert graph.schema_version() == 4
    again = Graph.from_json(graph.to_json())
    assert again.signature() == graph.signature()
    assert kv_heads(graph["h0_attn"].attrs) == 2
    # A GPT stays at schema 3's form or older: no kv_heads or mlp written.
    text = gpt(layers=1, hidden=32, heads=4, seq_len=8, vocab=20).to_json()
    assert '"kv_heads"' not in text and json.loads(text)["schema_version"] == 2


def test_llama_ffn_default_is_eight_thirds_rounded_up_to_64():
    # Llama 2 7B's 11008 is the same rule at a multiple of 256.
    assert llama_ffn(4096) == 10944 and llama_ffn(768) == 2048 and llama_ffn(128) == 384
    assert llama(layers=1, hidden=128, heads=4, seq_len=4, vocab=10)["h0_gate"].attrs["units"] == 384


@pytest.mark.parametrize("kwargs,message", [
    (dict(heads=4, kv_heads=3), r"kv_heads \(3\) must divide heads \(4\)"),
    (dict(hidden=36, heads=4), r"head width hidden / heads \(9\) must be even for rotary"),
    (dict(layers=0), "layers must be an integer >= 1"),
])
def test_llama_builder_refuses_bad_sizes_in_one_line(kwargs, message):
    sizes = dict(layers=1, hidden=32, heads=4, seq_len=8, vocab=20) | kwargs
    with pytest.raises(AiperfError, match=message):
        llama(**sizes)


def test_llama_builder_takes_any_even_head_width():
    """Rotary needs an even head width, not a power of two: 30 over 5 heads is 6 each."""
    graph = llama(layers=1, hidden=30, heads=5, seq_len=8, vocab=20)
    assert graph["h0_q_rope"].attrs["head_dim"] == 6 and graph["h0_attn"].attrs["heads"] == 5


def test_gpt_builder_refuses_kv_heads_by_name():
    with pytest.raises(AiperfError, match="--kv-heads applies to the llama builder only"):
        build("gpt", kv_heads=2)


def _seq(*nodes):
    return Graph([Node("x", "input", (), {"shape": [5, 8]}), *nodes])


@pytest.mark.parametrize("node,message", [
    (Node("r", "rotary", ("x",), {"head_dim": 3}), "must be even"),
    (Node("r", "rotary", ("x",), {"head_dim": 6}), "not a whole number of heads"),
    (Node("r", "rotary", ("x",), {"head_dim": 4, "base": 0.5}), "'base' must be in"),
    (Node("r", "rotary", ("x",), {"head_dim": 4, "scale": 2}), "unknown attribute 'scale'"),
    (Node("m", "moe", ("x",), {"experts": 2, "top_k": 1, "units": 4, "mlp": "relu"}), "'mlp' must be one of"),
])
def test_new_ops_refuse_bad_attributes_naming_the_node(node, message):
    with pytest.raises(GraphError, match=message) as caught:
        _seq(node)
    assert node.id in str(caught.value)


def test_attention_refuses_kv_heads_that_do_not_divide_or_fit():
    q = Node("q", "dense", ("x",), {"units": 8})
    k, v = Node("k", "dense", ("x",), {"units": 4}), Node("v", "dense", ("x",), {"units": 4})
    with pytest.raises(GraphError, match=r"'kv_heads' \(3\) must divide 'heads' \(4\)"):
        _seq(q, k, v, Node("a", "attention", ("q", "k", "v"), {"heads": 4, "head_dim": 2, "kv_heads": 3}))
    with pytest.raises(GraphError, match=r"key must be \(S, kv_heads \* head_dim = 2\)"):
        _seq(q, k, v, Node("a", "attention", ("q", "k", "v"), {"heads": 4, "head_dim": 2, "kv_heads": 1}))
    # kv_heads equal to heads is multi-head attention, written as schema 3 wrote it.
    k8, v8 = Node("k", "dense", ("x",), {"units": 8}), Node("v", "dense", ("x",), {"units": 8})
    graph = _seq(q, k8, v8, Node("a", "attention", ("q", "k", "v"), {"heads": 4, "head_dim": 2, "kv_heads": 4}))
    assert "kv_heads" not in graph["a"].attrs and graph.schema_version() == 2


def test_mul_refuses_mismatched_shapes():
    with pytest.raises(GraphError, match="mul inputs have mismatched shapes"):
        _seq(Node("a", "dense", ("x",), {"units": 3}), Node("m", "mul", ("x", "a"), {}))


def test_cli_counts_a_llama(capsys):
    from aiperf_core.cli import main

    assert main(["count", "llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                 "--seq-len", "16", "--vocab", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = standard_formula(layers=2, hidden=64, heads=4, kv_heads=2, ffn=llama_ffn(64), seq_len=16, vocab=50)
    assert out["by_category"]["dense"]["fp"] + out["by_category"]["attention"]["fp"] == want


def test_llama_blocks_are_whole_transformer_blocks():
    """Activation checkpointing's stretches (Graph.blocks) start at the embedding when positions are
    rotary: one attention and one MLP sub-layer each, as a GPT's."""
    graph = llama(layers=3, hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=20)
    assert [(b.input, b.output) for b in graph.blocks()] == [("embed", "h0_res2"), ("h0_res2", "h1_res2"),
                                                             ("h1_res2", "h2_res2")]


# Three sizes: multi-head through SDPA, grouped-query written out by hand, multi-query through SDPA.
TORCH_SIZES = [dict(layers=2, hidden=64, heads=4, kv_heads=4, ffn=176, seq_len=32, vocab=97, sdpa=True),
               dict(layers=2, hidden=96, heads=8, kv_heads=2, ffn=256, seq_len=24, vocab=64, sdpa=False),
               dict(layers=3, hidden=48, heads=6, kv_heads=1, ffn=128, seq_len=17, vocab=50, sdpa=True)]


@pytest.mark.parametrize("sizes", TORCH_SIZES, ids=["mha_sdpa", "gqa_by_hand", "mqa_sdpa"])
def test_llama_dense_and_attention_fp_equal_flopcountermode_on_a_plain_torch_llama(sizes):
    """Item 2: the builder's count on the matrix products equals what torch's FlopCounterMode books for a
    Llama written independently in plain torch (tests/torch_transformers.py), per sequence."""
    import torch
    from torch_transformers import Llama, forward_flops

    sizes = dict(sizes)
    sdpa = sizes.pop("sdpa")
    module = Llama(**sizes, sdpa=sdpa)
    tokens = torch.randint(0, sizes["vocab"], (2, sizes["seq_len"]))
    native = forward_flops(module, tokens)
    cats = count(llama(**sizes)).by_category()
    assert native == {"dense": cats["dense"]["fp"], "attention": cats["attention"]["fp"]}
    assert native["dense"] + native["attention"] == standard_formula(**sizes)
