"""The scale simulation (aiperf_core.workflow.simulation): the real primary, history and scoring
over simulated replicas on a virtual clock. The score must equal the operations counted by hand."""

from __future__ import annotations

import time

import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.morph.cnn import random_morph
from aiperf_core.rundir import EventLog, RunDir, read_events
from aiperf_core.scoring import score_run, verify_run
from aiperf_core.search.history import SharedHistory
from aiperf_core.workflow.simulation import (NasCostModel, ReplicaModel, VirtualClock, expected_ops, simulate,
                                             write_graph_pool, write_weights_stand_in)

REPLICAS = 4
BUDGET_S = 1050.0
EPOCH_S = 100.0  # of the initial graph; the morph's epochs take longer or shorter by its ops
POLICY = {"patience_min": 2, "patience_max": 2}  # with improving_epochs=1: every trial trains 3 epochs


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory):
    import numpy as np

    work = tmp_path_factory.mktemp("simulation")
    initial = resnet_small((32, 32, 3), 10)
    morphed = random_morph(initial, None, np.random.default_rng(1)).graph
    pool = write_graph_pool([initial, morphed], work / "pool")
    model = ReplicaModel(device_ops_per_s=expected_ops(pool[0], ReplicaModel(1.0)) / EPOCH_S, devices=1,
                         improving_epochs=1)
    weights = work / "pool" / "weights.npz"
    write_weights_stand_in(weights)
    result = simulate(work / "run", REPLICAS, BUDGET_S, model, pool, weights, start_time=1.8e9,
                      poll_interval_s=5.0, policy=POLICY)
    return result, pool, model


def hand_counted_ops(pool, model) -> int:
    """Every replica: trial 0 on the initial graph, later trials on the morph (the simulation's
    rule for a two-graph pool), 3 epochs each; an epoch counts if it ends by the deadline."""
    total = 0
    for _ in range(REPLICAS):
        t, trial = 0.0, 0
        while t < BUDGET_S:
            graph = pool[0] if trial == 0 else pool[1]
            ops = expected_ops(graph, model)
            for _ in range(3):
                t += ops / model.device_ops_per_s
                if t <= BUDGET_S:
                    total += ops
            trial += 1
    return total


def test_the_score_is_the_hand_counted_operations_over_the_budget(simulated_run):
    result, pool, model = simulated_run
    assert result.end_reason == "deadline"
    scored = score_run(result.run_dir, now=1.8e9 + BUDGET_S)
    assert scored.total_ops == hand_counted_ops(pool, model)
    assert scored.score_ops == pytest.approx(hand_counted_ops(pool, model) / BUDGET_S, rel=1e-12)
    assert scored.epochs_uncountable == 0


def test_the_run_directory_is_what_real_replicas_and_primary_write(simulated_run):
    result, _, _ = simulated_run
    assert verify_run(result.run_dir) == []
    primary_events = [e["event"] for e in read_events(result.run_dir.primary_log)]
    assert primary_events[0] == "run_start" and primary_events[-1] == "run_end"
    assert primary_events.count("replica_launch") == REPLICAS  # nobody was lost or restarted
    for replica in range(REPLICAS):
        events = read_events(result.run_dir.replica_log(replica))
        assert events[0]["event"] == "replica_start"
        starts = [e for e in events if e["event"] == "trial_start"]
        assert starts[0]["trial"] == f"r{replica:04d}-t00000" and starts[0]["graph_sha256"]


def test_the_shared_history_reads_every_ended_trial(simulated_run):
    result, _, _ = simulated_run
    history = SharedHistory(result.run_dir)
    history.refresh()
    assert len(history.records) == result.trials_ended > 0
    assert result.primary_s >= 0 and result.trials_started >= result.trials_ended


def test_a_virtual_clock_stamps_only_what_is_given_it(tmp_path):
    clock = VirtualClock(100.0)
    run_dir = RunDir(tmp_path, clock)
    assert EventLog(run_dir.primary_log, clock).append("run_start")["time"] == 100.0
    clock.sleep(5.0)
    run_dir.write_heartbeat(0)
    assert run_dir.read_heartbeat(0)["time"] == 105.0 and clock.monotonic() == 105.0
    assert RunDir(tmp_path) == run_dir  # the clock is not part of a run directory's identity
    # Writers without it keep the real clock.
    assert EventLog(tmp_path / "other.jsonl").append("run_start")["time"] > 1e9 and time.time() > 1e9


def test_nas_cost_is_interpolated_and_extrapolated():
    cost = NasCostModel([100, 1000, 10000], [0.01, 0.1, 1.0])
    assert cost(550) == pytest.approx(0.055)
    assert cost(20000) == pytest.approx(2.0)
    assert NasCostModel.free()(10**6) == 0.0
