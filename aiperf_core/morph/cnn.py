"""Function-preserving morphs of a CNN: deeper, wider, skip and kernel.

Each operator takes a parent graph and its weights (or None, to score a
candidate's architecture cheaply) and returns a child whose weights make it
compute exactly what the parent computed, in inference mode. The child's
history gains one JSON-plain record:

    {"op": ..., "args": {...}, "parent": <sha256 of the parent's signature>,
     "delta": {"fp": ..., "bp": ...}}

`args` hold every choice, random ones included, so `replay` rebuilds the same
child from the same parent. `delta` is the change in analytic ops per image
(paper convention), worked out from the nodes the morph touches only.

Child weights share every array the morph leaves unchanged with the parent;
the parent's weights are never modified.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.gcpause import gc_paused
from aiperf_core.ir import Graph, Node
from aiperf_core.morph.plan import (MorphCaps, MorphResult, _checked_record, _delta, _distinct_children, _dtype, _Index,
                                    _insert_after, _node, _params, _Plan, _prefix, _record, _rewired, _upstream)
from aiperf_core.weights import Weights

OPERATORS = ("deeper", "wider", "skip", "kernel")

MAX_KERNEL = 7
# Keras ResNet-50's batch-norm settings, so that inserted blocks match the rest.
BN_EPSILON = 1.001e-5
BN_MOMENTUM = 0.99
# Floor for the estimated variance of an inserted BN's input: a dead channel
# would otherwise get a near-zero gamma that training could hardly move.
MIN_VARIANCE = 1e-3
WIDER_FACTOR = 2.0

# Ops that carry a conv's channels through unchanged, one output channel per
# input channel: widening can pass through them by replicating channels.
_CHANNELWISE = frozenset({"batch_norm", "relu", "max_pool", "dropout", "global_avg_pool", "flatten", "concat"})
# Ops that absorb extra input channels by splitting their incoming weights.
_ABSORBING = frozenset({"conv2d", "dense"})


def _image(graph: Graph, node_id: str, what: str) -> tuple[int, int, int]:
    shape = graph.shapes[node_id]
    if len(shape) != 3:
        raise GraphError(f"{what} needs an image-shaped node (HxWxC), this one has shape {list(shape)}", node_id)
    return shape


def _rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    return np.random.default_rng(rng if rng is not None else 0)


# ---------------------------------------------------------------------------
# deeper
# ---------------------------------------------------------------------------


def _relu_output_stats(graph: Graph, weights: Mapping, relu: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Estimated per-channel mean and variance of a relu's output.

    If a batch norm feeds the relu, its output is roughly N(beta, gamma^2), so
    the relu's output is a rectified Gaussian with a closed-form mean and
    variance. An inserted BN holding these as running statistics normalises
    about as its training-mode batch statistics would, so the child starts
    near its parent in training as well as exactly equal in inference.
    Otherwise fall back to zero mean, unit variance.
    """
    channels = graph.shapes[relu][-1]
    source = graph[graph[relu].inputs[0]]
    if source.op != "batch_norm":
        return np.zeros(channels, dtype), np.ones(channels, dtype)
    bn = _params(graph, weights, source.id)
    mu = np.asarray(bn["beta"], np.float64)
    sigma = np.maximum(np.abs(np.asarray(bn["gamma"], np.float64)), 1e-6)
    a = mu / sigma
    pdf = np.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(a / math.sqrt(2.0)))
    mean = mu * cdf + sigma * pdf
    second = (mu * mu + sigma * sigma) * cdf + mu * sigma * pdf
    var = np.maximum(second - mean * mean, MIN_VARIANCE)
    return mean.astype(dtype), var.astype(dtype)


