"""The live line of `aiperf run` says what a replica does when it is not stepping (compiling,
evaluating, between trials, starting) instead of '0.0 images/s  - OPS analytic'."""

from __future__ import annotations

import json
import time

import pytest

from aiperf_core.backend import StepClock
from aiperf_core.rundir import RunDir
from aiperf_core.scoring.progress import Progress, ReplicaProgress
from aiperf_core.workflow.progress import (BETWEEN_TRIALS, COMPILING, EVALUATING, STARTING, STEPPING, live_figures,
                                           render, replica_state)

TRIAL = "r0000-t00003"


def snapshot(now: float, running: str | None, trials_done: int = 3) -> Progress:
    replica = ReplicaProgress(0, "node1", 1, trials_done, running, 0, False, None,
                              running_per_image=(10**9, 2 * 10**9) if running else None)
    return Progress(now=now, elapsed_s=400, budget_s=3600, remaining_s=3200, ended=False, trials_done=trials_done,
                    trials_running=int(running is not None), epochs_counted=0, ops_per_s=0.0, regulated_ops=0.0,
                    best_accuracy=None, best_error=None, replicas=(replica,))


def live_lines(tmp_path, running: str | None, **beat) -> tuple[str, list[str]]:
    """(replica 0's state, the display's lines) for a heartbeat written now."""
    now = time.time()
    run_dir = RunDir(tmp_path)
    run_dir.write_heartbeat(0, **beat)
    progress = snapshot(now, running)
    live = live_figures(run_dir, progress)
    return live.replicas[0].state, render(progress, live)


def test_stepping_shows_images_per_second_and_operations(tmp_path):
    now = time.time()
    state, lines = live_lines(tmp_path, TRIAL, state="training", trial=TRIAL, since=now - 100,
                              progress={"time": now - 1, "train_time": now - 1, "images": 6000,
                                        "epoch_start": now - 61})
    assert state == STEPPING
    assert lines[2] == "live, not scored: 100 images/s  300 Giga-OPS analytic (1 of 1 training replicas reporting)"
    assert lines[3].endswith(f"training {TRIAL} (epoch 1, 100 images/s)")


def test_compiling_before_the_trials_first_step(tmp_path):
    now = time.time()
    state, lines = live_lines(tmp_path, TRIAL, state="training", trial=TRIAL, since=now - 75, progress=None)
    assert state == COMPILING
    assert lines[2] == "live, not scored: compiling (1 of 1 training replicas reporting)"
    assert lines[3].endswith(f"training {TRIAL} (epoch 1, compiling: no step yet after 1m15s)")


def test_evaluating_when_the_last_step_was_a_validation_step(tmp_path):
    now = time.time()
    state, lines = live_lines(tmp_path, TRIAL, state="training", trial=TRIAL, since=now - 100,
                              progress={"time": now - 1, "train_time": now - 9, "images": 6000,
                                        "epoch_start": now - 69})
    assert state == EVALUATING
    assert lines[2] == "live, not scored: evaluating (1 of 1 training replicas reporting)"
    assert lines[3].endswith(f"training {TRIAL} (epoch 1, evaluating)")


@pytest.mark.parametrize("beat_state, beat_trial, running", [
    ("recording", TRIAL, TRIAL),  # writing the trial's files: the ledger still shows it running
    ("planning", None, TRIAL),  # the ledger has not read its trial_end yet
    ("planning", None, None),  # nothing runs
    ("training", "r0000-t00004", TRIAL),  # the heartbeat is at the next trial, the ledger not yet
])
def test_between_trials(tmp_path, beat_state, beat_trial, running):
    now = time.time()
    state, lines = live_lines(tmp_path, running, state=beat_state, trial=beat_trial, since=now - 5,
                              progress=None)
    assert state == BETWEEN_TRIALS
    if running:
        assert lines[2] == "live, not scored: between trials (1 of 1 training replicas reporting)"
        assert lines[3].endswith(f"training {TRIAL} (epoch 1, between trials)")
    else:
        assert lines[2] == "live, not scored: between trials"
        assert lines[3].endswith("3 trials done, planning")


def test_starting_before_the_first_trial(tmp_path):
    now = time.time()
    state, lines = live_lines(tmp_path, None, state="starting", trial=None, since=now - 3, progress=None)
    assert state == STARTING
    assert lines[2] == "live, not scored: starting"


def test_several_replicas_doing_different_things(tmp_path):
    now = time.time()
    run_dir = RunDir(tmp_path)
    trials = ["r0000-t00003", "r0001-t00002", "r0002-t00001"]
    run_dir.write_heartbeat(0, state="training", trial=trials[0], since=now - 100,
                            progress={"time": now - 1, "train_time": now - 1, "images": 6000, "epoch_start": now - 61})
    run_dir.write_heartbeat(1, state="training", trial=trials[1], since=now - 30, progress=None)
    run_dir.write_heartbeat(2, state="training", trial=trials[2], since=now - 100,
                            progress={"time": now - 1, "train_time": now - 5, "images": 10, "epoch_start": now - 61})
    replicas = tuple(ReplicaProgress(i, f"node{i}", 1, 1, trial, 0, False, None, running_per_image=(1, 2))
                     for i, trial in enumerate(trials))
    progress = Progress(now=now, elapsed_s=400, budget_s=3600, remaining_s=3200, ended=False, trials_done=3,
                        trials_running=3, epochs_counted=0, ops_per_s=0.0, regulated_ops=0.0, best_accuracy=None,
                        best_error=None, replicas=replicas)
    lines = render(progress, live_figures(run_dir, progress))
    assert lines[2] == ("live, not scored: 100 images/s  300 OPS analytic (3 of 3 training replicas reporting; "
                        "1 compiling, 1 evaluating)")


def test_the_step_clock_marks_validation_steps(tmp_path, monkeypatch):
    """A real StepClock: after a training step (count) the replica steps; after a validation step
    (no count) it evaluates."""
    progress_file = tmp_path / "progress.json"
    monkeypatch.setenv(StepClock.PROGRESS_FILE_ENV, str(progress_file))
    monkeypatch.setattr(StepClock, "PROGRESS_INTERVAL_S", 0.0)
    clock = StepClock()
    with clock:
        pass
    clock.count(32)

    def state() -> str:
        return replica_state({"state": "training", "trial": TRIAL, "progress": json.loads(progress_file.read_text())},
                             TRIAL)

    assert state() == STEPPING
    time.sleep(0.01)  # the validation step ends strictly later
    with clock:
        pass
    assert state() == EVALUATING
    with clock:
        pass
    clock.count(32)
    assert state() == STEPPING
