"""One training step, evaluation and the epoch loop, shared by the single-process and the data-parallel path.

The step is config.optimizer's update, the arithmetic written out beside aiperf_core.backend.OPTIMIZERS:
SGD with momentum (torch.optim.SGD) or AdamW (torch.optim.AdamW, whose decoupled decay, bias
correction and epsilon placement are that arithmetic; weight decay only on the parameters that
aiperf_core.optim.is_decayed names). With config.grad_clip set, every gradient is first scaled by
torch.nn.utils.clip_grad_norm_ to that ceiling on their global 2-norm (fp16: after unscaling).

The data-parallel path (distributed.py) runs the same loop in every rank with `rank`/`world` set:
every rank draws the same shuffled order (np.random.default_rng(seed + epoch)), cuts the same
global batches of `config.batch_size`, and takes its own contiguous shard of each. Each rank's
loss is its shard's summed cross-entropy scaled by world / global batch size, so that after
DistributedDataParallel averages the gradients over the ranks they are exactly the gradients of
the global batch's mean loss, even when the last batch does not split evenly. The clip and the
update then run on those averaged gradients, identically in every rank: k ranks take the step that
one device takes on the global batch. Under expert parallelism (expert_parallel.py) a rank's experts
are its own: their gradients, outside DDP, are divided by world, and the clip's norm sums every rank's.

Batches reach the device through a feed (feeds.py); streamed images arrive as uint8 pixels and
the model normalises them on the device, inside the step; streamed text (a TokenStream) arrives as
int64 token ids, a batch at a time.

With TrainConfig.micro_batch a step runs as micro-batches whose gradients add up to the global
batch's before the one update (Stepper), and with TrainConfig.checkpoint_blocks the model
recomputes each block's activations in the backward pass (lowering.run_block).

Compiling the step (torch.compile) is the policy `compile` (TrainConfig.compile: auto, always or
never); see `compiles` for what auto means and docs/backends/torch.md for the measurements.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from typing import Callable, Mapping, Sized

import numpy as np
import torch

from aiperf_backends.torch.feeds import open_feeds, stream_loader  # noqa: F401  (stream_loader: benchmarks)
from aiperf_backends.torch.loss import summed_eval, summed_loss
from aiperf_backends.torch.precision import autocast, float32_math, math_scope
from aiperf_core.backend import (BackendError, Dataset, EpochReport, StepClock, TrainConfig, is_streaming,
                                 micro_batches)
from aiperf_core.optim import is_decayed

PREDICT_BATCH = 256

# The compile policy. `auto` compiles a single-device trial's step on CUDA when the trial has at
# least AUTO_COMPILE_MIN_STEPS training steps: on an H100 the first compiled ResNet-50 step took
# 44 s and compiling saved about 17 ms a step at batch 256 (4,075 -> 5,589 images/s), so it pays
# after some 2,600 steps. On a CPU `auto` never compiles (docs/backends/torch.md: inductor's CPU
# compile of a trial costs more than it saves here). Data-parallel ranks run eager.
AUTO_COMPILE_MIN_STEPS = 2500
# CUDA graphs (torch.compile's "reduce-overhead" mode) for a compiled CUDA step: its shapes are
# static, because a batch of another size (the epoch's short last one) runs eager.
CUDA_GRAPHS = True


def device_of(model) -> torch.device:
    """Where the model's tensors are: its parameters', or its buffers' where it has none (a graph of
    constants and pooling), else the CPU."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device
    return torch.device("cpu")


def resolved(device) -> torch.device:
    """`device` with its index: 'cuda' is the current CUDA device ('cuda:0' unless set otherwise)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def compiles(mode: str, device: torch.device, steps: int, world: int) -> bool:
    """Whether a trial of `steps` training steps compiles its step: `always` and `never` say so;
    `auto` compiles a single-device CUDA trial of at least AUTO_COMPILE_MIN_STEPS steps."""
    if world > 1 or mode == "never":
        return False
    if mode == "always":
        return True
    return device.type == "cuda" and steps >= AUTO_COMPILE_MIN_STEPS


def trial_steps(data, config: TrainConfig) -> int:
    """Training steps of a whole trial (config.epochs passes over the training split)."""
    images = data.train_images if is_streaming(data) else len(data.y_train)
    return config.epochs * math.ceil(images / config.batch_size)


class preserved:
    """Restore every buffer (batch-norm statistics) and parameter gradient on exit, so that a
    training-mode pass that must not change the model (loss_and_grads, op counting) does not."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        for p, _ in self.grads:
            p.grad = None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        return False


