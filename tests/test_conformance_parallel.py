"""The kit's `parallel` level against fake backends built on the NumPy reference: a correct data-
parallel backend passes, in this process and in the child process with AIPERF_CPU_DEVICES=2; each
planted fault (per-device batch norm, estimated image counts, a backend that ignores the variable,
one that trains on two devices without declaring data parallelism) fails the check that names it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from aiperf_core.backend import CPU_DEVICES_ENV, EpochReport, Parallelism, StepClock
from aiperf_core.ir import is_trainable
from aiperf_numpy.backend import NumpyBackend
from aiperf_numpy.executor import loss_and_grads
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import Context, collect, run_check
from aiperf_conformance.levels.parallel import (DATA_PARALLEL_CHECKS, EXPERT_PARALLEL_REFUSED, MULTI_NODE_REFUSED,
                                                SINGLE_DEVICE_CHECKS)

DATA_PARALLEL = Parallelism(data_parallel=True, synchronized_batch_norm=True, notes="emulated",
                            expert_parallel_why_not="emulated without it", multi_node_why_not="emulated on one host")


class TwoDevices(NumpyBackend):
    """Correct data parallelism, emulated: any subset of its two devices trains on the whole
    global batch, which is what synchronous data parallelism with synchronised BN computes."""

    name = "twodevices"

    def devices(self):
        return ["cpu:0", "cpu:1"]

    def parallelism(self):
        return DATA_PARALLEL


class PerDeviceBatchNorm(TwoDevices):
    """Each device normalises its shard with its own statistics and the gradients are averaged,
    weighted by shard size: right for layers without batch norm, wrong with it."""

    name = "perdevicebn"

    def train_checked(self, model, data, config, on_epoch):
        from aiperf_core.data.stream import train_batches, val_batches

        world = len(self.train_devices(config))
        velocity = {n: {p: np.zeros_like(a) for p, a in ps.items() if is_trainable(p)}
                    for n, ps in model.weights.items()}
        reports, clock = [], StepClock()
        for epoch in range(config.epochs):
            lr = config.schedule.rate(epoch, config.epochs)
            seen, losses = 0, []
            for batch in train_batches(data, epoch, config.seed, config.batch_size):
                total, summed, moving_sum = len(batch.y), {}, {}
                with clock:
                    for part in np.array_split(np.arange(total), world):
                        if not len(part):
                            continue
                        loss, grads, moving = loss_and_grads(model.graph, model.weights, batch.x[part], batch.y[part],
                                                             dtype=np.float32)
                        losses.append(loss * len(part))
                        for n, ps in grads.items():
                            for p, g in ps.items():
                                summed.setdefault(n, {}).setdefault(p, 0)
                                summed[n][p] = summed[n][p] + g * len(part) / total
                        for n, ps in moving.items():
                            for p, v in ps.items():
                                moving_sum.setdefault(n, {}).setdefault(p, []).append(v)
                    for n, ps in summed.items():
                        for p, g in ps.items():
                            velocity[n][p] = velocity[n][p] * config.momentum + g
                            model.weights[n][p] -= lr * velocity[n][p]
                    for n, ps in moving_sum.items():
                        for p, values in ps.items():
                            model.weights[n][p] = np.mean(values, axis=0).astype(np.float32)
                seen += total
            val = sum(len(b.y) for b in val_batches(data, 256))
            reports.append(EpochReport(epoch, seen, val, float(np.sum(losses) / seen), 0.0, 0.0,
                                       step_seconds=clock.lap(), compile_seconds=0.0))
        return reports


class EstimatedCounts(TwoDevices):
    """Trains correctly but reports full batches: steps x batch size instead of the images."""

    name = "estimatedcounts"

    def train_checked(self, model, data, config, on_epoch):
        reports = super().train_checked(model, data, config, on_epoch)
        steps = -(-len(data.y_train) // config.batch_size)
        return [EpochReport(r.epoch, steps * config.batch_size, r.val_images, r.loss, r.val_loss, r.val_accuracy,
                            step_seconds=r.step_seconds) for r in reports]


class ReadsCpuDevices(TwoDevices):
    """Exposes AIPERF_CPU_DEVICES devices when the variable is set, else one: the child path."""

    name = "readscpudevices"

    def devices(self):
        n = int(os.environ.get(CPU_DEVICES_ENV, "1"))
        return [f"cpu:{i}" for i in range(n)] if n > 1 else ["cpu"]


class IgnoresCpuDevices(TwoDevices):
    """Declares data parallelism but never exposes a second CPU device."""

    name = "ignorescpudevices"

    def devices(self):
        return ["cpu"]


class TrainsOnTwoSilently(NumpyBackend):
    """Declares no parallelism and bypasses the contract's device check."""

    name = "silenttwo"

    def devices(self):
        return ["cpu:0", "cpu:1"]

    def train(self, model, data, config, on_epoch=None):
        return self.train_checked(model, data, config, on_epoch)


