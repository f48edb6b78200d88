"""Expert parallelism (TrainConfig.expert_parallel) over the data-parallel ranks (distributed.py).

On each of `world` ranks every moe module (lowering.Experts) is replaced by a `ShardedExperts` that
holds only its experts [start, stop) = aiperf_core.backend.expert_shard(E, world, rank): parameters of
shape (E / world, ...). The router stays whole on every rank and data-parallel, like every other
parameter. A forward:

1. routes the rank's tokens (router, top-k, gates: lowering.Experts.route, exactly as on one device)
   and sorts the (token, choice) assignments by expert (lowering.expert_segments);
2. exchanges the per-expert counts (one all_to_all_single of E int64s) and reads them once on the
   host: they are the split sizes of the next two exchanges;
3. sends each assignment's input row to its expert's rank (all_to_all_single with input/output split
   sizes), regroups what arrived (in source-rank order) by local expert, runs the local experts over
   contiguous segments (lowering.Experts.products: segment products, or torch._grouped_mm on CUDA in
   bf16), puts the outputs back in arrival order and sends them home (all_to_all_single, the splits
   swapped);
4. weights them by the gates and adds them to their tokens (lowering.Experts.combine).

No token is ever dropped: the buffers are sized by the exchanged counts. The exchanges are
differentiable (`_Exchange`: the backward is the reverse all-to-all), so a rank's backward sends the
gradients of the rows it received back to the ranks they came from. Every rank takes part in every
exchange, also with an empty micro-batch or when none of its experts was chosen (the training loop
runs as many micro-batches, and evaluation as many forwards, on every rank).

Gradients. The loss a rank differentiates is its shard's summed loss times world / global batch
(training.py). DistributedDataParallel averages the replicated parameters' gradients over the ranks,
which makes them the global batch's mean-loss gradient. The expert parameters are left out of DDP
(`ignored_parameter_names`): their gradient is already the sum over every rank's tokens, i.e. world
times the global mean-loss gradient, so `ExpertParallel.prepare_grads` divides it by world. The clip
(TrainConfig.grad_clip) sees the global norm: the replicated parameters' norm (the same on every rank)
together with the sum over the ranks of their experts' squared norms (`ExpertParallel.clip`). The
optimizer's state of an expert parameter is the rank's own.

The exchanges run in a process group of their own (created beside the default group on every rank),
so that they never interleave with DDP's asynchronous gradient all-reduces.

Time. `ExchangeClock` adds up the wall time of every exchange (the counts, the rows out and back, in
the forward and the backward, training and evaluation); training.run_epochs reports rank 0's figure as
EpochReport.all_to_all_seconds. On a CPU (gloo) the calls are synchronous and timed with
time.perf_counter. On CUDA (NCCL) they are timed with CUDA events recorded around each call on the
current stream, read once per epoch: written for it, unverified (no GPU here).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from aiperf_core.backend import TrainConfig, expert_shard
from aiperf_core.ir import Graph

from aiperf_backends.torch.lowering import Experts, expert_segments


def applies(graph: Graph, config: TrainConfig, world: int) -> bool:
    """Whether a rank of `world` trains `graph` expert-parallel (the parent's Backend.train has already
    checked the rest with aiperf_core.backend.check_expert_parallel)."""
    return bool(config.expert_parallel) and world > 1 and any(node.op == "moe" for node in graph.nodes)


class ExchangeClock:
    """The seconds spent in all-to-all exchanges since the last `take`, and how many ran."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self.exchanges = 0
        self._events: list = []  # CUDA: (start, end) event pairs not yet read

    @contextmanager
    def timing(self) -> Iterator[None]:
        if self.cuda:  # unverified: no GPU here
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - began
        self.exchanges += 1

    def take(self) -> float | None:
        """The seconds since the last call (None when no exchange ran), and zero them."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events.clear()
        seconds = self.seconds if self.exchanges else None
        self.seconds, self.exchanges = 0.0, 0
        return seconds


def exchange(rows: torch.Tensor, send: list[int], receive: list[int], group, clock: ExchangeClock) -> torch.Tensor:
    """all_to_all_single of `rows`: send[r] rows (in order) to rank r, receive[r] from rank r."""
    out = rows.new_empty((sum(receive),) + tuple(rows.shape[1:]))
    with clock.timing():
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                               group=group)
    return out


class _Exchange(torch.autograd.Function):
    """A differentiable `exchange`: the gradient of the rows received goes back where they came from."""

    @staticmethod
    def forward(ctx, rows, send, receive, group, clock):
        ctx.send, ctx.receive, ctx.group, ctx.clock = send, receive, group, clock
        return exchange(rows, send, receive, group, clock)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.receive, ctx.send, ctx.group, ctx.clock), None, None, None, None


class ShardedExperts(Experts):
    """A moe node's module on one rank of an expert-parallel model: the whole router, and only experts
    [start, stop) of every expert stack (see the module's docstring for the forward)."""

    def __init__(self, whole: Experts, rank: int, world: int, group, clock: ExchangeClock):
        nn.Module.__init__(self)
        experts = whole.router.shape[1]
        self.start, self.stop = expert_shard(experts, world, rank)
        self.rank, self.world, self.group, self.clock = rank, world, group, clock
        self.top_k, self.swiglu, self.routing = whole.top_k, whole.swiglu, None
        self.router = nn.Parameter(whole.router.detach().clone())
        for name in self.expert_parameter_names():
            stack = getattr(whole, name).detach()
            setattr(self, name, nn.Parameter(stack[self.start:self.stop].clone()))

    def expert_parameter_names(self) -> tuple[str, ...]:
        return ("w_gate", "w_in", "w_out") if self.swiglu else ("w_in", "b_in", "w_out", "b_out")

    def expert_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, name) for name in self.expert_parameter_names()]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        experts, local = self.router.shape[1], self.stop - self.start
        chosen, gates = self.route(x, flat)
        order, offsets = expert_segments(chosen, experts)
        token_of = order // self.top_k
        tokens = flat.index_select(0, token_of)
        # Counts: what this rank sends each expert, then what each rank sends this rank's experts.
        per_expert = torch.diff(offsets, prepend=offsets.new_zeros(1)).to(torch.int64)
        arriving = torch.empty_like(per_expert)
        with self.clock.timing():
            dist.all_to_all_single(arriving, per_expert, group=self.group)
        counts = torch.cat([per_expert, arriving]).tolist()  # the layer's one host read
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(self.world)]
        from_rank = np.asarray(counts[experts:], dtype=np.int64).reshape(self.world, local)  # (source, local expert)
        receive = from_rank.sum(axis=1).tolist()
        arrived = _Exchange.apply(tokens, send, receive, self.group, self.clock)
        # Arrived: by source rank, then local expert. Regrouped by local expert (stably: by source within).
        expert_of_row = np.repeat(np.tile(np.arange(local), self.world), from_rank.reshape(-1))
        regroup = np.argsort(expert_of_row, kind="stable")
        sizes = from_rank.sum(axis=0).tolist()
        device = x.device
        regroup_t = torch.from_numpy(regroup).to(device)
        local_offsets = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).to(device)
        outputs = self.products(arrived.index_select(0, regroup_t), local_offsets,
                                torch.from_numpy(expert_of_row[regroup]).to(device), device, sizes)
        restore = torch.from_numpy(np.argsort(regroup, kind="stable")).to(device)
        returned = _Exchange.apply(outputs.index_select(0, restore), receive, send, self.group, self.clock)
        return self.combine(flat, returned, gates, order, token_of).reshape(x.shape)


