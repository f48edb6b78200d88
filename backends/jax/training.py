"""Loss, the jit-compiled training step, evaluation and the epoch loop.

The step's update is config.optimizer's, as written beside aiperf_core.backend.OPTIMIZERS (and in
NumPy in aiperf_core.optim):

* sgd-momentum: torch.optim.SGD's v = momentum * v + g; w -= lr * v (v starts at zero, so the
  first step is w -= lr * g);
* adamw: torch.optim.AdamW's: w *= 1 - lr * weight_decay on the matrices only (optim.is_decayed),
  bias-corrected first and second moments, epsilon added to the root of the corrected second
  moment (`adamw_update`). Written out in jax.numpy: jax itself has no optimizers, and optax
  (installed only as flax's dependency) folds the decay into the update, -lr * (u + wd * w), which
  is torch's rule only in exact arithmetic;
* config.grad_clip (either optimizer): every gradient scaled by min(1, grad_clip / (norm + 1e-6)),
  norm the 2-norm of all the gradients together, before the update (torch.nn.utils
  .clip_grad_norm_; optax's clip_by_global_norm has no 1e-6). The gradients are those of the
  global batch (see below), so k devices clip exactly what one device would. No precision here
  scales the loss (fp16 is not offered), so the norm is always that of the true gradients.

The learning rate and the step's index (which seeds dropout and counts AdamW's steps) are
traced arguments of the step, so neither a new rate per epoch (config.schedule.rate(epoch,
epochs)) nor a new step recompiles: the step compiles once per batch shape, that is once for the
full batches and once more for a short last batch, per model, precision and update rule (cached on
the model, so the next trial of the same model compiles nothing). `EpochReport.compile_seconds` is
the wall time of the calls that traced and compiled (`Traced`, `CompileClock`).

Every training image is seen once per epoch, in the order np.random.default_rng(seed + epoch)
.permutation(n), in batches of config.batch_size; the last batch is short and not dropped, so
images are counted exactly and each step's loss is exactly the mean over the images it saw. A
sequence graph (token ids (N, S), labels (N, S)) is trained the same way: its loss is the mean
cross-entropy over every position of every sequence, its validation loss and accuracy are over
every position, and EpochReport's image counts count sequences. Streamed text (a TokenStream,
aiperf_core.data.text_stream) cuts its own batches: epoch e is data.iterate(TRAIN, e, config.seed,
...), new windows every epoch, read a batch at a time (never an epoch's arrays), its int32 ids
sent as they are. With
several devices the batch axis is sharded over a 1-D mesh (distributed.py); the code is written
over the global batch, so the gradients and the batch-norm statistics are those of the global
batch whatever the number of devices.

Gradient accumulation (TrainConfig.micro_batch): where a device's shard of a global batch is
larger than micro_batch, the step runs as consecutive micro-batches of it (aiperf_core.backend
.micro_batches), one jitted call each (`make_micro_step`: one executable per global batch shape and
micro-batch length, so a batch of 8 in micro-batches 3, 3, 2 compiles two), whose gradients of
summed loss / the global batch's labels add up on the device; then one jitted update
(`make_update`) clips and updates as the fused step does. The sum is the whole batch's gradient,
so the update is that of one step on the whole batch (to float32 summation order). With several
devices each sums its own micro-batches and the update adds the devices' sums: one all-reduce per
step, not per micro-batch. Batch-norm statistics are per micro-batch (and per device). A shard
that is one micro-batch runs the fused step.

Activation checkpointing (TrainConfig.checkpoint_blocks): the forward pass runs each of
Graph.blocks() under jax.checkpoint (lowering.apply), in the fused and the micro step alike.

A mixture of experts' load balance: the training pass returns each moe node's routing
(lowering.MoeRouting: its per-sequence balance E sum_e f_e P_e and its experts' loads). The loss that
is differentiated adds TrainConfig.moe_aux_loss times the balances summed over the sequences and
divided by the global batch's sequences (`balance_loss`), so a micro-batch or a device's shard adds its
share as its cross-entropy does; the summed loss the step returns, and EpochReport.loss, stay the
cross-entropy. The steps return the loads summed over their micro-batches and devices; the epoch loop
adds them up on the devices (one small jitted add per step) and reads them once, at the epoch's end,
for EpochReport.expert_load (None without a moe node).

Expert parallelism (TrainConfig.expert_parallel on several devices, a graph with moe nodes;
expert_parallel.py): the expert stacks and their optimizer state are placed sharded on E over the
mesh, the steps (fused, micro and update) hold them to that layout, and the moe nodes run their
experts under shard_map, chosen per batch shape when a step traces (split rows: all-to-all; replicated
rows: own experts and a psum; inside the micro step's shard_map: the collectives directly). The epoch
loop counts the all-to-all exchanges its steps ran and, at the epoch's end, prices them with
exchanges of the same shapes timed apart from the steps (expert_parallel.AllToAllTimer):
EpochReport.all_to_all_seconds. The gradient all-reduce of several devices is priced the same way
(all_reduce.AllReduceTimer): EpochReport.all_reduce_seconds. The wall seconds those timings took are
EpochReport.pricing_seconds: communication outside the steps, which the run's ideal-network score gives back.

Feeding the device (issue 17):

* host batches (in-memory arrays, streamed uint8 pixels) are issued to the devices with
  `Placement.put_batch` as soon as the previous step is dispatched, so the copy of batch k+1
  overlaps step k; the loop then waits for step k-1, so at most two steps are in flight (the
  device never idles for the host's dispatch, and the host never runs an epoch ahead);
* synthetic data (a StreamingDataset over aiperf_core.data.synthetic.SyntheticSource) is uploaded
  once, its repeated pool of pixels and their labels, and each batch is a window of them sliced on
  the device: no image crosses from the host per step (`DeviceSynthetic`).
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import Callable, Iterator, Mapping, NamedTuple

import numpy as np

from aiperf_core.backend import (BackendError, Dataset, EpochReport, StepClock, TrainConfig, is_streaming,
                                 is_token_stream, micro_batches)
from aiperf_core.data.stream import TRAIN, VAL, train_batches, val_batches

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
PREDICT_BATCH = 256


def labels_per_sample(graph) -> int:
    """Labels each sample carries: 1 for an image, S for a sequence with a class per position."""
    return int(np.prod(graph.output_shape[:-1], dtype=np.int64))


def summed_loss(graph, params, state, x, labels, label_smoothing, *, precision="fp32", masks=None, key=None,
                checkpoint_blocks: bool = False, expert_parallel=None):
    """(summed cross-entropy over the batch's labels, new BN state, {moe node id: MoeRouting}),
    training mode: one label per image, or one per position of a sequence.

    With a softmax output the loss comes from its logits (stable log-softmax); otherwise the
    output is read as probabilities clipped to [1e-7, 1 - 1e-7], as the reference does.
    expert_parallel: an expert_parallel.ExpertParallel for the moe nodes, or None (lowering.apply)."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import apply

    has_logits = graph[graph.output_id].op == "softmax"
    out, new_state, routing = apply(graph, params, state, x, training=True, logits=has_logits, precision=precision,
                                    masks=masks, key=key, checkpoint_blocks=checkpoint_blocks,
                                    expert_parallel=expert_parallel)
    classes = out.shape[-1]
    target = jax.nn.one_hot(labels, classes, dtype=jnp.float32) * (1.0 - label_smoothing) + label_smoothing / classes
    if has_logits:
        logp = jax.nn.log_softmax(out, axis=-1)
    else:
        logp = jnp.log(jnp.clip(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
    return -jnp.sum(target * logp), new_state, routing


def moe_experts(graph) -> dict[str, int]:
    """{moe node id: its number of experts}: the nodes of EpochReport.expert_load."""
    return {node.id: node.attrs["experts"] for node in graph.nodes if node.op == "moe"}


def balance_loss(routing, moe_aux_loss: float, sequences):
    """TrainConfig.moe_aux_loss's term of the loss that is differentiated: alpha times, summed over the
    moe nodes, their per-sequence balance summed over the batch's sequences (MoeRouting.balance) and
    divided by `sequences`, the global batch's. A micro-batch or a device's shard thus adds its share,
    weighted by its share of the global batch's sequences, as its cross-entropy does. 0 without moe."""
    import jax.numpy as jnp

    if not moe_aux_loss or not routing:
        return 0.0
    return moe_aux_loss * sum(jnp.sum(r.balance) for r in routing.values()) / sequences


def expert_loads(routing) -> dict:
    """{moe node id: (E,) int32 assignments per expert} of a training pass."""
    return {node_id: r.load for node_id, r in routing.items()}


def eval_sums(graph, params, state, x, labels, valid, label_smoothing, precision, expert_mesh=None):
    """(summed loss, correct predictions) over the rows where `valid` is true (every position of
    a sequence row), inference mode; with `expert_mesh` the moe nodes run expert-parallel over it."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import apply

    has_logits = graph[graph.output_id].op == "softmax"
    out, _, _ = apply(graph, params, state, x, training=False, logits=has_logits, precision=precision,
                      expert_parallel=expert_parallel_for(expert_mesh, x.shape[0]))
    classes = out.shape[-1]
    target = jax.nn.one_hot(labels, classes, dtype=jnp.float32) * (1.0 - label_smoothing) + label_smoothing / classes
    if has_logits:
        logp = jax.nn.log_softmax(out, axis=-1)
    else:
        logp = jnp.log(jnp.clip(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
    per = -jnp.sum(target * logp, axis=-1)
    valid = valid.reshape(valid.shape + (1,) * (per.ndim - 1))  # a sequence row's every position
    correct = (jnp.argmax(out, axis=-1) == labels) & valid
    return jnp.sum(jnp.where(valid, per, 0.0)), jnp.sum(correct)


class Traced:
    """jax.jit of `fn` that counts its traces. The Python function runs only while jax traces it,
    so a call that raised `traces` traced and compiled a new executable, and a call that did not
    ran a cached one (compile_seconds, and the test that the step never retraces)."""

    def __init__(self, fn: Callable, **jit_options):
        import jax

        self.traces = 0

        def counted(*args):
            self.traces += 1
            return fn(*args)

        self.jitted = jax.jit(counted, **jit_options)

    def __call__(self, *args):
        return self.jitted(*args)


class CompileClock:
    """Wall seconds of the calls that traced and compiled (EpochReport.compile_seconds). With
    asynchronous dispatch such a call returns once its executable is built and the run enqueued,
    so its wall time is the tracing and compilation."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def call(self, fn: Traced, *args):
        before = fn.traces
        start = time.perf_counter()
        out = fn(*args)
        if fn.traces != before:
            self.seconds += time.perf_counter() - start
        return out

    def lap(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class AdamW(NamedTuple):
    """AdamW's constants, as TrainConfig gives them; they are baked into the compiled step."""

    b1: float
    b2: float
    weight_decay: float
    epsilon: float


def adamw_of(config: TrainConfig) -> AdamW | None:
    if config.optimizer != "adamw":
        return None
    b1, b2 = config.betas
    return AdamW(float(b1), float(b2), float(config.weight_decay), float(config.adam_epsilon))


def expert_parallel_for(expert_mesh, rows: int):
    """The expert_parallel.ExpertParallel of a batch of `rows` on `expert_mesh` (None: not expert-parallel)."""
    if expert_mesh is None:
        return None
    from aiperf_backends.jax.expert_parallel import for_rows

    return for_rows(expert_mesh, rows)


def expert_mesh_key(expert_mesh) -> tuple:
    """What a step bound to `expert_mesh` adds to its cache key: its devices."""
    if expert_mesh is None:
        return ()
    return (("expert_parallel", tuple(str(d) for d in expert_mesh.devices.flat)),)


def step_key(config: TrainConfig, expert_mesh=None) -> tuple:
    """The cache key of the training step: everything baked into its traced code."""
    key = ("train", config.precision, float(config.momentum), float(config.label_smoothing))
    grad_clip = None if config.grad_clip is None else float(config.grad_clip)
    adamw = adamw_of(config)
    if adamw is not None or grad_clip is not None:
        key += (adamw, grad_clip)
    if config.moe_aux_loss:
        key += (("moe_aux_loss", float(config.moe_aux_loss)),)
    key += expert_mesh_key(expert_mesh)
    return key + ("checkpoint_blocks",) if config.checkpoint_blocks else key


def update_key(config: TrainConfig, sharded: bool, expert_mesh=None) -> tuple:
    """The cache key of the update after accumulated micro-batches (`make_update`)."""
    return ("update", float(config.momentum), adamw_of(config),
            None if config.grad_clip is None else float(config.grad_clip), sharded) + expert_mesh_key(expert_mesh)


def micro_step_key(config: TrainConfig, placement, sharded: bool, expert_mesh=None) -> tuple:
    """The cache key of one micro-batch's gradients (`make_micro_step`); a sharded one is bound to
    its devices' mesh."""
    return ("micro", config.precision, float(config.label_smoothing), bool(config.checkpoint_blocks),
            float(config.moe_aux_loss), tuple(placement.names()) if sharded else None) + expert_mesh_key(expert_mesh)


def initial_optimizer_state(params, adamw: AdamW | None):
    """Zeros: the momentum buffers, or AdamW's (first, second) moments."""
    import jax
    import jax.numpy as jnp

    if adamw is None:
        return jax.tree_util.tree_map(jnp.zeros_like, params)
    return jax.tree_util.tree_map(jnp.zeros_like, params), jax.tree_util.tree_map(jnp.zeros_like, params)


def clipped(grads, grad_clip: float):
    import jax
    import jax.numpy as jnp

    from aiperf_core.optim import CLIP_EPSILON

    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(grads)))
    scale = jnp.minimum(1.0, grad_clip / (norm + CLIP_EPSILON))
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), grads)


