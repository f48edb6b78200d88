"""A replica across nodes: node 0 leads the trial loop, every other node follows it.

Every node of a replica runs `aiperf replica --run-dir D --replica-id I --node-rank K`, started by
the executor (SLURM: one task per node of the replica's job; hosts: the launcher on each host;
local: one process per node, for tests). Node 0 is the replica as on one node: it plans, records
and reports. A follower (node K > 0) only trains: for each trial it reads what the leader wrote,
opens the run's data itself, lowers the same graph with the same starting weights, and calls the
backend's train() with its place in the layout. The backend's own distributed runtime joins the
nodes' devices into one group (torch.distributed at the coordinator, node 0's address and a port
it picked for the trial); nothing the trial needs is sent between nodes but through it.

The nodes meet through the run directory, which every node mounts (the shared filesystem the
replicas already share), in replicas/<I>/nodes/<launch>/, one folder per launch of the replica:
  node-<K>.json     written by node K when it joins and rewritten as its heartbeat: host,
                    address, devices, pid, state, and its liveness port;
  trial-<seq>.json  the leader's instructions for a trial: its id and seed, the graph's and the
                    starting weights' paths with their SHA-256, the TrainConfig and the coordinator;
  stop.json         the leader has ended: followers exit.

A node is lost when it cannot be reached: each node listens on a liveness port (it accepts and
closes, nothing more), and after a failed collective a node tries its peers' ports. A lost node
is named in one line, the trial is recorded as failed, and the replica ends with an error so that
the primary's fault policy restarts it (every node, as a new launch). A follower whose leader
cannot be reached, or has ended, exits: no process waits on a replica that is gone. The bound on
all of it is the policy item `node_timeout_s` (ReplicaLayout.timeout_s).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Mapping

from aiperf_core.atomic import write_bytes_atomic
from aiperf_core.errors import AiperfError
from aiperf_core.replica_layout import ReplicaLayout

LAUNCH_ENV = "AIPERF_REPLICA_LAUNCH"  # the same token on every node of one launch of a replica
NODE_ADDR_ENV = "AIPERF_NODE_ADDR"  # this node's address as its peers reach it; else its host name's
HOSTS_ENV = "AIPERF_REPLICA_HOSTS"  # the hosts an executor placed a replica's nodes on, by node rank
HEARTBEAT_S = 2.0
POLL_S = 0.2
PROBE_TIMEOUT_S = 3.0


class NodeError(AiperfError):
    pass


def node_address() -> str:
    """This node's address as the other nodes of its replica reach it."""
    given = os.environ.get(NODE_ADDR_ENV)
    if given:
        return given
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as exc:
        raise NodeError(f"this node's host name {socket.gethostname()!r} does not resolve ({exc.strerror or exc}): "
                        f"set {NODE_ADDR_ENV} to the address the replica's other nodes reach it at") from None


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def reachable(addr: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class _LivenessPort:
    """Accepts and closes connections, so that a peer can tell this node is up and reachable."""

    def __init__(self, addr: str):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, name="node-liveness", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class NodeRoster:
    """One node's view of its replica's nodes folder for one launch."""

    def __init__(self, replica_dir: Path, launch: str, node_rank: int, nodes: int):
        if not launch or "/" in launch or launch.startswith("."):
            raise NodeError(f"{LAUNCH_ENV}: {launch!r} is not a launch token")
        self.folder = Path(replica_dir) / "nodes" / launch
        self.node_rank, self.nodes = node_rank, nodes
        self.devices: list[str] = []  # known once the backend's node has started (Backend.start_node)
        self.addr = node_address()
        self.host = socket.gethostname()
        # The leader's port for a coordination service that lives as long as the launch (jax's).
        self.service_port = free_port(self.addr) if node_rank == 0 else None
        self._state: dict[str, Any] = {"state": "joined"}
        self._liveness: _LivenessPort | None = None
        self._stopping = threading.Event()
        self._beat: threading.Thread | None = None

    # -- this node ---------------------------------------------------------------------------
    def join(self) -> "NodeRoster":
        self.folder.mkdir(parents=True, exist_ok=True)
        self._liveness = _LivenessPort(self.addr)
        self._write_self()
        self._beat = threading.Thread(target=self._heartbeat, name="node-heartbeat", daemon=True)
        self._beat.start()
        return self

    def leave(self) -> None:
        self._stopping.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self._liveness is not None:
            self._liveness.close()

    def set_state(self, **fields: Any) -> None:
        self._state = {**self._state, **fields}
        self._write_self()

    def _write_self(self) -> None:
        record = {"node_rank": self.node_rank, "host": self.host, "addr": self.addr, "pid": os.getpid(),
                  "devices": self.devices, "liveness_port": self._liveness.port if self._liveness else None,
                  "service_port": self.service_port, "time": time.time(), **self._state}
        write_json(self.folder / f"node-{self.node_rank}.json", record)

    def _heartbeat(self) -> None:
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                self._write_self()
            except OSError as exc:  # a flaky shared disk must not end training; retry next beat
                print(f"node {self.node_rank}: heartbeat not written: {exc}", file=sys.stderr, flush=True)

    # -- the others --------------------------------------------------------------------------
    def peer(self, node_rank: int) -> dict[str, Any] | None:
        return read_json(self.folder / f"node-{node_rank}.json")

    def wait_for_peers(self, ranks: list[int], timeout_s: float, expected_hosts: list[str] | None = None,
                       started: bool = False) -> list[dict]:
        """Every node of `ranks` once it has joined (and, with `started`, started its backend: its
        devices are known); NodeError naming the first that has not within timeout_s (by its expected
        host where the executor said which)."""
        deadline = time.monotonic() + timeout_s
        while True:
            records = {rank: self.peer(rank) for rank in ranks}
            missing = [rank for rank, record in records.items()
                       if record is None or (started and not record.get("devices"))]
            if not missing:
                return [records[rank] for rank in ranks]
            if time.monotonic() >= deadline:
                rank = missing[0]
                host = f" ({expected_hosts[rank]})" if expected_hosts and rank < len(expected_hosts) else ""
                raise NodeError(f"node {rank}{host} of the replica never joined within {timeout_s:g} s")
            time.sleep(POLL_S)

    def lost(self, ranks: list[int]) -> list[dict]:
        """The records of the nodes among `ranks` that cannot be reached now."""
        gone = []
        for rank in ranks:
            record = self.peer(rank)
            port = (record or {}).get("liveness_port")
            if record is None or not isinstance(port, int) or not reachable(record["addr"], port):
                gone.append(record or {"node_rank": rank, "host": f"node {rank}"})
        return gone

    # -- the leader's instructions -----------------------------------------------------------
    def trial_file(self, seq: int) -> Path:
        return self.folder / f"trial-{seq}.json"

    def trial_numbers(self) -> list[int]:
        numbers = []
        for path in self.folder.glob("trial-*.json"):
            number = path.stem[len("trial-"):]
            if number.isdigit():
                numbers.append(int(number))
        return numbers

    @property
    def stop_file(self) -> Path:
        return self.folder / "stop.json"

    def layout(self, port: int, hosts: list[str], devices_per_node: int, timeout_s: float,
               expert_parallel: bool = False, leader_addr: str | None = None) -> ReplicaLayout:
        return ReplicaLayout(nodes=self.nodes, devices_per_node=devices_per_node, node_rank=self.node_rank,
                             local_devices=tuple(self.devices), hosts=tuple(hosts),
                             coordinator_addr=leader_addr or self.addr, coordinator_port=port,
                             expert_parallel=expert_parallel, timeout_s=timeout_s)

    def start_backend(self, backend, leader: Mapping[str, Any], timeout_s: float) -> None:
        """Backend.start_node with this node's place and the leader's service port, then record
        this node's devices (which a started runtime may only now know)."""
        hosts = [leader.get("host", "node 0")] + [f"node {rank}" for rank in range(1, self.nodes)]
        backend.start_node(ReplicaLayout(nodes=self.nodes, devices_per_node=1, node_rank=self.node_rank,
                                         hosts=tuple(hosts), coordinator_addr=leader["addr"],
                                         coordinator_port=leader["service_port"], timeout_s=timeout_s))
        self.devices = list(backend.devices())
        self._write_self()


def write_json(path: Path, record: Mapping[str, Any]) -> None:
    write_bytes_atomic(path, (json.dumps(record, sort_keys=True, allow_nan=False) + "\n").encode())


def read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def config_to_json(config) -> dict:
    """A TrainConfig as JSON (its layout left out: each node has its own place in it)."""
    fields = asdict(config)
    fields.pop("layout", None)
    return json.loads(json.dumps(fields))


def config_from_json(fields: Mapping[str, Any]):
    from aiperf_core.backend import Schedule, TrainConfig

    fields = dict(fields)
    fields["schedule"] = Schedule(**fields["schedule"])
    for key in ("betas", "devices"):
        if fields.get(key) is not None:
            fields[key] = tuple(fields[key])
    return TrainConfig(**fields)


# -- the leader (node 0), called by aiperf_core.replica.Replica ---------------------------------
def launch_token() -> str:
    token = os.environ.get(LAUNCH_ENV)
    if not token:
        raise NodeError(f"a replica across nodes needs {LAUNCH_ENV}, the same token on every node of one launch "
                        f"(the executor sets it)")
    return token


def expected_hosts() -> list[str] | None:
    """The hosts the executor placed the replica's nodes on, by node rank, where it said."""
    hosts = os.environ.get(HOSTS_ENV)
    return hosts.split(",") if hosts else None



def join_as_leader(replica) -> tuple[NodeRoster, list[dict]]:
    roster = NodeRoster(replica.run_dir.replica_dir(replica.id), launch_token(), 0, replica.nodes).join()
    timeout_s = replica.policy["node_timeout_s"]
    followers = list(range(1, replica.nodes))
    try:
        # Every node first joins the roster, so that one that never comes is named here in one line,
        # not by a runtime's own timeout inside start_node (jax's aborts the process).
        roster.wait_for_peers(followers, timeout_s, expected_hosts())
        roster.start_backend(replica.backend, roster.peer(0), timeout_s)
        records = [roster.peer(0)] + roster.wait_for_peers(followers, timeout_s, expected_hosts(), started=True)
        local = len(replica.backend.devices())
        odd = [r for r in records if len(r.get("devices") or []) != local]
        if odd:
            raise NodeError(f"node {odd[0]['node_rank']} ({odd[0]['host']}) has {len(odd[0].get('devices') or [])} "
                            f"device(s), node 0 has {local}: every node of a replica needs as many")
    except BaseException:
        end_followers(roster)
        raise
    return roster, records


def lead_trial(replica, seq: int, trial: str, graph_path: Path, graph_sha256: str, weights, config, seed: int):
    """Write trial `seq`'s instructions for the followers (the starting weights beside them) and
    return `config` with node 0's place in the layout, at a port picked for this trial."""
    from aiperf_core.rundir import sha256_file
    from aiperf_core.weights import save_weights

    roster: NodeRoster = replica._roster
    for earlier in roster.folder.glob("trial-*-weights.npz"):  # every node has loaded them by now
        earlier.unlink(missing_ok=True)
    weights_path = roster.folder / f"trial-{seq}-weights.npz"
    save_weights(weights, weights_path)
    records = [roster.peer(rank) or {} for rank in range(replica.nodes)]
    hosts = [str(r.get("host", f"node {rank}")) for rank, r in enumerate(records)]
    port = free_port(roster.addr)
    write_json(roster.trial_file(seq), {
        "trial": trial, "seq": seq, "seed": seed, "addr": roster.addr, "port": port, "hosts": hosts,
        "graph": str(graph_path), "graph_sha256": graph_sha256,
        "weights": str(weights_path), "weights_sha256": sha256_file(weights_path),
        "config": config_to_json(config)})
    roster.set_state(state="training", trial=trial)
    return replace(config, layout=roster.layout(port, hosts, len(replica.backend.devices()),
                                                replica.policy["node_timeout_s"], config.expert_parallel))


def end_followers(roster: NodeRoster) -> None:
    try:
        write_json(roster.stop_file, {"time": time.time()})
    except OSError:
        pass
    roster.leave()


# -- a follower (node K > 0) ---------------------------------------------------------------------
def follow(replica) -> str:
    """Train every trial the leader of this launch writes, until it writes stop.json; exits with a
    NodeError naming the leader when it cannot be reached, or never joined, within the bound."""
    from aiperf_core.ir import Graph
    from aiperf_core.registry import load_backend
    from aiperf_core.rundir import sha256_bytes, sha256_file
    from aiperf_core.weights import load_weights

    from aiperf_core.monitoring.sampler import Sampler

    backend = replica._backend or load_backend(replica.spec.backend)
    timeout_s = replica.policy["node_timeout_s"]
    roster = NodeRoster(replica.run_dir.replica_dir(replica.id), launch_token(), replica.node_rank,
                        replica.nodes).join()
    sampler = Sampler(replica.run_dir, replica.id, replica.spec.monitor_interval_s, node=replica.node_rank).start()
    try:
        leader = roster.wait_for_peers([0], timeout_s, expected_hosts())[0]
        roster.start_backend(backend, leader, timeout_s)
        dataset = replica._dataset or replica.workload.data.open(replica.spec.dataset, replica.policy)
        seq = -1  # the leader numbers trials on from its event log: take the next one it writes
        last_seen = time.monotonic()
        while True:
            if roster.stop_file.exists():
                return "followed"
            later = [n for n in roster.trial_numbers() if n > seq]
            info = read_json(roster.trial_file(min(later))) if later else None
            if info is None:
                if time.monotonic() - last_seen > timeout_s:
                    leader = roster.peer(0) or leader
                    if roster.lost([0]):
                        raise NodeError(f"lost the replica's leader, node 0 ({leader.get('host')})")
                    last_seen = time.monotonic()
                time.sleep(POLL_S)
                continue
            trial = info["trial"]
            roster.set_state(state="training", trial=trial)
            try:
                graph_bytes = Path(info["graph"]).read_bytes()
                if sha256_bytes(graph_bytes) != info["graph_sha256"] or \
                        sha256_file(Path(info["weights"])) != info["weights_sha256"]:
                    raise NodeError(f"trial {trial}: the graph or starting weights on this node are not what node 0 "
                                    f"wrote (is the run directory on a filesystem every node shares?)")
                graph = Graph.from_json(graph_bytes.decode("utf-8"))
                config = config_from_json(info["config"])
                config = replace(config, layout=roster.layout(info["port"], info["hosts"], len(backend.devices()),
                                                              timeout_s, config.expert_parallel, info["addr"]))
                data = replica.workload.data.trial_data(dataset, replica.policy, info["seed"])
                model = backend.lower(graph, load_weights(Path(info["weights"])), config.precision)
                backend.train(model, data, config, None)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                print(f"replica {replica.id} node {replica.node_rank}: trial {trial} failed: {first}",
                      file=sys.stderr, flush=True)
                if roster.lost([0]):
                    raise NodeError(f"lost the replica's leader, node 0 ({leader.get('host')}), in trial {trial}") \
                        from None
            roster.set_state(state="waiting", trial=None)
            seq = info["seq"]
            last_seen = time.monotonic()
    finally:
        sampler.stop()
        roster.leave()
