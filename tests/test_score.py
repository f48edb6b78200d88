"""Scoring from hand-made run directories, against figures worked out by hand.

The run directories are written the way replicas and the primary write them (rundir.EventLog,
real graphs from the builders, their real op counts); only the clock is made up.
"""

import json
import math

import numpy as np
import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.cli import main
from aiperf_core.ir import save_graph
from aiperf_core.policy import Policy
from aiperf_core.rundir import EventLog, RunDir, RunDirError, chain_head, sha256_file
from aiperf_core.scoring import format_ops, score_run, snapshot, verify_run
from aiperf_opcount import count

START = 1000.0
BUDGET = 900.0  # 0.25 h: samples at 0.1 h, 0.2 h and the deadline
GRAPH_1 = resnet_small()
GRAPH_2 = resnet_small(classes=100)


def per_image(graph):
    c = count(graph)
    return c.fp, c.bp


class RunBuilder:
    """Writes a run directory event by event, as the primary and the replicas do."""

    def __init__(self, root, **run_fields):
        self.run = RunDir(root)
        fields = {"run_id": "test-run", "start_time": START, "time_budget_s": BUDGET, "deadline": START + BUDGET,
                  "backend": "numpy", "executor": "local", "replicas": 2, "devices_per_replica": 1, "seed": 1,
                  "model": "resnet50", "dataset": {"name": "imagenet", "classes": 1000},
                  "policy": Policy().to_json(), "policy_overridden_fixed": []}
        fields.update(run_fields)
        self.run.write_run(fields)
        self.primary = EventLog(self.run.primary_log).open()
        self.primary.append("run_start", time=START, resume=False)
        self.logs: dict[int, EventLog] = {}
        self.seq: dict[int, int] = {}

    def log(self, replica: int) -> EventLog:
        if replica not in self.logs:
            self.logs[replica] = EventLog(self.run.replica_log(replica)).open()
        return self.logs[replica]

    def replica_start(self, replica, t, attempt=1):
        self.log(replica).append("replica_start", time=t, replica=replica, pid=100 + replica, host=f"node{replica}",
                                 backend="numpy", framework_version="numpy 2.0", devices=1, attempt=attempt)

    def trial_start(self, replica, t, graph, precision="fp16", round_number=1):
        seq = self.seq.get(replica, 0)
        self.seq[replica] = seq + 1
        trial = f"r{replica:04d}-t{seq:05d}"
        path = self.run.trial_dir(trial) / "graph.json"
        save_graph(graph, path)
        hyper = {"batch_size": 32, "kernel_size": 3, "epochs": 5, "learning_rate": 0.1, "patience": 3,
                 "label_smoothing": 0.0, "precision": precision}
        self.log(replica).append("trial_start", time=t, replica=replica, trial=trial, round=round_number,
                                 parent=None, morph=None, hyper=hyper, graph_sha256=sha256_file(path))
        return trial

    def epoch(self, replica, trial, t, epoch, train_images, val_images, accuracy, started=None, **extra):
        self.log(replica).append("epoch_end", time=t, replica=replica, trial=trial, epoch=epoch,
                                 started=t - 50 if started is None else started, train_images=train_images,
                                 val_images=val_images, loss=1.0, val_loss=1.0, val_accuracy=accuracy, **extra)

    def trial_end(self, replica, trial, t, status="ok", epochs=1, best=None, reason=None):
        folder = self.run.trial_dir(trial)
        (folder / "trial.json").write_text(json.dumps({"trial": trial, "status": status}))
        np.savez(folder / "weights.npz", w=np.arange(4.0))
        files = {name: sha256_file(folder / name) for name in ("graph.json", "trial.json", "weights.npz")}
        self.log(replica).append("trial_end", time=t, replica=replica, trial=trial, status=status, reason=reason,
                                 epochs=epochs, best_val_accuracy=best, predicted_accuracy=None, files=files)

    def finish(self, t, reason="deadline"):
        for log in self.logs.values():
            log.close()
        heads = {str(r): chain_head(self.run.replica_log(r)) for r in self.run.replica_ids()}
        self.primary.append("run_end", time=t, reason=reason, log_heads=heads)
        self.primary.close()


