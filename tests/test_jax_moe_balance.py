"""The JAX backend's load balance of a mixture of experts (issue 40): the load-balancing loss
(TrainConfig.moe_aux_loss) in the gradient of its training step, and the experts' loads it reports
(EpochReport.expert_load), on a small GPT whose MLP is upcycled to 4 experts, 2 per token.

* one SGD step of lr 1 without momentum moves the weights by minus the gradient: it must be the NumPy
  reference's float64 gradient of the cross-entropy plus the load-balancing loss, in the fused step, in
  accumulated micro-batches and with checkpointed blocks, while EpochReport.loss stays the cross-entropy;
* expert_load is, per epoch, the routing of every training sequence counted by the reference (with lr 0
  the weights, so the routing, stay those of the start), and None without a moe node;
* two host devices (data parallelism, fused and accumulated, a short last batch replicated) train to the
  weights, losses and loads of one.

The two-device test runs in a subprocess (AIPERF_CPU_DEVICES must be read before jax initialises), started
in the background with the module's first test.
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

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.registry import load_backend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_numpy import executor
from beside import beside

ROOT = Path(__file__).resolve().parents[1]
SIZES = dict(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
ALPHA = 1.0  # large, so that the load-balancing gradient is a good part of the router's (checked below)


def _graph_and_weights():
    graph = upcycle_moe(gpt(**SIZES), None, "h0_fc1", seed=5).graph
    return graph, trained_looking_weights(graph, 0)


def _tokens(n: int, seed: int):
    tokens = np.random.default_rng(seed).integers(0, SIZES["vocab"], (n, SIZES["seq_len"] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _float64(weights):
    return {n: {p: np.asarray(a, np.float64) for p, a in ps.items()} for n, ps in weights.items()}


def _normwise_error(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch,checkpoint_blocks", [(None, False), (3, False), (None, True)])
def test_a_step_takes_the_reference_gradient_of_the_cross_entropy_and_the_load_balancing_loss(
        micro_batch, checkpoint_blocks):
    graph, weights = _graph_and_weights()
    x, y = _tokens(8, 1)
    loss, want, _ = executor.loss_and_grads(graph, _float64(weights), x, y, moe_aux_loss=ALPHA)
    _, cross_entropy_only, _ = executor.loss_and_grads(graph, _float64(weights), x, y)
    (moe,) = [node.id for node in graph.nodes if node.op == "moe"]
    # the load-balancing loss moves the router's gradient by far more than the tolerance below
    assert _normwise_error(cross_entropy_only[moe]["router"], want[moe]["router"]) > 0.1

    backend = load_backend("jax")
    model = backend.lower(graph, weights)
    config = TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(initial=1.0), momentum=0.0,
                         moe_aux_loss=ALPHA, micro_batch=micro_batch, checkpoint_blocks=checkpoint_blocks)
    (report,) = backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    after = backend.export_weights(model)
    for node_id, grads in want.items():
        for name, grad in grads.items():
            if np.linalg.norm(grad) < 1e-12:  # the attention key bias: its exact gradient is zero
                continue
            step = weights[node_id][name].astype(np.float64) - after[node_id][name]
            assert _normwise_error(step, grad) < 2e-5, f"{node_id}.{name}"
    np.testing.assert_allclose(report.loss, loss, rtol=1e-6)  # the cross-entropy alone


@pytest.mark.slow
def test_expert_load_counts_the_routing_of_every_training_sequence_each_epoch():
    graph, weights = _graph_and_weights()
    x, y = _tokens(10, 2)
    want = executor.expert_load(graph, _float64(weights), x)
    (moe,) = want
    assert sum(want[moe]) == len(x) * SIZES["seq_len"] * 2 and min(want[moe]) < max(want[moe])
    backend = load_backend("jax")
    model = backend.lower(graph, weights)
    # lr 0: the weights, so the routing, stay the initial ones; batches 4, 4, 2, in micro-batches 3 and 1
    config = TrainConfig(epochs=2, batch_size=4, schedule=Schedule(initial=0.0), moe_aux_loss=ALPHA, micro_batch=3)
    reports = backend.train(model, Dataset(x, y, x[:2], y[:2], graph.vocab), config)
    assert [dict(r.expert_load) for r in reports] == [want, want]

    dense = gpt(**SIZES)  # one batch of 4: one step compiled, not two
    (report,) = backend.train(backend.lower(dense, trained_looking_weights(dense, 0)),
                              Dataset(x[:4], y[:4], x[:2], y[:2], dense.vocab), TrainConfig(epochs=1, batch_size=4))
    assert report.expert_load is None


_TWO_DEVICES = """
    import json
    import numpy as np
    SIZES = {sizes}
    from aiperf_backends.jax import JaxBackend
    from aiperf_conformance.cases import trained_looking_weights
    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.builders import gpt
    from aiperf_core.morph.transformer import upcycle_moe

    backend = JaxBackend()
    graph = upcycle_moe(gpt(**SIZES), None, "h0_fc1", seed=5).graph
    weights = trained_looking_weights(graph, 0)
    # 11 sequences in batches of 8 (split 4 + 4) and 3 (replicated: it does not split)
    tokens = np.random.default_rng(3).integers(0, graph.vocab, (11, graph.input_shape[0] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    runs = {}
    for name, devices, micro in (("one", ("cpu:0",), None), ("two", ("cpu:0", "cpu:1"), None),
                                 ("two_accumulated", ("cpu:0", "cpu:1"), 3)):
        model = backend.lower(graph, weights)
        config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(0.1), moe_aux_loss=0.5, devices=devices,
                             micro_batch=micro)
        reports = backend.train(model, Dataset(x, y, x[:4], y[:4], graph.vocab), config)
        runs[name] = {"weights": backend.export_weights(model), "loss": [r.loss for r in reports],
                      "load": [dict(r.expert_load) for r in reports]}
    one = runs["one"]["weights"]
    worst = {name: max(float(np.max(np.abs(one[n][p] - run["weights"][n][p]))) for n in one for p in one[n])
             for name, run in runs.items()}
    print(json.dumps({"devices": backend.devices(), "worst": worst,
                      "loss": {name: run["loss"] for name, run in runs.items()},
                      "load": {name: run["load"] for name, run in runs.items()}}))
"""


def _run_two_devices(environ: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in environ.items() if k not in ("XLA_FLAGS", "AIPERF_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", AIPERF_CPU_DEVICES="2")
    script = textwrap.dedent(_TWO_DEVICES).replace("{sizes}", repr(SIZES))
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module", autouse=True)
def two_devices(request):
    """The two-device subprocess, started with the module's first test when its test is selected, so that the
    in-process tests run beside it (it is one more process, mostly on one core); its test waits for it."""
    yield from beside(request, "test_two_host_devices_give_the_weights_losses_and_loads_of_one",
                      _run_two_devices, dict(os.environ))


@pytest.mark.slow
def test_two_host_devices_give_the_weights_losses_and_loads_of_one(two_devices):
    out = two_devices.result()
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == ["cpu:0", "cpu:1"]
    assert max(r["worst"].values()) < 2e-5, r["worst"]
    for name in ("two", "two_accumulated"):
        np.testing.assert_allclose(r["loss"][name], r["loss"]["one"], rtol=1e-5)
        assert r["load"][name] == r["load"]["one"]
    tokens = 11 * SIZES["seq_len"] * 2
    assert all(sum(counts) == tokens for epoch in r["load"]["one"] for counts in epoch.values())
