"""The kit's parallel/*multi_node* checks against fake backends built on the NumPy reference.

A replica across nodes, emulated: every node process meets its peer over TCP at the trial's
coordinator, then trains the whole global batch (what the nodes' group computes together). It
passes the three multi-node checks. Each planted fault fails with its own message: node 0 without
the follower's experts, node 0 reporting other losses, a follower that never exits (stopped at the
bound), a follower that fails (and the checks after it are not run). A backend without multi-node
support passes the refusal check only when it refuses in one line that quotes its declared reason,
before training."""

from __future__ import annotations

import atexit
import socket
import time
from dataclasses import replace

import pytest

from aiperf_core.backend import BackendError, Parallelism, train_world
from aiperf_conformance import multi_node
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import Context, catalogue, collect, run_check
from aiperf_conformance.levels.parallel import (DATA_PARALLEL_CHECKS, EXPERT_PARALLEL_CHECK, MULTI_NODE_CHECKS,
                                                MULTI_NODE_EXPERT_CHECK, MULTI_NODE_REFUSED, _multi_node,
                                                run_scenarios)
from test_conformance_expert_parallel import first_half_of_experts
from test_conformance_parallel import TwoDevices

MULTI_NODE = Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True, multi_node=True,
                         notes="emulated")
REASON = "emulated on one host only"


def _meet(layout) -> None:
    """Node 0 accepts its peer at the coordinator, the peer connects there: each waits for the other
    (at most layout.timeout_s), as a real rendezvous does."""
    deadline = time.monotonic() + layout.timeout_s
    if layout.leads:
        with socket.create_server((layout.coordinator_addr, layout.coordinator_port)) as server:
            server.settimeout(layout.timeout_s)
            peer, _ = server.accept()
            with peer:
                peer.sendall(b"go")
        return
    while True:
        try:
            with socket.create_connection((layout.coordinator_addr, layout.coordinator_port), timeout=1.0) as peer:
                assert peer.recv(2) == b"go"
                return
        except OSError:
            if time.monotonic() > deadline:
                raise BackendError(f"node {layout.node_rank}: node 0 never came to "
                                   f"{layout.coordinator_addr}:{layout.coordinator_port}") from None
            time.sleep(0.05)


class TwoNodes(TwoDevices):
    """Correct, emulated: the nodes meet, then each trains the global batch; an expert-parallel run
    reports a measured exchange time."""

    name = "twonodes"
    started = None

    def parallelism(self):
        return MULTI_NODE

    def start_node(self, layout):
        self.started = layout

    def train_checked(self, model, data, config, on_epoch):
        across = config.layout is not None and config.layout.multi_node
        if across:
            assert self.started is not None, "start_node was not called before train"
            _meet(config.layout)
        reports = super().train_checked(model, data, config, on_epoch)
        if config.expert_parallel and train_world(self, config) > 1:
            reports = [replace(r, all_to_all_seconds=0.002) for r in reports]
        return reports


class FollowersExpertsMissing(TwoNodes):
    """Node 0 exports only its own half of every expert stack after training across nodes."""

    name = "followersexpertsmissing"
    sharded = False

    def train_checked(self, model, data, config, on_epoch):
        self.sharded = config.layout is not None and config.layout.multi_node and config.expert_parallel
        return super().train_checked(model, data, config, on_epoch)

    def export_weights(self, model):
        weights = super().export_weights(model)
        return first_half_of_experts(model.graph, weights) if self.sharded else weights


class OtherLosses(TwoNodes):
    """Node 0 reports 2% more loss than it trained at across nodes (its own shard's, say)."""

    name = "otherlosses"

    def train_checked(self, model, data, config, on_epoch):
        reports = super().train_checked(model, data, config, on_epoch)
        if config.layout is not None and config.layout.multi_node:
            reports = [replace(r, loss=r.loss * 1.02) for r in reports]
        return reports


class FollowerNeverExits(TwoNodes):
    """The follower trains every trial, then waits for ever as its process exits."""

    name = "followerneverexits"

    def start_node(self, layout):
        super().start_node(layout)
        if layout.node_rank == 1:
            atexit.register(waits_on_a_peer_that_left)


def waits_on_a_peer_that_left():
    time.sleep(3600)


class FollowerFails(TwoNodes):
    name = "followerfails"

    def train_checked(self, model, data, config, on_epoch):
        if config.layout is not None and config.layout.node_rank == 1:
            _meet(config.layout)
            raise BackendError("node 1: the gradients' all-reduce failed")
        return super().train_checked(model, data, config, on_epoch)


class WithoutMultiNode(TwoDevices):
    name = "withoutmultinode"

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True,
                           multi_node_why_not=REASON)


class NoReason(TwoDevices):
    name = "noreason"

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True)


class TrainsAcrossNodesSilently(WithoutMultiNode):
    """Declares no multi-node support, and bypasses the contract's check: trains node 0's part alone."""

    name = "silentnodes"

    def train(self, model, data, config, on_epoch=None):
        return self.train_checked(model, data, config, on_epoch)


class RefusesWithoutQuoting(WithoutMultiNode):
    name = "refuseswithoutquoting"

    def train(self, model, data, config, on_epoch=None):
        raise BackendError("no\nmulti-node here")


def multi_node_results(backend, *names):
    return _multi_node(backend, list(names), 0, 1e-4, True)


