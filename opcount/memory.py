"""What one training step of a graph asks of a device's memory, estimated from the IR alone.

A step holds, per device:
- parameters: every parameter in float32 (the master weights), plus under bf16 or fp16 a copy of
  the trainable ones at the compute precision (what an autocast caches for the forward pass);
- gradients: float32, one per trainable parameter;
- optimizer state: AdamW's two moments (8 bytes a parameter), SGD's momentum (4);
- the update's temporaries: torch's multi-tensor (foreach) AdamW, a CPU's, allocates one float32
  copy of the parameters while it runs (the second moment's square root); SGD's momentum updates in
  place. A fused update (CUDA's AdamW) allocates none, so there the estimate errs high by it;
- activations, for the micro-batch the device takes at once: every tensor a backward pass reads,
  which is a node's output wherever some reader's gradient needs it. Every op's backward reads its
  input except `add` and `position_embedding` (sums: their gradient passes through); so an output
  read only by sums is not kept. The graph's output (the logits and their softmax) is kept too,
  in float32 as the loss computes it. Fused attention (flash attention, SDPA, cuDNN) keeps q, k, v,
  its output and a log-sum-exp per row, not the S x S probabilities; `attention_scores` adds them,
  for a backend that writes attention out;
- with activation checkpointing (Graph.blocks), only each block's input, the activations outside
  blocks, and one block's activations at a time while its backward runs (the largest block's);
- in flight during the backward pass: the gradient arriving at the widest node and the one leaving
  it, two of its outputs.

Not all of it at once. A step has two phases, and its peak is the larger (`MemoryEstimate.total`):
- the passes (forward and backward): parameters, optimizer state and activations. A step of one
  micro-batch has no gradients while its activations are alive: the previous step's are freed (set
  to None) before its forward pass, and its backward pass makes them as it frees the activations. A
  step that accumulates over several micro-batches holds the earlier ones' gradients through the
  later passes;
- the update: parameters, gradients, optimizer state and the update's temporaries, the activations
  gone.
Against torch's allocator on a CPU (docs/performance.md, "The memory estimate against measurement":
the official seed's step, the same checkpointed, and a grown child) this reads 0.985, 1.000 and
1.000 of the measured peak, where the sum of every term without the temporaries read 1.153, 0.870
and 0.986.

Under expert parallelism over `expert_devices` devices (aiperf_core.backend.TrainConfig.expert_parallel)
a device holds 1 / expert_devices of every `moe` node's expert stacks (all but its router), with their
gradients, copies and optimizer state. Its experts' activations are counted as those of its own
micro-batch's assignments: the share a balanced router sends it (the load-balancing loss keeps the
router near that; a device that receives more holds more).

Matrix products, attention, GELU and experts compute at the run's precision (2 bytes an element
under bf16 or fp16); norms, the residual stream's sums, the softmax and the loss stay float32 (4), as
every backend's mixed precision keeps them. The estimate leaves out what no graph decides: the
framework's own context, allocator fragmentation, a data-parallel runtime's buffers. MEMORY_HEADROOM
keeps room for them when the estimate decides what fits (plan_memory).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, is_trainable

OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd-momentum": 4}  # per trainable parameter
UPDATE_TEMPORARY_BYTES = {"adamw": 4, "sgd-momentum": 0}  # per trainable parameter (module docstring)
MIXED = ("bf16", "fp16")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
# Ops whose backward pass needs none of its inputs (the gradient of a sum passes through; rotary's is
# the inverse rotation of the gradient).
_PASS_THROUGH = frozenset({"add", "position_embedding", "token_input", "input", "rotary"})
# Ops that compute at the run's precision; the others (norms, sums, softmax) stay float32.
_COMPUTE_OPS = frozenset({"dense", "attention", "gelu", "moe", "conv2d", "relu", "embedding", "rotary", "silu",
                          "mul"})
# The share of a device's memory the estimate may fill: the rest is for the framework's context,
# its workspaces and fragmentation (measured against the estimate: docs/performance.md, "Memory").
MEMORY_HEADROOM = 0.85


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds for a training step of `batch` samples at once, by term, and at the
    peak of each of its two phases (the module's docstring)."""

    batch: int
    precision: str
    optimizer: str
    checkpoint_blocks: bool
    accumulating: bool  # the step sums the gradients of several micro-batches of `batch` samples
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    update_temporaries: int

    @property
    def passes(self) -> int:
        """At the peak of the forward and backward passes."""
        held = self.gradients if self.accumulating else 0
        return self.parameters + self.optimizer_state + self.activations + held

    @property
    def update(self) -> int:
        """At the peak of the optimizer's update."""
        return self.parameters + self.gradients + self.optimizer_state + self.update_temporaries

    @property
    def total(self) -> int:
        """The step's peak: the larger of its two phases."""
        return max(self.passes, self.update)

    def to_dict(self) -> dict:
        return {**asdict(self), "passes": self.passes, "update": self.update, "total": self.total}


