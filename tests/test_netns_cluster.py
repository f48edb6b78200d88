"""The multi-node test cluster (tests/netns_cluster.py): two network namespaces as two nodes under
SLURM, a gloo all-reduce between them that the links count and the shaper slows, a link taken
down and up, and nothing left behind when a cluster stops or after a test process was killed."""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns_cluster import STATE, NetnsCluster, netns_cluster, start_or_skip  # noqa: F401 (the fixture)

NUMEL = 2_000_000  # float32: 8 MB a rank, 0.3 s an all-reduce at 200 Mbit/s
SHAPED_MBIT = 200
RENDEZVOUS_PORT = 29500  # on node1, whose namespace only this module's processes use

# One rank of a two-node gloo group: for each count it reads, `count` all-reduces of NUMEL floats
# that hold rank + 1, then one line: the seconds they took and the first element of the sum.
GLOO_RANK = """
import sys, time
import torch, torch.distributed as dist
rank, rendezvous, numel = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://{rendezvous}", rank=rank, world_size=2)
tensor = torch.empty(numel)
print("ready", flush=True)
for line in sys.stdin:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(line)):
        tensor.fill_(rank + 1)
        dist.all_reduce(tensor)
    print(time.perf_counter() - start, float(tensor[0]), flush=True)
"""

# Connects from a node to ADDRESS:PORT and says whether anything answered there (a connection or a
# refusal both come from the other node's kernel) or the link stayed silent.
PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
    print("answered")
except ConnectionRefusedError:
    print("answered")
except OSError as error:
    print("silent", error)
"""


def _node_output(cluster, node, argv, timeout=30) -> str:
    process = cluster.run_on(node, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output
    return output


def _read_line(process, timeout_s: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    assert ready, f"no answer from {process.args} in {timeout_s} s"
    line = process.stdout.readline()
    assert line, f"{process.args} ended with {process.wait()}"
    return line


def _commands_in(namespace: str) -> list[str]:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    commands = []
    for pid in pids:
        try:
            commands.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return commands


def _leftovers(cluster: NetnsCluster, pids: list[int]) -> list[str]:
    """What of the cluster is still on this machine: its namespaces, devices, state file and processes."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    devices = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    left = [line for line in namespaces.splitlines() if cluster.id in line]
    left += [line.split(":")[1].strip() for line in devices.splitlines() if cluster.id in line]
    left += [str(path) for path in STATE.glob(f"{cluster.id}.json")]
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.append(f"process {pid}")
    return left


