import json

import pytest

from aiperf_core.backend import Dataset
from aiperf_core.data import load_dataset
from aiperf_core.registry import load_backend
from aiperf_core.replica import Replica, ReplicaError, run_replica, write_run_json
from aiperf_core.rundir import RunDir, read_events, sha256_file, verify_chain

FAST = {"dataset": "digits", "initial_architecture": "resnet_small", "batch_size": 32,
        "warmup_epochs": [1, 1, 1], "max_epochs": 1, "nas_candidates": 4}


@pytest.fixture(scope="module")
def digits():
    return load_dataset({"name": "digits", "image_size": 32})


@pytest.fixture(scope="module")
def small_digits(digits):
    # Two steps of 32 images an epoch: the tests below check the replica's events, files and plans, never
    # what a trial learns, and the NumPy backend's convolution gradients are nearly all their time.
    return Dataset(digits.x_train[:64], digits.y_train[:64], digits.x_val[:32], digits.y_val[:32], digits.classes)


def events(run_dir, replica=0, kind=None):
    found = read_events(RunDir(run_dir).replica_log(replica))
    return [e for e in found if kind is None or e["event"] == kind]


def test_a_four_round_search_beats_the_initial_model(tmp_path, digits):
    from aiperf_core.cli import main

    policy = {**FAST, "batch_size": 64, "warmup_epochs": [1, 2, 2], "max_epochs": 2}
    write_run_json(tmp_path, backend="torch", policy=policy, stop_after_trials=4)
    assert main(["replica", "--run-dir", str(tmp_path), "--replica-id", "0"]) == 0
    log = RunDir(tmp_path).replica_log(0)
    assert verify_chain(log) == []
    kinds = [e["event"] for e in read_events(log)]
    assert kinds[0] == "replica_start" and kinds[-1] == "replica_stop"
    assert events(tmp_path, kind="replica_stop")[0]["reason"] == "max_trials"
    starts, ends = events(tmp_path, kind="trial_start"), events(tmp_path, kind="trial_end")
    assert [s["round"] for s in starts] == [1, 2, 3, 4]
    assert starts[0]["parent"] is None and all(s["parent"] and s["morph"] for s in starts[1:])
    assert [s["hyper"]["epochs"] for s in starts] == [1, 2, 2, 2]
    for start, end in zip(starts, ends):
        folder = RunDir(tmp_path).trial_dir(start["trial"])
        assert end["status"] in ("ok", "early_stopped")
        assert start["graph_sha256"] == end["files"]["graph.json"] == sha256_file(folder / "graph.json")
        for name, digest in end["files"].items():
            assert sha256_file(folder / name) == digest
        info = json.loads((folder / "trial.json").read_text())
        assert info["round"] == start["round"] and info["hyper"] == start["hyper"]
        assert (info["predicted_accuracy"] is None) == (start["round"] >= 4)
    assert ends[-1]["predicted_accuracy"] is None and all(e["predicted_accuracy"] is not None for e in ends[:3])
    initial = ends[0]["best_val_accuracy"]
    assert max(e["best_val_accuracy"] for e in ends[1:]) > initial + 0.05
    # Every epoch records its time in steps, within the epoch's wall time (the busy fraction's input).
    for epoch in events(tmp_path, kind="epoch_end"):
        assert 0 < epoch["step_seconds"] <= epoch["time"] - epoch["started"]
    assert RunDir(tmp_path).read_heartbeat(0) is not None


def trial_sequence(run_dir):
    starts = events(run_dir, kind="trial_start")
    return [(s["trial"], s["parent"], s["morph"], s["hyper"], s["graph_sha256"]) for s in starts]


def test_a_fixed_seed_repeats_architectures_and_hyperparameters(tmp_path, small_digits):
    numpy_backend = load_backend("numpy")
    runs = []
    for name in ("a", "b"):
        write_run_json(tmp_path / name, backend="numpy", policy=FAST, seed=11, stop_after_trials=5)
        run_replica(tmp_path / name, 0, backend=numpy_backend, dataset=small_digits)
        runs.append(tmp_path / name)
    first = trial_sequence(runs[0])
    assert len(first) == 5 and first == trial_sequence(runs[1])
    assert [e["best_val_accuracy"] for e in events(runs[0], kind="trial_end")] == \
           [e["best_val_accuracy"] for e in events(runs[1], kind="trial_end")]
    hpo_rounds = [json.loads((RunDir(runs[0]).trial_dir(t[0]) / "trial.json").read_text())["hpo"] for t in first]
    assert hpo_rounds == ["warmup"] * 3 + ["hpo"] * 2
    # Another replica of the same run searches differently.
    write_run_json(tmp_path / "c", backend="numpy", policy=FAST, seed=11, stop_after_trials=3)
    run_replica(tmp_path / "c", 1, backend=numpy_backend, dataset=small_digits)
    other = [(t[2], t[3]) for t in trial_sequence(tmp_path / "c")]
    assert other != [(t[2], t[3]) for t in first[:3]]


