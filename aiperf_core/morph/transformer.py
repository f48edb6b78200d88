"""Function-preserving morphs of a decoder-only transformer (builders.gpt, builders.llama): deeper, wider_mlp,
more_heads, double_width and upcycle_moe.

The contract is the CNN morphs' (aiperf_core.morph.cnn), whose plan machinery (aiperf_core.morph.plan)
these operators share: the child computes what its parent computed (exactly in real arithmetic; no
transformer op keeps batch statistics, so in training mode too), its history gains one JSON-plain record
{"op", "args", "parent", "delta"}, `args` hold every choice (random ones as a seed), so `replay` rebuilds
the same child from the same parent, and `delta` is the change in analytic ops per sequence, from the
nodes the morph touches only.

Two block families are known, told apart by the norm that feeds the attention: a GPT's (layer norm, biases,
learned positions, a GELU MLP dense -> gelu -> dense) and a Llama's (RMS norm, no biases, rotary positions
on the query and key, grouped-query attention, a SwiGLU MLP: dense gate and up, silu on the gate, mul,
dense down). An MLP is named by the dense that opens it (the `fc1` argument): a GPT's fc1, a SwiGLU's gate
(the up projection is the gate's partner, found from it; naming it is refused with the gate's name).

* deeper: a new block after a node of the residual stream (an add, the positions, or a Llama's
  embedding), of the family of the nearest block (the next one, else the previous), with its heads, head
  width, key-value heads, rotary base and MLP width: a GPT's pre-LN x + proj(attention(LN(x))) then
  x + fc2(gelu(fc1(LN(x)))), or a Llama's x + proj(attention(rope(q), rope(k), v)) over RMSNorm(x) then
  x + down(silu(gate(h)) * up(h)), h = RMSNorm(x). Its attention output projection and its MLP output
  projection (fc2, down) start at zero, so the block adds nothing; its other projections start
  He-normal, as the seed's do, so that the first step's gradients on the two zero projections are not
  zero and the block learns.
* wider_mlp: Net2Net duplication of MLP hidden units: the new units of fc1 (of both gate and up, so a
  copied unit's silu(gate) * up is its source's) copy randomly chosen ones, and fc2's (down's) rows of
  each copied unit are split among its copies. The split is random (fractions drawn in [0.5, 1.5] and
  normalised), not even: copies with equal shares would receive equal gradients and stay copies forever.
* more_heads: one more key-value group of heads of the same width (the width sets the 1/sqrt(d)
  scaling): heads / kv_heads query heads and one key-value head, appended last, so that every old query
  head keeps its key-value head (h // (heads / kv_heads) does not change for h below heads). With
  multi-head attention (a GPT's) that is one head. Whole groups, not one query head within a group:
  the group size heads / kv_heads is the model's choice of key-value sharing, which a morph keeps, and
  a uniform grouping with one more query head in each group would move every old head (a permutation of
  q's columns and the output projection's rows) for the same function; under multi-query attention
  (kv_heads 1) a group is every head, so the morph doubles the query heads and makes the attention
  grouped-query with two key-value heads. q, k and v gain the new heads' columns, He-normal (a rotary
  between a projection and the attention rotates them as heads of their own); every layer reading the
  attention gains zero rows for them, so whatever they attend to, they contribute nothing until trained.
* double_width: every feature of the residual stream, of q, k and v (so twice the heads and key-value
  heads, each as wide as before) and of the MLPs duplicated, the width operator of Shen et al., "Staged
  Training for Transformer Language Models" (2022): a duplicated vector has its original's mean,
  variance and mean square, so every layer norm and RMS norm computes what it did, on both copies; a
  duplicated query or key is its heads twice over, which rotary rotates alike, and query head
  heads + h reads key-value head kv_heads + h // (heads / kv_heads), the copy of its original's. The
  embeddings, positions and norms are copied; each dense layer reads two copies of each input, and its
  two shares of each weight (random, a + b = 1, for the reason wider_mlp's are) sum to the original, for
  both copies of each output; silu and mul act elementwise on copies; the LM head keeps its
  vocabulary-wide output, so the logits do not change. A moe node doubles as a dense pair does (a
  SwiGLU expert as its three), expert by expert, and its router as the LM head: the routing does not
  change.
* upcycle_moe: an MLP becomes a mixture of experts (one `moe` node, aiperf_core.ir) whose experts are
  all copies of it, behind a He-normal router (Komatsuzaki et al., "Sparse Upcycling", 2022): GELU
  experts with biases from a GPT's MLP, SwiGLU experts (`mlp: swiglu`, which have no biases) from a
  SwiGLU MLP without biases. The gates of a token's top_k experts are renormalised to sum to 1, so the
  output is the MLP's whatever the routing; the experts part as the router sends them different tokens
  with different gates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from aiperf_core.builders import llama_ffn
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.gcpause import gc_paused
from aiperf_core.ir import PARAMETRIC_OPS, Graph, Node, kv_heads
from aiperf_core.morph.plan import (CapExceeded, MorphCaps, MorphResult, _checked_record, _delta, _distinct_children,
                                    _dtype, _Index, _insert_after, _node, _params, _Plan, _prefix, _record, _rewired)
from aiperf_core.weights import Weights, he_normal, init_node_weights

OPERATORS = ("deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe")
WIDER_MLP_FACTOR = 0.5  # a drawn wider_mlp adds half the MLP's units
# upcycle_moe's defaults: Switch/GShard-style top-2 routing over a few experts, so that a drawn upcycle
# costs about twice its MLP per token (plus the router), not E times.
MOE_EXPERTS, MOE_TOP_K = 4, 2
BLOCK_SUFFIXES = ("ln1", "q", "k", "v", "attn", "proj", "res1", "ln2", "fc1", "gelu", "fc2", "res2")
LLAMA_BLOCK_SUFFIXES = ("norm1", "q", "k", "v", "q_rope", "k_rope", "attn", "proj", "res1", "norm2", "gate", "up",
                        "silu", "glu", "down", "res2")  # builders.llama_block's
_LN_EPSILON = 1e-5  # builders.gpt's
_RESIDUAL = frozenset({"add", "position_embedding"})
# The ops double_width has a rule for: a graph holding another is refused.
_DOUBLING_OPS = frozenset({"token_input", "embedding", "position_embedding", "layer_norm", "rms_norm", "dense",
                           "rotary", "attention", "gelu", "silu", "mul", "add", "softmax", "moe"})


def transformer_size(graph: Graph) -> dict[str, int]:
    """What TransformerCaps bound: `layers` (attention layers), `width` (the widest embedding: the
    residual stream), `heads` (the most of one attention) and `experts` (the most of one mixture)."""
    def most(op: str, attr: str) -> int:
        return max((n.attrs[attr] for n in graph.nodes if n.op == op), default=0)

    return {"layers": sum(n.op == "attention" for n in graph.nodes), "width": most("embedding", "units"),
            "heads": most("attention", "heads"), "experts": most("moe", "experts")}


@dataclass(frozen=True)
class TransformerCaps(MorphCaps):
    """MorphCaps with a transformer's own bounds (the lm policy's max_layers, max_width, max_heads
    and max_experts): a child over one is skipped, as one over max_params is."""

    max_layers: int | None = None
    max_width: int | None = None
    max_heads: int | None = None
    max_experts: int | None = None

    def __post_init__(self):
        super().__post_init__()
        for name in ("max_layers", "max_width", "max_heads", "max_experts"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise AiperfError(f"{name} must be a positive integer or None, got {value!r}")

    def check(self, graph: Graph, ops_per_image: int | None = None) -> None:
        super().check(graph, ops_per_image)
        size = transformer_size(graph)
        for name in ("layers", "width", "heads", "experts"):
            limit = getattr(self, f"max_{name}")
            if limit is not None and size[name] > limit:
                raise CapExceeded(f"max_{name}", size[name], limit)


def _seed(value, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GraphError(f"{what}: seed must be a non-negative integer, got {value!r}", where)
    return value


def _sequence(graph: Graph, node_id: str, what: str) -> tuple[int, int]:
    shape = graph.shapes[node_id]
    if len(shape) != 2:
        raise GraphError(f"{what} needs a sequence node (S, D), this one has shape {list(shape)}", node_id)
    return shape


def _nearest(graph: Graph, index: _Index, anchor: str, found: Sequence[str]) -> str | None:
    """The first of `found` after anchor in the graph's order, else the last before it."""
    at = index.position[anchor]
    after = [f for f in found if index.position[f] > at]
    return min(after, key=index.position.__getitem__) if after else (max(found, key=index.position.__getitem__)
                                                                      if found else None)


