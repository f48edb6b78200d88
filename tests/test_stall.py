"""Stall detection (issue 18): steps report their progress through StepClock, the replica's
heartbeat carries it, and the primary restarts a training replica whose steps stopped finishing,
never one that is merely slow. Live images/s and analytic OPS come from the same progress."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiperf_core.backend import StepClock
from aiperf_core.rundir import RunDir, read_events, verify_chain
from aiperf_core.workflow import primary as primary_module
from stepping_backend import NAME, environment, install
from test_workflow import ScriptedExecutor, _primary, _primary_events

STALL_POLICY = """
[policy]
initial_architecture = "resnet_small"
warmup_epochs = [2]
max_epochs = 2
batch_size = 32
hpo_start_round = 50
"""


# --- StepClock's progress file ------------------------------------------------------------------
def test_step_clock_writes_its_progress_where_the_variable_says(tmp_path, monkeypatch):
    target = tmp_path / "progress.json"
    monkeypatch.setenv(StepClock.PROGRESS_FILE_ENV, str(target))
    clock = StepClock()
    before = time.time()
    with clock:
        time.sleep(0.05)  # the first step: tracing and compilation
    clock.count(8)
    first = json.loads(target.read_text())
    assert first["steps"] == 1 and first["images"] == 8 and first["first_step_s"] >= 0.05
    assert before <= first["epoch_start"] <= first["time"] and first["longest_step_s"] == 0.0
    with clock:
        time.sleep(0.02)
    clock.count(8)  # within a second of the last write: not written
    assert json.loads(target.read_text())["steps"] == 1
    monkeypatch.setattr(StepClock, "PROGRESS_INTERVAL_S", 0.0)
    with clock:
        time.sleep(0.01)
    clock.count(8)
    later = json.loads(target.read_text())
    assert later["steps"] == 3 and later["images"] == 24 and 0.01 <= later["longest_step_s"] < first["first_step_s"]
    assert clock.lap() > 0.08 and clock.images == 0
    with clock:
        pass
    assert json.loads(target.read_text())["images"] == 0  # a new epoch
    with pytest.raises(RuntimeError), clock:
        raise RuntimeError("a step that fails is no progress")
    assert json.loads(target.read_text())["steps"] == 4


def test_without_the_variable_a_step_clock_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(StepClock.PROGRESS_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    clock = StepClock()
    with clock:
        pass
    clock.count(4)
    assert list(tmp_path.iterdir()) == []


def test_the_heartbeat_ignores_progress_from_before_the_current_trial(tmp_path):
    from aiperf_core.replica import _Status

    status = _Status()
    status.progress_file = tmp_path / "progress.json"
    status.update(state="training", trial="r0000-t00001")
    since = status.beat()["since"]
    status.progress_file.write_text(json.dumps({"time": since - 1, "steps": 9, "longest_step_s": 5.0}))
    beat = status.beat()
    assert beat["progress"] is None and beat["longest_step_s"] == 0.0
    status.progress_file.write_text(json.dumps({"time": since + 2, "steps": 3, "longest_step_s": 0.5,
                                                "first_step_end": since + 1.5}))
    beat = status.beat()
    assert beat["progress"]["steps"] == 3 and beat["longest_step_s"] == 0.5 and beat["longest_startup_s"] == 1.5
    status.update(state="recording")
    assert status.beat()["progress"] is None and status.beat()["longest_step_s"] == 0.5


def test_progress_folders_of_killed_replicas_are_swept(tmp_path, monkeypatch):
    import tempfile

    from aiperf_core import replica

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"{replica.PROGRESS_DIR_PREFIX}{gone}-abc").mkdir()  # its replica was killed
    alive = tmp_path / f"{replica.PROGRESS_DIR_PREFIX}{os.getpid()}-def"
    alive.mkdir()
    made = Path(replica._progress_dir())
    assert made.parent == tmp_path and made.name.startswith(f"{replica.PROGRESS_DIR_PREFIX}{os.getpid()}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, made.name])


# --- the primary's decisions, with heartbeats written as a replica would --------------------------
class BeatingExecutor(ScriptedExecutor):
    """Each poll round, every running replica beats as `beat(launched, now)` says (None: no beat)."""

    def __init__(self, run_dir, script, beat):
        super().__init__(run_dir, script)
        self.beat, self.launched = beat, {}

    def launch(self, command):
        handle = super().launch(command)
        self.launched[handle.job] = time.time()
        return handle

    def refresh(self, handles):
        for handle in handles:
            if handle.end is None:
                fields = self.beat(handle.attempt, self.launched[handle.job], time.time())
                if fields is not None:
                    self.run_dir.write_heartbeat(handle.replica, **fields)


def _beating_primary(tmp_path, beat, script=None, **watch):
    script = script or {(0, 1): lambda *_: None}
    primary, run_dir, _ = _primary(tmp_path, script, **watch)
    primary.executor = BeatingExecutor(run_dir, script, beat)
    return primary, run_dir, primary.executor


def test_a_replica_whose_steps_stopped_finishing_is_lost_and_restarted(tmp_path):
    def beat(attempt, launched, now):  # one step ended right after the start, then nothing
        return {"state": "training", "trial": "r0000-t00000", "since": launched,
                "progress": {"time": launched + 0.01, "steps": 1, "images": 32, "first_step_s": 0.01},
                "longest_step_s": 0.0}
    primary, run_dir, executor = _beating_primary(tmp_path, beat, stall_timeout_s=0.3)
    assert primary.run_to_end() == "all_replicas_finished"
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert [(e["attempt"], e["status"]) for e in exits] == [(1, "lost"), (2, "finished")]
    assert exits[0]["reason"].startswith("no step finished for ") and "(stall limit 0s)" in exits[0]["reason"]
    assert exits[0]["last_progress"]["steps"] == 1 and exits[0]["restart"] is True
    assert executor.stopped == ["job-0-1"]


def test_a_slow_replica_with_steps_longer_than_its_heartbeat_is_never_touched(tmp_path):
    def beat(attempt, launched, now):  # steps of 2 s: the last one ended a second ago, another runs
        return {"state": "training", "trial": "r0000-t00000", "since": launched - 30,
                "progress": {"time": now - 1.0, "steps": 5, "images": 160, "first_step_s": 3.0},
                "longest_step_s": 2.0}
    primary, run_dir, executor = _beating_primary(tmp_path, beat, stall_timeout_s=0.3, budget_s=1.5)
    assert primary.run_to_end() == "deadline"
    assert [e["status"] for e in _primary_events(run_dir) if e["event"] == "replica_exit"] == ["stopped"]


def test_the_first_step_of_a_trial_gets_the_start_up_allowance(tmp_path, monkeypatch):
    monkeypatch.setattr(primary_module, "STARTUP_ALLOWANCE_S", 0.6)

    def beat(attempt, launched, now):  # compiling: in the trial since launch, no step yet
        return {"state": "training", "trial": "r0000-t00000", "since": launched, "progress": None}
    primary, run_dir, _ = _beating_primary(tmp_path, beat, stall_timeout_s=0.3)
    started = time.monotonic()
    assert primary.run_to_end() == "all_replicas_finished"
    assert time.monotonic() - started >= 0.9  # the stall limit plus the allowance
    lost = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"][0]
    assert lost["status"] == "lost" and lost["reason"].startswith("no first step ")
    assert "start-up allowance" in lost["reason"]


def test_a_replica_that_is_not_training_is_not_judged_by_its_steps(tmp_path):
    def beat(attempt, launched, now):  # planning for a long time: no step is expected
        return {"state": "planning", "trial": None, "since": launched - 1000, "progress": None}
    primary, run_dir, _ = _beating_primary(tmp_path, beat, stall_timeout_s=0.2, budget_s=1.0)
    assert primary.run_to_end() == "deadline"
    assert [e["status"] for e in _primary_events(run_dir) if e["event"] == "replica_exit"] == ["stopped"]


def test_the_stall_limit_grows_with_the_longest_step():
    assert primary_module.stall_limit(600.0, 0.3) == 600.0
    assert primary_module.stall_limit(600.0, 44.0) == 880.0
    assert primary_module.startup_allowance(10.0) == primary_module.STARTUP_ALLOWANCE_S
    assert primary_module.startup_allowance(1000.0) == 3000.0


# --- live figures -----------------------------------------------------------------------------
def test_live_images_per_second_and_analytic_ops_come_from_heartbeats(tmp_path):
    from aiperf_core.scoring.progress import Progress, ReplicaProgress
    from aiperf_core.workflow.progress import live_figures, render

    run_dir = RunDir(tmp_path)
    now = time.time()
    run_dir.write_heartbeat(0, state="training", trial="r0000-t00002", since=now - 100,
                            progress={"time": now - 1, "images": 6000, "epoch_start": now - 61})
    run_dir.write_heartbeat(1, state="training", trial="r0001-t00001", since=now - 500, progress=None)
    replicas = (ReplicaProgress(0, "node1", 1, 2, "r0000-t00002", 0, False, None, running_per_image=(10**9, 2 * 10**9)),
                ReplicaProgress(1, "node2", 1, 1, "r0001-t00001", 0, False, None, running_per_image=(1, 2)))
    progress = Progress(now=now, elapsed_s=400, budget_s=3600, remaining_s=3200, ended=False, trials_done=3,
                        trials_running=2, epochs_counted=0, ops_per_s=0.0, regulated_ops=0.0, best_accuracy=None,
                        best_error=None, replicas=replicas)
    live = live_figures(run_dir, progress)
    assert live.replicas[0].images_per_s == pytest.approx(100.0) and live.ops_per_s == pytest.approx(3e11)
    assert live.replicas[1].images_per_s is None and live.replicas[1].last_step_age_s is None
    lines = render(progress, live)
    assert lines[1].startswith("OPS 0 OPS")  # the score itself moves only when epochs end
    assert lines[2] == ("live, not scored: 100 images/s  300 Giga-OPS analytic (2 of 2 training replicas reporting; "
                        "1 compiling)")
    assert lines[3].endswith("training r0000-t00002 (epoch 1, 100 images/s)")
    assert lines[4].endswith("training r0001-t00001 (epoch 1, compiling: no step yet after 8m20s)")


# --- end to end: real primary, real replica processes --------------------------------------------
def _start(tmp_path, *args, **behaviour) -> subprocess.Popen:
    site = tmp_path / "site"
    install(site)
    config = tmp_path / "aiperf.toml"
    config.write_text(STALL_POLICY)
    return subprocess.Popen([sys.executable, "-m", "aiperf_core", "run", "--backend", NAME, "--data", "digits",
                             "--config", str(config), "--run-dir", str(tmp_path / "run"), *args],
                            env=environment(site, **behaviour), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


# The two runs below, as the tests that read them expect them: a step that hangs, and steps longer
# than the heartbeat. Their steps are sleeps, so the two runs go side by side, started once for the
# module: the slower one's time, not their sum.
RUNS = {
    "hang": (("--time-budget", "5m", "--stall-timeout", "3s", "--stop-after-trials", "3"),
             {"step_s": 0.2, "steps": 5, "hang": {"trial": 2, "epoch": 1, "step": 1, "marker": "hung"}}),
    # Steps of 6 s, longer than the 5 s heartbeat interval, against a 3 s stall floor: each
    # heartbeat sees the last step end up to 6 s before it, and the replica is healthy all along.
    # One step an epoch: two epochs span two heartbeats or more, each during a step.
    "slow": (("--time-budget", "5m", "--stall-timeout", "3s", "--stop-after-trials", "1"),
             {"step_s": 6.0, "steps": 1}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """name -> (the folder holding its run/, the finished `aiperf run`)."""
    started = {}
    try:
        for name, (args, behaviour) in RUNS.items():
            folder = tmp_path_factory.mktemp(name)
            if "hang" in behaviour:
                behaviour = {**behaviour, "hang": {**behaviour["hang"], "marker": str(folder / "hung")}}
            started[name] = (folder, _start(folder, *args, **behaviour))
        finished = {}
        for name, (folder, process) in started.items():
            stdout, stderr = process.communicate(timeout=300)
            finished[name] = (folder, subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
        return finished
    finally:
        for _, process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _epoch_ops(run_dir: Path, event: dict) -> int:
    from aiperf_core.ir import Graph
    from aiperf_opcount import count

    counted = count(Graph.from_json((run_dir / "trials" / event["trial"] / "graph.json").read_text()))
    return event["train_images"] * (counted.fp + counted.bp) + event["val_images"] * counted.fp


@pytest.mark.slow  # the module's two real runs (RUNS), side by side: about 18 s
def test_a_replica_whose_step_hangs_forever_is_restarted_and_nothing_counts_twice(runs):
    from aiperf_core.scoring import score_run

    tmp_path, result = runs["hang"]
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "run"
    exits = [e for e in read_events(run_dir / "primary/events.jsonl") if e["event"] == "replica_exit"]
    assert [(e["attempt"], e["status"]) for e in exits] == [(1, "lost"), (2, "finished")], exits
    lost = exits[0]
    assert lost["reason"].startswith("no step finished for ") and lost["reason"].endswith("during trial r0000-t00001")
    assert lost["trial"] == "r0000-t00001" and lost["restart"] is True and lost["last_progress"]["steps"] >= 7
    # The hung thread's stack, written on the primary's request before it stopped the replica.
    assert any("in train_checked" in line for line in lost["log_tail"]), lost["log_tail"]
    assert "lost: no step finished" in result.stdout

    events = read_events(run_dir / "replicas/0/events.jsonl")
    assert verify_chain(run_dir / "replicas/0/events.jsonl") == []
    epochs = [(e["trial"], e["epoch"]) for e in events if e["event"] == "epoch_end"]
    assert epochs == [("r0000-t00000", 0), ("r0000-t00000", 1), ("r0000-t00001", 0), ("r0000-t00002", 0),
                      ("r0000-t00002", 1)]
    ends = {e["trial"]: (e["status"], e["epochs"]) for e in events if e["event"] == "trial_end"}
    assert ends["r0000-t00001"] == ("interrupted", 1)
    scored = score_run(run_dir)
    epoch_events = [e for e in events if e["event"] == "epoch_end"]
    assert scored.epochs_counted == 5 and scored.total_ops == sum(_epoch_ops(run_dir, e) for e in epoch_events)
    verify = subprocess.run([sys.executable, "-m", "aiperf_core", "score", str(run_dir), "--verify"],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and "verify: intact" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.slow  # the module's two real runs (RUNS), side by side: about 18 s
def test_a_slow_healthy_replica_is_never_touched(runs):
    tmp_path, result = runs["slow"]  # RUNS["slow"]: steps longer than the heartbeat interval
    assert result.returncode == 0, result.stdout + result.stderr
    events = read_events(tmp_path / "run/primary/events.jsonl")
    assert [(e["attempt"], e["status"]) for e in events if e["event"] == "replica_exit"] == [(1, "finished")]
    replica = read_events(tmp_path / "run/replicas/0/events.jsonl")
    assert [e["epoch"] for e in replica if e["event"] == "epoch_end"] == [0, 1]
    assert all(e["step_seconds"] >= 6.0 for e in replica if e["event"] == "epoch_end")

