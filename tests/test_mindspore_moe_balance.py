"""MindSpore's mixture-of-experts load balance (issue 40, item 4): the gradients of the cross-entropy plus
TrainConfig.moe_aux_loss times the sequence-wise load-balancing loss equal the float64 NumPy reference's,
with and without activation checkpointing, and a step over micro-batches or two data-parallel CPU workers
is the step on the whole batch; EpochReport.loss stays the cross-entropy; EpochReport.expert_load counts
the routing the training steps ran, per epoch (None without a moe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aiperf_backends.mindspore import MindSporeBackend

# `make test` installs MindSpore: a missing one is a failure here, never a skip.
assert MindSporeBackend.availability().available, MindSporeBackend.availability().reason

from mindspore import Tensor  # noqa: E402

from aiperf_backends.mindspore.lowering import to_canonical  # noqa: E402
from aiperf_backends.mindspore.training import gradient_function, preserved, targets  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.train import _gpt  # noqa: E402
from aiperf_core.backend import Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_numpy import executor  # noqa: E402

ALPHA = 0.1
SEQUENCES = 6


@pytest.fixture(scope="module")
def backend():
    return MindSporeBackend()


def batch(graph, seed: int, n: int = SEQUENCES):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def ms_gradients(backend, graph, weights, x, y, alpha: float, checkpoint: bool = False):
    """The training objective's (cross-entropy, canonical gradients, assignments per expert) of one pass."""
    model = backend.lower(graph, weights)
    trainable = model.trainable()
    with preserved(model), model.checkpointing(checkpoint):
        model.set_train(True)
        grad_fn = gradient_function(model, [p for _, _, p in trainable], alpha)
        (_, total), grads = grad_fn(model.to_cell_layout(x), targets(y, graph.output_shape[-1], 0.0), None,
                                    Tensor(np.float32(1.0 / len(x))))
        counts = model.expert_counts()
        model.set_train(False)
    out = {node_id: {} for node_id in graph.all_param_shapes()}
    for (node_id, pname, _), grad in zip(trainable, grads):
        out[node_id][pname] = to_canonical(pname, grad.asnumpy())
    return float(total.asnumpy()) / len(x), out, counts


@pytest.mark.parametrize("checkpoint", (False, True))
def test_the_aux_loss_gradients_match_the_float64_reference(backend, checkpoint):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 1)
    loss, grads, _ = ms_gradients(backend, graph, weights, x, y, ALPHA, checkpoint)
    want_loss, want, _ = executor.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)
    _, without, _ = executor.loss_and_grads(graph, weights, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)  # the cross-entropy alone
    (moe,) = [n.id for n in graph.nodes if n.op == "moe"]
    scale = max(np.abs(value).max() for params in want.values() for value in params.values())
    assert np.abs(want[moe]["router"] - without[moe]["router"]).max() > 100 * 1e-5 * scale  # far above the tolerance
    for node, params in want.items():
        for name, value in params.items():  # fp32 against float64, on the largest gradient's scale
            np.testing.assert_allclose(grads[node][name], value, rtol=0, atol=1e-5 * scale, err_msg=f"{node}/{name}")


def test_one_pass_counts_the_reference_routing(backend):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 2)
    (counts,) = ms_gradients(backend, graph, weights, x, y, ALPHA)[2]
    (want,) = executor.expert_load(graph, weights, x).values()
    assert tuple(int(c) for c in counts) == want
    assert sum(want) == x.size * 2  # top-2


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
from aiperf_backends.mindspore import MindSporeBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.levels.train import _gpt
from aiperf_core.backend import Dataset, Schedule, TrainConfig

backend = MindSporeBackend()
graph = _gpt("gpt_moe")
weights = trained_looking_weights(graph, 0)
tokens = np.random.default_rng(3).integers(0, graph.vocab, (9, graph.input_shape[0] + 1))
data = Dataset(tokens[:, :-1], tokens[:, 1:], tokens[:2, :-1], tokens[:2, 1:], graph.vocab)
result = {}
for devices in (("cpu:0",), ("cpu:0", "cpu:1")):
    model = backend.lower(graph, weights)
    config = TrainConfig(epochs=2, batch_size=5, schedule=Schedule(0.1), moe_aux_loss=0.1, devices=devices)
    reports = backend.train(model, data, config)
    result[len(devices)] = dict(load=[r.expert_load for r in reports], loss=[r.loss for r in reports],
                                weights={f"{n}/{k}": v.tolist() for n, p in backend.export_weights(model).items()
                                         for k, v in p.items()})
print(json.dumps(result))
"""


def test_two_data_parallel_workers_take_the_one_device_step_and_count_every_shard():
    """Two CPU workers (a fresh process: AIPERF_CPU_DEVICES is read when the backend first loads MindSpore),
    batches of 5 and 4 sequences cut 3 + 2 and 2 + 2: the aux term weighted by each shard's sequences,
    the counts summed over the ranks; two epochs, each with its own counts."""
    env = dict(os.environ, AIPERF_CPU_DEVICES="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_DATA_PARALLEL_SCRIPT)],
                         cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    one, two = result["1"], result["2"]
    assert two["load"] == one["load"]
    assert all(sum(next(iter(load.values()))) == 9 * 16 * 2 for load in one["load"])
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
    for key, value in one["weights"].items():
        np.testing.assert_allclose(two["weights"][key], value, rtol=0, atol=2e-6, err_msg=key)
