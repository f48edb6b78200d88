"""Function-preserving morphs of a decoder-only transformer (builders.gpt): deeper, wider_mlp, more_heads,
double_width and upcycle_moe.

The contract is aiperf_core.morph's, whose plan machinery these operators share: the child computes
what its parent computed (exactly in real arithmetic; no transformer op keeps batch statistics, so in
training mode too), its history gains one JSON-plain record {"op", "args", "parent", "delta"}, `args`
hold every choice (random ones as a seed), so `replay` rebuilds the same child from the same parent,
and `delta` is the change in analytic ops per sequence, from the nodes the morph touches only.

* deeper: a new pre-LN block x + proj(attention(LN(x))) then x + fc2(gelu(fc1(LN(x)))) after a node
  of the residual stream. Its attention output projection and its MLP output projection start at
  zero, so the block adds nothing; its other projections start He-normal, as the seed's do, so that
  the first step's gradients on the two zero projections are not zero and the block learns.
* wider_mlp: Net2Net duplication of MLP hidden units: the new units of fc1 copy randomly chosen ones,
  and fc2's rows of each copied unit are split among its copies. The split is random (fractions
  drawn in [0.5, 1.5] and normalised), not even: copies with equal shares would receive equal
  gradients and stay copies forever.
* more_heads: one more attention head of the same width (the width sets the 1/sqrt(d) scaling).
  q, k and v gain its columns, He-normal; every layer reading the attention gains zero rows for it,
  so whatever the new head attends to, it contributes nothing until trained.
* double_width: every feature of the residual stream, of q, k and v (so twice the heads, each as
  wide as before) and of the MLPs duplicated, the width operator of Shen et al., "Staged Training
  for Transformer Language Models" (2022): a duplicated vector has its original's mean and variance,
  so every layer norm computes what it did, on both copies. The embeddings, positions and norms are
  copied; each dense layer reads two copies of each input, and its two shares of each weight
  (random, a + b = 1, for the reason wider_mlp's are) sum to the original, for both copies of each
  output; the LM head keeps its vocabulary-wide output, so the logits do not change. A moe node doubles
  as a dense pair does, expert by expert, and its router as the LM head: the routing does not change.
* upcycle_moe: an MLP becomes a mixture of experts (one `moe` node, aiperf_core.ir) whose experts are
  all copies of it, behind a He-normal router (Komatsuzaki et al., "Sparse Upcycling", 2022). The
  gates of a token's top_k experts are renormalised to sum to 1, so the output is the MLP's whatever
  the routing; the experts part as the router sends them different tokens with different gates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.gcpause import gc_paused
from aiperf_core.ir import Graph, Node
from aiperf_core.morph import (CapExceeded, MorphCaps, MorphResult, _checked_record, _delta, _distinct_children, _dtype,
                               _Index, _insert_after, _node, _params, _Plan, _prefix, _record, _rewired)
from aiperf_core.weights import Weights, he_normal, init_node_weights

OPERATORS = ("deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe")
WIDER_MLP_FACTOR = 0.5  # a drawn wider_mlp adds half the MLP's units
# upcycle_moe's defaults: Switch/GShard-style top-2 routing over a few experts, so that a drawn upcycle
# costs about twice its MLP per token (plus the router), not E times.
MOE_EXPERTS, MOE_TOP_K = 4, 2
BLOCK_SUFFIXES = ("ln1", "q", "k", "v", "attn", "proj", "res1", "ln2", "fc1", "gelu", "fc2", "res2")
_LN_EPSILON = 1e-5  # builders.gpt's
_RESIDUAL = frozenset({"add", "position_embedding"})
# The ops double_width has a rule for: a graph holding another is refused.
_DOUBLING_OPS = frozenset({"token_input", "embedding", "position_embedding", "layer_norm", "dense", "attention",
                           "gelu", "add", "softmax", "moe"})


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


def mlp_inputs(graph: Graph, index: _Index | None = None) -> list[str]:
    """The dense nodes that open an MLP: dense -> gelu -> dense, each read by the next alone."""
    index = index or _Index(graph)
    out = []
    for n in graph.nodes:
        if n.op != "dense" or len(graph.shapes[n.id]) != 2:
            continue
        readers = index.consumers[n.id]
        if len(readers) == 1 and graph[readers[0]].op == "gelu":
            after = index.consumers[readers[0]]
            if len(after) == 1 and graph[after[0]].op == "dense":
                out.append(n.id)
    return out


def _attention_parts(graph: Graph, index: _Index, attention: str) -> tuple[list[str], list[str]]:
    """An attention node's q, k and v projections and the dense layers reading it; a GraphError where
    a new head could not be added without changing another reader."""
    node = _node(graph, attention, "attention", "more_heads: 'attention'")
    projections = list(node.inputs)
    if len(set(projections)) != 3:
        raise GraphError("more_heads: q, k and v must be three separate dense nodes", attention)
    for p in projections:
        if graph[p].op != "dense" or index.consumers[p] != [attention]:
            raise GraphError(f"more_heads: '{p}' must be a dense node read by the attention alone", attention)
    readers = index.consumers[attention]
    if not readers or any(graph[r].op != "dense" for r in readers):
        raise GraphError("more_heads: every reader of the attention must be a dense node", attention)
    return projections, readers


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


def residual_points(graph: Graph) -> list[str]:
    """The nodes deeper may insert a block after: the residual stream's sums and the positions."""
    return [n.id for n in graph.nodes if n.op in _RESIDUAL and len(graph.shapes[n.id]) == 2]