def _element_bytes(op: str, precision: str) -> int:
    return 2 if precision in MIXED and op in _COMPUTE_OPS else 4


def _kept_outputs(graph: Graph) -> dict[str, int]:
    """Bytes per sample at fp32 of each node output a backward pass reads (see the module's
    docstring), by node id; scaled to the precision by activation_bytes."""
    readers: dict[str, list[str]] = {n.id: [] for n in graph.nodes}
    for node in graph.nodes:
        for source in node.inputs:
            readers[source].append(node.op)
    kept = {}
    for node in graph.nodes:
        if node.id == graph.output_id or any(op not in _PASS_THROUGH for op in readers[node.id]):
            kept[node.id] = math.prod(graph.shapes[node.id])
    return kept


def _node_bytes(graph: Graph, node_id: str, elements: int, precision: str, attention_scores: bool) -> int:
    node = graph[node_id]
    size = elements * _element_bytes(node.op, precision)
    if node.op == "attention":
        seq = graph.shapes[node_id][0]
        rows = node.attrs["heads"] * seq
        size += rows * 4  # the log-sum-exp of each row
        if attention_scores:
            size += rows * seq * _element_bytes("attention", precision)
    if node_id == graph.output_id:
        size += elements * 4  # the loss's float32 softmax (or its log) beside the logits
    return size


def activation_bytes(graph: Graph, batch: int, precision: str = "fp32", checkpoint_blocks: bool = False,
                     attention_scores: bool = False) -> int:
    """Activations a training step of `batch` samples holds at its peak (the module's docstring)."""
    kept = {nid: _node_bytes(graph, nid, e, precision, attention_scores) for nid, e in _kept_outputs(graph).items()}
    widest = max(math.prod(graph.shapes[n.id]) * 4 for n in graph.nodes)
    in_flight = 2 * widest
    blocks = graph.blocks() if checkpoint_blocks else []
    if not blocks:
        return batch * (sum(kept.values()) + in_flight)
    inside = {nid for block in blocks for nid in block.nodes}
    # A block's input stays (it is the previous block's output, or the embeddings'): counted once.
    boundaries = {block.input for block in blocks} | {blocks[-1].output}
    outside = sum(size for nid, size in kept.items() if nid not in inside or nid in boundaries)
    recomputed = max(sum(kept.get(nid, 0) for nid in block.nodes if nid not in boundaries) for block in blocks)
    return batch * (outside + recomputed + in_flight)


def _expert_stack(graph: Graph, node_id: str, name: str) -> bool:
    return graph[node_id].op == "moe" and name != "router"