# ---------------------------------------------------------------------------
# blocks: what a GPT's parts look like in the IR
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Mlp:
    """An MLP's nodes: a GPT's fc1 -> gelu -> fc2, or a SwiGLU's gate -> silu -> glu <- up, glu -> down
    (then `first` is the gate, `act` the silu and `last` the down projection)."""

    first: str
    act: str
    last: str
    up: str | None = None
    glu: str | None = None

    @property
    def swiglu(self) -> bool:
        return self.up is not None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for n in (self.first, self.up, self.act, self.glu, self.last) if n is not None)

    @property
    def hidden(self) -> tuple[str, ...]:
        """The dense layers whose output units are the MLP's hidden units."""
        return (self.first, self.up) if self.swiglu else (self.first,)


def _only_reader(graph: Graph, index: _Index, node_id: str, op: str) -> str | None:
    readers = index.consumers[node_id]
    return readers[0] if len(readers) == 1 and graph[readers[0]].op == op else None


def _mlp_at(graph: Graph, index: _Index, first: str) -> _Mlp | None:
    """The MLP that the dense `first` opens, or None."""
    if graph[first].op != "dense" or len(graph.shapes[first]) != 2:
        return None
    gelu = _only_reader(graph, index, first, "gelu")
    if gelu is not None:
        fc2 = _only_reader(graph, index, gelu, "dense")
        return None if fc2 is None else _Mlp(first, gelu, fc2)
    silu = _only_reader(graph, index, first, "silu")
    glu = None if silu is None else _only_reader(graph, index, silu, "mul")
    if glu is None:
        return None
    up = next(i for i in graph[glu].inputs if i != silu)  # mul has two distinct inputs
    down = _only_reader(graph, index, glu, "dense")
    if (down is None or graph[up].op != "dense" or index.consumers[up] != [glu]
            or graph[up].inputs != graph[first].inputs):
        return None
    return _Mlp(first, silu, down, up, glu)


