"""A replica across nodes (docs/workflow.md, "A replica across nodes"), end to end: `aiperf run
--nodes-per-replica 2` on the local executor (two processes that meet over TCP), under SLURM and
through a hostfile launcher on a two-node cluster of network namespaces (tests/netns_cluster.py),
with torch and jax; and the faults: a node killed, a link taken down in the middle of an epoch,
each ending the trial within the bound with one line that names the lost host, nothing left
running."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from aiperf_core.ir import Graph
from aiperf_core.rundir import read_events
from netns_cluster import netns_cluster  # noqa: F401 (the fixture)
from slurm_cluster import aiperf_argv

NODE_TIMEOUT_S = 20
# The fault tests' bound: each lost node is noticed at about twice it (a collective's timeout, then the
# teardown), so a short one keeps them short; joining and the slowest step of a healthy trial take well
# under it, even on two busy cores.
FAULT_TIMEOUT_S = 10
# The smallest GPT the lm workload grows, a few steps an epoch, two epochs a trial.
TINY_LM = """workload = "lm"
[policy]
initial_architecture = "gpt_tiny"
precision = "fp32"
epoch_tokens = 2048
val_tokens = 1024
max_epochs = 2
batch_size = 8
reference_batch_size = 8
node_timeout_s = {timeout}
"""


def _run(tmp_path, backend, *extra, env=None, trials=2, budget="4m", wait=True, timeout=NODE_TIMEOUT_S):
    config = tmp_path / "tiny-lm.toml"
    config.write_text(TINY_LM.format(timeout=timeout))
    run_dir = tmp_path / "run"
    # aiperf_argv: `python -m aiperf_core`, its SLURM executor polling squeue every second, not every 5 s.
    argv = aiperf_argv("run", "--backend", backend, "--nodes-per-replica", "2", "--config", str(config),
                       "--run-dir", str(run_dir), "--time-budget", budget, "--stop-after-trials", str(trials), *extra)
    primary = subprocess.Popen(argv, env={**(env or os.environ), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    if not wait:
        return primary, run_dir
    output, _ = primary.communicate(timeout=600)
    assert primary.returncode == 0, output[-3000:]
    return output, run_dir


def _events(run_dir, kind):
    return [e for e in read_events(run_dir / "replicas/0/events.jsonl") if e["event"] == kind]


def _verify(run_dir):
    answer = subprocess.run([sys.executable, "-m", "aiperf_core", "score", "--verify", str(run_dir)],
                            capture_output=True, text=True)
    assert answer.returncode == 0 and "verify: intact" in answer.stdout, answer.stdout + answer.stderr


def _inventory_hosts(run_dir) -> list[str]:
    from aiperf_core.submission.check import Verdict, _check_run, recorded_inventory

    return recorded_inventory(_check_run(Verdict(str(run_dir)), Path(run_dir))).hosts


def _gradient_bytes_on_each_link(run_dir) -> int:
    """What the trials' data-parallel all-reduce of fp32 gradients sends over each node's link at
    least: a ring of 2 ranks sends 2 (n - 1) / n = 1 times the gradients' bytes per rank a step."""
    total = 0
    batch = {e["trial"]: e["hyper"]["batch_size"] for e in _events(run_dir, "trial_start")}
    for epoch in _events(run_dir, "epoch_end"):
        graph = Graph.from_json((run_dir / "trials" / epoch["trial"] / "graph.json").read_text())
        steps = -(-epoch["train_images"] // batch[epoch["trial"]])
        params = sum(math.prod(shape) for node in graph.nodes for shape in graph.param_shapes(node.id).values())
        total += steps * 4 * params
    return total


def _assert_two_node_run(run_dir, hosts):
    starts = _events(run_dir, "replica_start")
    assert [n["host"] for n in starts[-1]["nodes"]] == hosts
    trials = _events(run_dir, "trial_end")
    assert len(trials) >= 2 and all(t["status"] in ("ok", "early_stopped") for t in trials)
    assert any(e.get("morph") for e in _events(run_dir, "trial_start")), "no morph child trained"
    assert "followed" in (run_dir / "replicas/0/node-1.log").read_text()
    assert (run_dir / "replicas/0/monitor-node1.jsonl").exists()  # every node samples itself
    _verify(run_dir)
    assert sorted(_inventory_hosts(run_dir)) == sorted(hosts)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert sorted(summary["machine"]["hosts"]) == sorted(hosts)


def _nothing_left(run_dir):
    left = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []):
            left.append(process.pid)
    return left