def standard_run(root):
    """Two replicas over a 900 s budget; worked out by hand in test_score_matches_hand_computation.

    replica 0: trial A (graph 1) epochs at 1100 and 1400 (the second straddles the 0.1 h mark at
               1360), trial B (graph 2) an epoch at 1800 and one at 1950, after the deadline 1900.
    replica 1: trial C (graph 1) fails after epochs at 1200 and 1500; trial D (graph 2) finishes an
               epoch at 1700, the replica dies and restarts, D is closed 'interrupted'; trial E
               (graph 1 again: a shared graph) finishes an epoch at 1890 and is still running."""
    b = RunBuilder(root)
    b.replica_start(0, 1000)
    b.replica_start(1, 1000)
    a = b.trial_start(0, 1000, GRAPH_1, "fp16")
    b.epoch(0, a, 1100, 0, 1000, 200, 0.50)
    b.epoch(0, a, 1400, 1, 1000, 200, 0.60, started=1300)
    b.trial_end(0, a, 1400, epochs=2, best=0.6)
    t_b = b.trial_start(0, 1400, GRAPH_2, "fp32")
    b.epoch(0, t_b, 1800, 0, 2000, 100, 0.75)
    b.epoch(0, t_b, 1950, 1, 2000, 100, 0.90, started=1800)  # straddles the deadline: not counted
    b.trial_end(0, t_b, 1950, status="early_stopped", epochs=2, best=0.9)
    b.log(0).append("replica_stop", time=1950, replica=0, reason="deadline")
    c = b.trial_start(1, 1005, GRAPH_1, "bf16")
    b.epoch(1, c, 1200, 0, 500, 50, 0.40)
    b.epoch(1, c, 1500, 1, 500, 50, 0.55)
    b.trial_end(1, c, 1510, status="failed", epochs=2, best=0.55, reason="loss is NaN")
    d = b.trial_start(1, 1510, GRAPH_2, "fp16")
    b.epoch(1, d, 1700, 0, 800, 80, 0.72)
    b.replica_start(1, 1750, attempt=2)  # the replica died mid-trial and came back
    b.trial_end(1, d, 1751, status="interrupted", epochs=1, best=0.72, reason="replica restarted")
    e = b.trial_start(1, 1752, GRAPH_1, "fp16")
    b.epoch(1, e, 1890, 0, 300, 30, 0.65)
    return b