@pytest.fixture(scope="module")
def gloo_ranks(netns_cluster, tmp_path_factory):
    """A gloo group of two ranks, one on each node, rendezvous at node1's address; yields
    all_reduce(count) -> (seconds, first element of the sum, {node: (bytes sent, bytes received)})."""
    cluster = netns_cluster
    rendezvous = f"{cluster.address('node1')}:{RENDEZVOUS_PORT}"
    log = open(tmp_path_factory.mktemp("gloo") / "ranks.log", "w")
    ranks = [cluster.run_on(node, [sys.executable, "-c", GLOO_RANK, str(rank), rendezvous, str(NUMEL)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
             for rank, node in enumerate(cluster.nodes)]

    def all_reduce(count: int):
        before = {node: cluster.link_bytes(node) for node in cluster.nodes}
        for rank in ranks:
            rank.stdin.write(f"{count}\n")
            rank.stdin.flush()
        answers = [_read_line(rank, 120).split() for rank in ranks]
        moved = {node: tuple(after - start for after, start in zip(cluster.link_bytes(node), before[node]))
                 for node in cluster.nodes}
        return max(float(answer[0]) for answer in answers), [float(answer[1]) for answer in answers], moved

    try:
        for rank in ranks:
            assert _read_line(rank, 120).strip() == "ready"
        yield all_reduce
    finally:
        for rank in ranks:
            rank.stdin.close()
        for rank in ranks:
            try:
                rank.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rank.kill()
        log.close()


def test_srun_runs_a_task_on_each_node_with_its_own_name_and_address(netns_cluster):
    names = subprocess.run(["srun", "-N2", "hostname"], env=netns_cluster.env, capture_output=True, text=True,
                           timeout=60)
    assert names.returncode == 0, names.stderr
    assert sorted(names.stdout.split()) == ["node1", "node2"]

    # Each task: its hostname, what the name resolves to (gloo binds there), and its eth0's address.
    whoami = ("import socket, subprocess; name = socket.gethostname(); "
              "print(name, socket.gethostbyname(name), "
              "subprocess.check_output(['ip', '-4', '-o', 'addr', 'show', 'dev', 'eth0'], text=True).split()[3])")
    tasks = subprocess.run(["srun", "-N2", sys.executable, "-c", whoami], env=netns_cluster.env,
                           capture_output=True, text=True, timeout=60)
    assert tasks.returncode == 0, tasks.stderr
    expected = sorted(f"{node} {netns_cluster.address(node)} {netns_cluster.address(node)}/24"
                      for node in netns_cluster.nodes)
    assert sorted(tasks.stdout.strip().splitlines()) == expected


def test_launcher_template_runs_a_command_on_the_host_as_ssh_would(netns_cluster):
    assert netns_cluster.hostfile() == "node1 slots=1\nnode2 slots=1\n"
    for node in netns_cluster.nodes:
        # The executor's way: the template's {host} filled in, the command's words after it, one
        # shell line; and, as with ssh, the words reach the node's shell joined.
        line = netns_cluster.launcher_template().format(host=node) + " 'echo $(hostname)' on '$(hostname -i)'"
        answer = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=30)
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout.split() == [node, "on", netns_cluster.address(node)]

    # The hosts executor's way (a launcher's words, then the command's, quoted) and its way of
    # stopping a node: a signal to the launcher ends the command on the node.
    launcher = [part.replace("{host}", "node2") for part in shlex.split(netns_cluster.launcher_template())]
    sleeper = subprocess.Popen([*launcher, *map(shlex.quote, ["sleep", "60"])])
    namespace = netns_cluster.namespace("node2")
    deadline = time.monotonic() + 10
    while "sleep" not in _commands_in(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "sleep" in _commands_in(namespace)
    sleeper.terminate()
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    assert "sleep" not in _commands_in(namespace)


def test_gloo_all_reduce_across_the_nodes_crosses_their_links(netns_cluster, gloo_ranks):
    count = 2
    _, sums, moved = gloo_ranks(count)
    assert sums == [3.0, 3.0]  # ranks hold 1 and 2
    # A ring all-reduce sends and receives 2(n-1)/n of the tensor per rank; with n = 2, the tensor.
    implied = 2 * (2 - 1) / 2 * NUMEL * 4 * count
    for node, (sent, received) in moved.items():
        assert sent >= implied and received >= implied, (node, moved, implied)
        assert sent < 1.2 * implied, (node, moved, implied)  # and not much more: the links carry only it


def test_all_reduce_bandwidth_follows_the_shaped_rate(netns_cluster, gloo_ranks):
    count = 2
    unshaped_seconds, _, _ = gloo_ranks(count)
    try:
        for node in netns_cluster.nodes:
            netns_cluster.shape(node, SHAPED_MBIT)
        shaped_seconds, sums, _ = gloo_ranks(count)
    finally:
        for node in netns_cluster.nodes:
            netns_cluster.shape(node, None)
    assert sums == [3.0, 3.0]
    unshaped, shaped = (NUMEL * 4 * count / seconds for seconds in (unshaped_seconds, shaped_seconds))
    rate = SHAPED_MBIT * 1e6 / 8  # bytes per second on each direction of each link
    # With two ranks, each sends the tensor's size per all-reduce over its shaped link: the
    # all-reduce moves at most at the rate (plus the bucket's 5 ms), and a busy machine does not
    # make it crawl. Measured here: 24.0 MB/s of 25, and unshaped 375 to 690 MB/s.
    assert 0.3 * rate < shaped < 1.1 * rate, (shaped, rate)
    assert unshaped > 1.5 * shaped, (unshaped, shaped)


def test_a_link_taken_down_silences_the_node_and_comes_back(netns_cluster):
    target = [netns_cluster.address("node1"), str(RENDEZVOUS_PORT + 1)]
    probe = [sys.executable, "-c", PROBE, *target]
    assert _node_output(netns_cluster, "node2", probe).split()[0] == "answered"
    netns_cluster.set_link("node1", False)
    try:
        assert _node_output(netns_cluster, "node2", probe).split()[0] == "silent"
    finally:
        netns_cluster.set_link("node1", True)
    deadline = time.monotonic() + 20  # the bridge port forwards again at once; ARP may take a moment
    while (answer := _node_output(netns_cluster, "node2", probe).split()[0]) != "answered" \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert answer == "answered"


def test_stop_leaves_nothing_behind(tmp_path):
    cluster = start_or_skip(NetnsCluster(tmp_path, rate_mbit=SHAPED_MBIT))
    try:
        sleeper = cluster.run_on("node2", ["sleep", "600"])  # a task the cluster must end at stop
        pids = [daemon.pid for daemon in cluster.daemons] + [sleeper.pid]
        # What the check must see while the cluster runs: 2 namespaces, a bridge and 2 veth ends,
        # the state file, and the processes (slurmctld, 2 slurmd, the task).
        assert len(_leftovers(cluster, pids)) == 2 + 3 + 1 + len(pids), _leftovers(cluster, pids)
    finally:
        cluster.stop()
    sleeper.wait(timeout=10)
    assert _leftovers(cluster, pids) == []


def test_a_start_removes_what_a_killed_test_process_left(tmp_path):
    # A test process that started a cluster and a task on it, then died without stopping it.
    crashed = subprocess.run(
        [sys.executable, "-c",
         "import json, os, pathlib, signal, subprocess, sys; sys.path.insert(0, sys.argv[2]);"
         "from netns_cluster import NetnsCluster;"
         "cluster = NetnsCluster(pathlib.Path(sys.argv[1])).start();"
         "sleeper = cluster.run_on('node1', ['sleep', '600'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
         "print(json.dumps({'id': cluster.id, 'pids': [d.pid for d in cluster.daemons] + [sleeper.pid]}),"
         " flush=True);"
         "os.kill(os.getpid(), signal.SIGKILL)",
         str(tmp_path / "crashed"), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120)
    if "NamespacesUnavailable" in crashed.stderr:
        pytest.skip(f"no multi-node cluster: {crashed.stderr.strip().splitlines()[-1]}")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    left = json.loads(crashed.stdout)
    dead = NetnsCluster(tmp_path / "crashed")
    dead.id = left["id"]
    assert _leftovers(dead, left["pids"]), "the killed process left its cluster"

    cluster = start_or_skip(NetnsCluster(tmp_path / "next"))
    try:
        assert _leftovers(dead, left["pids"]) == []
    finally:
        cluster.stop()