def bias_correction(beta: float, count):
    """1 - beta^count in float32. As -expm1(count * log(beta)): 1 - beta**count would cancel, and
    with b2 = 0.999 its first step would be off by 1e-5 relatively (torch computes it in float64)."""
    import jax.numpy as jnp

    log_beta = math.log(beta) if beta > 0 else -math.inf
    return -jnp.expm1(count * jnp.float32(log_beta))


def adamw_update(params, grads, moments, lr, count, adamw: AdamW):
    import jax
    import jax.numpy as jnp

    from aiperf_core.optim import is_decayed

    first, second = moments
    b1, b2 = adamw.b1, adamw.b2
    first = jax.tree_util.tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, first, grads)
    second = jax.tree_util.tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), second, grads)
    first_fix, second_fix = bias_correction(b1, count), bias_correction(b2, count)

    def update(w, m, v):
        if adamw.weight_decay and is_decayed(w):
            w = w * (1.0 - lr * adamw.weight_decay)
        return w - lr * (m / first_fix) / (jnp.sqrt(v / second_fix) + adamw.epsilon)

    return jax.tree_util.tree_map(update, params, first, second), (first, second)


def optimizer_update(params, slots, grads, lr, index, momentum: float, adamw: AdamW | None,
                     grad_clip: float | None):
    """(params, optimizer state) after one update by the global batch's gradients `grads`."""
    import jax
    import jax.numpy as jnp

    if grad_clip is not None:
        grads = clipped(grads, grad_clip)
    if adamw is not None:
        return adamw_update(params, grads, slots, lr, index.astype(jnp.float32) + 1.0, adamw)
    velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, slots, grads)
    return jax.tree_util.tree_map(lambda w, v: w - lr * v, params, velocity), velocity


