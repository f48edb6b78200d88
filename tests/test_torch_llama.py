"""The torch backend's lowering of schema 4's ops (rms_norm, rotary, silu, mul, grouped-query attention,
SwiGLU experts) against a float64 NumPy reading of the IR's spec (tests/llama_spec.py), independent of
the NumPy reference backend; the fused projections' grouping where rotary, silu or a narrower key and
value sit between the projections and their reader; and the Llama graph's native count.

Tolerance: float32 against float64 over sums of at most a few hundred products, 1e-5 of the largest
output (the kit holds each op to 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: F401  (`make test` installs torch: missing it is a failure, never a skip)

from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.lowering import fused_projections, generated_source
from aiperf_conformance.cases import case_input, trained_looking_weights
from aiperf_core.builders import llama
from aiperf_core.ir import Graph, Node

from llama_spec import NEW_CASES, lowered_against_the_spec, relative_error, rotary

TOL = 1e-5


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.mark.parametrize("name", list(NEW_CASES))
def test_each_new_op_case_matches_the_spec(backend, name):
    graph = NEW_CASES[name].graph()
    _, error = lowered_against_the_spec(backend, graph, 3, 4)
    assert error < TOL


def test_a_wrong_rotary_form_would_fail_the_spec():
    """The spec's half-split pairs (i, i + d/2) against GPT-J's interleaved pairs (2i, 2i + 1): on these
    inputs they differ by far more than the tolerance, so the case above tells the forms apart."""
    x = np.random.default_rng(0).normal(size=(1, 5, 8))
    interleaved = rotary(x.reshape(1, 5, 2, 2, 2).swapaxes(-1, -2).reshape(1, 5, 8), 4, 10000.0)
    interleaved = interleaved.reshape(1, 5, 2, 2, 2).swapaxes(-1, -2).reshape(1, 5, 8)
    assert relative_error(interleaved, rotary(x, 4, 10000.0)) > 1e-2


def test_a_llama_matches_the_spec_and_its_projections_are_fused(backend):
    graph = llama(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64, ffn=48)
    model, error = lowered_against_the_spec(backend, graph, 1, 2)
    assert error < TOL
    groups = set(fused_projections(graph, graph.nodes).values())
    assert groups == {tuple(f"h{i}_{p}" for p in parts)
                      for i in range(2) for parts in (("q", "k", "v"), ("gate", "up"))}
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
    _, error = lowered_against_the_spec(backend, graph, 5, 6, batch=2)
    assert error < TOL


def test_the_group_is_computed_before_a_rotary_of_its_later_member(backend):
    """A key projection stored before the query (and rotated before the query is computed): the fused
    product is emitted at the group's first member in graph order."""
    nodes = (Node("x", "input", (), {"shape": [5, 8]}),
             Node("k", "dense", ("x",), {"units": 4}), Node("k_rope", "rotary", ("k",), {"head_dim": 4}),
             Node("q", "dense", ("x",), {"units": 8}), Node("v", "dense", ("x",), {"units": 4}),
             Node("att", "attention", ("q", "k_rope", "v"), {"heads": 2, "head_dim": 4, "kv_heads": 1}))
    graph = Graph(nodes, name="key_first")
    assert set(fused_projections(graph, graph.nodes).values()) == {("q", "k", "v")}
    _, error = lowered_against_the_spec(backend, graph, 7, 8, batch=2)
    assert error < TOL


def test_grouped_query_attention_runs_the_fused_kernel_without_copying_key_value_heads(backend):
    """SDPA's enable_gqa: on a CPU the flash kernel reads each key-value head for its query heads,
    forward and backward, at every precision this CPU declares; nothing repeats the keys and values."""
    from torch.profiler import profile

    case = NEW_CASES["attention_grouped_query"]
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
