"""A multi-node cluster on one machine for tests: each node a network namespace with its own
address, hostname and slurmd, joined to a bridge by a veth pair whose two ends tc can shape.

Recipe and reasons: DEVELOPERS.md, "A multi-node cluster for tests". In short, as root:
- a bridge in the root namespace holds the subnet's .1 (the submit host, where the primary and
  slurmctld run); node K is namespace `aiperf-<id>-nodeK` at .(10+K), on a veth pair whose root
  end is a port of the bridge and whose other end is `eth0` in the namespace;
- every process of a node runs through the `enter` script the cluster writes: `nsenter --net`
  into the node's namespace (not `ip netns exec`, which remounts /sys, and slurmd then fails on
  cgroups), then `unshare --uts --mount` to set the node's hostname and bind a hosts file naming
  every node over /etc/hosts in that process's own mount namespace (torch's and jax's gloo bind
  to the address their hostname resolves to, so a node's name must resolve there, and /etc/hosts
  itself is never edited);
- slurmctld runs in the root namespace under `unshare --uts`, with the hostname SlurmctldHost
  names; one `slurmd -N nodeK` per node runs through `enter`.

The root namespace does not resolve the node names: address a node from there by
`cluster.address(node)`. A file per cluster in /run/aiperf-netns names its owner process, so
that a later start removes what a crashed run left (its namespaces, the processes in them, its
bridge, its slurmctld) and never what a live cluster holds.

Tests use the `netns_cluster` fixture by importing it: `from netns_cluster import netns_cluster`.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apt_packages import apt_install
from slurm_cluster import SlurmCluster, SlurmSetupError, install_packages

NAMESPACE_PREFIX = "aiperf-"  # a cluster's namespaces: aiperf-<id>-nodeK
BRIDGE_PREFIX = "aipb"  # its bridge: aipb<id>; a node's veth (root end): aipv<id>nK; interface names
VETH_PREFIX = "aipv"  # have at most 15 characters, hence the short forms
NODE_DEVICE = "eth0"  # a node's end of its veth pair, inside its namespace
NAMESPACE_NAME = re.compile(f"{NAMESPACE_PREFIX}([0-9a-f]{{6}})-node[0-9]+")  # only these are a cluster's:
LINK_NAME = re.compile(f"(?:{BRIDGE_PREFIX}|{VETH_PREFIX})([0-9a-f]{{6}})(?:n[0-9]+)?")  # others are left alone
STATE = Path("/run/aiperf-netns")
SUBNET = "10.213.{}.0/24"  # the third number is free on this machine, from 47 up
FIRST_SUBNET = 47
CONTROLLER = "head"  # slurmctld's hostname, in its own UTS namespace
TBF_LATENCY_MS = 50  # how long a packet may wait in the shaper's queue before tbf drops it


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be made here: the reason to skip."""


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise SlurmSetupError(f"{shlex.join(argv)} failed: {result.stderr.strip()}")
    return result


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot, which tells it from a later process with its id."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no namespace and waits only for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _end_processes(pids: list[int], grace_s: float = 5) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _namespace_pids(namespace: str) -> list[int]:
    return [int(pid) for pid in _run(["ip", "netns", "pids", namespace], check=False).stdout.split()]