def make_train_step(graph, precision: str, momentum: float, label_smoothing: float,
                    adamw: AdamW | None = None, grad_clip: float | None = None,
                    checkpoint_blocks: bool = False, moe_aux_loss: float = 0.0, expert_mesh=None) -> Traced:
    """The jitted step (params, state, optimizer state, x, labels, lr, key, step index) -> (params,
    state, optimizer state, summed cross-entropy, {moe node id: (E,) int32 expert loads}): the gradient
    is that of the mean cross-entropy plus moe_aux_loss's load-balancing term (`balance_loss`). SGD with
    momentum (the state: the momentum buffers), or AdamW when `adamw` is given (the state: its two
    moments), with the gradients clipped to `grad_clip` when given. x is a float32 (normalised) or
    uint8 (pixels) batch; dropout draws from fold_in(key, step index), and AdamW's bias correction
    counts step index + 1 steps (the index counts the steps since the state was zero). params and the
    optimizer state are donated: the update happens in place where the device allows.
    checkpoint_blocks: the forward pass recomputes each of the graph's blocks in the backward one
    (lowering.apply). expert_mesh: the moe nodes run expert-parallel over it (expert_parallel.py), their
    tokens sharded or replicated as the batch is, and the parameters and optimizer state keep their
    layout (the expert stacks sharded on E)."""
    import jax

    def step(params, state, slots, x, labels, lr, key, index):
        parallel = expert_parallel_for(expert_mesh, x.shape[0])

        def loss_fn(p):
            total, new_state, routing = summed_loss(graph, p, state, x, labels, label_smoothing, precision=precision,
                                                    key=jax.random.fold_in(key, index),
                                                    checkpoint_blocks=checkpoint_blocks, expert_parallel=parallel)
            loss = total / labels.size + balance_loss(routing, moe_aux_loss, labels.shape[0])
            return loss, (total, new_state, expert_loads(routing))

        grads, (total, new_state, loads) = jax.grad(loss_fn, has_aux=True)(params)
        params, slots = optimizer_update(params, slots, grads, lr, index, momentum, adamw, grad_clip)
        params, slots = kept_in_layout(graph, params, slots, expert_mesh)
        return params, new_state, slots, total, loads

    return Traced(step, donate_argnums=(0, 2))


