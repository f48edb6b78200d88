"""NumPy reference forward speed (issue: morphism and the reference executor)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import best_of, report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402
from aiperf_numpy import forward  # noqa: E402

if __name__ == "__main__":
    graph = resnet50((64, 64, 3), 1000)
    weights = init_weights(graph)
    x = np.random.default_rng(0).standard_normal((8, 64, 64, 3)).astype(np.float32)
    seconds = best_of(lambda: forward(graph, weights, x, dtype=np.float32), 5)
    report("numpy reference: ResNet-50 64x64 batch 8 forward (fp32)", seconds, "s", goal=3)
