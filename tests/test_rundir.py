import json

import pytest

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
