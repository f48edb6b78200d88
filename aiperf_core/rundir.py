"""The run directory: the one shared record of a benchmark run (layout in docs/run-directory.md).

Every file has exactly one writer. The primary writes run.json and primary/events.jsonl; replica I
writes only under replicas/I/ and trials/<its trial ids>/. Whole files are written atomically
(temporary file, then rename); event logs are append-only JSON lines, each flushed and fsynced
before the writer goes on, so a finished epoch survives any crash, SIGKILL included.

Each event line carries `seq` and `prev`, the SHA-256 of the previous line, so that an edited,
removed or reordered line is found by `aiperf score --verify`. A line torn by a crash mid-write
is the only damage a crash can do; readers ignore it and the next writer cuts it off.

One writer per file is enforced, not assumed: the primary holds a lease on the run
(primary/lease.json) and replica I one on its id (replicas/I/lease.json), see `Lease`. An event
log opened with a lease checks, before each line, that the lease is still its writer's.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from aiperf_core.atomic import write_bytes_atomic, write_text_atomic
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
    def primary_lease(self) -> Path:
        return self.primary_dir / "lease.json"

    @property
    def history_file(self) -> Path:
        """The published history: every usable trial, once, as the primary saw it end (docs/run-directory.md)."""
        return self.primary_dir / "history.jsonl"

    @property
    def progress_checkpoint(self) -> Path:
        """Where the primary leaves its live ledger's totals and log positions, for monitoring only:
        a new `aiperf metrics` or `aiperf watch` starts from it (scoring.progress; never the score)."""
        return self.primary_dir / "progress.json"

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

    def replica_lease(self, replica: int) -> Path:
        return self.replica_dir(replica) / "lease.json"

    def monitor_log(self, replica: int, node: int = 0) -> Path:
        """A replica's monitor.jsonl, written on its first node; node K > 0 of a replica across
        nodes writes monitor-node<K>.jsonl beside it."""
        return self.replica_dir(replica) / ("monitor.jsonl" if node == 0 else f"monitor-node{node}.jsonl")

    def monitor_logs(self, replica: int) -> list[Path]:
        """Every node's monitor log of a replica that exists, its first node's first."""
        folder = self.replica_dir(replica)
        nodes = sorted(folder.glob("monitor-node*.jsonl"), key=lambda p: int(p.stem[len("monitor-node"):] or 0)
                       if p.stem[len("monitor-node"):].isdigit() else 0)
        return [path for path in (self.monitor_log(replica), *nodes) if path.is_file()]

    def trial_dir(self, trial: str) -> Path:
        return self.root / "trials" / trial

    def replica_ids(self) -> list[int]:
        base = self.root / "replicas"
        if not base.is_dir():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.is_dir() and p.name.isdigit())

    # run.json ---------------------------------------------------------------------------------
    def write_run(self, run: dict[str, Any], new: bool = False) -> None:
        """Write run.json; with `new`, only if there is none yet (RunDirError otherwise): of two
        fresh runs started on one directory at once, exactly one gets it."""
        text = json.dumps({"schema_version": SCHEMA_VERSION, **run}, indent=2, sort_keys=True) + "\n"
        try:
            write_text_atomic(self.run_file, text, exclusive=new)
        except FileExistsError:
            raise RunDirError(f"{self.root}: already holds a run; continue it with --resume {self.root}") from None

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
    """One writer's append-only, hash-chained JSON-lines log. With a lease, each append first
    checks that the lease is still held by this process (LeaseLost otherwise): a writer that was
    frozen long enough for another to take over never appends after it."""

    def __init__(self, path: str | os.PathLike, clock: Clock = SYSTEM_CLOCK, lease: "Lease | None" = None):
        self.path = Path(path)
        self.clock = clock  # stamps events that bring no `time` of their own
        self.lease = lease
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
        if self.lease is not None:
            self.lease.verify()
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


class LogRewritten(Exception):
    """A log shrank or is another file now: it was replaced, not appended to. Whatever was read
    from it is stale."""


class LogTail:
    """Incremental reader of one append-only JSON-lines log: scoring, the live display and the
    shared history all read logs through it.

    Like read_events, it stops at the first torn or unparseable line; it re-reads from that
    line on the next call, so a line completed later (or cut off and rewritten by the writer's
    EventLog.open()) is read then. A call costs one path lookup (an open; the size comes from the
    open file), whatever the log holds: on NFS an open also revalidates the size that a stat may
    take from a stale attribute cache."""

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name  # relative to the run directory, for messages
        self.offset = 0  # bytes consumed: every line before it parsed
        self.lines = 0  # lines consumed
        self.damaged_line: int | None = None  # a complete line that is not a JSON object
        self.exists = False  # whether the log existed at the last read
        # The inode of what was read. Not the device number: a tail made by from_state may have
        # been written on another machine, and each NFS or Lustre client numbers its mounts.
        self._inode: int | None = None

    def state(self) -> dict[str, Any]:
        """Where this tail stands, as JSON-ready values (from_state continues from there)."""
        return {"offset": self.offset, "lines": self.lines, "damaged_line": self.damaged_line,
                "exists": self.exists, "inode": self._inode}

    @classmethod
    def from_state(cls, path: Path, name: str, state: dict[str, Any]) -> "LogTail":
        """A tail at `state`'s position. A log replaced since (another file, or shorter) raises
        LogRewritten at the first read, as it would for a tail that read it."""
        tail = cls(path, name)
        tail.offset, tail.lines = int(state["offset"]), int(state["lines"])
        if tail.offset < 0 or tail.lines < 0:
            raise ValueError(f"{name}: a negative position")
        damaged = state["damaged_line"]
        tail.damaged_line = None if damaged is None else int(damaged)
        tail.exists = bool(state["exists"])
        tail._inode = None if state["inode"] is None else int(state["inode"])
        return tail

    def read(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(1-based line number, event) for every complete line appended since the last call."""
        data = self._new_bytes()
        last = data.rfind(b"\n")
        if last < 0:
            return
        # Fast path: all complete lines as one JSON array, parsed in one call (a JSON line holds no
        # raw newline, so joining with commas is exact). Any damaged line: go line by line.
        try:
            events = json.loads(b"[" + data[:last].replace(b"\n", b",") + b"]")
        except ValueError:
            events = None
        if events is not None and all(type(event) is dict for event in events):
            first = self.lines + 1
            self.lines += len(events)
            self.offset += last + 1
            yield from enumerate(events, start=first)
            return
        start = 0
        loads = json.loads
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            try:
                event = loads(data[start:end])
            except ValueError:
                event = None
            if not isinstance(event, dict):
                # A whole line (newline-terminated) that does not parse is damage, not a crash
                # mid-write: nothing after it can be trusted, and the run cannot be scored whole.
                self.damaged_line = self.lines + 1
                break
            self.lines += 1
            self.offset += end + 1 - start
            start = end + 1
            yield self.lines, event

    def _new_bytes(self) -> bytes:
        """The bytes after `offset`; LogRewritten if the log is now shorter than that."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self.exists = False
            if self.offset:
                raise LogRewritten(str(self.path)) from None
            return b""
        try:
            self.exists = True
            status = os.fstat(fd)
            size = status.st_size
            if size < self.offset or (self._inode is not None and self.offset and status.st_ino != self._inode):
                raise LogRewritten(str(self.path))
            self._inode = status.st_ino
            chunks, position = [], self.offset
            while position < size:
                chunk = os.pread(fd, size - position, position)
                if not chunk:
                    break
                chunks.append(chunk)
                position += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


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


# --- leases: one owner per run and per replica id ----------------------------------------------

LEASE_RENEW_S = 15.0  # an owner rewrites its lease this often
LEASE_STALE_S = 90.0  # seen from another host, a lease not rewritten for this long is an abandoned one
LEASE_WAIT_POLL_S = 1.0

# --- how often a replica writes to the run directory on its own --------------------------------
# Every replica rewrites its heartbeat (an atomic write: 3 metadata calls on the shared filesystem)
# and, every third beat, its lease (4 calls). At a 5 s beat that is 0.87 calls/s a replica: 3,550/s
# at 4,096 replicas, more than the whole run's budget of 1,000/s (docs/performance.md, issue #23).
# So the beat slows down as replicas are added, keeping their own calls within REPLICA_CALLS_PER_S,
# to at most 30 s: half of the live display's freshness window (workflow/progress.py LIVE_FRESH_S)
# and far inside the primary's heartbeat timeout (10 min by default).
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_MAX_INTERVAL_S = 30.0
HEARTBEAT_CALLS = 3
LEASE_RENEW_CALLS = 4
BEATS_PER_LEASE_RENEWAL = 3
REPLICA_CALLS_PER_S = 600.0  # all replicas' heartbeats and lease renewals together, per second


@dataclass(frozen=True)
class ReplicaCadence:
    heartbeat_s: float
    lease_renew_s: float
    lease_stale_s: float  # as LEASE_STALE_S is to LEASE_RENEW_S: six renewals missed

    @property
    def calls_per_s(self) -> float:
        """One replica's metadata calls per second on the run directory from its beat and lease."""
        return (HEARTBEAT_CALLS + LEASE_RENEW_CALLS / BEATS_PER_LEASE_RENEWAL) / self.heartbeat_s


