"""The scale simulation's network (aiperf_core.network.model, issue #48 item 6): the collectives'
prices against hand-computed values, the fat tree's oversubscription, the calibration from a probe's JSON,
and a simulated run on a slow network scoring less per node than the same run without one."""

from __future__ import annotations

import json

import pytest

from aiperf_core.errors import AiperfError
from aiperf_core.network.model import Network

# Round numbers: 1 GB/s and 10 us between nodes, 10 GB/s and 1 us inside one.
NET = Network(injection_bytes_per_s=1e9, latency_s=1e-5, intra_node_bytes_per_s=1e10, intra_node_latency_s=1e-6,
              nodes_per_leaf=4)


def test_ring_all_reduce_is_its_steps_latency_and_bandwidth_terms():
    # 2 nodes x 4 devices: n = 8, 14 steps of a 2 MB chunk; the node's link (2.01 ms a step) is slower than
    # NVLink's (0.201 ms), so it sets the pace: 14 x (10 us + 2e6 / 1e9 s).
    assert NET.all_reduce_seconds(16e6, 2, 4) == pytest.approx(14 * (1e-5 + 2e-3), rel=1e-12)
    # One node of 4: every link inside it, 6 steps of 4 MB.
    assert NET.all_reduce_seconds(16e6, 1, 4) == pytest.approx(6 * (1e-6 + 4e-4), rel=1e-12)
    # 2 nodes of one device: 2 steps of half the gradients, 2(n-1)/n x G / B = G / B.
    assert NET.all_reduce_seconds(16e6, 2, 1) == pytest.approx(2 * 1e-5 + 16e6 / 1e9, rel=1e-12)
    assert NET.all_reduce_seconds(16e6, 1, 1) == 0.0


def test_all_to_all_is_its_rounds_latency_and_the_slower_of_its_links():
    # 800 MB over 2 nodes x 4 devices in 3 collectives: a node sends P (N-1)/N^2 = 200 MB off-node (0.2 s at
    # 1 GB/s), a rank P (D-1)/n^2 = 37.5 MB to its node's others (3.75 ms at 10 GB/s); 3 x 7 rounds of 10 us.
    assert NET.all_to_all_seconds(8e8, 2, 4, collectives=3) == pytest.approx(3 * 7 * 1e-5 + 0.2, rel=1e-12)
    # On one node only NVLink: 3 x 3 rounds of 1 us, and 800 MB x 3/16 a rank at 10 GB/s.
    assert NET.all_to_all_seconds(8e8, 1, 4, collectives=3) == pytest.approx(9e-6 + 8e8 * 3 / 16 / 1e10, rel=1e-12)
    # A probe's own all-to-all figures take the all-reduce's place.
    probed = NET.with_(all_to_all_bytes_per_s=5e8, all_to_all_latency_s=2e-5)
    assert probed.all_to_all_seconds(8e8, 2, 4) == pytest.approx(7 * 2e-5 + 0.4, rel=1e-12)


def test_oversubscription_slows_only_the_bytes_that_leave_a_leaf():
    tree = NET.with_(oversubscription=4.0)
    # Replicas of 2 nodes packed into leaves of 4: nothing leaves a leaf, as on a non-blocking tree.
    assert tree.all_reduce_seconds(16e6, 2, 4, 4096) == NET.all_reduce_seconds(16e6, 2, 4)
    assert tree.all_to_all_seconds(8e8, 2, 4, 1, 4096) == NET.all_to_all_seconds(8e8, 2, 4)
    # 8 nodes over 2 leaves: the ring leaves each leaf once (f = 1/4, r f = 1: no slower); the all-to-all
    # sends 4 of each node's 7 peers' bytes off-leaf: 4 x 4/7 slower.
    assert tree.slowdown("all_reduce", 8) == 1.0
    assert tree.slowdown("all_to_all", 8) == pytest.approx(16 / 7, rel=1e-12)
    # Replicas of 3 on consecutive nodes: over a period of 12 nodes, 2 of 4 replicas straddle two leaves,
    # each with 2 of its 3 ring links and 4 of its 6 ordered pairs across: f = 4/12 and 8/24.
    assert tree.off_leaf_share("all_reduce", 3) == pytest.approx(1 / 3, rel=1e-12)
    assert tree.off_leaf_share("all_to_all", 3) == pytest.approx(1 / 3, rel=1e-12)
    # Scattered over 16 nodes: a peer is off-leaf with probability 12/15, so 4 x 0.8 = 3.2 times slower.
    scattered = tree.with_(placement="scattered")
    assert scattered.slowdown("all_reduce", 2, 16) == pytest.approx(3.2, rel=1e-12)
    assert scattered.all_reduce_seconds(16e6, 2, 1, 16) == pytest.approx(2 * 1e-5 + 16e6 * 3.2 / 1e9, rel=1e-12)
    with pytest.raises(AiperfError, match="oversubscription"):
        Network(1e9, oversubscription=0.5)