def _mlp(graph: Graph, index: _Index, first: str, what: str) -> _Mlp:
    """The MLP `first` opens; a GraphError naming it where it opens none (and the gate, for a SwiGLU's up)."""
    _node(graph, first, "dense", f"{what}: 'fc1'")
    found = _mlp_at(graph, index, first)
    if found is not None:
        return found
    glu = _only_reader(graph, index, first, "mul")
    gate = None if glu is None else next(i for i in graph[glu].inputs if i != first)
    if gate is not None and graph[gate].op == "silu" and _mlp_at(graph, index, graph[gate].inputs[0]) is not None:
        raise GraphError(f"{what}: 'fc1' is a SwiGLU MLP's up projection; name its gate "
                         f"'{graph[gate].inputs[0]}', which opens the MLP", first)
    raise GraphError(f"{what}: 'fc1' must open an MLP (dense -> gelu -> dense, or a SwiGLU's gate: dense -> silu -> "
                     f"mul with a dense up of the same input -> dense, each read by the next alone)", first)


def mlp_inputs(graph: Graph, index: _Index | None = None) -> list[str]:
    """The dense nodes that open an MLP: a GPT's fc1 (dense -> gelu -> dense, each read by the next
    alone) and a SwiGLU MLP's gate."""
    index = index or _Index(graph)
    return [n.id for n in graph.nodes if n.op == "dense" and _mlp_at(graph, index, n.id) is not None]


@dataclass(frozen=True)
class _Attention:
    """An attention node's q, k and v projections (dense), the rotary nodes between a projection and
    the attention (projection -> rotary), and the dense layers reading the attention."""

    projections: tuple[str, str, str]
    rotary: Mapping[str, str]
    readers: tuple[str, ...]


def _attention_parts(graph: Graph, index: _Index, attention: str) -> _Attention:
    """An attention node's parts; a GraphError where a new head could not be added without changing
    another reader."""
    node = _node(graph, attention, "attention", "more_heads: 'attention'")
    projections, rotary = [], {}
    for i in node.inputs:
        if graph[i].op == "rotary" and index.consumers[i] == [attention]:
            p = graph[i].inputs[0]
            if graph[p].op != "dense" or index.consumers[p] != [i]:
                raise GraphError(f"more_heads: '{p}' must be a dense node read by the rotary '{i}' alone", attention)
            rotary[p] = i
            projections.append(p)
        elif graph[i].op != "dense" or index.consumers[i] != [attention]:
            raise GraphError(f"more_heads: '{i}' must be a dense node read by the attention alone", attention)
        else:
            projections.append(i)
    if len(set(projections)) != 3:
        raise GraphError("more_heads: q, k and v must be three separate dense nodes", attention)
    readers = index.consumers[attention]
    if not readers or any(graph[r].op != "dense" for r in readers):
        raise GraphError("more_heads: every reader of the attention must be a dense node", attention)
    return _Attention(tuple(projections), rotary, tuple(readers))


def growable_attention(graph: Graph, index: _Index | None = None) -> list[str]:
    """The attention nodes more_heads accepts."""
    index = index or _Index(graph)
    out = []
    for n in graph.nodes:
        if n.op == "attention":
            try:
                _attention_parts(graph, index, n.id)
            except GraphError:
                continue
            out.append(n.id)
    return out


def _is_residual(graph: Graph, index: _Index, node_id: str) -> bool:
    """An add or the positions of (S, D) shape, or an embedding that no position table follows (a Llama's)."""
    node = graph[node_id]
    if len(graph.shapes[node_id]) != 2:
        return False
    if node.op == "embedding":
        return all(graph[r].op != "position_embedding" for r in index.consumers[node_id])
    return node.op in _RESIDUAL


def residual_points(graph: Graph, index: _Index | None = None) -> list[str]:
    """The nodes deeper may insert a block after: the residual stream's sums, the positions, and an
    embedding that is the stream's start (a Llama has no position table)."""
    index = index or _Index(graph)
    return [n.id for n in graph.nodes if _is_residual(graph, index, n.id)]


