"""The shared history: every replica's finished trials, read from the run directory.

A trial enters the history when its replica's log holds its `trial_end` with status `ok` or
`early_stopped` (the trials whose weights were saved), and its trial.json matches the hash that
event recorded. Logs are read incrementally: each refresh parses only the lines appended since
the last one, and each trial.json is read once, so a refresh costs what is new, not the run's size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from aiperf_core.errors import AiperfError
from aiperf_core.rundir import RunDir, sha256_bytes
from aiperf_core.search.arch import ArchCode

USABLE = ("ok", "early_stopped")


@dataclass(frozen=True)
class TrialRecord:
    trial: str
    replica: int
    round: int
    target: float          # what the search maximises: predicted accuracy in warm-up rounds, else the best
    best_val_accuracy: float
    batch_size: int
    kernel_size: int
    arch: ArchCode
    signature: str
    files: dict[str, str] = field(default_factory=dict)  # file name -> sha256, from trial_end


class LogTail:
    """Complete lines appended to one log since the last call; a torn last line waits."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        events = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            try:
                events.append(json.loads(data[start:end]))
            except ValueError:
                break  # damage: nothing after it can be trusted
            start = end + 1
        self.offset += start
        return events


class SharedHistory:
    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir
        self.records: list[TrialRecord] = []
        self._tails: dict[int, LogTail] = {}
        self._summaries: list[np.ndarray] = []

    def refresh(self) -> list[TrialRecord]:
        """Read what the replicas appended since the last refresh; return the trials that joined."""
        joined = []
        for replica in self.run_dir.replica_ids():
            tail = self._tails.setdefault(replica, LogTail(self.run_dir.replica_log(replica)))
            for event in tail.read_new():
                if event.get("event") == "trial_end" and event.get("status") in USABLE:
                    record = self._load(replica, event)
                    if record is not None:
                        joined.append(record)
        self.records.extend(joined)
        self._summaries.extend(r.arch.summary() for r in joined)
        return joined

    def add(self, record: TrialRecord) -> None:
        """Put a record in directly (benchmarks and tests build histories without a run directory)."""
        self.records.append(record)
        self._summaries.append(record.arch.summary())

    def summaries(self) -> np.ndarray:
        return np.asarray(self._summaries).reshape(-1, 3)

    def _load(self, replica: int, event: dict[str, Any]) -> TrialRecord | None:
        trial = event.get("trial")
        files = event.get("files") or {}
        if not isinstance(trial, str) or "trial.json" not in files or "weights.npz" not in files:
            return None
        try:
            raw = (self.run_dir.trial_dir(trial) / "trial.json").read_bytes()
        except OSError:
            return None
        if sha256_bytes(raw) != files["trial.json"]:
            return None  # changed since its trial ended: not trusted
        try:
            info = json.loads(raw)
            return TrialRecord(trial, replica, int(info["round"]), float(info["target"]),
                               float(info["best_val_accuracy"]), int(info["hyper"]["batch_size"]),
                               int(info["hyper"]["kernel_size"]), ArchCode.from_json(info["arch"]),
                               str(info["signature"]), dict(files))
        except (ValueError, KeyError, TypeError, AiperfError):
            return None  # not a trial.json this aiperf wrote
