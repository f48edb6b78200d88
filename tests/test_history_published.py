"""The published history (issue #23, item 3): the primary publishes every usable trial once to
primary/history.jsonl, a restarted primary neither duplicates nor loses one, a replica sees its own
trials at once and each trial once, a refresh costs the same few filesystem calls at any replica
count, `--verify` checks the file, and scoring never reads it."""

from __future__ import annotations

import json

import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.morph.cnn import random_morph
from aiperf_core.rundir import GENESIS, EventLog, RunDir, RunDirError, read_events, sha256_bytes, verify_chain
from aiperf_core.scoring import score_run, verify_run
from aiperf_core.search.arch import encode
from aiperf_core.search.history import HistoryPublisher, SharedHistory, records_of
from aiperf_core.workflow.simulation import (FsCalls, ReplicaModel, VirtualClock, expected_ops, simulate,
                                             write_graph_pool, write_weights_stand_in)

ARCH = encode(resnet_small()).to_json()
NOW = 1.8e9


def finish(run_dir: RunDir, log: EventLog, replica: int, seq: int, target: float = 0.5, status: str = "ok") -> str:
    """What a replica writes when a trial ends: trial.json, then trial_end with its hash."""
    trial = f"r{replica:04d}-t{seq:05d}"
    info = {"round": seq + 1, "target": target, "best_val_accuracy": target,
            "hyper": {"batch_size": 32, "kernel_size": 3}, "hpo_point": {"batch_size": 32, "kernel_size": 3},
            "arch": ARCH, "signature": f"sig-{trial}"}
    text = json.dumps(info).encode()
    run_dir.trial_dir(trial).mkdir(parents=True, exist_ok=True)
    (run_dir.trial_dir(trial) / "trial.json").write_bytes(text)
    log.append("trial_end", replica=replica, trial=trial, status=status,
               files={"trial.json": sha256_bytes(text), "weights.npz": "0" * 64, "graph.json": "0" * 64})
    return trial


def published(run_dir: RunDir) -> list[str]:
    return [line["trial"] for line in read_events(run_dir.history_file)]


@pytest.fixture
def logs(tmp_path):
    run_dir = RunDir(tmp_path)
    opened = [EventLog(run_dir.replica_log(i)).open() for i in (0, 1)]
    yield run_dir, opened
    for log in opened:
        log.close()


def test_the_primary_publishes_each_usable_trial_once(logs):
    run_dir, (log0, log1) = logs
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    first = finish(run_dir, log0, 0, 0)
    finish(run_dir, log1, 1, 0, status="failed")  # no weights: never published
    changed = finish(run_dir, log1, 1, 1)
    (run_dir.trial_dir(changed) / "trial.json").write_text("{}")  # not what trial_end recorded
    assert publisher.poll(NOW + 1) == 1
    second = finish(run_dir, log1, 1, 2)
    assert publisher.poll(NOW + 2) == 1
    assert publisher.poll(NOW + 3) == 0 and publisher.publish_all(NOW + 4) == 0
    assert published(run_dir) == [first, second]
    assert verify_chain(run_dir.history_file) == []
    line = read_events(run_dir.history_file)[0]
    assert (line["event"], line["replica"], line["round"], line["target"]) == ("trial", 0, 1, 0.5)
    record, summary = records_of([line])[0]
    assert record.arch.to_json() == ARCH and summary.tolist() == record.arch.summary().tolist()
    publisher.close()


def test_a_log_is_read_less_often_as_its_trial_goes_on(logs):
    run_dir, (log0, _) = logs
    log0.append("trial_start", trial="r0000-t00000")
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    with FsCalls(run_dir.root) as calls:
        for second in range(0, 1800, 5):  # the primary polls every 5 s for half an hour
            publisher.poll(NOW + second)
    reads = calls.counts["primary"]["open"]
    # Per log: about 12 reads in the first 10 minutes, then one per 5 minutes; not 360, one per poll.
    assert 2 * 14 <= reads <= 2 * 18
    # The trial that ends now is published at the next read, within 5 minutes.
    trial = finish(run_dir, log0, 0, 0)
    for second in range(1800, 1800 + 305, 5):
        publisher.poll(NOW + second)
    assert published(run_dir) == [trial]
    publisher.close()


