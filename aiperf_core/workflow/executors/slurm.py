"""The SLURM executor: one batch job per replica, submitted through submitit.

The run directory must be on a filesystem that the submitting host and every compute node mount
at the same path: replicas read run.json and each other's trials from it, and the primary
watches their event logs and heartbeats there. submitit's own files (pickled job functions,
sbatch scripts, its logs) go to RUN_DIR/executor, created mode 0700; no replica reads them.

Job state comes from squeue, never from sacct: without slurmdbd sacct fails and submitit reports
every job as UNKNOWN. A job that squeue no longer lists, or lists in a final state, has ended;
a running job whose replica stops writing its heartbeat is the primary's to call lost.
"""

from __future__ import annotations

import getpass
import importlib.util
import math
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping

from aiperf_core.errors import AiperfError
from aiperf_core.workflow.container import launch_command
from aiperf_core.replica_nodes import NODE_ADDR_ENV
from aiperf_core.workflow.executors.base import (Executor, ProcessEnd, ReplicaCommand, ReplicaHandle, log_tail,
                                                 node_log_path)

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                 "STAGE_OUT", "SIGNALING", "RESV_DEL_HOLD", "REQUEUE_FED", "REQUEUE_HOLD"}
STARTED_STATES = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "SUSPENDED"}
COMMAND_TIMEOUT_S = 30
MISSING_ROUNDS_FOR_GONE = 2  # a job must be missing from two squeue answers in a row to count as gone


class ReplicaProcessFailed(RuntimeError):
    """Raised inside the job so that SLURM records it as FAILED."""


