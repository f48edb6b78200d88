"""ONNX for the transformers of 2026 (issue 41).

aiperf's own export and import of the Llama family's ops: rms_norm, rotary, silu, mul and grouped-query
attention are written as ONNX's RMSNormalization, RotaryEmbedding, Sigmoid times its input, Mul and
Attention (kv_num_heads), a builders.llama graph reads back to the identical graph, weights and count,
and runs in onnxruntime and onnx.reference as the NumPy reference does; what the IR cannot express is
refused in one line naming the ONNX node and op.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from aiperf_conformance.cases import trained_looking_weights
from aiperf_core.builders import llama
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import Graph, Node
from aiperf_core.onnx_import import rotary_base, rotary_tables
from aiperf_core.onnx_io import export_onnx, import_onnx
from aiperf_numpy.executor import forward
from aiperf_opcount import count

LLAMA = dict(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=8, vocab=50, ffn=48)


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def same_weights(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(np.array_equal(a[k][p], b[k][p]) for p in a[k]) for k in a)


def llama_weights(graph: Graph, seed: int = 0) -> dict:
    """Trained-looking weights with an embedding of unit scale, so that every block moves the logits."""
    weights = trained_looking_weights(graph, seed)
    for params in weights.values():
        if "table" in params:
            params["table"] = params["table"] * np.float32(50.0)
    return weights


def run_ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


# -- aiperf's own export of the Llama family -----------------------------------------------------------


@pytest.mark.parametrize("kv_heads, rope_base", [(4, 10000.0), (2, 500000.0), (1, 100.0)])
def test_llama_exports_with_onnx_ops_and_reads_back_identically(tmp_path, kv_heads, rope_base):
    graph = llama(**{**LLAMA, "kv_heads": kv_heads}, rope_base=rope_base)
    weights = llama_weights(graph)
    path = tmp_path / "llama.onnx"
    model = export_onnx(graph, weights, path=path)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    assert [o.version for o in model.opset_import] == [23]
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["RMSNormalization"] == 5 and ops["RotaryEmbedding"] == 4 and ops["Attention"] == 2
    assert ops["Sigmoid"] == 2 and ops["Mul"] == 4 and ops["MatMul"] == 2 * 7 + 1
    attention = next(n for n in model.graph.node if n.op_type == "Attention")
    assert _attrs(attention) == {"is_causal": 1, "q_num_heads": 4, "kv_num_heads": kv_heads}
    rotary = next(n for n in model.graph.node if n.op_type == "RotaryEmbedding")
    assert _attrs(rotary) == {"num_heads": 4}

    back, back_weights = import_onnx(path)
    assert back == graph
    assert same_weights(back_weights, weights)
    for convention in ("paper", "valid"):
        assert count(back, convention).to_dict() == count(graph, convention).to_dict()


def test_exported_llama_runs_in_onnxruntime_and_the_onnx_reference_as_the_numpy_reference_does():
    graph = llama(**LLAMA, rope_base=500000.0)
    weights = llama_weights(graph, seed=3)
    tokens = np.random.default_rng(4).integers(0, LLAMA["vocab"], (3, LLAMA["seq_len"])).astype(np.int64)
    logits = Graph(graph.nodes[:-1], name=graph.name)  # unsquashed, so that any difference shows
    expected = forward(logits, weights, tokens, dtype=np.float32)
    assert np.abs(expected).max() > 1.0
    model = export_onnx(logits, {k: v for k, v in weights.items() if k in logits})
    np.testing.assert_allclose(ReferenceEvaluator(model).run(None, {"input": tokens})[0], expected,
                               rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    np.testing.assert_allclose(run_ort(model, {"input": tokens}), expected, rtol=1e-4,
                               atol=1e-5 * np.abs(expected).max())

    # The check can fail: the same model with another rotary base, or without the causal mask, is far off.
    for op_type, name, value in (("RotaryEmbedding", "interleaved", 1), ("Attention", "is_causal", 0)):
        changed = export_onnx(logits, {k: v for k, v in weights.items() if k in logits})
        for node in changed.graph.node:
            if node.op_type == op_type:
                _set_node(node, **{name: value})
        assert np.abs(run_ort(changed, {"input": tokens}) - expected).max() > 1e-3


def test_silu_and_mul_export_at_the_default_opset_and_read_back():
    nodes = [Node("x", "input", (), {"shape": [5, 6]}),
             Node("gate", "dense", ("x",), {"units": 4, "use_bias": False}),
             Node("up", "dense", ("x",), {"units": 4, "use_bias": False}),
             Node("act", "silu", ("gate",), {}),
             Node("glu", "mul", ("act", "up"), {}),
             Node("down", "dense", ("glu",), {"units": 3})]
    graph = Graph(nodes, name="swiglu")
    weights = trained_looking_weights(graph, 0)
    model = export_onnx(graph, weights)
    assert [o.version for o in model.opset_import] == [17]
    assert [n.op_type for n in model.graph.node] == ["MatMul", "MatMul", "Sigmoid", "Mul", "Mul", "MatMul", "Add"]
    back, back_weights = import_onnx(model)
    assert back == graph and same_weights(back_weights, weights)
    x = np.random.default_rng(1).standard_normal((2, 5, 6)).astype(np.float32)
    np.testing.assert_allclose(run_ort(model, {"input": x}), forward(graph, weights, x), rtol=1e-5, atol=1e-6)


def test_swish_of_opset_24_reads_as_silu():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6])
    model = helper.make_model(helper.make_graph([helper.make_node("Swish", ["x"], ["y"], name="act")], "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 24)])
    graph, _ = import_onnx(model)
    assert [n.op for n in graph.nodes] == ["input", "silu"]


@pytest.mark.parametrize("head_dim, base", [(8, 10000.0), (16, 500000.0), (4, 100.0), (64, 1e6), (2, 10000.0)])
def test_rotary_base_reads_back_from_its_tables(head_dim, base):
    cos, sin = rotary_tables(12, head_dim, base)
    assert rotary_base(cos, sin, head_dim) == base
    # Tables computed in float32, as a framework's model computes them, read the same.
    inv_freq = (1.0 / np.float32(base) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    theta = np.arange(12, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)
    assert rotary_base(np.cos(theta), np.sin(theta), head_dim) == base
    # Scaled positions (as Llama 3's rope scaling writes) are no base's.
    if head_dim > 2:
        assert rotary_base(np.cos(theta * 0.5), np.sin(theta * 0.5), head_dim) is None


def test_export_refuses_an_opset_without_rms_norm_and_rotary():
    with pytest.raises(AiperfError, match=r"op 'rms_norm' \(node 'h0_norm1'\) needs opset 23 or newer, got 22"):
        export_onnx(llama(**LLAMA), opset=22)


def _edited(change):
    """The small Llama's export with `change(model)` applied; the first node `change` returns is named."""
    model = export_onnx(llama(**LLAMA, rope_base=10000.0))
    return model, change(model)


