import json
import os
import stat

import pytest

from aiperf_core.atomic import new_file_mode, write_text_atomic
from aiperf_core.rundir import EventLog, RunDir, RunDirError, chain_head, read_events, trial_id, verify_chain


def test_event_log_appends_and_chains(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.append("a", x=1)
        log.append("b", x=2)
    with EventLog(path) as log:  # reopening continues the chain
        log.append("c", x=3)
    events = read_events(path)
    assert [e["event"] for e in events] == ["a", "b", "c"]
    assert [e["seq"] for e in events] == [0, 1, 2]
    assert verify_chain(path) == []
    assert chain_head(path) != "0" * 64


def test_torn_last_line_is_ignored_and_cut(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.append("a")
    with open(path, "ab") as f:
        f.write(b'{"event": "b", "ti')  # a crash mid-write
    assert [e["event"] for e in read_events(path)] == ["a"]
    assert verify_chain(path) == []
    with EventLog(path) as log:
        log.append("c")
    assert [e["event"] for e in read_events(path)] == ["a", "c"]
    assert verify_chain(path) == []


@pytest.mark.parametrize("tamper", ["edit", "delete", "swap"])
def test_tampering_breaks_the_chain(tmp_path, tamper):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        for i in range(4):
            log.append("epoch_end", train_images=100 + i)
    lines = path.read_text().splitlines()
    if tamper == "edit":
        lines[1] = lines[1].replace("101", "9101")
    elif tamper == "delete":
        del lines[2]
    else:
        lines[1], lines[2] = lines[2], lines[1]
    path.write_text("\n".join(lines) + "\n")
    assert verify_chain(path)


def test_run_file_round_trip_and_errors(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(RunDirError, match="not a run directory"):
        run.read_run()
    run.write_run({"run_id": "x"})
    assert run.read_run()["run_id"] == "x"
    run.run_file.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(RunDirError, match="schema_version"):
        run.read_run()
    assert trial_id(3, 12) == "r0003-t00012"


def test_a_new_run_json_is_created_by_exactly_one_of_racing_writers(tmp_path):
    import threading

    from aiperf_core.rundir import RunDir, RunDirError

    run_dir = RunDir(tmp_path)
    outcomes: list[str] = []

    def write(i: int) -> None:
        try:
            run_dir.write_run({"writer": i}, new=True)
            outcomes.append("written")
        except RunDirError as exc:
            assert "already holds a run" in str(exc)
            outcomes.append("refused")

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["refused"] * 7 + ["written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no temporary file left


def test_replicas_beat_slower_as_they_are_added_so_the_run_directory_load_stays_bounded():
    from aiperf_core.rundir import LEASE_RENEW_S, LEASE_STALE_S, REPLICA_CALLS_PER_S, replica_cadence

    small = replica_cadence(1)
    assert (small.heartbeat_s, small.lease_renew_s, small.lease_stale_s) == (5.0, LEASE_RENEW_S, LEASE_STALE_S)
    assert replica_cadence(600) == small
    at_scale = replica_cadence(4096)
    assert 5.0 < at_scale.heartbeat_s <= 30.0
    assert 4096 * at_scale.calls_per_s <= REPLICA_CALLS_PER_S + 1e-9
    assert at_scale.lease_renew_s == 3 * at_scale.heartbeat_s
    assert at_scale.lease_stale_s == 6 * at_scale.lease_renew_s
    assert replica_cadence(100_000).heartbeat_s == 30.0  # capped: a beat must stay fresh for the live display
    for n in (1, 10, 700, 1000, 4096, 10_000):
        assert replica_cadence(n).heartbeat_s <= replica_cadence(n + 1).heartbeat_s


def test_a_replica_takes_its_cadence_from_the_run_s_replica_count(tmp_path):
    from aiperf_core.replica import RunSpec, write_run_json
    from aiperf_core.rundir import RunDir, replica_cadence

    write_run_json(tmp_path, replicas=4096)
    spec = RunSpec.from_run(RunDir(tmp_path).read_run())
    assert spec.replicas == 4096 and replica_cadence(spec.replicas).heartbeat_s > 5.0
    run = RunDir(tmp_path).read_run()
    run["replicas"] = 0
    with pytest.raises(Exception, match="run.json.replicas: 0 is not a positive integer"):
        RunSpec.from_run(run)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_an_atomic_write_has_the_mode_open_would_give(tmp_path, umask, mode):
    """Not the temporary file's 0600: a run directory's files are read by other users of a site."""
    old = os.umask(umask)
    try:
        assert new_file_mode() == mode
        write_text_atomic(tmp_path / "plain.json", "{}")
        write_text_atomic(tmp_path / "exclusive.json", "{}", exclusive=True)
        RunDir(tmp_path / "run").write_run({"run_id": "x"})
    finally:
        os.umask(old)
    for path in (tmp_path / "plain.json", tmp_path / "exclusive.json", tmp_path / "run" / "run.json"):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
