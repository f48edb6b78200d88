"""The torch backend's load balance of a mixture of experts (issue 40, item 4): the load-balancing loss
(TrainConfig.moe_aux_loss) in the gradient a training step takes, against the NumPy reference's float64
`loss_and_grads(..., moe_aux_loss=...)`, whole steps and accumulated micro-batches alike; and
EpochReport.expert_load, the routing that the training forwards ran, counted over an epoch and over
data-parallel ranks.

The model is a 2-layer GPT whose first MLP is upcycled to 8 experts, top-2, with trained-looking weights
(distinct experts, a random router). float32 against float64 agrees to ~1e-6 normwise; 1e-5 is the bound.
The attention key biases are left out, as the kit leaves them out: their exact gradient is zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)

from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.training import Stepper
from aiperf_conformance.cases import trained_looking_weights
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.morph import transformer as transformer_morph
from aiperf_numpy import executor

from cpu_devices import run_on_cpu_devices
from test_torch_step_memory import normwise, worst

TOL = 1e-5
SEQ, VOCAB, EXPERTS, TOP_K = 16, 64, 8, 2
ALPHA = 0.1  # the kit's coefficient: ten times the lm policy's, so that its gradient is a visible part


def upcycled_gpt():
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    morphed = transformer_morph.upcycle_moe(graph, None, "h0_fc1", experts=EXPERTS, top_k=TOP_K, seed=1)
    return morphed.graph, trained_looking_weights(morphed.graph, 2)


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.fixture(scope="module")
def upcycled():
    graph, weights = upcycled_gpt()
    (moe_id,) = (n.id for n in graph.nodes if n.op == "moe")
    return graph, weights, moe_id


def tokens(seed: int, sequences: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, VOCAB, (sequences, SEQ)) for _ in range(2))


# -- the loss ------------------------------------------------------------------------------------------


def test_the_balance_is_one_per_sequence_at_an_even_router(backend, upcycled):
    """A zero router gives every expert the probability 1/E: E sum_e f_e / E is 1 whatever the choices."""
    graph, weights, moe_id = upcycled
    model = backend.lower(graph, {**weights, moe_id: {**weights[moe_id], "router": np.zeros((32, EXPERTS))}})
    model.train()
    with torch.no_grad():
        model(torch.from_numpy(tokens(0, 5)[0]))
    routing = model.experts[moe_id].routing
    assert float(routing.balance) == pytest.approx(5.0, rel=1e-6)
    assert routing.load.tolist() == [5 * SEQ] * TOP_K + [0] * (EXPERTS - TOP_K)  # ties to the lower index


def test_the_balance_is_the_references_load_balancing_loss(backend, upcycled):
    """Summed over the sequences, so that micro-batches and ranks add it up; the reference's is alpha times
    the mean."""
    graph, weights, moe_id = upcycled
    x, _ = tokens(1, 6)
    model = backend.lower(graph, weights)
    model.train()
    with torch.no_grad():
        model(torch.from_numpy(x))
    trace = executor.run(graph, weights, x, training=True, moe_aux_loss=ALPHA)
    assert float(model.experts[moe_id].routing.balance) * ALPHA / len(x) == pytest.approx(
        trace.aux_losses[moe_id], rel=1e-6)


@pytest.mark.parametrize("micro_batch", [None, 3])
@pytest.mark.parametrize("alpha", [0.0, ALPHA])
def test_the_steps_gradient_is_the_references_with_the_load_balancing_loss(backend, upcycled, alpha, micro_batch):
    """The gradient the update takes is that of the cross-entropy plus alpha times the load-balancing loss
    (micro-batches of 3, 3 and 2 sequences weighted by their share); the loss the step returns stays the
    cross-entropy alone."""
    graph, weights, moe_id = upcycled
    x, y = tokens(2, 8)
    model = backend.lower(graph, weights)
    config = TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(initial=0.01), moe_aux_loss=alpha,
                         micro_batch=micro_batch)
    loss = Stepper(model, "cpu", config).step(torch.from_numpy(x), torch.from_numpy(y), len(x))
    want_loss, want, _ = executor.loss_and_grads(graph, weights, x, y, moe_aux_loss=alpha)
    assert float(loss) / len(x) == pytest.approx(want_loss, rel=TOL)
    err, where = worst(model.canonical_grads(), want)
    assert err <= TOL, f"gradient {where} differs by {err:.3g}"
    if alpha:  # not vacuous: the load-balancing loss moves the router's gradient well beyond the bound
        _, plain, _ = executor.loss_and_grads(graph, weights, x, y)
        assert normwise(want[moe_id]["router"], plain[moe_id]["router"]) > 1000 * TOL


# -- the load ------------------------------------------------------------------------------------------


def test_an_epochs_expert_load_is_the_routing_of_its_training_forwards_counted(backend, upcycled):
    """Two AdamW steps (the second routes on the first's weights): the epoch's load equals each training
    forward's top-2 of its input's router logits, counted here in float64; evaluation routes nothing in."""
    graph, weights, moe_id = upcycled
    x, y = tokens(3, 8)
    model = backend.lower(graph, weights)
    counted = np.zeros(EXPERTS, np.int64)

    def count(module, args, output):
        if module.training:
            flat = args[0].detach().double().reshape(-1, 32).numpy()
            logits = flat @ module.router.detach().double().numpy()
            chosen = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP_K]
            counted[:] += np.bincount(chosen.ravel(), minlength=EXPERTS)

    model.experts[moe_id].register_forward_hook(count)
    config = TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.01), optimizer="adamw",
                         moe_aux_loss=ALPHA)
    (report,) = backend.train(model, Dataset(x, y, x[:2], y[:2], VOCAB), config)
    assert report.expert_load == {moe_id: tuple(int(c) for c in counted)}
    assert sum(report.expert_load[moe_id]) == len(x) * SEQ * TOP_K
    assert model.experts[moe_id].routing is None  # taken by the step: nothing of the graph is kept


def test_a_graph_without_moe_reports_no_expert_load(backend):
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    x, y = tokens(4, 4)
    config = TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.01), moe_aux_loss=ALPHA)
    (report,) = backend.train(backend.lower(graph, trained_looking_weights(graph, 0)), Dataset(x, y, x, y, VOCAB),
                              config)
    assert report.expert_load is None


_TRAIN_SCRIPT = """
import json
import numpy as np
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_backends.torch import TorchBackend
from tests.test_torch_moe_balance import VOCAB, tokens, upcycled_gpt

graph, weights = upcycled_gpt()
x, y = tokens(5, 16)
# 14 training sequences in batches of 7: shards of 4 and 3, micro-batches of 2.
data = Dataset(x[:14], y[:14], x[14:], y[14:], VOCAB)
config = dict(epochs=2, batch_size=7, schedule=Schedule(initial=0.05), seed=3, moe_aux_loss=0.1, micro_batch=2)
backend = TorchBackend()
out = {"devices": backend.devices(), "runs": {}}
for name, devices in (("one", (backend.devices()[0],)), ("all", None)):
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, TrainConfig(devices=devices, **config))
    out["runs"][name] = {"loads": [r.expert_load for r in reports], "losses": [r.loss for r in reports],
                         "weights": {n: {p: a.tolist() for p, a in ps.items()}
                                     for n, ps in backend.export_weights(model).items()}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_two_cpu_devices_give_one_devices_expert_load_and_weights():
    """AIPERF_CPU_DEVICES=2: two epochs on two gloo ranks (uneven shards, accumulated micro-batches, the
    load-balancing loss on) report one device's expert load, summed over the ranks, and train its weights."""
    out = run_on_cpu_devices(_TRAIN_SCRIPT)
    assert out["devices"] == ["cpu:0", "cpu:1"]
    one, both = out["runs"]["one"], out["runs"]["all"]
    assert both["loads"] == one["loads"]
    assert [sum(load) for epoch in one["loads"] for load in epoch.values()] == [14 * SEQ * TOP_K] * 2
    assert both["losses"] == pytest.approx(one["losses"], rel=TOL)
    as_arrays = [{n: {p: np.asarray(a, np.float32) for p, a in ps.items()} for n, ps in run["weights"].items()}
                 for run in (both, one)]
    err, where = worst(*as_arrays)
    assert err <= TOL, f"weight {where} differs by {err:.3g} after data-parallel training"
