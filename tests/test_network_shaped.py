"""Issue 48, item 5: the interconnect shows on this machine. The same LM run (benchmarks/network_shaped.py's
SHAPED_LM: 8 steps of gpt_small, G = 1.87 MB of gradients a step) across the two nodes of a
network-namespace cluster (tests/netns_cluster.py), their links shaped by tc to 20 and to 200 Mbit/s
(one cluster, re-shaped between the runs), with torch and with jax: the all-reduce's measured bytes per
second follow the link, the slow link's score is lower, the ideal-network scores agree, and the links'
own byte counters carry the analytic bytes. The figures: docs/performance.md, "2026-12-07: the
interconnect on this machine"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from netns_cluster import netns_cluster  # noqa: F401 (the fixture)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from network_shaped import run_shaped  # noqa: E402

SLOW_MBIT, FAST_MBIT = 20, 200
# At 20 Mbit/s a step's 1.87 MB take 0.75 s, several times what two busy cores add to a step (torch's
# figure keeps the least of the ranks' waits, so load imbalance stays out of it: docs/backends/torch.md);
# at 200 Mbit/s 0.075 s.


def _link_bytes_per_second(rate_mbit: float) -> float:
    return rate_mbit * 1e6 / 8  # tc's mbit is 10^6 bits


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_all_reduce_and_the_score_follow_the_link(netns_cluster, tmp_path, backend):
    from torch.distributed import _DEFAULT_FIRST_BUCKET_BYTES as DDP_FIRST_BUCKET

    pairs = []
    try:
        # A second pair only where the first's scores do not show the link (below): the machine's load
        # moves a run's computation by seconds, as much as the network does.
        while len(pairs) < 2 and (not pairs or not _scores_show_the_link(*pairs[-1])):
            folder = tmp_path / f"pair{len(pairs)}"
            pairs.append((run_shaped(netns_cluster, backend, SLOW_MBIT, folder / "slow"),
                          run_shaped(netns_cluster, backend, FAST_MBIT, folder / "fast")))
    finally:
        for node in netns_cluster.nodes:
            netns_cluster.shape(node, None)
    print(pairs)
    for slow, fast in pairs:
        _the_all_reduce_follows_the_link(slow, fast, backend, DDP_FIRST_BUCKET)
    slow, fast = pairs[-1]
    # 8 steps x 0.68 s more on the slow link, against a run of 15 to 30 s: the score drops by a fifth or
    # more. Compute is the same, so the scores an ideal network would have given agree (the issue's
    # 15%): the waits measured are the network's, not the machine's.
    assert slow["score_ops"] < fast["score_ops"], pairs
    assert slow["network_efficiency"] < fast["network_efficiency"], pairs
    assert slow["ideal_score_ops"] == pytest.approx(fast["ideal_score_ops"], rel=0.15), pairs


def _scores_show_the_link(slow: dict, fast: dict) -> bool:
    """The test's score checks, as a condition. On this 2-core machine beside another test suite (load 2
    to 7) a run's steps outside the waits took from 1.7 to 5.7 s between runs of the same rate
    (docs/performance.md, "2026-12-07: the interconnect on this machine"), so one pair in two or three
    missed the ideal scores' 15%; a second pair is made then, and must meet them. Noise seldom repeats;
    a bias (communication outside the waits, a wait taken for the network) fails both pairs."""
    return (slow["score_ops"] < fast["score_ops"] and slow["network_efficiency"] < fast["network_efficiency"]
            and abs(slow["ideal_score_ops"] - fast["ideal_score_ops"]) <= 0.15 * fast["ideal_score_ops"])


def _the_all_reduce_follows_the_link(slow: dict, fast: dict, backend: str, ddp_first_bucket: int) -> None:
    for run in (slow, fast):
        link = _link_bytes_per_second(run["rate_mbit"])
        # No all-reduce outruns its link: each node sends (and receives) the per-rank bytes through a
        # token bucket at the rate; 10% above it is left for the bucket's burst (64 KiB against 1.87 MB a
        # step) and the timer's edges. jax times the whole collective apart from the steps. torch's figure
        # is the steps' exposed wait, from the launch of DDP's last bucket (docs/backends/torch.md): DDP
        # launches its first bucket (at most 1 MiB) during the backward, where the transfer can hide
        # behind the rest of it (on this busy machine, 200 Mbit/s measured up to 1.18 times the rate), so
        # only the bytes of the later buckets, G less 1 MiB, are sure to be waited on.
        exposed = 1.0 if backend == "jax" else run["gradient_bytes_per_step"] / (
            run["gradient_bytes_per_step"] - ddp_first_bucket)
        assert run["all_reduce_bytes_per_second"] <= 1.1 * link * exposed, run
        assert run["inter_node_bytes"] == run["all_reduce_bytes"] == run["steps"] * run["gradient_bytes_per_step"]
        # Every step's bytes crossed each node's link. Beside them the links carried: headers (under 1%:
        # the veth counts a 64 KiB offloaded segment with one), TCP's retransmissions of what the shaper's
        # queue dropped (4% at 20 Mbit/s), jax's pricing of the all-reduce (at most 3 runs of G), and the
        # heartbeats, rendezvous and stop decisions (well under 1 MB):
        # bounded together, with jax's check that the nodes start alike (device_put's process_allgather of the
        # weights: 1 G more at the start). torch's DDP no longer broadcasts them (distributed.same_start).
        extra = (3 + 2) * run["gradient_bytes_per_step"]
        for sent in run["link_sent_bytes"]:
            assert run["inter_node_bytes"] <= sent <= 1.1 * (run["inter_node_bytes"] + extra) + 1e6, run
    # The slow link shows: the all-reduce at 20 Mbit/s runs at half its rate or more (the rest is the
    # headers, TCP's ramp after a pause, the timer), and at 200 Mbit/s at 4 times the slow figure or more
    # (10 times the rate, less what a 0.075 s transfer loses to its fixed costs).
    assert slow["all_reduce_bytes_per_second"] >= 0.5 * _link_bytes_per_second(SLOW_MBIT), slow
    assert fast["all_reduce_bytes_per_second"] >= 4 * slow["all_reduce_bytes_per_second"], (slow, fast)
