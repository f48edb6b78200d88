"""The bytes a data-parallel step moves by all-reduce, and an expert-parallel one by all-to-all,
counted from the IR and the replica's layout alone (docs/scoring.md, "Communication").

All-to-all.

Under expert parallelism (aiperf_core.backend.TrainConfig.expert_parallel) every (token, choice)
assignment of a `moe` node travels to its expert's device and its output travels back: forward,
the token's input vector out (width D_in) and the expert's output back (D_out); backward, the
output's gradient out (D_out) and the input's gradient back (D_in). So a training sample moves

    sum over moe nodes of  positions x top_k x (D_in + D_out) x 2 x element bytes

and an evaluated sample half that (forward only). Elements travel at the run's compute precision
(2 bytes under bf16 and fp16, 4 under fp32 and tf32), as the experts compute in it.

The figure is the all-to-all payload, the same on any number of devices: the share that stays on
its own device (1/devices of it, on average, copied rather than sent) is included, as the
collective moves it too; padding a backend adds to fixed-size buffers is not (it is the
backend's cost, not the model's). Recomputation under activation checkpointing is not counted
either, as its operations are not (docs/counting.md).

All-reduce. With a data-parallel degree n > 1 (every device of every node of the replica) each
optimiser step all-reduces the gradient of every trainable parameter once, whatever the number of
micro-batches (they accumulate locally; torch's DDP under no_sync, jax's summed micro-steps). The
gradients travel as the backends keep them: float32, the master weights' type, under every precision
(torch trains float32 parameters under autocast, jax float32 master weights). Under expert
parallelism every expert of a moe node lives on exactly one device (degree = n, aiperf_core.backend
.expert_shard), so its stacks (everything of the node but the router) leave the all-reduce: their
gradients are already whole on their device. With G the bytes all-reduced, a ring (nccl-tests'
bus-bandwidth factor) makes every rank send, and receive, 2(n-1)/n x G per step: n-1 steps of
reduce-scatter and n-1 of all-gather, each a chunk of G/n. Counted per rank and per step rounded down
to a whole byte, times the epoch's optimiser steps.

Where the bytes travel: the ring runs over the ranks in their global order (node-major, aiperf_core
.replica_layout), so on N > 1 nodes of D devices exactly one of each node's D ring links leaves it
(its last device to the next node's first; the last node's wraps to node 0): each node sends one
rank's bytes over its network link and D - 1 ranks' bytes between its own devices. On one node all D
links stay inside it. What the collective moves besides the gradients (the clip's norms, batch norm's
synchronised statistics, DDP's buffer broadcast) is small and not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph

ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
GRADIENT_ELEMENT_BYTES = 4  # float32 gradients of float32 master weights, under every precision


def bytes_per_sample(graph: Graph, precision: str, training: bool = True) -> int:
    """All-to-all bytes one sample's training step (forward and backward) or evaluation moves."""
    if precision not in ELEMENT_BYTES:
        raise AiperfError(f"precision must be one of {', '.join(ELEMENT_BYTES)}, got {precision!r}")
    total = 0
    for node in graph.nodes:
        if node.op != "moe":
            continue
        in_shape, out_shape = graph.shapes[node.inputs[0]], graph.shapes[node.id]
        positions = math.prod(in_shape[:-1])
        total += positions * node.attrs["top_k"] * (in_shape[-1] + out_shape[-1])
    return total * ELEMENT_BYTES[precision] * (2 if training else 1)


def all_to_all_bytes(graph: Graph, precision: str, train_samples: int, val_samples: int = 0) -> int:
    """All-to-all bytes of an epoch that trained on `train_samples` and evaluated `val_samples`."""
    return (train_samples * bytes_per_sample(graph, precision, True)
            + val_samples * bytes_per_sample(graph, precision, False))


def gradient_bytes(graph: Graph, expert_parallel: bool = False) -> int:
    """Bytes of the gradients one data-parallel all-reduce carries: every trainable parameter in float32,
    less the moe nodes' expert stacks under expert parallelism (the router stays data-parallel)."""
    from aiperf_core.ir import is_trainable

    elements = 0
    for node_id, params in graph.all_param_shapes().items():
        moe = graph[node_id].op == "moe"
        for name, shape in params.items():
            if is_trainable(name) and not (expert_parallel and moe and name != "router"):
                elements += math.prod(shape)
    return elements * GRADIENT_ELEMENT_BYTES


@dataclass(frozen=True)
class AllReduceBytes:
    """An epoch's all-reduce traffic (module docstring): `bytes` what each rank sends (and each ring link
    carries); per node, `inter_node_bytes` over its network link and `intra_node_bytes` between its own
    devices."""

    bytes: int
    inter_node_bytes: int
    intra_node_bytes: int


def ring_bytes_per_rank(size: int, ranks: int) -> int:
    """Bytes each rank sends in a ring all-reduce of `size` bytes over `ranks`: 2(n-1)/n x size, rounded down."""
    return 2 * (ranks - 1) * size // ranks


def all_reduce_bytes(graph: Graph, ranks: int, nodes: int, steps: int, expert_parallel: bool = False) -> AllReduceBytes:
    """The all-reduce traffic of an epoch of `steps` optimiser steps on `ranks` devices over `nodes` nodes."""
    for name, value in (("ranks", ranks), ("nodes", nodes), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "steps" else 1):
            raise AiperfError(f"all-reduce: {name} must be a whole number >= {0 if name == 'steps' else 1}, "
                              f"got {value!r}")
    if ranks % nodes:
        raise AiperfError(f"all-reduce: {ranks} ranks do not divide over {nodes} nodes")
    per_rank = steps * ring_bytes_per_rank(gradient_bytes(graph, expert_parallel), ranks)
    per_node = ranks // nodes
    if nodes == 1:
        return AllReduceBytes(per_rank, 0, per_rank * per_node if ranks > 1 else 0)
    return AllReduceBytes(per_rank, per_rank, per_rank * (per_node - 1))


def optimiser_steps(train_samples: int, batch_size: int) -> int:
    """Optimiser steps of an epoch: one per global batch, the last one short (never dropped)."""
    return -(-train_samples // batch_size)
