"""What every family of morphs shares (the CNN's, cnn.py, and a transformer's, transformer.py): the caps
a child must stay under, the result of a morph, the plans behind it (below), the check of a record
against its parent before it is replayed, and the delta: the ops of the nodes a morph touches only.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import PARAMETRIC_OPS, Graph, Node
from aiperf_core.weights import Weights
from aiperf_opcount import count
from aiperf_opcount.rules import node_ops


class CapExceeded(GraphError):
    """A morph would make the child larger than a cap allows."""

    def __init__(self, cap: str, value: int, limit: int):
        self.cap, self.value, self.limit = cap, value, limit
        super().__init__(f"cap {cap} exceeded: the child would have {value:,}, the limit is {limit:,}")


@dataclass(frozen=True)
class MemoryCheck:
    """The memory estimate as a cap (opcount.memory): `needs(graph)` is the bytes a child's smallest
    training step needs a device where that is over `limit`, None where it fits."""

    needs: Callable[[Graph], int | None]
    limit: int


@dataclass(frozen=True)
class MorphCaps:
    """Upper bounds on a child. max_params counts trainable parameters;
    max_ops_per_image is training ops per image (FP + BP, paper convention); memory is the device's
    (a child whose step cannot fit it is skipped as one over a cap is)."""

    max_nodes: int | None = None
    max_params: int | None = None
    max_ops_per_image: int | None = None
    memory: MemoryCheck | None = None

    def __post_init__(self):
        for name in ("max_nodes", "max_params", "max_ops_per_image"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise AiperfError(f"{name} must be a positive integer or None, got {value!r}")

    @property
    def needs_ops(self) -> bool:
        return self.max_ops_per_image is not None

    def check(self, graph: Graph, ops_per_image: int | None = None) -> None:
        """Raise CapExceeded for the first cap the graph exceeds. ops_per_image
        saves a full count when the caller already knows it."""
        if self.max_nodes is not None and len(graph) > self.max_nodes:
            raise CapExceeded("max_nodes", len(graph), self.max_nodes)
        if self.max_params is not None:
            params = graph.num_params()
            if params > self.max_params:
                raise CapExceeded("max_params", params, self.max_params)
        if self.max_ops_per_image is not None:
            if ops_per_image is None:
                ops_per_image = count(graph).total
            if ops_per_image > self.max_ops_per_image:
                raise CapExceeded("max_ops_per_image", ops_per_image, self.max_ops_per_image)
        if self.memory is not None:
            needed = self.memory.needs(graph)
            if needed is not None:
                raise CapExceeded("device_memory", needed, self.memory.limit)


@dataclass(frozen=True)
class MorphResult:
    graph: Graph
    weights: Weights | None
    record: dict


def signature_hash(graph: Graph) -> str:
    """Identifies an architecture independently of node ids."""
    return _hash(graph.signature())


def _hash(signature: str) -> str:
    return hashlib.sha256(signature.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------
# Plans: a child graph plus the (deferred) weight transform that goes with it,
# so candidates can be built, de-duplicated and capped before any weight work.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    graph: Graph
    record: dict
    make_weights: Callable[[Mapping], Weights]

    def check(self, parent: Graph, caps: MorphCaps | None, parent_ops: int | None = None) -> None:
        """Raise CapExceeded if the child breaks a cap; its ops come from the parent's and the delta."""
        if caps is None:
            return
        ops = None
        if caps.needs_ops:
            if parent_ops is None:
                parent_ops = count(parent).total
            ops = parent_ops + self.record["delta"]["fp"] + self.record["delta"]["bp"]
        caps.check(self.graph, ops)

    def result(self, weights) -> MorphResult:
        return MorphResult(self.graph, None if weights is None else self.make_weights(weights), self.record)

    def finish(self, parent: Graph, weights, caps: MorphCaps | None) -> MorphResult:
        self.check(parent, caps)
        return self.result(weights)


class _Index:
    """Consumers and positions of a graph's nodes, built once per morph."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.position = {n.id: k for k, n in enumerate(graph.nodes)}
        self.consumers: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
        for n in graph.nodes:
            for i in n.inputs:
                self.consumers[i].append(n.id)

    @functools.cached_property
    def signature(self) -> str:
        return self.graph.signature()

    @functools.cached_property
    def signature_hash(self) -> str:
        return _hash(self.signature)

    def downstream(self, start: str) -> set[str]:
        """Every node that reads start's output, directly or not (start excluded)."""
        seen: set[str] = set()
        stack = list(self.consumers[start])
        while stack:
            nid = stack.pop()
            if nid not in seen:
                seen.add(nid)
                stack.extend(self.consumers[nid])
        return seen


def _upstream(graph: Graph, start: str) -> set[str]:
    seen: set[str] = set()
    stack = list(graph[start].inputs)
    while stack:
        nid = stack.pop()
        if nid not in seen:
            seen.add(nid)
            stack.extend(graph[nid].inputs)
    return seen


def _has_params_upstream(graph: Graph, start: str) -> bool:
    """opcount's test for whether a layer needs its input gradient; stops at the first hit."""
    seen: set[str] = set()
    stack = list(graph[start].inputs)
    while stack:
        nid = stack.pop()
        if nid in seen:
            continue
        seen.add(nid)
        node = graph[nid]
        if node.op in PARAMETRIC_OPS:
            return True
        stack.extend(node.inputs)
    return False


