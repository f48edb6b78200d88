"""Two nodes of one replica on this machine, for the parallel level's multi-node checks.

Each node is its own OS process of this Python, as `aiperf replica --node-rank K` is on a cluster.
It loads the backend class and calls Backend.start_node once, with the launch's coordinator
(127.0.0.1 and a port kept for the launch). Then, as a replica's nodes train its trials, it trains
each check's scenario in turn (levels.parallel.train_scenario) with its place in a ReplicaLayout
of NODES nodes of 1 device, meeting its peer at a port of that trial's own. Nothing passes between
the nodes but what the backend sends over TCP: no pipe, queue or shared memory. Every node is given
the same spec (its rank aside) and builds the same graph, weights and data; only node 0 passes
on_epoch. After each trial every node writes what it trained on, and node 0 its epoch reports
(JSON) and its exported weights (.npz, read back with allow_pickle=False), for the kit.

Each node runs in a session of its own (so that stopping it stops the ranks it spawned), on its
share of this machine's cores, with faulthandler on and its output in a log file. A node that
fails ends the launch: the others get GRACE_S to exit. A node still running NODE_EXIT_BOUND_S
after the launch is stopped (SIGABRT first, so that faulthandler writes its Python stacks, then
SIGKILL). The check being trained then fails, naming the node and how it ended, with its log's
tail; the checks after it fail as not run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from aiperf_core.backend import CPU_DEVICES_ENV, EpochReport
from aiperf_core.replica_layout import ReplicaLayout
from aiperf_conformance.kit import FAULTHANDLER_ENV, child_account, exit_description, read_text

NODES = 2
ADDR = "127.0.0.1"
# A node's bound on meeting its peers and on each collective (ReplicaLayout.timeout_s): a peer
# that died fails the other's training within it.
NODE_TIMEOUT_S = 120.0
# From the launch to the last node's exit: well above what the checks' scenarios take (a minute or
# two for all of them on two busy cores) plus NODE_TIMEOUT_S, so that only a node that hangs reaches it.
NODE_EXIT_BOUND_S = 400.0
GRACE_S = 10.0  # after one node failed, how long the others may take to exit before they are stopped
STOP_WAIT_S = 5.0  # between SIGABRT (faulthandler's stacks) and SIGKILL
POLL_S = 0.1
# The environment as this process found it when it imported this module (the parallel level does,
# before the backend's framework starts): a node starts from it, as a node's process starts afresh
# on its own host, not from what a framework set here when it initialised (jax puts AIPERF_CPU_DEVICES
# into XLA_FLAGS).
_STARTING_ENV = dict(os.environ)


@dataclass
class NodesTrained:
    """One check's trial on the nodes."""

    reports: list[EpochReport]  # node 0's
    weights: dict  # node 0's exported weights after training
    on_epoch_calls: int  # how often node 0's on_epoch was called
    devices: list[str]  # the device each node trained on, by node rank
    seconds: list[float]  # each node's wall seconds in train(), by node rank


def _result_file(folder: str, rank: int, check: str) -> Path:
    return Path(folder, f"node-{rank}-{check}.json")


def _weights_file(folder: str, check: str) -> Path:
    return Path(folder, f"node-0-{check}-weights.npz")


def _free_ports(count: int) -> list[int]:
    """`count` distinct free ports on ADDR."""
    from aiperf_core.replica_nodes import free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port(ADDR)
        if port not in ports:
            ports.append(port)
    return ports