def parallel_results(backend, quick=True):
    ctx = Context(backend, Expectations(), quick=quick, device=backend.devices()[0])
    return {c.name: run_check(ctx, c) for c in collect(ctx, ["parallel"])}


def test_correct_data_parallel_backend_passes_in_process():
    results = parallel_results(TwoDevices())
    assert set(results) == set(DATA_PARALLEL_CHECKS) | {EXPERT_PARALLEL_REFUSED, MULTI_NODE_REFUSED}
    for name, result in results.items():
        assert result.status == "pass", (name, result.message)
    assert "2 devices (cpu:0, cpu:1) vs 1 (cpu:0)" in results["matches_one_device"].message
    assert "shards [1, 0]" in results["empty_shard"].message
    assert results["uneven_last_batch"].device == "cpu:0, cpu:1"


def test_a_kit_run_of_one_workload_trains_only_that_workloads_scenarios():
    from aiperf_conformance.levels.parallel import LM_CHECKS, run_scenarios

    lm = set(run_scenarios(TwoDevices(), 0, True, 1e-4, workloads=["lm"]))
    assert lm == {"gpt_matches_one_device", EXPERT_PARALLEL_REFUSED} and lm <= set(LM_CHECKS)
    assert set(run_scenarios(TwoDevices(), 0, True, 1e-4, workloads=["cnn"])) == \
        set(DATA_PARALLEL_CHECKS) - set(LM_CHECKS) | {MULTI_NODE_REFUSED}


def test_per_device_batch_norm_fails_and_says_so():
    results = parallel_results(PerDeviceBatchNorm())
    bn = results["synchronized_batch_norm"]
    assert bn.status == "fail" and "per device, not those of the global batch" in bn.message
    assert bn.measured > 1e-2  # far outside the tolerance, not a rounding matter
    assert results["matches_one_device"].status == "fail"


def test_estimated_image_counts_fail_on_uneven_batches():
    results = parallel_results(EstimatedCounts())
    assert results["matches_one_device"].status == "pass"  # full batches: the estimate happens to be right
    for name in ("uneven_last_batch", "empty_shard"):
        assert results[name].status == "fail"
        assert "counted 48 training" in results[name].message or "counted 32 training" in results[name].message


