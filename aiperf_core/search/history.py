"""The shared history: every replica's usable trials, as the primary publishes them.

A trial is usable when its replica's log holds its `trial_end` with status `ok` or
`early_stopped` (the trials whose weights were saved) and its trial.json matches the hash that
event recorded. The primary, which watches every replica's log anyway, publishes each usable
trial once, as one line of the hash-chained log primary/history.jsonl carrying everything a
replica reads of its trial.json (`HistoryPublisher`). A replica tails that one file by byte
offset, and its own event log for its own trials, which it must see as soon as they end
(`SharedHistory`). A refresh so costs a fixed number of filesystem calls, however many replicas
the run has: two opens and one per own trial ended since the last refresh (docs/run-directory.md,
"The published history").

A run directory without that file (replicas run without a primary: tests, `aiperf replica` by
hand) is read as before it existed: every replica's log, and each new trial's trial.json.

A run begun by an aiperf before `hpo_point` (2026-11-27) wrote the cnn's point as two fields
(LEGACY_POINT); a cnn run reads them as its point. A published trial that cannot be read (that
form in a run of another workload, a line without a point, a damaged field) is set aside: never a
parent, never HPO data. The primary says which, once, when it opens the file (`set_aside_note`).
"""

from __future__ import annotations

import base64
import binascii
import heapq
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aiperf_core.clock import SYSTEM_CLOCK, Clock
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import (EventLog, LogRewritten, LogTail, RunDir, RunDirError, read_events, sha256_bytes,
                                verify_chain)
from aiperf_core.search.arch import ArchCode

USABLE = ("ok", "early_stopped")
HISTORY_NAME = "primary/history.jsonl"  # how messages name RunDir.history_file
PUBLISHED = "trial"  # the event of every line of the published history
# The fields of a published line besides event, time, seq and prev: what a replica reads of a trial.
PUBLISHED_FIELDS = ("trial", "replica", "round", "target", "best_val_accuracy", "hpo_point", "arch", "signature",
                    "files")
# Lines and trial.json files written before hpo_point, when the cnn was the only workload, carry its
# point as these two fields: top-level in a published line, under `hyper` in trial.json. They are
# the cnn's HPO dimensions (workloads/cnn.py HpoSpace), so the cnn reads them exactly as its point;
# another workload has other dimensions and cannot.
LEGACY_POINT = ("batch_size", "kernel_size")
LEGACY_WORKLOAD = "cnn"
# The primary reads a replica's log again after this fraction of the time since its current trial
# was seen to start, and at least every PUBLISH_DELAY_MAX_S: about 12 reads in a trial's first
# 10 minutes, then one every 5, so some 17 for a 36-minute trial and 26 for a 78-minute one (each
# read is an open on the shared filesystem and about 10 us of the primary). A trial is published
# within half its length, and at most 5 minutes (plus a poll), after it ends: a replica plans each
# round while the one before trains, so what it plans on is up to a trial old anyway.
PUBLISH_DELAY_FRACTION = 0.5
PUBLISH_DELAY_MAX_S = 300.0


@dataclass(frozen=True)
class TrialRecord:
    trial: str
    replica: int
    round: int
    target: float          # what the search maximises: predicted quality (1 - error) in warm-up rounds, else the best
    best_val_accuracy: float
    hpo_point: dict[str, float]  # the trial's value of each HPO dimension of its workload
    arch: ArchCode
    signature: str
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256, from trial_end


def usable_end(event: dict[str, Any]) -> bool:
    """Whether a replica log's event ends a trial that may join the history (its files permitting)."""
    files = event.get("files")
    return (event.get("event") == "trial_end" and event.get("status") in USABLE and isinstance(event.get("trial"), str)
            and isinstance(files, dict) and "trial.json" in files and "weights.npz" in files)


ARCH_INT = np.dtype("<i4")  # a published architecture code: little-endian int32 rows, base64


def encode_arch(arch: Any) -> dict[str, str]:
    """An architecture code as published: `layers` ([kind, width, kernel] rows) and `skips` ([u, d]
    rows) as base64 of little-endian int32. A cold read decodes tens of thousands of them: as JSON
    lists of lists they cost more to parse than everything else in the file."""
    code = ArchCode.from_json(arch)
    out = {}
    for name, rows in (("layers", code.layers), ("skips", code.skips)):
        ints = rows.astype(ARCH_INT)
        if not np.array_equal(ints, rows):
            raise AiperfError(f"arch: {name} are not 32-bit integers")
        out[name] = base64.b64encode(ints.tobytes()).decode("ascii")
    return out


