"""Data parallelism over the local devices with torch.distributed (NCCL on GPUs, gloo on CPUs).

`train_data_parallel` starts one process per device (start_ranks: a fork of a forkserver that has
imported torch once). Every process lowers the same graph with the
same weights (which `same_start` checks, in place of DDP's broadcast of rank 0's), wraps it in
DistributedDataParallel and runs training.run_epochs with its rank: each
global batch of `config.batch_size` images is cut into contiguous shards, one per rank, and the
gradients are all-reduced synchronously after every step. Every rank then takes the same training
step (training.Stepper: SGD with momentum or AdamW) on the all-reduced gradients, after clipping
them to config.grad_clip where that is set: the clip sees the global batch's gradient norm, not a
shard's, so k ranks update the weights as one device does on the combined batch. With
config.micro_batch a rank's shard runs as micro-batches under DDP's no_sync, its gradients reduced
once, in the last one's backward; every rank runs as many micro-batches as the largest shard needs
(empty ones last), so that the collectives inside a forward pair up across the ranks.

Streamed data (a StreamingDataset of images, a TokenStream of text) travels to the ranks as the
object itself, pickled: each rank reads only its own shard of every batch.

Expert parallelism (TrainConfig.expert_parallel, a graph with moe nodes): each rank's moe modules hold
only its own block of experts (expert_parallel.shard_experts, before DDP, which leaves those parameters
out), tokens reach their experts by all_to_all_single in a process group of the exchanges' own, and at
the end every rank's experts are gathered so that rank 0 sends the whole model (expert_parallel.py).

Batch norm is synchronised across the ranks (the statistics of a training step are those of the
whole global batch, and the moving averages are updated from them identically on every rank). That
makes data-parallel training mathematically the same as training on one device with the global
batch, which is what a benchmark needs: the result must not depend on how many accelerators ran
it. On CUDA this is torch.nn.SyncBatchNorm; torch's SyncBatchNorm refuses CPU tensors, so elsewhere
(CPU with gloo, used by the tests) `DistributedBatchNorm` below does the same with two
differentiable all-reduces per layer.

Rank 0 reports each epoch to the parent, which calls the caller's on_epoch and sends back whether
to stop; the decision is broadcast to all ranks. At the end rank 0 sends the trained weights
(canonical NumPy arrays) back, and the parent loads them into its model.

A rank ends in order (`end_rank`): its queue's feeder thread has flushed, every rank has passed
a barrier, nothing holds the process group any more, and destroying the group joins its threads
(gloo: two work threads and the TCP loop; on rank 0 also the TCP store's loop). A rank that
exited with those threads running aborted now and then ('terminate called without an active
exception'): docs/backends/torch.md, "Data-parallel teardown".
"""

from __future__ import annotations

import gc
import os
import queue as queue_module
import socket
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from aiperf_core.backend import BackendError, Dataset, EpochReport, TrainConfig, is_streaming
from aiperf_core.ir import Graph

MASTER_ADDR = "127.0.0.1"


# ---------------------------------------------------------------------------
# Synchronised batch norm for any device (torch's SyncBatchNorm is GPU-only)
# ---------------------------------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    """Differentiable sum over the ranks: the gradient of a sum is the sum of the gradients."""

    @staticmethod
    def forward(ctx, tensor):
        out = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


class DistributedBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm whose training statistics are those of the union of every rank's batch.

    mean = sum(x) / count and the biased variance = sum((x - mean)^2) / count, each summed over the
    ranks (two-pass, as stable as the single-device kernel); the moving variance gets the unbiased
    one (count / (count - 1), factor 1 when count == 1), as the NumPy reference and torch do.
    Ranks with an empty shard still take part in the collectives.
    """

    def _check_input_dim(self, input):
        if input.dim() not in (2, 3, 4):
            raise ValueError(f"expected a 2D, 3D or 4D input, got {input.dim()}D")

    def forward(self, x):
        if not (self.training and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            from aiperf_backends.torch.lowering import _bn_single_value

            if self.training and x.numel() == x.shape[1]:
                return _bn_single_value(self, x)
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                self.training, self.momentum, self.eps)
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        xf = x.float()
        count = xf.new_full((1,), xf.numel() // channels)
        stats = _AllReduceSum.apply(torch.cat([xf.sum(dims), count]))
        total = stats[channels].detach()
        mean = stats[:channels] / total
        centred = xf - mean.view(shape)
        var = _AllReduceSum.apply((centred * centred).sum(dims)) / total
        y = centred * torch.rsqrt(var + self.eps).view(shape) * self.weight.view(shape) + self.bias.view(shape)
        with torch.no_grad():
            m = self.momentum
            unbiased = var * (total / torch.clamp(total - 1, min=1))
            self.running_mean.mul_(1 - m).add_(mean.to(self.running_mean.dtype), alpha=m)
            self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
            self.num_batches_tracked.add_(1)
        return y


def convert_sync_batchnorm(model, device: torch.device):
    """Replace every batch norm of a LoweredModel by a synchronised one (in place); returns the model."""
    for key, module in list(model.layers.items()):
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        if device.type == "cuda":
            new = nn.SyncBatchNorm(module.num_features, module.eps, module.momentum)
        else:
            new = DistributedBatchNorm(module.num_features, module.eps, module.momentum)
        with torch.no_grad():
            new.weight.copy_(module.weight)
            new.bias.copy_(module.bias)
            new.running_mean.copy_(module.running_mean)
            new.running_var.copy_(module.running_var)
            new.num_batches_tracked.copy_(module.num_batches_tracked)
        model.layers[key] = new.to(device)  # the generated forward looks its modules up by name
    return model


# ---------------------------------------------------------------------------
# Process groups
# ---------------------------------------------------------------------------


def free_port(host: str = MASTER_ADDR) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_context():
    """The forkserver context the ranks start from. multiprocessing's forkserver is started once per
    process, with this module (so torch) imported, and every rank after is a fork of it: a spawned
    rank imported torch afresh, about 2 s of CPU a rank at every trial (the kit's parallel level on 2
    CPU devices: 34.7 s with spawn, 23.7 s forked). Where a worker pool (aiperf_core.data.stream)
    started the forkserver first, without this module, a rank imports it itself, as a spawned one did.
    Forking before CUDA is initialised is safe: the forkserver never touches a device."""
    import torch.multiprocessing as mp

    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def rank_queue():
    """A queue between this process and its ranks (start_ranks)."""
    return _rank_context().Queue()


def start_ranks(entry: Callable[[int, dict], None], job: dict, nprocs: int):
    """`nprocs` ranks running entry(local_rank, job), forked from the forkserver (_rank_context), not
    joined. The forkserver keeps the environment of the moment it started; each rank takes this
    process's environment of now (a replica sets its progress file's path for its ranks, and an
    auto-precision probe unsets it for its own). A spawned rank died with its parent (torch sets its
    parent-death signal), but a forked one's parent is the forkserver, which outlives a killed process
    while any of its forks runs: each rank leaves once this process is gone (aiperf_core.orphans),
    rather than wait for ever on its queue."""
    import torch.multiprocessing as mp

    from aiperf_core.orphans import process_identity

    _rank_context()
    owner = os.getpid()
    return mp.start_processes(_rank_entry, args=(entry, job, dict(os.environ), owner, process_identity(owner)),
                              nprocs=nprocs, join=False, start_method="forkserver")


def _rank_entry(local_rank: int, entry: Callable[[int, dict], None], job: dict, environ: dict, owner: int,
                identity: str | None) -> None:
    from aiperf_core.orphans import leave_when_gone

    leave_when_gone(owner, identity, 1, "watch-parent")
    os.environ.clear()
    os.environ.update(environ)
    entry(local_rank, job)


# How long a parent waits on its ranks' queue before it looks whether they have ended: the most a trial's
# end waits for its ranks' exit to be seen (it was 0.5 s, up to a second a trial with the teardown's).
RANK_POLL_S = 0.05


def rank_messages(processes, messages) -> Iterator[Any]:
    """What the ranks put on the queue `messages`, as it comes, until every rank has ended; raises
    if one failed. Read while the ranks run: a rank flushes its queue before it ends, and a reader
    after the join would leave it waiting on a full pipe. What a rank put just before it ended is
    still read after the end is seen."""
    while True:
        try:
            yield messages.get(timeout=RANK_POLL_S)
        except queue_module.Empty:
            if processes.join(timeout=0):  # raises if a rank failed
                break
    while True:
        try:
            yield messages.get(block=False)
        except queue_module.Empty:
            return


def terminate_ranks(processes) -> None:
    """Stop the ranks still alive: after a failure, none may be left waiting on a collective."""
    for p in processes.processes:
        if p.is_alive():
            p.terminate()


def init_process_group(rank: int, world: int, device: torch.device, master_addr: str, master_port: int,
                       timeout_s: float | None = None) -> None:
    # torch.distributed.nn.functional binds group.WORLD as the default argument of its functions
    # when it is first imported, and DistributedDataParallel imports it (through torch._dynamo).
    # Imported after the group exists, it would hold the group for the life of the interpreter:
    # destroy_process_group could not free it, and gloo's threads would outlive the rank's Python.
    import torch.distributed.nn.functional  # noqa: F401

    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # Across nodes, a bound on the rendezvous and on every collective: a node that dies, or whose
    # link goes down, fails its peers' next collective within it instead of hanging them
    # (docs/workflow.md, "A replica across nodes").
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group(process_group_backend(device), rank=rank, world_size=world,
                            init_method=f"tcp://{master_addr}:{master_port}", **timeout)


def process_group_threads() -> list[str]:
    """Names of this process's threads that belong to a gloo process group (its work threads and
    TCP loop, and the TCP store's loop): none once the group is really gone. Linux only."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # pragma: no cover - not Linux
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(("pt_gloo", "gloo_", "pt_tcpstore")):
            names.append(name)
    return sorted(names)