def _plan_deeper(graph: Graph, after: str, kernel: int = 3, prefix: str | None = None,
                 index: _Index | None = None) -> _Plan:
    _node(graph, after, "relu", "deeper: 'after'")
    h, w, c = _image(graph, after, "deeper")
    if isinstance(kernel, bool) or not isinstance(kernel, int) or kernel < 1 or kernel > MAX_KERNEL or kernel % 2 == 0:
        raise GraphError(f"deeper: kernel must be an odd size from 1 to {MAX_KERNEL}, got {kernel!r}", after)
    p = _prefix(graph, ("conv", "bn", "relu"), prefix, after)
    conv_id, bn_id, relu_id = f"{p}_conv", f"{p}_bn", f"{p}_relu"
    pad = kernel // 2
    new = [
        Node(conv_id, "conv2d", (after,), {"filters": c, "kernel": [kernel, kernel], "strides": [1, 1],
                                            "padding": [pad] * 4, "use_bias": False}),
        Node(bn_id, "batch_norm", (conv_id,), {"epsilon": BN_EPSILON, "momentum": BN_MOMENTUM}),
        Node(relu_id, "relu", (bn_id,), {}),
    ]
    nodes = _insert_after(_rewired(graph, after, relu_id, set()), after, new)
    args = {"after": after, "kernel": kernel, "prefix": p}
    child = graph.replace(nodes, None)
    delta = _delta(graph, child, (conv_id, bn_id, relu_id), (conv_id, bn_id))
    record = _record("deeper", args, index or _Index(graph), delta)
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        dtype = _dtype(weights)
        dirac = np.zeros((kernel, kernel, c, c), dtype)
        dirac[pad, pad, np.arange(c), np.arange(c)] = 1
        mean, var = _relu_output_stats(graph, weights, after, dtype)
        out = dict(weights)
        out[conv_id] = {"kernel": dirac}
        # y = gamma (x - mean) / sqrt(var + eps) + beta is x when gamma = sqrt(var + eps), beta = mean.
        # The trailing relu is then the identity too: its input is the output of a relu.
        out[bn_id] = {"gamma": np.sqrt(var.astype(np.float64) + BN_EPSILON).astype(dtype), "beta": mean,
                      "moving_mean": mean.copy(), "moving_variance": var}
        return out

    return _Plan(child, record, make_weights)


def deeper(graph: Graph, weights: Mapping | None, after: str, kernel: int = 3, rng=None, *,
           prefix: str | None = None, caps: MorphCaps | None = None) -> MorphResult:
    """Insert conv(kernel x kernel, same channels, stride 1, same padding) -> BN -> ReLU after the relu `after`.

    The conv is a Dirac (identity) kernel and the BN passes its input through
    at its running statistics. deeper makes no random choice; rng is accepted
    so every operator has the same signature.
    """
    return _plan_deeper(graph, after, kernel, prefix).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# wider
# ---------------------------------------------------------------------------


def _channel_flow(index: _Index, conv: str) -> tuple[list[str], list[str]]:
    """The channel-wise nodes a conv's channels pass through, and the layers that absorb them.

    Raises GraphError naming the conv when its channels reach anything else,
    an add above all: every branch the add joins would have to widen too.
    """
    graph = index.graph
    flow: set[str] = set()
    absorbers: set[str] = set()
    stack = [conv]
    while stack:
        nid = stack.pop()
        readers = index.consumers[nid]
        if not readers:
            raise GraphError(f"cannot widen: its channels reach the graph output through '{nid}'", conv)
        for r in readers:
            op = graph[r].op
            if op in _ABSORBING:
                absorbers.add(r)
            elif op == "add":
                raise GraphError(f"cannot widen: its channels reach add '{r}', whose other inputs "
                                 "would need widening too", conv)
            elif op in _CHANNELWISE:
                if r not in flow:
                    flow.add(r)
                    stack.append(r)
            else:
                raise GraphError(f"cannot widen: its channels reach {op} '{r}', which cannot take extra channels",
                                 conv)
    order = index.position.__getitem__
    return sorted(flow, key=order), sorted(absorbers, key=order)