def test_a_restarted_primary_neither_duplicates_nor_loses_a_trial(logs):
    run_dir, (log0, log1) = logs
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    early = [finish(run_dir, log0, 0, 0), finish(run_dir, log1, 1, 0)]
    publisher.poll(NOW + 1)
    publisher.close()  # killed: the trials below ended while no primary published
    late = [finish(run_dir, log0, 0, 1), finish(run_dir, log1, 1, 1)]
    # ... and it died writing the line of one of them: a torn last line.
    with open(run_dir.history_file, "ab") as f:
        f.write(b'{"event": "trial", "trial": "' + late[0].encode())
    again = HistoryPublisher(run_dir, 2, VirtualClock(NOW + 10))
    again.open(NOW + 10)
    assert again.poll(NOW + 10) == 2
    again.close()
    assert sorted(published(run_dir)) == sorted(early + late)
    assert verify_chain(run_dir.history_file) == [] and run_dir.history_file.read_bytes().endswith(b"\n")
    # A third start publishes nothing more.
    third = HistoryPublisher(run_dir, 2, VirtualClock(NOW + 20))
    third.open(NOW + 20)
    assert third.publish_all(NOW + 20) == 0
    third.close()
    assert len(published(run_dir)) == 4


def test_a_restarted_primary_refuses_a_changed_history(logs):
    run_dir, (log0, _) = logs
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    finish(run_dir, log0, 0, 0)
    finish(run_dir, log0, 0, 1)
    publisher.poll(NOW + 1)
    publisher.close()
    lines = run_dir.history_file.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace('"target": 0.5', '"target": 0.99')
    run_dir.history_file.write_text("".join(lines))
    with pytest.raises(RunDirError, match=r"history\.jsonl: line 2: hash chain broken"):
        HistoryPublisher(run_dir, 2, VirtualClock(NOW)).open(NOW + 2)


def test_a_replica_sees_its_own_trial_before_publication_and_each_trial_once(logs):
    run_dir, (log0, log1) = logs
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    history = SharedHistory(run_dir, replica=0)
    own = finish(run_dir, log0, 0, 0)
    other = finish(run_dir, log1, 1, 0)
    assert [r.trial for r in history.refresh()] == [own]  # its own at once; the other once published
    publisher.poll(NOW + 1)
    assert [r.trial for r in history.refresh()] == [other]
    assert history.refresh() == []
    assert [r.trial for r in history.records] == [own, other]
    assert history.summaries().tolist() == [r.arch.summary().tolist() for r in history.records]
    # A reader that is no replica sees what was published.
    assert [r.trial for r in SharedHistory(run_dir).refresh()] == [own, other]
    publisher.close()


def test_a_history_moved_aside_and_published_anew_is_read_again_without_duplicates(logs):
    run_dir, (log0, log1) = logs
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    trials = [finish(run_dir, log1, 1, 0), finish(run_dir, log1, 1, 1)]
    publisher.poll(NOW)
    publisher.close()
    history = SharedHistory(run_dir, replica=0)
    assert len(history.refresh()) == 2
    run_dir.history_file.rename(run_dir.history_file.with_name("history.jsonl.aside"))
    trials.append(finish(run_dir, log1, 1, 2))
    again = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    again.open(NOW)
    again.poll(NOW)  # a longer file than the one the replica read: its offset means nothing here
    again.close()
    assert [r.trial for r in history.refresh()] == trials[2:]
    assert [r.trial for r in history.records] == trials


def test_without_a_primary_a_replica_reads_every_log(logs):
    """Replicas run by hand or by tests: nobody publishes, so the logs are read as before."""
    run_dir, (log0, log1) = logs
    history = SharedHistory(run_dir, replica=0)
    trials = [finish(run_dir, log0, 0, 0), finish(run_dir, log1, 1, 0)]
    assert sorted(r.trial for r in history.refresh()) == trials
    # A primary starting later publishes both; the replica switches to the file without duplicates.
    publisher = HistoryPublisher(run_dir, 2, VirtualClock(NOW))
    publisher.open(NOW)
    publisher.poll(NOW)
    later = finish(run_dir, log1, 1, 1)
    publisher.poll(NOW + 1)
    assert [r.trial for r in history.refresh()] == [later]
    assert len(history.records) == 3
    publisher.close()


def refresh_calls(tmp_path, replicas: int) -> tuple[int, int]:
    """(calls of a replica's first refresh, calls of a refresh after one more trial of its own and
    one of every other replica) in a run of `replicas` replicas with 2 published trials each."""
    run_dir = RunDir(tmp_path / f"run-{replicas}")
    logs = [EventLog(run_dir.replica_log(i)).open() for i in range(replicas)]
    publisher = HistoryPublisher(run_dir, replicas, VirtualClock(NOW))
    publisher.open(NOW)
    for log_number, log in enumerate(logs):
        for seq in range(2):
            finish(run_dir, log, log_number, seq)
    publisher.poll(NOW)
    history = SharedHistory(run_dir, replica=0)
    with FsCalls(run_dir.root) as cold:
        history.refresh()
    for log_number, log in enumerate(logs):
        finish(run_dir, log, log_number, 2)
    publisher.poll(NOW + 1)
    with FsCalls(run_dir.root) as warm:
        joined = history.refresh()
    assert len(joined) == replicas and len(history.records) == 3 * replicas
    publisher.close()
    for log in logs:
        log.close()
    return cold.total(kinds=FsCalls.KINDS), warm.total(kinds=FsCalls.KINDS)


