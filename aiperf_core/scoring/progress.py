"""Live progress of a running benchmark, for the display `aiperf run` refreshes every few seconds.

`snapshot(run_dir, now)` keeps one ledger per run directory between calls: each call parses only
the bytes the logs gained, and adds only the new epochs' operations to a running total, so its
cost follows what happened since the last call, not the size of the run. Figures are the same
definitions as the score (aiperf_core.scoring.score); `score_run` remains the authority.

The primary writes its ledger's state and totals to primary/progress.json every five minutes and
at its end (`write_checkpoint`). A process that starts following a run (`aiperf metrics` or
`aiperf watch` on a login node, a primary that resumes) starts from that file and reads only what
the logs gained since, instead of every log whole (seconds at 4096 replicas). The file serves
monitoring only: scoring never reads it. One that is missing, unreadable, of another run or
another format, or that does not hold together is ignored, and the logs are read whole
(docs/run-directory.md, "The progress checkpoint").
"""

from __future__ import annotations

import json
import math
import os
import threading
import time as _time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from aiperf_core.atomic import write_bytes_atomic
from aiperf_core.gcpause import gc_paused
from aiperf_core.rundir import RunDir
from aiperf_core.scoring.ledger import RunLedger
from aiperf_core.scoring.score import epoch_ops, regulated


@dataclass(frozen=True)
class ReplicaProgress:
    replica: int
    host: str | None
    attempts: int  # replica_start events: 1, or more after restarts
    trials_done: int
    running: str | None  # the trial it trains now
    running_epochs: int  # epochs that trial has finished
    stopped: bool  # replica_stop logged
    last_event_time: float | None
    running_per_image: tuple[int, int] | None = None  # (FP, BP) per image of the running trial, once counted


@dataclass(frozen=True)
class Progress:
    now: float
    elapsed_s: float  # since the run's clock started
    budget_s: float
    remaining_s: float  # to the deadline, never negative
    ended: bool  # the primary logged run_end
    trials_done: int
    trials_running: int
    epochs_counted: int
    ops_per_s: float  # OPS(now), as the score defines it
    regulated_ops: float
    best_accuracy: float | None
    best_error: float | None
    replicas: tuple[ReplicaProgress, ...]
    workload: str = "cnn"
    operations: int = 0  # analytic operations of the epochs counted
    # The experts' all-to-all of every epoch read that logged it (epoch_end.all_to_all): analytic bytes,
    # measured seconds, the trials that ran expert-parallel. Reported beside the score, never in it.
    all_to_all_bytes: int = 0
    all_to_all_seconds: float = 0.0
    all_to_all_trials: int = 0
    # The gradient all-reduce of every epoch read that logged it (epoch_end.all_reduce): analytic bytes
    # per rank, measured seconds, the bytes of the epochs whose seconds were measured, the trials that ran
    # data-parallel, the bytes that left each node on its network link; and what the network cost
    # (aiperf_core.scoring.network: the share of step time waiting on communication and the network
    # efficiency; None before a trial communicated).
    all_reduce_bytes: int = 0
    all_reduce_inter_node_bytes: int = 0
    all_reduce_seconds: float = 0.0
    all_reduce_timed_bytes: int = 0
    all_reduce_trials: int = 0
    network_share: float | None = None
    network_efficiency: float | None = None

    @property
    def all_to_all_bytes_per_second(self) -> float | None:
        """The run's all-to-all bandwidth, bytes over seconds summed over its trials; None before an
        expert-parallel epoch (or where none measured any time)."""
        return self.all_to_all_bytes / self.all_to_all_seconds if self.all_to_all_seconds > 0 else None

    @property
    def all_reduce_bytes_per_second(self) -> float | None:
        """The run's all-reduce bus bandwidth per rank: timed bytes over seconds; None before a timed epoch."""
        return self.all_reduce_timed_bytes / self.all_reduce_seconds if self.all_reduce_seconds > 0 else None

    @property
    def fraction(self) -> float:
        """Share of the budget used, in [0, 1]."""
        return min(max(self.elapsed_s / self.budget_s, 0.0), 1.0) if self.budget_s > 0 else 1.0


CHECKPOINT_FORMAT = "aiperf-progress-checkpoint"
# 2: trials hold their expert_load; 3: and their all-to-all bytes and seconds (later, their all-reduce's);
# 4: and their pricing seconds. A checkpoint of another version is ignored and the logs read again.
CHECKPOINT_VERSION = 4
CHECKPOINT_INTERVAL_S = 300.0  # how often the primary writes it: a reader then reads at most 5 minutes of logs


