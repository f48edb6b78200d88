"""The run directory: the one shared record of a benchmark run (layout in docs/run-directory.md).

Every file has exactly one writer. The primary writes run.json and primary/events.jsonl; replica I
writes only under replicas/I/ and trials/<its trial ids>/. Whole files are written atomically
(temporary file, then rename); event logs are append-only JSON lines, each flushed and fsynced
before the writer goes on, so a finished epoch survives any crash, SIGKILL included.

Each event line carries `seq` and `prev`, the SHA-256 of the previous line, so that an edited,
removed or reordered line is found by `aiperf score --verify`. A line torn by a crash mid-write
is the only damage a crash can do; readers ignore it and the next writer cuts it off.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from aiperf_core.atomic import write_text_atomic
from aiperf_core.clock import SYSTEM_CLOCK, Clock
from aiperf_core.errors import AiperfError

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
GENESIS = "0" * 64  # `prev` of a log's first line


class RunDirError(AiperfError):
    """A run directory is missing, malformed or tampered with."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def trial_id(replica: int, seq: int) -> str:
    """Trial ids sort by replica, then by the replica's own sequence number."""
    return f"r{replica:04d}-t{seq:05d}"


@dataclass(frozen=True)
class RunDir:
    root: Path
    clock: Clock = field(default=SYSTEM_CLOCK, compare=False, repr=False)  # stamps heartbeats

    def __init__(self, root: str | os.PathLike, clock: Clock = SYSTEM_CLOCK):
        object.__setattr__(self, "root", Path(root))
        object.__setattr__(self, "clock", clock)

    @property
    def run_file(self) -> Path:
        return self.root / RUN_FILE

    @property
    def primary_dir(self) -> Path:
        return self.root / "primary"

    @property
    def primary_log(self) -> Path:
        return self.primary_dir / "events.jsonl"

    @property
    def executor_dir(self) -> Path:
        """The executor's own job files (submitit pickles): created 0700, never read by a replica."""
        return self.root / "executor"

    def replica_dir(self, replica: int) -> Path:
        return self.root / "replicas" / str(replica)

    def replica_log(self, replica: int) -> Path:
        return self.replica_dir(replica) / "events.jsonl"

    def heartbeat_file(self, replica: int) -> Path:
        return self.replica_dir(replica) / "heartbeat.json"

    def monitor_log(self, replica: int) -> Path:
        return self.replica_dir(replica) / "monitor.jsonl"

    def trial_dir(self, trial: str) -> Path:
        return self.root / "trials" / trial

    def replica_ids(self) -> list[int]:
        base = self.root / "replicas"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.is_dir() and p.name.isdigit())

    # run.json ---------------------------------------------------------------------------------
    def write_run(self, run: dict[str, Any]) -> None:
        write_text_atomic(self.run_file, json.dumps({"schema_version": SCHEMA_VERSION, **run}, indent=2,
                                                    sort_keys=True) + "\n")

    def read_run(self) -> dict[str, Any]:
        try:
            run = json.loads(self.run_file.read_text())
        except FileNotFoundError:
            raise RunDirError(f"{self.root}: not a run directory (no {RUN_FILE})") from None
        except (OSError, ValueError) as exc:
            raise RunDirError(f"{self.run_file}: unreadable: {exc}") from None
        if run.get("schema_version") != SCHEMA_VERSION:
            raise RunDirError(f"{self.run_file}: schema_version {run.get('schema_version')!r}, "
                              f"this aiperf reads {SCHEMA_VERSION}")
        return run

    # heartbeats -------------------------------------------------------------------------------
    def write_heartbeat(self, replica: int, **state: Any) -> None:
        beat = {"time": self.clock.time(), "pid": os.getpid(), "host": socket.gethostname(), **state}
        write_text_atomic(self.heartbeat_file(replica), json.dumps(beat) + "\n")

    def read_heartbeat(self, replica: int) -> dict[str, Any] | None:
        try:
            return json.loads(self.heartbeat_file(replica).read_text())
        except (OSError, ValueError):
            return None


class EventLog:
    """One writer's append-only, hash-chained JSON-lines log."""

    def __init__(self, path: str | os.PathLike, clock: Clock = SYSTEM_CLOCK):
        self.path = Path(path)
        self.clock = clock  # stamps events that bring no `time` of their own
        self._seq = 0
        self._prev = GENESIS
        self._file = None

    def open(self) -> "EventLog":
        """Open for appending: cut off a line torn by a crash and continue the chain."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        good_bytes = 0
        for line, record, end in _complete_lines(self.path):
            self._seq = record["seq"] + 1
            self._prev = sha256_bytes(line)
            good_bytes = end
        self._file = open(self.path, "ab")
        if self._file.tell() != good_bytes:
            self._file.truncate(good_bytes)
            self._file.seek(good_bytes)
        return self

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Write one event durably and return it as written. `time` defaults to now."""
        if self._file is None:
            self.open()
        stamp = fields.pop("time", None)
        record = {"event": event, "time": self.clock.time() if stamp is None else stamp, **fields,
                  "seq": self._seq, "prev": self._prev}
        line = json.dumps(record, sort_keys=True, allow_nan=False).encode()
        self._file.write(line + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._seq += 1
        self._prev = sha256_bytes(line)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "EventLog":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _complete_lines(path: Path) -> Iterator[tuple[bytes, dict[str, Any], int]]:
    """(line without newline, its record, byte offset after it) for every newline-terminated,
    parseable line.
    Stops at the first torn or unparseable line: nothing after it can be trusted to chain."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    offset = 0
    while True:
        end = data.find(b"\n", offset)
        if end < 0:
            return
        line = data[offset:end]
        try:
            record = json.loads(line)
        except ValueError:
            return
        offset = end + 1
        yield line, record, offset


def read_events(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete event of a log, in order; a missing log reads as empty."""
    return [record for _, record, _ in _complete_lines(Path(path))]


@dataclass(frozen=True)
class ChainProblem:
    line: int  # 1-based line number in the file
    message: str


def verify_chain(path: str | os.PathLike) -> list[ChainProblem]:
    """Every break in a log's hash chain: an edited, inserted, removed or reordered line, or a
    damaged line anywhere but at the very end (a torn last line is what a crash leaves)."""
    path = Path(path)
    problems: list[ChainProblem] = []
    try:
        raw_lines = path.read_bytes().split(b"\n")
    except FileNotFoundError:
        return [ChainProblem(0, f"{path}: missing")]
    torn_tail = raw_lines.pop()  # b"" when the file ends with a newline
    prev, expected_seq = GENESIS, 0
    for number, line in enumerate(raw_lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            problems.append(ChainProblem(number, "not valid JSON"))
            prev = sha256_bytes(line)
            continue
        if record.get("prev") != prev:
            problems.append(ChainProblem(number, "hash chain broken: this line or the one before was changed"))
        if record.get("seq") != expected_seq:
            problems.append(ChainProblem(number, f"seq {record.get('seq')!r}, expected {expected_seq}"))
        expected_seq = (record.get("seq") if isinstance(record.get("seq"), int) else expected_seq) + 1
        prev = sha256_bytes(line)
    del torn_tail  # a torn last line is a crash, not tampering
    return problems


def chain_head(path: str | os.PathLike) -> str:
    """SHA-256 of a log's last complete line: recorded elsewhere, it pins the log's whole content."""
    head = GENESIS
    for line, _, _ in _complete_lines(Path(path)):
        head = sha256_bytes(line)
    return head