# -- gradient accumulation (TrainConfig.micro_batch) ----------------------------------------------


def batch_norm_nodes(graph) -> tuple[str, ...]:
    return tuple(n.id for n in graph.nodes if n.op == "batch_norm")


def kept_in_layout(graph, params, slots, expert_mesh):
    """params and optimizer state held to their layout (`expert_parallel.param_shardings`) where the step
    is expert-parallel, so that the expert stacks stay sharded on E from step to step; as they are else."""
    if expert_mesh is None:
        return params, slots
    import jax

    from aiperf_backends.jax.expert_parallel import param_shardings

    shardings = param_shardings(graph, params, expert_mesh)
    slot_shardings = shardings if not isinstance(slots, tuple) else tuple(shardings for _ in slots)
    return (jax.lax.with_sharding_constraint(params, shardings),
            jax.lax.with_sharding_constraint(slots, slot_shardings))


def make_micro_step(graph, precision: str, label_smoothing: float, checkpoint_blocks: bool,
                    mesh=None, moe_aux_loss: float = 0.0, expert_mesh=None) -> Traced:
    """One micro-batch's share of a step: (params, state, accumulator, x, labels, start, length,
    divisor, key, index, micro index, first) -> (accumulator, state).

    x and labels are the whole global batch on the devices; the micro-batch is rows [start, start +
    length) of each device's shard of it, sliced on the device (`length` is static: one executable
    per global batch shape and micro-batch length, whatever the start). Its gradient is that of its
    summed loss / `divisor`, the global batch's number of labels: its mean loss weighted by its
    share of the global batch's samples, so that the micro-batches' gradients add up to the whole
    batch's; moe_aux_loss's term is weighted likewise, by the micro-batch's share of the global batch's
    sequences (divisor / labels per sequence). The accumulator is {'grads', 'loss', 'load'} (`load`: the
    expert loads, {moe node id: (E,) int32}); `first` starts it afresh (a select, so that
    whatever the buffer held, even a NaN, is discarded), and it is donated: the sum is kept in place.

    With a mesh (several devices, the batch sharded) the body runs per device under shard_map, on
    the device's own rows, and the accumulator has a leading device axis, sharded: each device sums
    its own micro-batches' gradients and nothing crosses between devices until `make_update` adds
    the devices' sums, one all-reduce per step. The parameters enter the body as device-varying
    (lax.pcast), so that autodiff does not reduce their gradients over devices per micro-batch.
    Batch-norm statistics are then per device micro-batch; the new moving statistics are averaged
    over the devices to stay replicated.

    expert_mesh (expert parallelism, expert_parallel.py): the expert stacks enter sharded on E (each
    device its own experts) and their accumulated gradients stay so, without a device axis: a device's
    experts' gradient is already summed over every device's tokens by the reverse all-to-all. Under
    a mesh the moe nodes call the collectives directly (MANUAL); without one (a replicated batch) they
    run REPLICATED."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    positions = labels_per_sample(graph)

    def gradients(params, state, x, labels, divisor, key, parallel):
        def loss_fn(p):
            total, new_state, routing = summed_loss(graph, p, state, x, labels, label_smoothing, precision=precision,
                                                    key=key, checkpoint_blocks=checkpoint_blocks,
                                                    expert_parallel=parallel)
            loss = total / divisor + balance_loss(routing, moe_aux_loss, divisor / positions)
            return loss, (total, new_state, expert_loads(routing))

        grads, (total, new_state, loads) = jax.grad(loss_fn, has_aux=True)(params)
        return {"grads": grads, "loss": total, "load": loads}, new_state

    def accumulated(acc, sums, first):
        def add(a, g):
            g = g[None] if a.ndim == g.ndim + 1 else g  # a per-device sum (leading device axis) of a local value
            return jnp.where(first, g, a + g)

        return jax.tree_util.tree_map(add, acc, sums)

    if mesh is None:  # one device, or a replicated batch: under expert parallelism, each device its own experts
        from aiperf_backends.jax.expert_parallel import REPLICATED, ExpertParallel

        replicated_experts = ExpertParallel(expert_mesh, REPLICATED) if expert_mesh is not None else None

        def micro(params, state, acc, x, labels, start, length, divisor, key, index, micro_index, first):
            xs, ys = (lax.dynamic_slice_in_dim(a, start, length) for a in (x, labels))
            key = jax.random.fold_in(jax.random.fold_in(key, index), micro_index)
            sums, new_state = gradients(params, state, xs, ys, divisor, key, replicated_experts)
            return accumulated(acc, sums, first), new_state

        return Traced(micro, static_argnums=(6,), donate_argnums=(2,))

    from jax.sharding import PartitionSpec as P

    from aiperf_backends.jax.distributed import AXIS
    from aiperf_backends.jax.expert_parallel import MANUAL, ExpertParallel, param_specs

    normalised = batch_norm_nodes(graph)
    parallel = ExpertParallel(mesh, MANUAL) if expert_mesh is not None else None

    def micro(params, state, acc, x, labels, start, length, divisor, key, index, micro_index, first):
        specs = param_specs(graph, params) if parallel is not None else jax.tree_util.tree_map(lambda _: P(), params)

        def local(params, state, acc, x, labels, start, divisor, key, index, micro_index, first):
            xs, ys = (lax.dynamic_slice_in_dim(a, start, length) for a in (x, labels))
            key = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, index), micro_index),
                                     lax.axis_index(AXIS))
            # replicated parameters made device-varying, so that autodiff does not all-reduce their
            # gradients per micro-batch; the expert stacks (P(AXIS)) vary already
            varying = jax.tree_util.tree_map(lambda value, spec: value if spec == P(AXIS)
                                             else lax.pcast(value, AXIS, to="varying"), params, specs)
            sums, new_state = gradients(varying, state, xs, ys, divisor, key, parallel)
            new_state = {n: lax.pmean(new_state[n], AXIS) if n in normalised else state[n] for n in state}
            return accumulated(acc, sums, first), new_state

        sharded, replicated = P(AXIS), P()
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(specs, replicated, sharded, sharded, sharded) + (replicated,) * 6,
                             out_specs=(sharded, replicated))(params, state, acc, x, labels, start, divisor, key,
                                                              index, micro_index, first)

    return Traced(micro, static_argnums=(6,), donate_argnums=(2,))


def make_update(momentum: float, adamw: AdamW | None, grad_clip: float | None, sharded: bool,
                graph=None, expert_mesh=None) -> Traced:
    """(params, optimizer state, accumulator, lr, index) -> (params, optimizer state, summed loss, expert
    loads): the step's update from the accumulated gradients, exactly as one step on the whole batch
    (`optimizer_update`: the clip on the global norm, then SGD or AdamW). A sharded accumulator
    (one sum per device) is added over its device axis first: XLA's one all-reduce of the step. Expert
    stacks accumulated sharded on E (expert parallelism: `graph` and its `expert_mesh`) have no device
    axis and are taken as they are; params and optimizer state keep their layout."""
    import jax
    import jax.numpy as jnp

    def update(params, slots, acc, lr, index):
        if sharded:
            grads = jax.tree_util.tree_map(lambda p, sums: jnp.sum(sums, axis=0) if sums.ndim == p.ndim + 1 else sums,
                                           params, acc["grads"])
            acc = {"grads": grads, "loss": jnp.sum(acc["loss"], axis=0),
                   "load": jax.tree_util.tree_map(lambda sums: jnp.sum(sums, axis=0), acc["load"])}
        params, slots = optimizer_update(params, slots, acc["grads"], lr, index, momentum, adamw, grad_clip)
        params, slots = kept_in_layout(graph, params, slots, expert_mesh)
        return params, slots, acc["loss"], acc["load"]

    return Traced(update, donate_argnums=(0, 1))


def zero_accumulator(placement, params, sharded: bool, experts: Mapping[str, int] | None = None,
                     expert_shardings=None):
    """A micro step's accumulator made on the devices: the gradients' shapes (with a leading device
    axis, sharded, when `sharded`), the loss, and the expert loads of the moe nodes `experts`
    ({node id: experts}, `moe_experts`). With `expert_shardings` (expert parallelism: the parameters'
    layout, `expert_parallel.param_shardings`) an expert stack's gradients are laid out as the stack
    itself, sharded on E, without a device axis."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    if sharded:
        lead, sharding = (placement.world,), placement.batch_sharding(placement.world)
    else:
        lead, sharding = (), placement.replicated

    def zeros(leaf, layout=None):
        if layout is not None and layout.spec != P():
            return jnp.zeros(leaf.shape, leaf.dtype, device=layout)
        return jnp.zeros(lead + leaf.shape, leaf.dtype, device=sharding)

    if expert_shardings is None:
        grads = jax.tree_util.tree_map(zeros, params)
    else:
        grads = jax.tree_util.tree_map(zeros, params, expert_shardings)
    load = {node_id: jnp.zeros(lead + (count,), jnp.int32, device=sharding)
            for node_id, count in (experts or {}).items()}
    return {"grads": grads, "loss": jnp.zeros(lead, jnp.float32, device=sharding), "load": load}


