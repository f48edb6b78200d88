"""Expert parallelism (TrainConfig.expert_parallel): a moe node's experts sharded over the mesh's devices,
tokens sent to their experts' devices by all-to-all, and the time of those exchanges measured.

Layout. On a placement of d devices (distributed.Placement, the 1-D mesh of axis 'batch'), each moe
node's expert stacks (w_in, b_in, w_out, b_out, w_gate: leading axis E) are laid out with
NamedSharding(mesh, P('batch')) on their E axis, so device r holds experts [r E/d, (r + 1) E/d)
(aiperf_core.backend.expert_shard), and so is their optimizer state (`param_shardings`); the router
and every other parameter stay replicated and data-parallel. Exported weights are the whole model:
np.asarray of a sharded jax array gathers it to the host.

The moe node (`routed_experts`) runs under jax.shard_map over the mesh, in one of three ways that
the training and evaluation steps choose per batch shape, when they trace (`ExpertParallel`):

* SHARDED (the batch's rows split over the devices): each device routes its own T tokens (router,
  top_k and gates as lowering.routed_experts), places each of its T k (token, choice) assignments in
  a send buffer (d, C, D) at row [its expert's device, its rank among the assignments to that
  device], C = T min(k, E/d) (a token's k distinct experts put at most min(k, E/d) of its assignments
  on one device, so no routing can exceed C and no token is ever dropped); the rows nobody filled are
  zeros. jax.lax.all_to_all sends block j to device j (with each row's local expert index, an int32
  (d, C) exchange); the device runs its experts on the d C rows it received (`local_experts`: the
  single-device moe's tile levels and custom VJP, sized for every row to be filled, each tile under a
  lax.cond that skips it when the routing left it empty), all_to_all sends
  the outputs back, and each token sums its k outputs weighted by its gates. Autodiff transposes
  each all_to_all into the reverse all_to_all: 2 exchanges forward and 2 backward per moe node.
* REPLICATED (a batch whose rows do not divide by the devices, the short last one, held whole by
  every device): each device routes every token, runs its own experts on the assignments that chose
  them and the devices' gated sums are added (psum). No all-to-all runs.
* MANUAL (inside the micro-batch step's shard_map, already manual over the axis): the SHARDED body,
  called directly on the device's micro-batch rows.

Gradients are the single-device gradient of the global batch's mean loss: an expert's weight
gradient is summed on its own device over every device's tokens (the reverse all-to-all brings them
there), the router's is all-reduced as every replicated parameter's is, and the clip reads the norm
over the sharded gradients as over the rest (XLA's SPMD partitioner adds the shards' squares).

ragged_all_to_all (exchanging only the filled rows) is not used: XLA:CPU does not implement it
("HLO opcode `ragged-all-to-all` is not supported"), and a GPU-only path could not be certified on the
CPU; every device therefore sends d C rows, of which T k are filled in all.

Timing (`AllToAllTimer`): XLA compiles the exchanges into the step, between the products, so they
cannot be timed inside it. They are measured apart from the step instead: a jitted shard_map of the
same jax.lax.all_to_all, on a buffer of the step's own shape and dtype over the step's own mesh
(compiled once per shape), run a few times at the end of every epoch (the median), times the number of
such exchanges the epoch ran
(`exchanges`; a block recomputed under TrainConfig.checkpoint_blocks runs its forward exchanges twice).
EpochReport.all_to_all_seconds is that estimate, not a measurement of the steps themselves.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiperf_backends.jax.distributed import AXIS

EXPERT_PARAMS = frozenset({"w_in", "b_in", "w_out", "b_out", "w_gate"})  # a moe node's stacks, leading axis E
SHARDED, REPLICATED, MANUAL = "sharded", "replicated", "manual"
TIMING_REPEATS = 5


@dataclass(frozen=True)
class ExpertParallel:
    """How a step's moe nodes run under expert parallelism: over `mesh`, on tokens that are SHARDED
    (the batch's rows split over the devices), REPLICATED (every device holds the whole batch), or
    MANUAL (the caller is already inside a shard_map over the axis, on its own rows)."""

    mesh: Any
    tokens: str

    @property
    def world(self) -> int:
        return int(self.mesh.shape[AXIS])


def for_rows(mesh, rows: int) -> ExpertParallel:
    """The layout of a batch of `rows` on `mesh` (distributed.Placement.batch_sharding's rule)."""
    world = int(mesh.shape[AXIS])
    return ExpertParallel(mesh, SHARDED if rows % world == 0 else REPLICATED)


def is_expert_param(graph, node_id: str, name: str) -> bool:
    return graph[node_id].op == "moe" and name in EXPERT_PARAMS


def param_specs(graph, params) -> dict:
    """{node id: {name: PartitionSpec}}: P('batch') on the E axis of the expert stacks, P() elsewhere."""
    from jax.sharding import PartitionSpec as P

    return {node_id: {name: P(AXIS) if is_expert_param(graph, node_id, name) else P() for name in leaves}
            for node_id, leaves in params.items()}


def param_shardings(graph, params, mesh) -> dict:
    """The NamedShardings of `param_specs` on `mesh`: where the parameters and their optimizer state live."""
    from jax.sharding import NamedSharding

    return {node_id: {name: NamedSharding(mesh, spec) for name, spec in leaves.items()}
            for node_id, leaves in param_specs(graph, params).items()}


def local_experts(rows, expert_of, weights, attrs, precision: str):
    """The outputs (R, D_out) of R rows (R, D), row i through local expert expert_of[i] (in [0, E_l)),
    or zeros where expert_of[i] == E_l (no expert: a padding row). `weights`: the local expert stacks
    (leading axis E_l) in the compute dtype.

    The valid rows are laid out and run as lowering.routed_experts runs a device's assignments
    (lowering.tiled_experts: tiles in levels of decreasing rows, their custom VJP), the levels sized for
    all R of them to be valid (every row of every device's buffer routed here), and a lax.cond per tile
    computes only the tiles the routing reached, forward and backward: the products are the rows that
    arrived plus the layout's padding bound (docs/backends/jax.md, "Expert parallelism")."""
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import moe_tile_levels, moe_tile_rows, tiled_experts
    from aiperf_core.ir import moe_mlp

    count = rows.shape[0]
    local = next(iter(weights.values())).shape[0]
    levels = moe_tile_levels(count, local, moe_tile_rows(count, local))
    out, slot = tiled_experts(rows, jnp.arange(count), expert_of, weights, levels, moe_mlp(attrs) == "swiglu",
                              precision, skip_unused=True)
    valid = slot < out.shape[0]
    return jnp.where(valid[:, None], out[jnp.minimum(slot, out.shape[0] - 1)], jnp.zeros((), out.dtype))


def route(x, router, attrs, precision: str):
    """(logits (T, E) float32, chosen (T, top_k), gates (T, top_k)) of tokens x (T, D), as
    lowering.routed_experts routes them."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from aiperf_backends.jax.lowering import dense

    logits = dense(x, router, precision).astype(jnp.float32)
    picked, chosen = lax.top_k(logits, attrs["top_k"])
    return logits, chosen, jax.nn.softmax(picked, axis=-1)


def capacity(tokens: int, attrs, world: int) -> int:
    """C, the rows a device sends to each device: its tokens times min(top_k, E / devices), which no
    routing can exceed (a token's top_k experts are distinct)."""
    return tokens * min(attrs["top_k"], attrs["experts"] // world)


def exchanged_experts(x, params, attrs, precision: str, world: int):
    """(output (T, D_out), logits, chosen) of one device's tokens x (T, D) inside a shard_map over the
    axis, its experts `params` holding the local E / world of each stack (the SHARDED body)."""
    import jax.numpy as jnp
    from jax import lax

    from aiperf_backends.jax.lowering import compute_dtype, expert_weights

    dtype = compute_dtype(precision) or x.dtype
    tokens, width = x.shape
    top_k, local = attrs["top_k"], attrs["experts"] // world
    logits, chosen, gates = route(x, params["router"], attrs, precision)
    per_device = capacity(tokens, attrs, world)
    expert_of = chosen.reshape(-1)
    device_of = expert_of // local
    one_hot = (device_of[:, None] == jnp.arange(world)[None, :]).astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(one_hot, axis=0) - one_hot) * one_hot, axis=1)  # earlier assignments, same device
    slot = device_of * per_device + rank  # each assignment's row in the send buffer (world * C rows)
    token_of_slot = jnp.full(world * per_device, tokens, jnp.int32).at[slot].set(
        jnp.arange(tokens * top_k, dtype=jnp.int32) // top_k)
    expert_of_slot = jnp.full(world * per_device, local, jnp.int32).at[slot].set(expert_of % local)
    padded = jnp.concatenate([x.astype(dtype), jnp.zeros((1, width), dtype)])  # row T: zeros, the empty rows
    send = padded[token_of_slot].reshape(world, per_device, width)
    received = lax.all_to_all(send, AXIS, 0, 0)
    received_expert = lax.all_to_all(expert_of_slot.reshape(world, per_device), AXIS, 0, 0)
    out = local_experts(received.reshape(world * per_device, width), received_expert.reshape(-1),
                        expert_weights(params, dtype), attrs, precision)
    back = lax.all_to_all(out.reshape(world, per_device, -1), AXIS, 0, 0).reshape(world * per_device, -1)
    picked = back[slot].reshape(tokens, top_k, -1)
    return jnp.sum(picked * gates.astype(picked.dtype)[..., None], axis=1), logits, chosen


def replicated_experts(x, params, attrs, precision: str, world: int):
    """(output (T, D_out), logits, chosen) of every token x (T, D), held whole by each device, inside a
    shard_map: each device runs its own experts on the assignments that chose them, and the gated
    sums are added over the devices (psum). The REPLICATED body."""
    import jax.numpy as jnp
    from jax import lax

    from aiperf_backends.jax.lowering import compute_dtype, expert_weights

    dtype = compute_dtype(precision) or x.dtype
    tokens = x.shape[0]
    top_k, local = attrs["top_k"], attrs["experts"] // world
    logits, chosen, gates = route(x, params["router"], attrs, precision)
    own = chosen.reshape(-1) - lax.axis_index(AXIS) * local
    mine = (own >= 0) & (own < local)
    out = local_experts(x.astype(dtype)[jnp.arange(tokens * top_k) // top_k], jnp.where(mine, own, local),
                        expert_weights(params, dtype), attrs, precision)
    picked = out.reshape(tokens, top_k, -1)
    return lax.psum(jnp.sum(picked * gates.astype(picked.dtype)[..., None], axis=1), AXIS), logits, chosen


def routed_experts(x, params, attrs, precision: str, parallel: ExpertParallel):
    """lowering.routed_experts under expert parallelism: (output, router logits (T, E) float32, chosen
    (T, top_k)) of the moe on x (N, S, D), T = N S, its expert stacks sharded over `parallel.mesh`."""
    import jax
    from jax.sharding import PartitionSpec as P

    shape, world = x.shape, parallel.world
    if parallel.tokens == MANUAL:
        y, logits, chosen = exchanged_experts(x.reshape(-1, shape[-1]), params, attrs, precision, world)
        return y.reshape(shape[:-1] + (y.shape[-1],)), logits, chosen
    body = exchanged_experts if parallel.tokens == SHARDED else replicated_experts

    def run(x, params):
        y, logits, chosen = body(x.reshape(-1, x.shape[-1]), params, attrs, precision, world)
        return y.reshape(x.shape[:-1] + (y.shape[-1],)), logits, chosen

    tokens = P(AXIS) if parallel.tokens == SHARDED else P()
    specs = {name: P(AXIS) if name in EXPERT_PARAMS else P() for name in params}
    return jax.shard_map(run, mesh=parallel.mesh, in_specs=(tokens, specs),
                         out_specs=(tokens, tokens, tokens))(x, params)


# -- the exchanges an epoch ran, and their time ---------------------------------------------------


def exchange_dtype(precision: str):
    """The dtype of the exchanged rows: the experts' compute dtype."""
    from aiperf_backends.jax.lowering import compute_dtype

    return np.dtype(compute_dtype(precision) or np.float32)


def recomputed_moe(graph, checkpoint_blocks: bool) -> frozenset:
    """The moe nodes a checkpointed training pass runs twice forward (TrainConfig.checkpoint_blocks:
    their block is recomputed in the backward pass, exchanges included; lowering.checkpointed_blocks)."""
    if not checkpoint_blocks:
        return frozenset()
    from aiperf_backends.jax.lowering import checkpointed_blocks

    output = graph[graph.output_id]
    stop = output.inputs[0] if output.op == "softmax" else graph.output_id  # where a training pass ends
    return frozenset(node_id for block, _ in checkpointed_blocks(graph, stop).values() for node_id in block.nodes
                     if graph[node_id].op == "moe")


def exchanges(graph, rows: int, world: int, precision: str, training: bool,
              checkpoint_blocks: bool = False) -> list[tuple[tuple, Any]]:
    """The all-to-alls one SHARDED (or MANUAL) pass of `rows` sequences a device runs: (local buffer
    shape, dtype) per exchange, per moe node. Forward: the rows out (d, C, D_in), their local expert
    index (d, C) int32, the outputs back (d, C, D_out); a training pass adds the two reverse exchanges
    of the gradients, (d, C, D_out) and (d, C, D_in), and, with checkpointed blocks, the forward ones
    again for a moe its block recomputes."""
    dtype = exchange_dtype(precision)
    recomputed = recomputed_moe(graph, checkpoint_blocks) if training else frozenset()
    found = []
    for node in graph.nodes:
        if node.op != "moe":
            continue
        in_shape, out_width = graph.shapes[node.inputs[0]], graph.shapes[node.id][-1]
        tokens = rows * int(np.prod(in_shape[:-1], dtype=np.int64))
        per_device = capacity(tokens, node.attrs, world)
        out_rows, back_rows = (world, per_device, in_shape[-1]), (world, per_device, out_width)
        forward = [(out_rows, dtype), ((world, per_device), np.dtype(np.int32)), (back_rows, dtype)]
        found += forward * (2 if node.id in recomputed else 1)
        if training:
            found += [(back_rows, dtype), (out_rows, dtype)]
    return found


# (device names, local shape, dtype) -> (the jitted exchange, compiled, and a buffer on the mesh)
_EXCHANGES: dict = {}


class AllToAllTimer:
    """The epoch's all-to-all exchanges, counted as the steps run (`add`), and their time: each buffer
    shape's exchange timed on the mesh at the end of every epoch (`lap`), apart from the steps, times its
    count. The exchange is compiled once per shape; its timing is taken afresh each epoch, so the figure
    follows the machine (other jobs, clocks) as the epochs go."""

    def __init__(self, mesh, names: tuple[str, ...]):
        self.mesh, self.names = mesh, tuple(names)
        self.counts: dict = {}
        self.priced_in = 0.0  # wall seconds of the last lap's timed exchanges, compilation excluded

    def add(self, found: list[tuple[tuple, Any]]) -> None:
        for shape, dtype in found:
            key = (tuple(shape), np.dtype(dtype).name)
            self.counts[key] = self.counts.get(key, 0) + 1

    def lap(self) -> float | None:
        """The seconds of the exchanges counted since the last lap (None when none ran), each shape's
        exchange timed now: call it between epochs, while no step runs."""
        counts, self.counts, self.priced_in = self.counts, {}, 0.0
        if not counts:
            return None
        return float(sum(count * self.seconds(shape, dtype) for (shape, dtype), count in counts.items()))

    def seconds(self, shape: tuple, dtype: str) -> float:
        key = (self.names, shape, dtype)
        if key not in _EXCHANGES:
            _EXCHANGES[key] = compiled_all_to_all(self.mesh, shape, dtype)
        started = time.perf_counter()
        seconds = time_all_to_all(*_EXCHANGES[key])
        self.priced_in += time.perf_counter() - started
        return seconds


def compiled_all_to_all(mesh, shape: tuple, dtype: str):
    """(a jitted jax.lax.all_to_all of a (d, ...) buffer per device over `mesh`, as the step runs it: split
    and concatenated on axis 0; a buffer for it on the mesh), compiled by one call."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    world = int(mesh.shape[AXIS])
    exchange = jax.jit(jax.shard_map(lambda b: lax.all_to_all(b, AXIS, 0, 0), mesh=mesh,
                                     in_specs=P(AXIS), out_specs=P(AXIS)))
    buffer = jax.device_put(jnp.ones((world * shape[0],) + tuple(shape[1:]), dtype), NamedSharding(mesh, P(AXIS)))
    exchange(buffer).block_until_ready()  # compiles
    return exchange, buffer


def time_all_to_all(exchange, buffer, repeats: int = TIMING_REPEATS) -> float:
    """Median wall seconds of one call of a compiled exchange."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        exchange(buffer).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