# ---------------------------------------------------------------------------
# deeper
# ---------------------------------------------------------------------------


def _query_norm(graph: Graph, attention: str) -> Node | None:
    """The node a block's query projection reads (through its rotary, if any): the block's first norm."""
    q = graph[graph[attention].inputs[0]]
    if q.op == "rotary":
        q = graph[q.inputs[0]]
    return graph[q.inputs[0]] if q.op == "dense" else None


def _use_bias(node: Node) -> bool:
    return node.op == "dense" and node.attrs["use_bias"]


def _gpt_block(graph: Graph, index: _Index, after: str, attention: str, width: int, p: str) -> list[Node]:
    heads, head_dim = graph[attention].attrs["heads"], graph[attention].attrs["head_dim"]
    mlp = _nearest(graph, index, after, [m for m in mlp_inputs(graph, index) if not _mlp_at(graph, index, m).swiglu])
    ffn = graph[mlp].attrs["units"] if mlp is not None else 4 * width
    ids = {s: f"{p}_{s}" for s in BLOCK_SUFFIXES}
    dense = {"use_bias": True}
    return [
        Node(ids["ln1"], "layer_norm", (after,), {"epsilon": _LN_EPSILON}),
        *(Node(ids[w], "dense", (ids["ln1"],), {"units": heads * head_dim, **dense}) for w in ("q", "k", "v")),
        Node(ids["attn"], "attention", (ids["q"], ids["k"], ids["v"]),
             {"heads": heads, "head_dim": head_dim, "causal": True}),
        Node(ids["proj"], "dense", (ids["attn"],), {"units": width, **dense}),
        Node(ids["res1"], "add", (after, ids["proj"]), {}),
        Node(ids["ln2"], "layer_norm", (ids["res1"],), {"epsilon": _LN_EPSILON}),
        Node(ids["fc1"], "dense", (ids["ln2"],), {"units": ffn, **dense}),
        Node(ids["gelu"], "gelu", (ids["fc1"],), {}),
        Node(ids["fc2"], "dense", (ids["gelu"],), {"units": width, **dense}),
        Node(ids["res2"], "add", (ids["res1"], ids["fc2"]), {}),
    ]


def _llama_block(graph: Graph, index: _Index, after: str, attention: str, width: int, p: str) -> list[Node]:
    """A Llama block in the form of `attention`'s block (its norm's epsilon, its projections' biases, its
    rotary nodes, its heads and key-value heads) and of the nearest SwiGLU MLP (its width and biases;
    with none, llama_ffn(width) and no biases)."""
    ids = {s: f"{p}_{s}" for s in LLAMA_BLOCK_SUFFIXES}
    node = graph[attention]
    head_dim, epsilon = node.attrs["head_dim"], _query_norm(graph, attention).attrs["epsilon"]
    gate = _nearest(graph, index, after, [m for m in mlp_inputs(graph, index) if _mlp_at(graph, index, m).swiglu])
    mlp = _mlp_at(graph, index, gate) if gate is not None else None
    ffn = graph[gate].attrs["units"] if mlp else llama_ffn(width)
    mlp_bias = (dict(zip(("gate", "up", "down"), (_use_bias(graph[n]) for n in (mlp.first, mlp.up, mlp.last))))
                if mlp else dict.fromkeys(("gate", "up", "down"), False))
    new = [Node(ids["norm1"], "rms_norm", (after,), {"epsilon": epsilon})]
    attention_inputs = []
    for s, source, units in zip(("q", "k", "v"), node.inputs, (node.attrs["heads"], kv_heads(node.attrs),
                                                               kv_heads(node.attrs))):
        rotary = graph[source] if graph[source].op == "rotary" and s != "v" else None
        projection = graph[rotary.inputs[0]] if rotary else graph[source]
        new.append(Node(ids[s], "dense", (ids["norm1"],), {"units": units * head_dim,
                                                           "use_bias": _use_bias(projection)}))
        if rotary:
            new.append(Node(ids[f"{s}_rope"], "rotary", (ids[s],), dict(rotary.attrs)))
        attention_inputs.append(new[-1].id)
    readers = index.consumers[attention]
    return new + [
        Node(ids["attn"], "attention", tuple(attention_inputs), dict(node.attrs)),
        Node(ids["proj"], "dense", (ids["attn"],), {"units": width, "use_bias": _use_bias(graph[readers[0]])}),
        Node(ids["res1"], "add", (after, ids["proj"]), {}),
        Node(ids["norm2"], "rms_norm", (ids["res1"],), {"epsilon": epsilon}),
        *(Node(ids[s], "dense", (ids["norm2"],), {"units": ffn, "use_bias": mlp_bias[s]}) for s in ("gate", "up")),
        Node(ids["silu"], "silu", (ids["gate"],), {}),
        Node(ids["glu"], "mul", (ids["silu"], ids["up"]), {}),
        Node(ids["down"], "dense", (ids["glu"],), {"units": width, "use_bias": mlp_bias["down"]}),
        Node(ids["res2"], "add", (ids["res1"], ids["down"]), {}),
    ]