def predict_fn(model) -> Traced:
    from aiperf_backends.jax.lowering import apply

    key = ("predict",)
    if key not in model.cache:
        graph, precision = model.graph, model.precision
        model.cache[key] = Traced(lambda p, s, x: apply(graph, p, s, x, training=False, precision=precision)[0])
    return model.cache[key]


def eval_fn(model, label_smoothing: float, expert_mesh=None) -> Traced:
    key = ("eval", float(label_smoothing)) + expert_mesh_key(expert_mesh)
    if key not in model.cache:
        model.cache[key] = Traced(partial(eval_sums, model.graph, label_smoothing=float(label_smoothing),
                                          precision=model.precision, expert_mesh=expert_mesh))
    return model.cache[key]


def bucket(n: int, cap: int = PREDICT_BATCH) -> int:
    """Padded batch size for inference: the next power of two up to `cap` (few compiled shapes)."""
    size = 1
    while size < n:
        size *= 2
    return min(size, cap)


def padded(array: np.ndarray, size: int) -> np.ndarray:
    """`array` with zero rows appended up to `size` rows, in its own dtype."""
    out = np.zeros((size,) + array.shape[1:], array.dtype)
    out[:len(array)] = array
    return out


def predict(model, x: np.ndarray) -> np.ndarray:
    """Inference in chunks padded to a power of two, on the model's devices; each image's output
    does not depend on the others in inference mode, so the padding rows are simply dropped."""
    from aiperf_backends.jax.lowering import host_input

    x = host_input(model.graph, x)
    fn = predict_fn(model)
    outputs = []
    for start in range(0, len(x), PREDICT_BATCH):
        chunk = x[start:start + PREDICT_BATCH]
        (xb,) = model.placement.put_batch(padded(chunk, bucket(len(chunk))))
        outputs.append(fn(model.params, model.state, xb)[:len(chunk)])
    return np.ascontiguousarray(np.concatenate([np.asarray(o, np.float32) for o in outputs]), dtype=np.float32)