def test_score_matches_hand_computation(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    f1, b1 = per_image(GRAPH_1)
    f2, b2 = per_image(GRAPH_2)
    assert (f1, b1) != (f2, b2)
    # By 0.1 h (t = 1360): A's first epoch and C's first. A's second ends at 1400: not yet.
    ops_1 = 1000 * (f1 + b1) + 200 * f1 + 500 * (f1 + b1) + 50 * f1
    # By 0.2 h (t = 1720): + A1, C1 (graph 1) and D0 (graph 2).
    ops_2 = ops_1 + 1000 * (f1 + b1) + 200 * f1 + 500 * (f1 + b1) + 50 * f1 + 800 * (f2 + b2) + 80 * f2
    # By the deadline (t = 1900): + B0 (graph 2) and E0 (graph 1). B1 at 1950 is too late.
    ops_3 = ops_2 + 2000 * (f2 + b2) + 100 * f2 + 300 * (f1 + b1) + 30 * f1

    r = score_run(tmp_path)
    assert r.total_ops == ops_3
    assert r.epochs_counted == 7 and r.epochs_after_deadline == 1 and r.epochs_uncountable == 0
    assert [s[0] for s in r.samples] == [360.0, 720.0, 900.0]
    assert r.samples[0][1] == pytest.approx(ops_1 / 360)
    assert r.samples[1][1] == pytest.approx(ops_2 / 720)
    assert r.samples[2][1] == pytest.approx(ops_3 / 900)
    assert [s[3] for s in r.samples] == pytest.approx([0.5, 0.28, 0.25])  # best error so far
    assert r.samples[1][2] == pytest.approx(-math.log(0.28) * ops_2 / 720)
    assert r.score_ops == pytest.approx(ops_3 / 900)
    assert r.regulated_ops == pytest.approx(-math.log(0.25) * ops_3 / 900)
    assert r.best_accuracy == 0.75 and r.best_error == pytest.approx(0.25)  # 0.90 came after the deadline
    assert r.trials == 5
    assert r.trials_by_status == {"early_stopped": 1, "failed": 1, "interrupted": 1, "ok": 1, "running": 1}
    assert r.valid, r.reasons
    assert r.reasons == [] and r.notes == []
    d = r.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["label"] == "official" and d["score"] == format_ops(ops_3 / 900)


def test_scoring_before_the_end_uses_now(tmp_path):
    b = standard_run(tmp_path)  # no run_end yet: the run is going
    f1, b1 = per_image(GRAPH_1)
    r = score_run(tmp_path, now=1450)
    assert [s[0] for s in r.samples] == [360.0, 450.0]
    assert r.total_ops == 2 * (1000 * (f1 + b1) + 200 * f1) + 500 * (f1 + b1) + 50 * f1
    assert r.score_ops == pytest.approx(r.total_ops / 450)
    assert not r.valid and any("has not ended" in reason for reason in r.reasons)
    b.finish(1960)


def test_live_snapshot_follows_appended_events(tmp_path):
    b = standard_run(tmp_path)
    p = snapshot(tmp_path, now=1450)
    assert p.ops_per_s == pytest.approx(score_run(tmp_path, now=1450).score_ops)
    assert p.best_accuracy == 0.6 and p.trials_done == 4 and p.trials_running == 1  # the logs run ahead of `now`
    by_replica = {r.replica: r for r in p.replicas}
    assert by_replica[1].running == "r0001-t00002" and by_replica[1].attempts == 2
    assert by_replica[0].stopped and by_replica[0].trials_done == 2
    e = "r0001-t00002"
    b.epoch(1, e, 1895, 1, 300, 30, 0.8)  # appended after the first snapshot
    p = snapshot(tmp_path, now=1899)
    assert p.ops_per_s == pytest.approx(score_run(tmp_path, now=1899).score_ops)
    assert p.best_accuracy == 0.8 and p.epochs_counted == 8
    assert p.remaining_s == pytest.approx(1.0) and 0.99 < p.fraction < 1.0
    b.finish(1960)
    p = snapshot(tmp_path, now=2000)
    assert p.ended and p.ops_per_s == pytest.approx(score_run(tmp_path).score_ops)


def test_live_snapshot_starts_again_when_a_log_is_replaced(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    first = snapshot(tmp_path, now=1950)
    log = b.run.replica_log(1)
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:-1]))  # E's epoch is gone
    again = snapshot(tmp_path, now=1950)
    assert again.epochs_counted == first.epochs_counted - 1
    assert again.ops_per_s == pytest.approx(score_run(tmp_path, now=1950).score_ops)


def test_validity_lists_every_reason(tmp_path):
    policy = Policy({"dataset": "digits", "initial_architecture": "resnet_small", "hpo_start_round": 2}).to_json()
    b = RunBuilder(tmp_path, dataset={"name": "digits"}, model="resnet_small", policy=policy,
                   policy_overridden_fixed=["dataset", "initial_architecture", "hpo_start_round"])
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1, "fp8")
    b.epoch(0, t, 1100, 0, 100, 10, 0.5)
    b.trial_end(0, t, 1100)
    lost = b.trial_start(0, 1100, GRAPH_2, "fp16")
    b.epoch(0, lost, 1200, 0, 100, 10, 0.55)
    (b.run.trial_dir(lost) / "graph.json").unlink()  # its ops cannot be counted
    b.finish(1300, reason="interrupted")
    r = score_run(tmp_path)
    f1, b1 = per_image(GRAPH_1)
    assert r.total_ops == 100 * (f1 + b1) + 10 * f1 and r.epochs_uncountable == 1
    assert r.samples[-1][0] == 300.0  # the run ended at 1300, before its deadline
    assert not r.valid
    text = "\n".join(r.reasons)
    for expected in ("dataset is 'digits', not ImageNet", "initial architecture is 'resnet_small'",
                     "precision fp8 is below the minimum", "r0000-t00000", "best validation error 50.00% is above",
                     "fixed setting hpo_start_round changed to 2", f"trials/{lost}/graph.json: missing",
                     "ended before its deadline with run_end reason 'interrupted'"):
        assert expected in text, (expected, r.reasons)
    assert "fixed setting dataset" not in text  # named once, by the dataset rule
    assert len(r.reasons) == 7