def run_replica_process(argv: list[str], env: Mapping[str, str], log_path: str, nodes: int = 1) -> int:
    """The job function submitit runs on each node of the replica's job (one task per node): the
    replica, output to replica.log on its first node, to node-<K>.log beside it on node K, which
    runs the replica's command with --node-rank K (ReplicaCommand.node_argv)."""
    full_env = {**os.environ, **env}
    if "OMP_NUM_THREADS" not in full_env and full_env.get("SLURM_CPUS_PER_TASK"):
        full_env["OMP_NUM_THREADS"] = full_env["SLURM_CPUS_PER_TASK"]
    if nodes > 1:
        node = int(full_env.get("SLURM_NODEID", "0"))
        if node:
            argv = [*argv, "--node-rank", str(node)]
            log_path = str(node_log_path(Path(log_path), node))
        full_env.setdefault(NODE_ADDR_ENV, node_addr_of(full_env.get("SLURMD_NODENAME", "")) or "")
        if not full_env[NODE_ADDR_ENV]:
            del full_env[NODE_ADDR_ENV]  # the host name's own address, then (replica_nodes.node_address)
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        code = subprocess.call(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    if code != 0:
        raise ReplicaProcessFailed(f"replica exited with code {code}")
    return code


def node_addr_of(node_name: str) -> str | None:
    """The address SLURM reaches a node at (its NodeAddr), which the replica's other nodes reach it
    at too; None where scontrol does not say."""
    if not node_name:
        return None
    try:
        answer = subprocess.run(["scontrol", "show", "node", "--oneliner", node_name], capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field_ in answer.stdout.split():
        key, _, value = field_.partition("=")
        if key == "NodeAddr" and value:
            return value
    return None


def parse_extra_args(extra: str | list[str] | None) -> dict[str, Any]:
    """sbatch long options ('--qos=high', '--exclusive', '--constraint a100') as submitit parameters."""
    tokens = shlex.split(extra) if isinstance(extra, str) else [t for part in (extra or []) for t in shlex.split(part)]
    parameters: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) < 3:
            raise AiperfError(f"--slurm-extra: '{token}': give sbatch long options, e.g. --qos=high")
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                value, i = tokens[i + 1], i + 1
            else:
                value = True
        parameters[key] = value
        i += 1
    return parameters


class SlurmHandle(ReplicaHandle):
    def __init__(self, command: ReplicaCommand, job: str):
        super().__init__(command, job)
        self.state: str | None = "PENDING"
        self.reason = ""
        self.missing_rounds = 0
        self.end: ProcessEnd | None = None

    def poll(self) -> ProcessEnd | None:
        return self.end

    def started(self) -> bool:
        return self.state in STARTED_STATES

    def observe(self, state: str | None, reason: str) -> None:
        """Fold one squeue answer (None: not listed) into this job's state."""
        if self.end is not None:
            return
        if state is None:
            self.missing_rounds += 1
            if self.missing_rounds >= MISSING_ROUNDS_FOR_GONE:
                self.end = ProcessEnd(False, f"SLURM job {self.job} left the queue (last state {self.state_seen})")
                self.state = None
            return
        self.missing_rounds = 0
        self.state, self.reason = state, reason
        if state not in ACTIVE_STATES:
            detail = f" ({reason})" if reason and reason != "None" else ""
            self.end = ProcessEnd(state == "COMPLETED", f"SLURM state {state}{detail}")

    @property
    def state_seen(self) -> str:
        return self.state or "unknown"


class SlurmExecutor(Executor):
    name = "slurm"
    poll_interval_s = 5.0

    def __init__(self, run_dir: Path, run_id: str, time_budget_s: float, partition: str | None = None,
                 account: str | None = None, time_limit_s: float | None = None, gpus_per_node: int = 0,
                 cpus_per_task: int | None = None, extra_args: str | list[str] | None = None):
        self.run_dir = Path(run_dir)
        self.folder = self.run_dir / "executor"
        self.run_id = run_id
        minutes = math.ceil((time_limit_s or time_budget_s + 600) / 60)
        self.parameters: dict[str, Any] = {"time": minutes, "nodes": 1, "ntasks_per_node": 1,
                                           "additional_parameters": parse_extra_args(extra_args)}
        for key, value in (("partition", partition), ("account", account), ("cpus_per_task", cpus_per_task)):
            if value:
                self.parameters[key] = value
        if gpus_per_node:
            self.parameters["gpus_per_node"] = gpus_per_node
        self._submitit = None

    # --- preflight ------------------------------------------------------------------------
    @classmethod
    def machine_nodes(cls, watch) -> int:
        """The nodes of the run's partition (the default one when none is given), by sinfo."""
        partition = watch.slurm.get("partition")
        argv = ["sinfo", "--noheader", "--format", "%D", *(["--partition", partition] if partition else [])]
        what = f"partition {partition}" if partition else "the default partition"
        try:
            answer = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AiperfError(f"--nodes-per-replica auto: could not count the nodes of {what} with sinfo ({exc}); "
                              f"give --nodes-per-replica N") from None
        counts = [line.strip() for line in answer.stdout.splitlines() if line.strip()]
        if answer.returncode != 0 or not counts or not all(c.isdigit() for c in counts):
            first = (answer.stderr.strip().splitlines() or [f"exit code {answer.returncode}"])[0]
            raise AiperfError(f"--nodes-per-replica auto: sinfo did not count the nodes of {what} ({first}); "
                              f"give --nodes-per-replica N")
        return sum(int(c) for c in counts)

    @classmethod
    def preflight(cls) -> None:
        for tool in ("sbatch", "squeue", "scancel", "srun"):
            if shutil.which(tool) is None:
                raise AiperfError(f"--executor slurm: '{tool}' is not on PATH (is this a SLURM submit host?)")
        if importlib.util.find_spec("submitit") is None:
            raise AiperfError("--executor slurm needs submitit: pip install 'aiperf[slurm]'")
        try:
            answer = subprocess.run(["squeue", "--noheader", "--user", getpass.getuser(), "--format", "%i"],
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AiperfError(f"--executor slurm: the SLURM controller did not answer squeue within "
                              f"{COMMAND_TIMEOUT_S} s") from None
        if answer.returncode != 0:
            first = (answer.stderr.strip().splitlines() or [f"exit code {answer.returncode}"])[0]
            raise AiperfError(f"--executor slurm: the SLURM controller does not answer: {first}")

    # --- launching ------------------------------------------------------------------------
    def _executor(self):
        if self._submitit is None:
            import submitit

            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.folder, 0o700)  # mkdir's mode is masked by the umask
            executor = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=0)
            executor.update_parameters(**self.parameters)
            self._submitit = executor
        return self._submitit

    def launch(self, command: ReplicaCommand) -> SlurmHandle:
        executor = self._executor()
        executor.update_parameters(job_name=self.job_name(command.replica))
        # One job of the replica's nodes, one task each (slurm's "nodes" and "ntasks_per_node").
        executor.update_parameters(nodes=command.nodes)
        # Each node is its replica's alone: a job's nodes are allocated to it.
        argv, env = launch_command(self.container, command.argv, command.node_env(replicas_per_node=1))
        try:
            job = executor.submit(run_replica_process, argv, env, str(command.log_path), command.nodes)
        except Exception as exc:  # sbatch's refusal reaches the user as one line
            message = str(exc).strip().splitlines()
            raise AiperfError(f"--executor slurm: sbatch refused replica {command.replica}: "
                              f"{message[-1] if message else type(exc).__name__}") from None
        return SlurmHandle(command, str(job.job_id))

    # --- watching -------------------------------------------------------------------------
    def queue_states(self) -> dict[str, tuple[str, str]] | None:
        """job id -> (state, reason) of this user's jobs, or None if squeue did not answer."""
        try:
            answer = subprocess.run(["squeue", "--noheader", "--states", "all", "--user", getpass.getuser(),
                                     "--format", "%i|%T|%r"], capture_output=True, text=True,
                                    timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
        if answer.returncode != 0:
            return None
        states = {}
        for line in answer.stdout.splitlines():
            job, _, rest = line.strip().partition("|")
            state, _, reason = rest.partition("|")
            if job:
                states[job] = (state.split()[0] if state else "UNKNOWN", reason)
        return states

    def refresh(self, handles: list[ReplicaHandle]) -> None:
        handles = [h for h in handles if isinstance(h, SlurmHandle) and h.end is None]
        if not handles:
            return
        states = self.queue_states()
        if states is None:  # controller busy or down: no news is not bad news; heartbeats still count
            return
        for handle in handles:
            state, reason = states.get(handle.job, (None, ""))
            handle.observe(state, reason)

    # --- stopping -------------------------------------------------------------------------
    def stop(self, handles: list[ReplicaHandle], grace_s: float) -> None:
        jobs = [h.job for h in handles if h.poll() is None]
        if not jobs:
            return
        _scancel(["--signal=TERM", *jobs])
        self._wait_gone(jobs, grace_s)
        _scancel(jobs)
        self._wait_gone(jobs, 60)
        self.refresh(handles)

    def job_log_tail(self, handle: ReplicaHandle) -> list[str]:
        """The job's own stderr, every task's (submitit's `<job>_<task>_log.err` in executor/, one
        task per node): where slurmstepd says that it killed the job (out of memory, time limit,
        cancelled, a node failed) and submitit why the job function failed; the replica's own output
        is in replica.log and, on its other nodes, node-<K>.log."""
        tails = []
        for task in range(handle.command.nodes):
            lines = log_tail(self.folder / f"{handle.job}_{task}_log.err")
            tails += [f"task {task}: {line}" for line in lines] if handle.command.nodes > 1 else lines
        return tails

    def job_name(self, replica: int) -> str:
        """Names a replica's jobs by run and replica, so that a resume finds even a job whose
        submission the killed primary never got to log."""
        return f"aiperf-{self.run_id}-r{replica}"

    def adopt(self, command: ReplicaCommand, job: str) -> SlurmHandle | None:
        """A job that outlived its primary keeps running under the new one: no training is lost."""
        states = self.queue_states()
        if states is None or states.get(job, ("", ""))[0] not in ACTIVE_STATES:
            return None
        handle = SlurmHandle(command, job)
        handle.observe(*states[job])
        return handle

    def end_leftover(self, replica: int, job: str) -> None:
        _scancel([job])
        self._wait_gone([job], 120)

    def end_strays(self, keep: set[str]) -> None:
        prefix = f"aiperf-{self.run_id}-r"
        strays = sorted(j for j, name in self.queue_names().items() if name.startswith(prefix) and j not in keep)
        if strays:
            _scancel(strays)
            self._wait_gone(strays, 120)

    def queue_names(self) -> dict[str, str]:
        """job id -> job name of this user's active jobs ({} if squeue does not answer)."""
        try:
            answer = subprocess.run(["squeue", "--noheader", "--user", getpass.getuser(), "--format", "%i|%j"],
                                    capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {}
        pairs = (line.strip().partition("|") for line in answer.stdout.splitlines())
        return {job: name for job, _, name in pairs if job} if answer.returncode == 0 else {}

    def _wait_gone(self, jobs: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.queue_states()
            if states is not None and not any(states.get(j, ("", ""))[0] in ACTIVE_STATES for j in jobs):
                return
            time.sleep(1)


def _scancel(arguments: list[str]) -> None:
    try:
        subprocess.run(["scancel", *arguments], capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
