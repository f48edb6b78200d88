"""The TensorFlow lowering of the Llama family's ops (IR schema 4) beyond what the kit checks against
the NumPy reference: grouped-query attention is multi-head attention with each key-value head's columns
repeated, forward and gradients (the key-value gradients are the repeated heads' gradients summed);
rotary's tables are constants of the lowering, not computed in the traced graph; activation
checkpointing of a Llama's blocks leaves its gradients as they were; the XLA-compiled forward equals
the plain one.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiperf_backends.tensorflow import TensorFlowBackend

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

import tensorflow as tf  # noqa: E402

from aiperf_backends.tensorflow.backend import graph_function  # noqa: E402
from aiperf_core.builders import llama  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402

from llama_spec import relative_error  # noqa: E402
from test_tensorflow_step_memory import assert_checkpointing_leaves_gradients_as_they_were  # noqa: E402

HIDDEN, HEADS, SEQ, VOCAB, FFN = 32, 4, 8, 64, 48
HEAD_DIM = HIDDEN // HEADS


@pytest.fixture(scope="module")
def backend():
    return TensorFlowBackend()


def _tokens(batch: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (batch, SEQ)), rng.integers(0, VOCAB, (batch, SEQ))


def _repeat_heads(kernel: np.ndarray, group: int) -> np.ndarray:
    """A (D, kv * d) key or value kernel as (D, kv * group * d): each head's columns `group` times."""
    d_in = kernel.shape[0]
    return np.repeat(kernel.reshape(d_in, -1, 1, HEAD_DIM), group, axis=2).reshape(d_in, -1)


def _logits_and_grads(backend, graph, weights, x, y):
    model = backend.lower(graph, weights)
    xs, ys = tf.constant(x, tf.int64), tf.constant(y, tf.int64)
    with tf.GradientTape() as tape:
        logits, _ = model.call(xs, True, logits=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(ys, logits))
    grads = tape.gradient(loss, model.trainables)
    return logits.numpy(), {key: tf.convert_to_tensor(g).numpy() for key, g in zip(model.trainable_keys, grads)}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_attention_is_multi_head_attention_with_key_value_heads_repeated(backend, kv_heads):
    group = HEADS // kv_heads
    grouped = llama(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=kv_heads, seq_len=SEQ, vocab=VOCAB, ffn=FFN)
    multi_head = llama(layers=2, hidden=HIDDEN, heads=HEADS, seq_len=SEQ, vocab=VOCAB, ffn=FFN)
    weights = init_weights(grouped, seed=3)
    repeated = {node: dict(params) for node, params in weights.items()}
    key_value_nodes = [n.id for n in grouped.nodes if n.id.endswith(("_k", "_v")) and n.op == "dense"]
    assert len(key_value_nodes) == 4
    for node in key_value_nodes:
        repeated[node]["kernel"] = _repeat_heads(weights[node]["kernel"], group)
    x, y = _tokens(3, 0)
    logits, grads = _logits_and_grads(backend, grouped, weights, x, y)
    logits_mha, grads_mha = _logits_and_grads(backend, multi_head, repeated, x, y)
    # The key and value products of another width sum in another order: equal to float32 rounding.
    assert relative_error(logits, logits_mha) < 1e-5
    for (node, param), grad in grads.items():
        expected = grads_mha[(node, param)]
        if node in key_value_nodes:  # the repeated columns' gradients, summed back onto their head
            expected = expected.reshape(HIDDEN, kv_heads, group, HEAD_DIM).sum(axis=2).reshape(HIDDEN, -1)
        assert relative_error(grad, expected) < 1e-5, f"{node}/{param}"


def test_rotary_tables_are_constants_of_the_lowering(backend):
    graph = llama(layers=1, hidden=HIDDEN, heads=HEADS, kv_heads=2, seq_len=SEQ, vocab=VOCAB, ffn=FFN)
    model = backend.lower(graph)
    concrete = graph_function(lambda t: model.call(t, False)[0]).get_concrete_function(
        tf.TensorSpec([2, SEQ], tf.int64))
    op_types = {op.type for op in concrete.graph.get_operations()}
    assert not op_types & {"Cos", "Sin", "Pow"}
    cos, sin = model.rotary_tables["h0_q_rope"]
    theta = np.arange(SEQ)[:, None, None] * 10000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    np.testing.assert_array_equal(cos, np.cos(theta).astype(np.float32))
    np.testing.assert_array_equal(sin, np.sin(theta).astype(np.float32))


def test_checkpointing_a_llama_leaves_its_gradients_as_they_were(backend):
    graph = llama(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=2, seq_len=SEQ, vocab=VOCAB, ffn=FFN)
    assert graph.blocks()  # something to checkpoint
    assert_checkpointing_leaves_gradients_as_they_were(backend, graph, *_tokens(4, 1))


def test_the_xla_compiled_llama_forward_equals_the_plain_one(backend):
    graph = llama(layers=1, hidden=HIDDEN, heads=HEADS, kv_heads=2, seq_len=SEQ, vocab=VOCAB, ffn=FFN)
    model = backend.lower(graph)
    x = tf.constant(_tokens(2, 2)[0], tf.int64)
    plain = graph_function(lambda t: model.call(t, False)[0])(x).numpy()
    compiled = graph_function(lambda t: model.call(t, False)[0], jit_compile=True)(x).numpy()
    np.testing.assert_allclose(compiled, plain, rtol=0, atol=1e-6)
