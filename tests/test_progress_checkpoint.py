"""primary/progress.json: a reader that starts from the primary's checkpoint shows exactly what a
reader of every log shows, and reads only what the logs gained since; a checkpoint it cannot
trust is ignored (aiperf_core.scoring.progress)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from aiperf_core.monitoring.exporter.collector import RunCollector
from aiperf_core.rundir import RunDir
from aiperf_core.scoring import progress
from aiperf_core.scoring.progress import live_ledger, snapshot, write_checkpoint
from test_metrics import scrape
from test_score import GRAPH_1, GRAPH_2, RunBuilder, resnet_small

GRAPH_3 = resnet_small(classes=37)  # a graph no other trial has

NOW = 2100.0  # after the run's end
CHECKPOINT_AT = 1450.0


def first_half(root, waiting=False):
    """Two replicas: replica 0 ends trial A and is in trial B, replica 1 ends trial C and is in
    trial X. With `waiting`, X's graph file is away (it does not resolve yet)."""
    b = RunBuilder(root)
    b.primary.append("replica_launch", time=1000, replica=0, attempt=1, job="1", log_seq=0)
    b.primary.append("replica_launch", time=1000, replica=1, attempt=1, job="2", log_seq=0)
    b.replica_start(0, 1000)
    b.replica_start(1, 1000)
    a = b.trial_start(0, 1000, GRAPH_1, "fp16")
    b.epoch(0, a, 1100, 0, 1000, 200, 0.50, step_seconds=40.0, compile_seconds=2.0)
    b.epoch(0, a, 1300, 1, 1000, 200, 0.60, started=1200)
    b.trial_end(0, a, 1300, epochs=2, best=0.6)
    t_b = b.trial_start(0, 1300, GRAPH_2, "fp32")
    b.epoch(0, t_b, 1400, 0, 2000, 100, 0.75)
    c = b.trial_start(1, 1005, GRAPH_1, "bf16")
    b.epoch(1, c, 1200, 0, 500, 50, 0.40)
    b.trial_end(1, c, 1240, status="ok", epochs=1, best=0.4)
    x = b.trial_start(1, 1250, GRAPH_3, "fp16")
    if waiting:
        os.replace(b.run.trial_dir(x) / "graph.json", b.run.trial_dir(x) / "graph.json.away")
    b.epoch(1, x, 1420, 0, 300, 30, 0.30)
    return b, {"a": a, "b": t_b, "c": c, "x": x, "waiting": waiting}


def second_half(b, trials):
    """The rest: epochs after the checkpoint, X's graph back, a restart, the run's end."""
    away = b.run.trial_dir(trials["x"]) / "graph.json.away"
    if away.exists():
        os.replace(away, away.with_suffix(""))
    b.epoch(0, trials["b"], 1600, 1, 2000, 100, 0.80, started=1450)
    b.trial_end(0, trials["b"], 1600, status="early_stopped", epochs=2, best=0.8)
    b.epoch(1, trials["x"], 1500, 1, 300, 30, 0.35)
    if trials["waiting"]:  # a later trial of X's graph, with its file: X's graph resolves
        y = b.trial_start(0, 1610, GRAPH_3, "fp16")
        b.epoch(0, y, 1700, 0, 100, 10, 0.5)
    b.trial_end(1, trials["x"], 1550, status="failed", epochs=1, best=0.3, reason="loss is NaN")
    b.primary.append("replica_exit", time=1560, replica=1, attempt=1, status="crashed", reason="exit code 1",
                     restart=True)
    b.primary.append("replica_launch", time=1570, replica=1, attempt=2, job="3", log_seq=9)
    b.replica_start(1, 1580, attempt=2)
    e = b.trial_start(1, 1590, GRAPH_1, "fp16")
    b.epoch(1, e, 1850, 0, 700, 70, 0.82)
    b.log(0).append("replica_stop", time=1800, replica=0, reason="deadline")
    b.finish(1960)


def from_logs(root, now=NOW):
    """What a reader of every log shows: no checkpoint, a new ledger."""
    checkpoint = RunDir(root).progress_checkpoint
    kept = checkpoint.with_suffix(".kept")
    if checkpoint.exists():
        os.replace(checkpoint, kept)
    try:
        progress.forget(root)
        result = snapshot(root, now), scrape(RunCollector(root))
        assert not progress._LIVE[Path(root).resolve()].from_checkpoint
        return result
    finally:
        progress.forget(root)
        if kept.exists():
            os.replace(kept, checkpoint)


def from_checkpoint(root, now=NOW):
    """What a new reader shows (it starts from the checkpoint where it can): (progress, its
    ledger, whether it started from the checkpoint)."""
    progress.forget(root)
    with live_ledger(root, now) as (shown, ledger):
        return shown, ledger, progress._LIVE[Path(root).resolve()].from_checkpoint


def follow_and_checkpoint(root, waiting=False):
    """The primary's side: its live ledger follows the run, and writes the checkpoint mid-run.
    What that same ledger shows at NOW, having followed the whole run."""
    b, trials = first_half(root, waiting)
    snapshot(root, 1300.0)
    write_checkpoint(root, CHECKPOINT_AT)
    second_half(b, trials)
    followed = snapshot(root, NOW)
    progress.forget(root)
    return followed


@pytest.fixture
def checkpointed(tmp_path):
    follow_and_checkpoint(tmp_path)
    yield tmp_path
    progress.forget(tmp_path)