# -- feeding the devices --------------------------------------------------------------------------


class HostFeed:
    """Batches read on the host and issued to the devices one at a time, as they are: uint8 pixels
    from a stream (normalised in the step), float32 from in-memory arrays (normalised already)."""

    def __init__(self, data, placement):
        self.data, self.placement = data, placement
        self.tokens = is_token_stream(data)

    def train(self, epoch: int, seed: int, batch_size: int, clock: StepClock) -> Iterator[tuple]:
        """(x, y on the devices, images, skipped) per global batch; a batch of undecodable images
        only (x None) still reports what it skipped."""
        for batch in train_batches(self.data, epoch, seed, batch_size):
            if not len(batch.y):
                yield None, None, 0, batch.skipped
                continue
            x, y = batch.x, np.asarray(batch.y, np.int32)
            if self.tokens:  # ids below the vocab: int32 is exact, and what jax without x64 takes
                x = np.ascontiguousarray(x, np.int32)
            with clock:  # the copy is issued here, while the devices run the previous step
                xb, yb = self.placement.put_batch(x, y)
            yield xb, yb, len(y), batch.skipped

    def val(self, clock: StepClock) -> Iterator[tuple]:
        """(x, y, valid on the devices, images, skipped) per batch, padded to a few shapes."""
        for batch in val_batches(self.data, PREDICT_BATCH):
            n = len(batch.y)
            if not n:
                yield None, None, None, 0, batch.skipped
                continue
            size = bucket(n)
            x, y = padded(batch.x, size), padded(np.asarray(batch.y, np.int32), size)
            with clock:
                xb, yb, valid = self.placement.put_batch(x, y, np.arange(size) < n)
            yield xb, yb, valid, n, batch.skipped


SLICERS: dict = {}  # DeviceSynthetic's jitted window slicers, by output sharding


class DeviceSynthetic:
    """Synthetic data made once on the devices (aiperf_core.data.synthetic's device contract): the
    repeated pool of pixels and its labels are uploaded when training starts, and every batch is a
    window of them, sliced on the device (one offset crosses per step, never an image). The
    windows are exactly the batches the host stream would deliver (tested)."""

    def __init__(self, data, placement, compiling: CompileClock, batch_size: int):
        from aiperf_core.data.synthetic import device_pool

        pool = device_pool(data, max(batch_size, PREDICT_BATCH))
        self.data, self.placement, self.compiling = data, placement, compiling
        self.pixels, self.labels = placement.replicate((pool.pixels, pool.labels.astype(np.int32)))

    @staticmethod
    def applies(data) -> bool:
        from aiperf_core.data.synthetic import is_synthetic

        return is_streaming(data) and is_synthetic(data)

    def _window(self, offset: int, rows: int):
        """pixels and labels [offset, offset + rows) on the devices, laid out as a batch of `rows`."""
        from jax import lax

        sharding = self.placement.batch_sharding(rows)
        if sharding not in SLICERS:  # one slicer per layout, for every trial; it compiles once per window length
            SLICERS[sharding] = Traced(
                lambda pixels, labels, start, length: (lax.dynamic_slice_in_dim(pixels, start, length),
                                                       lax.dynamic_slice_in_dim(labels, start, length)),
                static_argnums=(3,), out_shardings=sharding)
        return self.compiling.call(SLICERS[sharding], self.pixels, self.labels, np.int32(offset), rows)

    def train(self, epoch: int, seed: int, batch_size: int, clock: StepClock) -> Iterator[tuple]:
        from aiperf_core.data.synthetic import windows

        for window in windows(self.data, TRAIN, batch_size):
            with clock:
                xb, yb = self._window(window.offset, window.length)
            yield xb, yb, window.length, 0

    def val(self, clock: StepClock) -> Iterator[tuple]:
        from aiperf_core.data.synthetic import windows

        for window in windows(self.data, VAL, PREDICT_BATCH):
            size = bucket(window.length)  # the pool repeats, so a padded window is still in it
            with clock:
                xb, yb = self._window(window.offset, size)
                (valid,) = self.placement.put_batch(np.arange(size) < window.length)
            yield xb, yb, valid, window.length, 0