def replica_cadence(replicas: int) -> ReplicaCadence:
    """The heartbeat and lease intervals of every replica of a run of `replicas` replicas: 5 s,
    15 s and 90 s up to about 700 replicas, then slower in proportion, to 30 s, 90 s and 540 s."""
    per_beat = HEARTBEAT_CALLS + LEASE_RENEW_CALLS / BEATS_PER_LEASE_RENEWAL
    beat = min(HEARTBEAT_MAX_INTERVAL_S, max(HEARTBEAT_INTERVAL_S, max(replicas, 1) * per_beat / REPLICA_CALLS_PER_S))
    renew = beat * BEATS_PER_LEASE_RENEWAL
    return ReplicaCadence(beat, renew, renew * LEASE_STALE_S / LEASE_RENEW_S)


class LeaseHeld(RunDirError):
    """The lease belongs to another process that is, as far as can be told, alive."""

    def __init__(self, message: str, holder: dict[str, Any]):
        self.holder = holder
        super().__init__(message)


class LeaseLost(RunDirError):
    """The lease this process held was taken over: it must stop writing."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the host name alone names the machine
        return ""


def _process_started(pid: Any) -> float | None:
    """When process `pid` of this machine started (psutil's create_time, rounded to 10 ms, which
    is stable across calls), or None if it is gone or a zombie."""
    import psutil

    if isinstance(pid, bool) or not isinstance(pid, int):
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return round(process.create_time(), 2)
    except psutil.Error:
        return None


class Lease:
    """An exclusive, renewable claim: the primary's on its run, a replica's on its replica id.

    The claim is one JSON file (owner, host, boot id, pid, the process's start time, a random
    token, when it was acquired and last renewed). It must work on shared filesystems where fcntl
    locks do not, so it relies only on what NFS (v3+), Lustre, GPFS and BeeGFS do atomically: the
    file is created by link(2) from a complete temporary file, which fails when it exists (an
    exclusive open(2) where hard links are not supported), and renewed by rename(2) over itself.

    An existing lease is held while its owner lives. On the owner's own machine (same host name
    and boot id) its process decides: gone, a zombie, or another process under a reused pid, and
    the lease is taken over at once; alive, and it is held however old it is. From another machine
    only its age can tell: not renewed for `stale_s` seconds, it is taken over. A take-over first
    renames the file aside, so that of two contenders only one wins, and puts it back if what it
    moved was not the lease it judged (renewed or taken meanwhile). Node clocks must agree (NTP),
    as event times already require.
    """

    def __init__(self, path: str | os.PathLike, owner: str, stale_s: float = LEASE_STALE_S):
        self.path = Path(path)
        self.owner = owner  # "primary", "replica 3": what the file and the messages call its holder
        self.stale_s = float(stale_s)
        self.token = secrets.token_hex(8)
        self.held = False
        self.taken_over: dict[str, Any] | None = None  # the abandoned lease acquire() replaced, if any
        self._acquired: float | None = None
        self._me = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
                    "pid_started": _process_started(os.getpid())}

    # -- taking it --------------------------------------------------------------------------------
    def acquire(self, wait: bool = False) -> "Lease":
        """Hold the lease, taking over an abandoned one. LeaseHeld when its holder is alive.
        With wait, a lease of another host that is still fresh is watched until it goes stale
        (taken over then) or is renewed (LeaseHeld at once): at most stale_s plus a renewal."""
        give_up = time.time() + self.stale_s * (1 + LEASE_RENEW_S / LEASE_STALE_S)  # and one renewal
        watched: bytes | None = None
        for _ in range(1000):  # every round wins, takes an abandoned lease aside, or waits a second
            if self._create():
                self.held = True
                return self
            raw = self._read_raw()
            if raw is None:
                continue  # released in between
            holder, verdict = self._judge(raw)
            if verdict in ("mine", "gone", "stale"):
                if self._set_aside(raw):
                    self.taken_over = None if verdict == "mine" else {**(holder or {}), "verdict": verdict}
                continue
            if wait and verdict == "fresh" and (watched is None or watched == raw) and time.time() < give_up:
                watched = raw
                time.sleep(LEASE_WAIT_POLL_S)
                continue
            raise LeaseHeld(self._refusal(holder, verdict, renewed=watched is not None and watched != raw), holder or {})
        raise LeaseHeld(f"{self.path}: the lease changed hands too often to be taken; try again", {})

    def check(self) -> None:
        """LeaseHeld if someone else holds the lease and is alive; nothing is written."""
        raw = self._read_raw()
        if raw is None:
            return
        holder, verdict = self._judge(raw)
        if verdict in ("alive", "fresh"):
            raise LeaseHeld(self._refusal(holder, verdict), holder or {})

    # -- keeping and giving it back ---------------------------------------------------------------
    def renew(self) -> bool:
        """Rewrite the lease with the time now; False (and held becomes False) if it was taken over."""
        if not self.held:
            return False
        holder = _parse(self._read_raw())
        if holder is None or holder.get("token") != self.token:
            self.held = False
            return False
        write_text_atomic(self.path, self._record())
        return True

    def verify(self) -> None:
        """LeaseLost unless the lease file still carries this holder's token."""
        holder = _parse(self._read_raw())
        if not self.held or holder is None or holder.get("token") != self.token:
            self.held = False
            now_held = "" if holder is None or holder.get("token") == self.token else f"; it is now {_describe(holder)}"
            raise LeaseLost(f"{self.path}: this {self.owner} (pid {os.getpid()}) no longer holds its lease{now_held}")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = _parse(self._read_raw())
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    # -- the file ---------------------------------------------------------------------------------
    def _record(self) -> str:
        now = time.time()
        if self._acquired is None:
            self._acquired = now
        return json.dumps({"owner": self.owner, **self._me, "token": self.token, "acquired": self._acquired,
                           "renewed": now}) + "\n"

    def _read_raw(self) -> bytes | None:
        try:
            return self.path.read_bytes()
        except FileNotFoundError:
            return None

    def _create(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._acquired = None
        data = self._record().encode()
        fresh = self.path.with_name(f".{self.path.name}.{self.token}.new")
        write_bytes_atomic(fresh, data)
        try:
            os.link(fresh, self.path)
            return True
        except FileExistsError:
            # NFS may answer EEXIST to a retransmitted link that did succeed: the link count tells.
            return os.stat(fresh).st_nlink == 2
        except OSError:  # no hard links here: an exclusive create, written in place
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return True
        finally:
            fresh.unlink(missing_ok=True)

    def _judge(self, raw: bytes) -> tuple[dict[str, Any] | None, str]:
        """(holder, verdict): mine (this very process), gone (its process ended), stale (not renewed
        for stale_s, seen from another host), alive (its process runs here), fresh (recent, elsewhere)."""
        holder = _parse(raw)
        if holder is None:  # an exclusive create being written, or a damaged file: its age decides
            try:
                age = time.time() - os.stat(self.path).st_mtime
            except FileNotFoundError:
                return None, "gone"
            return None, "stale" if age > self.stale_s else "fresh"
        me = self._me
        if holder.get("host") == me["host"] and holder.get("boot_id") == me["boot_id"]:
            if holder.get("pid") == me["pid"] and holder.get("pid_started") == me["pid_started"]:
                return holder, "mine"
            started = _process_started(holder.get("pid"))
            return holder, "alive" if started is not None and started == holder.get("pid_started") else "gone"
        renewed = holder.get("renewed")
        if isinstance(renewed, bool) or not isinstance(renewed, (int, float)):
            return holder, "stale"
        return holder, "stale" if time.time() - renewed > self.stale_s else "fresh"

    def _set_aside(self, raw: bytes) -> bool:
        """Move the judged lease out of the way; False if another contender got there first."""
        aside = self.path.with_name(f".{self.path.name}.{self.token}.old")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            if aside.read_bytes() == raw:
                return True
            try:  # a lease renewed or taken meanwhile: back where it was, unless a newer one exists
                os.link(aside, self.path)
            except FileExistsError:
                pass
            except OSError:
                if not self.path.exists():
                    os.rename(aside, self.path)
            return False
        finally:
            aside.unlink(missing_ok=True)

    def _refusal(self, holder: dict[str, Any] | None, verdict: str, renewed: bool = False) -> str:
        if holder is None:
            return f"{self.path}: being written by another process just now"
        if verdict == "alive":
            return f"in use by {_describe(holder)}, which is running"
        age = time.time() - float(holder.get("renewed") or 0.0)
        how = "renewed while this process waited" if renewed else f"renewed {age:.0f} s ago"
        return (f"in use by {_describe(holder)} (lease {how}; from another host it is taken over once "
                f"{self.stale_s:.0f} s old)")


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: dict[str, Any]) -> str:
    return f"the {holder.get('owner', '?')} on host {holder.get('host', '?')}, pid {holder.get('pid', '?')}"