def _channel_maps(graph: Graph, conv: str, sources: np.ndarray, flow: Sequence[str]) -> dict[str, np.ndarray]:
    """For each widened tensor, the parent channel that each of its channels copies."""
    maps = {conv: np.concatenate([np.arange(graph[conv].attrs["filters"]), sources])}
    for nid in flow:
        node = graph[nid]
        if node.op == "concat":
            pieces, offset = [], 0
            for i in node.inputs:
                width = graph.shapes[i][-1]
                pieces.append(offset + (maps[i] if i in maps else np.arange(width)))
                offset += width
            maps[nid] = np.concatenate(pieces)
        elif node.op == "flatten" and len(graph.shapes[node.inputs[0]]) == 3:
            # Dense rows follow the NHWC order: (h, w, c) with c fastest.
            h, w, c = graph.shapes[node.inputs[0]]
            maps[nid] = (np.arange(h * w)[:, None] * c + maps[node.inputs[0]][None, :]).ravel()
        else:
            maps[nid] = maps[node.inputs[0]]
    return maps


def _wider_sources(graph: Graph, conv: str, factor, new_filters, sources, rng) -> list[int]:
    filters = graph[conv].attrs["filters"]
    if sources is not None:
        if not isinstance(sources, (list, tuple)) or not sources or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < filters for s in sources):
            raise GraphError(f"wider: sources must be a non-empty list of channel indices below {filters}", conv)
        if new_filters is not None and new_filters != filters + len(sources):
            raise GraphError(f"wider: {len(sources)} sources do not widen {filters} filters to {new_filters}", conv)
        return list(sources)
    if new_filters is None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
            raise GraphError(f"wider: factor must be a number above 1, got {factor!r}", conv)
        new_filters = int(round(filters * factor))
    if isinstance(new_filters, bool) or not isinstance(new_filters, int) or new_filters <= filters:
        raise GraphError(f"wider: the new width must be an integer above the current {filters}, got {new_filters!r}",
                         conv)
    return [int(s) for s in _rng(rng).integers(0, filters, size=new_filters - filters)]


def _plan_wider(graph: Graph, conv: str, factor=WIDER_FACTOR, new_filters=None, rng=None, sources=None,
                index: _Index | None = None) -> _Plan:
    node = _node(graph, conv, "conv2d", "wider: 'conv'")
    index = index or _Index(graph)
    flow, absorbers = _channel_flow(index, conv)
    sources = _wider_sources(graph, conv, factor, new_filters, sources, rng)
    width = node.attrs["filters"] + len(sources)
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, "filters": width}) if n.id == conv else n for n in graph.nodes]
    args = {"conv": conv, "new_filters": width, "sources": sources}
    child = graph.replace(nodes, None)
    delta = _delta(graph, child, [conv, *flow, *absorbers])
    record = _record("wider", args, index, delta)
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        maps = _channel_maps(graph, conv, np.asarray(sources, dtype=np.int64), flow)
        out = dict(weights)
        out[conv] = {k: np.take(v, maps[conv], axis=-1) for k, v in _params(graph, weights, conv).items()}
        for nid in flow:
            if graph[nid].op == "batch_norm":
                out[nid] = {k: np.take(v, maps[nid], axis=0) for k, v in _params(graph, weights, nid).items()}
        for nid in absorbers:
            params = _params(graph, weights, nid)
            source = maps[graph[nid].inputs[0]]
            # Each copy of a channel carries 1/n of its outgoing weights: the copies sum to the original.
            share = 1.0 / np.bincount(source)[source]
            kernel = np.asarray(params["kernel"])
            axis = kernel.ndim - 2  # conv HWIO or dense (in, out): the input axis
            shape = [1] * kernel.ndim
            shape[axis] = len(source)
            out[nid] = {**params, "kernel": (np.take(kernel, source, axis=axis) * share.reshape(shape))
                        .astype(kernel.dtype, copy=False)}
        return out

    return _Plan(child, record, make_weights)


