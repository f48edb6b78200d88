"""Graph IR: shape inference, JSON and weights round trips, and rejection of bad graphs by node."""

import json

import numpy as np
import pytest

from aiperf_core.builders import resnet50, resnet_small
from aiperf_core.errors import GraphError
from aiperf_core.ir import SCHEMA_VERSION, Graph, load_graph, save_graph
from aiperf_core.weights import init_weights, load_weights, save_weights, transposed_copy, validate_weights


def nodes_of(g: Graph) -> list[dict]:
    return g.to_dict()["nodes"]


def doc(nodes):
    return {"schema_version": SCHEMA_VERSION, "name": "t", "nodes": nodes}


def small():
    return [
        {"id": "x", "op": "input", "attrs": {"shape": [8, 8, 3]}},
        {"id": "c", "op": "conv2d", "inputs": ["x"], "attrs": {"filters": 4, "kernel": [3, 3], "padding": [1, 1, 1, 1]}},
        {"id": "r", "op": "relu", "inputs": ["c"]},
        {"id": "a", "op": "add", "inputs": ["c", "r"]},
        {"id": "g", "op": "global_avg_pool", "inputs": ["a"]},
        {"id": "d", "op": "dense", "inputs": ["g"], "attrs": {"units": 2}},
    ]


def test_resnet50_keras_layout_shapes():
    g = resnet50()
    assert g.shapes["conv1_conv"] == (112, 112, 64)
    assert g.shapes["pool1"] == (56, 56, 64)
    # The stride of a downsampling bottleneck sits on its first 1x1 conv.
    assert g["conv3_block1_1_conv"].attrs["strides"] == (2, 2)
    assert g["conv3_block1_2_conv"].attrs["strides"] == (1, 1)
    assert g.shapes["conv5_block3_out"] == (7, 7, 2048)
    assert g.output_shape == (1000,)
    assert g.num_params() == 25_557_032
    assert sum(n.op == "batch_norm" for n in g) == 53


@pytest.mark.parametrize("shape,classes", [((32, 32, 3), 10), ((97, 64, 1), 7), ((300, 300, 3), 5)])
def test_resnet50_any_input(shape, classes):
    g = resnet50(shape, classes)
    assert g.input_shape == shape and g.output_shape == (classes,)


def test_resnet50_rejects_tiny_input():
    with pytest.raises(Exception, match="at least 32x32"):
        resnet50((31, 32, 3))


def test_json_round_trip_and_signature():
    for g in (resnet50(), resnet_small()):
        again = Graph.from_json(g.to_json())
        assert again == g and again.shapes == g.shapes
        assert again.signature() == g.signature()


def test_unordered_json_is_sorted_topologically():
    nodes = small()
    g = Graph.from_dict(doc(list(reversed(nodes))))
    assert [n.id for n in g] == [n["id"] for n in nodes]


@pytest.mark.parametrize(
    "mutate,node,pattern",
    [
        (lambda n: n[1].update(op="lstm"), "c", "unknown op"),
        (lambda n: n[2].update(inputs=["zzz"]), "r", "dangling"),
        (lambda n: n[1].update(inputs=["r"]), None, "cycle"),
        (lambda n: n[3].update(inputs=["c", "x"]), "a", "mismatched shapes"),
        (lambda n: n[1]["attrs"].update(filters=0), "c", "filters"),
        (lambda n: n[1]["attrs"].update(kernel=[9, 9], padding=[0, 0, 0, 0]), "c", "does not fit"),
        (lambda n: n[0]["attrs"].update(shape=[8, -1, 3]), "x", "shape"),
        (lambda n: n[1]["attrs"].update(strides=[1]), "c", "strides"),
        (lambda n: n[1]["attrs"].update(bogus=1), "c", "unknown attribute"),
        (lambda n: n.append(dict(n[2], id="r")), "r", "duplicate"),
        (lambda n: n[5].update(inputs=["a"]), "d", "flat input"),
    ],
)
def test_bad_graphs_name_the_node(mutate, node, pattern):
    nodes = small()
    mutate(nodes)
    with pytest.raises(GraphError, match=pattern) as info:
        Graph.from_dict(doc(nodes))
    if node is not None:
        assert info.value.node == node
        assert f"node '{node}'" in str(info.value)
    else:
        assert info.value.node in {"c", "r", "a"}
    assert "\n" not in str(info.value)