def _plan_deeper(graph: Graph, after: str, seed: int = 0, prefix: str | None = None,
                 index: _Index | None = None) -> _Plan:
    node = _node(graph, after, None, "deeper: 'after'")
    index = index or _Index(graph)
    if not _is_residual(graph, index, after) and node.op not in _RESIDUAL:
        raise GraphError(f"deeper: 'after' must be an add or position_embedding node of the residual stream "
                         f"(or a Llama's embedding), this is a {node.op}", after)
    _, width = _sequence(graph, after, "deeper")
    seed = _seed(seed, "deeper", after)
    attention = _nearest(graph, index, after, [n.id for n in graph.nodes if n.op == "attention"])
    if attention is None:
        raise GraphError("deeper: the graph has no attention node to take the new block's heads from", after)
    norm = _query_norm(graph, attention)
    llama = norm is not None and norm.op == "rms_norm"
    suffixes = LLAMA_BLOCK_SUFFIXES if llama else BLOCK_SUFFIXES
    p = _prefix(graph, suffixes, prefix, after)
    new = (_llama_block if llama else _gpt_block)(graph, index, after, attention, width, p)
    ids = [n.id for n in new]
    nodes = _insert_after(_rewired(graph, after, ids[-1], set(ids)), after, new)
    args = {"after": after, "seed": seed, "prefix": p}
    child = graph.replace(nodes, None)
    parametric = [n.id for n in new if n.op in PARAMETRIC_OPS]
    record = _record("deeper", args, index, _delta(graph, child, ids, parametric))
    child = graph.replace(nodes, record)
    zeroed = (f"{p}_proj", f"{p}_down" if llama else f"{p}_fc2")  # the block's two outputs: it adds nothing yet

    def make_weights(weights: Mapping) -> Weights:
        dtype = _dtype(weights)
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for nid in parametric:
            out[nid] = init_node_weights(child, nid, rng, dtype)
        for nid in zeroed:
            out[nid] = {k: np.zeros_like(v) for k, v in out[nid].items()}
        return out

    return _Plan(child, record, make_weights)


def deeper(graph: Graph, weights: Mapping | None, after: str, seed: int = 0, *, prefix: str | None = None,
           caps: MorphCaps | None = None) -> MorphResult:
    """Insert a pre-norm block after the residual-stream node `after`, of the nearest block's family (GPT or
    Llama) and with its heads, head width and MLP width (the next block's, else the previous one's)."""
    return _plan_deeper(graph, after, seed, prefix).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# wider_mlp
# ---------------------------------------------------------------------------


def _split(seed: int, width: int, units: int) -> tuple[np.ndarray, np.ndarray]:
    """The sources of `units` new hidden units among `width`, and every unit's share of its source's
    outgoing weights (the shares of a source and its copies sum to 1)."""
    rng = np.random.default_rng(seed)
    sources = np.concatenate([np.arange(width), rng.integers(0, width, units)])
    raw = rng.uniform(0.5, 1.5, width + units)
    return sources, raw / np.bincount(sources, weights=raw, minlength=width)[sources]


def _plan_wider_mlp(graph: Graph, fc1: str, units: int | None = None, seed: int = 0,
                    index: _Index | None = None) -> _Plan:
    index = index or _Index(graph)
    mlp = _mlp(graph, index, fc1, "wider_mlp")
    width = graph[fc1].attrs["units"]
    units = max(1, round(width * WIDER_MLP_FACTOR)) if units is None else units
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise GraphError(f"wider_mlp: units must be a positive integer, got {units!r}", fc1)
    seed = _seed(seed, "wider_mlp", fc1)
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, "units": width + units}) if n.id in mlp.hidden else n
             for n in graph.nodes]
    args = {"fc1": fc1, "units": units, "seed": seed}
    child = graph.replace(nodes, None)
    record = _record("wider_mlp", args, index, _delta(graph, child, mlp.nodes))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        sources, shares = _split(seed, width, units)
        out = dict(weights)
        for hidden in mlp.hidden:  # a SwiGLU's gate and up alike: a copied unit's silu(gate) * up is its source's
            out[hidden] = {k: np.take(v, sources, axis=-1) for k, v in _params(graph, weights, hidden).items()}
        second = _params(graph, weights, mlp.last)
        kernel = np.asarray(second["kernel"])
        out[mlp.last] = {**second,
                         "kernel": (np.take(kernel, sources, axis=0) * shares[:, None]).astype(kernel.dtype)}
        return out

    return _Plan(child, record, make_weights)


