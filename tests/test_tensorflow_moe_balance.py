"""TensorFlow's mixture-of-experts load balance (issue 40, item 4): the gradients of the cross-entropy plus
TrainConfig.moe_aux_loss times the sequence-wise load-balancing loss equal the float64 NumPy reference's,
with and without activation checkpointing, and a step over micro-batches or two data-parallel devices is
the step on the whole batch; EpochReport.loss stays the cross-entropy; EpochReport.expert_load counts the
routing the training steps ran, per epoch (None without a moe).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aiperf_backends.tensorflow import TensorFlowBackend

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

import tensorflow as tf  # noqa: E402

from aiperf_backends.tensorflow.training import Trainer  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.train import _gpt  # noqa: E402
from aiperf_core.backend import Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_numpy import executor  # noqa: E402

ALPHA = 0.1
SEQUENCES = 6


@pytest.fixture(scope="module")
def backend():
    return TensorFlowBackend()


def batch(graph, seed: int, n: int = SEQUENCES):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def tf_gradients(backend, graph, weights, x, y, alpha: float, checkpoint: bool = False):
    """The trainer's (cross-entropy, canonical gradients, assignments per expert) of one pass over the batch."""
    model = backend.lower(graph, weights)
    trainer = Trainer(model, TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(0.1), moe_aux_loss=alpha,
                                         checkpoint_blocks=checkpoint))
    load: list = []
    total, grads, _ = trainer._gradients(tf.constant(x), tf.constant(y), tf.constant(float(len(x))),
                                         model.trainables, load)
    return float(total) / y.size, model.canonical_grads(grads), [c.numpy() for c in load]


@pytest.mark.parametrize("checkpoint", (False, True))
def test_the_aux_loss_gradients_match_the_float64_reference(backend, checkpoint):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 1)
    loss, grads, _ = tf_gradients(backend, graph, weights, x, y, ALPHA, checkpoint)
    want_loss, want, _ = executor.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)
    _, without, _ = executor.loss_and_grads(graph, weights, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)  # the cross-entropy alone
    (moe,) = [n.id for n in graph.nodes if n.op == "moe"]
    aux_part = np.abs(want[moe]["router"] - without[moe]["router"]).max()
    scale = max(np.abs(value).max() for params in want.values() for value in params.values())
    assert aux_part > 100 * 1e-5 * scale  # the aux term is far above the tolerance
    for node, params in want.items():
        for name, value in params.items():  # fp32 against float64, on the largest gradient's scale
            np.testing.assert_allclose(grads[node][name], value, rtol=0, atol=1e-5 * scale, err_msg=f"{node}/{name}")


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

    routed, compiled = tf.function(gradients)(x, y), tf.function(gradients, jit_compile=True)(x, y)
    np.testing.assert_array_equal(compiled[1][0].numpy(), routed[1][0].numpy())
    scale = max(float(np.abs(g.numpy()).max()) for g in routed[0])  # the largest gradient's
    for got, want in zip(compiled[0], routed[0]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=1e-5 * scale)


def test_one_pass_counts_the_reference_routing(backend):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 2)
    (counts,) = tf_gradients(backend, graph, weights, x, y, ALPHA)[2]
    (want,) = executor.expert_load(graph, weights, x).values()
    assert tuple(int(c) for c in counts) == want
    assert sum(want) == x.size * graph[[n.id for n in graph.nodes if n.op == "moe"][0]].attrs["top_k"]


def dataset(graph, n: int) -> Dataset:
    x, y = batch(graph, 3, n)
    xv, yv = batch(graph, 4, 2)
    return Dataset(x, y, xv, yv, graph.vocab)


def config(n: int, alpha: float, **options) -> TrainConfig:
    settings = dict(epochs=2, batch_size=n, schedule=Schedule(0.01), optimizer="adamw", weight_decay=0.1,
                    moe_aux_loss=alpha)
    return TrainConfig(**{**settings, **options})


def train(backend, graph, weights, data, cfg):
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, cfg)
    return reports, backend.export_weights(model)


def test_epochs_report_the_routing_their_steps_ran_and_the_cross_entropy_alone(backend):
    """One step an epoch (the whole set), so that each epoch's routing is the reference's on the weights
    the epoch began with; the step's loss is the cross-entropy with or without the aux term."""
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    n = 8
    data = dataset(graph, n)
    reports, _ = train(backend, graph, weights, data, config(n, ALPHA))
    plain, _ = train(backend, graph, weights, data, config(n, 0.0))
    (moe,) = [node.id for node in graph.nodes if node.op == "moe"]
    assert reports[0].loss == pytest.approx(plain[0].loss, rel=1e-6)
    assert reports[0].expert_load == {moe: executor.expert_load(graph, weights, data.x_train)[moe]}
    middle = train(backend, graph, weights, data, config(n, ALPHA, epochs=1))[1]
    assert reports[1].expert_load == {moe: executor.expert_load(graph, middle, data.x_train)[moe]}
    assert all(sum(r.expert_load[moe]) == data.x_train.size * 2 for r in reports)


def test_a_graph_without_a_moe_reports_no_expert_load(backend):
    graph = _gpt("gpt")
    reports, _ = train(backend, graph, trained_looking_weights(graph, 0), dataset(graph, 4), config(4, ALPHA, epochs=1))
    assert reports[0].expert_load is None


def test_micro_batches_take_the_whole_batch_step_and_count_its_routing(backend):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    n = 7  # micro-batches of 3, 3 and 1: the aux term's weights are their shares of the sequences
    data = dataset(graph, n)
    # SGD: an update in proportion to the gradient (AdamW's would blow up the rounding of zero gradients).
    sgd = dict(epochs=1, optimizer="sgd-momentum", weight_decay=0.0)
    whole, want = train(backend, graph, weights, data, config(n, ALPHA, **sgd))
    micro, got = train(backend, graph, weights, data, config(n, ALPHA, micro_batch=3, **sgd))
    assert micro[0].expert_load == whole[0].expert_load
    for node, params in want.items():
        for name, value in params.items():
            np.testing.assert_allclose(got[node][name], value, rtol=0, atol=2e-6, err_msg=f"{node}/{name}")


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


def test_two_data_parallel_devices_take_the_one_device_step_and_count_every_shard():
    """Two CPU devices (a fresh process: AIPERF_CPU_DEVICES is read when TensorFlow loads), 9 sequences cut
    5 and 4: the aux term is weighted by each shard's sequences, the counts all-reduced."""
    import json

    env = dict(os.environ, AIPERF_CPU_DEVICES="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_DATA_PARALLEL_SCRIPT)],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    one, two = result["1"], result["2"]
    assert two["load"] == one["load"] and sum(next(iter(one["load"].values()))) == 9 * 16 * 2
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    for key, value in one["weights"].items():
        np.testing.assert_allclose(two["weights"][key], value, rtol=0, atol=2e-6, err_msg=key)
