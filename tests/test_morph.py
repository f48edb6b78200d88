"""Network morphs: function preservation, op-count deltas, caps, errors, candidates, replay and `aiperf morph`."""

import json

import numpy as np
import pytest

from aiperf_core.builders import resnet50, resnet_small
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import Graph, load_graph
from aiperf_core.morph import CapExceeded, MorphCaps, signature_hash
from aiperf_core.morph import cnn as M
from aiperf_core.weights import init_weights, load_weights, validate_weights
from aiperf_opcount import count

import aiperf_numpy  # noqa: E402  (installed by `make test`)
run = aiperf_numpy.run


def trained_weights(graph, seed):
    """He-initialised kernels with the statistics of a trained net: no BN is an identity."""
    rng = np.random.default_rng(seed)
    weights = init_weights(graph, seed, dtype=np.float64)
    for params in weights.values():
        if "gamma" in params:
            c = params["gamma"].shape
            params["gamma"] = rng.uniform(0.5, 1.5, c)
            params["beta"] = rng.normal(0.0, 0.3, c)
            params["moving_mean"] = rng.normal(0.0, 0.5, c)
            params["moving_variance"] = rng.uniform(0.5, 2.0, c)
        if "bias" in params:
            params["bias"] = rng.normal(0.0, 0.1, params["bias"].shape)
    return weights


def outputs(graph, weights, x):
    """The output and the logits (the output's input) in float64 inference."""
    trace = run(graph, weights, x, training=False, dtype=np.float64)
    return trace.outputs[graph.output_id], trace.outputs[graph[graph.output_id].inputs[0]]


def assert_same_function(expected, graph, weights, x):
    validate_weights(graph, weights)
    out, logits = outputs(graph, weights, x)
    want_out, want_logits = expected
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5 * np.abs(want_logits).max())
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-12)


def assert_delta(parent, result):
    before, after = count(parent), count(result.graph)
    delta = result.record["delta"]
    assert after.fp == before.fp + delta["fp"], result.record
    assert after.bp == before.bp + delta["bp"], result.record


class Model:
    def __init__(self, graph, seed=0, batch=2):
        self.graph = graph
        self.weights = trained_weights(graph, seed)
        self.x = np.random.default_rng(seed + 100).standard_normal((batch, *graph.input_shape))
        self.expected = outputs(graph, self.weights, self.x)


@pytest.fixture(scope="module")
def small():
    return Model(resnet_small((32, 32, 3), 10))


@pytest.fixture(scope="module")
def big():
    return Model(resnet50((64, 64, 3), 10))


def tiny_graph():
    """Concat, max-pool, dropout, a biased conv and flatten into dense: every path wider can take."""
    return Graph([
        {"id": "input", "op": "input", "attrs": {"shape": [8, 8, 3]}},
        {"id": "c1", "op": "conv2d", "inputs": ["input"], "attrs": {"filters": 4, "kernel": [3, 3], "padding": [1] * 4}},
        {"id": "b1", "op": "batch_norm", "inputs": ["c1"]},
        {"id": "r1", "op": "relu", "inputs": ["b1"]},
        {"id": "c2", "op": "conv2d", "inputs": ["input"], "attrs": {"filters": 5, "kernel": [1, 1], "use_bias": True}},
        {"id": "r2", "op": "relu", "inputs": ["c2"]},
        {"id": "cat", "op": "concat", "inputs": ["r1", "r2"]},
        {"id": "mp", "op": "max_pool", "inputs": ["cat"], "attrs": {"kernel": [2, 2]}},
        {"id": "dr", "op": "dropout", "inputs": ["mp"], "attrs": {"rate": 0.3}},
        {"id": "c3", "op": "conv2d", "inputs": ["dr"],
         "attrs": {"filters": 6, "kernel": [3, 3], "padding": [1] * 4, "use_bias": True}},
        {"id": "r3", "op": "relu", "inputs": ["c3"]},
        {"id": "fl", "op": "flatten", "inputs": ["r3"]},
        {"id": "d", "op": "dense", "inputs": ["fl"], "attrs": {"units": 7}},
        {"id": "sm", "op": "softmax", "inputs": ["d"]},
    ], name="tiny")