# ---------------------------------------------------------------------------
# deeper
# ---------------------------------------------------------------------------


def _plan_deeper(graph: Graph, after: str, seed: int = 0, prefix: str | None = None,
                 index: _Index | None = None) -> _Plan:
    node = _node(graph, after, None, "deeper: 'after'")
    if node.op not in _RESIDUAL:
        raise GraphError(f"deeper: 'after' must be an add or position_embedding node of the residual stream, "
                         f"this is a {node.op}", after)
    _, width = _sequence(graph, after, "deeper")
    seed = _seed(seed, "deeper", after)
    index = index or _Index(graph)
    attention = _nearest(graph, index, after, [n.id for n in graph.nodes if n.op == "attention"])
    if attention is None:
        raise GraphError("deeper: the graph has no attention node to take the new block's heads from", after)
    heads, head_dim = graph[attention].attrs["heads"], graph[attention].attrs["head_dim"]
    mlp = _nearest(graph, index, after, mlp_inputs(graph, index))
    ffn = graph[mlp].attrs["units"] if mlp is not None else 4 * width
    p = _prefix(graph, BLOCK_SUFFIXES, prefix, after)
    ids = {s: f"{p}_{s}" for s in BLOCK_SUFFIXES}
    dense = {"use_bias": True}
    new = [
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
    nodes = _insert_after(_rewired(graph, after, ids["res2"], set(ids.values())), after, new)
    args = {"after": after, "seed": seed, "prefix": p}
    child = graph.replace(nodes, None)
    parametric = [ids[s] for s in ("ln1", "q", "k", "v", "proj", "ln2", "fc1", "fc2")]
    record = _record("deeper", args, index, _delta(graph, child, ids.values(), parametric))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        dtype = _dtype(weights)
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for nid in parametric:
            out[nid] = init_node_weights(child, nid, rng, dtype)
        for nid in (ids["proj"], ids["fc2"]):  # the block's two outputs: zero, so it adds nothing yet
            out[nid] = {k: np.zeros_like(v) for k, v in out[nid].items()}
        return out

    return _Plan(child, record, make_weights)


def deeper(graph: Graph, weights: Mapping | None, after: str, seed: int = 0, *, prefix: str | None = None,
           caps: MorphCaps | None = None) -> MorphResult:
    """Insert a pre-LN block after the residual-stream node `after`, with the heads, head width and MLP
    width of the nearest block (the next one, else the previous)."""
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
    node = _node(graph, fc1, "dense", "wider_mlp: 'fc1'")
    index = index or _Index(graph)
    if fc1 not in mlp_inputs(graph, index):
        raise GraphError("wider_mlp: 'fc1' must open an MLP (dense -> gelu -> dense, each read by the next alone)",
                         fc1)
    width = node.attrs["units"]
    units = max(1, round(width * WIDER_MLP_FACTOR)) if units is None else units
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise GraphError(f"wider_mlp: units must be a positive integer, got {units!r}", fc1)
    seed = _seed(seed, "wider_mlp", fc1)
    gelu = index.consumers[fc1][0]
    fc2 = index.consumers[gelu][0]
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, "units": width + units}) if n.id == fc1 else n
             for n in graph.nodes]
    args = {"fc1": fc1, "units": units, "seed": seed}
    child = graph.replace(nodes, None)
    record = _record("wider_mlp", args, index, _delta(graph, child, (fc1, gelu, fc2)))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        sources, shares = _split(seed, width, units)
        out = dict(weights)
        first = _params(graph, weights, fc1)
        out[fc1] = {k: np.take(v, sources, axis=-1) for k, v in first.items()}
        second = _params(graph, weights, fc2)
        kernel = np.asarray(second["kernel"])
        out[fc2] = {**second, "kernel": (np.take(kernel, sources, axis=0) * shares[:, None]).astype(kernel.dtype)}
        return out

    return _Plan(child, record, make_weights)