def _set(model, op_type, **attrs):
    """Set attributes of the first `op_type` node; return it."""
    return _set_node(next(n for n in model.graph.node if n.op_type == op_type), **attrs)


def _set_node(node, **attrs):
    kept = [a for a in node.attribute if a.name not in attrs]
    del node.attribute[:]
    node.attribute.extend([*kept, *(helper.make_attribute(k, v) for k, v in attrs.items())])
    return node


def _replace_initializer(model, node_name, param, value):
    """Replace the initializer `node_name/param` by value(old); return the node `node_name`."""
    init = next(t for t in model.graph.initializer if t.name == f"{node_name}/{param}")
    init.CopyFrom(numpy_helper.from_array(value(numpy_helper.to_array(init)), init.name))
    return next(n for n in model.graph.node if n.name == node_name)


@pytest.mark.parametrize("change, expected", [
    (lambda m: _set(m, "RotaryEmbedding", interleaved=1), "the interleaved form (pairs (2i, 2i + 1)) is not supported"),
    (lambda m: _set(m, "RotaryEmbedding", rotary_embedding_dim=4), "partial rotation (rotary_embedding_dim 4 of "
                                                                  "head_dim 8) is not supported"),
    (lambda m: _set(m, "RotaryEmbedding", num_heads=3), "num_heads 3 does not split the width 32"),
    (lambda m: _replace_initializer(m, "h0_q_rope", "position_ids", lambda v: v + 1),
     "only the positions 0 to 7 of every sequence are supported"),
    (lambda m: _replace_initializer(m, "h0_q_rope", "cos", lambda v: np.cos(np.arccos(v) * 0.5).astype(np.float32)),
     "the cos and sin caches are not the angles position * base^(-2i / head_dim) of any base"),
    (lambda m: _set(m, "RMSNormalization", axis=1), "only an RMS norm over the last axis is supported, got axis 1"),
    (lambda m: _set(m, "Attention", kv_num_heads=3), "only 3-D inputs with kv_num_heads dividing q_num_heads"),
])
def test_a_llama_op_the_ir_cannot_express_is_refused_naming_it(change, expected):
    model, node = _edited(change)
    with pytest.raises(GraphError) as info:
        import_onnx(model)
    assert f"ONNX node '{node.name}' (op {node.op_type}): {expected}" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_sigmoid_alone_is_refused():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6])
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"], name="gate"), helper.make_node("Relu", ["s"], ["y"], name="r")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(GraphError, match=r"ONNX node 'gate' \(op Sigmoid\): unsupported op \(an elementwise function "
                                         r"the IR has no op for; aiperf reads GELU's tanh form, x \* sigmoid\(x\) and a x \+ b\)"):
        import_onnx(model)