def wider_mlp(graph: Graph, weights: Mapping | None, fc1: str, units: int | None = None, seed: int = 0, *,
              caps: MorphCaps | None = None) -> MorphResult:
    """Add `units` hidden units (default half as many again) to the MLP that `fc1` (a GPT's fc1, a SwiGLU's
    gate) opens, Net2Net-style."""
    return _plan_wider_mlp(graph, fc1, units, seed).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# more_heads
# ---------------------------------------------------------------------------


def _plan_more_heads(graph: Graph, attention: str, seed: int = 0, index: _Index | None = None) -> _Plan:
    index = index or _Index(graph)
    parts = _attention_parts(graph, index, attention)
    seed = _seed(seed, "more_heads", attention)
    attrs = graph[attention].attrs
    heads, head_dim, groups = attrs["heads"], attrs["head_dim"], kv_heads(attrs)
    group = heads // groups  # query heads per key-value head: a new group adds that many and one key-value head
    q, k, v = parts.projections
    changed = {q: {"units": (heads + group) * head_dim}, k: {"units": (groups + 1) * head_dim},
               v: {"units": (groups + 1) * head_dim},
               attention: {"heads": heads + group, **({"kv_heads": groups + 1} if "kv_heads" in attrs else {})}}
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, **changed[n.id]}) if n.id in changed else n for n in graph.nodes]
    args = {"attention": attention, "seed": seed}
    child = graph.replace(nodes, None)
    touched = (*parts.projections, *parts.rotary.values(), attention, *parts.readers)
    record = _record("more_heads", args, index, _delta(graph, child, touched))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for p in parts.projections:  # the new heads' columns, drawn as the seed's projections are
            params = _params(graph, weights, p)
            fresh = init_node_weights(child, p, rng, np.asarray(params["kernel"]).dtype)
            old = graph.shapes[p][-1]
            out[p] = {k: np.concatenate([v, fresh[k][..., old:]], axis=-1) for k, v in params.items()}
        for r in parts.readers:  # zero rows: the new heads contribute nothing yet
            params = _params(graph, weights, r)
            kernel = np.asarray(params["kernel"])
            out[r] = {**params, "kernel": np.concatenate([kernel, np.zeros((group * head_dim, kernel.shape[1]),
                                                                           kernel.dtype)])}
        return out

    return _Plan(child, record, make_weights)


def more_heads(graph: Graph, weights: Mapping | None, attention: str, seed: int = 0, *,
               caps: MorphCaps | None = None) -> MorphResult:
    """Add one key-value group of heads of the same width to `attention`: heads / kv_heads query heads and one
    key-value head (one head under multi-head attention)."""
    return _plan_more_heads(graph, attention, seed).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# double_width
# ---------------------------------------------------------------------------


def _lm_head(graph: Graph) -> str:
    """The dense layer the output softmax reads (its output is the vocabulary, which stays); a GraphError
    naming the node where double_width has no rule."""
    for n in graph.nodes:
        if n.op not in _DOUBLING_OPS:
            raise GraphError(f"double_width: a {n.op} node has no width rule", n.id)
    out = graph[graph.output_id]
    head = graph[out.inputs[0]] if out.op == "softmax" else None
    if head is None or head.op != "dense":
        raise GraphError("double_width: the output must be a softmax over a dense LM head", graph.output_id)
    return head.id


def _plan_double_width(graph: Graph, seed: int = 0, index: _Index | None = None) -> _Plan:
    head = _lm_head(graph)
    seed = _seed(seed, "double_width", head)
    index = index or _Index(graph)
    doubled = {"embedding": ("units",), "dense": ("units",), "attention": ("heads", "kv_heads"), "moe": ("units",)}

    def grown(n: Node) -> Node:
        keys = [] if n.id == head else [k for k in doubled.get(n.op, ()) if k in n.attrs]
        return Node(n.id, n.op, n.inputs, {**n.attrs, **{k: 2 * n.attrs[k] for k in keys}}) if keys else n

    nodes = [grown(n) for n in graph.nodes]
    args = {"seed": seed}
    child = graph.replace(nodes, None)
    record = _record("double_width", args, index, _delta(graph, child, [n.id for n in graph.nodes]))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for n in graph.nodes:
            if n.op in ("embedding", "position_embedding", "layer_norm", "rms_norm"):
                out[n.id] = {k: np.concatenate([v, v], axis=-1) for k, v in _params(graph, weights, n.id).items()}
            elif n.op == "dense":
                params = _params(graph, weights, n.id)
                out[n.id] = {"kernel": _doubled_kernel(params["kernel"], rng, outputs=n.id != head)}
                if "bias" in params:
                    bias = np.asarray(params["bias"])
                    out[n.id]["bias"] = bias if n.id == head else np.concatenate([bias, bias])
            elif n.op == "moe":  # the router's logits stay (so does the routing); each expert as its dense layers
                params = _params(graph, weights, n.id)
                names = graph.param_shapes(n.id)
                out[n.id] = {"router": _doubled_kernel(params["router"], rng, outputs=False),
                             **{k: np.stack([_doubled_kernel(w, rng, outputs=True) for w in params[k]])
                                for k in ("w_gate", "w_in", "w_out") if k in names},
                             **{k: np.concatenate([params[k], params[k]], axis=-1) for k in ("b_in", "b_out")
                                if k in names}}
        return out

    return _Plan(child, record, make_weights)