class _LiveRun:
    """A run's ledger plus the running totals over the epochs it has already added up."""

    def __init__(self, run_dir: Path, ledger: RunLedger | None = None):
        self.run_dir = run_dir
        self.ledger = RunLedger(run_dir) if ledger is None else ledger
        # A ledger from a checkpoint holds none of the epochs before it: only the totals do.
        self.from_checkpoint = ledger is not None
        self._restart()

    def _restart(self) -> None:
        self.epochs_seen = 0  # ledger.epochs[:epochs_seen] are in the totals or in `pending`
        self.ops_done = 0
        self.epochs_done = 0
        self.best_error: float | None = None
        self.best_accuracy: float | None = None
        self.pending: list[tuple[float, int, float | None, float | None]] = []  # finished after `now`
        self.latest_counted = -math.inf  # the time of the latest epoch in the totals

    def update(self, now: float) -> None:
        generation = self.ledger.generation
        self.ledger.refresh()
        if self.ledger.generation != generation:  # a log was replaced: the ledger read every log again
            self.from_checkpoint = False
            self._restart()
        elif now < self.latest_counted:  # the clock went back past epochs in the totals: add up again
            if self.from_checkpoint:  # from the logs: the epochs before the checkpoint are not at hand
                fresh = RunLedger(self.run_dir)
                fresh.generation = generation + 1  # holders of derived state see a new ledger
                self.ledger, self.from_checkpoint = fresh, False
                self.ledger.refresh()
            self._restart()
        deadline = self.ledger.info.deadline
        for time, trial, train_images, val_images, accuracy, error in self.ledger.epochs[self.epochs_seen:]:
            # An epoch of a trial whose graph has not resolved is left out here; score_run counts it
            # if another trial resolves the same graph later.
            if time > deadline or trial.per_image is None:
                continue
            self.pending.append((time, epoch_ops(trial.per_image, train_images, val_images), error, accuracy))
        self.epochs_seen = len(self.ledger.epochs)
        limit = min(now, deadline)
        still_pending = []
        for time, ops, error, accuracy in self.pending:
            if time > limit:
                still_pending.append((time, ops, error, accuracy))
                continue
            self.ops_done += ops
            self.epochs_done += 1
            self.latest_counted = max(self.latest_counted, time)
            if error is not None and (self.best_error is None or error < self.best_error):
                self.best_error, self.best_accuracy = error, accuracy
        self.pending = still_pending

    def checkpoint(self) -> dict:
        """The ledger's state and these totals, after an update (every epoch read is in them)."""
        info = self.ledger.info
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "run_id": info.run.get("run_id"),
                "start_time": info.start_time, "written": _time.time(), "ledger": self.ledger.state(),
                "totals": {"ops_done": self.ops_done, "epochs_done": self.epochs_done,
                           "best_error": self.best_error, "best_accuracy": self.best_accuracy,
                           "pending": self.pending,
                           "latest_counted": None if self.latest_counted == -math.inf else self.latest_counted}}

    @classmethod
    def from_checkpoint_file(cls, run_dir: Path) -> "_LiveRun | None":
        """The live run the checkpoint describes, or None where there is none to trust for it.
        Hundreds of thousands of objects and no cycles: the cyclic collector is paused, or it would
        rescan the growing heap many times over while they are made."""
        with gc_paused():
            try:
                state = json.loads(RunDir(run_dir).progress_checkpoint.read_bytes())
                if (state["format"], state["version"]) != (CHECKPOINT_FORMAT, CHECKPOINT_VERSION):
                    return None
                ledger = RunLedger.from_state(run_dir, state["ledger"])
                if (state["run_id"], state["start_time"]) != (ledger.info.run.get("run_id"), ledger.info.start_time):
                    return None
                live = cls(run_dir, ledger)
                totals = state["totals"]
                live.ops_done, live.epochs_done = int(totals["ops_done"]), int(totals["epochs_done"])
                live.best_error, live.best_accuracy = totals["best_error"], totals["best_accuracy"]
                live.pending = [(float(t), int(ops), error, accuracy) for t, ops, error, accuracy in totals["pending"]]
                latest = totals["latest_counted"]
                live.latest_counted = -math.inf if latest is None else float(latest)
                return live
            except (OSError, KeyError, TypeError, ValueError, AttributeError):  # unreadable or not whole
                return None


