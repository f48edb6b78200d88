"""Expert parallelism in the contract and the policy: the lm item `expert_parallel` and how a replica
resolves it per trial, the contract's refusal (a backend that does not declare it, experts that do not
divide by the devices), the experts each device holds, and the all-to-all bytes an epoch logs."""

from __future__ import annotations

import pytest

from aiperf_core.backend import (BackendError, Dataset, EpochReport, Parallelism, TrainConfig, check_expert_parallel,
                                 expert_shard)
from aiperf_core.builders import gpt
from aiperf_core.errors import GraphError
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.policy import Policy, PolicyError
from aiperf_core.replica import all_to_all_fields, expert_parallel
from aiperf_numpy.backend import NumpyBackend

import numpy as np


def moe_gpt(experts: int = 4):
    return upcycle_moe(gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32), None, "h0_fc1", experts=experts,
                       seed=5).graph


class Devices(NumpyBackend):
    """A NumPy backend that shows `count` devices and declares `parallel`."""

    name = "devices"

    def __init__(self, count: int, parallel: Parallelism):
        super().__init__()
        self.count, self.parallel = count, parallel

    def devices(self):
        return [f"cpu:{i}" for i in range(self.count)]

    def parallelism(self):
        return self.parallel


EXPERT_PARALLEL = Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True)
DATA_PARALLEL = Parallelism(data_parallel=True, synchronized_batch_norm=True,
                            expert_parallel_why_not="its collectives cannot exchange tokens")


def test_the_item_is_the_lm_tracks_and_defaults_to_auto():
    assert Policy({"workload": "lm"})["expert_parallel"] == "auto"
    assert Policy({"workload": "lm", "expert_parallel": "none"})["expert_parallel"] == "none"
    with pytest.raises(PolicyError, match=r"policy\.expert_parallel"):
        Policy({"workload": "lm", "expert_parallel": "always"})
    with pytest.raises(PolicyError, match=r"policy\.expert_parallel"):
        Policy({"expert_parallel": "auto"})  # the cnn track has no experts


def test_auto_is_on_only_where_backend_devices_and_experts_allow_it():
    lm = Policy({"workload": "lm"})
    assert expert_parallel(lm, Devices(2, EXPERT_PARALLEL), moe_gpt(4))
    assert not expert_parallel(Policy({"workload": "lm", "expert_parallel": "none"}), Devices(2, EXPERT_PARALLEL),
                               moe_gpt(4))
    assert not expert_parallel(lm, Devices(1, EXPERT_PARALLEL), moe_gpt(4))  # one device: nothing to shard
    assert not expert_parallel(lm, Devices(2, DATA_PARALLEL), moe_gpt(4))  # the backend cannot
    assert not expert_parallel(lm, Devices(2, EXPERT_PARALLEL), moe_gpt(3))  # 3 experts on 2 devices
    assert not expert_parallel(lm, Devices(2, EXPERT_PARALLEL), gpt(layers=1, hidden=16, heads=2, seq_len=8,
                                                                      vocab=32))  # no moe node
    assert expert_parallel(lm, Devices(4, EXPERT_PARALLEL), moe_gpt(8))


def test_each_device_holds_a_contiguous_block_of_experts():
    assert [expert_shard(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [expert_shard(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert expert_shard(4, 1, 0) == (0, 4)


def test_the_contract_refuses_what_cannot_run_and_names_why():
    on = TrainConfig(epochs=1, batch_size=4, expert_parallel=True)
    assert check_expert_parallel(Devices(2, EXPERT_PARALLEL), moe_gpt(4), on, 2)
    assert not check_expert_parallel(Devices(2, EXPERT_PARALLEL), moe_gpt(4), on, 1)
    assert not check_expert_parallel(Devices(2, DATA_PARALLEL), gpt(layers=1, hidden=16, heads=2, seq_len=8,
                                                                    vocab=32), on, 2)
    assert not check_expert_parallel(Devices(2, DATA_PARALLEL), moe_gpt(4), TrainConfig(epochs=1, batch_size=4), 2)
    with pytest.raises(BackendError, match="^backend 'devices' does not implement expert parallelism: its "
                                           "collectives cannot exchange tokens$"):
        check_expert_parallel(Devices(2, DATA_PARALLEL), moe_gpt(4), on, 2)
    with pytest.raises(GraphError, match="^node 'm1_moe': expert parallelism over 2 devices needs experts that "
                                         "divide by them, the node has 3$"):
        check_expert_parallel(Devices(2, EXPERT_PARALLEL), moe_gpt(3), on, 2)


def test_backend_train_refuses_before_anything_trains():
    backend = Devices(2, DATA_PARALLEL)
    graph = moe_gpt(4)
    model = backend.lower(graph)
    before = backend.export_weights(model)
    tokens = np.random.default_rng(0).integers(0, 32, (6, 9))
    data = Dataset(tokens[:4, :-1], tokens[:4, 1:], tokens[4:, :-1], tokens[4:, 1:], 32)
    with pytest.raises(BackendError, match="does not implement expert parallelism"):
        backend.train(model, data, TrainConfig(epochs=1, batch_size=4, expert_parallel=True))
    after = backend.export_weights(model)
    assert all(np.array_equal(after[n][p], before[n][p]) for n in before for p in before[n])


def test_the_epoch_log_carries_analytic_bytes_and_measured_seconds():
    report = EpochReport(0, 35, 5, 1.0, 1.0, 0.1, all_to_all_seconds=0.5)
    fields = all_to_all_fields(report, (4096, 2048))
    assert fields == {"all_to_all": {"bytes": 35 * 4096 + 5 * 2048, "seconds": 0.5,
                                     "bytes_per_second": (35 * 4096 + 5 * 2048) / 0.5}}
    assert all_to_all_fields(report, None) == {}  # the trial did not run expert-parallel
    assert all_to_all_fields(EpochReport(0, 35, 5, 1.0, 1.0, 0.1), (4096, 2048)) == {}  # nothing measured


def test_the_memory_estimate_holds_a_devices_share_of_the_experts():
    from aiperf_opcount.memory import estimate, plan_memory

    graph = moe_gpt(4)
    stacks = sum(int(np.prod(shape)) for name, shape in graph.param_shapes("m1_moe").items() if name != "router")
    one, two = (estimate(graph, 2, "bf16", "adamw", expert_devices=d) for d in (1, 2))
    half = stacks // 2
    assert one.parameters - two.parameters == half * 4 + half * 2  # float32 masters and the bf16 copies
    assert one.gradients - two.gradients == half * 4
    assert one.optimizer_state - two.optimizer_state == half * 8
    assert one.activations == two.activations
    assert plan_memory(graph, 4, None, expert_devices=2).estimate == estimate(graph, 4, expert_devices=2)
    with pytest.raises(Exception, match="expert_devices must be a positive integer, got 0"):
        estimate(graph, 2, expert_devices=0)
