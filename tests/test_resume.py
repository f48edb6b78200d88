"""SIGKILL at seeded points, of the primary or of a replica, then `--resume` (or the primary's own
restart of the replica): no finished epoch or trial is ever lost, none is counted twice, every
event log's hash chain holds, and the op total recomputed from the logs only ever grows; for each
workload, the CNN on digits and the LM on the embedded corpus."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from aiperf_core.ir import Graph
from aiperf_core.rundir import read_events, verify_chain
from aiperf_core.scoring import score_run
from aiperf_opcount import count
from test_workflow import TINY_POLICY

SEED = 20261122
KILL_POINTS = 22
# The longest pause before a kill. The seeded draws are the same at any scale; 2.5 s still spans a
# primary's start-up and a replica's, and a trial's epoch takes about 2 s here.
MAX_PAUSE_S = 2.5
# The LM's counterpart of TINY_POLICY: the tiny GPT, epochs of 32 windows of 64 bytes, about as
# long as the CNN's here.
LM_TINY_POLICY = """
workload = "lm"
[policy]
initial_architecture = "gpt_tiny"
seq_len = 64
epoch_tokens = 2048
val_tokens = 4096
warmup_epochs = [1]
max_epochs = 1
batch_size = 8
hpo_start_round = 50
"""


def _start(args: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "aiperf_core", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        out.close()


class Ledger:
    """What the logs held at the last check: it may only grow."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.epochs: set[tuple[str, int]] = set()
        self.trials_ended: dict[str, str] = {}
        self.ops = 0
        self._per_image: dict[str, tuple[int, int]] = {}

    def check(self, where: str) -> None:
        if not (self.run_dir / "run.json").exists():
            return  # killed before the run existed: nothing to lose yet
        # A replica that was not killed keeps appending while this runs: scoring is compared on the
        # epochs stamped at least a second before the logs are read, which are all on disk by then.
        cutoff = time.time() - 1.0
        logs = [self.run_dir / "primary/events.jsonl", *sorted(self.run_dir.glob("replicas/*/events.jsonl"))]
        logs = [log for log in logs if log.exists()]
        for log in logs:
            assert verify_chain(log) == [], f"{where}: {log} chain broken"
        # The published history: its chain holds (a torn last line aside) and no trial is in it twice.
        history = self.run_dir / "primary/history.jsonl"
        if history.exists():
            assert verify_chain(history) == [], f"{where}: history chain broken"
        published = [line["trial"] for line in read_events(history)]
        assert len(published) == len(set(published)), f"{where}: a trial was published twice"
        events = [e for log in logs[1:] for e in read_events(log)]
        epochs = [(e["trial"], e["epoch"]) for e in events if e["event"] == "epoch_end"]
        assert len(epochs) == len(set(epochs)), f"{where}: an epoch is logged twice"
        assert self.epochs <= set(epochs), f"{where}: finished epochs were lost: {self.epochs - set(epochs)}"
        starts = [e["trial"] for e in events if e["event"] == "trial_start"]
        assert len(starts) == len(set(starts)), f"{where}: a trial started twice"
        ends = {}
        for e in events:
            if e["event"] == "trial_end":
                assert e["trial"] not in ends, f"{where}: trial {e['trial']} ended twice"
                assert e["trial"] in starts, f"{where}: trial_end without trial_start"
                ends[e["trial"]] = e["status"]
        for trial, status in self.trials_ended.items():
            assert ends.get(trial) == status, f"{where}: trial {trial} lost its end ({status})"
        assert all(trial in starts for trial, _ in epochs)
        ops = sum(self._epoch_ops(e) for e in events if e["event"] == "epoch_end")
        assert ops >= self.ops, f"{where}: op total fell from {self.ops} to {ops}"
        settled = [e for e in events if e["event"] == "epoch_end" and e["time"] <= cutoff]
        scored = score_run(self.run_dir, now=cutoff)
        assert (scored.epochs_counted, scored.total_ops) == (len(settled), sum(map(self._epoch_ops, settled))), where
        self.epochs, self.trials_ended, self.ops = set(epochs), ends, ops

    def _epoch_ops(self, event: dict) -> int:
        trial = event["trial"]
        if trial not in self._per_image:
            counted = count(Graph.from_json((self.run_dir / "trials" / trial / "graph.json").read_text()))
            self._per_image[trial] = (counted.fp, counted.bp)
        fp, bp = self._per_image[trial]
        return event["train_images"] * (fp + bp) + event["val_images"] * fp