def estimate(graph: Graph, batch: int, precision: str = "fp32", optimizer: str = "adamw",
             checkpoint_blocks: bool = False, attention_scores: bool = False,
             expert_devices: int = 1, accumulating: bool = False) -> MemoryEstimate:
    """The memory of one device's training step on `batch` samples at once (a micro-batch), its
    experts sharded over `expert_devices` devices (1: every expert on every device), `accumulating`
    where the step sums the gradients of several such micro-batches."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise AiperfError(f"batch must be a positive integer, got {batch!r}")
    if precision not in PRECISIONS:
        raise AiperfError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise AiperfError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    if isinstance(expert_devices, bool) or not isinstance(expert_devices, int) or expert_devices < 1:
        raise AiperfError(f"expert_devices must be a positive integer, got {expert_devices!r}")
    trainable = frozen = 0
    for node_id, params in graph.all_param_shapes().items():
        for name, shape in params.items():
            size = math.prod(shape)
            if _expert_stack(graph, node_id, name):
                size //= expert_devices  # the experts divide by the devices (backend.check_expert_parallel)
            if is_trainable(name):
                trainable += size
            else:
                frozen += size
    copies = 2 * trainable if precision in MIXED else 0
    return MemoryEstimate(batch, precision, optimizer, bool(checkpoint_blocks and graph.blocks()), bool(accumulating),
                          4 * (trainable + frozen) + copies, 4 * trainable,
                          OPTIMIZER_STATE_BYTES[optimizer] * trainable,
                          activation_bytes(graph, batch, precision, checkpoint_blocks, attention_scores),
                          UPDATE_TEMPORARY_BYTES[optimizer] * trainable)


def smallest_step(graph: Graph, shard: int, precision: str = "fp32", optimizer: str = "adamw",
                  micro_batch: int | str = "auto", checkpointing: str = "auto", attention_scores: bool = False,
                  expert_devices: int = 1) -> MemoryEstimate:
    """The estimate of the step that needs least among those the policy items micro_batch and
    activation_checkpointing (plan_memory) allow a device on its `shard` of each global batch: with
    checkpointing unless it is never; under micro_batch auto, one sample at a time (accumulating) or the
    shard whole, whichever needs less (a step's gradients can outweigh its activations), else the
    micro-batch it sets."""
    if checkpointing not in ("auto", "always", "never"):
        raise AiperfError(f"activation_checkpointing must be auto, always or never, got {checkpointing!r}")
    sizes = (1, shard) if micro_batch == "auto" else (min(int(micro_batch), shard),)
    return min((estimate(graph, size, precision, optimizer, checkpointing != "never", attention_scores, expert_devices,
                         size < shard) for size in sizes), key=lambda found: found.total)


@dataclass(frozen=True)
class MemoryPlan:
    """How a device trains its shard of each global batch: micro_batch samples at once, with or
    without activation checkpointing, and the estimate that chose it against the device's budget."""

    micro_batch: int
    checkpoint_blocks: bool
    estimate: MemoryEstimate
    budget: int | None

    def to_dict(self) -> dict:
        return {"micro_batch": self.micro_batch, "checkpoint_blocks": self.checkpoint_blocks,
                "estimate_bytes": self.estimate.total, "budget_bytes": self.budget}


def plan_memory(graph: Graph, shard: int, budget: int | None, precision: str = "fp32", optimizer: str = "adamw",
                micro_batch: int | str = "auto", checkpointing: str = "auto",
                attention_scores: bool = False, expert_devices: int = 1) -> MemoryPlan | None:
    """The step a device of `budget` bytes runs on its `shard` of each global batch; None when even
    the smallest step the settings allow does not fit. `micro_batch` is the policy item: an integer
    (at most the shard), or auto: the largest that fits. `checkpointing` is the policy item
    activation_checkpointing: never, always, or auto: only where no micro-batch fits without it,
    since recomputing costs a third more forward work. Without a budget (a device that cannot tell
    its memory) the shard runs whole, as the settings say."""
    if checkpointing not in ("auto", "always", "never"):
        raise AiperfError(f"activation_checkpointing must be auto, always or never, got {checkpointing!r}")
    choices = {"never": (False,), "always": (True,), "auto": (False, True)}[checkpointing]
    fixed = None if micro_batch == "auto" else min(int(micro_batch), shard)
    if budget is None:
        size = fixed or shard
        return MemoryPlan(size, choices[0], estimate(graph, size, precision, optimizer, choices[0], attention_scores,
                                                     expert_devices, size < shard), None)
    limit = budget * MEMORY_HEADROOM
    for checkpoint in choices:
        def fits(size: int) -> MemoryEstimate | None:
            found = estimate(graph, size, precision, optimizer, checkpoint, attention_scores, expert_devices,
                             size < shard)
            return found if found.total <= limit else None

        if fixed is not None:
            found = fits(fixed)
            if found is not None:
                return MemoryPlan(fixed, found.checkpoint_blocks, found, budget)
            continue
        found = fits(shard)
        if found is not None:
            return MemoryPlan(shard, found.checkpoint_blocks, found, budget)
        # Accumulating, the estimate grows with the micro-batch: the largest that fits.
        low, high = 1, shard - 1
        if high < 1 or fits(low) is None:
            continue
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) is not None else (low, mid - 1)
        found = fits(low)
        return MemoryPlan(low, found.checkpoint_blocks, found, budget)
    return None


__all__ = ["MemoryEstimate", "MemoryPlan", "estimate", "activation_bytes", "plan_memory", "MEMORY_HEADROOM",
           "UPDATE_TEMPORARY_BYTES", "smallest_step"]
