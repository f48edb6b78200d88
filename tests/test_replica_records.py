"""What a replica records about precision and compile time: the precision it trains at
(run.json's, or `auto` resolved on its node where the primary could not), and each epoch's and
trial's compile seconds in the events and trial.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from aiperf_core.backend import Dataset
from aiperf_core.data import load_dataset
from aiperf_core.registry import load_backend
from aiperf_core.replica import ReplicaError, run_replica, write_run_json
from aiperf_core.rundir import RunDir, read_events

FAST = {"dataset": "digits", "initial_architecture": "resnet_small", "batch_size": 32,
        "warmup_epochs": [2, 2, 2], "max_epochs": 2, "nas_candidates": 4}


@pytest.fixture(scope="module")
def small_digits():
    digits = load_dataset({"name": "digits", "image_size": 32})
    return Dataset(digits.x_train[:96], digits.y_train[:96], digits.x_val[:48], digits.y_val[:48], digits.classes)


def events(run_dir, kind):
    return [e for e in read_events(RunDir(run_dir).replica_log(0)) if e["event"] == kind]


class Crash(BaseException):
    """Stands for SIGKILL: nothing in the replica catches it."""


class Reporting:
    """The numpy backend, reporting `compile_seconds[epoch]` in its epoch reports (a compiling
    backend's first epoch holds the compile); with `crash_after`, killed after that many epochs;
    `fastest` stands for the fastest precision of this node's device: declared with fp32."""

    def __init__(self, compile_seconds, crash_after=None, fastest="fp32"):
        self.inner = load_backend("numpy")
        self.compile_seconds, self.crash_after, self.fastest = compile_seconds, crash_after, fastest
        self.resolved_on: list[str] = []
        self.trained_at: list[str] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def precisions(self, device=None):
        self.resolved_on.append(device)
        return ("fp32",) if self.fastest == "fp32" else ("fp32", self.fastest)

    def train(self, model, data, config, on_epoch=None):
        self.trained_at.append(config.precision)

        def report(epoch_report):
            seconds = self.compile_seconds[epoch_report.epoch]
            stop = on_epoch(dataclasses.replace(epoch_report, compile_seconds=seconds))
            if self.crash_after is not None and epoch_report.epoch + 1 >= self.crash_after:
                raise Crash()
            return stop
        return self.inner.train(model, data, config, report)


def test_compile_seconds_are_recorded_per_epoch_and_per_trial(tmp_path, small_digits):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=1)
    run_replica(tmp_path, 0, backend=Reporting([2.5, 0.0]), dataset=small_digits)
    assert [e["compile_seconds"] for e in events(tmp_path, "epoch_end")] == [2.5, 0.0]
    end = events(tmp_path, "trial_end")[0]
    assert end["compile_seconds"] == 2.5
    info = json.loads((RunDir(tmp_path).trial_dir(end["trial"]) / "trial.json").read_text())
    assert info["compile_seconds"] == 2.5


def test_a_backend_that_does_not_measure_compile_time_records_null(tmp_path, small_digits):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=1)
    run_replica(tmp_path, 0, backend=Reporting([None, float("nan")]), dataset=small_digits)
    assert [e["compile_seconds"] for e in events(tmp_path, "epoch_end")] == [None, None]
    assert events(tmp_path, "trial_end")[0]["compile_seconds"] is None


def test_an_interrupted_trial_keeps_the_compile_seconds_of_its_logged_epochs(tmp_path, small_digits):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=1)
    with pytest.raises(Crash):
        run_replica(tmp_path, 0, backend=Reporting([1.5, 0.0], crash_after=1), dataset=small_digits)
    run_replica(tmp_path, 0, backend=Reporting([0.0, 0.0]), dataset=small_digits)
    end = events(tmp_path, "trial_end")[0]
    assert end["status"] == "interrupted" and end["compile_seconds"] == 1.5
    info = json.loads((RunDir(tmp_path).trial_dir(end["trial"]) / "trial.json").read_text())
    assert info["compile_seconds"] == 1.5


def test_the_replica_trains_at_run_jsons_precision(tmp_path, small_digits):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=1)
    backend = Reporting([0.0, 0.0], fastest="bf16")
    run_replica(tmp_path, 0, backend=backend, dataset=small_digits)
    assert backend.resolved_on == [] and backend.trained_at == ["fp32"]
    assert events(tmp_path, "replica_start")[0]["precision"] == "fp32"
    assert events(tmp_path, "trial_start")[0]["hyper"]["precision"] == "fp32"


def _as_a_slurm_run(run_dir, policy, trials=1):
    """run.json as a SLURM primary writes it: the precision is left to the replicas when `auto`."""
    run = write_run_json(run_dir, backend="numpy", policy=policy, stop_after_trials=trials, executor="slurm")
    RunDir(run_dir).write_run({**run, "precision": None if policy.get("precision", "auto") == "auto"
                               else policy["precision"]})


def test_a_replica_resolves_auto_on_its_node_and_keeps_it_on_restart(tmp_path, small_digits):
    _as_a_slurm_run(tmp_path, FAST, trials=2)  # the interrupted trial counts as one
    first = Reporting([0.0, 0.0], crash_after=1, fastest="fp32")
    with pytest.raises(Crash):
        run_replica(tmp_path, 0, backend=first, dataset=small_digits)
    assert first.resolved_on == [first.devices()[0]] and first.trained_at == ["fp32"]
    # Restarted on a node whose backend would now pick another precision: it trains as before.
    again = Reporting([0.0, 0.0], fastest="bf16")
    run_replica(tmp_path, 0, backend=again, dataset=small_digits)
    assert again.resolved_on == [] and again.trained_at == ["fp32"]
    assert [e["precision"] for e in events(tmp_path, "replica_start")] == ["fp32", "fp32"]


def test_an_explicit_precision_of_a_slurm_run_is_used_as_asked(tmp_path, small_digits):
    _as_a_slurm_run(tmp_path, {**FAST, "precision": "fp32"})
    backend = Reporting([0.0, 0.0], fastest="bf16")
    run_replica(tmp_path, 0, backend=backend, dataset=small_digits)
    assert backend.resolved_on == [] and backend.trained_at == ["fp32"]


def test_a_bad_precision_in_run_json_names_the_field(tmp_path, small_digits):
    run = write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=1)
    RunDir(tmp_path).write_run({**run, "precision": "fp8"})
    with pytest.raises(ReplicaError, match=r"^run.json.precision: 'fp8' is not one of fp32, tf32, bf16, fp16 or null$"):
        run_replica(tmp_path, 0, backend=Reporting([0.0, 0.0]), dataset=small_digits)