def _delta(parent: Graph, child: Graph, touched: Iterable[str], new_parametric: Sequence[str] = ()) -> dict:
    """Ops of the touched child nodes minus those of the same nodes in the parent.

    A new parametric node can make a layer below it need its input gradient
    for the first time; such layers are found by walking down from the new
    nodes, stopping wherever the parent already had parameters upstream.
    """
    touched = set(touched)
    if new_parametric:
        consumers = _Index(child).consumers
        stack = list(new_parametric)
        seen: set[str] = set(stack)
        while stack:
            for c in consumers[stack.pop()]:
                if c in seen:
                    continue
                seen.add(c)
                if c not in parent:
                    stack.append(c)
                elif not _has_params_upstream(parent, c):
                    touched.add(c)
                    stack.append(c)
    fp = bp = 0
    for nid in touched:  # a touched node may be new (child only) or replaced (parent only)
        if nid in child:
            ops = node_ops(child, child[nid], "paper", not _has_params_upstream(child, nid))
            fp, bp = fp + ops.fp, bp + ops.bp
        if nid in parent:
            ops = node_ops(parent, parent[nid], "paper", not _has_params_upstream(parent, nid))
            fp, bp = fp - ops.fp, bp - ops.bp
    return {"fp": fp, "bp": bp}


def _record(op: str, args: dict, index: _Index, delta: dict) -> dict:
    return {"op": op, "args": args, "parent": index.signature_hash, "delta": delta}


def _params(graph: Graph, weights: Mapping, node_id: str) -> Mapping[str, np.ndarray]:
    """The weights of one node, checked against the graph (the rest are not read)."""
    have = weights.get(node_id)
    want = graph.param_shapes(node_id)
    if have is None:
        raise GraphError("no weights given for this node", node_id)
    for pname, shape in want.items():
        if pname not in have:
            raise GraphError(f"missing weight '{pname}'", node_id)
        if tuple(np.shape(have[pname])) != tuple(shape):
            raise GraphError(f"weight '{pname}' has shape {list(np.shape(have[pname]))}, expected {list(shape)}",
                             node_id)
    return have


def _dtype(weights: Mapping) -> np.dtype:
    for params in weights.values():
        for array in params.values():
            return np.asarray(array).dtype
    return np.dtype(np.float32)


def _prefix(graph: Graph, suffixes: Sequence[str], prefix: str | None, where: str) -> str:
    """Prefix of a morph's new node ids: m<k>, k the first free number from the history length."""
    if prefix is not None:
        if not isinstance(prefix, str) or not prefix:
            raise GraphError(f"prefix must be a non-empty string, got {prefix!r}", where)
        for s in suffixes:
            if f"{prefix}_{s}" in graph:
                raise GraphError(f"prefix '{prefix}' clashes with an existing node '{prefix}_{s}'", where)
        return prefix
    k = len(graph.history) + 1
    while any(f"m{k}_{s}" in graph for s in suffixes):
        k += 1
    return f"m{k}"


def _node(graph: Graph, node_id: Any, op: str | None, what: str) -> Node:
    if not isinstance(node_id, str):
        raise GraphError(f"{what} must be a node id, got {node_id!r}")
    node = graph[node_id]
    if op is not None and node.op != op:
        article = "an" if op[0] in "aeiou" else "a"
        raise GraphError(f"{what} must be {article} {op} node, this is a {node.op}", node_id)
    return node


def _rewired(graph: Graph, old: str, new: str, skip: set[str]) -> list[Node]:
    """The graph's nodes with every reader of old (except those in skip) reading new."""
    out = []
    for n in graph.nodes:
        if old in n.inputs and n.id not in skip:
            n = Node(n.id, n.op, tuple(new if i == old else i for i in n.inputs), n.attrs)
        out.append(n)
    return out


def _insert_after(nodes: list[Node], anchor: str, new: Sequence[Node]) -> list[Node]:
    """Keep the topological order valid so Graph skips its re-sort."""
    k = next(i for i, n in enumerate(nodes) if n.id == anchor)
    return nodes[: k + 1] + list(new) + nodes[k + 1:]


def _checked_record(graph: Graph, record: Any, arguments: Mapping[str, tuple[set, set]],
                    what: str = "morph") -> tuple[str, Mapping, _Index]:
    """A record's op and args, checked against `arguments` (op -> required and optional names), and the
    parent's index; a GraphError if the record is malformed or was made from another parent."""
    if not isinstance(record, Mapping):
        raise GraphError(f"a {what} record must be an object")
    op, args = record.get("op"), record.get("args")
    if op not in arguments:
        raise GraphError(f"{what} record has unknown op {op!r} (choose from {', '.join(arguments)})")
    if not isinstance(args, Mapping):
        raise GraphError(f"{op} record: 'args' must be an object")
    required, optional = arguments[op]
    missing, extra = sorted(required - set(args)), sorted(set(args) - required - optional)
    if missing or extra:
        raise GraphError(f"{op} record: {'missing' if missing else 'unknown'} argument '{(missing or extra)[0]}'")
    index = _Index(graph)
    parent = index.signature_hash
    if record.get("parent") != parent:
        raise GraphError(f"{op} record was made from another parent (signature {str(record.get('parent'))[:12]}..., "
                         f"this graph {parent[:12]}...)")
    return op, args, index


def _distinct_children(graph: Graph, weights: Mapping | None, n: int, draw: Callable[[], _Plan | None],
                       caps: MorphCaps | None, index: _Index) -> list[MorphResult]:
    """Up to n children from plans drawn one at a time (None: a draw that found nothing), skipping
    those over a cap or repeating an architecture; at most 20 draws per wanted child."""
    parent_ops = count(graph).total if caps is not None and caps.needs_ops else None
    seen = {index.signature}
    out: list[MorphResult] = []
    draws = 0
    while len(out) < n and draws < 20 * n:
        draws += 1
        plan = draw()
        if plan is None:
            continue
        try:
            plan.check(graph, caps, parent_ops)
        except CapExceeded:
            continue
        signature = plan.graph.signature()
        if signature not in seen:
            seen.add(signature)
            out.append(plan.result(weights))
    return out
