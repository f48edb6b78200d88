"""A one-node SLURM cluster for tests: slurmctld and slurmd started by hand on this machine.

Recipe (DEVELOPERS.md): install the Debian packages (root, as in CI), write a slurm.conf with no
authentication (auth/none, cred/none), no cgroups (proctrack/linuxproc, task/none), this host as
the only node, state and spool folders under a temporary folder and free ports, then start
`slurmctld -D -i` and `slurmd -D` as child processes. Clients find the cluster through SLURM_CONF.
The cluster stops only the two daemons it started, by their process ids.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from apt_packages import apt_install

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODE_CPUS = 8  # declared, not real: config_overrides lets slurmd accept more than the machine has
# The SLURM executor asks squeue every 5 s (SlurmExecutor.poll_interval_s), which spares a real cluster's
# controller; against this one a test's primary asks every second, so that it sees a job end (or crash)
# within a second, not up to 5 s later: the same decisions, sooner.
TEST_POLL_S = 1.0


def aiperf_argv(*args: str, poll_s: float = TEST_POLL_S) -> list[str]:
    """`python -m aiperf_core ARGS...` whose SLURM executor polls every `poll_s` seconds."""
    code = ("import sys; from aiperf_core.workflow.executors.slurm import SlurmExecutor; "
            f"SlurmExecutor.poll_interval_s = {float(poll_s)!r}; from aiperf_core.cli import main; sys.exit(main())")
    return [sys.executable, "-c", code, *args]


class SlurmSetupError(RuntimeError):
    pass


def install_packages() -> None:
    """apt-get install the SLURM daemons and clients if they are missing (needs root)."""
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "squeue")):
        return
    if os.geteuid() != 0:
        raise SlurmSetupError("SLURM is not installed and this is not root: apt-get install -y "
                              "--no-install-recommends " + " ".join(PACKAGES))
    error = apt_install(PACKAGES)
    if error is not None:
        raise SlurmSetupError(f"apt-get install failed: {error}")


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def slurm_conf(folder: Path, controller: str, ctld_port: int, slurmd_port: int, user: str,
               nodes: dict[str, str | None]) -> str:
    """slurm.conf for `nodes` (name: address, or None where the name resolves) in one partition,
    controlled by `controller` (SlurmctldHost: `name` or `name(address)`). slurmd's spool, pid and
    log files carry the node's name (%n), so that several slurmd can share the folder."""
    return "\n".join([
        "ClusterName=aiperf-test",
        f"SlurmctldHost={controller}",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        f"SlurmUser={user}",
        f"SlurmdUser={user}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "MpiDefault=none",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "MinJobAge=600",
        "SchedulerParameters=sched_interval=2",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        *(f"NodeName={name}" + (f" NodeAddr={address}" if address else "")
          + f" CPUs={NODE_CPUS} RealMemory=4000 State=UNKNOWN" for name, address in nodes.items()),
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        "",
    ])


class SlurmCluster:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.conf = self.folder / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        install_packages()
        host = socket.gethostname().split(".")[0]
        self.write_conf(host, {host: None})
        self.start_daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
        self.start_daemon(["slurmd", "-D", "-f", str(self.conf)], "slurmd.out")
        self.wait_for_idle_nodes(timeout_s)
        return self

    def write_conf(self, controller: str, nodes: dict[str, str | None]) -> None:
        (self.folder / "state").mkdir(parents=True, exist_ok=True)
        for node in nodes:
            (self.folder / "spool" / node).mkdir(parents=True, exist_ok=True)
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        self.conf.write_text(slurm_conf(self.folder, controller, *_free_ports(2), user, nodes))

    def start_daemon(self, argv: list[str], output: str, **popen_kwargs) -> None:
        """Start a daemon in the foreground (-D), its output to `output` in the folder, and hold it to stop."""
        with open(self.folder / output, "ab") as log:
            self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, **popen_kwargs))

    def wait_for_idle_nodes(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise SlurmSetupError(f"{' '.join(daemon.args)} exited with {daemon.returncode}: {self.logs()}")
            answer = subprocess.run(["sinfo", "--noheader", "--Node", "--format", "%t"], env=self.env,
                                    capture_output=True, text=True)
            state = answer.stdout.strip()
            if answer.returncode == 0 and set(state.split()) == {"idle"}:
                return
            time.sleep(0.5)
        raise SlurmSetupError(f"the SLURM nodes are not idle after {timeout_s} s (states {state!r}): {self.logs()}")

    def logs(self, chars: int = 1500) -> str:
        text = ""
        for path in [self.folder / "slurmctld.log", *sorted(self.folder.glob("slurmd-*.log"))]:
            if path.exists():
                text += f"\n--- {path.name}\n" + path.read_text(errors="replace")[-chars:]
        return text

    def stop(self) -> None:
        """Stop the daemons this cluster started (by pid), and cancel what they still run."""
        subprocess.run(["scancel", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        self.daemons.clear()