def wider(graph: Graph, weights: Mapping | None, conv: str, factor: float = WIDER_FACTOR,
          new_filters: int | None = None, rng=None, *, sources: Sequence[int] | None = None,
          caps: MorphCaps | None = None) -> MorphResult:
    """Widen a conv Net2Net-style to new_filters (or round(filters * factor)) output channels.

    The extra channels copy randomly chosen existing filters (sources; drawn
    from rng unless given) with their batch-norm parameters, and the layers
    reading them split each copied channel's weights among its copies.

    Widenable: a conv whose channels reach, through batch_norm, relu,
    max_pool, dropout, concat, global_avg_pool or flatten only, layers that
    are conv2d or dense. Channels reaching an add would force every branch of
    the add to widen alike, so such a conv is refused (in a ResNet bottleneck
    only the first two convs are widenable).
    """
    return _plan_wider(graph, conv, factor, new_filters, rng, sources).finish(graph, weights, caps)


def widenable(graph: Graph) -> list[str]:
    """The convs wider accepts."""
    index = _Index(graph)
    out = []
    for n in graph.nodes:
        if n.op == "conv2d":
            try:
                _channel_flow(index, n.id)
            except GraphError:
                continue
            out.append(n.id)
    return out


# ---------------------------------------------------------------------------
# skip
# ---------------------------------------------------------------------------


