"""One owner per run and per replica (issue 18): the lease (aiperf_core.rundir.Lease) on its own,
then `aiperf run --resume` against a running primary, a resume after SIGKILL of the primary, and
two replica processes for one replica id."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from aiperf_core.rundir import EventLog, Lease, LeaseHeld, LeaseLost, RunDir, read_events, verify_chain
from stepping_backend import NAME, environment, install
from test_workflow import TINY_POLICY

HOLD = """
import sys, time
from aiperf_core.rundir import Lease
Lease(sys.argv[1], "primary").acquire()
print("held", flush=True)
time.sleep(600)
"""


def _foreign(path: Path, renewed_ago: float, **fields) -> dict:
    """A lease written by a process of another machine."""
    now = time.time()
    holder = {"owner": "primary", "host": "login2", "boot_id": "elsewhere", "pid": 4242, "pid_started": 1.0,
              "token": "f" * 16, "acquired": now - 3600, "renewed": now - renewed_ago, **fields}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(holder) + "\n")
    return holder


@pytest.fixture
def holder_process(tmp_path):
    path = tmp_path / "lease.json"
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "held\n"
        yield path, process
    finally:
        process.kill()
        process.wait()


def test_a_lease_is_exclusive_while_its_process_lives_and_taken_over_once_it_is_gone(holder_process):
    path, process = holder_process
    with pytest.raises(LeaseHeld) as refused:
        Lease(path, "primary").acquire()
    assert str(refused.value) == f"in use by the primary on host {os.uname().nodename}, pid {process.pid}, which is running"
    old = json.loads(path.read_text())
    time.sleep(0.01)
    with pytest.raises(LeaseHeld):
        Lease(path, "primary").check()
    assert json.loads(path.read_text()) == old  # a refusal writes nothing
    process.kill()
    process.wait()
    lease = Lease(path, "primary").acquire()
    assert lease.held and lease.taken_over["verdict"] == "gone" and lease.taken_over["pid"] == process.pid
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lease.release()
    assert not path.exists()


def test_a_reused_pid_is_not_the_owner(tmp_path):
    path = tmp_path / "lease.json"
    mine = Lease(path, "primary").acquire()
    record = json.loads(path.read_text())
    mine.held = False  # as if this process had crashed: its record stays
    record.update(pid=os.getppid(), pid_started=1.0)  # a live pid, but not the process that took the lease
    path.write_text(json.dumps(record))
    taken = Lease(path, "primary").acquire()
    assert taken.taken_over["verdict"] == "gone"


def test_from_another_host_only_the_age_of_the_lease_counts(tmp_path):
    path = tmp_path / "lease.json"
    _foreign(path, renewed_ago=5)
    with pytest.raises(LeaseHeld) as refused:
        Lease(path, "primary").acquire()
    assert str(refused.value).startswith("in use by the primary on host login2, pid 4242 (lease renewed 5 s ago; "
                                         "from another host it is taken over once 90 s old)")
    _foreign(path, renewed_ago=91)
    lease = Lease(path, "primary").acquire()
    assert lease.taken_over["verdict"] == "stale" and lease.taken_over["host"] == "login2"


def test_waiting_for_a_lease_of_another_host(tmp_path):
    path = tmp_path / "lease.json"
    _foreign(path, renewed_ago=0)
    started = time.monotonic()
    lease = Lease(path, "replica 0", stale_s=1.0).acquire(wait=True)  # never renewed: it goes stale
    assert lease.taken_over["verdict"] == "stale" and 0.9 <= time.monotonic() - started < 5

    _foreign(path, renewed_ago=0)
    renewer = threading.Timer(0.3, lambda: _foreign(path, renewed_ago=0, token="e" * 16))
    renewer.start()
    with pytest.raises(LeaseHeld, match="renewed while this process waited"):
        Lease(path, "replica 0", stale_s=5.0).acquire(wait=True)  # renewed: its owner lives
    renewer.join()


def test_a_damaged_lease_is_judged_by_its_age(tmp_path):
    path = tmp_path / "lease.json"
    path.write_text("")  # an exclusive create not yet written, or a damaged file
    with pytest.raises(LeaseHeld, match="being written"):
        Lease(path, "primary").acquire()
    old = time.time() - 200
    os.utime(path, (old, old))
    assert Lease(path, "primary").acquire().taken_over["verdict"] == "stale"


def test_a_taken_over_lease_fences_its_old_holder(tmp_path):
    path = tmp_path / "lease.json"
    first = Lease(path, "replica 0", stale_s=0.2).acquire()
    log = EventLog(tmp_path / "events.jsonl", lease=first)
    log.append("replica_start")
    assert first.renew()
    record = json.loads(path.read_text())
    record.update(host="node7", boot_id="other")  # as seen from another host, first is a stale lease
    path.write_text(json.dumps(record))
    time.sleep(0.3)
    second = Lease(path, "replica 0", stale_s=0.2).acquire()
    assert second.taken_over["verdict"] == "stale"
    assert first.renew() is False
    with pytest.raises(LeaseLost, match="no longer holds its lease; it is now the replica 0 on host"):
        log.append("epoch_end")
    log.close()
    assert [e["event"] for e in read_events(tmp_path / "events.jsonl")] == ["replica_start"]
    first.release()  # gives back nothing it does not hold
    assert path.exists()


def _contend(path: str, start: float, results, everyone_tried) -> None:
    time.sleep(max(0.0, start - time.time()))
    try:
        Lease(path, "primary").acquire()
        results.put(os.getpid())
        # Hold it, alive, until every contender has tried: a winner that exited first would leave
        # a lease of a dead process, which a late contender rightly takes over (a loaded machine
        # can start a spawned process seconds late).
        everyone_tried.wait(timeout=120)
    except LeaseHeld:
        results.put(None)


def test_of_many_contenders_for_an_abandoned_lease_exactly_one_wins(tmp_path):
    path = tmp_path / "lease.json"
    _foreign(path, renewed_ago=500)
    context = multiprocessing.get_context("spawn")
    results, everyone_tried = context.Queue(), context.Event()
    start = time.time() + 2.0
    contenders = [context.Process(target=_contend, args=(str(path), start, results, everyone_tried))
                  for _ in range(6)]
    for process in contenders:
        process.start()
    outcome = [results.get(timeout=60) for _ in contenders]
    everyone_tried.set()
    for process in contenders:
        process.join(timeout=60)
    winners = [pid for pid in outcome if pid is not None]
    assert len(winners) == 1, outcome


# --- the command line ---------------------------------------------------------------------------
def _aiperf(args, env, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "aiperf_core", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _wait_for(condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def _trained(run_dir: Path) -> bool:
    return any(e["event"] == "epoch_end" for e in read_events(run_dir / "replicas/0/events.jsonl"))


@pytest.fixture
def stepping(tmp_path):
    """(config path, environment) for runs with the stepping backend: quick, steady steps."""
    install(tmp_path / "site")
    config = tmp_path / "aiperf.toml"
    config.write_text(TINY_POLICY)
    return config, environment(tmp_path / "site", step_s=0.1, steps=4)


@pytest.mark.slow  # a real run, held in its second trial while a second primary is refused
def test_a_second_primary_is_refused_and_the_run_stays_intact(tmp_path, stepping):
    config, _ = stepping
    run_dir, gate = tmp_path / "run", tmp_path / "go"
    # The run must end by itself (exit 0), and be running while the second primary is refused: its replica
    # trains a first trial, then holds before the second's first step (stepping_backend's gate) until the
    # refusal has been checked, and stops after that trial.
    env = environment(tmp_path / "site", step_s=0.1, steps=4, gate={"trial": 2, "file": str(gate)})
    first = _aiperf(["run", "--backend", NAME, "--data", "digits", "--config", str(config), "--time-budget", "5m",
                     "--run-dir", str(run_dir), "--stop-after-trials", "2"], env)
    try:
        _wait_for(lambda: _trained(run_dir), 120, "the first primary's replica to train")
        second = subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--resume", str(run_dir)], env=env,
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr == (f"aiperf: error: --resume {run_dir}: in use by the primary on host "
                                 f"{os.uname().nodename}, pid {first.pid}, which is running\n")
        assert second.stdout == ""
        assert first.poll() is None  # the first primary was running all along
        gate.touch()
        output, errors = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, output + errors
    events = read_events(run_dir / "primary/events.jsonl")
    assert [e["event"] for e in events].count("run_start") == 1
    assert [e["event"] for e in events].count("run_end") == 1
    assert [e["attempt"] for e in events if e["event"] == "replica_launch"] == [1]
    verify = subprocess.run([sys.executable, "-m", "aiperf_core", "score", str(run_dir), "--verify"],
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0 and "verify: intact" in verify.stdout, verify.stdout + verify.stderr
    assert not (run_dir / "primary/lease.json").exists() and not (run_dir / "replicas/0/lease.json").exists()


def test_a_resume_after_sigkill_of_the_primary_takes_the_run_over(tmp_path, stepping):
    config, env = stepping
    run_dir = tmp_path / "run"
    first = _aiperf(["run", "--backend", NAME, "--data", "digits", "--config", str(config), "--time-budget", "90s",
                     "--run-dir", str(run_dir), "--stop-after-trials", "2"], env)
    try:
        _wait_for(lambda: _trained(run_dir), 120, "the replica to train")
    finally:
        first.kill()
        first.communicate()
    replica_pid = json.loads((run_dir / "replicas/0/lease.json").read_text())["pid"]
    _wait_for(lambda: not Path(f"/proc/{replica_pid}").exists() or "Z" in Path(f"/proc/{replica_pid}/stat").read_text().split()[2],
              30, "the replica to die with its primary")
    assert json.loads((run_dir / "primary/lease.json").read_text())["pid"] == first.pid  # left behind by SIGKILL
    resumed = subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--resume", str(run_dir)], env=env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"took the run over from the primary pid {first.pid} on host" in resumed.stdout
    starts = [e for e in read_events(run_dir / "primary/events.jsonl") if e["event"] == "run_start"]
    assert [s["resume"] for s in starts] == [False, True]
    assert starts[1]["lease_taken_from"] == {"host": os.uname().nodename, "pid": first.pid, "verdict": "gone"}
    replica = read_events(run_dir / "replicas/0/events.jsonl")
    assert [e["event"] for e in replica].count("replica_start") == 2 and replica[-1]["event"] == "replica_stop"
    assert "took over the lease of pid" in (run_dir / "replicas/0/replica.log").read_text()
    for log in (run_dir / "primary/events.jsonl", run_dir / "replicas/0/events.jsonl"):
        assert verify_chain(log) == []


def test_two_replica_processes_for_one_replica_id_are_refused(tmp_path):
    from aiperf_core.replica import write_run_json

    install(tmp_path / "site")
    env = environment(tmp_path / "site", step_s=0.5, steps=4)
    run_dir = tmp_path / "run"
    write_run_json(run_dir, backend=NAME, policy={"dataset": "digits", "initial_architecture": "resnet_small",
                                                  "warmup_epochs": [1], "max_epochs": 1, "batch_size": 32},
                   time_budget_s=300)
    replica = ["replica", "--run-dir", str(run_dir), "--replica-id", "0"]
    first = _aiperf(replica, env)
    try:
        _wait_for(lambda: (run_dir / "replicas/0/lease.json").exists(), 120, "the first replica's lease")
        second = subprocess.run([sys.executable, "-m", "aiperf_core", *replica], env=env, capture_output=True,
                                text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr == (f"aiperf: error: replica 0 of {run_dir}: in use by the replica 0 on host "
                                 f"{os.uname().nodename}, pid {first.pid}, which is running\n")
        _wait_for(lambda: _trained(run_dir), 120, "the first replica to train")
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    events = read_events(RunDir(run_dir).replica_log(0))
    assert [e["event"] for e in events].count("replica_start") == 1 and events[0]["pid"] == first.pid
    assert verify_chain(RunDir(run_dir).replica_log(0)) == []
