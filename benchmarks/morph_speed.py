"""Candidate generation speed: 8 children of a ~300-node graph with weights (issue: morphism)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.morph import generate_candidates, random_morph  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402

if __name__ == "__main__":
    import time

    graph = resnet50((224, 224, 3), 1000)
    weights = init_weights(graph)
    rng = np.random.default_rng(0)
    while len(graph) < 300:
        child = random_morph(graph, weights, rng, ops=("deeper", "skip"))
        graph, weights = child.graph, child.weights
    times = []
    for seed in range(10):
        t = time.perf_counter()
        generate_candidates(graph, weights, 8, seed)
        times.append(time.perf_counter() - t)
    report(f"morph: 8 candidates of a {len(graph)}-node graph, median", float(np.median(times)), "s", goal=0.5)
    report(f"morph: 8 candidates of a {len(graph)}-node graph, worst", float(np.max(times)), "s", goal=0.5)