def feed_for(data, placement, compiling: CompileClock, batch_size: int):
    if DeviceSynthetic.applies(data):
        return DeviceSynthetic(data, placement, compiling, batch_size)
    return HostFeed(data, placement)


# -- the epoch loop -------------------------------------------------------------------------------


def run_epochs(model, data: Dataset, config: TrainConfig, placement,
               on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """The epoch loop on `placement` (distributed.Placement); the trained parameters and BN
    statistics are stored back into `model`, which then lives on `placement`. `data` is in-memory
    arrays or a StreamingDataset (aiperf_core.data.stream). A placement across nodes: every node runs
    this loop on the same data and config, each giving its own devices' rows of every batch; on_epoch
    (the leader's) decides for all (distributed.agreed_stop); the trained weights are gathered, and
    the model then lives on this node's devices."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.distributed import Placement, agreed_stop
    from aiperf_backends.jax.lowering import host_input

    if not model.params:
        raise BackendError("the graph has no trainable parameters: there is nothing to train")
    experts = moe_experts(model.graph)
    # Expert parallelism (expert_parallel.py): Backend.train has checked that the experts divide by the devices.
    expert_mesh = placement.mesh if config.expert_parallel and placement.world > 1 and experts else None
    key = step_key(config, expert_mesh)
    adamw = adamw_of(config)
    grad_clip = None if config.grad_clip is None else float(config.grad_clip)
    if key not in model.cache:
        model.cache[key] = make_train_step(model.graph, config.precision, float(config.momentum),
                                           float(config.label_smoothing), adamw, grad_clip,
                                           bool(config.checkpoint_blocks), float(config.moe_aux_loss), expert_mesh)
    step = model.cache[key]
    evaluate = eval_fn(model, config.label_smoothing, expert_mesh)
    if expert_mesh is None:
        place, shardings, exchanges_run = placement.replicate, None, None
    else:
        from aiperf_backends.jax.expert_parallel import AllToAllTimer, exchanges, param_shardings

        shardings = param_shardings(model.graph, model.params, expert_mesh)
        place = partial(placement.put, shardings=shardings)  # the expert stacks sharded on E, the rest replicated
        exchanges_run = AllToAllTimer(expert_mesh, tuple(placement.names()))
    reduces_run = None  # the gradient all-reduce, priced apart from the steps (all_reduce.py)
    if placement.world > 1:
        from aiperf_backends.jax.all_reduce import AllReduceTimer
        from aiperf_opcount.communication import GRADIENT_ELEMENT_BYTES, gradient_bytes

        reduces_run = AllReduceTimer(placement.mesh, tuple(placement.names()),
                                     gradient_bytes(model.graph, expert_mesh is not None) // GRADIENT_ELEMENT_BYTES)
    # Copies first: the step donates params and its optimizer state, and the model keeps its own
    # until the end.
    params = place(jax.tree_util.tree_map(jnp.array, model.params))
    state = placement.replicate(model.state)
    slots = initial_optimizer_state(params, adamw)
    slots = tuple(place(s) for s in slots) if isinstance(slots, tuple) else place(slots)
    if not is_streaming(data):  # convert once, not per batch
        data = Dataset(host_input(model.graph, np.asarray(data.x_train)), np.asarray(data.y_train, np.int32),
                       host_input(model.graph, np.asarray(data.x_val)), data.y_val, data.classes)
    positions = labels_per_sample(model.graph)
    clock, compiling = StepClock(), CompileClock()
    feed = feed_for(data, placement, compiling, config.batch_size)
    rng_key = placement.replicate(jax.random.PRNGKey(config.seed))
    accumulator: dict = {"value": None, "sharded": None}
    if experts and ("add_loads",) not in model.cache:  # the epoch's expert loads, summed on the devices
        model.cache[("add_loads",)] = Traced(lambda total, load: jax.tree_util.tree_map(jnp.add, total, load))

    def accumulated_step(params, state, slots, xb, yb, n, lr, index):
        """One step as consecutive micro-batches of each device's shard (TrainConfig.micro_batch),
        or the fused step where the shard is one micro-batch."""
        sharded = placement.splits(n)
        spans = micro_batches(n // placement.world if sharded else n, config.micro_batch)
        if reduces_run is not None and sharded:  # a replicated batch's gradients are whole on every device
            reduces_run.add()
        if exchanges_run is not None and sharded:  # a replicated batch's experts exchange nothing (psum)
            for start, stop in spans:
                exchanges_run.add(exchanges(model.graph, stop - start, placement.world, config.precision, True,
                                            bool(config.checkpoint_blocks)))
        if len(spans) == 1:
            return compiling.call(step, params, state, slots, xb, yb, lr, rng_key, index)
        micro_key = micro_step_key(config, placement, sharded, expert_mesh)
        update_key_ = update_key(config, sharded, expert_mesh)
        if micro_key not in model.cache:
            model.cache[micro_key] = make_micro_step(model.graph, config.precision, float(config.label_smoothing),
                                                     bool(config.checkpoint_blocks),
                                                     placement.mesh if sharded else None, float(config.moe_aux_loss),
                                                     expert_mesh)
        if update_key_ not in model.cache:
            model.cache[update_key_] = make_update(float(config.momentum), adamw, grad_clip, sharded, model.graph,
                                                   expert_mesh)
        if accumulator["sharded"] is not sharded:
            accumulator["value"] = None  # one at a time: a short last batch may be laid out otherwise
            accumulator.update(value=zero_accumulator(placement, params, sharded, experts, shardings), sharded=sharded)
        acc, divisor = accumulator["value"], np.float32(n * positions)
        for k, (start, stop) in enumerate(spans):
            acc, state = compiling.call(model.cache[micro_key], params, state, acc, xb, yb, np.int32(start),
                                        stop - start, divisor, rng_key, index, np.int32(k), np.bool_(k == 0))
        accumulator["value"] = acc
        params, slots, total, load = compiling.call(model.cache[update_key_], params, slots, acc, lr, index)
        return params, state, slots, total, load

    reports: list[EpochReport] = []
    step_index = 0
    try:
        for epoch in range(config.epochs):
            lr = np.float32(config.schedule.rate(epoch, config.epochs))
            totals = []
            # Summed on the devices and read once, at the epoch's end: no host wait per step.
            epoch_load = placement.replicate({node_id: np.zeros(count, np.int32) for node_id, count in experts.items()})
            in_flight = None  # (summed loss, images) of the step dispatched before the current one
            images = skipped = 0
            # Advancing the feed issues batch k+1 to the devices right after step k is dispatched.
            for xb, yb, n, batch_skipped in feed.train(epoch, config.seed, config.batch_size, clock):
                skipped += batch_skipped
                if not n:
                    continue
                with clock:
                    params, state, slots, total, load = accumulated_step(params, state, slots, xb, yb, n, lr,
                                                                         np.int32(step_index))
                    if experts:
                        epoch_load = compiling.call(model.cache[("add_loads",)], epoch_load, load)
                    if in_flight is not None:
                        in_flight[0].block_until_ready()
                if in_flight is not None:
                    clock.count(in_flight[1])
                in_flight = (total, n)
                totals.append(total)
                step_index += 1
                images += n
            if in_flight is not None:
                with clock:
                    in_flight[0].block_until_ready()
                clock.count(in_flight[1])
            with clock:
                loss_sum = float(np.sum([np.float64(t) for t in totals]))
                expert_load = {node_id: tuple(int(c) for c in counts)
                               for node_id, counts in placement.to_host(epoch_load).items()} if experts else None
            val_parts, val_total = [], 0
            for xb, yb, valid, n, batch_skipped in feed.val(clock):
                skipped += batch_skipped
                if n:
                    with clock:
                        val_parts.append(compiling.call(evaluate, params, state, xb, yb, valid))
                    val_total += n
                    if exchanges_run is not None and placement.splits(len(yb)):
                        exchanges_run.add(exchanges(model.graph, len(yb) // placement.world, placement.world,
                                                    config.precision, False))
            with clock:  # waits for the evaluation
                val_loss = float(np.sum([np.float64(s) for s, _ in val_parts]))
                correct = int(np.sum([int(c) for _, c in val_parts]))
            # Measured apart from the steps, now that none runs (expert_parallel.AllToAllTimer).
            all_to_all = exchanges_run.lap() if exchanges_run is not None else None
            all_reduce = reduces_run.lap() if reduces_run is not None else None
            pricing = [timer.priced_in for timer, figure in ((exchanges_run, all_to_all), (reduces_run, all_reduce))
                       if figure is not None]
            report = EpochReport(epoch=epoch, train_images=images, val_images=val_total,
                                 loss=loss_sum / max(images * positions, 1),
                                 val_loss=val_loss / (val_total * positions) if val_total else 0.0,
                                 val_accuracy=correct / (val_total * positions) if val_total else 0.0,
                                 skipped_images=skipped, step_seconds=clock.lap(),
                                 compile_seconds=compiling.lap(), expert_load=expert_load,
                                 all_to_all_seconds=all_to_all, all_reduce_seconds=all_reduce,
                                 pricing_seconds=sum(pricing) if pricing else None)
            reports.append(report)
            if agreed_stop(placement, on_epoch, report):
                break
    except BaseException:
        if not placement.spans_processes:
            model.params, model.state, model.placement = params, state, placement
        raise  # across nodes the model keeps its starting weights: a gather now could wait on a peer that left
    if placement.spans_processes:  # whole on every node again, on this node's devices (a collective)
        params, state = placement.to_host((params, state))
        placement = Placement(placement.devices[placement.own[0]:placement.own[1]])
        params, state = placement.replicate((params, state))
    model.params, model.state, model.placement = params, state, placement
    return reports