def test_nas_and_error_rules(tmp_path):
    b = RunBuilder(tmp_path, policy=Policy({"nas_method": "network-morphism"}).to_json())
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1)
    b.epoch(0, t, 1100, 0, 100, 10, None)  # no validation result at all
    b.finish(1900)
    r = score_run(tmp_path)
    assert r.best_error is None and r.regulated_ops == 0.0 and r.score_ops > 0
    assert r.reasons == ["no validation accuracy was recorded by the end of the run"]


def test_a_perfect_accuracy_has_a_finite_regulated_score(tmp_path):
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1)
    b.epoch(0, t, 1100, 0, 100, 10, 1.0)
    b.finish(1900)
    r = score_run(tmp_path)
    assert r.best_accuracy == 1.0 and r.best_error == pytest.approx(0.05)  # half of one image in ten
    assert r.regulated_ops == pytest.approx(-math.log(0.05) * r.score_ops)


def test_torn_last_line_and_duplicate_epoch(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    before = score_run(tmp_path)
    log = b.run.replica_log(1)
    lines = log.read_bytes().splitlines(keepends=True)
    with open(log, "ab") as f:
        f.write(b'{"event": "epoch_end", "ti')  # a crash mid-write
    assert score_run(tmp_path).total_ops == before.total_ops
    log.write_bytes(b"".join(lines))
    with EventLog(log) as writer:  # the same epoch logged twice (a bug, or a replayed line)
        writer.append("epoch_end", time=1891, replica=1, trial="r0001-t00002", epoch=0, started=1800,
                      train_images=300, val_images=30, loss=1.0, val_loss=1.0, val_accuracy=0.65)
    r = score_run(tmp_path)
    assert r.total_ops == before.total_ops and any("logged after epoch 0: counted once" in n for n in r.notes)
    assert r.valid


def test_a_damaged_line_makes_the_run_unofficial(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    log = b.run.replica_log(0)
    lines = log.read_bytes().splitlines(keepends=True)
    lines[3] = b"garbage\n"  # trial A's second epoch and everything after it on replica 0
    log.write_bytes(b"".join(lines))
    r = score_run(tmp_path)
    assert r.epochs_counted == 5  # A0 from replica 0, all four of replica 1
    assert "replicas/0/events.jsonl: line 4 is not a JSON object" in "\n".join(r.reasons)


def test_bad_input_names_the_file_and_field(tmp_path):
    with pytest.raises(RunDirError, match="not a run directory"):
        score_run(tmp_path / "nowhere")
    b = RunBuilder(tmp_path)
    b.run.write_run({"start_time": "noon", "time_budget_s": 10})
    with pytest.raises(RunDirError, match=r"run\.json: start_time must be a number"):
        score_run(tmp_path)
    b.run.write_run({"start_time": START, "time_budget_s": BUDGET, "policy": {"max_epochs": 600}})
    with pytest.raises(RunDirError, match=r"run\.json: policy\.max_epochs"):
        score_run(tmp_path)
    b.run.write_run({"start_time": START, "time_budget_s": BUDGET})
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1)
    b.log(0).append("epoch_end", time=1100, trial=t, epoch=0, train_images=-3, val_images=1)
    with pytest.raises(RunDirError, match=r"replicas/0/events\.jsonl: line 3: epoch_end\.train_images"):
        score_run(tmp_path)


def test_format_ops_uses_the_papers_prefixes():
    assert format_ops(56.1e12) == "56.1 Tera-OPS"
    assert format_ops(194.53e15) == "195 Peta-OPS"
    assert format_ops(12.34e12) == "12.3 Tera-OPS"
    assert format_ops(999.96e12) == "1.00 Peta-OPS"
    assert format_ops(0) == "0 OPS"


# --verify ------------------------------------------------------------------------------------------

def test_intact_run_verifies(tmp_path):
    standard_run(tmp_path).finish(1960)
    assert verify_run(tmp_path) == []
    assert main(["score", str(tmp_path), "--verify"]) == 0
    assert json.loads((tmp_path / "score.json").read_text())["verify"] == {"intact": True, "problems": []}


@pytest.mark.parametrize("tamper, expected", [
    ("edit_line", "replicas/0/events.jsonl: line 4: hash chain broken"),  # the line after the edit
    ("drop_last_line", "replicas/1/events.jsonl: last line differs from run_end.log_heads"),
    ("change_graph", "trials/r0000-t00001/graph.json: content differs from trial_start.graph_sha256"),
    ("delete_weights", "trials/r0001-t00000/weights.npz: missing"),
    ("change_trial_json", "trials/r0000-t00000/trial.json: content differs from trial_end.files"),
    ("no_run_end", "primary/events.jsonl: no run_end"),
])
def test_verify_catches_tampering(tmp_path, capsys, tamper, expected):
    b = standard_run(tmp_path)
    if tamper != "no_run_end":
        b.finish(1960)
    run = b.run
    if tamper == "edit_line":  # more training images in an epoch: a higher score
        lines = run.replica_log(0).read_text().splitlines(keepends=True)
        assert '"train_images": 1000' in lines[2]
        lines[2] = lines[2].replace('"train_images": 1000', '"train_images": 9000')
        run.replica_log(0).write_text("".join(lines))
    elif tamper == "drop_last_line":
        lines = run.replica_log(1).read_text().splitlines(keepends=True)
        run.replica_log(1).write_text("".join(lines[:-1]))
    elif tamper == "change_graph":
        save_graph(resnet_small(classes=1000), run.trial_dir("r0000-t00001") / "graph.json")
    elif tamper == "delete_weights":
        (run.trial_dir("r0001-t00000") / "weights.npz").unlink()
    elif tamper == "change_trial_json":
        (run.trial_dir("r0000-t00000") / "trial.json").write_text("{}")
    problems = verify_run(tmp_path)
    assert any(p.startswith(expected) for p in problems), problems
    capsys.readouterr()
    assert main(["score", str(tmp_path), "--verify"]) == 1
    assert expected in capsys.readouterr().out


def test_a_changed_graph_is_not_counted(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    save_graph(resnet_small(classes=1000), b.run.trial_dir("r0000-t00001") / "graph.json")  # trial B, graph 2
    r = score_run(tmp_path)
    # Trial D pins the same graph 2 with an intact file, so B's epoch still counts, at graph 2's ops.
    assert r.epochs_uncountable == 0
    (b.run.trial_dir("r0001-t00001") / "graph.json").unlink()
    r = score_run(tmp_path)
    assert r.epochs_uncountable == 2 and not r.valid


def test_score_command_prints_and_writes_json(tmp_path, capsys):
    standard_run(tmp_path).finish(1960)
    assert main(["score", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["valid"] and out["epochs_counted"] == 7
    assert json.loads((tmp_path / "score.json").read_text())["score_ops"] == out["score_ops"]
    assert main(["score", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "Tera-OPS" in text or "Giga-OPS" in text or "Mega-OPS" in text
    assert "official" in text
    assert main(["score", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_many_new_graphs_are_counted_in_worker_processes(tmp_path, monkeypatch):
    import concurrent.futures

    from aiperf_core.scoring import ledger

    pools = []

    class RecordedPool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            pools.append(args)
            super().__init__(*args, **kwargs)

    standard_run(tmp_path).finish(1960)
    expected = score_run(tmp_path)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", RecordedPool)
    monkeypatch.setattr(ledger, "_PER_IMAGE", {})  # as in a fresh process: nothing counted yet
    monkeypatch.setattr(ledger, "PARALLEL_GRAPHS_PER_WORKER", 1)
    monkeypatch.setenv("AIPERF_SCORE_WORKERS", "2")
    jobs = [(tmp_path / "trials" / "r0000-t00000" / "graph.json", None)]
    assert ledger.count_graphs(jobs) == [(None, "trials/r0000-t00000/graph.json: content differs from "
                                                 "trial_start.graph_sha256")]
    r = score_run(tmp_path)
    assert pools == [(2,)] and len(ledger._PER_IMAGE) == 2  # both graphs, counted by two workers
    assert r.total_ops == expected.total_ops and r.score_ops == expected.score_ops


def test_tf32_meets_fp16_or_better_and_fp8_does_not(tmp_path):
    b = RunBuilder(tmp_path, replicas=1)
    b.replica_start(0, 1000)
    for precision, t in (("tf32", 1000), ("bf16", 1100), ("fp8", 1200)):
        trial = b.trial_start(0, t, GRAPH_1, precision)
        b.epoch(0, trial, t + 50, 0, 100, 10, 0.9)
        b.trial_end(0, trial, t + 60)
    b.finish(1900)
    reasons = score_run(tmp_path).reasons
    assert len(reasons) == 1 and reasons[0].startswith("precision fp8 is below the minimum"), reasons


def test_a_run_produced_nothing_only_when_no_trial_succeeded_and_something_failed(tmp_path):
    assert score_run_of(standard_run(tmp_path / "standard")).failure is None  # it has ok trials

    b = RunBuilder(tmp_path / "short", replicas=1)  # the budget ended inside the first epoch: no failure
    b.replica_start(0, 1000)
    b.trial_start(0, 1000, GRAPH_1)
    assert score_run_of(b).failure is None

    b = RunBuilder(tmp_path / "open", replicas=1)  # one trial failed, the next was training fine at the end
    b.replica_start(0, 1000)
    b.trial_end(0, b.trial_start(0, 1000, GRAPH_1), 1010, status="failed", epochs=0, reason="RuntimeError: x")
    b.epoch(0, b.trial_start(0, 1010, GRAPH_1), 1500, 0, 100, 10, 0.5)
    assert score_run_of(b).failure is None

    # Every replica crashed at start-up (no trial at all): the first crash and the last line of its log.
    b = RunBuilder(tmp_path / "crashed", replicas=1)
    for attempt, t in ((1, 1010), (2, 1020)):
        b.primary.append("replica_exit", time=t, replica=0, attempt=attempt, status="crashed",
                         reason="exit code 2", job="123", exit="exit code 2", trial=None, restart=attempt < 2,
                         log_tail=["Traceback (most recent call last):", f"ImportError: libcuda.so.{attempt}", ""])
    failure = score_run_of(b, reason="all_replicas_failed").failure
    assert (failure.failed_trials, failure.failed_attempts, failure.first_where) == (0, 2, "replica 0, attempt 1")
    assert failure.first_cause == "exit code 2; its log ends: ImportError: libcuda.so.1"

    # A crash in every trial: interrupted trials (with counted epochs) and crashed attempts.
    b = RunBuilder(tmp_path / "segfaults", replicas=1)
    b.replica_start(0, 1000)
    trial = b.trial_start(0, 1000, GRAPH_1)
    b.epoch(0, trial, 1100, 0, 100, 10, 0.5)
    b.primary.append("replica_exit", time=1150, replica=0, attempt=1, status="crashed",
                     reason=f"killed by signal 11 (SIGSEGV) during trial {trial}", log_tail=[], restart=False)
    b.replica_start(0, 1160, attempt=2)
    b.trial_end(0, trial, 1161, status="interrupted", epochs=1, reason="restarted")
    result = score_run_of(b, reason="all_replicas_failed")
    assert result.score_ops > 0 and result.failure.first_cause.startswith("killed by signal 11")
    assert result.to_dict()["failure"]["first_where"] == "replica 0, attempt 1"


def score_run_of(builder, reason="deadline"):
    builder.finish(1900, reason=reason)
    return score_run(builder.run.root)


def test_compile_seconds_per_trial_and_replica(tmp_path):
    from aiperf_core.scoring.ledger import RunLedger

    b = RunBuilder(tmp_path, replicas=1)
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1)
    b.epoch(0, t, 1100, 0, 100, 10, 0.5, compile_seconds=12.5)
    b.epoch(0, t, 1200, 1, 100, 10, 0.5, compile_seconds=None)  # not measured: adds nothing
    b.epoch(0, t, 1300, 2, 100, 10, 0.5, compile_seconds=0.0)
    u = b.trial_start(0, 1300, GRAPH_1)
    b.epoch(0, u, 1400, 0, 100, 10, 0.5)  # a log written before compile_seconds existed
    b.finish(1900)
    ledger = RunLedger(tmp_path)
    ledger.refresh()
    assert ledger.trials[t].compile_seconds == 12.5 and ledger.trials[u].compile_seconds is None
    assert ledger.replicas[0].compile_seconds == 12.5
