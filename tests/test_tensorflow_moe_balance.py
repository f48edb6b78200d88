"""TensorFlow's mixture-of-experts load balance (issue 40, item 4): the gradients of the cross-entropy plus
TrainConfig.moe_aux_loss times the sequence-wise load-balancing loss equal the float64 NumPy reference's,
with and without activation checkpointing, and a step over micro-batches or two data-parallel devices is
the step on the whole batch; EpochReport.loss stays the cross-entropy; EpochReport.expert_load counts the
routing the training steps ran, per epoch (None without a moe).
"""

from __future__ import annotations


import numpy as np
import pytest

from aiperf_backends.tensorflow import TensorFlowBackend

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

import tensorflow as tf  # noqa: E402

from aiperf_backends.tensorflow.backend import graph_function  # noqa: E402
from aiperf_backends.tensorflow.training import Trainer  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.train import _gpt  # noqa: E402
from aiperf_core.backend import Schedule, TrainConfig  # noqa: E402

from moe_balance_checks import *  # noqa: E402, F403  (the shared tests, collected here with these fixtures)
from moe_balance_checks import ALPHA, SEQUENCES, batch, run_data_parallel  # noqa: E402
from beside import beside


@pytest.fixture(scope="module")
def backend():
    return TensorFlowBackend()


def tf_gradients(backend, graph, weights, x, y, alpha: float, checkpoint: bool = False):
    """The trainer's (cross-entropy, canonical gradients, assignments per expert) of one pass over the batch."""
    model = backend.lower(graph, weights)
    trainer = Trainer(model, TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(0.1), moe_aux_loss=alpha,
                                         checkpoint_blocks=checkpoint))
    load: list = []
    total, grads, _ = trainer._gradients(tf.constant(x), tf.constant(y), tf.constant(float(len(x))),
                                         model.trainables, load)
    return float(total) / y.size, model.canonical_grads(grads), [c.numpy() for c in load]


@pytest.fixture(scope="module")
def gradients():
    return tf_gradients


def test_under_xla_every_expert_gives_the_routed_gradients_and_counts(backend):
    """Under jit_compile (GPUs' default) the moe runs every expert on every token (static shapes): its aux
    loss and counts come from the same logits and choices, so the gradients and counts are the routed ones."""
    graph = _gpt("gpt_moe")
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    trainer = Trainer(model, TrainConfig(epochs=1, batch_size=SEQUENCES, schedule=Schedule(0.1), moe_aux_loss=ALPHA))
    x, y = (tf.constant(t) for t in batch(graph, 5))

    def gradients(x, y):
        load: list = []
        _, grads, _ = trainer._gradients(x, y, tf.constant(float(SEQUENCES)), model.trainables, load)
        return grads, load

    routed, compiled = graph_function(gradients)(x, y), graph_function(gradients, jit_compile=True)(x, y)
    np.testing.assert_array_equal(compiled[1][0].numpy(), routed[1][0].numpy())
    scale = max(float(np.abs(g.numpy()).max()) for g in routed[0])  # the largest gradient's
    for got, want in zip(compiled[0], routed[0]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5 * scale)


_DATA_PARALLEL_SCRIPT = """
import json
import numpy as np
from aiperf_backends.tensorflow import TensorFlowBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.levels.train import _gpt
from aiperf_core.backend import Dataset, Schedule, TrainConfig

backend = TensorFlowBackend()
graph = _gpt("gpt_moe")
weights = trained_looking_weights(graph, 0)
rng = np.random.default_rng(3)
tokens = rng.integers(0, graph.vocab, (9, graph.input_shape[0] + 1))
data = Dataset(tokens[:, :-1], tokens[:, 1:], tokens[:2, :-1], tokens[:2, 1:], graph.vocab)
result = {}
for devices in (["cpu:0"], ["cpu:0", "cpu:1"]):
    model = backend.lower(graph, weights)
    config = TrainConfig(epochs=1, batch_size=9, schedule=Schedule(0.1), moe_aux_loss=0.1, devices=devices)
    (report,) = backend.train(model, data, config)
    result[len(devices)] = dict(load=report.expert_load, loss=report.loss,
                                weights={f"{n}/{k}": v.tolist() for n, p in backend.export_weights(model).items()
                                         for k, v in p.items()})
print(json.dumps(result))
"""


@pytest.fixture(scope="module", autouse=True)
def two_devices(request):
    """The two-device subprocess (AIPERF_CPU_DEVICES is read when the framework starts),
    started with the module's first test when its test is selected, so that the in-process tests run beside it
    (one more process, mostly on one core); its test waits for it."""
    yield from beside(request, "test_two_data_parallel_devices_take_the_one_device_step_and_count_every_shard",
                      run_data_parallel, _DATA_PARALLEL_SCRIPT)


@pytest.mark.slow
def test_two_data_parallel_devices_take_the_one_device_step_and_count_every_shard(two_devices):
    """Two CPU devices (a fresh process: AIPERF_CPU_DEVICES is read when TensorFlow loads), 9 sequences cut
    5 and 4: the aux term is weighted by each shard's sequences, the counts all-reduced."""
    one, two = two_devices.result()
    assert two["load"] == one["load"] and sum(next(iter(one["load"].values()))) == 9 * 16 * 2
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
