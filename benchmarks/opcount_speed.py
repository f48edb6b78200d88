"""Speed of the analytic counter and of the IR's JSON/npz round trip (issue: foundation)."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import aiperf_opcount  # noqa: E402
from _common import best_of, report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.ir import Graph, Node, load_graph, save_graph  # noqa: E402
from aiperf_core.weights import init_weights, load_weights, save_weights  # noqa: E402


def chain_graph(n_nodes: int) -> Graph:
    nodes = [Node("x", "input", (), {"shape": [32, 32, 16]})]
    prev = "x"
    i = 0
    while len(nodes) < n_nodes - 3:
        for op, attrs in (("conv2d", {"filters": 16, "kernel": [3, 3], "padding": [1, 1, 1, 1]}),
                          ("batch_norm", {}), ("relu", {})):
            nodes.append(Node(f"n{i}", op, (prev,), attrs))
            prev = f"n{i}"
            i += 1
    nodes += [Node("gap", "global_avg_pool", (prev,), {}), Node("fc", "dense", ("gap",), {"units": 10}),
              Node("sm", "softmax", ("fc",), {})]
    return Graph(nodes)


def round_trip(graph, weights, folder):
    """What a trial file costs: graph JSON and weights .npz written atomically (fsync) and read back."""
    save_graph(graph, folder / "graph.json")
    save_weights(weights, folder / "weights.npz")
    load_weights(folder / "weights.npz", load_graph(folder / "graph.json"))


if __name__ == "__main__":
    r50 = resnet50()
    report("opcount: ResNet-50 count", best_of(lambda: opcount.count(r50)) * 1e3, "ms", goal=5)
    big = chain_graph(1000)
    report(f"opcount: {len(big)}-node graph count", best_of(lambda: opcount.count(big)) * 1e3, "ms", goal=20)
    w = init_weights(r50)
    with tempfile.TemporaryDirectory() as tmp:
        seconds = best_of(lambda: round_trip(r50, w, Path(tmp)), 5)
    report("IR: ResNet-50 JSON + npz round trip (98 MiB)", seconds * 1e3, "ms", goal=200)