def _arch_bytes(arch: Any) -> tuple[bytes, bytes]:
    """The raw layers and skips of a published architecture code (ValueError if it is not one)."""
    try:
        layers = binascii.a2b_base64(arch["layers"], strict_mode=True)
        skips = binascii.a2b_base64(arch["skips"], strict_mode=True)
    except (KeyError, TypeError, binascii.Error):
        raise ValueError("not a published architecture code") from None
    if len(layers) % (3 * ARCH_INT.itemsize) or len(skips) % (2 * ARCH_INT.itemsize):
        raise ValueError("not a published architecture code")
    return layers, skips


def published_fields(trial: str, replica: int, raw: bytes, files: dict[str, str],
                     workload: str = LEGACY_WORKLOAD) -> dict[str, Any] | None:
    """What the history publishes of a usable trial of a `workload` run, from its trial.json bytes
    and its trial_end's files; None when the bytes do not hash to files["trial.json"] or are not a
    trial.json an aiperf wrote for that workload. The one definition the publisher, the fallback
    reader and --verify share."""
    if sha256_bytes(raw) != files.get("trial.json"):
        return None  # changed since its trial ended: not trusted
    try:
        info = json.loads(raw)
        fields = {"trial": trial, "replica": replica, "round": int(info["round"]), "target": float(info["target"]),
                  "best_val_accuracy": float(info["best_val_accuracy"]),
                  "hpo_point": _hpo_point(info, info.get("hyper"), workload),
                  "arch": encode_arch(info["arch"]), "signature": str(info["signature"]), "files": dict(files)}
    except (ValueError, KeyError, TypeError, AttributeError, AiperfError):
        return None
    if not all(np.isfinite([fields["target"], fields["best_val_accuracy"]])):
        return None  # not JSON: a trial with weights always has both
    return fields


def as_published(line: dict[str, Any], workload: str = LEGACY_WORKLOAD) -> dict[str, Any]:
    """The PUBLISHED_FIELDS of a line, an old line's hpo_point read from LEGACY_POINT where the
    run's workload reads them: what --verify compares with published_fields."""
    shown = {key: line.get(key) for key in PUBLISHED_FIELDS}
    if "hpo_point" not in line:
        try:
            shown["hpo_point"] = _hpo_point(line, line, workload)
        except (ValueError, TypeError):
            pass  # left None: it differs from trial.json's, and --verify names the field
    return shown


def _point(value: Any) -> dict[str, float]:
    """An HPO point as published: names to finite numbers (ValueError if it is not one)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError("not an HPO point")
    point = {k: float(v) if isinstance(v, float) else int(v) for k, v in value.items()}
    if not all(np.isfinite(v) for v in point.values()):
        raise ValueError("not an HPO point")
    return point


class _Unread(ValueError):
    """Why a published trial cannot be read, in words for the set-aside note."""


def _hpo_point(fields: dict[str, Any], legacy: Any, workload: str) -> dict[str, float]:
    """fields' hpo_point; without one, the cnn's point from LEGACY_POINT in `legacy` (the line
    itself, or trial.json's hyper). _Unread when neither gives a point of `workload`."""
    if "hpo_point" in fields:
        return _point(fields["hpo_point"])
    if not isinstance(legacy, dict) or not all(name in legacy for name in LEGACY_POINT):
        raise _Unread("no hpo_point, nor the batch_size and kernel_size of an aiperf before it")
    if workload != LEGACY_WORKLOAD:
        raise _Unread(f"batch_size and kernel_size (written before hpo_point, the {LEGACY_WORKLOAD}'s point) in a "
                      f"{workload} run")
    return {name: int(value) for name, value in _point({name: legacy[name] for name in LEGACY_POINT}).items()}


def _why_unread(exc: Exception) -> str:
    if isinstance(exc, _Unread):
        return str(exc)
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]}"
    return f"a field this aiperf cannot read ({exc})"