def run_nodes(backend_class: str, checks: list[str], seed: int, quick: bool) -> dict[str, NodesTrained | str]:
    """Train the scenarios of `checks`, one trial each, on NODES node processes of `backend_class`
    (module:qualname). Per check: what the nodes trained, or why they did not (a message whose first
    line names the node and how it ended)."""
    launch_port, *trial_ports = _free_ports(1 + len(checks))
    env = dict(_STARTING_ENV, **{FAULTHANDLER_ENV: "1", CPU_DEVICES_ENV: "1"})  # a node of one CPU device
    with tempfile.TemporaryDirectory(prefix="aiperf-nodes-") as tmp:
        logs = [os.path.join(tmp, f"node-{rank}.log") for rank in range(NODES)]
        code = "import sys; from aiperf_conformance.multi_node import node_main; sys.exit(node_main(sys.argv[1]))"
        processes = []
        start = time.monotonic()
        try:
            for rank in range(NODES):
                spec = {"backend_class": backend_class, "sys_path": [p for p in sys.path if p], "checks": checks,
                        "seed": seed, "quick": quick, "node_rank": rank, "launch_port": launch_port,
                        "trial_ports": trial_ports, "out": tmp}
                spec_path = os.path.join(tmp, f"node-{rank}-spec.json")
                Path(spec_path).write_text(json.dumps(spec))
                with open(logs[rank], "wb") as log:
                    processes.append(subprocess.Popen([sys.executable, "-c", code, spec_path], env=env,
                                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                      start_new_session=True))
            seconds = _watch(processes, start)
        finally:
            for process in processes:  # whatever is left of a node's session: the ranks it spawned
                _signal_session(process, signal.SIGKILL)
                process.wait()
        return _per_check(tmp, checks, _failure(processes, seconds, logs), logs)


def _per_check(folder: str, checks: list[str], failure: str | None, logs: list[str]) -> dict[str, NodesTrained | str]:
    """Each check's trial, or why it has none: the launch's `failure` goes to the first check that
    some node did not finish (the ones after it were not run), or to the last check where the nodes
    failed or hung after finishing every trial."""
    found: dict[str, NodesTrained | str] = {}
    ended_in = None
    for check in checks:
        trained = _trained(folder, check)
        if trained is None and ended_in is not None:
            trained = f"not run: the nodes ended in '{ended_in}' ({failure.splitlines()[0]})"
        elif trained is None:
            if failure is None:  # every node exited 0 without finishing it
                missing = next((rank for rank in range(NODES) if not _result_file(folder, rank, check).exists()), 0)
                failure = (f"node {missing} exited 0 without writing what it trained\nnode {missing}'s log:\n"
                           + child_account(read_text(logs[missing])))
            trained, ended_in = failure, check
        found[check] = trained
    if failure is not None and ended_in is None:
        found[checks[-1]] = f"after training every check, {failure}"
    return found


