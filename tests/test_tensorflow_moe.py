"""The TensorFlow lowering's routed mixture of experts (issue 40): each expert's products run on the rows
of the tokens that chose it, in a graph without a host read per expert; under XLA (static shapes) every
expert runs on every token, the same function. The native counter books the routed products, exactly,
under 'moe'.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiperf_backends.tensorflow import TensorFlowBackend

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

import tensorflow as tf  # noqa: E402

from aiperf_backends.tensorflow.backend import graph_function  # noqa: E402
from aiperf_backends.tensorflow.counter import TFProfilerCounter  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.count import BATCH, MOE_CASES, moe_graph, moe_products  # noqa: E402


@pytest.fixture(scope="module")
def backend():
    return TensorFlowBackend()


def sample(graph, seed: int):
    return tf.constant(np.random.default_rng(seed).standard_normal((BATCH,) + graph.input_shape), tf.float32)


def forward_and_grads(model, x, jit_compile: bool):
    """The moe's output and the gradients of a fixed projection of it w.r.t. its input and its parameters."""
    moe = model.params["op"]

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = model._mixture_of_experts(model.graph["op"], x)
            loss = tf.reduce_sum(y * tf.reshape(tf.linspace(-1.0, 1.0, tf.size(y)), tf.shape(y)))
        return [y] + tape.gradient(loss, [x] + list(moe.values()))

    return [t.numpy() for t in graph_function(step, jit_compile=jit_compile)(x)]


@pytest.mark.parametrize("name", MOE_CASES)
def test_the_routed_experts_equal_every_expert_gated_forward_and_gradients(backend, name):
    graph = moe_graph(name)
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    x = sample(graph, 1)
    routed, every = forward_and_grads(model, x, False), forward_and_grads(model, x, True)
    for got, want in zip(routed, every):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_an_expert_that_no_token_chose_runs_on_no_rows_and_gets_no_gradient(backend):
    graph = moe_graph("gelu_top2")
    weights = trained_looking_weights(graph, 0)
    weights["op"]["router"][:, 2:] = 0.0
    weights["op"]["router"][:, :2] = 5.0  # experts 0 and 1 outscore the rest on a positive input
    model = backend.lower(graph, weights)
    x = tf.abs(sample(graph, 2)) + 0.1
    routed, every = forward_and_grads(model, x, False), forward_and_grads(model, x, True)
    names = list(model.params["op"])
    for got, want in zip(routed, every):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    w_in = routed[2 + names.index("w_in")]
    assert np.abs(w_in[0]).max() > 0 and np.abs(w_in[1]).max() > 0
    assert not w_in[2:].any()


def test_the_routed_graph_has_one_product_per_expert_and_no_einsum(backend):
    graph = moe_graph("swiglu_top2")
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    spec = tf.TensorSpec((BATCH,) + graph.input_shape, tf.float32)
    ops = graph_function(lambda x: model.call(x, False)[0]).get_concrete_function(spec).graph.get_operations()
    moe_ops = [op for op in ops if "aiperf_moe" in op.name.split("/")]
    assert not [op for op in ops if op.type == "Einsum"]
    experts = MOE_CASES["swiglu_top2"]["experts"]
    assert sum(op.type == "MatMul" for op in moe_ops) == 1 + 3 * experts  # the router, then gate, in, out each
    assert {op.type for op in moe_ops} >= {"TopKV2", "DenseBincount", "SplitV", "UnsortedSegmentSum"}


@pytest.mark.parametrize("name", MOE_CASES)
@pytest.mark.parametrize("backward", (False, True))
def test_the_counter_books_exactly_the_routed_products_under_moe(backend, name, backward):
    graph = moe_graph(name)
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    counted = TFProfilerCounter().count(model, BATCH, backward)
    assert counted["moe"] == moe_products(graph, backward) * BATCH
