"""What a run's event logs say, read incrementally: trials, epochs, replicas, the run's end.

Scoring, verification, the live display and the report all read the logs through `RunLedger`.
`refresh()` parses only the bytes appended to each log since the last call, so the live display
can call it every few seconds during a 4096-replica run. Per-image operation counts come from the
trial graphs through `per_image_ops`, cached by the graph's SHA-256: the hash pins the content,
so one count serves every trial (and every run) with the same graph.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiperf_core import workloads
from aiperf_core.errors import AiperfError
from aiperf_core.gcpause import gc_paused
from aiperf_core.rundir import LogRewritten, LogTail, RunDir, RunDirError, sha256_bytes

# graph sha256 -> (FP, BP) per image, paper convention. Content-addressed, so it is safe to share
# across runs and calls: re-scoring a run (or scoring it after the live display) costs reading and
# hashing its graphs, not loading and counting them again.
_PER_IMAGE: dict[str, tuple[int, int]] = {}


def per_image_ops(graph_path: Path, expected_sha256: str) -> tuple[tuple[int, int] | None, str | None]:
    """((FP, BP) per image, None) for the graph pinned by `expected_sha256`, or (None, problem).

    The file is always read, and its content must hash to the pinned value: a graph changed after
    its trial started is never counted, and whether a run's graph counts never depends on what
    this process happened to count before. Only the counting is cached."""
    try:
        data = graph_path.read_bytes()
    except FileNotFoundError:
        return None, f"{_short(graph_path)}: missing"
    except OSError as exc:
        return None, f"{_short(graph_path)}: unreadable: {exc}"
    if sha256_bytes(data) != expected_sha256:
        return None, f"{_short(graph_path)}: content differs from trial_start.graph_sha256"
    cached = _PER_IMAGE.get(expected_sha256)
    if cached is not None:
        return cached, None
    from aiperf_core.ir import Graph
    from aiperf_opcount import count

    try:
        counted = count(Graph.from_json(data.decode("utf-8")))
    except (AiperfError, UnicodeDecodeError) as exc:
        return None, f"{_short(graph_path)}: not a valid graph: {exc}"
    value = (counted.fp, counted.bp)
    _PER_IMAGE[expected_sha256] = value
    return value, None


def count_graphs(jobs: list[tuple[Path, str]]) -> list[tuple[tuple[int, int] | None, str | None]]:
    """per_image_ops for each (graph path, pinned sha256), caching what counts. Many graphs are
    spread over worker processes: loading and counting a ResNet-50-size graph takes milliseconds,
    and a big run of distinct morphs has tens of thousands. AIPERF_SCORE_WORKERS caps the workers
    (1: none)."""
    workers = min(_score_workers(), len(jobs) // PARALLEL_GRAPHS_PER_WORKER)
    results = None
    if workers >= 2:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        try:
            # spawn, not fork: the caller (the primary) may have threads, and fork copies their locks.
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                results = list(pool.map(per_image_ops, [p for p, _ in jobs], [s for _, s in jobs],
                                        chunksize=max(1, len(jobs) // (workers * 8))))
        except (OSError, BrokenProcessPool):  # no processes to be had here: count in this one
            results = None
    if results is None:
        return [per_image_ops(path, sha) for path, sha in jobs]
    for (_, sha), (value, _) in zip(jobs, results):
        if value is not None:
            _PER_IMAGE[sha] = value
    return results


PARALLEL_GRAPHS_PER_WORKER = 64  # fewer graphs than this per worker do not repay starting it


def _score_workers() -> int:
    configured = os.environ.get("AIPERF_SCORE_WORKERS", "").strip()
    if configured:
        try:
            return max(int(configured), 1)
        except ValueError:
            raise AiperfError(f"AIPERF_SCORE_WORKERS: {configured!r} is not an integer") from None
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _short(path: Path) -> str:
    """trials/<trial>/graph.json: how problems name a file, independent of where the run dir sits."""
    return "/".join(path.parts[-3:])


@dataclass(frozen=True)
class RunInfo:
    """The clock of a run, from run.json."""

    run: dict[str, Any]
    start_time: float
    deadline: float
    budget_s: float


def _number(run: dict, key: str, where: Path) -> float | None:
    value = run.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RunDirError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def read_run_info(run_dir: RunDir) -> RunInfo:
    run = run_dir.read_run()
    where = run_dir.run_file
    start = _number(run, "start_time", where)
    if start is None:
        raise RunDirError(f"{where}: start_time missing")
    budget = _number(run, "time_budget_s", where)
    deadline = _number(run, "deadline", where)
    if deadline is None and budget is None:
        raise RunDirError(f"{where}: deadline and time_budget_s both missing")
    if deadline is None:
        deadline = start + budget
    if budget is None:
        budget = deadline - start
    if deadline <= start:
        raise RunDirError(f"{where}: deadline {deadline} is not after start_time {start}")
    return RunInfo(run, start, deadline, budget)


def _expert_load(value) -> dict[str, float] | None:
    """epoch_end.expert_load's maximum over mean per moe node; what does not read as one is left out (the
    figure is reported beside the score, never part of it)."""
    if not isinstance(value, dict):
        return None
    out = {}
    for node, entry in value.items():
        ratio = entry.get("max_over_mean") if isinstance(entry, dict) else None
        if type(ratio) in (float, int) and ratio >= 1.0:
            out[str(node)] = float(ratio)
    return out or None


def _all_to_all(value) -> tuple[int, float] | None:
    """(bytes, seconds) of epoch_end.all_to_all; None where the field is absent or does not read as one
    (the figure is reported beside the score, never part of it: `aiperf score --verify` names a
    malformed one, scoring passes over it)."""
    if not isinstance(value, dict):
        return None
    moved, seconds = value.get("bytes"), value.get("seconds")
    if type(moved) is not int or moved < 0 or type(seconds) not in (float, int) or not 0 <= seconds < math.inf:
        return None
    return moved, float(seconds)


def _all_reduce(value) -> tuple[int, int, int, float | None] | None:
    """(bytes, inter_node_bytes, intra_node_bytes, seconds or None) of epoch_end.all_reduce; None where
    the field does not read as one (reported beside the score: `aiperf score --verify` names it)."""
    if not isinstance(value, dict):
        return None
    moved = [value.get(key) for key in ("bytes", "inter_node_bytes", "intra_node_bytes")]
    seconds = value.get("seconds")
    if any(type(v) is not int or v < 0 for v in moved) or (
            seconds is not None and (type(seconds) not in (float, int) or not 0 <= seconds < math.inf)):
        return None
    return moved[0], moved[1], moved[2], None if seconds is None else float(seconds)


# Trial.all_reduce, summed over the epochs that logged epoch_end.all_reduce: its indices.
AR_BYTES, AR_INTER, AR_INTRA, AR_SECONDS, AR_TIMED_BYTES = range(5)


class Trial:
    """One trial as its replica's log tells it."""

    __slots__ = ("id", "replica", "round", "parent", "graph_sha256", "precision", "started", "ended",
                 "status", "reason", "epochs", "last_epoch", "last_epoch_time", "best_accuracy", "per_image", "problem",
                 "compile_seconds", "expert_load", "all_to_all_bytes", "all_to_all_seconds", "step_seconds",
                 "all_reduce", "pricing_seconds")

    def __init__(self, trial_id: str, replica: int, event: dict[str, Any]):
        hyper = event.get("hyper") if isinstance(event.get("hyper"), dict) else {}
        self.id = trial_id
        self.replica = replica
        self.round = event.get("round")
        self.parent = event.get("parent")
        self.graph_sha256 = event.get("graph_sha256")
        self.precision = hyper.get("precision")
        self.started = event["time"]
        self.ended: float | None = None
        self.status: str | None = None  # None while running
        self.reason: str | None = None
        self.epochs = 0  # epoch_end events counted
        self.last_epoch = -1  # the highest epoch number logged
        self.last_epoch_time: float | None = None
        self.best_accuracy: float | None = None
        self.per_image: tuple[int, int] | None = None  # (FP, BP) once the graph is resolved
        self.problem: str | None = None  # why per_image is None
        self.compile_seconds: float | None = None  # summed epoch_end.compile_seconds; None: none measured
        # Per moe node, its experts' maximum over mean tokens in the latest epoch (epoch_end.expert_load);
        # None for a trial without a mixture of experts.
        self.expert_load: dict[str, float] | None = None
        # The experts' all-to-all summed over the epochs that logged it (epoch_end.all_to_all): analytic
        # bytes and measured seconds; None for a trial that did not run expert-parallel.
        self.all_to_all_bytes: int | None = None
        self.all_to_all_seconds: float | None = None
        self.step_seconds = 0.0  # summed epoch_end.step_seconds
        # The gradient all-reduce summed over the epochs that logged it (epoch_end.all_reduce): [bytes,
        # inter-node bytes, intra-node bytes, measured seconds (None: none measured), the bytes of the
        # epochs whose seconds were measured]; None for a trial on one device.
        self.all_reduce: list | None = None
        # Summed epoch_end.pricing_seconds: communication outside the steps that priced their waits.
        self.pricing_seconds = 0.0

    def all_to_all_bytes_per_second(self) -> float | None:
        """The trial's all-to-all bandwidth: its bytes over its seconds (None: none, or no time measured)."""
        if self.all_to_all_bytes is None or not self.all_to_all_seconds:
            return None
        return self.all_to_all_bytes / self.all_to_all_seconds

    def all_reduce_bytes_per_second(self) -> float | None:
        """The trial's all-reduce bandwidth per rank (nccl-tests' busbw): the bytes of its timed epochs
        over their seconds (None: none, or no time measured)."""
        if self.all_reduce is None or not self.all_reduce[AR_SECONDS]:
            return None
        return self.all_reduce[AR_TIMED_BYTES] / self.all_reduce[AR_SECONDS]

    def wait_seconds(self) -> float:
        """Seconds its steps waited on communication: measured all-reduce plus all-to-all."""
        return ((self.all_to_all_seconds or 0.0)
                + ((self.all_reduce[AR_SECONDS] or 0.0) if self.all_reduce is not None else 0.0))

    def communicated(self) -> bool:
        return self.all_reduce is not None or self.all_to_all_bytes is not None

    def state(self) -> list:
        """Every field, in __slots__ order (RunLedger.state)."""
        return [getattr(self, name) for name in self.__slots__]

    @classmethod
    def from_state(cls, values: list) -> "Trial":
        """The trial `state()` gave (ValueError if it does not hold together). One assignment of
        every field: a checkpoint of a 4096-replica run holds about 50,000 trials."""
        trial = cls.__new__(cls)
        (trial.id, trial.replica, trial.round, trial.parent, trial.graph_sha256, trial.precision, trial.started,
         trial.ended, trial.status, trial.reason, trial.epochs, trial.last_epoch, trial.last_epoch_time,
         trial.best_accuracy, per_image, trial.problem, trial.compile_seconds, trial.expert_load,
         trial.all_to_all_bytes, trial.all_to_all_seconds, trial.step_seconds, trial.all_reduce,
         trial.pricing_seconds) = values
        if type(trial.id) is not str or type(trial.replica) is not int or type(trial.epochs) is not int:
            raise ValueError(f"trial {trial.id!r} of replica {trial.replica!r}")
        trial.per_image = None if per_image is None else (int(per_image[0]), int(per_image[1]))
        return trial

    def to_dict(self) -> dict[str, Any]:
        return {"trial": self.id, "replica": self.replica, "round": self.round, "parent": self.parent,
                "started": self.started, "ended": self.ended, "status": self.status, "epochs": self.epochs,
                "best_accuracy": self.best_accuracy, "precision": self.precision,
                "compile_seconds": self.compile_seconds, "expert_load": self.expert_load,
                "all_to_all": None if self.all_to_all_bytes is None else {
                    "bytes": self.all_to_all_bytes, "seconds": self.all_to_all_seconds,
                    "bytes_per_second": self.all_to_all_bytes_per_second()},
                "all_reduce": None if self.all_reduce is None else {
                    "bytes": self.all_reduce[AR_BYTES], "inter_node_bytes": self.all_reduce[AR_INTER],
                    "intra_node_bytes": self.all_reduce[AR_INTRA], "seconds": self.all_reduce[AR_SECONDS],
                    "bytes_per_second": self.all_reduce_bytes_per_second()}}


