"""The lm rules' nodes per replica (docs/search.md, "The official LM track"): `auto` is 2 where the
machine has 2 or more nodes, else 1; a run on 2 or more nodes whose replicas span another number is
unofficial; a one-node run says that no network was loaded; each list names its rules version."""

from __future__ import annotations

import os
import stat

import pytest

from aiperf_core.errors import AiperfError
from aiperf_core.policy import Policy, PolicyError
from aiperf_core.report import replica_nodes
from aiperf_core.report.page import _replica_nodes
from aiperf_core.scoring.rules import (RULES_VERSIONS, official_nodes_per_replica, replica_nodes_reasons,
                                       validity_reasons)
from aiperf_core.workflow.executors.hosts import HostsExecutor
from aiperf_core.workflow.executors.local import LocalExecutor
from aiperf_core.workflow.executors.slurm import SlurmExecutor
from aiperf_core.workflow.plan import RunRequest, resolve_nodes_per_replica, watch_settings


def _run(workload="lm", executor="slurm", replicas=1, nodes=2, **extra):
    return {"executor": executor, "replicas": replicas, "policy": {"workload": workload, "nodes_per_replica": nodes},
            **extra}


def test_the_lm_track_defaults_to_auto_and_the_cnn_track_to_one_node():
    assert Policy({"workload": "lm"})["nodes_per_replica"] == "auto"
    assert Policy({"workload": "lm", "nodes_per_replica": 3})["nodes_per_replica"] == 3
    assert Policy()["nodes_per_replica"] == 1
    with pytest.raises(PolicyError, match=r"^policy.nodes_per_replica: 'auto' must be an integer$"):
        Policy({"nodes_per_replica": "auto"}, source="policy")
    with pytest.raises(PolicyError, match=r"^policy.nodes_per_replica: 0 must be auto or an integer >= 1$"):
        Policy({"workload": "lm", "nodes_per_replica": 0}, source="policy")


def test_auto_is_two_nodes_where_the_machine_has_two_or_more():
    def never():
        raise AssertionError("a number is not resolved against the machine")

    assert [resolve_nodes_per_replica("auto", lambda n=n: n) for n in (1, 2, 64)] == [1, 2, 2]
    assert resolve_nodes_per_replica(3, never) == 3


def test_each_executor_counts_its_machine_nodes(tmp_path, monkeypatch):
    assert LocalExecutor.machine_nodes(watch_settings(RunRequest())) == 1
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n# node2 slots=1\nnode2 slots=1\n")
    watch = watch_settings(RunRequest(executor="hosts", hosts={"hostfile": str(hostfile)}))
    assert HostsExecutor.machine_nodes(watch) == 3
    # SLURM: the partition's nodes, summed over sinfo's lines (one per node state).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sinfo = bin_dir / "sinfo"
    sinfo.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\nprintf "3\\n1\\n"\n')
    sinfo.chmod(sinfo.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    watch = watch_settings(RunRequest(executor="slurm", slurm={"partition": "gpu"}))
    assert SlurmExecutor.machine_nodes(watch) == 4
    assert (bin_dir / "args").read_text().split() == ["--noheader", "--format", "%D", "--partition", "gpu"]
    sinfo.write_text('#!/bin/sh\necho "sinfo: error: invalid partition specified: gpu" >&2\nexit 1\n')
    with pytest.raises(AiperfError, match=r"^--nodes-per-replica auto: sinfo did not count the nodes of partition "
                                          r"gpu \(sinfo: error: invalid partition specified: gpu\); give "
                                          r"--nodes-per-replica N$"):
        SlurmExecutor.machine_nodes(watch)


def test_an_lm_run_on_two_or_more_nodes_needs_two_nodes_a_replica():
    assert official_nodes_per_replica(_run(replicas=1, nodes=1)) == 1  # a one-node machine
    assert replica_nodes_reasons(_run(replicas=1, nodes=1)) == []
    assert replica_nodes_reasons(_run(replicas=4, nodes=2)) == []
    assert replica_nodes_reasons(_run(replicas=4, nodes=1)) == [
        "nodes_per_replica is 1 on 4 node(s), not 2 (the lm rules: 2 nodes a replica where the machine has 2 or "
        "more, so that every step's gradients cross the network)"]
    assert "nodes_per_replica is 4 on 4 node(s), not 2" in replica_nodes_reasons(_run(replicas=1, nodes=4))[0]
    # The local executor's node processes share one machine: one node a replica is the rules' value there.
    assert "nodes_per_replica is 2 on one machine (the local executor), not 1" in \
        replica_nodes_reasons(_run(executor="local", nodes=2))[0]
    assert replica_nodes_reasons(_run(workload="cnn", replicas=4, nodes=1)) == []  # the CNN keeps its one node


def test_a_run_made_under_other_rules_is_unofficial():
    base = _run(replicas=1, nodes=2, dataset={"name": "enwik8"}, model="gpt2_small")
    assert RULES_VERSIONS == {"cnn": 1, "lm": 2}
    old = validity_reasons(base, [], 0.1)  # no rules_version recorded: version 1
    assert "made under the lm rules version 1, not the current 2 (run.json rules_version)" in old
    assert not any("rules version" in r for r in validity_reasons({**base, "rules_version": 2}, [], 0.1))


def test_the_summary_and_report_say_whether_a_network_was_loaded():
    assert replica_nodes(_run(nodes=2)) == {"nodes_per_replica": 2, "network_loaded": True}
    assert replica_nodes(_run(nodes=1)) == {"nodes_per_replica": 1, "network_loaded": False}
    assert replica_nodes(_run(executor="local", nodes=2))["network_loaded"] is False
    assert _replica_nodes({"nodes_per_replica": 2, "network_loaded": True, "executor": "slurm"}) == \
        "2: every step's gradients crossed the network"
    assert _replica_nodes({"nodes_per_replica": 1, "network_loaded": False}) == "1: no network was loaded"
    assert _replica_nodes({"nodes_per_replica": 2, "network_loaded": False, "executor": "local"}) == \
        "2 processes on one machine: no network was loaded"


def test_aiperf_run_resolves_auto_against_the_hostfile_and_says_so(tmp_path, capsys):
    from aiperf_core.cli import main

    (tmp_path / "hosts").write_text("node0 slots=1\nnode1 slots=1\n")
    (tmp_path / "lm.toml").write_text('executor = "hosts"\nworkload = "lm"\n')
    # numpy trains one device in one process: the two nodes auto gives are refused, in one line after the note.
    assert main(["run", "--config", str(tmp_path / "lm.toml"), "--backend", "numpy", "--hostfile",
                 str(tmp_path / "hosts"), "--run-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "nodes_per_replica auto: 2, the machine has 2 nodes (executor hosts)",
        "aiperf: error: --nodes-per-replica 2: backend numpy does not train a replica across nodes: the reference "
        "executor trains on one CPU device, in one process"]
    assert not (tmp_path / "run").exists()
