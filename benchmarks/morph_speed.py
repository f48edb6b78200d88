"""Candidate generation speed: 8 children of a ~300-node graph with weights (issue: morphism).

The goal (0.5 s) is for a replica's planner, which generates candidates over and over in one long
process. The first call of a process is reported apart, without a goal: it is the one that first
writes the new weight arrays (a kernel morph of a wide conv pads a kernel of up to ~100 MB), and
in a fresh VM every page the process touches for the first time is slow (docs/performance.md).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.morph.cnn import generate_candidates, random_morph  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402

SEEDS = 10

if __name__ == "__main__":
    graph = resnet50((224, 224, 3), 1000)
    weights = init_weights(graph)
    rng = np.random.default_rng(0)
    while len(graph) < 300:
        child = random_morph(graph, weights, rng, ops=("deeper", "skip"))
        graph, weights = child.graph, child.weights

    def timed(seed: int) -> float:
        t = time.perf_counter()
        generate_candidates(graph, weights, 8, seed)
        return time.perf_counter() - t

    first = timed(SEEDS)  # a seed not among the timed ones
    times = [timed(seed) for seed in range(SEEDS)]
    report(f"morph: 8 candidates of a {len(graph)}-node graph, median", float(np.median(times)), "s", goal=0.5)
    report(f"morph: 8 candidates of a {len(graph)}-node graph, worst", float(np.max(times)), "s", goal=0.5)
    report("morph: first call in a fresh process", first, "s")