_LIVE: dict[Path, _LiveRun] = {}
# The live display (main thread) and a metrics endpoint (its server's threads) of one process share
# a run's ledger: one refreshes it while the other reads it only under this lock.
_LOCK = threading.RLock()


def snapshot(run_dir: str | os.PathLike, now: float | None = None) -> Progress:
    """The run's progress at `now` (default: the current time)."""
    with live_ledger(run_dir, now) as (progress, _):
        return progress


@contextmanager
def live_ledger(run_dir: str | os.PathLike, now: float | None = None) -> Iterator[tuple[Progress, RunLedger]]:
    """snapshot() and the ledger behind it, which no other thread refreshes until the block ends."""
    now = _time.time() if now is None else now
    key = Path(run_dir).resolve()
    with _LOCK:
        live = _LIVE.get(key)
        if live is None:
            live = _LIVE[key] = _LiveRun.from_checkpoint_file(key) or _LiveRun(key)
        live.update(now)
        yield _progress(live, now), live.ledger


def _progress(live: _LiveRun, now: float) -> Progress:
    ledger = live.ledger
    info = ledger.info
    end = min(now, info.deadline)
    if ledger.run_end is not None:
        end = min(end, ledger.run_end["time"])
    ops_per_s = live.ops_done / (end - info.start_time) if end > info.start_time else 0.0

    replicas = []
    for replica, state in sorted(ledger.replicas.items()):
        running = state.running
        replicas.append(ReplicaProgress(
            replica=replica, host=state.starts[-1].get("host") if state.starts else None,
            attempts=len(state.starts), trials_done=state.trials_done,
            running=running.id if running else None, running_epochs=running.epochs if running else 0,
            stopped=state.stop is not None, last_event_time=state.last_time,
            running_per_image=running.per_image if running else None))
    return Progress(
        now=now, elapsed_s=now - info.start_time, budget_s=info.budget_s,
        remaining_s=max(info.deadline - now, 0.0), ended=ledger.run_end is not None,
        trials_done=sum(r.trials_done for r in replicas),
        trials_running=sum(r.running is not None for r in replicas), epochs_counted=live.epochs_done,
        ops_per_s=ops_per_s, regulated_ops=regulated(ops_per_s, live.best_error),
        best_accuracy=live.best_accuracy, best_error=live.best_error, replicas=tuple(replicas),
        operations=live.ops_done, workload=ledger.workload, all_to_all_bytes=ledger.all_to_all_bytes,
        all_to_all_seconds=ledger.all_to_all_seconds, all_to_all_trials=ledger.all_to_all_trials,
        all_reduce_bytes=ledger.all_reduce_bytes, all_reduce_seconds=ledger.all_reduce_seconds,
        all_reduce_timed_bytes=ledger.all_reduce_timed_bytes, all_reduce_trials=ledger.all_reduce_trials,
        all_reduce_inter_node_bytes=ledger.all_reduce_inter_node_bytes, **_network_cost(ledger, end - info.start_time))


def _network_cost(ledger, run_seconds: float) -> dict[str, float | None]:
    """aiperf_core.scoring.network's share of step time waiting and run efficiency (`run_seconds` the live
    score's time), None before a trial communicated."""
    from aiperf_core.scoring.network import run_efficiency, waits

    if not ledger.all_reduce_trials and not ledger.all_to_all_trials:
        return {"network_share": None, "network_efficiency": None}
    waited, priced, steps, lives, span = waits(ledger)
    return {"network_share": waited / steps if steps > 0 else None,
            "network_efficiency": run_efficiency(waited + priced, lives, span, run_seconds)}


def write_checkpoint(run_dir: str | os.PathLike, now: float | None = None) -> None:
    """Bring the run's live ledger up to date and write primary/progress.json from it, atomically."""
    with live_ledger(run_dir, now), gc_paused():
        data = json.dumps(_LIVE[Path(run_dir).resolve()].checkpoint(), separators=(",", ":")).encode()
    write_bytes_atomic(RunDir(run_dir).progress_checkpoint, data)


def forget(run_dir: str | os.PathLike) -> None:
    """Drop the cached state of a run (when its display closes)."""
    with _LOCK:
        _LIVE.pop(Path(run_dir).resolve(), None)