def end_process_group() -> None:
    """Destroy the default process group and with it its threads, while the interpreter is whole.

    The group's threads end only when its last reference goes: the caller has dropped its own
    (DistributedDataParallel's reducer holds the group), and the cycles that the autograd graph
    and the reducer make are collected here first. A gloo group that survives this is an error,
    not a warning: a rank that exits with gloo's threads running aborts now and then, and failing
    every time instead names the threads (docs/backends/torch.md, "Data-parallel teardown")."""
    if not dist.is_initialized():
        return
    gloo = dist.get_backend() == "gloo"
    gc.collect()
    dist.destroy_process_group()
    gc.collect()
    left = process_group_threads() if gloo else []  # NCCL's teardown is unverified here (no GPUs)
    if left:
        raise BackendError(f"the process group's threads still run after its teardown ({', '.join(left)}): "
                           f"something holds the group, and the rank's exit could abort")


def end_rank(outcome: BaseException | None) -> None:
    """A rank's last act: on success a barrier (no rank tears down while another still reduces),
    then end_process_group. A failed rank keeps its exception for torch's spawn to report; its
    traceback's frames still hold the model, so its group is only destroyed, not waited for."""
    if outcome is not None:
        if dist.is_initialized():
            dist.destroy_process_group()
        return
    if dist.is_initialized():
        dist.barrier()
    end_process_group()


