"""Runs begun by an aiperf before `hpo_point` (issue #42, item 4): their published lines carried
top-level `batch_size` and `kernel_size`, their trial.json only `hyper`. A cnn run resumed by this
aiperf reads them as the cnn's HPO point; a run that cannot (another workload, a line with no
point) sets them aside and says so once, in the primary's log and on the terminal."""

from __future__ import annotations

import json
import time

from aiperf_core import workloads
from aiperf_core.builders import resnet_small
from aiperf_core.policy import Policy
from aiperf_core.rundir import EventLog, RunDir, read_events, sha256_bytes
from aiperf_core.scoring import verify_run
from aiperf_core.search.arch import encode
from aiperf_core.search.history import (HISTORY_NAME, HistoryPublisher, SharedHistory, encode_arch, records_of,
                                        set_aside_note)
from aiperf_core.workflow.plan import WatchSettings
from aiperf_core.workflow.primary import Primary
from aiperf_core.workflow.simulation import VirtualClock
from test_history_published import rechain
from test_workflow import ScriptedExecutor

ARCH = encode(resnet_small()).to_json()
NOW = 1.8e9
OLD_POINTS = {"r0000-t00000": (48, 5), "r0001-t00000": (32, 3), "r0001-t00001": (64, 7)}


def old_trial_json(trial: str, replica: int, seq: int, batch: int, kernel: int) -> bytes:
    """trial.json as the replica of commit a1f5d33^ wrote it: the point only in `hyper`."""
    hyper = {"batch_size": batch, "kernel_size": kernel, "epochs": 1, "learning_rate": 0.1 * batch / 256,
             "patience": 2, "label_smoothing": 0.1, "precision": "fp32"}
    return json.dumps({"trial": trial, "replica": replica, "round": seq + 1, "parent": None, "morph": None,
                       "hyper": hyper, "hpo": "warmup", "nas": None, "status": "ok", "reason": None, "epochs": 1,
                       "val_accuracy": [0.5], "val_loss": [1.0], "best_val_accuracy": 0.5,
                       "predicted_accuracy": 0.6, "target": 0.6, "compile_seconds": 0.0, "arch": ARCH,
                       "signature": f"sig-{trial}"}).encode()


def old_line(trial: str, replica: int, raw: bytes, files: dict[str, str]) -> dict:
    """published_fields of commit a1f5d33^: the point as two top-level fields."""
    info = json.loads(raw)
    return {"trial": trial, "replica": replica, "round": int(info["round"]), "target": float(info["target"]),
            "best_val_accuracy": float(info["best_val_accuracy"]),
            "batch_size": int(info["hyper"]["batch_size"]), "kernel_size": int(info["hyper"]["kernel_size"]),
            "arch": encode_arch(info["arch"]), "signature": str(info["signature"]), "files": dict(files)}


def old_run(root, workload: str | None = None) -> RunDir:
    """A run an older aiperf began and its primary published: OLD_POINTS' trials, every file in the
    old form. run.json has no `workload` unless given (runs before workloads had none)."""
    run_dir = RunDir(root)
    run_dir.primary_dir.mkdir(parents=True)
    run_dir.write_run({"replicas": 2, "deadline": NOW, **({"workload": workload} if workload else {})})
    with EventLog(run_dir.history_file) as history:
        for trial, (batch, kernel) in OLD_POINTS.items():
            replica, seq = int(trial[1:5]), int(trial[-5:])
            raw = old_trial_json(trial, replica, seq, batch, kernel)
            run_dir.trial_dir(trial).mkdir(parents=True)
            (run_dir.trial_dir(trial) / "trial.json").write_bytes(raw)
            files = {"trial.json": sha256_bytes(raw), "weights.npz": "0" * 64, "graph.json": "0" * 64}
            with EventLog(run_dir.replica_log(replica)) as log:
                log.append("trial_end", replica=replica, trial=trial, status="ok", files=files)
            history.append("trial", **old_line(trial, replica, raw, files))
    return run_dir


def test_a_cnn_run_reads_the_old_fields_as_its_hpo_point(tmp_path):
    run_dir = old_run(tmp_path / "run")
    expected = {trial: {"batch_size": batch, "kernel_size": kernel} for trial, (batch, kernel) in OLD_POINTS.items()}
    # Replica 0: its own trial from its old trial.json, the others from the old published lines.
    replica = SharedHistory(run_dir, replica=0, workload="cnn")
    assert {r.trial: r.hpo_point for r in replica.refresh()} == expected
    assert all(type(v) is int for r in replica.records for v in r.hpo_point.values())
    # The same names as the cnn's HPO dimensions: the tuner takes them as observations.
    dimensions = workloads.get("cnn").hpo.dimensions(Policy({}))
    assert {d.name for d in dimensions} == {"batch_size", "kernel_size"}
    # A reader without a published history reads the old trial.json files the same.
    run_dir.history_file.rename(run_dir.history_file.with_name("history.jsonl.aside"))
    assert {r.trial: r.hpo_point for r in SharedHistory(run_dir).refresh()} == expected