def _skip_strides(src_shape, dst_shape) -> tuple[int, int] | None:
    """Strides of a 1x1 conv taking src's grid onto dst's, or None if none fits.

    A 1x1 conv with stride s and no padding maps n positions to ceil(n / s);
    the smallest s that could work is ceil(n_src / n_dst).
    """
    strides = []
    for a, b in zip(src_shape[:2], dst_shape[:2]):
        s = -(-a // b)
        if a < b or -(-a // s) != b:
            return None
        strides.append(s)
    return strides[0], strides[1]


def _plan_skip(graph: Graph, src: str, dst: str, prefix: str | None = None, index: _Index | None = None) -> _Plan:
    _node(graph, src, None, "skip: 'src'")
    _node(graph, dst, None, "skip: 'dst'")
    src_shape = _image(graph, src, "skip")
    dst_shape = _image(graph, dst, "skip")
    if src == dst:
        raise GraphError("skip: src and dst are the same node", src)
    index = index or _Index(graph)
    if src in index.downstream(dst):
        raise GraphError(f"skip to '{dst}' would make a cycle: this node is downstream of it", src)
    strides = _skip_strides(src_shape, dst_shape)
    if strides is None:
        kind = "upsample" if src_shape[0] < dst_shape[0] or src_shape[1] < dst_shape[1] else "stride"
        raise GraphError(f"skip to '{dst}': cannot {kind} {src_shape[0]}x{src_shape[1]} onto "
                         f"{dst_shape[0]}x{dst_shape[1]} (a 1x1 conv needs an integer stride)", src)
    p = _prefix(graph, ("skip", "add"), prefix, dst)
    conv_id, add_id = f"{p}_skip", f"{p}_add"
    new = [
        Node(conv_id, "conv2d", (src,), {"filters": dst_shape[2], "kernel": [1, 1], "strides": list(strides),
                                          "padding": [0, 0, 0, 0], "use_bias": False}),
        Node(add_id, "add", (dst, conv_id), {}),
    ]
    anchor = max(src, dst, key=index.position.__getitem__)
    nodes = _insert_after(_rewired(graph, dst, add_id, set()), anchor, new)
    args = {"src": src, "dst": dst, "prefix": p}
    child = graph.replace(nodes, None)
    delta = _delta(graph, child, (conv_id, add_id), (conv_id,))
    record = _record("skip", args, index, delta)
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        out = dict(weights)
        # A zero projection adds nothing, yet its gradient is not zero, so it learns.
        out[conv_id] = {"kernel": np.zeros((1, 1, src_shape[2], dst_shape[2]), _dtype(weights))}
        return out

    return _Plan(child, record, make_weights)


def skip(graph: Graph, weights: Mapping | None, src: str, dst: str, rng=None, *, prefix: str | None = None,
         caps: MorphCaps | None = None) -> MorphResult:
    """Make dst's readers read add(dst, conv1x1(src)), the 1x1 conv zero-initialised.

    The conv maps src's channels to dst's and, strided, src's grid onto dst's
    (a stride s takes n positions to ceil(n / s)). Refused: a cycle (src
    downstream of dst), upsampling, or grids no integer stride matches.
    """
    return _plan_skip(graph, src, dst, prefix).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# kernel
# ---------------------------------------------------------------------------


def morph_convs(graph: Graph) -> list[str]:
    """The convs that deeper morphs in the graph's history added and that are still in it."""
    out = []
    for rec in graph.history:
        args = rec.get("args")
        if rec.get("op") == "deeper" and isinstance(args, Mapping) and isinstance(args.get("prefix"), str):
            conv = f"{args['prefix']}_conv"
            if conv in graph and graph[conv].op == "conv2d":
                out.append(conv)
    return out


def _plan_kernel(graph: Graph, conv: str, size: int | None = None, index: _Index | None = None) -> _Plan:
    node = _node(graph, conv, "conv2d", "kernel: 'conv'")
    if conv not in morph_convs(graph):
        raise GraphError("kernel: only convs added by a deeper morph can grow their kernel", conv)
    k = node.attrs["kernel"][0]
    if size is None:
        if k >= MAX_KERNEL:
            raise GraphError(f"kernel: already at the largest kernel, {MAX_KERNEL}", conv)
        size = k + 2
    if isinstance(size, bool) or not isinstance(size, int) or size <= k or size > MAX_KERNEL or (size - k) % 2:
        raise GraphError(f"kernel: size must be larger than {k}, at most {MAX_KERNEL}, and differ from it by an even "
                         f"number, got {size!r}", conv)
    grow = (size - k) // 2
    attrs = {**node.attrs, "kernel": [size, size], "padding": [p + grow for p in node.attrs["padding"]]}
    nodes = [Node(n.id, n.op, n.inputs, attrs) if n.id == conv else n for n in graph.nodes]
    args = {"conv": conv, "size": size}
    child = graph.replace(nodes, None)
    record = _record("kernel", args, index or _Index(graph), _delta(graph, child, (conv,)))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        params = _params(graph, weights, conv)
        out = dict(weights)
        # One more ring of zero taps over one more ring of zero padding: the same sum at every output position.
        out[conv] = {**params, "kernel": np.pad(params["kernel"], ((grow, grow), (grow, grow), (0, 0), (0, 0)))}
        return out

    return _Plan(child, record, make_weights)


def kernel(graph: Graph, weights: Mapping | None, conv: str, size: int | None = None, rng=None, *,
           caps: MorphCaps | None = None) -> MorphResult:
    """Grow a deeper-added conv's kernel (3 -> 5 -> 7; size defaults to the next) by zero-padding it,
    with one more padding per side per step so the output shape stays."""
    return _plan_kernel(graph, conv, size).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# replay, random choice, candidates
# ---------------------------------------------------------------------------

_ARGS = {
    "deeper": ({"after"}, {"kernel", "prefix"}),
    "wider": ({"conv"}, {"new_filters", "sources"}),
    "skip": ({"src", "dst"}, {"prefix"}),
    "kernel": ({"conv"}, {"size"}),
}


def _plan(graph: Graph, op: str, args: Mapping, index: _Index | None = None) -> _Plan:
    if op == "deeper":
        return _plan_deeper(graph, args["after"], args.get("kernel", 3), args.get("prefix"), index)
    if op == "wider":
        return _plan_wider(graph, args["conv"], new_filters=args.get("new_filters"), rng=args.get("rng"),
                           sources=args.get("sources"), index=index)
    if op == "skip":
        return _plan_skip(graph, args["src"], args["dst"], args.get("prefix"), index)
    return _plan_kernel(graph, args["conv"], args.get("size"), index)


def replay(graph: Graph, weights: Mapping | None, record: Mapping, *, caps: MorphCaps | None = None) -> MorphResult:
    """Rebuild the child a record describes from its parent: the same graph and the same weights."""
    op, args, index = _checked_record(graph, record, _ARGS)
    return _plan(graph, op, args, index).finish(graph, weights, caps)


class _Proposer:
    """Draws valid (op, args) pairs on one parent; its target lists are built once."""

    def __init__(self, graph: Graph, ops: Sequence[str]):
        unknown = [op for op in ops if op not in OPERATORS]
        if unknown or not ops:
            raise AiperfError(f"unknown morph op {unknown[0] if unknown else None!r} "
                              f"(choose from {', '.join(OPERATORS)})")
        self.graph = graph
        self.index = _Index(graph)
        self.targets: dict[str, list[str]] = {}
        for op in dict.fromkeys(ops):
            if op == "deeper":
                found = [n.id for n in graph.nodes if n.op == "relu" and len(graph.shapes[n.id]) == 3]
            elif op == "wider":
                found = widenable(graph)
            elif op == "skip":
                found = [n.id for n in graph.nodes if n.op != "input" and len(graph.shapes[n.id]) == 3]
            else:
                found = [c for c in morph_convs(graph) if graph[c].attrs["kernel"][0] < MAX_KERNEL]
            if found:
                self.targets[op] = found

    def propose(self, rng: np.random.Generator) -> tuple[str, dict] | None:
        """A random valid morph, or None for a skip destination that nothing can reach."""
        op = list(self.targets)[rng.integers(len(self.targets))]
        target = self.targets[op][rng.integers(len(self.targets[op]))]
        if op == "deeper":
            return op, {"after": target}
        if op == "wider":
            return op, {"conv": target, "rng": rng}
        if op == "kernel":
            return op, {"conv": target}
        # Skips run forward, from an ancestor whose grid a 1x1 stride maps onto the destination's.
        shapes = self.graph.shapes
        sources = sorted((s for s in _upstream(self.graph, target)
                          if len(shapes[s]) == 3 and _skip_strides(shapes[s], shapes[target]) is not None),
                         key=self.index.position.__getitem__)
        if not sources:
            return None
        return op, {"src": sources[rng.integers(len(sources))], "dst": target}


def random_morph(graph: Graph, weights: Mapping | None, rng=None, ops: Sequence[str] = OPERATORS, *,
                 caps: MorphCaps | None = None) -> MorphResult:
    """One random valid morph among ops; raises CapExceeded if the one drawn breaks a cap."""
    rng = _rng(rng)
    proposer = _Proposer(graph, ops)
    if not proposer.targets:
        raise GraphError(f"no node of this graph admits a {' or '.join(ops)} morph")
    for _ in range(100):
        proposal = proposer.propose(rng)
        if proposal is not None:
            return _plan(graph, *proposal, index=proposer.index).finish(graph, weights, caps)
    raise GraphError(f"found no valid {' or '.join(ops)} morph in 100 draws")


def generate_candidates(graph: Graph, weights: Mapping | None, n: int, seed: int, caps: MorphCaps | None = None,
                        ops: Sequence[str] = OPERATORS) -> list[MorphResult]:
    """Up to n distinct children of graph, seeded and reproducible.

    Candidates that break a cap or repeat an architecture (by signature) are
    skipped; weights are built only for the candidates kept. Fewer than n come
    back only when the graph runs out of distinct valid morphs (after 20 draws
    per wanted candidate).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AiperfError(f"n must be a non-negative integer, got {n!r}")
    with gc_paused():
        return _generate_candidates(graph, weights, n, seed, caps, ops)


def _generate_candidates(graph: Graph, weights: Mapping | None, n: int, seed: int, caps: MorphCaps | None,
                         ops: Sequence[str]) -> list[MorphResult]:
    rng = np.random.default_rng(seed)
    proposer = _Proposer(graph, ops)
    if not proposer.targets:
        return []

    def draw() -> _Plan | None:
        proposal = proposer.propose(rng)
        return None if proposal is None else _plan(graph, *proposal, index=proposer.index)

    return _distinct_children(graph, weights, n, draw, caps, proposer.index)


__all__ = [
    "OPERATORS", "MAX_KERNEL", "deeper", "wider", "skip", "kernel", "replay", "random_morph", "generate_candidates",
    "widenable", "morph_convs",
]