@pytest.mark.slow
def test_a_replica_of_two_local_nodes_meets_over_tcp(tmp_path):
    # One trial: what this checks (the two node processes, their ranks and address, the verified run,
    # nothing left) is all there after the first; the tests below train a morph child on the nodes.
    output, run_dir = _run(tmp_path, "torch", trials=1)
    assert "1 replica(s) x 2 device(s)" in output
    nodes = _events(run_dir, "replica_start")[-1]["nodes"]
    assert [n["node_rank"] for n in nodes] == [0, 1] and all(n["addr"] == "127.0.0.1" for n in nodes)
    assert nodes[0]["pid"] != nodes[1]["pid"]
    _verify(run_dir)
    assert not _nothing_left(run_dir)


def test_layouts_that_do_not_fit_are_refused_in_one_line():
    from aiperf_core.commands.run import _layout
    from aiperf_core.errors import AiperfError
    from aiperf_core.workflow.plan import BackendFacts, WatchSettings, check_parallelism

    facts = BackendFacts(devices=["cpu"], data_parallel=True, multi_node_why_not="MirroredStrategy spans one process")
    with pytest.raises(AiperfError, match=r"^--nodes-per-replica 2: backend tensorflow does not train a replica "
                                          r"across nodes: MirroredStrategy spans one process$"):
        check_parallelism("tensorflow", facts, 2, "--devices-per-replica", 2)
    check_parallelism("torch", BackendFacts(devices=["cpu"], data_parallel=True), 2, "--devices-per-replica", 2)
    watch = WatchSettings(3, 600.0, 30.0, {})
    with pytest.raises(AiperfError, match=r"--devices-per-replica 3: does not divide between the replica's 2 nodes"):
        _layout("local", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 1, 3, watch, 2)
    with pytest.raises(AiperfError, match=r"a replica's 3 accelerators do not divide between its nodes"):
        _layout("local", ["cuda:0", "cuda:1", "cuda:2"], 1, None, watch, 2)
    assert _layout("local", ["cuda:0", "cuda:1", "cuda:2", "cuda:3"], 2, None, watch, 2)[:2] == (2, 2)
    assert _layout("slurm", [], 2, None, WatchSettings(3, 600.0, 30.0, {"gpus_per_node": 4}), 2)[:2] == (2, 8)
    with pytest.raises(AiperfError, match=r"--executor hosts: give --hostfile FILE"):
        _layout("hosts", [], None, None, watch, 2)


def test_a_hostfile_is_read_and_placed(tmp_path):
    from aiperf_core.errors import AiperfError
    from aiperf_core.workflow.executors.base import ReplicaCommand
    from aiperf_core.workflow.executors.hosts import HostsExecutor, place_replicas, read_hostfile

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# four nodes\nn1 slots=4\nn2 slots=4\nn3 slots=4   # spare\n\nn4 slots=4\n")
    hosts = read_hostfile(hostfile)
    assert [(h.name, h.slots) for h in hosts] == [("n1", 4), ("n2", 4), ("n3", 4), ("n4", 4)]
    assert [[h.name for h in group] for group in place_replicas(hosts, None, 2)] == [["n1", "n2"], ["n3", "n4"]]
    with pytest.raises(AiperfError, match=r"--replicas 3 x --nodes-per-replica 2 needs 6 hosts, the hostfile names 4"):
        place_replicas(hosts, 3, 2)
    hostfile.write_text("n1 slots=four\n")
    with pytest.raises(AiperfError, match=r"line 1: 'n1 slots=four' is not 'HOST slots=K'"):
        read_hostfile(hostfile)
    with pytest.raises(AiperfError, match=r"--launcher 'ssh': give a command with \{host\}"):
        HostsExecutor(tmp_path, [hosts[:2]], "ssh")
    command = ReplicaCommand(0, 1, ["python", "-m", "aiperf_core", "replica", "--run-dir", "/r a"], nodes=2)
    argv = HostsExecutor(tmp_path, [hosts[:2]]).node_command(command, 1)
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "n2"]
    assert argv[-3:] == ["'/r a'", "--node-rank", "1"] and f"AIPERF_REPLICA_LAUNCH={command.launch}" in argv


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_two_nodes_under_slurm(netns_cluster, tmp_path, backend):
    before = [netns_cluster.link_bytes(node) for node in netns_cluster.nodes]
    _, run_dir = _run(tmp_path, backend, "--executor", "slurm", env=netns_cluster.env)
    _assert_two_node_run(run_dir, netns_cluster.nodes)
    sent = [netns_cluster.link_bytes(node)[1] - b[1] for node, b in zip(netns_cluster.nodes, before)]
    implied = _gradient_bytes_on_each_link(run_dir)
    # What the replica recorded leaving each node (epoch_end.all_reduce, docs/scoring.md) is the same
    # figure, and the links' own counters carry at least it.
    recorded = sum(e["all_reduce"]["inter_node_bytes"] for e in _events(run_dir, "epoch_end"))
    assert recorded == implied
    assert all(s >= implied for s in sent), (sent, implied)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_two_nodes_through_a_hostfile_launcher(netns_cluster, tmp_path, backend):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(netns_cluster.hostfile())
    _, run_dir = _run(tmp_path, backend, "--executor", "hosts", "--hostfile", str(hostfile), "--launcher",
                      netns_cluster.launcher_template(), env=netns_cluster.env)
    _assert_two_node_run(run_dir, netns_cluster.nodes)