def set_worker_threads(world: int) -> None:
    """Share this machine's cores between the ranks instead of each taking them all."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // world))


class AllReduceClock:
    """The seconds each training step waits on DDP's gradient all-reduce (EpochReport.all_reduce_seconds).

    Registered as DDP's communication hook: it runs torch's own allreduce_hook (the default reduction:
    divide by world, all-reduce, in the same buckets and order) and times it. DDP launches a bucket's
    all-reduce as soon as its gradients are ready, overlapping the rest of the backward; the bucket it
    launches last (GradBucket.is_last) is launched once the backward's computation is done. So a step's
    wait is from the last bucket's launch to the completion of the step's last collective to end: the
    communication the backward could not hide, including what was still running of earlier buckets.
    Not the last bucket's own completion: gloo runs a process group's collectives on two threads, so an
    earlier, larger bucket can end after it (at 20 Mbit/s the first 1 MiB bucket of gpt_small ended about
    0.1 s a step after the last one, time no wait counted: docs/performance.md). Copying the reduced
    buckets back into the gradients is not counted.
    A rank that finishes its backward first also waits there for the slower ranks to launch theirs: load
    imbalance, which an ideal network would not take away. So a step's wait is the least of the ranks'
    waits at that step (`take` reduces them with MIN over the default group, on every rank): the rank
    that launches last waits only for the communication.
    On a CPU (gloo) both ends are read with time.perf_counter (the completion in the future's callback,
    which DDP waits on before backward() returns); on CUDA (NCCL) with CUDA events, one on the current
    stream at the launch and one in the callback, read once per epoch: written for it, unverified (no
    GPU here)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.waits: list[float] = []  # this rank's wait at each step since the last take, in step order
        self._events: list = []  # CUDA: (launch, done) event pairs not yet read
        # CPU: the step's collectives not yet ended, the last bucket's launch (None before it) and the
        # latest end so far; the futures' callbacks run on gloo's threads.
        self._lock = threading.Lock()
        self._running, self._launched, self._ended = 0, None, 0.0

    def hook(self, process_group, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        last = bucket.is_last()
        if self.cuda:  # NCCL ends one communicator's collectives in launch order (unverified: no GPU here)
            if last:
                launched = torch.cuda.Event(enable_timing=True)
                launched.record()
            future = allreduce_hook(process_group, bucket)
            if not last:
                return future

            def recorded(fut):
                finished = torch.cuda.Event(enable_timing=True)
                finished.record()
                self._events.append((launched, finished))
                return fut.value()

            return future.then(recorded)
        with self._lock:
            self._running += 1
            if last:
                self._launched = time.perf_counter()
        future = allreduce_hook(process_group, bucket)

        def ended(fut):
            now = time.perf_counter()
            with self._lock:
                self._running -= 1
                self._ended = max(self._ended, now)
                if self._launched is not None and not self._running:  # the step's last collective
                    self.waits.append(self._ended - self._launched)
                    self._launched, self._ended = None, 0.0
            return fut.value()

        return future.then(ended)

    def take(self) -> float | None:
        """The steps' waits since the last call, each the least over the ranks, summed (None when no step
        reduced), and forget them. A collective when several ranks run: call it on every rank alike (every
        rank ran the same steps, so their lists pair up)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.waits += [start.elapsed_time(end) / 1000.0 for start, end in self._events]
            self._events.clear()
        waits, self.waits = self.waits, []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # The lengths first (least and, negated, most), so that every rank sees the same and either
            # all reduce the waits or all raise, never one left waiting in a collective the others skip.
            counts = torch.tensor([len(waits), -len(waits)], dtype=torch.float64, device=self.device)
            dist.all_reduce(counts, op=dist.ReduceOp.MIN)
            fewest, most = int(counts[0].item()), -int(counts[1].item())
            if fewest != most:
                raise RuntimeError(f"all-reduce clock: the ranks timed from {fewest} to {most} steps this epoch")
            if waits:
                least = torch.tensor(waits, dtype=torch.float64, device=self.device)
                dist.all_reduce(least, op=dist.ReduceOp.MIN)
                waits = least.tolist()
        return sum(waits) if waits else None


def wrap(model, device: torch.device):
    """Synchronised batch norm plus DistributedDataParallel around a lowered model on `device`. An
    expert-parallel model's expert parameters are left out of DDP (their own rank's, not replicas).
    The all-reduce is timed by an AllReduceClock hook, kept as the wrapper's `all_reduce_clock`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aiperf_backends.torch.expert_parallel import ignored_parameter_names

    convert_sync_batchnorm(model, device)
    ignored = ignored_parameter_names(model)
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    same_start(model, ignored, device)
    # Every rank lowered the same weights (the module's docstring): DDP's broadcast of rank 0's would send
    # the whole model from one rank at every trial's start (0.75 s for gpt_small's 1.87 MB at 20 Mbit/s, time
    # no wait counts), so it is skipped and same_start stands guard instead.
    if device.type == "cuda":
        wrapped = DDP(model, device_ids=[device.index], output_device=device.index, init_sync=False)
    else:
        wrapped = DDP(model, init_sync=False)
    clock = AllReduceClock(device)
    wrapped.register_comm_hook(None, clock.hook)
    wrapped.all_reduce_clock = clock
    return wrapped


def same_start(model, ignored: set[str] | list[str], device: torch.device) -> None:
    """Raises BackendError unless every rank holds the same parameters and buffers (those DDP replicates:
    not `ignored`): each rank's sum and sum of squares of them, in float64, gathered (16 bytes a rank)."""
    with torch.no_grad():
        tensors = [t for name, t in [*model.named_parameters(), *model.named_buffers()]
                   if name not in ignored and t.is_floating_point()]
        mine = torch.stack([sum((t.double().sum() for t in tensors), torch.zeros((), dtype=torch.float64)),
                            sum((t.double().square().sum() for t in tensors), torch.zeros((), dtype=torch.float64))])
        everyone = [torch.empty_like(mine.to(device)) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine.to(device))
    for rank, theirs in enumerate(everyone):
        if not torch.equal(theirs, everyone[0]):
            raise BackendError(f"rank {rank} starts the trial from other weights than rank 0: every rank must lower "
                               f"the same graph and weights")