class ReplicaState:
    """What the live display and the report show per replica."""

    __slots__ = ("replica", "starts", "stop", "trials_done", "running", "last_time", "step_seconds",
                 "compile_seconds")

    def __init__(self, replica: int):
        self.replica = replica
        self.starts: list[dict[str, Any]] = []  # every replica_start (one per attempt)
        self.stop: dict[str, Any] | None = None
        self.trials_done = 0
        self.running: Trial | None = None
        self.last_time: float | None = None
        self.step_seconds = 0.0  # summed epoch_end.step_seconds: time in train and eval steps
        self.compile_seconds: float | None = None  # summed epoch_end.compile_seconds; None: none measured

    def state(self) -> dict[str, Any]:
        return {"starts": self.starts, "stop": self.stop, "trials_done": self.trials_done,
                "running": None if self.running is None else self.running.id, "last_time": self.last_time,
                "step_seconds": self.step_seconds, "compile_seconds": self.compile_seconds}

    @classmethod
    def from_state(cls, replica: int, state: dict[str, Any], trials: dict[str, "Trial"]) -> "ReplicaState":
        restored = cls(replica)
        restored.starts = list(state["starts"])
        restored.stop = state["stop"]
        restored.trials_done = int(state["trials_done"])
        restored.running = None if state["running"] is None else trials[state["running"]]
        restored.last_time = state["last_time"]
        restored.step_seconds = float(state["step_seconds"])
        restored.compile_seconds = state["compile_seconds"]
        return restored

    def busy_fraction(self) -> float | None:
        """Time in train and eval steps over the replica's life, from its first replica_start to
        its last event (restarts and their downtime included): None before any epoch."""
        life = self.life_seconds()
        return self.step_seconds / life if life and self.step_seconds else None

    def life_seconds(self) -> float | None:
        """From the replica's first replica_start to its last event, restarts and downtime included."""
        if not self.starts or self.last_time is None or self.last_time <= self.starts[0]["time"]:
            return None
        return self.last_time - self.starts[0]["time"]