def test_concat_mismatch_and_schema_version():
    nodes = small()[:3] + [{"id": "p", "op": "max_pool", "inputs": ["x"], "attrs": {"kernel": [2, 2]}},
                           {"id": "k", "op": "concat", "inputs": ["r", "p"]}]
    with pytest.raises(GraphError, match="concat") as info:
        Graph.from_dict(doc(nodes))
    assert info.value.node == "k"
    with pytest.raises(GraphError, match="schema_version"):
        Graph.from_dict({"schema_version": 99, "nodes": small()})
    with pytest.raises(GraphError, match="not valid JSON"):
        Graph.from_json("{")


def test_dead_branch_is_rejected():
    nodes = small() + [{"id": "dead", "op": "relu", "inputs": ["x"]}]
    with pytest.raises(GraphError, match="exactly one output"):
        Graph.from_dict(doc(nodes))


def test_weights_npz_round_trip(tmp_path):
    g = resnet_small()
    w = init_weights(g, seed=3)
    save_weights(w, tmp_path / "w.npz")
    back = load_weights(tmp_path / "w.npz", g)
    assert back.keys() == w.keys()
    for nid in w:
        for p in w[nid]:
            np.testing.assert_array_equal(back[nid][p], w[nid][p])
    save_graph(g, tmp_path / "g.json")
    assert load_graph(tmp_path / "g.json") == g
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_wrong_weights_name_the_node(tmp_path):
    g = resnet_small()
    w = init_weights(g)
    w["conv1_conv"]["kernel"] = np.zeros((3, 3, 3, 15), np.float32)
    with pytest.raises(GraphError, match="shape") as info:
        validate_weights(g, w)
    assert info.value.node == "conv1_conv"
    w = init_weights(g)
    del w["predictions"]["bias"]
    with pytest.raises(GraphError, match="missing weight 'bias'") as info:
        validate_weights(g, w)
    assert info.value.node == "predictions"
    w = init_weights(g)
    w["conv1_relu"] = {"kernel": np.zeros(1)}
    with pytest.raises(GraphError) as info:
        validate_weights(g, w)
    assert info.value.node == "conv1_relu"


def test_weights_file_never_unpickles(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, **{"conv1_conv/kernel": np.array([object()], dtype=object)})
    with pytest.raises(GraphError, match="not a weights"):
        load_weights(path)


@pytest.mark.parametrize("shape", [(1, 1), (3, 130), (200, 64), (64, 129), (1000, 2048)])
def test_transposed_copy_is_the_transpose_in_c_order(shape):
    # Shapes on, below and across the 64-element tiles, with partial tiles on either axis.
    matrix = np.random.default_rng(0).standard_normal(shape)
    copy = transposed_copy(matrix)
    assert copy.dtype == np.float32 and copy.flags.c_contiguous and not np.shares_memory(copy, matrix)
    assert np.array_equal(copy, matrix.T.astype(np.float32))
    assert np.array_equal(transposed_copy(copy.T, np.float64), copy.astype(np.float64))  # a strided view too
    with pytest.raises(ValueError, match=r"takes a matrix, got shape \[2, 3, 4\]"):
        transposed_copy(np.zeros((2, 3, 4)))


def test_bad_json_file_is_named(tmp_path):
    p = tmp_path / "g.json"
    p.write_text(json.dumps(doc(small()[:2] + [{"id": "r", "op": "nope", "inputs": ["c"]}])))
    with pytest.raises(GraphError, match=r"g\.json: node 'r': unknown op"):
        load_graph(p)


def test_core_and_opcount_import_no_framework():
    import subprocess
    import sys

    code = ("import sys, aiperf_core.ir, aiperf_core.builders, aiperf_core.weights, aiperf_core.morph.cnn, "
            "aiperf_core.morph.transformer, "
            "aiperf_core.backend, aiperf_core.registry, aiperf_core.cli, aiperf_opcount, aiperf_backends.torch; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'mindspore', 'flax', 'onnx') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