def _doubled_kernel(kernel, rng: np.random.Generator, outputs: bool) -> np.ndarray:
    """An (in, out) kernel reading two copies of each input row: each weight split between them with
    random shares; with `outputs`, every output column copied too (both copies compute the original)."""
    kernel = np.asarray(kernel)
    copies = np.concatenate([kernel, kernel], axis=1) if outputs else kernel
    top = (rng.uniform(0.25, 0.75, copies.shape) * copies).astype(kernel.dtype)
    return np.concatenate([top, copies - top])


def double_width(graph: Graph, weights: Mapping | None, seed: int = 0, *,
                 caps: MorphCaps | None = None) -> MorphResult:
    """Double the width of everything but the vocabulary: the residual stream, the heads and the MLPs."""
    return _plan_double_width(graph, seed).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# upcycle_moe
# ---------------------------------------------------------------------------


def _expert_biases(graph: Graph, mlp: _Mlp) -> str | None:
    """Why the MLP's biases do not fit an expert's (GELU experts have biases, SwiGLU experts none), or None."""
    biases = [graph[n].attrs["use_bias"] for n in (*mlp.hidden, mlp.last)]
    if mlp.swiglu and any(biases):
        return "a SwiGLU MLP's gate, up and down must have no biases, as a SwiGLU expert's have none"
    if not mlp.swiglu and not all(biases):
        return "the MLP's two layers must have biases, as an expert's do"
    return None