def test_a_reader_from_the_checkpoint_shows_what_a_reader_of_every_log_shows(checkpointed):
    expected, expected_scrape = from_logs(checkpointed)
    shown, ledger, resumed = from_checkpoint(checkpointed)
    assert resumed
    assert shown == expected
    # It read only what the logs gained after the checkpoint: its ledger holds only those epochs.
    assert sorted(e[0] for e in ledger.epochs) == [1500, 1600, 1850]
    assert len(ledger.trials) == 5
    progress.forget(checkpointed)
    assert scrape(RunCollector(checkpointed)) == expected_scrape
    assert progress._LIVE[checkpointed.resolve()].from_checkpoint
    assert shown.epochs_counted == 8 and shown.trials_done == 4 and shown.ended
    assert [r.attempts for r in shown.replicas] == [1, 2]


def test_a_trial_waiting_for_its_graph_at_the_checkpoint_resolves_after_it(tmp_path):
    """Like the ledger that followed the run: the epoch logged while the graph was away is left
    out of the live totals (score_run counts it), the later ones count."""
    followed = follow_and_checkpoint(tmp_path, waiting=True)
    shown, ledger, resumed = from_checkpoint(tmp_path)
    assert resumed and shown == followed
    x = ledger.trials["r0001-t00001"]
    assert x.per_image is not None and x.problem is None and x.epochs == 2
    assert shown.epochs_counted == 8  # of 9: X's first epoch is not in the live totals
    progress.forget(tmp_path)


def test_the_checkpoint_mid_run_matches_the_logs_at_its_time(tmp_path):
    first_half(tmp_path)
    write_checkpoint(tmp_path, CHECKPOINT_AT)
    expected, _ = from_logs(tmp_path, CHECKPOINT_AT)
    shown, ledger, resumed = from_checkpoint(tmp_path, CHECKPOINT_AT)
    assert resumed and shown == expected and ledger.epochs == []
    assert shown.trials_running == 2 and shown.epochs_counted == 5 and shown.trials_done == 2
    progress.forget(tmp_path)


def test_the_clock_going_back_before_the_checkpoint_reads_every_log(checkpointed):
    expected, _ = from_logs(checkpointed, 1250.0)
    shown, ledger, resumed = from_checkpoint(checkpointed, 1250.0)
    assert not resumed and shown == expected and shown.epochs_counted == 2


def test_a_log_replaced_after_the_checkpoint_is_read_again_whole(checkpointed):
    log = RunDir(checkpointed).replica_log(0)
    copy = log.with_suffix(".copy")
    shutil.copyfile(log, copy)
    os.replace(copy, log)  # the same bytes in another file
    expected, expected_scrape = from_logs(checkpointed)
    shown, _, resumed = from_checkpoint(checkpointed)
    assert not resumed and shown == expected


@pytest.mark.parametrize("change", ["not json", "another run", "another version", "a field missing",
                                    "a trial field missing", "a tail of a negative offset"])
def test_a_checkpoint_that_cannot_be_trusted_is_ignored(checkpointed, change):
    path = RunDir(checkpointed).progress_checkpoint
    state = json.loads(path.read_text())
    if change == "another run":
        state["run_id"] = "other-run"
    elif change == "another version":
        state["version"] += 1
    elif change == "a field missing":
        del state["totals"]["ops_done"]
    elif change == "a trial field missing":
        state["ledger"]["trials"][0].pop()
    elif change == "a tail of a negative offset":
        state["ledger"]["tails"]["0"]["offset"] = -5
    path.write_text("{" if change == "not json" else json.dumps(state))
    expected, _ = from_logs(checkpointed)
    shown, _, resumed = from_checkpoint(checkpointed)
    assert not resumed and shown == expected


def test_the_checkpoint_is_written_atomically_and_names_its_run(checkpointed, monkeypatch):
    state = json.loads(RunDir(checkpointed).progress_checkpoint.read_text())
    assert state["format"] == "aiperf-progress-checkpoint" and state["version"] == 4
    assert state["run_id"] == "test-run" and set(state["ledger"]["tails"]) == {"0", "1"}
    before = RunDir(checkpointed).progress_checkpoint.read_bytes()

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(progress, "write_bytes_atomic", fail)
    with pytest.raises(OSError):
        write_checkpoint(checkpointed)
    assert RunDir(checkpointed).progress_checkpoint.read_bytes() == before


def test_the_primarys_writer_says_a_failure_once_and_never_raises(tmp_path, monkeypatch):
    from aiperf_core.workflow.progress import CheckpointWriter

    first_half(tmp_path)
    notes = []
    writer = CheckpointWriter(tmp_path, notes.append)
    writer.tick(CHECKPOINT_AT)  # within the first interval: nothing written yet
    assert not RunDir(tmp_path).progress_checkpoint.exists()
    monkeypatch.setattr(progress, "CHECKPOINT_INTERVAL_S", 0.0)
    writer.tick(CHECKPOINT_AT)
    assert json.loads(RunDir(tmp_path).progress_checkpoint.read_text())["totals"]["epochs_done"] == 5

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(progress, "write_bytes_atomic", full_disk)
    writer.tick(CHECKPOINT_AT)
    writer.write()
    assert len(notes) == 1 and "primary/progress.json not written" in notes[0] and "No space left" in notes[0]
    progress.forget(tmp_path)