class Crash(BaseException):
    """Stands for SIGKILL: nothing in the replica catches it."""


class Wrapped:
    """The numpy backend with a fault injected into train() of chosen rounds (counted from 1)."""

    def __init__(self, fault, rounds):
        self.inner, self.fault, self.rounds, self.calls = load_backend("numpy"), fault, set(rounds), 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def train(self, model, data, config, on_epoch=None):
        self.calls += 1
        if self.calls not in self.rounds:
            return self.inner.train(model, data, config, on_epoch)
        if self.fault == "crash":
            def crash_after_one_epoch(report):
                on_epoch(report)
                raise Crash()
            return self.inner.train(model, data, config, crash_after_one_epoch)
        raise RuntimeError("device lost\nsecond line")


def test_a_crash_is_closed_as_interrupted_and_the_replica_continues(tmp_path, small_digits):
    policy = {**FAST, "warmup_epochs": [2, 2, 2], "max_epochs": 2}
    write_run_json(tmp_path, backend="numpy", policy=policy, stop_after_trials=4)
    with pytest.raises(Crash):
        run_replica(tmp_path, 0, backend=Wrapped("crash", [2]), dataset=small_digits)
    assert [e["event"] for e in events(tmp_path)][-2:] == ["trial_start", "epoch_end"]
    assert run_replica(tmp_path, 0, backend=load_backend("numpy"), dataset=small_digits) == "max_trials"
    log = events(tmp_path)
    assert verify_chain(RunDir(tmp_path).replica_log(0)) == []
    interrupted = [e for e in log if e["event"] == "trial_end" and e["status"] == "interrupted"]
    assert [(e["trial"], e["epochs"]) for e in interrupted] == [("r0000-t00001", 1)]
    # The interrupted trial's epoch stays in the log exactly once, and nothing retrains under its id.
    assert len([e for e in log if e["event"] == "epoch_end" and e["trial"] == "r0000-t00001"]) == 1
    assert [e["trial"] for e in log if e["event"] == "trial_start"] == [f"r0000-t0000{k}" for k in range(4)]
    assert [e["attempt"] for e in log if e["event"] == "replica_start"] == [1, 2]
    restart = [e["event"] for e in log].index("replica_start", 1)
    assert [e["event"] for e in log[restart - 2:restart + 2]] == ["epoch_end", "trial_end", "replica_start",
                                                                  "trial_start"]
    info = json.loads((RunDir(tmp_path).trial_dir("r0000-t00001") / "trial.json").read_text())
    assert info["status"] == "interrupted" and info["epochs"] == 1


def test_a_failing_trial_is_recorded_and_the_loop_goes_on(tmp_path, small_digits):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=3)
    assert run_replica(tmp_path, 0, backend=Wrapped("raise", [2]), dataset=small_digits) == "max_trials"
    ends = events(tmp_path, kind="trial_end")
    assert [e["status"] for e in ends] == ["ok", "failed", "ok"]
    assert ends[1]["reason"] == "RuntimeError: device lost" and "weights.npz" not in ends[1]["files"]
    # Three failures in a row stop the replica instead of spinning.
    write_run_json(tmp_path / "f", backend="numpy", policy=FAST, stop_after_trials=10)
    assert run_replica(tmp_path / "f", 0, backend=Wrapped("raise", range(1, 11)), dataset=small_digits) == "failures"
    assert len(events(tmp_path / "f", kind="trial_end")) == 3


def test_stop_file_deadline_and_bad_run_json(tmp_path, small_digits):
    write_run_json(tmp_path / "s", backend="numpy", policy=FAST, stop_after_trials=3)
    (tmp_path / "s" / "primary").mkdir()
    (tmp_path / "s" / "primary" / "stop").touch()
    assert run_replica(tmp_path / "s", 0, backend=load_backend("numpy"), dataset=small_digits) == "stopped"
    assert events(tmp_path / "s", kind="trial_start") == []
    write_run_json(tmp_path / "d", backend="numpy", policy=FAST, time_budget_s=-1)
    assert run_replica(tmp_path / "d", 0, backend=load_backend("numpy"), dataset=small_digits) == "deadline"
    run = RunDir(tmp_path / "d").read_run()
    RunDir(tmp_path / "b").write_run({**run, "seed": "x"})
    with pytest.raises(ReplicaError, match=r"run\.json\.seed"):
        Replica(tmp_path / "b", 0)
    RunDir(tmp_path / "b").write_run({**run, "policy": {**run["policy"], "max_epochs": 99}})
    with pytest.raises(Exception, match=r"run\.json\.policy\.max_epochs"):
        Replica(tmp_path / "b", 0)


