"""MindSpore's mixture-of-experts load balance (issue 40, item 4): the gradients of the cross-entropy plus
TrainConfig.moe_aux_loss times the sequence-wise load-balancing loss equal the float64 NumPy reference's,
with and without activation checkpointing, and a step over micro-batches or two data-parallel CPU workers
is the step on the whole batch; EpochReport.loss stays the cross-entropy; EpochReport.expert_load counts
the routing the training steps ran, per epoch (None without a moe).
"""

from __future__ import annotations


import numpy as np
import pytest

from aiperf_backends.mindspore import MindSporeBackend

# `make test` installs MindSpore: a missing one is a failure here, never a skip.
assert MindSporeBackend.availability().available, MindSporeBackend.availability().reason

from mindspore import Tensor  # noqa: E402

from aiperf_backends.mindspore.lowering import to_canonical  # noqa: E402
from aiperf_backends.mindspore.training import gradient_function, preserved, targets  # noqa: E402

from moe_balance_checks import *  # noqa: E402, F403  (the shared tests, collected here with these fixtures)
from moe_balance_checks import run_data_parallel  # noqa: E402
from beside import beside


@pytest.fixture(scope="module")
def backend():
    return MindSporeBackend()


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


@pytest.fixture(scope="module")
def gradients():
    return ms_gradients


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


@pytest.fixture(scope="module", autouse=True)
def two_devices(request):
    """The two-device subprocess (AIPERF_CPU_DEVICES is read when the framework starts),
    started with the module's first test when its test is selected, so that the in-process tests run beside it
    (one more process, mostly on one core); its test waits for it."""
    yield from beside(request, "test_two_data_parallel_workers_take_the_one_device_step_and_count_every_shard",
                      run_data_parallel, _DATA_PARALLEL_SCRIPT)


@pytest.mark.slow
def test_two_data_parallel_workers_take_the_one_device_step_and_count_every_shard(two_devices):
    """Two CPU workers (a fresh process: AIPERF_CPU_DEVICES is read when the backend first loads MindSpore),
    batches of 5 and 4 sequences cut 3 + 2 and 2 + 2: the aux term weighted by each shard's sequences,
    the counts summed over the ranks; two epochs, each with its own counts."""
    one, two = two_devices.result()
    assert two["load"] == one["load"]
    assert all(sum(next(iter(load.values()))) == 9 * 16 * 2 for load in one["load"])
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-6)