PROBE = {"kind": "aiperf-probe-network", "version": 1, "backend": "torch", "nodes": 2, "ranks": 4,
         "ranks_per_node": 2, "hosts": ["node1", "node2"],
         "collectives": {"all_reduce": [], "all_to_all": []},
         "fit": {"all_reduce": {"latency_s": 60e-6, "busbw_bytes_per_s": 1e10},
                 "all_to_all": {"latency_s": 30e-6, "busbw_bytes_per_s": 4e9}}}


def test_from_probe_reads_a_collectives_latency_per_step_and_its_bus_bandwidth(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(PROBE))
    for source in (PROBE, path, str(path)):
        network = Network.from_probe(source, oversubscription=2.0)
        # The all-reduce's 60 us is its ring's 2(n - 1) = 6 steps; its busbw is the link's rate.
        assert network.latency_s == pytest.approx(1e-5, rel=1e-12)
        assert network.injection_bytes_per_s == 1e10
        # The all-to-all's 30 us is its n - 1 = 3 rounds; a node's link carries 2 ranks' busbw, of which
        # (n - 2)/(n - 1) = 2/3 leaves the node.
        assert network.all_to_all_latency_s == pytest.approx(1e-5, rel=1e-12)
        assert network.all_to_all_bytes_per_s == pytest.approx(4e9 * 2 * 2 / 3, rel=1e-12)
        assert network.oversubscription == 2.0
    without = {**PROBE, "fit": {"all_reduce": PROBE["fit"]["all_reduce"]}}
    assert Network.from_probe(without).all_to_all_bytes_per_s is None
    for bad, message in (({**PROBE, "kind": "other"}, "not an aiperf-probe-network"),
                         ({**PROBE, "nodes": 1, "ranks": 2}, "one node's collectives"),
                         ({**PROBE, "ranks": 3}, "3 ranks are not 2 nodes x 2"),
                         ({**PROBE, "fit": {"all_reduce": {"latency_s": 1e-5, "busbw_bytes_per_s": 0}}},
                          "busbw_bytes_per_s must be > 0")):
        with pytest.raises(AiperfError, match=message):
            Network.from_probe(bad)
    with pytest.raises(AiperfError, match="cannot read it"):
        Network.from_probe(tmp_path / "missing.json")


def test_a_simulated_run_on_a_slow_network_scores_less_per_node(tmp_path):
    """The real primary over 2 replicas of 2 nodes, the same budget with and without a network: an epoch
    lasts its compute plus its steps' ring all-reduces, and the score per node falls by that ratio."""
    from aiperf_core.builders import resnet_small
    from aiperf_core.scoring import score_run
    from aiperf_core.workflow.simulation import (ReplicaModel, expected_ops, simulate, write_graph_pool,
                                                 write_weights_stand_in)

    pool = write_graph_pool([resnet_small((32, 32, 3), 10)], tmp_path / "pool")
    weights = tmp_path / "pool" / "weights.npz"
    write_weights_stand_in(weights)
    graph = pool[0]
    # Small epochs: 2,560 images in batches of 256, 10 all-reduces an epoch.
    base = ReplicaModel(device_ops_per_s=expected_ops(graph, ReplicaModel(1.0, train_images=2560, val_images=256)) / 20,
                        devices=1, train_images=2560, val_images=256, nodes=2, improving_epochs=1)
    slow = Network.link(0.002)  # 2 Mbit/s: resnet_small's 135 kB of gradients take about half a second a step
    budget, scores = 400.0, {}
    for name, network in (("free", None), ("slow", slow)):
        model = ReplicaModel(**{**base.__dict__, "network": network})
        result = simulate(tmp_path / name, 2, budget, model, pool, weights, start_time=1.8e9, poll_interval_s=5.0,
                          policy={"patience_min": 2, "patience_max": 2})
        scores[name] = score_run(result.run_dir, now=1.8e9 + budget).score_ops / (2 * model.nodes)
    epoch = ReplicaModel(**{**base.__dict__, "network": slow}).epoch_time(graph)
    # Compute: half an epoch's 20 s on each of 2 nodes; then 10 steps of a 2-rank ring over 250 kB/s.
    assert epoch.compute_s == pytest.approx(10.0, rel=1e-12)
    assert epoch.all_reduce_s == pytest.approx(10 * (2 * 5e-6 + graph.gradient_bytes / 250e3), rel=1e-12)
    assert 0.5 < epoch.compute_s / epoch.seconds < 0.75
    assert epoch.all_to_all_s == 0.0  # no experts
    assert scores["slow"] < scores["free"]
    # About 40 and 25 epochs a replica in the 400 s (10 s and 15.4 s an epoch): the scores stand in the ratio
    # of the epochs' times, to within the epoch the deadline cuts and the last poll's 5 s.
    assert scores["slow"] / scores["free"] == pytest.approx(epoch.compute_s / epoch.seconds, rel=0.05)
