"""NAS selection latency with 100, 1,000 and 10,000 trials in the shared history (goal <= 1 s at 10,000).

The history holds ResNet-50 descendants (random morph walks) with random accuracies. Timed: picking
the parents, encoding 8 morph candidates and choosing one by the GP and the acquisition, with the
history already in memory (SharedHistory reads each trial once; see docs/search.md). Cold: no
distance cached yet; warm: the replica's DistanceCache holds the earlier rounds' distances.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.morph.cnn import generate_candidates, random_morph  # noqa: E402
from aiperf_core.policy import Policy  # noqa: E402
from aiperf_core.search import nas  # noqa: E402
from aiperf_core.search.arch import encode  # noqa: E402
from aiperf_core.search.history import SharedHistory, TrialRecord  # noqa: E402

POOL = 120  # distinct architectures the history's trials are drawn from


def architecture_pool(rng):
    graph = resnet50((224, 224, 3), 1000)
    pool = [graph]
    while len(pool) < POOL:
        parent = pool[int(rng.integers(len(pool)))]
        pool.append(random_morph(parent, None, rng).graph)
    return pool


def history_of(n, pool, codes, rng):
    history = SharedHistory(None)
    for k in range(n):
        i = int(rng.integers(len(pool)))
        # distinct trials: no shared cache entries
        history.add(TrialRecord(f"r{k % 64:04d}-t{k // 64:05d}", k % 64, k // 64 + 1, float(rng.uniform(0.3, 0.9)),
                                0.0, {"batch_size": 256, "kernel_size": 3}, codes[i], f"trial-{k}"))
    return history, [pool[int(rng.integers(len(pool)))] for _ in range(5)]


def select_once(history, parent_graph, policy, seed, cache=None):
    candidates = generate_candidates(parent_graph, None, policy["nas_candidates"], seed)
    t = time.perf_counter()
    nas.best_trials(history.records, policy["nas_parents"])
    codes = [encode(c.graph) for c in candidates]
    nas.select(history.records, history.summaries(), codes, policy, cache)
    return time.perf_counter() - t


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    pool = architecture_pool(rng)
    codes = [encode(g) for g in pool]
    policy = Policy()
    for n in (100, 1000, 10000):
        history, parents = history_of(n, pool, codes, rng)
        # Cold: no distance cached, as on a replica's first round after a start.
        cold = [select_once(history, parents[k % len(parents)], policy, k) for k in range(5)]
        report(f"nas: selection, {n:,} trials, cold cache, median", float(np.median(cold)), "s", goal=1.0)
        report(f"nas: selection, {n:,} trials, cold cache, worst", float(np.max(cold)), "s", goal=1.0)
        cache = nas.DistanceCache()
        warm = [select_once(history, parents[k % len(parents)], policy, k, cache) for k in range(6)][1:]
        report(f"nas: selection, {n:,} trials, warm cache, median", float(np.median(warm)), "s", goal=1.0)
