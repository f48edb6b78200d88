"""What the primary needs from an executor: start a replica, see whether it still runs, stop it.

An executor knows nothing of the search. It runs one command per replica (`aiperf replica
--run-dir DIR --replica-id I`), with the replica's stdout and stderr appended to
replicas/<I>/replica.log, and reports how the process ended. Whether a replica *finished* or
*crashed* is the primary's call, made from the replica's own event log.
"""

from __future__ import annotations

import abc
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# A replica answers it by writing every thread's Python stack to its stderr (replica.log): the
# primary sends it to a stalled replica before stopping it, so that the stall can be diagnosed.
STACKS_SIGNAL = signal.SIGUSR1
LOG_TAIL_LINES = 40  # enough for a crash's message and the stack faulthandler writes
LOG_TAIL_CHARS = 400  # per line: a runaway line must not bloat the primary log


@dataclass(frozen=True)
class ReplicaCommand:
    """One launch of one replica: the command, its extra environment and where its output goes."""

    replica: int
    attempt: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    nodes: int = 1  # the nodes the replica spans: the executor starts argv on each (node_argv)
    # The same token on every node of this launch (replica_nodes.LAUNCH_ENV): the nodes of one
    # launch meet in their own folder, never in a previous launch's.
    launch: str = field(default_factory=lambda: secrets.token_hex(6))

    def node_argv(self, node_rank: int) -> list[str]:
        """What node `node_rank` of the replica runs: the leader the replica's command, the others
        the same with --node-rank."""
        return list(self.argv) if node_rank == 0 else [*self.argv, "--node-rank", str(node_rank)]

    def node_env(self, replicas_per_node: int = 1) -> dict[str, str]:
        """The variables every executor sets on a replica's node process: the launch token, and how
        many replicas share the node (each CPU replica then counts its share of the node's RAM)."""
        from aiperf_core.backend import REPLICAS_PER_NODE_ENV
        from aiperf_core.replica_nodes import LAUNCH_ENV

        return {**self.env, LAUNCH_ENV: self.launch, REPLICAS_PER_NODE_ENV: str(replicas_per_node)}


@dataclass(frozen=True)
class ProcessEnd:
    """How a replica's process (or job) ended, as far as the executor can tell."""

    success: bool  # exit code 0 / SLURM state COMPLETED
    description: str  # "exit code 1", "killed by signal 9 (SIGKILL)", "SLURM state OUT_OF_MEMORY"
    exit_code: int | None = None
    signal: int | None = None


class ReplicaHandle(abc.ABC):
    """A launched replica."""

    def __init__(self, command: ReplicaCommand, job: str):
        self.command = command
        self.job = job  # pid or SLURM job id, as the primary log records it

    @property
    def replica(self) -> int:
        return self.command.replica

    @property
    def attempt(self) -> int:
        return self.command.attempt

    @abc.abstractmethod
    def poll(self) -> ProcessEnd | None:
        """None while the replica is queued or running; how it ended once it has."""

    @abc.abstractmethod
    def started(self) -> bool:
        """Whether the replica's process runs (a queued SLURM job has not started yet)."""

    def exited(self) -> bool:
        """Whether the replica's process is known to have ended without asking a batch system (False
        where only a query would tell): the primary looks between its polls, so that a run's end (and
        its score's time) is not a poll interval late."""
        return False