def _die_with_parent() -> None:
    """In a daemon's child before exec: SIGTERM it when the test process dies, so that a killed
    test leaves no daemon (prctl's parent-death signal survives the exec chain nsenter, unshare, sh -c exec)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class NetnsCluster(SlurmCluster):
    """`nodes` nodes named node1..nodeN under one SLURM partition, their links limited to
    `rate_mbit` each way (None: unshaped) until `shape` changes it."""

    def __init__(self, folder: Path, nodes: int = 2, rate_mbit: float | None = None):
        super().__init__(folder)
        self.id = secrets.token_hex(3)
        self.nodes = [f"node{k}" for k in range(1, nodes + 1)]
        self.rate_mbit = rate_mbit
        self.subnet: int | None = None
        self.bridge = BRIDGE_PREFIX + self.id
        self.enter = self.folder / "enter"
        self.hosts = self.folder / "hosts"

    def namespace(self, node: str) -> str:
        return f"{NAMESPACE_PREFIX}{self.id}-{node}"

    def veth(self, node: str) -> str:
        """The root end of the node's link: a port of the bridge."""
        return f"{VETH_PREFIX}{self.id}n{self.nodes.index(node) + 1}"

    def address(self, node: str) -> str:
        return f"10.213.{self.subnet}.{10 + self.nodes.index(node) + 1}"

    @property
    def controller_address(self) -> str:
        return f"10.213.{self.subnet}.1"

    def start(self, timeout_s: float = 60) -> "NetnsCluster":
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root")
        for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nsenter", "util-linux"),
                              ("unshare", "util-linux")):
            if not shutil.which(tool) and (error := apt_install([package])) is not None:
                raise SlurmSetupError(f"{tool} is missing and apt-get install {package} failed: {error}")
        install_packages()
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            with self._lock():
                _remove_stale()
                self.subnet = self._free_subnet()
                (STATE / f"{self.id}.json").write_text(json.dumps(
                    {"owner": os.getpid(), "owner_start": _start_time(os.getpid()), "folder": str(self.folder),
                     "subnet": self.subnet, "nodes": self.nodes}))
                self._make_network()
            self._write_node_files()
            self._check_nodes_reach_each_other()
            self.write_conf(f"{CONTROLLER}({self.controller_address})",
                            {node: self.address(node) for node in self.nodes})
            self.start_daemon(["unshare", "--uts", "sh", "-c", f'hostname {CONTROLLER} && exec "$@"', "-",
                               "slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld.out",
                              preexec_fn=_die_with_parent)
            for node in self.nodes:
                self.start_daemon(self.node_argv(node, ["slurmd", "-D", "-N", node, "-f", str(self.conf)]),
                                  f"slurmd-{node}.out", preexec_fn=_die_with_parent)
            self.wait_for_idle_nodes(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _lock(self):
        """Hold /run/aiperf-netns/lock: a start does not take a subnet another start is taking."""
        STATE.mkdir(parents=True, exist_ok=True)
        lock = open(STATE / "lock", "w")
        fcntl.flock(lock, fcntl.LOCK_EX)
        return lock  # closing it (leaving the with block) releases the lock

    def _free_subnet(self) -> int:
        taken = _run(["ip", "-4", "-o", "addr"]).stdout
        for third in range(FIRST_SUBNET, 255):
            if f" 10.213.{third}." not in taken:
                return third
        raise SlurmSetupError("no free 10.213.X.0/24 subnet for the cluster")

    def _make_network(self) -> None:
        first = self.namespace(self.nodes[0])
        made = _run(["ip", "netns", "add", first], check=False)
        if made.returncode != 0:
            raise NamespacesUnavailable(f"ip netns add failed: {made.stderr.strip()}")
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.controller_address}/24", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for node in self.nodes:
            namespace, veth = self.namespace(node), self.veth(node)
            if node != self.nodes[0]:
                _run(["ip", "netns", "add", namespace])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", NODE_DEVICE, "netns", namespace])
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", namespace, "addr", "add", f"{self.address(node)}/24", "dev", NODE_DEVICE])
            _run(["ip", "-n", namespace, "link", "set", NODE_DEVICE, "up"])
            _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
            if self.rate_mbit is not None:
                self.shape(node, self.rate_mbit)

    def _write_node_files(self) -> None:
        self.hosts.write_text("127.0.0.1 localhost\n" + f"{self.controller_address} {CONTROLLER}\n"
                              + "".join(f"{self.address(node)} {node}\n" for node in self.nodes))
        # Like `ssh NODE COMMAND...`: the words after the node are joined by spaces and read by
        # bash (root's login shell, which ssh would run), which runs a simple command in its own
        # place: a signal to the launcher reaches the command.
        # --propagation slave: mounts made later in the root namespace still show on the nodes
        # (one shared filesystem), and the node's own hosts mount stays on the node.
        self.enter.write_text(
            "#!/bin/sh\n"
            "# enter NODE COMMAND...: run COMMAND on NODE of this cluster, as `ssh NODE COMMAND...` would\n"
            'node="$1"; shift\n'
            f"hosts={shlex.quote(str(self.hosts))}\n"
            f'exec nsenter --net=/run/netns/{NAMESPACE_PREFIX}{self.id}-"$node" '
            "unshare --uts --mount --propagation slave "
            """sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec bash -c "$*"' """
            'enter "$node" "$hosts" "$@"\n')
        self.enter.chmod(0o755)

    def _check_nodes_reach_each_other(self) -> None:
        """Fail in one line where the bridge does not carry node-to-node traffic: with the
        br_netfilter module loaded (net.bridge.bridge-nf-call-iptables=1), bridged packets pass
        iptables' FORWARD chain, whose policy a container runtime may have set to DROP."""
        first, last = self.nodes[0], self.nodes[-1]
        if first == last:
            return
        # A refused connection is an answer from the other node's kernel: nothing need listen there.
        probe = ("import socket, sys\ntry: socket.create_connection((sys.argv[1], 9), timeout=3)\n"
                 "except ConnectionRefusedError: pass")
        answer = subprocess.run(self.node_argv(last, [sys.executable, "-c", probe, self.address(first)]),
                                capture_output=True, text=True, timeout=60)
        if answer.returncode != 0:
            raise SlurmSetupError(f"{last} does not reach {first} at {self.address(first)} across the bridge "
                                  f"(is bridged traffic filtered? iptables -S FORWARD): {answer.stderr.strip()[-300:]}")

    def node_argv(self, node: str, argv: list[str]) -> list[str]:
        """argv run on `node`: in its network namespace, with its hostname and hosts file."""
        return [str(self.enter), node, "exec " + shlex.join(argv)]

    def run_on(self, node: str, argv: list[str], **popen_kwargs) -> subprocess.Popen:
        """Start argv on `node` (with the cluster's environment unless env= is given)."""
        popen_kwargs.setdefault("env", self.env)
        return subprocess.Popen(self.node_argv(node, argv), **popen_kwargs)

    def launcher_template(self) -> str:
        """A launcher for `--executor hosts --launcher TEMPLATE`: it enters the node `{host}` and runs
        the command that follows it, as `ssh {host}` would."""
        return f"{shlex.quote(str(self.enter))} {{host}}"

    def hostfile(self, slots: int = 1) -> str:
        """The nodes in DeepSpeed's hostfile format."""
        return "".join(f"{node} slots={slots}\n" for node in self.nodes)

    def shape(self, node: str, rate_mbit: float | None) -> None:
        """Limit both directions of the node's link to rate_mbit (None: unlimited) with a token bucket."""
        for namespace, device in ((None, self.veth(node)), (self.namespace(node), NODE_DEVICE)):
            tc = ["tc", *(["-n", namespace] if namespace else []), "qdisc"]
            if rate_mbit is None:
                _run([*tc, "del", "dev", device, "root"], check=False)  # fails only where none was set
                continue
            # The bucket holds 5 ms at the rate and at least one 64 KiB segment: veth passes GSO
            # segments of up to 64 KiB, and tbf would otherwise cut each one up in software.
            burst = max(int(rate_mbit * 1e6 / 8 * 0.005), 65536 + 1514)
            _run([*tc, "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                  "latency", f"{TBF_LATENCY_MS}ms"])

    def set_link(self, node: str, up: bool) -> None:
        """Plug or unplug the node's link: its bridge port goes down, and its eth0 loses carrier."""
        _run(["ip", "link", "set", self.veth(node), "up" if up else "down"])

    def link_bytes(self, node: str) -> tuple[int, int]:
        """(bytes the node sent, bytes it received) on its link since the cluster started, read from the
        root end of its veth pair (which receives what the node sends)."""
        statistics = Path("/sys/class/net") / self.veth(node) / "statistics"
        return int((statistics / "rx_bytes").read_text()), int((statistics / "tx_bytes").read_text())

    def stop(self) -> None:
        """Stop the daemons and every process left in the nodes, and remove the namespaces, the bridge
        (its veth pairs go with the namespaces) and the state file."""
        if self.daemons:
            super().stop()
        _remove_cluster(self.id, [self.namespace(node) for node in self.nodes])


def _remove_cluster(cluster_id: str, namespaces: list[str]) -> None:
    # A namespace goes (and takes its veth pair with it) only when its last process has, and then
    # later, in the kernel's own time: delete the pairs first, so that none outlives stop().
    for device in _links():
        if device.startswith(f"{VETH_PREFIX}{cluster_id}n") or device == BRIDGE_PREFIX + cluster_id:
            _run(["ip", "link", "del", device], check=False)
    for namespace in namespaces:
        if Path("/run/netns", namespace).exists():
            _end_processes(_namespace_pids(namespace))
            _run(["ip", "netns", "del", namespace], check=False)
    (STATE / f"{cluster_id}.json").unlink(missing_ok=True)


def _links() -> list[str]:
    """The names of the root namespace's network devices (a veth's without its @peer)."""
    return [line.split(":")[1].strip().split("@")[0] for line in _run(["ip", "-o", "link"]).stdout.splitlines()]


def _remove_stale() -> None:
    """Remove what clusters whose test process has ended left behind: their namespaces (and the
    processes in them), bridges and slurmctld."""
    namespaces = [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]
    ids = {match[1] for name in namespaces if (match := NAMESPACE_NAME.fullmatch(name))}
    ids |= {match[1] for name in _links() if (match := LINK_NAME.fullmatch(name))}
    ids |= {path.stem for path in STATE.glob("*.json")}
    for cluster_id in ids:
        state_file = STATE / f"{cluster_id}.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        if state and _start_time(state["owner"]) == state["owner_start"]:
            continue  # a live cluster
        for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # Its slurmctld, in the root namespace: the one whose configuration is in the dead cluster's folder.
            if state and command[0].endswith(b"slurmctld") and any(
                    word.startswith(state["folder"].encode()) for word in command):
                _end_processes([pid])
        _remove_cluster(cluster_id, [name for name in namespaces if name.startswith(f"{NAMESPACE_PREFIX}{cluster_id}-")])


def start_or_skip(cluster: NetnsCluster) -> NetnsCluster:
    """Start the cluster, or skip the test where network namespaces cannot be made."""
    try:
        return cluster.start()
    except NamespacesUnavailable as reason:
        pytest.skip(f"no multi-node cluster: {reason}")


@pytest.fixture(scope="module")
def netns_cluster(tmp_path_factory):
    """A started two-node NetnsCluster with unshaped links, for one test module."""
    cluster = start_or_skip(NetnsCluster(tmp_path_factory.mktemp("netns")))
    try:
        yield cluster
    finally:
        cluster.stop()