def data_first_graph():
    """No parameters before the first conv: a morph above it makes that conv need its input gradient."""
    return Graph([
        {"id": "input", "op": "input", "attrs": {"shape": [8, 8, 3]}},
        {"id": "r0", "op": "relu", "inputs": ["input"]},
        {"id": "mp", "op": "max_pool", "inputs": ["r0"], "attrs": {"kernel": [2, 2]}},
        {"id": "c", "op": "conv2d", "inputs": ["mp"], "attrs": {"filters": 4, "kernel": [3, 3], "padding": [1] * 4}},
        {"id": "b", "op": "batch_norm", "inputs": ["c"]},
        {"id": "r", "op": "relu", "inputs": ["b"]},
        {"id": "gap", "op": "global_avg_pool", "inputs": ["r"]},
        {"id": "d", "op": "dense", "inputs": ["gap"], "attrs": {"units": 3}},
        {"id": "sm", "op": "softmax", "inputs": ["d"]},
    ], name="data_first")


def branches_graph():
    """Two parallel branches on different grids (5x5 and 8x8), joined after pooling."""
    return Graph([
        {"id": "input", "op": "input", "attrs": {"shape": [8, 8, 3]}},
        {"id": "c5", "op": "conv2d", "inputs": ["input"], "attrs": {"filters": 4, "kernel": [4, 4]}},
        {"id": "c8", "op": "conv2d", "inputs": ["input"], "attrs": {"filters": 4, "kernel": [1, 1]}},
        {"id": "g5", "op": "global_avg_pool", "inputs": ["c5"]},
        {"id": "g8", "op": "global_avg_pool", "inputs": ["c8"]},
        {"id": "add", "op": "add", "inputs": ["g5", "g8"]},
        {"id": "d", "op": "dense", "inputs": ["add"], "attrs": {"units": 2}},
        {"id": "sm", "op": "softmax", "inputs": ["d"]},
    ], name="branches")


# ---------------------------------------------------------------------------
# Function preservation, one morph at a time
# ---------------------------------------------------------------------------

SINGLE = [
    ("deeper", {"after": "conv3_block1_1_relu"}),
    ("deeper", {"after": "conv2_block1_out", "kernel": 5}),
    ("wider", {"conv": "conv2_block1_1_conv", "rng": 1}),
    ("wider", {"conv": "conv3_block1_2_conv", "new_filters": 0, "rng": 2}),  # new_filters 0: filters + 3
    ("wider", {"conv": "conv1_conv", "factor": 1.5, "rng": 3}),
    ("skip", {"src": "pool1", "dst": "conv3_block1_2_bn"}),
    ("skip", {"src": "conv1_relu", "dst": "conv4_block1_add"}),
    ("skip", {"src": "conv2_block1_1_relu", "dst": "conv2_block1_3_bn"}),
]


