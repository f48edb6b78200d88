"""Loss, the training step, the feeds that put batches on the device, and the epoch loop, for one
device or MirroredStrategy over several.

The step's update is TrainConfig.optimizer (the rules beside aiperf_core.backend.OPTIMIZERS; the
NumPy reference is aiperf_core.optim.HostOptimizer), written out in TensorFlow ops:

* "sgd-momentum" with torch.optim.SGD's semantics (``v = m * v + g``; ``w -= lr * v``), not Keras
  SGD's (``v = m * v - lr * g``; ``w += v``): the two differ as soon as the learning rate changes
  between epochs, and every aiperf backend must train the same way.
* "adamw" with torch.optim.AdamW's: decoupled decay ``w *= 1 - lr * weight_decay`` of the matrices
  only (optim.is_decayed: not biases, not layer-norm scales and shifts), bias-corrected moments,
  epsilon added to ``sqrt(v / (1 - b2^t))``. Not Keras' AdamW, which adds epsilon before the second
  moment's bias correction. t counts the updates applied (an fp16 step skipped on overflow is not
  one).

With TrainConfig.grad_clip, every gradient is first scaled by ``min(1, clip / (norm + 1e-6))``, norm
the 2-norm of all the gradients together (torch.nn.utils.clip_grad_norm_), taken after the
all-reduce and after fp16's unscaling: the global batch's gradient is clipped, on any number of
devices. The learning rate is an argument of the traced step, set per epoch; everything else of the
config is a constant of the trace, and each Trainer (one config) traces its own steps.

fp16 trains with dynamic loss scaling (`LossScale`, the rule of torch's GradScaler and Keras'
LossScaleOptimizer): the loss is multiplied by the scale before the backward pass and the
gradients divided by it after (after the all-reduce); a step whose gradients are not all finite
changes nothing (weights, momentum, moving statistics) and halves the scale; after 2,000 finite
steps in a row the scale doubles. bf16 has fp32's exponent range and needs none.

Data parallelism (strategy with several replicas): every global batch of ``config.batch_size``
images (the same order as on one device) is cut into contiguous shards, one per replica
(np.array_split's rule, so the last short batch is shared as evenly as it can be). Each replica's
loss is its shard's summed cross-entropy divided by the *global* batch's labels (its images, or
its sequences times their positions for a language model); the gradients are
all-reduced with SUM, so they are exactly the gradients of the global batch's mean loss. Batch norm
is synchronised (see lowering.py): the step is the same computation as on one device with the
global batch. A global batch with fewer images than replicas (at most the last of an epoch) would
leave a replica an empty shard, which TensorFlow's oneDNN convolutions cannot take (an empty batch
comes back with the input's shape, and the peers' all-reduces abort on mismatched lengths); such a
batch trains whole on the first device in the strategy's cross-replica context instead (gradients
with respect to the first replica's copies, every copy updated): the same computation on the
global batch.

Gradient accumulation (TrainConfig.micro_batch). A device whose part of a global batch (the whole
batch, or its shard under a strategy) is larger than micro_batch runs it as consecutive
micro-batches (aiperf_core.backend.micro_batches) inside the one traced step: each micro-batch's
summed loss is divided by the *global* batch's labels, as a shard's is, so that the gradients summed
over the micro-batches (and then all-reduced, once, over the replicas) are the global batch's, and
the clip, the fp16 unscaling and the update that follow are those of one step on the whole batch,
the uneven last batch of an epoch included. Batch norm normalises each micro-batch by its own
statistics (on each device, not synchronised: the replicas' micro-batches need not line up), and its
moving statistics take one update per micro-batch, in order (under data parallelism, the first
replica's). Validation batches are then at most micro_batch too.

A mixture of experts' load balance. With TrainConfig.moe_aux_loss alpha > 0, the loss whose gradient is
taken adds, for each moe node, alpha times its summed load-balancing loss (lowering.load_balance: the sum
over the pass's sequences of E sum_e f_e P_e) divided by the *global* batch's sequences, as the
cross-entropy's sum is divided by its labels: over shards and micro-batches it adds up to alpha times the
mean over the global batch's sequences. The step's returned loss (EpochReport.loss) stays the
cross-entropy. The assignments each expert received are summed over the micro-batches, all-reduced with
the gradients, and added inside the step to an int64 variable per moe node (`Trainer.expert_counts`), which
the epoch loop reads once an epoch: no host read per step (EpochReport.expert_load).

Activation checkpointing (TrainConfig.checkpoint_blocks): the forward runs each of the graph's
blocks (Graph.blocks) under tf.recompute_grad (lowering.LoweredModel.call), so the backward pass
keeps only a block's input and recomputes its activations; the gradients are those of plain
training. An image graph has no blocks: the flag changes nothing there.

Feeding the device (issue 17). Every batch reaches a step as a `Placed` batch, already on the
training device(s): float32 images (in-memory arrays, already normalised) or uint8 pixels
(streamed and synthetic data, normalised on the device inside the step, lowering.device_input).

* in-memory arrays and the host pipelines (`data.iterate`: generated data, DALI on the CPU, and a
  TokenStream's text, int32 token ids read one global batch at a time, new windows every epoch): each
  batch is copied to the device(s) one batch ahead (`_ahead`), so the copy of batch k+1 is issued
  before step k runs (on a CPU the arrays are passed as they are: there is nothing to copy);
* ImageFolder and TFRecord with the native loader: tf.data decodes and augments to uint8 pixels
  (`tf_input`); on a single GPU it ends in `prefetch_to_device`, so batches arrive on the GPU ahead
  of the step;
* synthetic data (`--data synthetic`): the pool of aiperf_core.data.synthetic is uploaded once per
  device and trial, and each batch is a slice of it on the device: no host work per step.

`EpochReport.compile_seconds` is the wall time of the calls that traced a step or an evaluation
(tf.function tracing, Grappler, and XLA when it compiles), less the typical time of an untraced call
of the same function (its run); `StepClock.count` is called after each training step with the
images of the global batch it trained on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from aiperf_core.backend import (BackendError, Dataset, EpochReport, StepClock, TrainConfig, batches, is_streaming,
                                 is_token_stream)
from aiperf_core.optim import CLIP_EPSILON, is_decayed
from aiperf_backends.tensorflow.backend import framework, graph_function
from aiperf_backends.tensorflow.lowering import make_variable, precision_scope, use_xla

tf = framework()  # configured before any use (backend.py): oneDNN, threads, AIPERF_CPU_DEVICES

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
PREDICT_BATCH = 256


def targets(labels, classes: int, label_smoothing: float):
    y = tf.one_hot(labels, classes, dtype=tf.float32)
    if label_smoothing:
        y = y * (1.0 - label_smoothing) + label_smoothing / classes
    return y


def summed_loss(model, x, labels, label_smoothing: float, training: bool = True, masks=None, **options):
    """(summed categorical cross-entropy of the batch, over every image or every token of every
    sequence, batch-norm updates, output used). `options`: LoweredModel.call's (checkpoint, moving,
    synchronise).

    With a softmax output the loss comes from its logits (a stable log-softmax); otherwise the
    output is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does."""
    out, updates = model.call(x, training, logits=True, masks=masks, **options)
    out = tf.cast(out, tf.float32)
    y = targets(labels, model.graph.output_shape[-1], label_smoothing)
    if model.has_logits:
        total = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=out))
    else:
        clipped = tf.clip_by_value(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP)
        total = -tf.reduce_sum(y * tf.math.log(clipped))
    return total, updates, out


class LossScale:
    """Dynamic loss scaling for fp16 (see the module's docstring); float32 variables, replicated
    like the model's under a strategy."""

    INITIAL = 2.0 ** 15
    GROWTH_INTERVAL = 2000

    def __init__(self):
        self.scale = make_variable(self.INITIAL, "loss_scale", trainable=False)
        self.good_steps = make_variable(0.0, "loss_scale_good_steps", trainable=False)

    def update(self, finite) -> None:
        """After a step: back off on overflow, grow after GROWTH_INTERVAL finite steps in a row."""
        good = tf.where(finite, self.good_steps + 1.0, 0.0)
        grow = good >= self.GROWTH_INTERVAL
        self.scale.assign(tf.where(finite, tf.where(grow, self.scale * 2.0, self.scale), self.scale * 0.5))
        self.good_steps.assign(tf.where(grow, 0.0, good))


@dataclass
class Placed:
    """A global batch ready for a step: x and y on the (first) device, or, when `sharded`, per-replica
    values on each replica's device; n: its images."""

    x: Any
    y: Any
    n: int
    sharded: bool = False


class CompileClock:
    """Seconds spent tracing and compiling (EpochReport.compile_seconds): for each call that traced
    its tf.function anew, its wall time less the median of the untraced calls of the same function
    (what running it takes; nothing is taken off when it never ran untraced). XLA recompiling an
    already traced step for a new batch shape (a short last batch) is not seen: it is counted as a
    step."""

    def __init__(self) -> None:
        self._traced: list[tuple[int, float]] = []  # (function id, seconds) since the last lap
        self._runs: dict[int, list[float]] = {}  # function id -> seconds of untraced calls

    def call(self, fn, *args):
        before = fn.experimental_get_tracing_count()
        start = time.perf_counter()
        out = fn(*args)
        seconds = time.perf_counter() - start
        if fn.experimental_get_tracing_count() != before:
            self._traced.append((id(fn), seconds))
        else:
            self._runs.setdefault(id(fn), []).append(seconds)
        return out

    def lap(self) -> float:
        total = 0.0
        for key, seconds in self._traced:
            runs = self._runs.get(key)
            total += max(seconds - (float(np.median(runs)) if runs else 0.0), 0.0)
        self._traced = []
        return total


class Trainer:
    """The compiled train and eval steps of a model under a strategy (default: one device, the
    model's), and the placement of batches on its device(s)."""

    def __init__(self, model, config: TrainConfig, strategy: tf.distribute.Strategy | None = None):
        from aiperf_backends.tensorflow.backend import tf_device_name

        if not model.trainables:
            raise BackendError("the graph has no trainable parameters: there is nothing to train")
        self.model = model
        self.config = config
        self.strategy = strategy
        self.precision = model.precision
        self.world = strategy.num_replicas_in_sync if strategy is not None else 1
        # Evaluation and the single-device step run where the model's variables (or the first
        # replica's copy) live.
        self.replica_devices = list(strategy.extended.worker_devices) if strategy is not None else \
            [tf_device_name(model.device)]
        self.device = self.replica_devices[0]
        self.on_cpu = all("CPU" in d.upper().rsplit("/", 1)[-1] for d in self.replica_devices)
        self.xla = strategy is None and use_xla(model.device, model.graph)
        self.compiling = CompileClock()
        scope = strategy.scope() if strategy is not None else tf.device(self.device)
        # The optimizer's state, replicated like the model's variables under a strategy. `slots` is
        # SGD's velocity or AdamW's first moment; AdamW adds the second moment and its step count
        # (float32: exact up to 2**24 steps, by which b2**t is long since 0).
        with scope:
            self.slots = [make_variable(tf.zeros(v.shape), f"momentum_{i}", trainable=False)
                          for i, v in enumerate(model.trainables)]
            adamw = config.optimizer == "adamw"
            self.second = [make_variable(tf.zeros(v.shape), f"second_moment_{i}", trainable=False)
                           for i, v in enumerate(model.trainables)] if adamw else []
            self.updates_applied = make_variable(0.0, "optimizer_steps", trainable=False) if adamw else None
            self.loss_scale = LossScale() if self.precision == "fp16" else None
            # Each moe node's assignments per expert since the trainer was made, added to inside the step
            # (int64: an epoch's tokens pass float32's 2^24).
            self.moe_ids = [node.id for node in model.graph.nodes if node.op == "moe"]
            self.expert_counts = [tf.Variable(tf.zeros([model.graph[n].attrs["experts"]], tf.int64), trainable=False,
                                              name=f"expert_load_{i}",
                                              aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                                  for i, n in enumerate(self.moe_ids)]
        # optim.is_decayed's rule, asked of a zero-copy array of each variable's shape (a variable
        # itself would be read to the host).
        self.decayed = [is_decayed(np.broadcast_to(np.float32(0), tuple(v.shape))) for v in model.trainables]
        # By (input dtype, sharded, accumulating) only: the optimizer's fields are fixed for this
        # Trainer's life.
        self._steps: dict[tuple[tf.DType, bool, bool], Any] = {}
        self._evals: dict[tf.DType, Any] = {}

    # -- the traced functions ---------------------------------------------------------------------
    def _gradients(self, x, y, global_n, sources, load: list | None = None, **options):
        """(summed cross-entropy, gradients, moving-statistics updates) of one pass over x: the gradients of
        its summed cross-entropy over the *global* batch's labels plus moe_aux_loss times its summed
        load-balancing losses over the global batch's sequences (times the fp16 loss scale), so that the
        shards' and micro-batches' gradients add up to the global batch's. `load`: where given, each moe
        node's assignments per expert in this pass are appended to it (in moe_ids' order). `options`:
        call's."""
        model, scaling, alpha = self.model, self.loss_scale, float(self.config.moe_aux_loss)
        balance: dict | None = {} if self.moe_ids else None
        with tf.GradientTape() as tape:
            total, updates, _ = summed_loss(model, x, y, float(self.config.label_smoothing), True,
                                            checkpoint=self.config.checkpoint_blocks, balance=balance, **options)
            loss = total / (global_n * model.labels_per_sample)
            if alpha and self.moe_ids:
                loss = loss + alpha * tf.add_n([balance[n][0] for n in self.moe_ids]) / global_n
            if scaling is not None:
                loss = loss * scaling.scale
        grads = tape.gradient(loss, sources)
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, sources)]
        if load is not None:
            load.extend(balance[n][1] for n in self.moe_ids)
        return total, grads, updates

    def _accumulated_gradients(self, x, y, global_n, sources):
        """_gradients of x as consecutive micro-batches of config.micro_batch (aiperf_core.backend.
        micro_batches), summed. x's batch dimension is static (the accumulating step is traced per
        batch shape), so every micro-batch is a slice of static size: the full ones in a
        tf.while_loop that runs one at a time (one micro-batch's activations live at once), the
        short last one after it. Batch norm normalises each micro-batch by its own statistics, also
        under data parallelism (the replicas' micro-batches need not line up), and its moving
        statistics take one update per micro-batch, in order, as a run of micro-batch forwards would."""
        micro, n = int(self.config.micro_batch), int(x.shape[0])
        refs = [v.ref() for v in self.model.moving_variables]

        def pass_over(xk, yk, moving):
            load: list = []
            total, grads, updates = self._gradients(xk, yk, global_n, sources, load, moving=dict(zip(refs, moving)),
                                                    synchronise=False)
            new = {var.ref(): value for var, value in updates}
            return total, grads, [new.get(r, m) for r, m in zip(refs, moving)], load

        def part(t, start, size):
            return tf.slice(t, [start] + [0] * (len(t.shape) - 1), [size] + list(t.shape[1:]))

        full, rest = divmod(n, micro)
        total = tf.zeros([], tf.float32)
        grads = [tf.zeros(v.shape, tf.float32) for v in sources]
        moving = [tf.identity(v) for v in self.model.moving_variables]
        load = [tf.zeros(v.shape, tf.float32) for v in self.expert_counts]
        if full:
            def body(k, total, grads, moving, load):
                t, g, m, c = pass_over(part(x, k * micro, micro), part(y, k * micro, micro), moving)
                return k + 1, total + t, [a + b for a, b in zip(grads, g)], m, [a + b for a, b in zip(load, c)]

            start = (tf.constant(0), total, grads, moving, load)
            _, total, grads, moving, load = tf.while_loop(lambda k, *_: k < full, body, start, parallel_iterations=1)
        if rest:
            with tf.control_dependencies([total]):  # after the loop's micro-batches, not beside them
                t, g, moving, c = pass_over(part(x, full * micro, rest), part(y, full * micro, rest), moving)
            total, grads, load = total + t, [a + b for a, b in zip(grads, g)], [a + b for a, b in zip(load, c)]
        updates = list(zip(self.model.moving_variables, moving))
        return total, grads, updates, load

    def _replica_step(self, x, y, lr, global_n, world: int, accumulate: bool = False):
        """The step of one replica (world: the replicas in sync), or of the whole model on one device
        (world 1: no strategy, or its cross-replica context); `accumulate`: over micro-batches."""
        model, scaling = self.model, self.loss_scale
        # In a strategy's cross-replica context the mirrored variables are read from, and their
        # gradients taken with respect to, the first replica's copies.
        sources = model.trainables if self.strategy is None or world > 1 else \
            [self.strategy.experimental_local_results(v)[0] for v in model.trainables]
        if accumulate:
            total, grads, updates, load = self._accumulated_gradients(x, y, global_n, sources)
        else:
            load = []
            total, grads, updates = self._gradients(x, y, global_n, sources, load)
        if world > 1:  # once a step, after any accumulation; the expert counts travel with the gradients
            reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads + load)
            grads, load = reduced[:len(grads)], reduced[len(grads):]
        for counter, received in zip(self.expert_counts, load):  # the routing ran, whether or not fp16 skips
            counter.assign_add(tf.cast(received, tf.int64))
        if scaling is None:
            self._apply(grads, lr)
            for var, value in updates:
                var.assign(value)
            return total
        # fp16: the same update where every gradient is finite, nothing where one is not. Written
        # with tf.where, not tf.cond: assignments to mirrored variables cannot sit in a branch.
        inverse = 1.0 / scaling.scale
        grads = [g * inverse for g in grads]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        self._apply(grads, lr, finite)
        for var, value in updates:
            var.assign(tf.where(finite, value, var))
        scaling.update(finite)
        return total

    def _apply(self, grads, lr, finite=None) -> None:
        """The optimizer's update of every trainable variable from its (all-reduced, unscaled)
        gradient; with `finite` (fp16), only where it holds: otherwise weights, moments and the step
        count keep their values, as torch's GradScaler skips optimizer.step()."""
        config, model = self.config, self.model

        def kept(new, old):
            return new if finite is None else tf.where(finite, new, old)

        if config.grad_clip is not None:
            # Over the global batch's gradients (after the all-reduce), so that k devices clip as one.
            norm = tf.linalg.global_norm(grads)
            factor = tf.minimum(1.0, float(config.grad_clip) / (norm + CLIP_EPSILON))
            grads = [g * factor for g in grads]
        if config.optimizer == "sgd-momentum":
            momentum = float(config.momentum)
            for var, slot, g in zip(model.trainables, self.slots, grads):
                velocity = kept(momentum * slot + g, slot)
                slot.assign(velocity)
                if finite is None:
                    var.assign_sub(lr * velocity)
                else:
                    var.assign(tf.where(finite, var - lr * velocity, var))
            return
        # AdamW written out: Keras' AdamW adds epsilon to sqrt(v) before the second moment's bias
        # correction (epsilon-hat), not to sqrt(v / (1 - b2^t)) as torch.optim.AdamW does.
        b1, b2 = (float(b) for b in config.betas)
        decay, epsilon = float(config.weight_decay), float(config.adam_epsilon)
        t = self.updates_applied + 1.0
        first_fix, second_fix = 1.0 - tf.pow(b1, t), 1.0 - tf.pow(b2, t)
        for var, m, v, g, decayed in zip(model.trainables, self.slots, self.second, grads, self.decayed):
            w = var * (1.0 - lr * decay) if decay and decayed else var
            first = b1 * m + (1.0 - b1) * g
            second = b2 * v + (1.0 - b2) * tf.square(g)
            m.assign(kept(first, m))
            v.assign(kept(second, v))
            var.assign(kept(w - lr * (first / first_fix) / (tf.sqrt(second / second_fix) + epsilon), var))
        self.updates_applied.assign(kept(t, self.updates_applied))

    def _spec(self, dtype):
        graph = self.model.graph
        return [tf.TensorSpec([None] + list(graph.input_shape), dtype),
                tf.TensorSpec([None] + list(graph.output_shape[:-1]), tf.int64)]  # a label per image or token

    def _step_fn(self, dtype, sharded: bool):
        """The step for batches of `dtype`: over the replicas when `sharded`, else on one device (no
        strategy, or the strategy's cross-replica context for a batch smaller than its replicas)."""
        return self._traced_step(dtype, sharded, accumulate=False)

    def _accumulating_step_fn(self, dtype, sharded: bool):
        """_step_fn's step over micro-batches, traced per batch (shard) shape, for its static
        micro-batches: two traces a trial at most, the full batches' and the short last one's."""
        return self._traced_step(dtype, sharded, accumulate=True)

    def _traced_step(self, dtype, sharded: bool, accumulate: bool):
        key = (dtype, sharded, accumulate)
        if key not in self._steps:
            spec = self._spec(dtype) + [tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32)]
            if not sharded:
                def whole(x, y, lr, global_n):
                    return self._replica_step(x, y, lr, global_n, world=1, accumulate=accumulate)

                self._steps[key] = graph_function(whole, input_signature=None if accumulate else spec,
                                                  jit_compile=self.xla)
            else:
                strategy, world = self.strategy, self.world

                @graph_function(reduce_retracing=not accumulate)
                def distributed(x, y, lr, global_n):
                    per_replica = strategy.run(self._replica_step, args=(x, y, lr, global_n, world, accumulate))
                    return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

                self._steps[key] = distributed
        return self._steps[key]

    def _eval_fn(self, dtype):
        if dtype not in self._evals:
            model, smoothing = self.model, float(self.config.label_smoothing)

            def evaluate(x, y):
                out, _ = model.call(x, False, logits=True)
                out = tf.cast(out, tf.float32)
                t = targets(y, model.graph.output_shape[-1], smoothing)
                if model.has_logits:
                    total = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(labels=t, logits=out))
                else:
                    total = -tf.reduce_sum(t * tf.math.log(tf.clip_by_value(out, PROBABILITY_CLIP, 1 - PROBABILITY_CLIP)))
                correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, axis=-1), y), tf.int64))
                return total, correct

            self._evals[dtype] = graph_function(evaluate, input_signature=self._spec(dtype), jit_compile=self.xla)
        return self._evals[dtype]

    # -- placing batches --------------------------------------------------------------------------
    def put(self, x, y, n: int | None = None) -> Placed:
        """A global batch (NumPy arrays or tensors) on the training device(s): one contiguous shard
        per replica under a strategy. n: its images (default len(y))."""
        n = int(len(y)) if n is None else n
        if self.strategy is None or n < self.world:  # no strategy, or no image for some replica
            return self.put_eval(x, y, n)
        sizes = [len(p) for p in np.array_split(np.arange(n), self.world)]
        bounds = np.cumsum([0] + sizes)

        def shard(values):
            # value_fn runs under each replica's device scope: tf.identity copies the shard there.
            return self.strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.identity(values[bounds[ctx.replica_id_in_sync_group]:
                                               bounds[ctx.replica_id_in_sync_group + 1]]))

        return Placed(shard(x), shard(_labels(y)), n, sharded=True)

    def put_eval(self, x, y, n: int | None = None) -> Placed:
        """A batch on the first device (evaluation, and the single-device step)."""
        n = int(len(y)) if n is None else n
        if self.on_cpu:  # the step reads host memory: nothing to copy
            return Placed(x, _labels(y), n)
        with tf.device(self.device):
            return Placed(tf.identity(x), tf.identity(_labels(y)), n)

    # -- running ----------------------------------------------------------------------------------
    def accumulates(self, batch: Placed) -> bool:
        """Whether a device's part of this global batch is larger than config.micro_batch."""
        micro = self.config.micro_batch
        largest = -(-batch.n // self.world) if batch.sharded else batch.n  # np.array_split's first shard
        return micro is not None and largest > micro

    def step(self, batch: Placed, lr: float):
        """One synchronous optimizer step on a placed global batch; returns its summed loss (a tensor)."""
        accumulate = self.accumulates(batch)
        dtype = _dtype(batch.x, self.strategy if batch.sharded else None)
        fn = (self._accumulating_step_fn if accumulate else self._step_fn)(dtype, batch.sharded)
        with precision_scope(self.precision):
            if batch.sharded:
                return self.compiling.call(fn, batch.x, batch.y, tf.constant(lr, tf.float32),
                                           tf.constant(batch.n, tf.float32))
            # Under a strategy, its scope is the cross-replica context: assignments reach every copy.
            scope = self.strategy.scope() if self.strategy is not None else tf.device(self.device)
            with scope, tf.device(self.device):
                if accumulate:  # no input signature: scalars as tensors, so a new rate is no new trace
                    return self.compiling.call(fn, batch.x, batch.y, tf.constant(lr, tf.float32),
                                               tf.constant(batch.n, tf.float32))
                return self.compiling.call(fn, batch.x, batch.y, np.float32(lr), np.float32(batch.n))

    def read_expert_counts(self) -> list[np.ndarray]:
        """Each moe node's assignments per expert since the trainer was made (one read per node)."""
        return [np.asarray(counter.numpy(), np.int64) for counter in self.expert_counts]

    def evaluate(self, batch: Placed):
        """(summed loss, correct predictions) tensors of a batch placed by put_eval, in inference
        mode, on the first device."""
        fn = self._eval_fn(_dtype(batch.x, None))
        with precision_scope(self.precision), tf.device(self.device):
            return self.compiling.call(fn, batch.x, batch.y)


def _labels(y):
    if isinstance(y, tf.Tensor):
        return y if y.dtype == tf.int64 else tf.cast(y, tf.int64)
    return np.asarray(y, np.int64)


def _dtype(x, strategy) -> tf.DType:
    if strategy is not None and not isinstance(x, (tf.Tensor, np.ndarray)):
        x = strategy.experimental_local_results(x)[0]
    return tf.as_dtype(x.dtype)


# ---------------------------------------------------------------------------
# Feeds: every kind of data as placed batches
# ---------------------------------------------------------------------------


def _ahead(items: Iterable, put: Callable[[Any], Placed | None]) -> Iterator[Placed]:
    """put() each item one ahead of the consumer: the copy of batch k+1 is issued before step k
    runs. put() returns None for an item with no images (every image of it failed to decode)."""
    pending = None
    for item in items:
        placed = put(item)
        if placed is None:
            continue
        if pending is not None:
            yield pending
        pending = placed
    if pending is not None:
        yield pending


class Feed:
    """The training and validation batches of one trial, placed for `trainer`. Validation batches
    hold PREDICT_BATCH samples, or at most TrainConfig.micro_batch where it is set: a device never
    takes more samples through one forward pass than a micro-batch trains on."""

    def __init__(self, trainer: Trainer, data, config: TrainConfig):
        self.trainer, self.data, self.config = trainer, data, config
        self.eval_batch = PREDICT_BATCH if config.micro_batch is None else min(PREDICT_BATCH, config.micro_batch)

    def train(self, epoch: int) -> Iterator[Placed]:
        raise NotImplementedError

    def val(self) -> Iterator[Placed]:
        raise NotImplementedError


class ArrayFeed(Feed):
    """In-memory arrays (a Dataset: float32 images, already normalised, or int64 token ids), in the
    order of np.random.default_rng(seed + epoch)."""

    def __init__(self, trainer, data: Dataset, config):
        super().__init__(trainer, data, config)
        dtype = np.int64 if trainer.model.graph.takes_tokens else np.float32
        self.x_train = np.ascontiguousarray(data.x_train, dtype=dtype)
        self.y_train = np.asarray(data.y_train, dtype=np.int64)
        self.x_val = np.ascontiguousarray(data.x_val, dtype=dtype)
        self.y_val = np.asarray(data.y_val, dtype=np.int64)

    def train(self, epoch):
        rng = np.random.default_rng(self.config.seed + epoch)
        order = batches(len(self.y_train), self.config.batch_size, rng)
        return _ahead(order, lambda idx: self.trainer.put(self.x_train[idx], self.y_train[idx]))

    def val(self):
        order = batches(len(self.y_val), self.eval_batch)
        return _ahead(order, lambda idx: self.trainer.put_eval(self.x_val[idx], self.y_val[idx]))


class HostStreamFeed(Feed):
    """Batches from the shared host pipeline (data.iterate: generated data, DALI on the CPU), and a
    TokenStream's windows (int32 token ids, widened to int64 on the device by the graph's
    token_input): one global batch read at a time, never an epoch's arrays."""

    def train(self, epoch):
        stream = self.data.iterate("train", epoch, self.config.seed, self.config.batch_size)
        return _ahead(stream, lambda b: self.trainer.put(b.x, b.y) if len(b.y) else None)

    def val(self):
        stream = self.data.iterate("val", 0, 0, self.eval_batch)
        return _ahead(stream, lambda b: self.trainer.put_eval(b.x, b.y) if len(b.y) else None)


class TFDataFeed(Feed):
    """ImageFolder and TFRecord through tf.data (tf_input), uint8 pixels; prefetched to the GPU when
    training on one."""

    def _device(self) -> str | None:
        trainer = self.trainer
        return None if trainer.on_cpu or trainer.strategy is not None else trainer.device

    def train(self, epoch):
        ds = tf_input(self.data, "train", epoch, self.config.seed, self.config.batch_size, self._device())
        return _ahead(ds, lambda b: self.trainer.put(b[0], b[1]))

    def val(self):
        ds = tf_input(self.data, "val", 0, 0, self.eval_batch, None if self.trainer.on_cpu else self.trainer.device)
        return _ahead(ds, lambda b: self.trainer.put_eval(b[0], b[1]))


class SyntheticFeed(Feed):
    """--data synthetic: the repeated pool (aiperf_core.data.synthetic.device_pool) uploaded once to
    each device; every batch is a slice of it there (synthetic.windows gives each replica's)."""

    def __init__(self, trainer, data, config):
        from aiperf_core.data import synthetic

        super().__init__(trainer, data, config)
        self.synthetic = synthetic
        pool = synthetic.device_pool(data, max(config.batch_size, PREDICT_BATCH))
        self.pools = []
        for device in trainer.replica_devices:
            with tf.device(device):
                self.pools.append((tf.identity(tf.constant(pool.pixels)), tf.identity(tf.constant(pool.labels))))

    def _slice(self, replica: int, window):
        pixels, labels = self.pools[replica]
        return pixels[window.offset:window.offset + window.length], labels[window.offset:window.offset + window.length]

    def train(self, epoch):
        trainer, world = self.trainer, self.trainer.world
        per_rank = [self.synthetic.windows(self.data, "train", self.config.batch_size, rank, world)
                    for rank in range(world)]
        for windows in zip(*per_rank):
            n = sum(w.length for w in windows)
            if trainer.strategy is None or n < world:  # one device takes the whole batch (see put())
                # The shards are consecutive pool positions from rank 0's, in a pool that repeats.
                whole = type(windows[0])(windows[0].offset, n, windows[0].size)
                with tf.device(trainer.device):
                    x, y = self._slice(0, whole)
                yield Placed(x, y, n)
                continue
            parts = [self._slice(rank, w) for rank, w in enumerate(windows)]
            x = trainer.strategy.experimental_distribute_values_from_function(
                lambda ctx: parts[ctx.replica_id_in_sync_group][0])
            y = trainer.strategy.experimental_distribute_values_from_function(
                lambda ctx: parts[ctx.replica_id_in_sync_group][1])
            yield Placed(x, y, n, sharded=True)

    def val(self):
        for window in self.synthetic.windows(self.data, "val", self.eval_batch):
            with tf.device(self.trainer.device):
                x, y = self._slice(0, window)
            yield Placed(x, y, window.length)


def open_feed(trainer: Trainer, data, config: TrainConfig) -> Feed:
    if not is_streaming(data):
        return ArrayFeed(trainer, data, config)
    from aiperf_core.data import synthetic
    from aiperf_core.data.stream import NATIVE

    if is_token_stream(data):
        return HostStreamFeed(trainer, data, config)
    if synthetic.is_synthetic(data):
        return SyntheticFeed(trainer, data, config)
    if data.source.layout in ("imagefolder", "tfrecord") and getattr(data, "loader", NATIVE) == NATIVE:
        return TFDataFeed(trainer, data, config)
    return HostStreamFeed(trainer, data, config)


# ---------------------------------------------------------------------------
# The epoch loop
# ---------------------------------------------------------------------------


def run_epochs(trainer: Trainer, data, config: TrainConfig,
               on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """Per epoch: the learning rate config.schedule.rate(epoch, epochs); every training image once,
    in batches of config.batch_size (the last one short, never dropped; in-memory arrays in the
    order np.random.default_rng(config.seed + epoch).permutation(n), streams in their plan's
    order); then the validation set in inference mode. The report's loss is the mean training loss
    over the epoch's images (as each step saw it), and val_loss the same cross-entropy (label
    smoothing included) on the validation images; for a sequence output both are means over every
    token, and the accuracy is over every token. Images count sequences. Streamed images that did
    not decode are what did not arrive: the split's count minus the images processed."""
    tf.random.set_seed(config.seed)  # dropout masks: a run is reproducible
    feed = open_feed(trainer, data, config)
    streaming = is_streaming(data)
    reports: list[EpochReport] = []
    clock = StepClock()
    counted = trainer.read_expert_counts()  # the counters run over the trainer's life: an epoch's is a difference
    for epoch in range(config.epochs):
        lr = config.schedule.rate(epoch, config.epochs)
        totals, images = [], 0
        in_flight = None  # (summed loss, images) of the step dispatched before the current one
        for batch in feed.train(epoch):
            with clock:
                total = trainer.step(batch, lr)
                if in_flight is not None:  # at most two steps in flight on an asynchronous device
                    in_flight[0].numpy()
            if in_flight is not None:
                clock.count(in_flight[1])
            in_flight = (total, batch.n)
            totals.append(total)
            images += batch.n
        if in_flight is not None:
            with clock:
                in_flight[0].numpy()
            clock.count(in_flight[1])
        with clock:
            loss_sum = float(np.sum([np.float64(t.numpy()) for t in totals]))
        val_parts, val_n = [], 0
        for batch in feed.val():
            with clock:
                val_parts.append(trainer.evaluate(batch))
            val_n += batch.n
        with clock:  # waits for the evaluation
            val_loss = float(np.sum([np.float64(t.numpy()) for t, _ in val_parts]))
            correct = int(np.sum([int(c.numpy()) for _, c in val_parts]))
        skipped = (data.train_images - images) + (data.val_images - val_n) if streaming else 0
        per = trainer.model.labels_per_sample  # labels per image or sequence
        with clock:
            now = trainer.read_expert_counts()
        expert_load = {node: tuple(int(c) for c in after - before)
                       for node, before, after in zip(trainer.moe_ids, counted, now)} if trainer.moe_ids else None
        counted = now
        report = EpochReport(epoch=epoch, train_images=images, val_images=val_n,
                             loss=loss_sum / max(images * per, 1), val_loss=val_loss / (val_n * per) if val_n else 0.0,
                             val_accuracy=correct / (val_n * per) if val_n else 0.0, skipped_images=skipped,
                             step_seconds=clock.lap(), compile_seconds=trainer.compiling.lap(),
                             expert_load=expert_load)
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports


def train_one_device(model, data, config: TrainConfig, device: str,
                     on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """Train on `device` (a backend device name) without a strategy. A model whose variables live
    elsewhere is trained as a copy on `device`, whose weights are then loaded back."""
    from aiperf_backends.tensorflow.lowering import lower_graph

    work = model if model.device == device else lower_graph(model.graph, model.export_canonical(),
                                                            model.precision, device)
    reports = run_epochs(Trainer(work, config), data, config, on_epoch)
    if work is not model:
        model.load_canonical(work.export_canonical())
    return reports


# ---------------------------------------------------------------------------
# Streamed data (aiperf_core.data.stream.StreamingDataset) through tf.data
# ---------------------------------------------------------------------------

CROP_AREA = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
VAL_CROP_FRACTION = 0.875


def _crop_window(shape, seed):
    """A random-resized-crop window (offset, size) for an image of `shape`, stateless in `seed`."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=CROP_RATIO, area_range=CROP_AREA, max_attempts=10, use_image_if_no_bounding_boxes=True)
    return begin, size


def _pixels(image):
    """A resized float image back to uint8 pixels, rounded to nearest (as Pillow's resize rounds)."""
    return tf.cast(tf.clip_by_value(tf.round(image), 0.0, 255.0), tf.uint8)


def _train_image(encoded, seed, size: int):
    """Decode (only the crop, for JPEGs), random-resized crop, flip: uint8 size x size x 3."""

    def jpeg():
        begin, crop = _crop_window(tf.io.extract_jpeg_shape(encoded), seed)
        return tf.image.decode_and_crop_jpeg(encoded, tf.stack([begin[0], begin[1], crop[0], crop[1]]), channels=3)

    def other():  # PNG, GIF, BMP: decode everything, then crop
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        begin, crop = _crop_window(tf.shape(image), seed)
        return tf.slice(image, begin, crop)

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image = _pixels(tf.image.resize(image, [size, size], method="bilinear", antialias=True))
    return tf.image.stateless_random_flip_left_right(image, seed)


def _val_image(encoded, size: int):
    """Decode, resize the shorter side to size / 0.875, central crop: uint8 size x size x 3."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    short = float(max(round(size / VAL_CROP_FRACTION), size))
    new = tf.maximum(tf.cast(tf.round(hw * short / tf.reduce_min(hw)), tf.int32), size)
    image = tf.image.resize(image, new, method="bilinear", antialias=True)
    top, left = (new[0] - size) // 2, (new[1] - size) // 2
    return _pixels(tf.image.crop_to_bounding_box(image, top, left, size, size))


def tf_input(data, split: str, epoch: int, seed: int, batch_size: int, device: str | None = None) -> tf.data.Dataset:
    """One epoch of a split as a tf.data pipeline of (uint8 NHWC pixels, int64 labels) batches: read
    (natively for ImageFolder files; for TFRecord shards by offset through the source, which checks
    the CRCs), decode and augment with data.workers parallel calls, drop what fails to decode,
    batch, prefetch; with `device` (a TF device name), prefetched onto that device. Augmentation is
    stateless, seeded by (seed, epoch, image index), so it does not depend on thread timing.
    Normalisation is the model's, on the device (lowering.device_input)."""
    from aiperf_core.data.stream import TRAIN

    source = data.source
    plan = data.plan(split, epoch, seed, batch_size)
    order = np.concatenate(plan).astype(np.int64) if plan else np.zeros(0, np.int64)
    labels = np.asarray(source.labels(split))[order].astype(np.int64)
    parallel = max(data.workers, 1)
    # Graph TensorFlow already: AutoGraph would only rewrite their source (graph_function).
    plain = tf.autograph.experimental.do_not_convert
    if source.layout == "imagefolder":
        files = np.asarray(source.files(split))[order]
        ds = tf.data.Dataset.from_tensor_slices((files, order, labels))
        ds = ds.map(plain(lambda f, i, y: (tf.io.read_file(f), i, y)), num_parallel_calls=parallel)
    else:
        def fetch(i):
            return source.encoded(split, int(i))  # raises on a bad checksum: the record is dropped

        ds = tf.data.Dataset.from_tensor_slices((order, labels))
        ds = ds.map(plain(lambda i, y: (tf.py_function(fetch, [i], tf.string), i, y)), num_parallel_calls=parallel)
    size = data.image_size
    epoch_seed = (seed * 1_000_003 + epoch) & 0x7FFFFFFF
    if split == TRAIN:
        def transform(encoded, i, y):
            stateless = tf.stack([tf.constant(epoch_seed, tf.int64), i])
            return _train_image(encoded, stateless, size), y
    else:
        def transform(encoded, i, y):
            return _val_image(encoded, size), y
    ds = ds.map(plain(transform), num_parallel_calls=parallel)
    # A corrupt image fails in read or decode; it is dropped here and counted by the caller.
    ds = ds.ignore_errors().batch(batch_size).prefetch(max(data.prefetch, 1))
    options = tf.data.Options()
    options.deterministic = True
    ds = ds.with_options(options)
    if device is not None:  # must be the last transformation
        ds = ds.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=max(data.prefetch, 1)))
    return ds