def test_child_process_with_cpu_devices(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    results = parallel_results(ReadsCpuDevices())
    for name, result in results.items():
        assert result.status == "pass", (name, result.message)
        assert result.device == f"child process with {CPU_DEVICES_ENV}=2: cpu:0, cpu:1"


def test_backend_that_ignores_cpu_devices_fails_clearly(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    results = parallel_results(IgnoresCpuDevices())
    assert results.pop(MULTI_NODE_REFUSED).status == "pass"  # one device is all a refusal needs
    for result in results.values():
        assert result.status == "fail"
        assert f"exposes 1 device(s) (cpu) with {CPU_DEVICES_ENV}=2 set" in result.message


def test_single_device_backend_is_certified_as_such():
    results = parallel_results(NumpyBackend(), quick=False)
    assert set(results) == set(SINGLE_DEVICE_CHECKS) | {MULTI_NODE_REFUSED}
    assert all(r.status == "pass" for r in results.values()), results
    assert "35 training images counted exactly" in results["one_device_matches_default"].message
    assert "two devices refused" in results["refuses_two_devices"].message


def test_training_on_two_devices_without_declaring_it_fails():
    results = parallel_results(TrainsOnTwoSilently())
    assert results["refuses_two_devices"].status == "fail"
    assert "declares no data parallelism but trained" in results["refuses_two_devices"].message


def test_a_backend_defined_in_main_cannot_go_to_a_child(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    local = type("Local", (ReadsCpuDevices,), {"__module__": "__main__"})
    results = parallel_results(local())
    assert all(r.status == "error" and "importable module" in r.message for r in results.values())


class CountsOneDeviceTrainings(TwoDevices):
    """TwoDevices that declares multi-node too and records what it trains on one device."""

    name = "countsonedevice"

    def __init__(self):
        super().__init__()
        self.alone: list[tuple] = []

    def parallelism(self):
        from dataclasses import replace

        return replace(DATA_PARALLEL, multi_node=True, multi_node_why_not="")

    def train(self, model, data, config, on_epoch=None):
        if config.devices is not None and len(config.devices) == 1:
            self.alone.append((model.graph.name, len(data.y_train), config.epochs))
        return super().train(model, data, config, on_epoch)


def test_a_scenario_two_checks_compare_with_one_device_is_trained_on_one_device_once(monkeypatch):
    """gpt_matches_one_device and gpt_multi_node_matches_one_device train the same scenario: its one-device
    answer is trained once per level run and both checks compare with it (the nodes' side faked here, as
    the same training; tests/test_conformance_multi_node.py launches real nodes)."""
    from aiperf_conformance.levels import parallel
    from aiperf_conformance.multi_node import NodesTrained

    def nodes(backend_class, checks, seed, quick):
        out = {}
        for check in checks:
            reports, weights = parallel.train_scenario(TwoDevices(), parallel.scenario_of(check, quick), seed,
                                                       ("cpu:0",))
            out[check] = NodesTrained(reports, weights, len(reports), ["cpu:0", "cpu:1"], [0.0, 0.0])
        return out

    monkeypatch.setattr(parallel, "run_nodes", nodes)
    backend = CountsOneDeviceTrainings()
    results = parallel_results(backend)
    assert set(results) == set(DATA_PARALLEL_CHECKS) | set(parallel.MULTI_NODE_CHECKS) | {EXPERT_PARALLEL_REFUSED}
    for name, result in results.items():
        assert result.status == "pass", (name, result.message)
    gpt = parallel.scenario_of("gpt_matches_one_device", True)
    assert backend.alone.count((parallel._gpt().name, gpt.train, gpt.epochs)) == 1
    assert len(backend.alone) == len(set(backend.alone)) == len(results) - 2  # less the refusal and the shared one


def test_a_kit_run_starts_the_levels_child_before_its_first_check(monkeypatch):
    """run_conformance starts the parallel level's child with the run (start_early): it trains while
    the levels before it run, and the level's checks read its outcomes."""
    from aiperf_conformance import kit

    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    running = []
    real = kit.run_check

    def spy(ctx, check):
        child = ctx.cache.get("parallel_child")
        running.append((check.level, child is not None and child.run.proc.poll() is None))
        return real(ctx, check)

    monkeypatch.setattr(kit, "run_check", spy)
    report = kit.run_conformance(ReadsCpuDevices(), "op,parallel", quick=True)
    assert running[0] == ("op", True)  # started before the kit's first check, running beside it
    parallel = [r for r in report.results if r.level == "parallel"]
    assert parallel and all(r.status == "pass" for r in parallel), [(r.name, r.message) for r in parallel]
    assert {r.device for r in parallel} == {f"child process with {CPU_DEVICES_ENV}=2: cpu:0, cpu:1"}


def test_pytest_cases_start_the_child_only_where_parallel_checks_are_selected(monkeypatch):
    """The pytest path: a context whose parallel checks the session selected (will_run, from the
    plugin's collection hook) starts the child at its first case; one without them never does."""
    from aiperf_conformance import pytest_support

    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    cases = {}
    for key in ("selected", "not selected"):
        ctx = Context(ReadsCpuDevices(), Expectations(), quick=True, device="cpu")
        monkeypatch.setitem(pytest_support._contexts, (key,), ctx)
        cases[key] = [pytest_support.Case("readscpudevices", check, (key,)) for check in collect(ctx, ["op", "parallel"])]
    monkeypatch.setattr(pytest_support, "_parallel_ahead", set())
    pytest_support.will_run(cases["selected"] + [c for c in cases["not selected"] if c.check.level != "parallel"])
    for key, expected in (("selected", True), ("not selected", False)):
        first = cases[key][0]
        assert first.check.level == "op"
        pytest_support.run_case(first)
        assert ("parallel_child" in pytest_support._contexts[(key,)].cache) is expected
    for case in cases["selected"]:
        if case.check.level == "parallel":
            pytest_support.run_case(case)  # reads the early child's outcomes: every check passes
    assert "parallel_child" not in pytest_support._contexts[("selected",)].cache
