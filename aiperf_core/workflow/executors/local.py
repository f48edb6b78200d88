"""The local executor: replica processes on this machine, the devices partitioned between them.

Layout: with accelerators, the default is scale-up (one replica with every device); `--replicas N`
splits them evenly (scale-out: `--replicas` equal to the device count gives one device each).
Without accelerators one CPU replica runs by default. Each replica sees only its own devices
(CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES) and gets cores // replicas threads
(OMP_NUM_THREADS, unless the user set it) so that replicas do not oversubscribe the CPU.

Replicas die with the primary (PR_SET_PDEATHSIG): a primary killed by SIGKILL leaves no replica
writing to the run directory, so `--resume` can start them again without two writers per log.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from aiperf_core.backend import CPU_DEVICES_ENV
from aiperf_core.errors import AiperfError
from aiperf_core.replica_nodes import NODE_ADDR_ENV
from aiperf_core.workflow.container import launch_command
from aiperf_core.workflow.executors.base import (STACKS_SIGNAL, Executor, NodeProcessesHandle, ReplicaCommand,
                                                 ReplicaHandle, end_processes, node_log_path, signal_group)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class LocalLayout:
    replicas: int
    devices_per_replica: int
    devices: list[list[str]]  # per replica: backend device names, ['cpu'] for a CPU replica
    threads_per_replica: int


def plan_layout(accelerators: list[str], replicas: int | None, devices_per_replica: int | None,
                cores: int | None = None, cpu_devices: int = 1) -> LocalLayout:
    """Partition this machine's accelerators (backend device names, e.g. 'cuda:1') between replicas.
    Without accelerators each replica trains on the CPU: as `cpu_devices` logical devices where the
    backend shows several (AIPERF_CPU_DEVICES, aiperf_core.backend.CPU_DEVICES_ENV, which the
    replicas inherit), else as one."""
    cores = cores or os.cpu_count() or 1
    if not accelerators:
        if devices_per_replica not in (None, cpu_devices):
            shown = (f"shows {cpu_devices} CPU devices ({CPU_DEVICES_ENV}={cpu_devices}), each replica trains on them "
                     f"all" if cpu_devices > 1 else "sees no accelerator here; a CPU replica uses the CPU")
            raise AiperfError(f"--devices-per-replica: {devices_per_replica} asked, but the backend {shown}")
        replicas = replicas or 1
        if replicas > cores:
            raise AiperfError(f"--replicas: {replicas} CPU replicas on {cores} cores would oversubscribe the CPU")
        devices = [f"cpu:{i}" for i in range(cpu_devices)] if cpu_devices > 1 else ["cpu"]
        return LocalLayout(replicas, cpu_devices, [devices] * replicas, max(1, cores // replicas))
    count = len(accelerators)
    if replicas is None and devices_per_replica is None:
        replicas, devices_per_replica = 1, count  # scale-up
    elif devices_per_replica is None:
        devices_per_replica = count // replicas
        if devices_per_replica == 0:
            raise AiperfError(f"--replicas: {replicas} replicas but only {count} accelerators here")
    elif replicas is None:
        replicas = count // devices_per_replica
        if replicas == 0:
            raise AiperfError(f"--devices-per-replica: {devices_per_replica} asked, only {count} accelerators here")
    if replicas * devices_per_replica > count:
        raise AiperfError(f"--replicas {replicas} x --devices-per-replica {devices_per_replica} needs "
                          f"{replicas * devices_per_replica} accelerators, this machine has {count}")
    devices = [accelerators[i * devices_per_replica:(i + 1) * devices_per_replica] for i in range(replicas)]
    return LocalLayout(replicas, devices_per_replica, devices, max(1, cores // replicas))


def replica_environment(devices: list[str], threads: int, parent: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that confine one replica to its devices and its share of the cores."""
    parent = dict(os.environ) if parent is None else parent
    env = {name: str(threads) for name in THREAD_VARIABLES if name not in parent}
    accelerators = [d for d in devices if not d.startswith("cpu")]
    if not accelerators:
        return env
    by_variable: dict[str, list[str]] = {}
    for device in accelerators:
        kind, _, index = device.partition(":")
        variable = "ASCEND_RT_VISIBLE_DEVICES" if kind in ("npu", "ascend") else "CUDA_VISIBLE_DEVICES"
        visible = [v for v in parent.get(variable, "").split(",") if v.strip()]
        # The backend numbers the devices it sees: if this process is already confined, map back.
        physical = visible[int(index)] if visible and index.isdigit() and int(index) < len(visible) else index or "0"
        by_variable.setdefault(variable, []).append(physical)
    env.update({variable: ",".join(ids) for variable, ids in by_variable.items()})
    return env