def _watch(processes: list[subprocess.Popen], start: float) -> list[float | None]:
    """Wait for every node to exit; stop those still running at NODE_EXIT_BOUND_S after `start`,
    or GRACE_S after another node failed. Each node's seconds to its exit (None: stopped)."""
    seconds: list[float | None] = [None] * len(processes)
    deadline = start + NODE_EXIT_BOUND_S
    while True:
        now = time.monotonic()
        for rank, process in enumerate(processes):
            if seconds[rank] is None and process.poll() is not None:
                seconds[rank] = now - start
                if process.returncode != 0:
                    deadline = min(deadline, now + GRACE_S)
        if all(s is not None for s in seconds) or now >= deadline:
            break
        time.sleep(POLL_S)
    running = [p for p, s in zip(processes, seconds) if s is None]
    for process in running:
        _signal_session(process, signal.SIGABRT)
    stop = time.monotonic() + STOP_WAIT_S
    for process in running:
        try:
            process.wait(max(stop - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass
    return seconds


def _signal_session(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)  # start_new_session: the node leads its own process group
    except (ProcessLookupError, PermissionError):
        pass


def _failure(processes: list[subprocess.Popen], seconds: list[float | None], logs: list[str]) -> str | None:
    """How a launch where a node did not exit, or exited other than 0, ended (None: it did not)."""
    hung = [rank for rank, s in enumerate(seconds) if s is None]
    failed = [rank for rank, (p, s) in enumerate(zip(processes, seconds)) if s is not None and p.returncode != 0]
    if not hung and not failed:
        return None
    ended = [f"node {rank} exited 0 after {s:.1f} s" for rank, (p, s) in enumerate(zip(processes, seconds))
             if s is not None and p.returncode == 0]
    if failed:
        first = min(failed, key=lambda rank: seconds[rank])
        head = f"node {first} failed ({exit_description(processes[first].returncode)} after {seconds[first]:.1f} s)"
        if hung:
            head += (f"; node(s) {', '.join(map(str, hung))} still running {GRACE_S:g} s later were stopped "
                     f"(SIGABRT, then SIGKILL)")
    else:
        head = (f"node(s) {', '.join(map(str, hung))} did not exit within {NODE_EXIT_BOUND_S:g} s of the launch "
                f"and were stopped (SIGABRT, then SIGKILL): every node of a replica must end when its training does")
    if ended:
        head += f" ({'; '.join(ended)})"
    parts = [head]
    for rank in sorted(set(hung) | set(failed)):
        parts.append(f"node {rank}'s log:\n" + child_account(read_text(logs[rank])))
    return "\n".join(parts)


def _trained(folder: str, check: str) -> NodesTrained | None:
    """What the nodes wrote for `check`, where every node finished it."""
    from aiperf_core.weights import load_weights

    paths = [_result_file(folder, rank, check) for rank in range(NODES)]
    if not all(p.exists() for p in paths) or not _weights_file(folder, check).exists():
        return None
    written = [json.loads(p.read_text()) for p in paths]
    reports = [EpochReport(**{**r, "expert_load": None if r["expert_load"] is None else
                              {node: tuple(counts) for node, counts in r["expert_load"].items()}})
               for r in written[0]["reports"]]
    return NodesTrained(reports, load_weights(_weights_file(folder, check)), written[0]["on_epoch_calls"],
                        [w["device"] for w in written], [w["seconds"] for w in written])


# -- a node ---------------------------------------------------------------------------------------


def _take_cores(rank: int) -> None:
    """This node's share of the machine's cores (rank-th of every NODES), as a node has its own."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return
    if len(cores) >= NODES:
        os.sched_setaffinity(0, cores[rank::NODES])


def node_main(spec_path: str) -> int:
    """One node: start the backend's node, then train each check's scenario with this node's place
    in the layout, writing after each what it trained on (node 0: its reports and weights too) to
    the spec's folder."""
    from dataclasses import asdict

    from aiperf_core.atomic import write_text_atomic
    from aiperf_core.weights import save_weights
    from aiperf_conformance.levels.parallel import backend_from_spec, scenario_of, train_scenario

    spec = json.loads(Path(spec_path).read_text())
    rank = spec["node_rank"]
    _take_cores(rank)
    backend = backend_from_spec(spec)
    # Before anything touches a device, as a run's nodes do (aiperf_core.replica_nodes): the launch's
    # coordinator; devices_per_node is each trial's business.
    backend.start_node(ReplicaLayout(nodes=NODES, node_rank=rank, coordinator_addr=ADDR,
                                     coordinator_port=spec["launch_port"], timeout_s=NODE_TIMEOUT_S))
    devices = list(backend.devices())
    # A node that sees a device per node (several accelerators on one host) takes its own.
    device = devices[rank] if len(devices) >= NODES else devices[0]
    for check, port in zip(spec["checks"], spec["trial_ports"]):
        scenario = scenario_of(check, spec["quick"])
        layout = ReplicaLayout(nodes=NODES, devices_per_node=1, node_rank=rank, local_devices=(device,),
                               coordinator_addr=ADDR, coordinator_port=port, expert_parallel=scenario.expert_parallel,
                               timeout_s=NODE_TIMEOUT_S)
        calls: list[EpochReport] = []
        start = time.monotonic()
        reports, weights = train_scenario(backend, scenario, spec["seed"], (device,), layout,
                                          calls.append if layout.leads else None)
        seconds = time.monotonic() - start
        if layout.leads:  # the weights first: the result file says this node is done with the check
            save_weights(weights, _weights_file(spec["out"], check))
        written = {"device": device, "reports": [asdict(r) for r in reports], "on_epoch_calls": len(calls),
                   "seconds": seconds}
        write_text_atomic(_result_file(spec["out"], rank, check), json.dumps(written))
    return 0