def _plan_upcycle_moe(graph: Graph, fc1: str, experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K, seed: int = 0,
                      prefix: str | None = None, index: _Index | None = None) -> _Plan:
    index = index or _Index(graph)
    mlp = _mlp(graph, index, fc1, "upcycle_moe")
    node, last = graph[fc1], mlp.last
    refusal = _expert_biases(graph, mlp)
    if refusal:
        raise GraphError(f"upcycle_moe: {refusal}", fc1)
    width = graph.shapes[node.inputs[0]][-1]
    if graph[last].attrs["units"] != width or len(graph.shapes[last]) != 2:
        raise GraphError("upcycle_moe: the MLP must map a sequence (S, D) back to (S, D)", last)
    for name, value, low in (("experts", experts, 2), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GraphError(f"upcycle_moe: {name} must be an integer >= {low}, got {value!r}", fc1)
    if top_k > experts:
        raise GraphError(f"upcycle_moe: top_k ({top_k}) must not exceed experts ({experts})", fc1)
    seed = _seed(seed, "upcycle_moe", fc1)
    p = _prefix(graph, ("moe",), prefix, fc1)
    moe = f"{p}_moe"
    attrs = {"experts": experts, "top_k": top_k, "units": node.attrs["units"], **({"mlp": "swiglu"} if mlp.swiglu
                                                                                  else {})}
    replaced = set(mlp.nodes)
    nodes = []
    for n in _rewired(graph, last, moe, replaced):
        if n.id == fc1:
            nodes.append(Node(moe, "moe", node.inputs, attrs))
        elif n.id not in replaced:
            nodes.append(n)
    args = {"fc1": fc1, "experts": experts, "top_k": top_k, "seed": seed, "prefix": p}
    child = graph.replace(nodes, None)
    record = _record("upcycle_moe", args, index, _delta(graph, child, (moe, *mlp.nodes)))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        first, second = _params(graph, weights, fc1), _params(graph, weights, last)
        dtype = np.asarray(first["kernel"]).dtype
        out = {k: v for k, v in weights.items() if k not in replaced}

        def stack(array) -> np.ndarray:
            return np.repeat(np.asarray(array)[None], experts, axis=0)

        router = he_normal((width, experts), width, np.random.default_rng(seed), dtype)  # as init_weights draws it
        if mlp.swiglu:
            out[moe] = {"router": router, "w_gate": stack(first["kernel"]),
                        "w_in": stack(_params(graph, weights, mlp.up)["kernel"]), "w_out": stack(second["kernel"])}
        else:
            out[moe] = {"router": router, "w_in": stack(first["kernel"]), "b_in": stack(first["bias"]),
                        "w_out": stack(second["kernel"]), "b_out": stack(second["bias"])}
        return out

    return _Plan(child, record, make_weights)


def upcycle_moe(graph: Graph, weights: Mapping | None, fc1: str, experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                seed: int = 0, *, prefix: str | None = None, caps: MorphCaps | None = None) -> MorphResult:
    """Turn the MLP that `fc1` (a GPT's fc1, a SwiGLU's gate) opens into a mixture of `experts` copies of it,
    `top_k` of them per token."""
    return _plan_upcycle_moe(graph, fc1, experts, top_k, seed, prefix).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# replay, random choice, candidates
# ---------------------------------------------------------------------------

_ARGS = {
    "deeper": ({"after"}, {"seed", "prefix"}),
    "wider_mlp": ({"fc1"}, {"units", "seed"}),
    "more_heads": ({"attention"}, {"seed"}),
    "double_width": (set(), {"seed"}),
    "upcycle_moe": ({"fc1"}, {"experts", "top_k", "seed", "prefix"}),
}


def _plan(graph: Graph, op: str, args: Mapping, index: _Index | None = None) -> _Plan:
    if op == "deeper":
        return _plan_deeper(graph, args["after"], args.get("seed", 0), args.get("prefix"), index)
    if op == "wider_mlp":
        return _plan_wider_mlp(graph, args["fc1"], args.get("units"), args.get("seed", 0), index)
    if op == "double_width":
        return _plan_double_width(graph, args.get("seed", 0), index)
    if op == "upcycle_moe":
        return _plan_upcycle_moe(graph, args["fc1"], args.get("experts", MOE_EXPERTS), args.get("top_k", MOE_TOP_K),
                                 args.get("seed", 0), args.get("prefix"), index)
    return _plan_more_heads(graph, args["attention"], args.get("seed", 0), index)


def replay(graph: Graph, weights: Mapping | None, record: Mapping, *, caps: MorphCaps | None = None) -> MorphResult:
    """Rebuild the child a record describes from its parent: the same graph and the same weights."""
    op, args, index = _checked_record(graph, record, _ARGS, "transformer morph")
    return _plan(graph, op, args, index).finish(graph, weights, caps)


def _targets(graph: Graph, index: _Index, ops: Sequence[str]) -> dict[str, list[str]]:
    unknown = [op for op in ops if op not in OPERATORS]
    if unknown or not ops:
        raise AiperfError(f"unknown transformer morph op {unknown[0] if unknown else None!r} "
                          f"(choose from {', '.join(OPERATORS)})")
    mlps = mlp_inputs(graph, index)
    found = {"deeper": residual_points(graph, index) if any(n.op == "attention" for n in graph.nodes) else [],
             "wider_mlp": mlps, "more_heads": growable_attention(graph, index),
             "double_width": [None] if doublable(graph) else [],
             "upcycle_moe": [m for m in mlps if _expert_biases(graph, _mlp_at(graph, index, m)) is None]}
    return {op: found[op] for op in dict.fromkeys(ops) if found[op]}


_TARGET_ARG = {"deeper": "after", "wider_mlp": "fc1", "more_heads": "attention", "double_width": None,
               "upcycle_moe": "fc1"}


def doublable(graph: Graph) -> bool:
    """Whether double_width accepts the graph."""
    try:
        _lm_head(graph)
    except GraphError:
        return False
    return True


def _draw(targets: Mapping[str, list], rng: np.random.Generator) -> tuple[str, dict]:
    op = list(targets)[rng.integers(len(targets))]
    target = targets[op][rng.integers(len(targets[op]))]
    args = {} if _TARGET_ARG[op] is None else {_TARGET_ARG[op]: target}
    return op, {**args, "seed": int(rng.integers(2**31))}


def random_morph(graph: Graph, weights: Mapping | None, rng=None, ops: Sequence[str] = OPERATORS, *,
                 caps: MorphCaps | None = None) -> MorphResult:
    """One random valid morph among ops; raises CapExceeded if the one drawn breaks a cap."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng if rng is not None else 0)
    index = _Index(graph)
    targets = _targets(graph, index, ops)
    if not targets:
        raise GraphError(f"no node of this graph admits a {' or '.join(ops)} morph")
    return _plan(graph, *_draw(targets, rng), index=index).finish(graph, weights, caps)


def generate_candidates(graph: Graph, weights: Mapping | None, n: int, seed: int, caps: MorphCaps | None = None,
                        ops: Sequence[str] = OPERATORS) -> list[MorphResult]:
    """Up to n distinct children of graph, seeded and reproducible, as aiperf_core.morph's: children over
    a cap or repeating an architecture are skipped, and weights are built for those kept only."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AiperfError(f"n must be a non-negative integer, got {n!r}")
    with gc_paused():
        rng = np.random.default_rng(seed)
        index = _Index(graph)
        targets = _targets(graph, index, ops)
        if not targets:
            return []
        return _distinct_children(graph, weights, n, lambda: _plan(graph, *_draw(targets, rng), index=index),
                                  caps, index)


__all__ = ["OPERATORS", "deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe", "replay", "random_morph",
           "generate_candidates", "mlp_inputs", "growable_attention", "residual_points", "doublable", "TransformerCaps",
           "transformer_size"]