class ExpertParallel:
    """A rank's expert-parallel state: its process group for the exchanges, the clock, and the sharded
    modules' expert parameters (left out of DDP, their gradients divided by world, their norm summed)."""

    def __init__(self, modules: Mapping[str, ShardedExperts], rank: int, world: int, group, clock: ExchangeClock):
        self.modules = dict(modules)
        self.rank, self.world, self.group, self.clock = rank, world, group, clock
        self.parameters = [p for m in self.modules.values() for p in m.expert_parameters()]

    def prepare_grads(self) -> None:
        """Every expert parameter's gradient as one device's on the global batch: present (zero where none of
        its experts was chosen: one device's stack would hold zeros there) and divided by world."""
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.div_(self.world)

    def clip(self, params: list, max_norm: float) -> None:
        """clip_grad_norm_ of `params` (every trainable parameter of the rank) on the global norm."""
        ours = {id(p) for p in self.parameters}
        replicated = [p.grad for p in params if id(p) not in ours and p.grad is not None]
        experts = [p.grad for p in self.parameters]
        device = experts[0].device
        squares = torch.nn.utils.get_total_norm(experts).float().square().reshape(1)
        dist.all_reduce(squares, group=self.group)  # every rank's experts: the whole model's
        if replicated:
            squares = squares + torch.nn.utils.get_total_norm(replicated).float().square().to(device)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, squares.sqrt()[0])

    def agree_found_inf(self, scaler, optimizer) -> None:
        """fp16: every rank skips a step when any rank's (unscaled) gradients overflowed, since the expert
        gradients differ by rank. Uses GradScaler's per-optimizer state (private); unverified (fp16 runs
        only on CUDA)."""
        for found in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)

    def whole(self, canonical: dict) -> dict:
        """`canonical` (the rank's export_canonical or canonical_grads) with every expert stack gathered from
        the ranks in order: the whole model in the canonical layout. A collective: every rank calls it."""
        out = {node_id: dict(params) for node_id, params in canonical.items()}
        for node_id, module in self.modules.items():
            for name in module.expert_parameter_names():
                if name not in out.get(node_id, {}):
                    continue
                mine = torch.from_numpy(np.ascontiguousarray(out[node_id][name])).to(module.router.device)
                parts = [torch.empty_like(mine) for _ in range(self.world)]
                dist.all_gather(parts, mine, group=self.group)
                out[node_id][name] = np.ascontiguousarray(torch.cat(parts).cpu().numpy())
        return out


def shard_experts(model, rank: int, world: int, device, group) -> ExpertParallel:
    """Replace every moe module of `model` (a LoweredModel on `device`) by this rank's ShardedExperts, in
    place, and set model.expert_parallel. `group` is the process group of the exchanges."""
    clock = ExchangeClock(torch.device(device))
    modules = {}
    for node_id, whole in model.experts.items():
        key = model.module_names[node_id]
        modules[node_id] = model.layers[key] = ShardedExperts(whole, rank, world, group, clock).to(device)
    model.expert_parallel = ExpertParallel(modules, rank, world, group, clock)
    return model.expert_parallel


def ignored_parameter_names(model) -> list[str]:
    """The expert parameters' names in `model`, for DistributedDataParallel to leave out."""
    ep = getattr(model, "expert_parallel", None)
    if ep is None:
        return []
    ours = {id(p) for p in ep.parameters}
    return [name for name, p in model.named_parameters() if id(p) in ours]


def whole_weights(model) -> dict:
    """The trained weights of a rank's model, whole and canonical (a collective under expert parallelism)."""
    ep = getattr(model, "expert_parallel", None)
    weights = model.export_canonical()
    return ep.whole(weights) if ep is not None else weights


def whole_grads(model) -> dict:
    """canonical_grads of a rank's model, whole (a collective under expert parallelism)."""
    ep = getattr(model, "expert_parallel", None)
    grads = model.canonical_grads()
    return ep.whole(grads) if ep is not None else grads
