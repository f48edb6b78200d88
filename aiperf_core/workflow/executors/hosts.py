"""The hosts executor: replicas on the hosts of a hostfile, each node started by a launcher.

For clusters without SLURM, as many GPU clouds run: the hostfile is DeepSpeed's format, one host a
line with its device slots (`node7 slots=8`; `#` starts a comment). Replica r takes the next
`nodes_per_replica` hosts in the file's order; a host's slots are its devices (a CPU host: one).
Each node is started by the launcher template with `{host}` replaced (default `ssh -o
BatchMode=yes {host}`), followed by the node's command as shell-quoted words, which the launcher
runs on the host as ssh does (joined into one shell line): the same Python and aiperf at the
same paths, the run directory on a filesystem every host mounts. The launcher's output (the
node's stdout and stderr, which ssh carries back) goes to replica.log and node-<K>.log.

The launcher process is what this executor watches: a replica has ended when its first node's
launcher has. Stopping signals the launchers; the replicas themselves stop at the run's stop file
and deadline, and a follower leaves when its leader does (aiperf_core.replica_nodes), so nothing
is left running on a host whose launcher was killed before its command saw the signal.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aiperf_core.errors import AiperfError
from aiperf_core.replica_nodes import HOSTS_ENV
from aiperf_core.workflow.container import launch_command
from aiperf_core.workflow.executors.base import (Executor, NodeProcessesHandle, ReplicaCommand, ReplicaHandle,
                                                 end_processes, node_log_path)

DEFAULT_LAUNCHER = "ssh -o BatchMode=yes {host}"
_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:-]+)(?:\s+slots=(?P<slots>\d+))?\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str | os.PathLike) -> list[Host]:
    """The hosts of a DeepSpeed-style hostfile, in order; AiperfError naming the line at fault."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AiperfError(f"--hostfile {path}: {exc.strerror or exc}") from None
    hosts: list[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match is None:
            raise AiperfError(f"--hostfile {path}: line {number}: {raw.strip()!r} is not 'HOST slots=K'")
        slots = int(match["slots"] or 1)
        if slots < 1:
            raise AiperfError(f"--hostfile {path}: line {number}: slots must be at least 1")
        if any(h.name == match["host"] for h in hosts):
            raise AiperfError(f"--hostfile {path}: line {number}: host {match['host']} is listed twice")
        hosts.append(Host(match["host"], slots))
    if not hosts:
        raise AiperfError(f"--hostfile {path}: names no host")
    return hosts


def check_launcher(template: str) -> str:
    if "{host}" not in template:
        raise AiperfError(f"--launcher {template!r}: give a command with {{host}} where the host goes, "
                          f"e.g. {DEFAULT_LAUNCHER!r}")
    try:
        shlex.split(template.replace("{host}", "h"))
    except ValueError as exc:
        raise AiperfError(f"--launcher {template!r}: {exc}") from None
    return template


def launcher_argv(template: str, host: str, argv: list[str], env: dict[str, str]) -> list[str]:
    """The argv, run here, that starts `argv` on `host` through the launcher template, with `env` set
    by `env` on the far side (ssh does not carry the variables)."""
    remote = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *argv]
    launcher = [part.replace("{host}", host) for part in shlex.split(template)]
    # A launcher joins the words after it into one shell line on the host, as ssh does: each
    # word is quoted so that it arrives as given.
    return [*launcher, *(shlex.quote(part) for part in remote)]


def hostfile_hosts(watch) -> list[Host]:
    """The hosts of the run's --hostfile (`watch`: its WatchSettings)."""
    if not watch.hosts.get("hostfile"):
        raise AiperfError("--executor hosts: give --hostfile FILE (one host a line: 'HOST slots=K')")
    return read_hostfile(watch.hosts["hostfile"])


def place_replicas(hosts: list[Host], replicas: int | None, nodes: int) -> list[list[Host]]:
    """Each replica's hosts: consecutive groups of `nodes` hosts with the same slots."""
    fit = len(hosts) // nodes
    replicas = fit if replicas is None else replicas
    if replicas < 1 or replicas * nodes > len(hosts):
        raise AiperfError(f"--replicas {replicas} x --nodes-per-replica {nodes} needs {replicas * nodes} hosts, the "
                          f"hostfile names {len(hosts)}")
    groups = [hosts[i * nodes:(i + 1) * nodes] for i in range(replicas)]
    for group in groups:
        if len({h.slots for h in group}) > 1:
            raise AiperfError(f"--hostfile: a replica's hosts ({', '.join(h.name for h in group)}) have different "
                              f"slots; every node of a replica needs as many devices")
    return groups


class HostsHandle(NodeProcessesHandle):
    """A replica's launchers, one per node: the first node's is the replica's."""


class HostsExecutor(Executor):
    name = "hosts"
    poll_interval_s = 1.0

    def __init__(self, run_dir: Path, placement: list[list[Host]], launcher: str = DEFAULT_LAUNCHER):
        self.run_dir = Path(run_dir)
        self.placement = placement
        self.launcher = check_launcher(launcher)

    @classmethod
    def machine_nodes(cls, watch) -> int:
        return len({host.name for host in hostfile_hosts(watch)})

    def node_command(self, command: ReplicaCommand, node: int) -> list[str]:
        """The launcher's argv that starts node `node` of the replica on its host, with the
        variables every node needs set by `env` on the far side (ssh does not carry them)."""
        hosts = self.placement[command.replica]
        env = {**command.node_env(replicas_per_node=1), HOSTS_ENV: ",".join(h.name for h in hosts)}
        argv, env = launch_command(self.container, command.node_argv(node), env)
        return launcher_argv(self.launcher, hosts[node].name, argv, env)

    def launch(self, command: ReplicaCommand) -> HostsHandle:
        launchers = []
        for node in range(command.nodes):
            log_path = command.log_path if node == 0 or command.log_path is None else node_log_path(command.log_path,
                                                                                                    node)
            log_path = log_path or os.devnull
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as log:
                launchers.append(subprocess.Popen(self.node_command(command, node), stdin=subprocess.DEVNULL,
                                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        return HostsHandle(command, launchers)

    def stop(self, handles: list[ReplicaHandle], grace_s: float) -> None:
        end_processes(handles, grace_s)

    def end_leftover(self, replica: int, job: str) -> None:
        """A launcher of an earlier primary died with it (its session); the replica it started stops
        at the run's stop file or deadline, and a resumed replica waits for its lease (rundir.Lease)."""