def wider_mlp(graph: Graph, weights: Mapping | None, fc1: str, units: int | None = None, seed: int = 0, *,
              caps: MorphCaps | None = None) -> MorphResult:
    """Add `units` hidden units (default half as many again) to the MLP that `fc1` opens, Net2Net-style."""
    return _plan_wider_mlp(graph, fc1, units, seed).finish(graph, weights, caps)


# ---------------------------------------------------------------------------
# more_heads
# ---------------------------------------------------------------------------


def _plan_more_heads(graph: Graph, attention: str, seed: int = 0, index: _Index | None = None) -> _Plan:
    index = index or _Index(graph)
    projections, readers = _attention_parts(graph, index, attention)
    seed = _seed(seed, "more_heads", attention)
    attrs = graph[attention].attrs
    heads, head_dim = attrs["heads"], attrs["head_dim"]
    width = (heads + 1) * head_dim
    changed = {p: {"units": width} for p in projections}
    changed[attention] = {"heads": heads + 1}
    nodes = [Node(n.id, n.op, n.inputs, {**n.attrs, **changed[n.id]}) if n.id in changed else n for n in graph.nodes]
    args = {"attention": attention, "seed": seed}
    child = graph.replace(nodes, None)
    record = _record("more_heads", args, index, _delta(graph, child, (*projections, attention, *readers)))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for p in projections:  # the new head's columns, drawn as the seed's projections are
            params = _params(graph, weights, p)
            fresh = init_node_weights(child, p, rng, np.asarray(params["kernel"]).dtype)
            out[p] = {k: np.concatenate([v, fresh[k][..., heads * head_dim:]], axis=-1) for k, v in params.items()}
        for r in readers:  # zero rows: the new head contributes nothing yet
            params = _params(graph, weights, r)
            kernel = np.asarray(params["kernel"])
            out[r] = {**params, "kernel": np.concatenate([kernel, np.zeros((head_dim, kernel.shape[1]), kernel.dtype)])}
        return out

    return _Plan(child, record, make_weights)


def more_heads(graph: Graph, weights: Mapping | None, attention: str, seed: int = 0, *,
               caps: MorphCaps | None = None) -> MorphResult:
    """Add one head of the same width to `attention`."""
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
    doubled = {"embedding": "units", "dense": "units", "attention": "heads", "moe": "units"}

    def grown(n: Node) -> Node:
        key = doubled.get(n.op)
        return n if key is None or n.id == head else Node(n.id, n.op, n.inputs, {**n.attrs, key: 2 * n.attrs[key]})

    nodes = [grown(n) for n in graph.nodes]
    args = {"seed": seed}
    child = graph.replace(nodes, None)
    record = _record("double_width", args, index, _delta(graph, child, [n.id for n in graph.nodes]))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        rng = np.random.default_rng(seed)
        out = dict(weights)
        for n in graph.nodes:
            if n.op in ("embedding", "position_embedding", "layer_norm"):
                out[n.id] = {k: np.concatenate([v, v], axis=-1) for k, v in _params(graph, weights, n.id).items()}
            elif n.op == "dense":
                params = _params(graph, weights, n.id)
                out[n.id] = {"kernel": _doubled_kernel(params["kernel"], rng, outputs=n.id != head)}
                if "bias" in params:
                    bias = np.asarray(params["bias"])
                    out[n.id]["bias"] = bias if n.id == head else np.concatenate([bias, bias])
            elif n.op == "moe":  # the router's logits stay (so does the routing); each expert as a dense pair
                params = _params(graph, weights, n.id)
                out[n.id] = {"router": _doubled_kernel(params["router"], rng, outputs=False),
                             **{k: np.stack([_doubled_kernel(w, rng, outputs=True) for w in params[k]])
                                for k in ("w_in", "w_out")},
                             **{k: np.concatenate([params[k], params[k]], axis=-1) for k in ("b_in", "b_out")}}
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