def _replica_pids(run_dir: Path) -> dict[int, int]:
    """replica -> pid of its latest launch, from the primary log."""
    launches = {}
    for e in read_events(run_dir / "primary/events.jsonl"):
        if e["event"] == "replica_launch":
            launches[e["replica"]] = int(e["job"])
    return launches


def _run_starts(run_dir: Path) -> int:
    return sum(e["event"] == "run_start" for e in read_events(run_dir / "primary/events.jsonl"))


def _wait_until(condition, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _usable_ends(run_dir: Path) -> list[str]:
    return [e["trial"] for log in sorted(run_dir.glob("replicas/*/events.jsonl")) for e in read_events(log)
            if e["event"] == "trial_end" and e["status"] in ("ok", "early_stopped")]


def _exits(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "primary/events.jsonl") if e["event"] == "replica_exit"]


def _interrupted_ends(run_dir: Path) -> list[str]:
    return [e["trial"] for log in sorted(run_dir.glob("replicas/*/events.jsonl")) for e in read_events(log)
            if e["event"] == "trial_end" and e["status"] == "interrupted"]


def _open_trial(run_dir: Path) -> tuple[int, str] | None:
    """(replica, trial) of a trial that a replica's current launch started and has not ended."""
    launches = {}
    for e in read_events(run_dir / "primary/events.jsonl"):
        if e["event"] == "replica_launch":
            launches[e["replica"]] = e["time"]
    for replica, launched in sorted(launches.items()):
        events = read_events(run_dir / f"replicas/{replica}/events.jsonl")
        ended = {e["trial"] for e in events if e["event"] == "trial_end"}
        # A trial left open by an earlier launch is not this one's: its restart closes it.
        for e in events:
            if e["event"] == "trial_start" and e["time"] > launched and e["trial"] not in ended:
                return replica, e["trial"]
    return None


def _trial_end(run_dir: Path, replica: int, trial: str) -> dict | None:
    return next((e for e in read_events(run_dir / f"replicas/{replica}/events.jsonl")
                 if e["event"] == "trial_end" and e["trial"] == trial), None)


def _kill_mid_trial(run_dir: Path) -> int:
    """SIGKILL a replica in the middle of a trial and see its restart close that trial as
    interrupted: 1 where the kill landed, 0 where the trial ended between the look and the kill."""
    _wait_until(lambda: _open_trial(run_dir) is not None, 300, "a replica to start a trial")
    replica, trial = _open_trial(run_dir) or (None, None)
    if replica is None:
        return 0
    exits_before = len(_exits(run_dir))
    psutil.Process(_replica_pids(run_dir)[replica]).send_signal(signal.SIGKILL)
    _wait_until(lambda: len(_exits(run_dir)) > exits_before, 30, "the primary to see the replica die")
    if _trial_end(run_dir, replica, trial) is not None:
        return 1  # ended before the kill (a SIGKILL cannot be caught): not this kill's to close
    _wait_until(lambda: _trial_end(run_dir, replica, trial) is not None, 300, f"the restart to close trial {trial}")
    assert _trial_end(run_dir, replica, trial)["status"] == "interrupted", _trial_end(run_dir, replica, trial)
    return 1


WORKLOADS = ("cnn", "lm")


@pytest.fixture(scope="module")
def kill_sequences(request, tmp_path_factory) -> dict[str, BaseException | None]:
    """Each selected workload's kill sequence, run side by side: a sequence is timed by the wall clock
    (its pauses, a primary's start-up, the waits for a death to be seen), so two at once take little
    longer than one. What each raised (None: it held throughout)."""
    test_name = test_sigkill_at_seeded_points_loses_nothing_and_counts_nothing_twice.__name__
    selected = [w for w in WORKLOADS if any(item.name == f"{test_name}[{w}]" for item in request.session.items)]
    with ThreadPoolExecutor(len(selected)) as pool:
        runs = {w: pool.submit(_kill_and_resume, tmp_path_factory.mktemp(w), w) for w in selected}
    return {w: run.exception() for w, run in runs.items()}


@pytest.mark.slow  # 22 kill points of a real run, the two workloads side by side: about a minute
@pytest.mark.parametrize("workload", WORKLOADS)
def test_sigkill_at_seeded_points_loses_nothing_and_counts_nothing_twice(kill_sequences, workload):
    if kill_sequences[workload] is not None:
        raise kill_sequences[workload]


