import numpy as np
import pytest

from aiperf_core.policy import Policy
from aiperf_core.search import nas
from aiperf_core.search.arch import ArchCode
from aiperf_core.search.history import SharedHistory, TrialRecord


def chain(depth: int, width: int = 16) -> ArchCode:
    """A plain stack of `depth` convs: architectures on a line, distance = difference in depth."""
    return ArchCode(np.array([[0, width, 3]] * depth, dtype=float).reshape(-1, 3), np.zeros((0, 2)))


def record(k: int, code: ArchCode, target: float) -> TrialRecord:
    return TrialRecord(f"r0000-t{k:05d}", 0, k + 1, target, target, {"batch_size": 64, "kernel_size": 3}, code, f"sig{k}")


def history(n: int, accuracy) -> SharedHistory:
    h = SharedHistory(None)
    rng = np.random.default_rng(0)
    for k in range(n):
        depth = int(rng.integers(2, 30))
        h.add(record(k, chain(depth), accuracy(depth)))
    return h


def test_selection_prefers_the_candidate_near_the_known_optimum():
    h = history(40, lambda d: 0.9 - 0.002 * (d - 12) ** 2)  # best at depth 12
    candidates = [chain(d) for d in (3, 12, 26)]
    choice = nas.select(h.records, h.summaries(), candidates, Policy({"nas_kappa": 0.5}))
    assert choice.index == 1
    assert choice.mean[1] == pytest.approx(0.9, abs=0.03)
    assert choice.describe()["active_set"] == 40


def test_active_set_is_bounded_and_keeps_the_best_and_the_nearest():
    h = history(3000, lambda d: d / 100)
    targets = np.array([r.target for r in h.records])
    candidates = [chain(5)]
    index = nas.active_set(targets, h.summaries(), candidates, 64)
    assert len(index) == 64 and len(set(index.tolist())) == 64
    assert int(np.argmax(targets)) in index
    near = [h.records[i].arch for i in index if h.records[i].target < 0.1]
    assert near and all(len(code.layers) <= 9 for code in near)
    choice = nas.select(h.records, h.summaries(), candidates + [chain(29)], Policy({"nas_active_set": 64}))
    assert choice.active == 64


def test_parents_are_the_best_trials_in_a_stable_order():
    h = history(10, lambda d: 0.5)
    best = nas.best_trials(h.records, 3)
    assert [r.trial for r in best] == ["r0000-t00000", "r0000-t00001", "r0000-t00002"]
    h.add(record(99, chain(4), 0.99))
    assert nas.best_trials(h.records, 1)[0].trial == "r0000-t00099"


def test_policy_items_of_the_search_are_checked():
    from aiperf_core.policy import PolicyError
    with pytest.raises(PolicyError, match="policy.nas_active_set"):
        Policy({"nas_active_set": 1})
    with pytest.raises(PolicyError, match="policy.hpo_kernel_sizes"):
        Policy({"hpo_kernel_sizes": [9]})