class Executor(abc.ABC):
    name: str = ""
    poll_interval_s: float = 1.0  # how often the primary asks poll()
    # The image every replica's command runs in (workflow.container.ContainerSpec; launch() wraps the
    # command with container.launch_command), None on the host. `aiperf run` sets it.
    container = None

    @classmethod
    def preflight(cls) -> None:
        """Raise AiperfError, naming the option, when this executor cannot start anything here."""

    @classmethod
    def machine_nodes(cls, watch) -> int:
        """The nodes of the machine this executor places replicas on (`watch`: the run's
        WatchSettings); what the policy item nodes_per_replica's `auto` is resolved by. One for an
        executor that starts every replica on this node."""
        return 1

    def refresh(self, handles: list[ReplicaHandle]) -> None:
        """Called once per poll round before poll() on each handle; batch queries go here."""

    @abc.abstractmethod
    def launch(self, command: ReplicaCommand) -> ReplicaHandle: ...

    @abc.abstractmethod
    def stop(self, handles: list[ReplicaHandle], grace_s: float) -> None:
        """Ask the replicas to end (SIGTERM), and force them (SIGKILL, scancel) after grace_s."""

    def job_log_tail(self, handle: ReplicaHandle) -> list[str]:
        """The last lines of what the executor's own job wrapper wrote about an ended replica (a
        batch system's messages: out of memory, time limit, node failure), apart from replica.log."""
        return []

    def request_stacks(self, handle: ReplicaHandle) -> bool:
        """Ask a running replica to write every thread's Python stack to its replica.log (before a
        stalled one is stopped); True if asked. Executors that cannot reach the process say False."""
        return False

    def adopt(self, command: ReplicaCommand, job: str) -> ReplicaHandle | None:
        """A handle on a replica an earlier primary of this run launched (job as logged) if it still
        runs and this executor can watch it from here; None otherwise (then end_leftover)."""
        return None

    @abc.abstractmethod
    def end_leftover(self, replica: int, job: str) -> None:
        """Make sure a replica launched by an earlier primary of this run (job as logged) no longer
        runs, before --resume launches it again: two writers of one event log would corrupt it."""

    def end_strays(self, keep: set[str]) -> None:
        """On --resume, end every job of this run but `keep` (the adopted ones), logged or not: a
        primary killed between submitting a job and logging it leaves one nobody knows of."""


class NodeProcessesHandle(ReplicaHandle):
    """A replica launched as one process per node, each in a session of its own: the first node's
    process is the replica's, and the others end with it (they leave on their leader's stop file,
    which a crashed leader did not write)."""

    def __init__(self, command: ReplicaCommand, processes: list[subprocess.Popen]):
        super().__init__(command, str(processes[0].pid))
        self.processes = processes

    @property
    def process(self) -> subprocess.Popen:
        return self.processes[0]

    def poll(self) -> ProcessEnd | None:
        code = self.process.poll()
        if code is None:
            return None
        for follower in self.processes[1:]:
            if follower.poll() is None:
                signal_group(follower.pid, signal.SIGTERM)
        return describe_exit_code(code)

    def started(self) -> bool:
        return True

    def exited(self) -> bool:
        return self.process.poll() is not None


def end_processes(handles: list[ReplicaHandle], grace_s: float) -> None:
    """SIGTERM to every running node process of the handles' replicas (their sessions), SIGKILL to
    those still running after grace_s."""
    stop_processes([p for h in handles if isinstance(h, NodeProcessesHandle) for p in h.processes], grace_s)


def stop_processes(processes: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM to each running process's session, SIGKILL to those still running after grace_s."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(process.pid, signal.SIGKILL)
            process.wait()


def signal_group(pid: int, sig: int) -> None:
    """Signal a process's group (it leads its own session), so its helpers go too."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def log_tail(path: Path, lines: int = LOG_TAIL_LINES, since: int = 0) -> list[str]:
    """The last lines of a log written after byte `since` (where a replica's attempt began), each
    cut at LOG_TAIL_CHARS; [] when there is no such log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(min(since, end), end - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line[:LOG_TAIL_CHARS] for line in text.splitlines()[-lines:]]


def node_log_path(replica_log: Path, node: int) -> Path:
    """Where node `node` (> 0) of a replica writes its output: beside its leader's replica.log."""
    return Path(replica_log).with_name(f"node-{node}.log")


def describe_exit_code(code: int) -> ProcessEnd:
    """A subprocess return code in words: negative codes are signals."""
    if code == 0:
        return ProcessEnd(True, "exit code 0", exit_code=0)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return ProcessEnd(False, f"killed by signal {-code} ({name})", signal=-code)
    return ProcessEnd(False, f"exit code {code}", exit_code=code)


def replica_argv(run_dir: Path, replica: int) -> list[str]:
    """The command every executor runs: this Python, this aiperf, the same run directory. Unbuffered
    (-u), so that what a replica printed last is in replica.log even when it dies by a signal."""
    return aiperf_argv("replica", "--run-dir", str(run_dir), "--replica-id", str(replica))


def aiperf_argv(*words: str) -> list[str]:
    """`aiperf WORDS...` as this Python runs it (unbuffered), for a process started on this host or,
    through a launcher, on another with the same paths."""
    return [sys.executable, "-u", "-m", "aiperf_core", *words]