def float_all_reduce(device: torch.device) -> Callable[[list[float]], list[float]]:
    def reduce(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    return reduce


def shard(global_indices: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's contiguous part of a global batch (the shards partition the batch)."""
    return np.array_split(global_indices, world)[rank]


def ddp_step(stepper, x_global: torch.Tensor, y_global: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """One synchronous data-parallel training step on a global batch: this rank takes its shard.

    `stepper` is a training.Stepper around the DDP-wrapped model. Returns the shard's summed loss.
    """
    part = torch.from_numpy(shard(np.arange(len(y_global)), rank, world))
    return stepper.step(x_global.index_select(0, part), y_global.index_select(0, part), len(y_global), world)


# ---------------------------------------------------------------------------
# The spawned training job
# ---------------------------------------------------------------------------


def _start_rank(local_rank: int, job: dict):
    """Process group, lowered model (this rank's experts only under expert parallelism), synchronised BN
    and DDP for this node's rank `local_rank`: (model, ddp, device, config, rank), rank the global one."""
    from aiperf_backends.torch import expert_parallel
    from aiperf_backends.torch.lowering import lower_graph, torch_device

    world, rank = job["world"], job["first_rank"] + local_rank
    device = torch_device(job["devices"][local_rank])
    set_worker_threads(len(job["devices"]))  # the ranks that share this node's cores
    init_process_group(rank, world, device, job["master_addr"], job["master_port"], job.get("timeout_s"))
    config: TrainConfig = job["config"]
    graph = Graph.from_dict(job["graph"])
    model = lower_graph(graph, job["weights"], config.precision, str(device))
    if expert_parallel.applies(graph, config, world):
        # The exchanges' own group (every rank creates it, in the same order): they never interleave
        # with DDP's asynchronous all-reduces on the default group.
        expert_parallel.shard_experts(model, rank, world, device, dist.new_group(backend=process_group_backend(device)))
    return model, wrap(model, device), device, config, rank


def _train_rank(local_rank: int, job: dict) -> None:
    """One rank of train_data_parallel: the whole epoch loop. Everything that holds the process
    group (the DDP wrapper, the stepper) lives in this call's frame and goes when it returns.
    Global rank 0, on the replica's first node, reports to its node's parent; nothing crosses
    between nodes but through the process group."""
    from aiperf_backends.torch.expert_parallel import whole_weights
    from aiperf_backends.torch.training import Stepper, run_epochs

    model, ddp, device, config, rank = _start_rank(local_rank, job)
    # Streamed data travels as the object itself (a StreamingDataset's paths and settings, a
    # TokenStream's corpus reopened from its path); each rank reads only its own shard of a batch.
    data = job["stream"] if "stream" in job else Dataset(*(t.numpy() for t in job["data"]), classes=job["classes"])
    reports_q, replies_q = job["reports"], job["replies"]

    def on_epoch(report: EpochReport) -> bool:
        flag = torch.zeros(1, dtype=torch.int64, device=device)
        if rank == 0:
            reports_q.put(("epoch", asdict(report)))
            flag[0] = int(bool(replies_q.get()))
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    run_epochs(ddp, data, config, device, rank=rank, world=job["world"], all_reduce=float_all_reduce(device),
               on_epoch=on_epoch, stepper=Stepper(ddp, device, config))
    weights = whole_weights(model)  # every rank's experts gathered: a collective
    if rank == 0:
        reports_q.put(("weights", weights))
        reports_q.close()
        reports_q.join_thread()  # the feeder thread has written everything before the rank ends


def _rank_main(local_rank: int, job: dict) -> None:
    outcome = None
    try:
        _train_rank(local_rank, job)
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        end_rank(outcome)


def _step_rank(local_rank: int, job: dict) -> None:
    from aiperf_backends.torch.expert_parallel import whole_grads, whole_weights
    from aiperf_backends.torch.training import Stepper

    model, ddp, device, config, rank = _start_rank(local_rank, job)
    stepper = Stepper(ddp, device, config)
    stepper.set_lr(config.schedule.rate(0, max(config.epochs, 1)))
    losses, grads = [], []
    for x, y in job["batches"]:
        losses.append(float(ddp_step(stepper, x.to(device), y.to(device), rank, job["world"])))
        grads.append(whole_grads(model))
    job["results"].put((rank, losses, grads, whole_weights(model)))


def run_rank_steps(rank: int, job: dict) -> None:
    """One rank of a fixed sequence of data-parallel training steps, for tests and self-checks.

    `job` holds what train_data_parallel's jobs hold (world, devices, master_addr, master_port,
    graph, weights, config) plus `batches`, a list of global batches (NHWC float32 tensor, int64
    labels), and `results`, a queue. Each step runs ddp_step at epoch 0's learning rate; the rank
    then puts (rank, per-step summed shard losses, per-step canonical gradients, final canonical
    weights) on the queue. The gradients are those the update took: DDP's all-reduced ones (the
    global batch's mean loss), clipped where config.grad_clip is set. With `job["threads_after"]` (a queue) set, the rank then puts (rank, the
    names of its process-group threads still running after end_rank) there. Under expert parallelism
    (config.expert_parallel and a moe node) the gradients and weights are the whole model's, every rank's
    experts gathered.
    """
    outcome = None
    try:
        _step_rank(rank, job)
    except BaseException as exc:
        outcome = exc
        raise
    finally:
        end_rank(outcome)
    if job.get("threads_after") is not None:
        job["threads_after"].put((rank, process_group_threads()))


def make_job(model, config: TrainConfig, devices: list[str], **extra) -> dict:
    """What every rank of this node needs to rebuild `model` (a LoweredModel) and train it with
    `config`; `devices` are this node's. Across nodes (config.layout) the group is every device of
    the replica, met at its coordinator; on one node it is these devices, met on loopback."""
    layout = config.layout
    if layout is not None and layout.multi_node:
        meeting = {"world": layout.world, "first_rank": layout.global_rank(0), "master_addr": layout.coordinator_addr,
                   "master_port": layout.coordinator_port, "timeout_s": layout.timeout_s}
    else:
        meeting = {"world": len(devices), "first_rank": 0, "master_addr": MASTER_ADDR, "master_port": free_port()}
    return {**meeting, "devices": list(devices), "graph": model.graph.to_dict(), "weights": model.export_canonical(),
            "config": config, **extra}


def train_data_parallel(model, data: Dataset, config: TrainConfig, devices: list[str],
                        on_epoch: Callable[[EpochReport], Any] | None = None) -> list[EpochReport]:
    """Train `model` (a LoweredModel) with one process per device of this node (start_ranks). Where this
    node leads (always, but on a replica's follower nodes), the trained weights are loaded back into
    `model` and the epoch reports returned; a follower returns none and keeps its starting weights."""
    leads = config.layout is None or config.layout.leads
    reports_q, replies_q = rank_queue(), rank_queue()
    if is_streaming(data):
        job = make_job(model, config, devices, stream=data, reports=reports_q, replies=replies_q)
    else:
        shared = []
        inputs = np.int64 if model.graph.takes_tokens else np.float32  # token ids, or normalised images
        for array, dtype in ((data.x_train, inputs), (data.y_train, np.int64), (data.x_val, inputs),
                             (data.y_val, np.int64)):
            shared.append(torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).share_memory_())
        job = make_job(model, config, devices, data=shared, classes=data.classes, reports=reports_q,
                       replies=replies_q)
    processes = start_ranks(_rank_main, job, len(devices))
    reports: list[EpochReport] = []
    weights = None
    try:
        for kind, payload in rank_messages(processes, reports_q):
            if kind == "epoch":
                report = EpochReport(**payload)
                reports.append(report)
                stop = bool(on_epoch(report)) if on_epoch is not None else False
                replies_q.put(stop)
            elif kind == "weights":
                weights = payload
    except BaseException:
        terminate_ranks(processes)
        raise
    finally:
        for q in (reports_q, replies_q):
            q.close()
        replies_q.join_thread()
    if not leads:
        return reports
    if weights is None:
        raise BackendError("data-parallel training ended without returning the trained weights")
    model.load_canonical(weights)
    return reports