def test_a_resumed_primary_keeps_the_old_lines_and_publishes_new_ones_in_the_new_form(tmp_path):
    run_dir = old_run(tmp_path / "run")
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW), workload="cnn")
    publisher.open(NOW)
    assert publisher.set_aside == {}
    raw = json.dumps({"round": 3, "target": 0.7, "best_val_accuracy": 0.7,
                      "hyper": {"batch_size": 40, "kernel_size": 3}, "hpo_point": {"batch_size": 40, "kernel_size": 3},
                      "arch": ARCH, "signature": "sig-new"}).encode()
    run_dir.trial_dir("r0001-t00002").mkdir(parents=True)
    (run_dir.trial_dir("r0001-t00002") / "trial.json").write_bytes(raw)
    with EventLog(run_dir.replica_log(1)) as log:
        log.append("trial_end", replica=1, trial="r0001-t00002", status="ok",
                   files={"trial.json": sha256_bytes(raw), "weights.npz": "0" * 64, "graph.json": "0" * 64})
    assert publisher.publish_all(NOW + 1) == 1  # the old trials are not published again
    publisher.close()
    lines = read_events(run_dir.history_file)
    assert ["hpo_point" in line for line in lines] == [False, False, False, True]
    history = SharedHistory(run_dir, workload="cnn")
    assert [r.hpo_point["batch_size"] for r in history.refresh()] == [48, 32, 64, 40]
    # --verify finds the old lines exactly what their trial_end and old trial.json give.
    assert [p for p in verify_run(run_dir) if p.startswith(HISTORY_NAME)] == []


def test_verify_names_an_old_line_whose_point_was_forged(tmp_path):
    run_dir = old_run(tmp_path / "run")
    lines = [{k: v for k, v in line.items() if k not in ("seq", "prev")} for line in read_events(run_dir.history_file)]
    lines[1]["kernel_size"] = 7
    run_dir.history_file.write_bytes(rechain(lines))
    assert [p for p in verify_run(run_dir) if p.startswith(HISTORY_NAME)] == [
        f"{HISTORY_NAME}: line 2: trial r0001-t00000: hpo_point differ from its trial_end and trial.json "
        "(the line was forged or altered)"]


def test_lines_that_cannot_be_read_are_set_aside_with_the_reason():
    base = {"trial": "t", "replica": 0, "round": 1, "target": 0.5, "best_val_accuracy": 0.5,
            "arch": encode_arch(ARCH), "signature": "s", "files": {}}
    old = {**base, "trial": "old", "batch_size": 32, "kernel_size": 3}
    pointless = {**base, "trial": "pointless"}
    damaged = {**base, "trial": "damaged", "hpo_point": {"batch_size": 32}, "arch": {"layers": "?"}}
    nameless = {**old, "trial": None}
    set_aside: dict[str, str] = {}
    assert [r.trial for r, _ in records_of([old, pointless, damaged, nameless], "cnn", set_aside)] == ["old"]
    assert set_aside == {"pointless": "no hpo_point, nor the batch_size and kernel_size of an aiperf before it",
                         "damaged": "a field this aiperf cannot read (not a published architecture code)"}
    set_aside.clear()
    assert records_of([old], "lm", set_aside) == []
    assert set_aside == {"old": "batch_size and kernel_size (written before hpo_point, the cnn's point) in a lm run"}
    many = {f"t{k}": "no hpo_point" for k in range(7)} | {"x": "no target"}
    assert set_aside_note(many) == (
        f"{HISTORY_NAME}: 8 published trial(s) set aside, not parents or HPO data for this run: "
        "7 with no hpo_point (t0, t1, t2, t3, t4 and 2 more); 1 with no target (x)")


def resumed_primary(run_dir: RunDir, workload: str | None) -> tuple[list[str], list[dict]]:
    """Resume the run with a primary whose replicas end at once; (its notes, its log's events)."""
    with EventLog(run_dir.primary_log) as log:  # the older aiperf's primary, killed
        log.append("run_start", resume=False)
    notes: list[str] = []
    run = {"deadline": time.time() + 60.0, "replicas": 2, **({"workload": workload} if workload else {})}
    settings = WatchSettings(max_restarts=3, heartbeat_timeout_s=60.0, stop_grace_s=0.2, slurm={})
    primary = Primary(run_dir, run, ScriptedExecutor(run_dir, {}), settings, resume=True, notify=notes.append)
    assert primary.run_to_end() == "all_replicas_finished"
    return notes, read_events(run_dir.primary_log)


def test_a_cnn_run_resumes_with_its_old_trials_and_no_warning(tmp_path):
    notes, events = resumed_primary(old_run(tmp_path / "run"), None)
    assert not [n for n in notes if "set aside" in n]
    assert not [e for e in events if e["event"] == "history_set_aside"]


def test_a_run_that_cannot_read_the_old_lines_says_so_once(tmp_path):
    run_dir = old_run(tmp_path / "run", workload="lm")
    notes, events = resumed_primary(run_dir, "lm")
    why = "batch_size and kernel_size (written before hpo_point, the cnn's point) in a lm run"
    assert [n for n in notes if "set aside" in n] == [
        f"{HISTORY_NAME}: 3 published trial(s) set aside, not parents or HPO data for this run: 3 with {why} "
        "(r0000-t00000, r0001-t00000, r0001-t00001)"]
    set_aside = [e for e in events if e["event"] == "history_set_aside"]
    assert [e["trials"] for e in set_aside] == [{trial: why for trial in OLD_POINTS}]
    # ... and its replicas read none of them.
    assert SharedHistory(run_dir, replica=0, workload="lm").refresh() == []