def records_of(lines: list[dict[str, Any]], workload: str = LEGACY_WORKLOAD,
               set_aside: dict[str, str] | None = None) -> list[tuple[TrialRecord, np.ndarray]]:
    """(record, arch summary) of every published line (or published_fields) of a `workload` run
    that is one, in order; `set_aside`, when given, gets trial -> why for each line with a trial
    id that is none. The architecture codes are decoded together: one array for all, one view per
    record."""
    kept, layer_bytes, skip_bytes = [], [], []
    for fields in lines:
        try:
            files = fields["files"]
            if not isinstance(fields["trial"], str):
                continue  # nothing to name it by
            if not isinstance(files, dict):
                raise _Unread("files that are not an object")
            values = (int(fields["replica"]), int(fields["round"]), float(fields["target"]),
                      float(fields["best_val_accuracy"]), _hpo_point(fields, fields, workload),
                      str(fields["signature"]))
            layers, skips = _arch_bytes(fields["arch"])
        except (ValueError, KeyError, TypeError) as exc:
            if set_aside is not None and isinstance(fields.get("trial"), str):
                set_aside.setdefault(fields["trial"], _why_unread(exc))
            continue
        kept.append((fields["trial"], values, dict(files)))
        layer_bytes.append(layers)
        skip_bytes.append(skips)
    if not kept:
        return []
    all_layers = np.frombuffer(b"".join(layer_bytes), ARCH_INT).astype(np.float64).reshape(-1, 3)
    all_skips = np.frombuffer(b"".join(skip_bytes), ARCH_INT).astype(np.float64).reshape(-1, 2)
    layer_ends = np.cumsum([len(b) // (3 * ARCH_INT.itemsize) for b in layer_bytes])
    skip_ends = np.cumsum([len(b) // (2 * ARCH_INT.itemsize) for b in skip_bytes])
    layer_starts = np.concatenate(([0], layer_ends[:-1]))
    skip_starts = np.concatenate(([0], skip_ends[:-1]))
    # ArchCode.summary, for all at once: layers, skips, log2(summed widths + 1).
    widths = np.concatenate(([0.0], np.cumsum(all_layers[:, 1])))
    summaries = np.stack([layer_ends - layer_starts, skip_ends - skip_starts,
                          np.log2(widths[layer_ends] - widths[layer_starts] + 1.0)], axis=1).astype(np.float64)
    out = []
    for k, (trial, values, files) in enumerate(kept):
        arch = ArchCode(all_layers[layer_starts[k]:layer_ends[k]], all_skips[skip_starts[k]:skip_ends[k]])
        replica, round_number, target, best, point, signature = values
        out.append((TrialRecord(trial, replica, round_number, target, best, point, arch, signature, files),
                    summaries[k]))
    return out


def _log_tail(run_dir: RunDir, replica: int) -> LogTail:
    return LogTail(run_dir.replica_log(replica), f"replicas/{replica}/events.jsonl")


def _read(tail: LogTail) -> list[dict[str, Any]]:
    """The events appended since the last read; a log that shrank (replaced) is read again from
    its start: whoever reads it knows each trial by id and skips what it has."""
    try:
        return [event for _, event in tail.read()]
    except LogRewritten:
        tail.offset, tail.lines, tail.damaged_line = 0, 0, None
        return [event for _, event in tail.read()]  # offset 0: whatever file is there now is read


class SharedHistory:
    """The history as one replica sees it. `replica`: whose own log is read directly, so that its
    trials join as soon as they end; None for a reader that is no replica (tools, benchmarks).
    `workload`: the run's (run.json `workload`), which decides what an old trial's fields mean."""

    def __init__(self, run_dir: RunDir | None, replica: int | None = None, workload: str = LEGACY_WORKLOAD):
        self.run_dir = run_dir
        self.replica = replica
        self.workload = workload
        self.records: list[TrialRecord] = []
        self._known: set[str] = set()
        self._summaries: list[np.ndarray] = []
        self._published = None if run_dir is None else LogTail(run_dir.history_file, HISTORY_NAME)
        self._logs: dict[int, LogTail] = {}

    def refresh(self) -> list[TrialRecord]:
        """Read what was published (and what this replica ended) since the last refresh; return
        the trials that joined."""
        joined: list[TrialRecord] = []
        published = _read(self._published)
        if self.replica is not None:
            self._read_log(self.replica, joined)
        if self._published.exists:
            fresh = [event for event in published
                     if event.get("event") == PUBLISHED and event.get("trial") not in self._known]
            for record, summary in records_of(fresh, self.workload):
                if record.trial not in self._known:  # published twice: the first counts
                    self._join(record, joined, summary)
        else:  # nobody publishes: read every replica's log
            for replica in self.run_dir.replica_ids():
                if replica != self.replica:
                    self._read_log(replica, joined)
        return joined

    def add(self, record: TrialRecord) -> None:
        """Put a record in directly (benchmarks and tests build histories without a run directory)."""
        self._join(record, [], record.arch.summary())

    def summaries(self) -> np.ndarray:
        return np.asarray(self._summaries).reshape(-1, 3)

    def _join(self, record: TrialRecord, joined: list[TrialRecord], summary: np.ndarray) -> None:
        self._known.add(record.trial)
        self.records.append(record)
        self._summaries.append(summary)
        joined.append(record)

    def _read_log(self, replica: int, joined: list[TrialRecord]) -> None:
        tail = self._logs.get(replica)
        if tail is None:
            tail = self._logs[replica] = _log_tail(self.run_dir, replica)
        for event in _read(tail):
            if usable_end(event) and event["trial"] not in self._known:
                fields = _load(self.run_dir, replica, event, self.workload)
                if fields is not None:
                    for record, summary in records_of([fields], self.workload):
                        self._join(record, joined, summary)


def _load(run_dir: RunDir, replica: int, event: dict[str, Any], workload: str) -> dict[str, Any] | None:
    """published_fields of a usable trial_end, read from its trial.json; None if it is not trusted."""
    try:
        raw = (run_dir.trial_dir(event["trial"]) / "trial.json").read_bytes()
    except OSError:
        return None
    return published_fields(event["trial"], replica, raw, event["files"], workload)


class HistoryPublisher:
    """The primary's side of the history: reads every replica's log and appends each usable trial,
    once, to primary/history.jsonl (an EventLog under the primary's lease).

    A log is read again after PUBLISH_DELAY_FRACTION of the time since its replica's current trial
    was seen to start, and at least every PUBLISH_DELAY_MAX_S: a bounded number of reads per trial
    whatever its length, where reading every log at every poll would cost the primary, and the
    filesystem, one open per replica every few seconds. `publish_all` reads every log to its end.
    `workload`: the run's, as for SharedHistory."""

    def __init__(self, run_dir: RunDir, replicas: int, clock: Clock = SYSTEM_CLOCK, lease=None,
                 workload: str = LEGACY_WORKLOAD):
        self.run_dir = run_dir
        self.workload = workload
        self.log = EventLog(run_dir.history_file, clock, lease=lease)
        self.published: set[str] = set()
        self.set_aside: dict[str, str] = {}  # trial -> why: published lines no replica of this run can read
        self._tails = [_log_tail(run_dir, replica) for replica in range(replicas)]
        self._since: list[float | None] = [None] * replicas  # when the current trial was seen to start
        self._due: list[tuple[float, int]] = []  # heap of (time of the next read, replica)

    def open(self, now: float) -> None:
        """Continue the history a primary before this one wrote, after checking its hash chain
        (RunDirError when a line was changed: replicas may have planned on it); a line torn by a
        crash is cut off and its trial published again. Every log is then read from its start.
        `set_aside` then names the lines that replicas will not read (an older or damaged form):
        they stay, since the chain forbids changing them, and their trials are not published again."""
        path = self.run_dir.history_file
        for problem in ([] if not path.exists() else verify_chain(path)):
            raise RunDirError(f"{path}: line {problem.line}: {problem.message}: the published history was changed "
                              "(move the file aside to have every trial published anew)")
        lines = [event for event in read_events(path) if event.get("event") == PUBLISHED]
        self.published = {event.get("trial") for event in lines}
        self.set_aside = {}
        records_of(lines, self.workload, self.set_aside)
        self.log.open()
        self._due = [(now, replica) for replica in range(len(self._tails))]

    def poll(self, now: float) -> int:
        """Read the logs that are due; returns the number of trials published."""
        due = []
        while self._due and self._due[0][0] <= now:
            due.append(heapq.heappop(self._due)[1])
        count = 0
        for replica in due:
            count += self._read(replica, now)
            delay = min(PUBLISH_DELAY_MAX_S, PUBLISH_DELAY_FRACTION * (now - self._since[replica]))
            heapq.heappush(self._due, (now + delay, replica))
        return count

    def publish_all(self, now: float) -> int:
        """Read every log to its end (before run_end: every trial that ended is published)."""
        return sum(self._read(replica, now) for replica in range(len(self._tails)))

    def close(self) -> None:
        self.log.close()

    def _read(self, replica: int, now: float) -> int:
        count = 0
        for event in _read(self._tails[replica]):
            kind = event.get("event")
            if kind in ("trial_start", "trial_end", "replica_start"):
                self._since[replica] = now
            if kind == "trial_end" and usable_end(event) and event["trial"] not in self.published:
                fields = _load(self.run_dir, replica, event, self.workload)
                if fields is not None:
                    self.log.append(PUBLISHED, **fields)
                    self.published.add(event["trial"])
                    count += 1
        if self._since[replica] is None:
            self._since[replica] = now  # nothing started yet: read less often as the wait goes on
        return count


SET_ASIDE_NAMED = 5  # trials a note names for each reason; the primary's log names them all


def set_aside_note(set_aside: dict[str, str]) -> str:
    """One line for the terminal: how many published trials no replica reads, and why."""
    by_reason: dict[str, list[str]] = {}
    for trial, why in set_aside.items():
        by_reason.setdefault(why, []).append(trial)
    parts = []
    for why, trials in by_reason.items():
        named = ", ".join(trials[:SET_ASIDE_NAMED]) + (f" and {len(trials) - SET_ASIDE_NAMED} more"
                                                        if len(trials) > SET_ASIDE_NAMED else "")
        parts.append(f"{len(trials)} with {why} ({named})")
    return (f"{HISTORY_NAME}: {len(set_aside)} published trial(s) set aside, not parents or HPO data for this run: "
            + "; ".join(parts))