def adamw_kernel(params: list) -> dict:
    """How AdamW updates `params`: fused (one CUDA kernel for every tensor's whole update) where they
    are all floating-point CUDA tensors; else foreach, the multi-tensor update (torch's default only
    on CUDA). On a CPU the per-tensor loop is three small multithreaded ops a tensor, and a GPT
    lowered from the IR has more (separate Q, K, V) tensors than a hand-written one
    (docs/performance.md)."""
    if params and all(p.device.type == "cuda" and p.is_floating_point() for p in params):
        return {"fused": True}
    return {"foreach": True}


def make_optimizer(params: list, config: TrainConfig) -> torch.optim.Optimizer:
    """config.optimizer over `params` at the schedule's first rate (set_lr sets each epoch's)."""
    if config.optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=config.schedule.initial, momentum=config.momentum, foreach=True)
    # Two groups, because torch's weight_decay is per group and the contract decays matrices only.
    groups = [{"params": [p for p in params if is_decayed(p)], "weight_decay": config.weight_decay},
              {"params": [p for p in params if not is_decayed(p)], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=config.schedule.initial,
                             betas=tuple(config.betas), eps=config.adam_epsilon, **adamw_kernel(params))


class Stepper:
    """config.optimizer (make_optimizer) after an optional global-norm gradient clip, the precision's
    scope, loss scaling for fp16, and the loss compiled with torch.compile when `compile` is set (a
    single-device LoweredModel only; the update itself runs eager).

    Gradient accumulation (config.micro_batch): a shard larger than micro_batch runs as consecutive
    micro-batches (aiperf_core.backend.micro_batches), each one's summed loss scaled by
    world / global batch and its backward adding into the same gradients, so that they are the
    global batch's before the one clip, unscale and update. A data-parallel model reduces its
    gradients over the ranks once, in the last micro-batch's backward (DDP's no_sync before it).
    Batch norm normalises each micro-batch by its own statistics. Activation checkpointing
    (config.checkpoint_blocks) is the model's `checkpoint_blocks` during the step (lowering.run_block).

    A mixture of experts: after each micro-batch's forward the step takes every moe module's Routing
    (lowering.Experts): the loss whose gradient it takes adds config.moe_aux_loss times their balance
    (summed over the micro-batch's sequences, so scaled by world / global batch as the cross-entropy is),
    while the loss it returns stays the cross-entropy; and each moe's load adds to `expert_load`, on the
    device, which `take_expert_load` reads once (an epoch's). A graph without moe takes none of this."""

    def __init__(self, model, device, config: TrainConfig, compile: bool = False):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise BackendError("the graph has no trainable parameters: there is nothing to train")
        self.model = model
        self.device = resolved(device)
        if device_of(model) != self.device:
            raise BackendError(f"the model is on {device_of(model)}, the step was asked to run on {device}")
        self.precision = config.precision
        self.label_smoothing = config.label_smoothing
        self.params = params
        self.grad_clip = config.grad_clip
        self.micro_batch = config.micro_batch
        self.checkpoint_blocks = config.checkpoint_blocks
        self.experts = getattr(model, "module", model).experts
        # Expert parallelism (expert_parallel.py): the rank's experts' gradients, clip and overflow check.
        self.expert_parallel = getattr(getattr(model, "module", model), "expert_parallel", None)
        self.moe_aux_loss = config.moe_aux_loss
        self.expert_load = {node_id: torch.zeros(m.router.shape[1], dtype=torch.int64, device=self.device)
                            for node_id, m in self.experts.items()}
        # torch's AdamW skips a parameter without a gradient (no decay, no moment decay, its own step
        # count held back); the contract's rule gives it a zero gradient and updates it.
        self.zero_missing_grads = config.optimizer == "adamw"
        self.optimizer = make_optimizer(params, config)
        self.scaler = torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None
        self.compiled = None
        self.cuda_graphs = False
        self.compiled_batch: int | None = None  # the shard size the compiled loss runs at
        # Compile time: the first compiled step's time less the second's ("first", "second", "done").
        self._compile_timing = "first" if compile else "done"
        self._used_compiled = False
        self._first_seconds = 0.0
        self.compile_seconds = 0.0  # not yet reported (take_compile_seconds)
        if compile:
            if hasattr(model, "module"):
                raise BackendError("the step of a data-parallel model is not compiled")
            # Not for an accumulated step: a graph's replay for the next micro-batch would overwrite
            # the previous one's outputs, among them gradients that autograd may keep as .grad.
            graphs = self.device.type == "cuda" and CUDA_GRAPHS and config.micro_batch is None
            mode = "reduce-overhead" if graphs else "default"
            self.cuda_graphs = graphs
            self.compiled = torch.compile(model._training_loss, dynamic=False, mode=mode)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _loss(self, x, y):
        self._used_compiled = False
        if self.compiled is not None:
            if self.compiled_batch is None:
                self.compiled_batch = len(y)
            if len(y) == self.compiled_batch:  # another size (a short last batch) runs eager: no recompile
                if self.cuda_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                self._used_compiled = True
                return self.compiled(self.model, x, y, self.label_smoothing)
        return summed_loss(self.model, x, y, self.label_smoothing)

    def _prepare_grads(self) -> None:
        """The gradients as the update takes them: present for every parameter, then clipped."""
        if self.expert_parallel is not None:  # their gradients as one device's (every optimizer)
            self.expert_parallel.prepare_grads()
        if self.zero_missing_grads:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        if self.grad_clip is not None:
            if self.expert_parallel is not None:  # the global norm: every rank's experts
                self.expert_parallel.clip(self.params, self.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)

    def _micro_batches(self, length: int, largest_shard: int | None) -> list[tuple[int, int]]:
        """[start, stop) of each micro-batch of this shard. With `largest_shard` (several ranks),
        as many as that shard needs, empty ones last: every rank then runs the same number of
        forward passes, whose collectives (synchronised batch norm, DDP's buffer broadcast) pair up."""
        parts = micro_batches(length, self.micro_batch)
        if largest_shard is not None:
            parts += [(length, length)] * (len(micro_batches(largest_shard, self.micro_batch)) - len(parts))
        return parts

    def step(self, x: torch.Tensor, y: torch.Tensor, global_batch: int, world: int = 1,
             largest_shard: int | None = None) -> torch.Tensor:
        """One synchronous training step on this rank's shard (x: uint8 pixels, float32 or token
        ids, moved to the step's device if it is not there) of a global batch of `global_batch`
        samples, whose largest shard over the ranks has `largest_shard` (default: global_batch
        split evenly); returns the shard's summed loss (detached, on the device)."""
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        if world > 1 and largest_shard is None:
            largest_shard = -(-global_batch // world)
        parts = self._micro_batches(len(y), largest_shard if world > 1 else None)
        base = getattr(self.model, "module", self.model)
        no_sync = getattr(self.model, "no_sync", None)  # DistributedDataParallel's
        base.checkpoint_blocks = self.checkpoint_blocks
        total, compiled = None, False
        try:
            with float32_math(self.device, self.precision == "tf32"):
                for k, (a, b) in enumerate(parts):
                    reduces = k == len(parts) - 1 or no_sync is None
                    with contextlib.nullcontext() if reduces else no_sync():
                        with autocast(self.device, self.precision):
                            part = self._loss(x[a:b], y[a:b])
                        compiled |= self._used_compiled
                        # The gradient's loss; `part`, the cross-entropy alone, is the one reported.
                        loss = (part + self._balance() if self.experts else part) * (world / global_batch)
                        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
                    # A copy: a CUDA graph's output is overwritten by its next replay.
                    total = part.detach().clone() if total is None else total + part.detach()
                    del part, loss
                self._update()
        finally:
            base.checkpoint_blocks = False
        if compiled and self._compile_timing != "done":
            self._time_compile(start)
        return total

    def _balance(self):
        """The micro-batch's load-balancing loss, config.moe_aux_loss times its moe modules' balance (0 at
        0), their loads added to `expert_load` on the way."""
        balance = 0.0
        for node_id, module in self.experts.items():
            routing, module.routing = module.routing, None
            self.expert_load[node_id] += routing.load
            if self.moe_aux_loss:
                balance = balance + self.moe_aux_loss * routing.balance
        return balance

    def take_expert_load(self) -> dict[str, tuple[int, ...]] | None:
        """Each moe node's expert load since the last call (one host read for all of them), and zero it;
        None without moe."""
        if not self.experts:
            return None
        counts = torch.cat(list(self.expert_load.values())).tolist()
        for load in self.expert_load.values():
            load.zero_()
        return cut_loads(self.expert_load, counts)

    def _update(self) -> None:
        """The update on the accumulated gradients: (unscale,) clip, step."""
        if self.scaler is not None:
            if self.grad_clip is not None or self.expert_parallel is not None:
                # The ceiling is on the true gradients' norm, not the scaled ones'; scaler.step
                # does not unscale twice, and still skips the step if they overflowed.
                self.scaler.unscale_(self.optimizer)
            if self.expert_parallel is not None:  # an overflow in any rank's experts skips every rank's step
                self.expert_parallel.agree_found_inf(self.scaler, self.optimizer)
            self._prepare_grads()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self._prepare_grads()
            self.optimizer.step()

    def _time_compile(self, start: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        if self._compile_timing == "first":
            self._first_seconds = seconds
            self.compile_seconds += seconds  # all of it, until the second step says what a step costs
            self._compile_timing = "second"
        else:
            self.compile_seconds -= min(seconds, self._first_seconds)
            self._compile_timing = "done"

    def take_compile_seconds(self) -> float:
        """Compile seconds since the last call (0.0 when nothing was compiled). An epoch whose
        only compiled step was the first reports that whole step."""
        if self._compile_timing == "second":
            self._compile_timing = "done"
        seconds, self.compile_seconds = self.compile_seconds, 0.0
        return seconds


def evaluate(model, feed, device: torch.device, precision: str, label_smoothing: float,
             clock: StepClock) -> tuple[float, int, int, int]:
    """(summed loss, correct predictions, images, skipped) over a validation feed in eval mode; for a
    sequence graph the images are sequences and the correct predictions are positions. An expert-parallel
    model runs the forward of an empty shard too: its all-to-all exchanges pair up with the other ranks'."""
    base = getattr(model, "module", model)
    exchanges = getattr(base, "expert_parallel", None) is not None
    was_training = base.training
    base.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    images = skipped = 0
    try:
        with torch.no_grad():
            for batch in feed.epoch(0):
                skipped += batch.skipped
                if not len(batch.y) and not exchanges:
                    continue
                with clock, math_scope(device, precision):
                    part, right = summed_eval(base, batch.x, batch.y, label_smoothing)
                    total += part
                    correct += right
                images += len(batch.y)
        with clock:  # waits for the queued evaluation on an asynchronous device
            return float(total), int(correct), images, skipped
    finally:
        base.train(was_training)


def cut_loads(loads: Mapping[str, Sized], counts: list[float]) -> dict[str, tuple[int, ...]]:
    """`counts`, the moe nodes' expert loads one after another, cut into `loads`' nodes by their lengths."""
    values = iter(counts)
    return {node_id: tuple(int(round(next(values))) for _ in range(len(load))) for node_id, load in loads.items()}


def run_epochs(model, data: Dataset, config: TrainConfig, device, *, rank: int = 0, world: int = 1,
               all_reduce: Callable[[list[float]], list[float]] | None = None,
               on_epoch: Callable[[EpochReport], bool] | None = None,
               stepper: Stepper | None = None) -> list[EpochReport]:
    """The epoch loop. `all_reduce` sums a list of floats over the ranks (None when world == 1);
    `on_epoch` returns True to stop and must give every rank the same answer.

    Per epoch: the learning rate config.schedule.rate(epoch, epochs); every training image once,
    in the order np.random.default_rng(config.seed + epoch).permutation(n) (streamed data: the
    dataset's plan; a TokenStream's epoch `epoch` is new windows of its text, data.train_images of
    them), in batches of config.batch_size (the last one short, never dropped), each a step of
    config.micro_batch micro-batches where it is set (Stepper); then the validation set in eval mode. The report's loss is the mean training loss over the epoch's
    images (as each step saw it), and val_loss the same cross-entropy (label smoothing included)
    on the validation images. With several ranks, the number of images that decoded in each global
    batch is summed over the ranks before the step, so the loss is still the global batch's mean
    over the images it really holds. A sequence graph counts sequences as its images, and its loss
    and accuracy are over every position (loss.py). A graph with moe reports each moe node's expert load
    over the epoch's training steps (Stepper.take_expert_load), summed over the ranks. An expert-parallel
    model reports the seconds its all-to-all exchanges took in the epoch's training and evaluation, rank 0's
    figure on rank 0 (each rank reports its own; expert_parallel.ExchangeClock); a data-parallel one the
    seconds its steps waited on the gradient all-reduce, at each step the least of the ranks' waits, the same
    figure on every rank (distributed.AllReduceClock)."""
    device = resolved(device)
    if stepper is None:
        stepper = Stepper(model, device, config,
                          compile=compiles(config.compile, device, trial_steps(data, config), world))
    base = getattr(model, "module", model)
    exchange_clock = base.expert_parallel.clock if getattr(base, "expert_parallel", None) is not None else None
    reduce_clock = getattr(model, "all_reduce_clock", None)  # DDP's (distributed.AllReduceClock)
    # Dropout draws from a generator seeded by config.seed and the rank: a run is reproducible.
    seed = int(np.random.SeedSequence([config.seed, rank]).generate_state(1)[0])
    generator = torch.Generator(device=device).manual_seed(seed)
    train_feed, val_feed = open_feeds(data, config, device, PREDICT_BATCH, rank, world)
    reports: list[EpochReport] = []
    clock = StepClock()
    try:
        with base.dropout_masks(generator):
            for epoch in range(config.epochs):
                stepper.set_lr(config.schedule.rate(epoch, config.epochs))
                base.train()
                loss_sum = torch.zeros((), dtype=torch.float64, device=device)
                images = skipped = 0
                for batch in train_feed.epoch(epoch):
                    skipped += batch.skipped
                    if not train_feed.may_skip:
                        held = batch.size
                    elif all_reduce is None:
                        held = len(batch.y)
                    else:
                        held = int(round(all_reduce([float(len(batch.y))])[0]))
                    if held == 0:  # every image of the global batch was corrupt
                        continue
                    with clock:
                        loss_sum += stepper.step(batch.x, batch.y, held, world, largest_shard=-(-batch.size // world))
                    clock.count(held)
                    images += held
                with clock:  # waits for the queued steps on an asynchronous device
                    train_loss = float(loss_sum)
                    load = stepper.take_expert_load()
                val_loss, correct, val_n, val_skipped = evaluate(model, val_feed, device, config.precision,
                                                                 config.label_smoothing, clock)
                skipped += val_skipped
                if all_reduce is not None:  # images is already global; the rest are this rank's sums
                    counts = [float(c) for loads in (load or {}).values() for c in loads]  # exact below 2^53
                    train_loss, val_loss, correct, val_n, skipped, *counts = all_reduce(
                        [train_loss, val_loss, float(correct), float(val_n), float(skipped), *counts])
                    if load is not None:
                        load = cut_loads(load, counts)
                val_n = int(round(val_n))
                report = EpochReport(
                    epoch=epoch, train_images=images, val_images=val_n, loss=train_loss / max(images, 1),
                    val_loss=val_loss / val_n if val_n else 0.0,
                    val_accuracy=float(round(correct)) / (val_n * base.positions) if val_n else 0.0,
                    skipped_images=int(round(skipped)), step_seconds=clock.lap(),
                    compile_seconds=stepper.take_compile_seconds(),
                    expert_load=load, all_to_all_seconds=exchange_clock.take() if exchange_clock else None,
                    all_reduce_seconds=reduce_clock.take() if reduce_clock else None)
                reports.append(report)
                if on_epoch is not None and on_epoch(report):
                    break
    finally:
        train_feed.close()
        val_feed.close()
    return reports
