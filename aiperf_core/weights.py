"""Canonical weights: {node id: {param name: numpy array}} in the IR's layout.

Stored as .npz with keys "<node id>/<param>"; loaded with allow_pickle=False so
a weights file can never run code.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import numpy as np

from aiperf_core.atomic import write_atomic
from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph

Weights = dict[str, dict[str, np.ndarray]]

_SEP = "/"


def validate_weights(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], *, complete: bool = True) -> None:
    """Raise GraphError naming the node if weights do not fit the graph."""
    expected = graph.all_param_shapes()
    for node_id, params in weights.items():
        if node_id not in expected:
            if node_id in graph:
                raise GraphError(f"weights given for a {graph[node_id].op} node, which has none", node_id)
            raise GraphError("weights given for a node that is not in the graph", node_id)
        want = expected[node_id]
        for pname, array in params.items():
            if pname not in want:
                raise GraphError(f"unexpected weight '{pname}' (expected {sorted(want)})", node_id)
            shape = tuple(np.shape(array))
            if shape != tuple(want[pname]):
                raise GraphError(f"weight '{pname}' has shape {list(shape)}, expected {list(want[pname])}", node_id)
            if not np.issubdtype(np.asarray(array).dtype, np.floating):
                raise GraphError(f"weight '{pname}' must be floating point, got {np.asarray(array).dtype}", node_id)
    if complete:
        for node_id, want in expected.items():
            have = weights.get(node_id, {})
            missing = sorted(set(want) - set(have))
            if missing:
                raise GraphError(f"missing weight '{missing[0]}'", node_id)


def init_weights(graph: Graph, seed: int = 0, dtype=np.float32) -> Weights:
    """He-normal kernels (fan-in; a mixture of experts' router and expert weights too), zero biases, BN as
    identity over unit statistics; embedding and position tables N(0, 0.02) (GPT-2's); constants as the
    identity (mul_const 1, add_const 0)."""
    rng = np.random.default_rng(seed)
    return {node_id: init_node_weights(graph, node_id, rng, dtype) for node_id in graph.all_param_shapes()}


def init_node_weights(graph: Graph, node_id: str, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    """One node's parameters as init_weights makes them, drawn from rng (morphs initialise new nodes so)."""
    node = graph[node_id]
    w: dict[str, np.ndarray] = {}
    for pname, shape in graph.param_shapes(node_id).items():
        if pname in ("kernel", "router", "w_gate", "w_in", "w_out"):
            # A conv's fan-in is its window times its input channels; an expert stack's (E, in, out) is `in`.
            w[pname] = he_normal(shape, math.prod(shape[:-1]) if pname == "kernel" else shape[-2], rng, dtype)
        elif pname == "table":
            w[pname] = (rng.standard_normal(shape) * 0.02).astype(dtype)
        elif pname in ("gamma", "moving_variance") or (pname == "value" and node.op == "mul_const"):
            w[pname] = np.ones(shape, dtype)
        else:
            w[pname] = np.zeros(shape, dtype)
    return w


def he_normal(shape, fan_in: int, rng: np.random.Generator, dtype=np.float32) -> np.ndarray:
    """He et al.'s normal initialisation: standard deviation sqrt(2 / fan_in)."""
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(dtype)


# A 64 x 64 float32 tile of the source and of the copy fits in L1 together. numpy copies a transposed view
# element by element along the copy's rows, so it reads the source a column at a time and misses the
# cache on every element: 3.3 s for vgg19's 25088 x 4096 dense kernel on this project's CI CPU, 0.28 s by
# tiles (the same on small kernels).
_TRANSPOSE_TILE = 64


def transposed_copy(matrix: np.ndarray, dtype=np.float32) -> np.ndarray:
    """matrix.T as a C-ordered array of its own, of `dtype`: a dense kernel between the IR's (in, out)
    layout and a framework's (out, in), either way."""
    if np.ndim(matrix) != 2:
        raise ValueError(f"transposed_copy takes a matrix, got shape {list(np.shape(matrix))}")
    rows, cols = matrix.shape
    out = np.empty((cols, rows), dtype)
    tile = _TRANSPOSE_TILE
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j:j + tile, i:i + tile] = matrix[i:i + tile, j:j + tile].T
    return out


def save_weights(weights: Mapping[str, Mapping[str, np.ndarray]], path) -> None:
    flat = {}
    for node_id, params in weights.items():
        for pname, array in params.items():
            flat[f"{node_id}{_SEP}{pname}"] = np.asarray(array)
    write_atomic(path, lambda fh: np.savez(fh, **flat))


def load_weights(path, graph: Graph | None = None) -> Weights:
    p = Path(path)
    try:
        with np.load(p, allow_pickle=False) as data:
            flat = {k: data[k] for k in data.files}
    except FileNotFoundError:
        raise GraphError(f"{p}: no such file") from None
    except (OSError, ValueError) as exc:
        raise GraphError(f"{p}: not a weights .npz file: {exc}") from None
    weights: Weights = {}
    for key, array in flat.items():
        node_id, sep, pname = key.rpartition(_SEP)
        if not sep or not node_id:
            raise GraphError(f"{p}: key {key!r} is not '<node id>/<param>'")
        weights.setdefault(node_id, {})[pname] = array
    if graph is not None:
        validate_weights(graph, weights)
    return weights