def _kill_and_resume(tmp_path: Path, workload: str) -> None:
    rng = random.Random(SEED)
    config = tmp_path / "aiperf.toml"
    config.write_text(TINY_POLICY if workload == "cnn" else LM_TINY_POLICY)
    run_dir = tmp_path / "run"
    output = tmp_path / "primary.out"
    common = ["--config", str(config), "--max-restarts", "1000"]
    data = ["--data", "digits"] if workload == "cnn" else []
    fresh = ["run", "--backend", "torch", *data, "--replicas", "2", "--time-budget", "30m",
             "--run-dir", str(run_dir), *common]
    primary = _start(fresh, output)
    ledger = Ledger(run_dir)
    kills = {"primary": 0, "replica": 0}
    starts_before = 0  # run_start events logged before the current primary started
    landed = 0  # replica kills that hit a live replica
    try:
        for point in range(KILL_POINTS):
            # A fifth of the points fall in the primary's start-up (run.json and its log being
            # written); the others are timed from its run_start, so that a slow machine still
            # gets kills among running replicas.
            if rng.random() >= 0.2:
                _wait_until(lambda: _run_starts(run_dir) > starts_before, 120, "the primary to start")
            time.sleep(rng.uniform(0.05, MAX_PAUSE_S))
            assert primary.poll() is None, output.read_text()
            pids = _replica_pids(run_dir) if (run_dir / "primary/events.jsonl").exists() else {}
            target = rng.choice(["primary", "replica"]) if pids else "primary"
            if target == "replica":
                replica = rng.choice(sorted(pids))
                exits_before = len(_exits(run_dir))
                try:  # a resumed primary may not have launched yet: the pid is an old, dead one
                    process = psutil.Process(pids[replica])
                    if process.status() != psutil.STATUS_ZOMBIE:
                        process.send_signal(signal.SIGKILL)
                        landed += 1
                except psutil.NoSuchProcess:
                    pass
                _wait_until(lambda: len(_exits(run_dir)) > exits_before, 30, "the primary to see the replica die")
                ledger.check(f"kill {point} (replica {replica})")
            else:
                primary.kill()
                primary.wait()
                for pid in pids.values():  # the replicas die with their primary
                    _wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
                                30, f"replica pid {pid} to die with the primary")
                ledger.check(f"kill {point} (primary)")
                # Killed before run.json was written, the run never existed: it starts afresh.
                resume = (run_dir / "run.json").exists()
                starts_before = _run_starts(run_dir)
                primary = _start(["run", "--resume", str(run_dir), *common] if resume else fresh, output)
            kills[target] += 1
        # SIGTERM is the primary's to handle once it runs (run_start logged); before, it just dies.
        _wait_until(lambda: _run_starts(run_dir) > starts_before, 60, "the primary to start")
        # On a loaded machine a replica's start-up can outlast every seeded pause, so that no kill
        # lands mid-trial: one more, aimed at an open trial, keeps the restart check below from
        # holding vacuously.
        while not _interrupted_ends(run_dir):
            hit = _kill_mid_trial(run_dir)
            kills["replica"] += hit
            landed += hit
            ledger.check("the kill aimed at an open trial")
        # A usable trial, however the kills fell on a slow machine: the publication check below
        # must never hold vacuously.
        _wait_until(lambda: _usable_ends(run_dir), 300, "a trial to end usable")
        time.sleep(1)
    finally:
        if primary.poll() is None:
            primary.send_signal(signal.SIGTERM)
            primary.wait(timeout=60)
    assert primary.returncode == 130, output.read_text()
    ledger.check("graceful stop")
    assert min(kills.values()) >= 5, kills

    primary_log = read_events(run_dir / "primary/events.jsonl")
    starts = [e["resume"] for e in primary_log if e["event"] == "run_start"]
    # A primary killed before it logged run_start leaves no record; every later one is a resume.
    assert starts[1:] == [True] * (len(starts) - 1) and len(starts) <= kills["primary"] + 1, starts
    assert primary_log[-1]["event"] == "run_end" and primary_log[-1]["reason"] == "interrupted"
    # Whatever the kills, every usable trial was published exactly once by the end.
    published = [line["trial"] for line in read_events(run_dir / "primary/history.jsonl")]
    usable = [t for t, status in ledger.trials_ended.items() if status in ("ok", "early_stopped")]
    assert sorted(published) == sorted(usable) and usable, (published, usable)
    crashed = [e for e in primary_log if e["event"] == "replica_exit" and e["status"] == "crashed"]
    assert len(crashed) == landed >= 5, (landed, crashed)
    assert all("signal 9" in e["reason"] for e in crashed), crashed
    assert ledger.epochs, "no epoch finished in the whole test: the kill points are too dense"
    assert json.loads((run_dir / "run.json").read_text())["workload"] == workload
    interrupted = [t for t, status in ledger.trials_ended.items() if status == "interrupted"]
    assert interrupted, "no trial was interrupted and closed on restart"