def _plan_upcycle_moe(graph: Graph, fc1: str, experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K, seed: int = 0,
                      prefix: str | None = None, index: _Index | None = None) -> _Plan:
    node = _node(graph, fc1, "dense", "upcycle_moe: 'fc1'")
    index = index or _Index(graph)
    if fc1 not in mlp_inputs(graph, index):
        raise GraphError("upcycle_moe: 'fc1' must open an MLP (dense -> gelu -> dense, each read by the next "
                         "alone)", fc1)
    gelu = index.consumers[fc1][0]
    fc2 = index.consumers[gelu][0]
    if not node.attrs["use_bias"] or not graph[fc2].attrs["use_bias"]:
        raise GraphError("upcycle_moe: the MLP's two layers must have biases, as an expert's do", fc1)
    width = graph.shapes[node.inputs[0]][-1]
    if graph[fc2].attrs["units"] != width or len(graph.shapes[fc2]) != 2:
        raise GraphError("upcycle_moe: the MLP must map a sequence (S, D) back to (S, D)", fc2)
    for name, value, low in (("experts", experts, 2), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise GraphError(f"upcycle_moe: {name} must be an integer >= {low}, got {value!r}", fc1)
    if top_k > experts:
        raise GraphError(f"upcycle_moe: top_k ({top_k}) must not exceed experts ({experts})", fc1)
    seed = _seed(seed, "upcycle_moe", fc1)
    p = _prefix(graph, ("moe",), prefix, fc1)
    moe = f"{p}_moe"
    attrs = {"experts": experts, "top_k": top_k, "units": node.attrs["units"]}
    replaced = {fc1, gelu, fc2}
    nodes = []
    for n in _rewired(graph, fc2, moe, replaced):
        if n.id == fc1:
            nodes.append(Node(moe, "moe", node.inputs, attrs))
        elif n.id not in replaced:
            nodes.append(n)
    args = {"fc1": fc1, "experts": experts, "top_k": top_k, "seed": seed, "prefix": p}
    child = graph.replace(nodes, None)
    record = _record("upcycle_moe", args, index, _delta(graph, child, (moe, fc1, gelu, fc2)))
    child = graph.replace(nodes, record)

    def make_weights(weights: Mapping) -> Weights:
        first, second = _params(graph, weights, fc1), _params(graph, weights, fc2)
        dtype = np.asarray(first["kernel"]).dtype
        out = {k: v for k, v in weights.items() if k not in replaced}

        def stack(array) -> np.ndarray:
            return np.repeat(np.asarray(array)[None], experts, axis=0)

        router = he_normal((width, experts), width, np.random.default_rng(seed), dtype)  # as init_weights draws it
        out[moe] = {"router": router, "w_in": stack(first["kernel"]), "b_in": stack(first["bias"]),
                    "w_out": stack(second["kernel"]), "b_out": stack(second["bias"])}
        return out

    return _Plan(child, record, make_weights)


def upcycle_moe(graph: Graph, weights: Mapping | None, fc1: str, experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K,
                seed: int = 0, *, prefix: str | None = None, caps: MorphCaps | None = None) -> MorphResult:
    """Turn the MLP that `fc1` opens into a mixture of `experts` copies of it, `top_k` of them per token."""
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
    found = {"deeper": residual_points(graph) if any(n.op == "attention" for n in graph.nodes) else [],
             "wider_mlp": mlp_inputs(graph, index), "more_heads": growable_attention(graph, index),
             "double_width": [None] if doublable(graph) else [], "upcycle_moe": mlp_inputs(graph, index)}
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
