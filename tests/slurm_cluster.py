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
import time
from pathlib import Path

from apt_packages import apt_install

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODE_CPUS = 8  # declared, not real: config_overrides lets slurmd accept more than the machine has


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


def slurm_conf(folder: Path, host: str, ctld_port: int, slurmd_port: int, user: str) -> str:
    return "\n".join([
        "ClusterName=aiperf-test",
        f"SlurmctldHost={host}",
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
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"NodeName={host} CPUs={NODE_CPUS} RealMemory=4000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
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
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0]
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        self.conf.write_text(slurm_conf(self.folder, host, *_free_ports(2), user))
        for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
            log = open(self.folder / f"{daemon[0]}.out", "ab")
            self.daemons.append(subprocess.Popen([*daemon, "-f", str(self.conf)], env=self.env, stdout=log,
                                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            log.close()
        self._wait_for_idle_node(timeout_s)
        return self

    def _wait_for_idle_node(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise SlurmSetupError(f"{daemon.args[0]} exited with {daemon.returncode}: {self.logs()}")
            answer = subprocess.run(["sinfo", "--noheader", "--format", "%t"], env=self.env, capture_output=True,
                                    text=True)
            state = answer.stdout.strip()
            if answer.returncode == 0 and state.startswith("idle"):
                return
            time.sleep(0.5)
        raise SlurmSetupError(f"the SLURM node is not idle after {timeout_s} s (state {state!r}): {self.logs()}")

    def logs(self, chars: int = 1500) -> str:
        text = ""
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.folder / name
            if path.exists():
                text += f"\n--- {name}\n" + path.read_text(errors="replace")[-chars:]
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