def test_a_refresh_makes_the_same_few_filesystem_calls_at_any_replica_count(tmp_path):
    few, many = refresh_calls(tmp_path, 3), refresh_calls(tmp_path, 60)
    assert few == many
    cold, warm = many
    assert warm == 3  # the history file, its own log, its own new trial.json
    assert cold == 4  # the same, with its own 2 earlier trial.json files


# --- a whole simulated run: --verify and scoring ---------------------------------------------------

@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    import numpy as np

    work = tmp_path_factory.mktemp("published")
    initial = resnet_small((32, 32, 3), 10)
    pool = write_graph_pool([initial, random_morph(initial, None, np.random.default_rng(1)).graph], work / "pool")
    model = ReplicaModel(device_ops_per_s=expected_ops(pool[0], ReplicaModel(1.0)) / 100.0, devices=1,
                         improving_epochs=1)
    weights = work / "pool" / "weights.npz"
    write_weights_stand_in(weights)
    result = simulate(work / "run", 3, 1050.0, model, pool, weights, start_time=NOW, poll_interval_s=5.0,
                      policy={"patience_min": 2, "patience_max": 2})
    return result.run_dir, result


def test_a_primary_run_publishes_every_usable_trial_once_and_verifies(simulated):
    run_dir, result = simulated
    ended = [e["trial"] for r in range(3) for e in read_events(run_dir.replica_log(r))
             if e["event"] == "trial_end" and e["status"] in ("ok", "early_stopped")]
    assert sorted(published(run_dir)) == sorted(ended) and len(ended) == result.trials_ended > 0
    assert verify_run(run_dir) == []


def rechain(lines: list[dict]) -> bytes:
    """The lines as a forger who knows the format writes them: a valid hash chain."""
    out, prev = [], GENESIS
    for seq, line in enumerate(lines):
        raw = json.dumps({**line, "seq": seq, "prev": prev}, sort_keys=True).encode()
        out.append(raw)
        prev = sha256_bytes(raw)
    return b"".join(raw + b"\n" for raw in out)


@pytest.mark.parametrize("tamper, expected", [
    ("edit", "primary/history.jsonl: line 3: hash chain broken"),
    ("forge", "primary/history.jsonl: line 2: trial r0001-t00000: target differ from its trial_end and trial.json"),
    ("invent", "has no trial_end with status ok or early_stopped"),
    ("drop", "ended usable but was never published"),
    ("duplicate", "published again"),
    ("delete", "primary/history.jsonl: missing (pinned by run_end.history_head)"),
    ("truncate", "primary/history.jsonl: last line differs from run_end.history_head"),
])
def test_verify_checks_the_published_history(simulated, tmp_path, tamper, expected):
    import shutil

    run_dir = RunDir(tmp_path / "run")
    shutil.copytree(simulated[0].root, run_dir.root)
    lines = [{k: v for k, v in line.items() if k not in ("seq", "prev")} for line in read_events(run_dir.history_file)]
    assert lines[1]["trial"] == "r0001-t00000"
    if tamper == "delete":
        run_dir.history_file.unlink()
    elif tamper == "truncate":  # the last line removed, the rest a valid chain
        run_dir.history_file.write_bytes(b"".join(line + b"\n" for line in
                                                  run_dir.history_file.read_bytes().splitlines()[:-1]))
    elif tamper == "edit":
        text = run_dir.history_file.read_text().splitlines(keepends=True)
        text[1] = text[1].replace('"target": ', '"target": 1')
        run_dir.history_file.write_text("".join(text))
    else:
        if tamper == "forge":
            lines[1]["target"] = 0.999
        elif tamper == "invent":
            lines.append({**lines[0], "trial": "r0007-t00003"})
        elif tamper == "drop":
            del lines[-1]
        elif tamper == "duplicate":
            lines.append(lines[0])
        run_dir.history_file.write_bytes(rechain(lines))
    problems = verify_run(run_dir)
    assert any(expected in p for p in problems), problems


def test_scoring_never_reads_the_published_history(simulated, tmp_path):
    import shutil

    run_dir = RunDir(tmp_path / "run")
    shutil.copytree(simulated[0].root, run_dir.root)
    before = score_run(run_dir, now=NOW + 1050.0)
    lines = read_events(run_dir.history_file)
    run_dir.history_file.write_bytes(rechain([{**line, "target": 0.0, "best_val_accuracy": 0.0}
                                              for line in lines[:1]]))
    after = score_run(run_dir, now=NOW + 1050.0)
    run_dir.history_file.unlink()
    gone = score_run(run_dir, now=NOW + 1050.0)
    assert before.total_ops > 0 and before.best_accuracy is not None
    assert before.to_dict() == after.to_dict() == gone.to_dict()
