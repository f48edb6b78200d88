"""The kit's parallel/gpt_moe_expert_parallel_* checks against fake backends built on the NumPy
reference: emulated expert parallelism that trains the global batch and measures its exchanges
passes; one that does not measure them, one that exports only its own device's experts, and one
that reports a device's expert load instead of the global batch's each fail the check and say why;
a data-parallel backend without expert parallelism passes the refusal check only with a reason."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from aiperf_core.backend import Parallelism
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import Context, collect, run_check
from aiperf_conformance.levels.parallel import (DATA_PARALLEL_CHECKS, EXPERT_PARALLEL_CHECK, EXPERT_PARALLEL_REFUSED,
                                                MULTI_NODE_REFUSED, run_scenarios)
from test_conformance_parallel import TwoDevices

EXPERT_PARALLEL = Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True,
                              multi_node_why_not="emulated on one host", notes="emulated")


class ExpertParallel(TwoDevices):
    """Trains the global batch (what expert parallelism computes) and reports a measured exchange time."""

    name = "expertparallel"

    def parallelism(self):
        return EXPERT_PARALLEL

    def train_checked(self, model, data, config, on_epoch):
        reports = super().train_checked(model, data, config, on_epoch)
        if config.expert_parallel and len(self.train_devices(config)) > 1:
            reports = [replace(r, all_to_all_seconds=0.002) for r in reports]
        return reports


class UnmeasuredExchanges(ExpertParallel):
    name = "unmeasured"

    def train_checked(self, model, data, config, on_epoch):
        return [replace(r, all_to_all_seconds=None) for r in super().train_checked(model, data, config, on_epoch)]


class ExportsItsOwnExperts(ExpertParallel):
    """Exports device 0's half of every expert stack after an expert-parallel run."""

    name = "ownexperts"
    sharded = False

    def train_checked(self, model, data, config, on_epoch):
        self.sharded = config.expert_parallel and len(self.train_devices(config)) > 1
        return super().train_checked(model, data, config, on_epoch)

    def export_weights(self, model):
        weights = super().export_weights(model)
        return first_half_of_experts(model.graph, weights) if self.sharded else weights


def first_half_of_experts(graph, weights):
    """`weights` with every moe node's expert stacks cut to their first half: device 0's experts of 2."""
    for node in graph.nodes:
        if node.op == "moe":
            half = node.attrs["experts"] // 2
            weights[node.id] = {p: (a if p == "router" else a[:half]) for p, a in weights[node.id].items()}
    return weights


class PerDeviceLoad(ExpertParallel):
    """Reports the experts' load of one device's shard: about half the global batch's."""

    name = "perdeviceload"

    def train_checked(self, model, data, config, on_epoch):
        reports = super().train_checked(model, data, config, on_epoch)
        if len(self.train_devices(config)) < 2:
            return reports
        return [replace(r, expert_load={n: tuple(c // 2 for c in counts) for n, counts in r.expert_load.items()})
                for r in reports]


class WithoutExpertParallelism(TwoDevices):
    name = "withoutexperts"

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True,
                           expert_parallel_why_not="emulated without it")


class NoReason(TwoDevices):
    name = "noreason"

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True)


def expert_parallel_result(backend, name=EXPERT_PARALLEL_CHECK):
    return run_scenarios(backend, 0, True, 1e-4, workloads=["lm"])[name]


def test_emulated_expert_parallelism_passes_with_every_record():
    ctx = Context(ExpertParallel(), Expectations(), quick=True, device="cpu:0")
    results = {c.name: run_check(ctx, c) for c in collect(ctx, ["parallel"])}
    assert set(results) == set(DATA_PARALLEL_CHECKS) | {EXPERT_PARALLEL_CHECK, MULTI_NODE_REFUSED}
    result = results[EXPERT_PARALLEL_CHECK]
    assert result.status == "pass", result.message
    assert "expert load equal every epoch" in result.message
    assert "all-to-all seconds per epoch measured: 0.002, 0.002" in result.message
    assert "35 training images counted exactly" in result.message


def test_unmeasured_exchanges_fail():
    found = expert_parallel_result(UnmeasuredExchanges())
    assert not found["passed"] and "all_to_all_seconds is None" in found["message"]


def test_exporting_one_devices_experts_fails():
    found = expert_parallel_result(ExportsItsOwnExperts())
    assert not found["passed"] and "missing or misshapen" in found["message"]
    assert "m1_moe" in found["message"]


def test_a_devices_expert_load_fails():
    found = expert_parallel_result(PerDeviceLoad())
    assert not found["passed"] and "expert load" in found["message"]


def test_a_backend_without_expert_parallelism_must_refuse_it_and_say_why():
    found = expert_parallel_result(WithoutExpertParallelism(), EXPERT_PARALLEL_REFUSED)
    assert found["passed"], found["message"]
    assert "does not implement expert parallelism: emulated without it" in found["message"]
    found = expert_parallel_result(NoReason(), EXPERT_PARALLEL_REFUSED)
    assert not found["passed"] and "gives no reason in Parallelism.expert_parallel_why_not" in found["message"]


def test_list_names_both_checks_without_a_backend():
    ctx = Context(None, Expectations(), quick=True)
    names = {c.name for c in collect(ctx, ["parallel"])}
    assert {EXPERT_PARALLEL_CHECK, EXPERT_PARALLEL_REFUSED} <= names
    lm = {c.name: c for c in collect(ctx, ["parallel"]) if c.name.startswith("gpt_moe")}
    assert all(c.workload == "lm" and "moe" in c.ops for c in lm.values())


def test_the_checks_model_has_four_experts_top_two():
    from aiperf_conformance.levels.parallel import SCENARIOS

    graph = SCENARIOS[EXPERT_PARALLEL_CHECK].graph()
    moe = [n.attrs for n in graph.nodes if n.op == "moe"]
    assert [(a["experts"], a["top_k"]) for a in moe] == [(4, 2)]
    assert np.prod(graph.input_shape) == 8
