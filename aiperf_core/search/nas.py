"""NAS: Bayesian optimisation over morph candidates (Auto-Keras style; paper section 4.1).

Parents are the best trials of the shared history (all replicas' finished trials), so one
replica's good architecture is grown by the others too. Each parent yields morph candidates;
a GP over the architecture edit distance (aiperf_core.search.arch) predicts each candidate's
accuracy from the history, and the acquisition (UCB by default) picks the one to train.

Speed with a long history: the GP is fitted on a bounded active set of at most
policy["nas_active_set"] trials, half the best by target and half the nearest to the candidates
by a cheap summary (layer count, skip count, log total width) computed for every trial at once.
The GP is fitted in O(K^3) and the edit distances cost O(K^2 + K C) DP runs for K active trials
and C candidates, so selection time is bounded by K and C, not by the history's length; only
the summary filter grows with the history, at a few vector operations over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from aiperf_core.search.arch import ArchCode, distance_matrix, pair_distances
from aiperf_core.search.gp import acquisition, posterior
from aiperf_core.search.history import TrialRecord


@dataclass(frozen=True)
class Selection:
    index: int               # the chosen candidate
    scores: np.ndarray       # acquisition of every candidate
    mean: np.ndarray         # GP mean accuracy of every candidate
    std: np.ndarray
    active: int              # trials the GP was fitted on

    def describe(self) -> dict:
        i = self.index
        return {"candidates": len(self.scores), "active_set": self.active, "acquisition": float(self.scores[i]),
                "predicted_mean": float(self.mean[i]), "predicted_std": float(self.std[i])}


def best_trials(records: Sequence[TrialRecord], count: int) -> list[TrialRecord]:
    """The count best trials by target; ties go to the earlier trial id, so the order is stable."""
    return sorted(records, key=lambda r: (-r.target, r.trial))[:count]


def active_set(targets: np.ndarray, summaries: np.ndarray, candidates: Sequence[ArchCode], size: int) -> np.ndarray:
    """Indices of at most `size` trials: the best by target, then the nearest to any candidate."""
    n = len(targets)
    if n <= size:
        return np.arange(n)
    best_count = size // 2
    # Stable order by (-target, index) so ties resolve the same way on every replica.
    order = np.lexsort((np.arange(n), -targets))
    chosen = list(order[:best_count])
    taken = np.zeros(n, bool)
    taken[chosen] = True
    probe = np.asarray([c.summary() for c in candidates])
    nearness = np.min(np.abs(summaries[:, None, :] - probe[None, :, :]).sum(axis=2), axis=1)
    nearness[taken] = np.inf
    near_count = size - best_count
    nearest = np.argpartition(nearness, near_count - 1)[:near_count]
    nearest = nearest[np.lexsort((nearest, nearness[nearest]))]
    return np.sort(np.concatenate([np.asarray(chosen, dtype=np.int64), nearest]))


class DistanceCache:
    """Distances between history architectures, keyed by their signatures, so that an active set
    that changes little from one round to the next costs little; repeated architectures share an
    entry. Bounded: when full it is emptied and refilled."""

    def __init__(self, limit: int = 500_000):
        self.limit = limit
        self._known: dict[tuple[str, str], float] = {}

    def matrix(self, records: Sequence[TrialRecord]) -> np.ndarray:
        n = len(records)
        pairs: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for i in range(n):
            for j in range(i + 1, n):
                a, b = records[i].signature, records[j].signature
                if a != b:  # the same architecture: distance 0
                    pairs.setdefault((a, b) if a < b else (b, a), []).append((i, j))
        values = {key: self._known[key] for key in pairs if key in self._known}
        missing = [key for key in pairs if key not in values]
        if missing:
            left = np.array([pairs[key][0][0] for key in missing], dtype=np.int64)
            right = np.array([pairs[key][0][1] for key in missing], dtype=np.int64)
            found = dict(zip(missing, pair_distances([r.arch for r in records], left, right).tolist()))
            if len(self._known) + len(found) > self.limit:
                self._known.clear()
            self._known.update(found)
            values.update(found)
        out = np.zeros((n, n))
        for key, where in pairs.items():
            for i, j in where:
                out[i, j] = out[j, i] = values[key]
        return out


def select(records: Sequence[TrialRecord], summaries: np.ndarray, candidates: Sequence[ArchCode],
           policy: Mapping, cache: DistanceCache | None = None) -> Selection:
    """Score candidates by the acquisition of the GP fitted on the history; pick the best."""
    targets = np.asarray([r.target for r in records], dtype=np.float64)
    index = active_set(targets, summaries, candidates, policy["nas_active_set"])
    active = [records[i] for i in index]
    codes = [r.arch for r in active]
    y = targets[index]
    train_d = (cache or DistanceCache()).matrix(active)
    post = posterior(train_d, y, distance_matrix(codes, list(candidates)))
    scores = acquisition(post, policy["nas_acquisition"], policy["nas_kappa"], float(np.max(y)) if len(y) else 0.0)
    return Selection(int(np.argmax(scores)), scores, post.mean, post.std, len(index))