def multi_node_result(backend, name):
    return multi_node_results(backend, name)[name]


def refusal_result(backend):
    return run_scenarios(backend, 0, True, 1e-4, workloads=["cnn"])[MULTI_NODE_REFUSED]


def test_emulated_nodes_pass_every_multi_node_check():
    ctx = Context(TwoNodes(), Expectations(), quick=True, device="cpu:0")
    checks = [c for c in collect(ctx, ["parallel"]) if "multi_node" in c.name]
    results = {c.name: run_check(ctx, c) for c in checks}
    assert set(results) == set(MULTI_NODE_CHECKS) | {MULTI_NODE_EXPERT_CHECK}
    for name, result in results.items():
        assert result.status == "pass", (name, result.message)
        assert "2 nodes x 1 device (node 0: cpu:0, node 1: cpu:1) vs 1 device (cpu:0)" in result.message
        assert "the nodes trained it in" in result.message
    assert "19 training images counted exactly" in results["multi_node_matches_one_device"].message
    assert "35 training images counted exactly" in results["gpt_multi_node_matches_one_device"].message
    experts = results[MULTI_NODE_EXPERT_CHECK].message
    assert "expert load equal every epoch" in experts and "all-to-all seconds per epoch measured: 0.002" in experts


def test_node_0_without_the_followers_experts_fails():
    outcome = multi_node_result(FollowersExpertsMissing(), MULTI_NODE_EXPERT_CHECK)
    assert not outcome.passed
    assert "node 0 does not hold the whole model after training: node 'm1_moe' weight" in outcome.message
    assert "has shape [2," in outcome.message and "not [4," in outcome.message


def test_other_losses_on_node_0_fail():
    outcome = multi_node_result(OtherLosses(), "gpt_multi_node_matches_one_device")
    assert not outcome.passed
    assert "largest relative difference 0.02 (epoch 0 loss" in outcome.message
    assert outcome.measured > 1e-2


@pytest.mark.slow
def test_a_node_that_never_exits_is_stopped_at_the_bound(monkeypatch):
    # Both nodes start and train the emulated checks in about a second (the failing launch's test takes 1.5 s).
    monkeypatch.setattr(multi_node, "NODE_EXIT_BOUND_S", 8.0)
    first, last = multi_node_results(FollowerNeverExits(), *MULTI_NODE_CHECKS).values()
    assert first.passed, first.message  # both nodes trained it; the follower hangs only as it exits
    assert not last.passed
    head, *account = last.message.splitlines()
    assert head.startswith("after training every check, node(s) 1 did not exit within 8 s of the launch and "
                           "were stopped (SIGABRT, then SIGKILL): every node of a replica must end when its "
                           "training does (node 0 exited 0 after")
    # faulthandler's stack of the stopped node says where it hung.
    assert "node 1's log:" in account[0] and "in waits_on_a_peer_that_left" in "\n".join(account)


def test_a_node_that_fails_is_named_with_its_error_and_ends_the_launch(monkeypatch):
    monkeypatch.setattr(multi_node, "GRACE_S", 1.0)  # node 0 waits for its peer in the second check
    first, second = multi_node_results(FollowerFails(), *MULTI_NODE_CHECKS).values()
    assert not first.passed and not second.passed
    head, *account = first.message.splitlines()
    assert head.startswith("node 1 failed (exit status 1 after")
    assert "BackendError: node 1: the gradients' all-reduce failed" in "\n".join(account)
    assert second.message == f"not run: the nodes ended in 'multi_node_matches_one_device' ({head})"


def test_a_backend_without_multi_node_support_refuses_quoting_its_reason():
    found = refusal_result(WithoutMultiNode())
    assert found["passed"], found["message"]
    assert found["message"] == (f"a replica of 2 nodes refused: backend 'withoutmultinode' does not train a replica "
                                f"across nodes: {REASON}")
    results = run_scenarios(WithoutMultiNode(), 0, True, 1e-4)
    assert set(results) == set(DATA_PARALLEL_CHECKS) | {EXPERT_PARALLEL_CHECK, MULTI_NODE_REFUSED}


def test_a_refusal_without_a_reason_fails():
    found = refusal_result(NoReason())
    assert not found["passed"]
    assert found["message"] == ("backend 'noreason' declares no multi-node support and gives no reason in "
                                "Parallelism.multi_node_why_not")


def test_training_across_nodes_without_declaring_it_fails():
    found = refusal_result(TrainsAcrossNodesSilently())
    assert not found["passed"]
    assert "declares no multi-node support but trained with a layout of 2 nodes" in found["message"]


def test_a_refusal_in_several_lines_without_the_reason_fails():
    found = refusal_result(RefusesWithoutQuoting())
    assert not found["passed"]
    assert "not in one line that quotes Parallelism.multi_node_why_not" in found["message"]


def test_list_names_every_multi_node_check_with_its_workload():
    listed = {c.name: c for c in catalogue(["parallel"])}
    assert {n: listed[n].workload for n in (*MULTI_NODE_CHECKS, MULTI_NODE_EXPERT_CHECK, MULTI_NODE_REFUSED)} == {
        "multi_node_matches_one_device": "cnn", "gpt_multi_node_matches_one_device": "lm",
        MULTI_NODE_EXPERT_CHECK: "lm", MULTI_NODE_REFUSED: "cnn"}
    assert "moe" in listed[MULTI_NODE_EXPERT_CHECK].ops