# An epoch as scoring needs it: (time, trial, train_images, val_images, val_accuracy or None, error or
# None), the error the run's workload makes of the epoch's validation figures (workloads.base.Validity).
Epoch = tuple


class RunLedger:
    """The accumulated content of every event log of one run directory."""

    def __init__(self, run_dir: str | os.PathLike | RunDir):
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.info = read_run_info(self.run_dir)
        workload = workloads.of_run(self.info.run)
        self.workload, self.validity = workload.name, workload.validity
        self.generation = -1
        self._reset()

    def _reset(self) -> None:
        # Counts the times the ledger started again from scratch: holders of derived totals
        # (the live display) compare it to know their totals are stale.
        self.generation += 1
        self._tails: dict[int | None, LogTail] = {}  # None is the primary log
        self.trials: dict[str, Trial] = {}
        self.epochs: list[Epoch] = []
        self.replicas: dict[int, ReplicaState] = {}
        self.primary_events: list[dict[str, Any]] = []
        self.run_end: dict[str, Any] | None = None
        self.problems: list[str] = []  # log content that scoring could not use, one line each
        self._resolved: dict[str, tuple[int, int]] = {}  # graph sha256 -> (FP, BP), checked in this run
        self._waiting: dict[str, list[Trial]] = {}  # graph sha256 -> trials whose graph did not resolve
        self._new_trials: list[Trial] = []  # started in this refresh; resolved at its end
        self._count_all_to_all([])

    def _count_all_to_all(self, trials) -> None:
        """The run's all-to-all totals over `trials` (every epoch that logged epoch_end.all_to_all):
        analytic bytes, measured seconds, and the trials that logged it. Kept as epochs are read, so
        the live display and /metrics never go over every trial."""
        trials = list(trials)
        measured = [t for t in trials if t.all_to_all_bytes is not None]
        self.all_to_all_bytes = sum(t.all_to_all_bytes for t in measured)
        self.all_to_all_seconds = sum(t.all_to_all_seconds for t in measured)
        self.all_to_all_trials = len(measured)
        # The same of the gradient all-reduce (epoch_end.all_reduce): bytes per rank, seconds measured,
        # the bytes of the epochs whose seconds were measured, the trials that logged it.
        reduced = [t.all_reduce for t in trials if t.all_reduce is not None]
        self.all_reduce_bytes = sum(r[AR_BYTES] for r in reduced)
        self.all_reduce_inter_node_bytes = sum(r[AR_INTER] for r in reduced)
        self.all_reduce_seconds = sum(r[AR_SECONDS] or 0.0 for r in reduced)
        self.all_reduce_timed_bytes = sum(r[AR_TIMED_BYTES] for r in reduced)
        self.all_reduce_trials = len(reduced)
        # Seconds of communication outside the steps, spent pricing their waits (epoch_end.pricing_seconds).
        self.pricing_seconds = sum(t.pricing_seconds for t in trials)

    def refresh(self) -> bool:
        """Read what every log gained since the last call. True if anything new was read.
        A log that shrank (replaced, not appended to) makes the ledger start again from scratch."""
        with gc_paused():
            try:
                return self._refresh()
            except LogRewritten:
                self._reset()
                return self._refresh()

    def _refresh(self) -> bool:
        grew = self._read_primary()
        for replica in self.run_dir.replica_ids():
            tail = self._tails.get(replica)
            if tail is None:
                tail = self._tails[replica] = LogTail(self.run_dir.replica_log(replica),
                                                      f"replicas/{replica}/events.jsonl")
                self.replicas[replica] = ReplicaState(replica)
            state = self.replicas[replica]
            for line, event in tail.read():
                grew = True
                self._replica_event(state, event, tail.name, line)
        self._resolve_new_trials()
        return grew

    def state(self) -> dict[str, Any]:
        """What this ledger has read of the replicas' logs, with each log's position, as JSON-ready
        values: `from_state` continues from there without reading those bytes again. The epochs
        read so far are left out (a live reader keeps only their totals: progress._LiveRun), and so
        is the primary log (small: read again whole). Call it between refreshes."""
        return {"trials": [trial.state() for trial in self.trials.values()],
                "replicas": {str(r): state.state() for r, state in self.replicas.items()},
                "tails": {str(r): tail.state() for r, tail in self._tails.items() if r is not None},
                "problems": self.problems,
                "resolved": {sha: list(value) for sha, value in self._resolved.items()},
                "waiting": {sha: [trial.id for trial in trials] for sha, trials in self._waiting.items()}}

    @classmethod
    def from_state(cls, run_dir: str | os.PathLike | RunDir, state: dict[str, Any]) -> "RunLedger":
        """A ledger positioned where `state()` left one (its `epochs` start empty). ValueError,
        KeyError or TypeError on a state that does not hold together."""
        ledger = cls(run_dir)
        ledger.trials = {trial.id: trial for trial in map(Trial.from_state, state["trials"])}
        ledger._count_all_to_all(ledger.trials.values())
        for key, tail_state in state["tails"].items():
            replica = int(key)
            ledger._tails[replica] = LogTail.from_state(ledger.run_dir.replica_log(replica),
                                                        f"replicas/{replica}/events.jsonl", tail_state)
            ledger.replicas[replica] = ReplicaState.from_state(replica, state["replicas"][key], ledger.trials)
        ledger.problems = [str(problem) for problem in state["problems"]]
        ledger._resolved = {str(sha): (int(fp), int(bp)) for sha, (fp, bp) in state["resolved"].items()}
        # Not into _PER_IMAGE: that cache serves scoring, and holds only what this process counted.
        ledger._waiting = {str(sha): [ledger.trials[i] for i in ids] for sha, ids in state["waiting"].items()}
        return ledger

    def _read_primary(self) -> bool:
        tail = self._tails.get(None)
        if tail is None:
            tail = self._tails[None] = LogTail(self.run_dir.primary_log, "primary/events.jsonl")
        grew = False
        for line, event in tail.read():
            grew = True
            _require_time(event, tail.name, line)
            self.primary_events.append(event)
            if event.get("event") == "run_end":
                self.run_end = event
        return grew

    def _replica_event(self, state: ReplicaState, event: dict[str, Any], log: str, line: int) -> None:
        kind = event.get("event")
        time = event.get("time")
        if type(time) not in (float, int):
            _require_time(event, log, line)
        state.last_time = time
        if kind == "epoch_end":
            self._epoch_end(state, event, log, line, time)
        elif kind == "trial_start":
            trial_id = _require_str(event, "trial", log, line)
            if trial_id in self.trials:
                self.problems.append(f"{_where(log, line)}: trial {trial_id} started twice; the first counts")
                return
            trial = self.trials[trial_id] = Trial(trial_id, state.replica, event)
            state.running = trial
            self._new_trials.append(trial)
        elif kind == "trial_end":
            trial = self.trials.get(_require_str(event, "trial", log, line))
            if trial is None:
                self.problems.append(f"{_where(log, line)}: trial_end of {event['trial']}, which never started")
                return
            trial.ended = time
            trial.status = event.get("status")
            trial.reason = event.get("reason")
            state.trials_done += 1
            if state.running is trial:
                state.running = None
        elif kind == "replica_start":
            state.starts.append(event)
            # A restarted replica first closes its interrupted trial; until then it is not running.
            state.running = None
        elif kind == "replica_stop":
            state.stop = event
            state.running = None

    def _epoch_end(self, state: ReplicaState, event: dict, log: str, line: int, time: float) -> None:
        # The hot path of scoring (one call per epoch of every replica): plain type() checks inline,
        # the helpers only to raise with a message.
        trial_id = event.get("trial")
        if type(trial_id) is not str:
            _require_str(event, "trial", log, line)
        trial = self.trials.get(trial_id)
        if trial is None:
            self.problems.append(f"{_where(log, line)}: epoch_end of {trial_id}, which never started: not counted")
            return
        epoch = event.get("epoch")
        if type(epoch) is not int:
            raise RunDirError(f"{_where(log, line)}: epoch_end.epoch must be an integer, got {epoch!r}")
        if epoch <= trial.last_epoch:  # a trial's epochs are numbered 0, 1, 2... in the order they end
            self.problems.append(f"{_where(log, line)}: epoch {epoch} of {trial_id} logged after epoch "
                                 f"{trial.last_epoch}: counted once")
            return
        train_images = event.get("train_images")
        if type(train_images) is not int or train_images < 0:
            _require_count(event, "train_images", log, line)
        val_images = event.get("val_images")
        if type(val_images) is not int or val_images < 0:
            _require_count(event, "val_images", log, line)
        accuracy = event.get("val_accuracy")
        if accuracy is not None:
            if type(accuracy) not in (float, int) or not 0.0 <= accuracy <= 1.0:
                raise RunDirError(f"{_where(log, line)}: val_accuracy must be in [0, 1], got {accuracy!r}")
            if trial.best_accuracy is None or accuracy > trial.best_accuracy:
                trial.best_accuracy = accuracy
        val_loss = event.get("val_loss")
        if val_loss is not None and type(val_loss) not in (float, int):
            raise RunDirError(f"{_where(log, line)}: val_loss must be a number or null, got {val_loss!r}")
        error = self.validity.error(accuracy, val_loss, val_images)
        trial.last_epoch = epoch
        trial.epochs += 1
        trial.last_epoch_time = time
        seconds = event.get("step_seconds")
        if type(seconds) in (float, int) and seconds > 0:  # absent or null: the backend did not measure
            state.step_seconds += seconds
            trial.step_seconds += seconds
        compiling = event.get("compile_seconds")
        if type(compiling) in (float, int) and compiling >= 0:  # 0.0: nothing compiled; null: not measured
            trial.compile_seconds = (trial.compile_seconds or 0.0) + compiling
            state.compile_seconds = (state.compile_seconds or 0.0) + compiling
        load = _expert_load(event.get("expert_load"))
        if load:
            trial.expert_load = load
        moved = _all_to_all(event.get("all_to_all")) if "all_to_all" in event else None
        if moved is not None:
            if trial.all_to_all_bytes is None:
                trial.all_to_all_bytes, trial.all_to_all_seconds = 0, 0.0
                self.all_to_all_trials += 1
            trial.all_to_all_bytes += moved[0]
            trial.all_to_all_seconds += moved[1]
            self.all_to_all_bytes += moved[0]
            self.all_to_all_seconds += moved[1]
        reduced = _all_reduce(event.get("all_reduce")) if "all_reduce" in event else None
        if reduced is not None:
            if trial.all_reduce is None:
                trial.all_reduce = [0, 0, 0, None, 0]
                self.all_reduce_trials += 1
            for index in (AR_BYTES, AR_INTER, AR_INTRA):
                trial.all_reduce[index] += reduced[index]
            self.all_reduce_bytes += reduced[AR_BYTES]
            self.all_reduce_inter_node_bytes += reduced[AR_INTER]
            if reduced[AR_SECONDS] is not None:
                trial.all_reduce[AR_SECONDS] = (trial.all_reduce[AR_SECONDS] or 0.0) + reduced[AR_SECONDS]
                trial.all_reduce[AR_TIMED_BYTES] += reduced[AR_BYTES]
                self.all_reduce_seconds += reduced[AR_SECONDS]
                self.all_reduce_timed_bytes += reduced[AR_BYTES]
        pricing = event.get("pricing_seconds")
        if type(pricing) in (float, int) and 0 <= pricing < math.inf:  # absent: nothing priced apart
            trial.pricing_seconds += pricing
            self.pricing_seconds += pricing
        self.epochs.append((time, trial, train_images, val_images, accuracy, error))

    def _resolve_new_trials(self) -> None:
        """Find the per-image ops of the trials read in this refresh, one graph hash at a time.

        Each pinned graph is read once per ledger: trials that share it share its file's check. A
        graph file that fails (missing, changed) leaves its trials waiting: a later trial with the
        same pinned hash and an intact file resolves them all. Graphs this process has never
        counted are counted first, in parallel when there are many (a run of distinct morphs)."""
        by_sha: dict[str, list[Trial]] = {}
        for trial in self._new_trials:
            sha = trial.graph_sha256
            if not isinstance(sha, str):
                trial.problem = f"trial_start of {trial.id} records no graph_sha256"
            elif sha in self._resolved:
                trial.per_image = self._resolved[sha]
            else:
                by_sha.setdefault(sha, []).append(trial)
        self._new_trials = []
        uncounted = [(self._graph_path(trials[0]), sha) for sha, trials in by_sha.items() if sha not in _PER_IMAGE]
        checked = dict(zip((sha for _, sha in uncounted), count_graphs(uncounted)))
        for sha, trials in by_sha.items():
            value = None
            for i, trial in enumerate(trials):
                value, problem = checked[sha] if i == 0 and sha in checked else per_image_ops(
                    self._graph_path(trial), sha)
                if value is not None:
                    break
                trial.problem = problem
            waiting = self._waiting.pop(sha, []) + trials
            if value is None:
                self._waiting[sha] = waiting
                continue
            self._resolved[sha] = value
            for trial in waiting:
                trial.per_image, trial.problem = value, None

    def _graph_path(self, trial: Trial) -> Path:
        return self.run_dir.trial_dir(trial.id) / "graph.json"

    def damaged_logs(self) -> list[str]:
        """One line per log with a damaged line; the rest of that log is not read."""
        return [f"{tail.name}: line {tail.damaged_line} is not a JSON object: it and the lines after it "
                "are not read" for tail in self._tails.values() if tail.damaged_line is not None]

    def unresolved_trials(self) -> list[Trial]:
        """Trials with epochs whose operations cannot be counted (their graph is missing or changed)."""
        return [t for t in self.trials.values() if t.per_image is None and t.epochs]

    def framework_versions(self) -> dict[str, list[str]]:
        """backend name -> the framework versions its replicas reported (replica_start)."""
        found: dict[str, set[str]] = {}
        for state in self.replicas.values():
            for start in state.starts:
                found.setdefault(str(start.get("backend")), set()).add(str(start.get("framework_version")))
        return {backend: sorted(versions) for backend, versions in sorted(found.items())}


def _where(log: str, line: int) -> str:
    return f"{log}: line {line}"


def _require_time(event: dict, log: str, line: int) -> float:
    value = event.get("time")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RunDirError(f"{_where(log, line)}: time must be a number, got {value!r}")
    return value


def _require_str(event: dict, key: str, log: str, line: int) -> str:
    value = event.get(key)
    if not isinstance(value, str):
        raise RunDirError(f"{_where(log, line)}: {event.get('event')}.{key} must be a string, got {value!r}")
    return value


def _require_count(event: dict, key: str, log: str, line: int) -> int:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RunDirError(f"{_where(log, line)}: {event.get('event')}.{key} must be a non-negative integer, "
                          f"got {value!r}")
    return value