def test_a_node_that_never_joins_is_named_within_the_bound(tmp_path, monkeypatch):
    from aiperf_core.replica_nodes import HOSTS_ENV, NodeError, NodeRoster, expected_hosts

    monkeypatch.setenv(HOSTS_ENV, "node1,node2")
    roster = NodeRoster(tmp_path, "launch1", 0, 2).join()
    try:
        started = time.monotonic()
        with pytest.raises(NodeError, match=r"^node 1 \(node2\) of the replica never joined within 1.5 s$"):
            roster.wait_for_peers([1], 1.5, expected_hosts())
        assert 1.5 <= time.monotonic() - started < 10
        assert roster.lost([1]) == [{"node_rank": 1, "host": "node 1"}]
        assert roster.lost([0]) == []  # its own liveness port answers
    finally:
        roster.leave()


def _training(run_dir, node: int) -> dict | None:
    """Node `node`'s roster record once it trains a trial."""
    for path in (run_dir / "replicas/0/nodes").glob(f"*/node-{node}.json"):
        record = json.loads(path.read_text())
        if record.get("state") == "training":
            return record
    return None


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "link_down"])
def test_a_lost_node_ends_its_trial_within_the_bound(netns_cluster, tmp_path, fault):
    """The killed node's replica is restarted (a new launch on both nodes) and goes on to its last
    trial; the run with the link down gives the replica up (--max-restarts 0)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(netns_cluster.hostfile())
    restarts = "1" if fault == "killed" else "0"
    primary, run_dir = _run(tmp_path, "torch", "--executor", "hosts", "--hostfile", str(hostfile), "--launcher",
                            netns_cluster.launcher_template(), "--max-restarts", restarts, env=netns_cluster.env,
                            trials=3, wait=False, timeout=FAULT_TIMEOUT_S)
    lost = netns_cluster.nodes[1]
    try:
        deadline = time.monotonic() + 240
        while (record := _training(run_dir, 1)) is None or not _events(run_dir, "epoch_end"):
            assert time.monotonic() < deadline and primary.poll() is None, primary.stdout.read()[-3000:]
            time.sleep(0.2)
        time.sleep(0.5)  # into the next epoch's steps
        started = time.monotonic()
        if fault == "killed":
            os.killpg(os.getpgid(record["pid"]), signal.SIGKILL)
        else:
            netns_cluster.set_link(lost, False)
        output, _ = primary.communicate(timeout=FAULT_TIMEOUT_S * 4 + 120)
        ended = time.monotonic() - started
    finally:
        netns_cluster.set_link(lost, True)
        if primary.poll() is None:
            primary.kill()
    log = (run_dir / "replicas/0/replica.log").read_text()
    failed = [e for e in _events(run_dir, "trial_end") if e["status"] == "failed"]
    print(f"{fault}: the run ended {ended:.1f} s after the fault; the trial failed "
          f"{failed[0]['time'] - (time.time() - (time.monotonic() - started)):.1f} s after it" if failed else "")
    assert len(failed) == 1 and f"lost node 1 ({lost})" in failed[0]["reason"], log[-2000:]
    named = [line for line in log.splitlines() if f"lost node 1 ({lost})" in line]
    assert named and all("Traceback" not in line for line in named)
    # The leader notices at the bound (a collective's timeout), then probes the peer for a few seconds.
    assert ended < FAULT_TIMEOUT_S * 2 + 60, ended
    starts = _events(run_dir, "replica_start")
    if fault == "killed":  # restarted on both nodes as a new launch, and on to its last trial
        assert len(starts) == 2 and len(_events(run_dir, "trial_end")) == 3, output[-2000:]
        assert len(list((run_dir / "replicas/0/nodes").iterdir())) == 2
        _verify(run_dir)
    else:
        assert len(starts) == 1
    deadline = time.monotonic() + 30
    while _nothing_left(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _nothing_left(run_dir), [psutil.Process(p).cmdline() for p in _nothing_left(run_dir)]