def test_a_damaged_parent_is_dropped_not_fatal(tmp_path, small_digits, capsys):
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=2)
    run_replica(tmp_path, 0, backend=load_backend("numpy"), dataset=small_digits)
    (RunDir(tmp_path).trial_dir("r0000-t00000") / "weights.npz").write_bytes(b"not the trained weights")
    write_run_json(tmp_path, backend="numpy", policy=FAST, stop_after_trials=3)
    assert run_replica(tmp_path, 0, backend=load_backend("numpy"), dataset=small_digits) == "max_trials"
    # Round 3 may use round 1 only (its own rounds up to r - 2); that parent is damaged, so the
    # replica starts over from the initial architecture instead of stopping.
    third = events(tmp_path, kind="trial_start")[2]
    assert third["round"] == 3 and third["parent"] is None
    assert "r0000-t00000: weights.npz changed since its trial ended" in capsys.readouterr().err


def test_replicas_share_trials_and_plan_while_training(tmp_path, small_digits, monkeypatch):
    import threading

    write_run_json(tmp_path, backend="numpy", policy=FAST, replicas=2, stop_after_trials=2)
    run_replica(tmp_path, 0, backend=load_backend("numpy"), dataset=small_digits)
    planned_on = {}
    plan = Replica._plan

    def recording_plan(self, round_number, latest):
        planned_on[round_number] = threading.current_thread().name
        return plan(self, round_number, latest)

    monkeypatch.setattr(Replica, "_plan", recording_plan)
    run_replica(tmp_path, 1, backend=load_backend("numpy"), dataset=small_digits)
    # Replica 1's round 2 may not use its own round 1 (still training when round 2 is planned),
    # so its parent comes from replica 0, and the plan was made on the planner thread meanwhile.
    second = events(tmp_path, replica=1, kind="trial_start")[1]
    assert second["parent"] in ("r0000-t00000", "r0000-t00001")
    info = json.loads((RunDir(tmp_path).trial_dir(second["trial"]) / "trial.json").read_text())
    assert info["nas"]["active_set"] == 2
    assert planned_on[1] == threading.current_thread().name and planned_on[2].startswith("planner-1")


class Scripted:
    """A backend that trains nothing and reports scripted validation losses, to test the stopping rules."""

    def __init__(self, val_losses):
        self.val_losses = val_losses

    def framework_version(self):
        return "scripted"

    def devices(self):
        return ["cpu"]

    def lower(self, graph, weights=None, precision="fp32"):
        return weights

    def export_weights(self, model):
        return model

    def train(self, model, data, config, on_epoch=None):
        from aiperf_core.backend import EpochReport
        reports = []
        for epoch in range(config.epochs):
            loss = self.val_losses[epoch]
            reports.append(EpochReport(epoch, 10, 5, loss, loss, 0.5))
            if on_epoch(reports[-1]):
                break
        return reports


def test_patience_and_divergence_stop_a_trial(tmp_path, small_digits):
    policy = {**FAST, "warmup_epochs": [8, 8, 8], "max_epochs": 8, "patience_min": 3}
    write_run_json(tmp_path / "p", backend="numpy", policy=policy, stop_after_trials=1)
    run_replica(tmp_path / "p", 0, backend=Scripted([1.0, 0.9, 1.0, 1.1, 1.2, 0.1, 0.1, 0.1]), dataset=small_digits)
    end = events(tmp_path / "p", kind="trial_end")[0]
    assert (end["status"], end["reason"], end["epochs"]) == ("early_stopped", "patience", 5)
    write_run_json(tmp_path / "n", backend="numpy", policy=policy, stop_after_trials=1)
    run_replica(tmp_path / "n", 0, backend=Scripted([1.0, float("nan")] + [1.0] * 6), dataset=small_digits)
    assert events(tmp_path / "n", kind="epoch_end")[-1]["val_loss"] is None
    end = events(tmp_path / "n", kind="trial_end")[0]
    assert (end["status"], end["epochs"]) == ("failed", 2) and "diverged" in end["reason"]


class Slow(Scripted):
    def train(self, model, data, config, on_epoch=None):
        import time
        time.sleep(1.6)
        return super().train(model, data, config, on_epoch)


def test_the_deadline_ends_the_trial_after_its_epoch_and_keeps_its_weights(tmp_path, small_digits):
    policy = {**FAST, "warmup_epochs": [8, 8, 8], "max_epochs": 8}
    write_run_json(tmp_path, backend="numpy", policy=policy, time_budget_s=1.5)
    assert run_replica(tmp_path, 0, backend=Slow([1.0] * 8), dataset=small_digits) == "deadline"
    end = events(tmp_path, kind="trial_end")[0]
    assert (end["status"], end["reason"], end["epochs"]) == ("early_stopped", "deadline", 1)
    assert "weights.npz" in end["files"]


def test_the_replica_samples_its_node_while_it_runs(tmp_path, small_digits):
    from aiperf_core.monitoring.sampler import read_monitor

    write_run_json(tmp_path, backend="numpy", policy={**FAST, "warmup_epochs": [1, 1, 1], "max_epochs": 1},
                   stop_after_trials=1)
    assert run_replica(tmp_path, 0, backend=load_backend("numpy"), dataset=small_digits) == "max_trials"
    samples = read_monitor(RunDir(tmp_path).monitor_log(0))
    assert samples, "the sampler wrote nothing"