def node_share(env: dict[str, str], node: int, nodes: int) -> dict[str, str]:
    """One node's part of a replica's environment on this machine: its slice of the replica's
    accelerators, and its share of the replica's threads."""
    env = dict(env)
    for variable in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
        if variable in env:
            ids = env[variable].split(",")
            if len(ids) % nodes:
                raise AiperfError(f"--nodes-per-replica {nodes}: a replica's {len(ids)} accelerators do not divide "
                                  f"between its nodes")
            per = len(ids) // nodes
            env[variable] = ",".join(ids[node * per:(node + 1) * per])
    for variable in THREAD_VARIABLES:
        if variable in env:
            env[variable] = str(max(1, int(env[variable]) // nodes))
    return env


def _die_with_parent(parent_pid: int) -> None:
    """preexec_fn: the kernel SIGKILLs the replica when the primary dies, however it dies (Linux;
    elsewhere a replica outlives a killed primary, and --resume ends it by its pid)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the primary died before prctl took effect
        os._exit(1)


class LocalHandle(NodeProcessesHandle):
    """A replica's process, and on a replica across nodes its other nodes' processes."""


class LocalExecutor(Executor):
    name = "local"
    poll_interval_s = 0.5

    def __init__(self, run_dir: Path, environments: list[dict[str, str]]):
        self.run_dir = Path(run_dir)
        self.environments = environments  # per replica, from replica_environment()

    def launch(self, command: ReplicaCommand) -> LocalHandle:
        """The replica's process; on a replica across nodes, one process per node, each a node of
        its own that meets the others only over TCP (on this machine's loopback) and through the run
        directory, as nodes of a cluster do: no shared memory, pipe or queue between them."""
        processes = [self._start(command, node) for node in range(command.nodes)]
        return LocalHandle(command, processes)

    def _start(self, command: ReplicaCommand, node: int) -> subprocess.Popen:
        replica_env = dict(self.environments[command.replica])
        if command.nodes > 1:
            replica_env = node_share(replica_env, node, command.nodes)
            replica_env[NODE_ADDR_ENV] = "127.0.0.1"
        env = {**os.environ, **replica_env, **command.node_env(len(self.environments) * command.nodes)}
        argv, env = launch_command(self.container, command.node_argv(node), env)
        log_path = command.log_path or os.devnull
        if node > 0 and command.log_path is not None:
            log_path = node_log_path(command.log_path, node)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        parent = os.getpid()
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=lambda: _die_with_parent(parent))

    def stop(self, handles: list[ReplicaHandle], grace_s: float) -> None:
        end_processes(handles, grace_s)

    def request_stacks(self, handle: ReplicaHandle) -> bool:
        if not isinstance(handle, LocalHandle) or handle.process.poll() is not None:
            return False
        try:  # the replica process alone: its helpers (data loader workers) would die of the signal
            handle.process.send_signal(STACKS_SIGNAL)
        except ProcessLookupError:
            return False
        return True

    def end_leftover(self, replica: int, job: str) -> None:
        import psutil

        try:
            process = psutil.Process(int(job))
            cmdline = process.cmdline()
        except (ValueError, psutil.Error):
            return  # gone already
        # Only a replica of this very run: a recycled pid may belong to anything else.
        if "replica" not in cmdline or str(self.run_dir) not in cmdline or str(replica) not in cmdline:
            return
        signal_group(process.pid, signal.SIGKILL)
        try:
            process.wait(timeout=30)
        except psutil.Error:
            pass