def _single(graph, weights, op, kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("new_filters") == 0:
        kwargs["new_filters"] = graph[kwargs["conv"]].attrs["filters"] + 3
    return getattr(M, op)(graph, weights, **kwargs)


@pytest.mark.parametrize("model", ["small", "big"])
@pytest.mark.parametrize("op, kwargs", SINGLE, ids=[f"{op}-{i}" for i, (op, _) in enumerate(SINGLE)])
def test_single_morph_preserves_function(request, model, op, kwargs):
    m = request.getfixturevalue(model)
    result = _single(m.graph, m.weights, op, kwargs)
    assert result.graph.signature() != m.graph.signature()
    assert_same_function(m.expected, result.graph, result.weights, m.x)
    assert_delta(m.graph, result)


@pytest.mark.parametrize("model", ["small", "big"])
def test_kernel_growth_preserves_function(request, model):
    m = request.getfixturevalue(model)
    r = M.deeper(m.graph, m.weights, "conv2_block1_2_relu")
    conv = r.record["args"]["prefix"] + "_conv"
    for size in (5, 7):
        parent = r.graph
        r = M.kernel(r.graph, r.weights, conv)
        assert r.graph[conv].attrs["kernel"] == (size, size)
        assert r.graph[conv].attrs["padding"] == ((size - 1) // 2,) * 4
        assert r.graph.shapes[conv] == parent.shapes[conv]
        assert_delta(parent, r)
    assert_same_function(m.expected, r.graph, r.weights, m.x)


def test_tiny_graph_wider_through_concat_pool_dropout_and_flatten():
    g = tiny_graph()
    m = Model(g, seed=4, batch=3)
    for conv in ("c1", "c2", "c3"):
        r = M.wider(m.graph, m.weights, conv, new_filters=g[conv].attrs["filters"] + 5, rng=7)
        assert_same_function(m.expected, r.graph, r.weights, m.x)
        assert_delta(m.graph, r)
    r = M.wider(g, m.weights, "c3", rng=0)
    assert r.graph.shapes["fl"] == (4 * 4 * 12,)
    assert r.weights["d"]["kernel"].shape == (4 * 4 * 12, 7)


def test_skip_with_a_ceil_stride_on_an_odd_grid():
    m = Model(resnet_small((28, 28, 3), 4), seed=2)
    assert m.graph.shapes["conv3_block1_out"][:2] == (7, 7)
    assert m.graph.shapes["conv4_block1_2_bn"][:2] == (4, 4)
    r = M.skip(m.graph, m.weights, "conv3_block1_out", "conv4_block1_2_bn")
    assert r.graph[r.record["args"]["prefix"] + "_skip"].attrs["strides"] == (2, 2)
    assert_same_function(m.expected, r.graph, r.weights, m.x)
    assert_delta(m.graph, r)


def test_deeper_block_identity_and_statistics(small):
    r = M.deeper(small.graph, small.weights, "conv3_block1_1_relu")
    p = r.record["args"]["prefix"]
    assert [n.id for n in r.graph.consumers("conv3_block1_1_relu")] == [f"{p}_conv"]
    assert r.graph[f"{p}_conv"].attrs["kernel"] == (3, 3) and r.graph[f"{p}_conv"].attrs["padding"] == (1, 1, 1, 1)
    bn = r.weights[f"{p}_bn"]
    eps = r.graph[f"{p}_bn"].attrs["epsilon"]
    np.testing.assert_allclose(bn["gamma"], np.sqrt(bn["moving_variance"] + eps))
    np.testing.assert_array_equal(bn["beta"], bn["moving_mean"])
    # Estimated from the BN before the relu, so not the trivial zero-mean unit-variance pair.
    assert np.all(bn["moving_mean"] > 0) and not np.allclose(bn["moving_variance"], 1.0)


def test_weights_are_shared_copied_only_where_changed_and_parent_untouched(small):
    before = {k: {p: a.copy() for p, a in v.items()} for k, v in small.weights.items()}
    r = M.wider(small.graph, small.weights, "conv3_block1_1_conv", rng=0)
    changed = {"conv3_block1_1_conv", "conv3_block1_1_bn", "conv3_block1_2_conv"}
    for node_id, params in small.weights.items():
        for pname, array in params.items():
            np.testing.assert_array_equal(array, before[node_id][pname])
            assert (r.weights[node_id][pname] is array) == (node_id not in changed), (node_id, pname)


def test_graph_only_morphs_match_the_weighted_ones(small):
    for op, kwargs in SINGLE:
        with_w = _single(small.graph, small.weights, op, kwargs)
        without = _single(small.graph, None, op, kwargs)
        assert without.weights is None
        assert without.graph == with_w.graph and without.record == with_w.record


# ---------------------------------------------------------------------------
# Chains, deltas, replay
# ---------------------------------------------------------------------------


def _chain(model, steps, seed, caps=None):
    graph, weights = model.graph, model.weights
    links = []
    for step in range(steps):
        (result,) = M.generate_candidates(graph, weights, 1, seed + step, caps=caps)
        links.append((graph, weights, result))
        graph, weights = result.graph, result.weights
    return links


def test_chain_of_20_random_morphs_on_resnet_small(small):
    links = _chain(small, 20, seed=11)
    ops = {result.record["op"] for _, _, result in links}
    assert ops == set(M.OPERATORS)
    for parent, parent_weights, result in links:
        assert_delta(parent, result)
        again = M.replay(parent, parent_weights, result.record)
        assert again.graph == result.graph and again.record == result.record
        for node_id, params in result.weights.items():
            for pname, array in params.items():
                np.testing.assert_array_equal(again.weights[node_id][pname], array)
    final = links[-1][2]
    assert len(final.graph.history) == 20
    assert [h["op"] for h in final.graph.history] == [r.record["op"] for _, _, r in links]
    json.dumps(final.graph.to_dict())  # records are JSON-plain
    assert_same_function(small.expected, final.graph, final.weights, small.x)


def test_chain_of_20_random_morphs_on_resnet50(big):
    caps = MorphCaps(max_params=40_000_000)
    links = _chain(big, 20, seed=5, caps=caps)
    assert {result.record["op"] for _, _, result in links} == set(M.OPERATORS)
    for parent, _, result in links:
        assert_delta(parent, result)
    final = links[-1][2]
    assert final.graph.num_params() <= 40_000_000
    assert_same_function(big.expected, final.graph, final.weights, big.x)


@pytest.mark.parametrize("op", M.OPERATORS)
def test_delta_matches_a_full_recount(small, op):
    graph, weights = small.graph, None
    if op == "kernel":
        graph = M.deeper(graph, None, "conv2_block1_1_relu").graph
        graph = M.deeper(graph, None, "conv4_block1_out", kernel=5).graph
    grown = _chain(Model(graph, seed=1), 6, seed=3)[-1][2].graph
    for parent in (graph, grown):
        results = M.generate_candidates(parent, weights, 6, seed=9, ops=(op,))
        assert results and all(r.record["op"] == op for r in results)
        for result in results:
            assert_delta(parent, result)


@pytest.mark.parametrize("op, kwargs", [
    ("deeper", {"after": "r0"}),
    ("skip", {"src": "input", "dst": "mp"}),
    ("skip", {"src": "r0", "dst": "mp"}),
])
def test_delta_counts_a_layer_that_newly_needs_its_input_gradient(op, kwargs):
    g = data_first_graph()
    m = Model(g, seed=3)
    r = getattr(M, op)(g, m.weights, **kwargs)
    assert_delta(g, r)
    conv = next(n for n in count(r.graph).nodes if n.id == "c")
    assert conv.bp > next(n for n in count(g).nodes if n.id == "c").bp
    assert_same_function(m.expected, r.graph, r.weights, m.x)


def test_replay_refuses_another_parent_and_bad_records(small):
    r = M.deeper(small.graph, None, "conv2_block1_1_relu")
    with pytest.raises(GraphError, match="another parent"):
        M.replay(r.graph, None, r.record)
    with pytest.raises(GraphError, match="unknown op"):
        M.replay(small.graph, None, {**r.record, "op": "shrink"})
    with pytest.raises(GraphError, match="unknown argument 'colour'"):
        M.replay(small.graph, None, {**r.record, "args": {**r.record["args"], "colour": 1}})
    with pytest.raises(GraphError, match="missing argument 'after'"):
        M.replay(small.graph, None, {**r.record, "args": {"kernel": 3}})


def test_record_shape_and_deterministic_ids(small):
    r1 = M.deeper(small.graph, None, "conv2_block1_1_relu")
    r2 = M.deeper(r1.graph, None, "conv2_block1_1_relu")
    assert set(r1.record) == {"op", "args", "parent", "delta"}
    assert r1.record["parent"] == signature_hash(small.graph)
    assert r1.record["args"] == {"after": "conv2_block1_1_relu", "kernel": 3, "prefix": "m1"}
    assert r2.record["args"]["prefix"] == "m2"
    assert {"m1_conv", "m1_bn", "m1_relu", "m2_conv", "m2_bn", "m2_relu"} <= {n.id for n in r2.graph}
    assert r2.graph.history == (r1.record, r2.record)
    w = M.wider(small.graph, None, "conv2_block1_1_conv", rng=np.random.default_rng(4))
    assert w.record["args"]["new_filters"] == 16 and len(w.record["args"]["sources"]) == 8
    assert all(type(s) is int and 0 <= s < 8 for s in w.record["args"]["sources"])


# ---------------------------------------------------------------------------
# Caps
# ---------------------------------------------------------------------------


def test_caps_raise_cap_exceeded_naming_the_cap(small):
    g = small.graph
    base = count(g).total
    cases = [
        (MorphCaps(max_nodes=len(g) + 2), "max_nodes", len(g) + 3),
        (MorphCaps(max_params=g.num_params()), "max_params", None),
        (MorphCaps(max_ops_per_image=base), "max_ops_per_image", None),
    ]
    for caps, name, value in cases:
        with pytest.raises(CapExceeded) as info:
            M.deeper(g, small.weights, "conv2_block1_1_relu", caps=caps)
        assert isinstance(info.value, GraphError)
        assert info.value.cap == name and name in str(info.value)
        assert info.value.value > info.value.limit
        if value is not None:
            assert info.value.value == value
    loose = MorphCaps(max_nodes=len(g) + 3, max_params=10**9, max_ops_per_image=10 * base)
    assert M.deeper(g, small.weights, "conv2_block1_1_relu", caps=loose).weights is not None


def test_caps_validate_their_values():
    for bad in (0, -1, 1.5, True, "10"):
        with pytest.raises(AiperfError):
            MorphCaps(max_nodes=bad)


def test_candidates_skip_children_over_the_caps(small):
    caps = MorphCaps(max_params=small.graph.num_params() + 3000)
    results = M.generate_candidates(small.graph, None, 8, seed=2, caps=caps)
    assert results
    assert all(r.graph.num_params() <= caps.max_params for r in results)
    no_new_nodes = MorphCaps(max_nodes=len(small.graph))
    assert M.generate_candidates(small.graph, None, 8, seed=2, caps=no_new_nodes, ops=("deeper", "skip")) == []
    widened = M.generate_candidates(small.graph, None, 8, seed=2, caps=no_new_nodes)
    assert widened and {r.record["op"] for r in widened} == {"wider"}


# ---------------------------------------------------------------------------
# Errors name the node
# ---------------------------------------------------------------------------


def test_errors_name_the_node(small):
    g, w = small.graph, small.weights
    cases = [
        (lambda: M.deeper(g, w, "nope"), "nope", "no such node"),
        (lambda: M.deeper(g, w, "conv1_conv"), "conv1_conv", "must be a relu"),
        (lambda: M.deeper(g, w, "conv1_relu", kernel=4), "conv1_relu", "odd size"),
        (lambda: M.wider(g, w, "missing"), "missing", "no such node"),
        (lambda: M.wider(g, w, "conv1_relu"), "conv1_relu", "must be a conv2d"),
        (lambda: M.wider(g, w, "conv2_block1_3_conv"), "conv2_block1_3_conv", "add 'conv2_block1_add'"),
        (lambda: M.wider(g, w, "conv2_block1_0_conv"), "conv2_block1_0_conv", "add 'conv2_block1_add'"),
        (lambda: M.wider(g, w, "conv1_conv", factor=1.0), "conv1_conv", "factor"),
        (lambda: M.wider(g, w, "conv1_conv", new_filters=16), "conv1_conv", "above the current 16"),
        (lambda: M.wider(g, w, "conv1_conv", sources=[99]), "conv1_conv", "below 16"),
        (lambda: M.skip(g, w, "conv3_block1_out", "conv2_block1_out"), "conv3_block1_out", "cycle"),
        (lambda: M.skip(g, w, "conv1_relu", "conv1_relu"), "conv1_relu", "same node"),
        (lambda: M.skip(g, w, "conv1_relu", "avg_pool"), "avg_pool", "image-shaped"),
        (lambda: M.skip(g, w, "ghost", "conv1_relu"), "ghost", "no such node"),
        (lambda: M.kernel(g, w, "conv2_block1_2_conv"), "conv2_block1_2_conv", "added by a deeper morph"),
        (lambda: M.kernel(g, w, "conv1_relu"), "conv1_relu", "must be a conv2d"),
    ]
    for call, node, text in cases:
        with pytest.raises(GraphError) as info:
            call()
        assert info.value.node == node, (node, str(info.value))
        assert f"'{node}'" in str(info.value) and text in str(info.value)


def test_skip_refuses_upsampling_and_grids_no_stride_matches():
    g = branches_graph()
    with pytest.raises(GraphError, match="upsample 5x5 onto 8x8") as info:
        M.skip(g, None, "c5", "c8")
    assert info.value.node == "c5"
    with pytest.raises(GraphError, match="cannot stride 8x8 onto 5x5") as info:
        M.skip(g, None, "input", "c5")
    assert info.value.node == "input"


def test_wider_refuses_channels_that_reach_the_output_and_kernel_refuses_bad_sizes(small):
    g = Graph([
        {"id": "input", "op": "input", "attrs": {"shape": [4, 4, 2]}},
        {"id": "c", "op": "conv2d", "inputs": ["input"], "attrs": {"filters": 3, "kernel": [1, 1]}},
        {"id": "r", "op": "relu", "inputs": ["c"]},
    ])
    with pytest.raises(GraphError, match="graph output") as info:
        M.wider(g, None, "c")
    assert info.value.node == "c"
    r = M.deeper(small.graph, None, "conv1_relu", kernel=7)
    with pytest.raises(GraphError, match="largest kernel") as info:
        M.kernel(r.graph, None, "m1_conv")
    assert info.value.node == "m1_conv"
    r = M.deeper(small.graph, None, "conv1_relu")
    for size in (3, 4, 9):
        with pytest.raises(GraphError, match="size must be larger than 3"):
            M.kernel(r.graph, None, "m1_conv", size=size)
    assert M.kernel(r.graph, None, "m1_conv", size=7).graph["m1_conv"].attrs["kernel"] == (7, 7)


# ---------------------------------------------------------------------------
# Candidates
# ---------------------------------------------------------------------------


def test_candidates_are_reproducible_distinct_and_valid(small):
    a = M.generate_candidates(small.graph, small.weights, 8, seed=42)
    b = M.generate_candidates(small.graph, small.weights, 8, seed=42)
    c = M.generate_candidates(small.graph, None, 8, seed=42)
    assert len(a) == 8
    assert [r.record for r in a] == [r.record for r in b] == [r.record for r in c]
    assert all(x.graph == y.graph for x, y in zip(a, b))
    for x, y in zip(a, b):
        for node_id, params in x.weights.items():
            for pname, array in params.items():
                np.testing.assert_array_equal(array, y.weights[node_id][pname])
    signatures = [r.graph.signature() for r in a]
    assert len(set(signatures)) == 8 and small.graph.signature() not in signatures
    assert {r.record["op"] for r in a} == set(M.OPERATORS) - {"kernel"}  # no deeper-added conv yet
    assert [r.record for r in M.generate_candidates(small.graph, None, 8, seed=43)] != [r.record for r in c]
    for r in a:
        validate_weights(r.graph, r.weights)


def test_candidates_respect_ops_and_run_out_gracefully(small):
    only = M.generate_candidates(small.graph, None, 5, seed=1, ops=("skip",))
    assert len(only) == 5 and {r.record["op"] for r in only} == {"skip"}
    assert M.generate_candidates(small.graph, None, 5, seed=1, ops=("kernel",)) == []
    # resnet_small has 4 widenable convs (the first two of each bottleneck, plus the stem) at factor 2 only.
    wide = M.generate_candidates(small.graph, None, 50, seed=1, ops=("wider",))
    assert len(wide) == len(M.widenable(small.graph)) == 7
    with pytest.raises(AiperfError, match="unknown morph op"):
        M.generate_candidates(small.graph, None, 1, seed=1, ops=("shrink",))


def test_candidates_of_a_300_node_graph_with_weights():
    """Eight children of a graph of the size the search reaches, weights and all. Their speed (the
    goal: 0.5 s for the eight) is benchmarks/morph_speed.py's to report: a test would time the machine."""
    graph = resnet50((224, 224, 3), 1000)
    # A block after every relu inside a bottleneck, then skips: 300 nodes, about 60M parameters.
    for relu in [n.id for n in graph.nodes if n.op == "relu" and not n.id.endswith("_out")]:
        graph = M.deeper(graph, None, relu).graph
    rng = np.random.default_rng(0)
    while len(graph) < 300:
        graph = M.random_morph(graph, None, rng, ops=("skip",)).graph
    weights = init_weights(graph, 0)
    results = M.generate_candidates(graph, weights, 8, seed=1)
    assert len(results) == 8 and len({signature_hash(r.graph) for r in results}) == 8  # distinct architectures
    for r in results:  # every child's weights fit its graph, every parameter of it and nothing else
        assert len(r.graph) >= len(graph)
        validate_weights(r.graph, r.weights)


# ---------------------------------------------------------------------------
# aiperf morph
# ---------------------------------------------------------------------------


def _morph(tmp_path, *argv, name="out"):
    return main(["morph", *argv, "--out", str(tmp_path / name)])


def test_cli_writes_a_child_that_computes_what_its_parent_did(tmp_path, capsys):
    assert _morph(tmp_path, "resnet_small", "--input", "16x16x3", "--classes", "5", "--steps", "6",
                  "--seed", "3") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("resnet_small: 44 nodes")
    assert sum(line.startswith("step ") for line in out) == 6
    assert "FP +" in out[1] and "BP +" in out[1] and out[-1].startswith("wrote ")
    graph = load_graph(tmp_path / "out" / "graph.json")
    weights = load_weights(tmp_path / "out" / "weights.npz", graph)
    assert len(graph.history) == 6
    parent = resnet_small((16, 16, 3), 5)
    parent_weights = init_weights(parent, 3)
    x = np.random.default_rng(0).standard_normal((2, 16, 16, 3))
    assert_same_function(outputs(parent, parent_weights, x), graph, weights, x)
    # The same seed gives the same child.
    assert _morph(tmp_path, "resnet_small", "--input", "16x16x3", "--classes", "5", "--steps", "6",
                  "--seed", "3", name="again") == 0
    assert (tmp_path / "again" / "graph.json").read_text() == (tmp_path / "out" / "graph.json").read_text()


def test_cli_json_from_an_ir_file_with_weights(tmp_path, capsys):
    assert _morph(tmp_path, "resnet_small", "--input", "16x16x3", "--classes", "5", "--op", "deeper",
                  name="first") == 0
    capsys.readouterr()
    first = tmp_path / "first"
    assert main(["morph", str(first / "graph.json"), "--weights", str(first / "weights.npz"), "--op", "kernel",
                 "--steps", "2", "--json", "--out", str(tmp_path / "second")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["op"] for s in data["steps"]] == ["kernel", "kernel"]
    assert [s["args"]["size"] for s in data["steps"]] == [5, 7]
    total = data["start"]["fp"] + sum(s["delta"]["fp"] for s in data["steps"])
    graph = load_graph(data["graph"])
    assert data["steps"][-1]["fp"] == total == count(graph).fp
    assert data["steps"][-1]["bp"] == count(graph).bp
    assert data["steps"][-1]["nodes"] == len(graph)


def test_cli_fixed_targets(tmp_path, capsys):
    assert _morph(tmp_path, "resnet_small", "--op", "skip", "--src", "pool1", "--node", "conv3_block1_2_bn",
                  "--json", "--input", "16x16x3") == 0
    step = json.loads(capsys.readouterr().out)["steps"][0]
    assert step["args"] == {"src": "pool1", "dst": "conv3_block1_2_bn", "prefix": "m1"}
    assert _morph(tmp_path, "resnet_small", "--op", "wider", "--node", "conv1_conv", "--json", "--input", "16x16x3",
                  name="w") == 0
    step = json.loads(capsys.readouterr().out)["steps"][0]
    assert step["args"]["conv"] == "conv1_conv" and step["args"]["new_filters"] == 32


@pytest.mark.parametrize("argv, message", [
    (["--op", "deeper", "--node", "nope"], "node 'nope': no such node"),
    (["--op", "wider", "--node", "conv2_block1_3_conv"], "node 'conv2_block1_3_conv': cannot widen"),
    (["--op", "kernel"], "no node of this graph admits a kernel morph"),
    (["--op", "deeper", "--steps", "2", "--max-nodes", "47"], "cap max_nodes exceeded"),
    (["--max-params", "1000"], "cap max_params exceeded"),
    (["--max-ops", "1000"], "cap max_ops_per_image exceeded"),
    (["--node", "conv1_relu"], "need a specific --op"),
    (["--op", "skip", "--node", "conv1_relu"], "needs both --src and --node"),
])
def test_cli_errors_are_one_line_with_status_2(tmp_path, capsys, argv, message):
    assert _morph(tmp_path, "resnet_small", "--input", "16x16x3", *argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aiperf: error: ") and message in err
    assert not (tmp_path / "out").exists()


def test_cli_refuses_a_file_as_out(tmp_path, capsys):
    (tmp_path / "out").write_text("")
    assert _morph(tmp_path, "resnet_small") == 2
    assert "not a folder" in capsys.readouterr().err
