"""The mixture-of-experts load-balance tests (issue 40, item 4) that the TensorFlow and MindSpore backends'
test modules share: each module star-imports the test_* functions in __all__ (pytest collects them there) and
defines two fixtures, `backend` and `gradients`, the latter its `gradients(backend, graph, weights, x, y, alpha,
checkpoint=False)`: one training pass's (cross-entropy, canonical gradients, assignments per expert), which
these hold to the float64 NumPy reference. `run_data_parallel` runs a backend's two-device script."""

from __future__ import annotations

import numpy as np
import pytest

from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.levels.train import _gpt
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_numpy import executor

from cpu_devices import run_on_cpu_devices

__all__ = [  # the shared tests, collected in each module that star-imports them
    "test_the_aux_loss_gradients_match_the_float64_reference",
    "test_one_pass_counts_the_reference_routing",
    "test_epochs_report_the_routing_their_steps_ran_and_the_cross_entropy_alone",
    "test_a_graph_without_a_moe_reports_no_expert_load",
    "test_micro_batches_take_the_whole_batch_step_and_count_its_routing",
]

ALPHA = 0.1
SEQUENCES = 6


def batch(graph, seed: int, n: int = SEQUENCES):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def moe_id(graph) -> str:
    (moe,) = [n.id for n in graph.nodes if n.op == "moe"]
    return moe


@pytest.mark.parametrize("checkpoint", (False, True))
def test_the_aux_loss_gradients_match_the_float64_reference(backend, gradients, checkpoint):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 1)
    loss, grads, _ = gradients(backend, graph, weights, x, y, ALPHA, checkpoint)
    want_loss, want, _ = executor.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)
    _, without, _ = executor.loss_and_grads(graph, weights, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-5)  # the cross-entropy alone
    moe = moe_id(graph)
    aux_part = np.abs(want[moe]["router"] - without[moe]["router"]).max()
    scale = max(np.abs(value).max() for params in want.values() for value in params.values())
    assert aux_part > 100 * 1e-5 * scale  # the aux term is far above the tolerance
    for node, params in want.items():
        for name, value in params.items():  # fp32 against float64, on the largest gradient's scale
            np.testing.assert_allclose(grads[node][name], value, rtol=0, atol=1e-5 * scale, err_msg=f"{node}/{name}")


def test_one_pass_counts_the_reference_routing(backend, gradients):
    graph = _gpt("gpt_moe")
    weights = trained_looking_weights(graph, 0)
    x, y = batch(graph, 2)
    (counts,) = gradients(backend, graph, weights, x, y, ALPHA)[2]
    (want,) = executor.expert_load(graph, weights, x).values()
    assert tuple(int(c) for c in counts) == want
    top_k = graph[moe_id(graph)].attrs["top_k"]
    assert top_k == 2 and sum(want) == x.size * top_k


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
    moe = moe_id(graph)
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


def run_data_parallel(script: str):
    """The script's runs on one and on two CPU devices (AIPERF_CPU_DEVICES=2 in a fresh process), each a dict
    of `load`, `loss` and `weights` (key "node/param"), the two runs' weights within 2e-6 of each other."""
    result = run_on_cpu_devices(script)
    one, two = result["1"], result["2"]
    for key, value in one["weights"].items():
        np.testing.assert_allclose(two["weights"][key], value, rtol=0, atol=2e-6, err_msg=key)
    return one, two
