"""The MindSpore backend's lowering of schema 4's ops (rms_norm, rotary, silu, mul, grouped-query attention,
SwiGLU experts) against a float64 NumPy reading of the IR's spec (tests/llama_spec.py), independent of the
NumPy reference backend; a Llama's gradients against that reference, with and without activation checkpointing;
its fp16 path; and the native count of grouped-query attention.

Tolerance: float32 against float64 over sums of at most a few hundred products, 1e-5 of the largest output
(the kit holds each op to 1e-4). Measured here: 3e-7 at worst for the op cases, 3.6e-6 for the Llama's
gradients."""

from __future__ import annotations

import numpy as np
import pytest
import mindspore  # noqa: F401  (`make test` installs mindspore: missing it is a failure, never a skip)

import aiperf_numpy
from aiperf_backends.mindspore import MindSporeBackend
from aiperf_conformance.cases import case_input, trained_looking_weights
from aiperf_core.builders import llama
from aiperf_core.ir import Graph, Node

from llama_spec import NEW_CASES, lowered_against_the_spec, relative_error

TOL = 1e-5


def small_llama():
    return llama(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64, ffn=48)


@pytest.fixture(scope="module")
def backend():
    return MindSporeBackend()


@pytest.mark.parametrize("name", list(NEW_CASES))
def test_each_new_op_case_matches_the_spec(backend, name):
    graph = NEW_CASES[name].graph()
    _, error = lowered_against_the_spec(backend, graph, 3, 4)
    assert error < TOL


def test_rms_norm_of_an_image_normalises_over_the_channels(backend):
    """The lowering holds images NCHW: the IR's last axis, the channels, is its axis 1 there."""
    graph = Graph((Node("x", "input", (), {"shape": [3, 4, 5]}),
                   Node("c", "conv2d", ("x",), {"filters": 6, "kernel": [1, 1]}),
                   Node("op", "rms_norm", ("c",), {})), name="rms_norm_image")
    _, error = lowered_against_the_spec(backend, graph, 5, 5, batch=2)
    assert error < TOL


def test_a_llama_matches_the_spec_and_its_rotations_share_one_table(backend):
    graph = small_llama()
    model, error = lowered_against_the_spec(backend, graph, 1, 2)
    assert error < TOL
    rotations = [model.layers[model.layer_of[n.id]] for n in graph.nodes if n.op == "rotary"]
    assert len(rotations) == 4 and len({id(cell.cos) for cell in rotations}) == 1


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_llama_gradients_match_the_reference(backend, checkpoint):
    graph = small_llama()
    weights = trained_looking_weights(graph, 1)
    x = case_input(graph, np.random.default_rng(2), 3)
    labels = np.random.default_rng(3).integers(0, 64, (3, 16))
    model = backend.lower(graph, weights)
    assert len(model.block_spans) == 2
    with model.checkpointing(checkpoint):
        loss, grads = backend.loss_and_grads(model, x, labels)
    want_loss, want, _ = aiperf_numpy.loss_and_grads(graph, weights, x, labels)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for node_id, params in want.items():
        for name, value in params.items():
            assert relative_error(grads[node_id][name], value) < 1e-4, f"{node_id}.{name}"


def test_a_llama_in_half_precision_runs_close_to_fp32():
    # fp16 is not declared on this CPU (emulated); its lowering is exercised directly. Measured: 1.3e-3 at
    # most on probabilities up to 0.53.
    from aiperf_backends.mindspore.lowering import lower_graph
    from aiperf_backends.mindspore.training import predict

    graph = small_llama()
    weights = trained_looking_weights(graph, 1)
    x = case_input(graph, np.random.default_rng(2), 3)
    full = predict(lower_graph(graph, weights, "fp32"), x)
    half = predict(lower_graph(graph, weights, "fp16"), x)
    assert half.dtype == np.float32 and np.all(np.isfinite(half))
    assert np.max(np.abs(half - full)) < 0.01


@pytest.mark.slow
def test_grouped_query_attention_counts_as_multi_head_attention(backend):
    """The count rule: grouped-query attention's products are those of multi-head attention with `heads`
    query heads; the key and value heads are repeated, so MindSpore's own count of them says so too."""

    def attention_graph(kv: int) -> Graph:
        return Graph((Node("x", "input", (), {"shape": [6, 8]}), Node("q", "dense", ("x",), {"units": 8}),
                      Node("k", "dense", ("x",), {"units": 2 * kv}), Node("v", "dense", ("x",), {"units": 2 * kv}),
                      Node("op", "attention", ("q", "k", "v"), {"heads": 4, "head_dim": 2, "kv_heads": kv})),
                     name=f"attention_kv{kv}")

    counter = backend.native_counter()
    counts = []
    for kv in (4, 2, 1):
        graph = attention_graph(kv)
        model = backend.lower(graph, trained_looking_weights(graph, 0))
        counts.append([counter.count(model, 2, backward)["attention"] for backward in (False, True)])
    # 2 samples x 2 products x 2 FLOPs x heads 4 x S^2 36 x head_dim 2; the backward doubles it
    assert counts == [[2 * 2 * 2 * 4 * 36 * 2, 3 * 2 * 2 * 2 * 4 * 36 * 2]] * 3


def test_training_at_another_precision_switches_the_experts_too(backend):
    """computing_in (training at a precision other than the lowering's) reaches every cell that casts to a
    compute dtype: the experts' products as well as the dense layers'."""
    import mindspore as ms

    case = NEW_CASES["moe_swiglu_top2"]
    graph = case.with_head()
    model = backend.lower(graph, trained_looking_weights(graph, 3))
    experts, head = model.layers[model.layer_of["op"]], model.layers[model.layer_of["head_dense"]]
    with model.computing_in("fp16"):
        assert experts.compute_dtype == head.compute_dtype == ms.float16
    assert experts.compute_dtype is None and head.compute_dtype is None
