"""Loss, one training step and the epoch loop, shared by the single-process and the data-parallel
path.

The step is config.optimizer, by the rules written beside aiperf_core.backend.OPTIMIZERS:

* "sgd-momentum" is MindSpore's nn.Momentum: v = momentum * v + g; w -= lr * v (v starts at zero),
  the same rule as torch.optim.SGD.
* "adamw" is torch.optim.AdamW's arithmetic written out in MindSpore ops (`AdamW` below): the
  decoupled decay w *= 1 - lr * weight_decay on matrices only (aiperf_core.optim.is_decayed), then
  bias-corrected moments, epsilon added to the root of the corrected second moment. MindSpore's
  own AdamWs do not fit: nn.AdamWeightDecay has no bias correction, nn.Adam adds epsilon to the
  uncorrected root (and its decay is an L2 term in the gradient), mint.optim.AdamW runs on Ascend
  only, and mindspore.experimental.optim.AdamW, whose arithmetic is right, compiles its update
  with ms.jit, a graph build inside the first step of a backend that runs PyNative and reports no
  compile time on CPUs (below).
* config.grad_clip (either optimizer) scales every gradient by min(1, grad_clip / (norm + 1e-6)),
  norm the 2-norm of all trainable gradients together (torch.nn.utils.clip_grad_norm_; MindSpore's
  ops.clip_by_global_norm divides by max(norm, clip) instead), after the gradients are all-reduced
  and unscaled, so that the clip sees the global batch's true gradient.

The learning rate is set to config.schedule.rate(epoch, epochs) at the start of each epoch: the
optimizer's learning-rate parameter for nn.Momentum, the float AdamW reads each step.

Every training image is seen once per epoch, in the order np.random.default_rng(seed + epoch)
.permutation(n), in batches of config.batch_size (aiperf_core.data.stream.train_batches, which
also streams datasets that do not fit in memory, and a TokenStream's new windows of each epoch);
the last batch is short and never dropped, so images are counted exactly. With data parallelism
(distributed.py) every rank draws the same order, cuts the same global batches and takes its own
contiguous shard of each; a rank's loss is its shard's summed cross-entropy scaled by world /
global batch, and the gradient reducer averages over the ranks, so the gradients are exactly
those of the global batch's mean loss.

Gradient accumulation (config.micro_batch): a global batch is cut into consecutive micro-batches
of micro_batch * world samples (aiperf_core.backend.micro_batches), each sharded over the ranks as
a global batch is, so that no device takes more than micro_batch samples through one pass and
every rank runs the same number of passes (a synchronised batch norm all-reduces in each). Each
micro-batch's gradient (its summed loss scaled by world / the global batch's samples, as above) is
added up on the device (Stepper.accumulate); the sum is all-reduced, unscaled, clipped and applied
once (Stepper.apply): the step of the whole batch. Batch-norm statistics are those of each
micro-batch (over the ranks), and the moving statistics are updated once per micro-batch.
Activation checkpointing (config.checkpoint_blocks) is the lowering's (LoweredCell.checkpointing).

A mixture of experts' load balance: with config.moe_aux_loss alpha > 0 the loss whose gradient is taken is
the summed cross-entropy plus alpha times each moe's summed load-balancing loss over the pass's sequences
(lowering.Experts.balance), scaled as the cross-entropy is (world / global batch): over micro-batches and
ranks it adds up to alpha times the mean over the global batch's sequences. The loss returned and reported
stays the cross-entropy. The assignments each expert received are read on the host, where the routing is
chosen anyway, summed over the epoch's passes (a batch every rank computes whole is counted once) and, with
data parallelism, over the ranks at the epoch's end (EpochReport.expert_load).

fp16 scales the loss (mindspore.amp.DynamicLossScaler) and skips a step whose gradients are not
finite (AdamW's step count does not advance, as under torch's GradScaler); bf16 has float32's range
and needs no scaling.

A sequence graph (token ids (N, S), labels (N, S)) has a class per position: a sequence's loss is
the mean over its S positions, so the summed loss over the sequences divided by their number is the
mean over every position (the NumPy reference's loss), and every per-sample rule above (scaling,
shards, all-reduces, the report's mean) holds as it is. Its accuracy is over positions.

Input: streamed batches are uint8 pixels, normalised on the device (lowering.normalised_pixels).
Synthetic data (aiperf_core.data.synthetic) is uploaded once, its repeated pool of pixels and the
one-hot targets of its labels, and each step trains on a window of them sliced on the device: no
image crosses from the host per step (`DeviceSynthetic`, single-process training).

After each training step the loop calls StepClock.count with the images of the global batch (live
progress for stall detection), on every rank of a data-parallel run. MindSpore runs PyNative here:
no step graph is traced or compiled, so EpochReport.compile_seconds is 0.0 on CPUs; on Ascend and
GPUs, where kernels are built on first use inside the first steps and cannot be told apart from
them, it is None (not measured).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from aiperf_core.backend import BackendError, Dataset, EpochReport, StepClock, TrainConfig, micro_batches, one_hot
from aiperf_core.optim import CLIP_EPSILON, is_decayed
from aiperf_backends.mindspore import lowering  # noqa: F401  (settles MindSpore's NumPy bridge first)

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
PREDICT_BATCH = 256


def summed_loss(model, x: Tensor, target: Tensor, masks=None):
    """Summed (not mean) over the samples of a batch of their cross-entropy against (smoothed) one-hot
    targets (a sequence's: the mean over its positions), training mode.

    With a softmax output the loss comes from its logits (stable log-softmax); otherwise the output
    is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does."""
    out = model(x, model.has_logits, masks)
    if model.has_logits:
        logp = ops.log_softmax(out, axis=-1)
    else:
        logp = ops.log(ops.clamp(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
    return -(target * logp).sum() / positions(model.graph)


def positions(graph) -> int:
    """Labels per sample: 1 for a class output, S for a class per position of a sequence."""
    return math.prod(graph.output_shape[:-1])


def targets(labels: np.ndarray, classes: int, label_smoothing: float) -> Tensor:
    """(Smoothed) one-hot targets, shape labels.shape + (classes,): per image or per position."""
    labels = np.asarray(labels)
    rows = one_hot(labels.reshape(-1), classes, label_smoothing)
    return Tensor(rows.reshape(labels.shape + (classes,)))


def predict(model, x: np.ndarray) -> np.ndarray:
    """Inference-mode output for an NHWC batch (or token ids), PREDICT_BATCH samples at a time."""
    was_training = model.training
    model.set_train(False)
    try:
        outputs = [model(model.to_cell_layout(x[start:start + PREDICT_BATCH])).asnumpy()
                   for start in range(0, len(x), PREDICT_BATCH)]
    finally:
        model.set_train(was_training)
    return model.to_canonical_output(np.concatenate(outputs))


class preserved:
    """Restore the batch-norm moving statistics on exit, so that a training-mode pass that must not
    change the model (loss_and_grads) does not."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.saved = [(p, p.asnumpy().copy()) for p in self.model.moving_statistics()]
        return self

    def __exit__(self, *exc):
        for p, value in self.saved:
            p.set_data(Tensor(value))
        return False


def gradient_function(model, params, moe_aux_loss: float = 0.0):
    """(x, target, masks, scale) -> ((scaled objective, summed loss), gradients of the scaled objective): the
    summed cross-entropy plus moe_aux_loss times the moes' summed load-balancing losses (LoweredCell.
    balance_loss)."""
    balanced = bool(moe_aux_loss) and bool(model.moe_ids())

    def forward(x, target, masks, scale):
        total = summed_loss(model, x, target, masks)
        objective = total + model.balance_loss() * float(moe_aux_loss) if balanced else total
        return objective * scale, total

    return ms.value_and_grad(forward, None, params, has_aux=True)


class AdamW:
    """torch.optim.AdamW over `params` (float32 Parameters), in PyNative ops: each step is
    w *= 1 - lr * weight_decay (where `decayed`), m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2,
    w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + epsilon). The corrections and the decay
    factor are computed on the host in float64, once per step, and enter as float32 scalars."""

    def __init__(self, params, decayed, config: TrainConfig):
        self.parameters = list(params)
        self.decayed = list(decayed)
        self.betas = tuple(float(b) for b in config.betas)
        self.weight_decay = float(config.weight_decay)
        self.epsilon = float(config.adam_epsilon)
        self.lr = float(config.schedule.initial)
        self.steps = 0
        self.first = [ops.zeros(p.shape, p.dtype) for p in self.parameters]
        self.second = [ops.zeros(p.shape, p.dtype) for p in self.parameters]

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)

    def __call__(self, grads) -> None:
        self.steps += 1
        b1, b2 = self.betas
        first_fix, second_fix = 1.0 - b1 ** self.steps, 1.0 - b2 ** self.steps
        keep = 1.0 - self.lr * self.weight_decay
        for i, (w, g, decayed) in enumerate(zip(self.parameters, grads, self.decayed)):
            m = self.first[i] * b1 + g * (1.0 - b1)
            v = self.second[i] * b2 + (g * g) * (1.0 - b2)
            self.first[i], self.second[i] = m, v
            step = (m / first_fix) / (ops.sqrt(v / second_fix) + self.epsilon)
            start = w * keep if decayed and self.weight_decay else w
            ops.assign(w, start - step * self.lr)


def clip_gradients(grads, grad_clip: float):
    """Every gradient scaled by min(1, grad_clip / (norm + 1e-6)), norm the 2-norm of them all together
    (torch.nn.utils.clip_grad_norm_), computed on the device in float32."""
    norm = ops.sqrt(sum((g.astype(ms.float32) * g.astype(ms.float32)).sum() for g in grads))
    factor = ops.clamp(grad_clip / (norm + CLIP_EPSILON), max=1.0)
    return tuple(g * factor.astype(g.dtype) for g in grads)


class Stepper:
    """config.optimizer (nn.Momentum or `AdamW`), an optional gradient clip, loss scaling for fp16, an
    optional gradient reducer."""

    def __init__(self, model, config: TrainConfig, reducer=None):
        trainable = model.trainable()
        params = [p for _, _, p in trainable]
        if not params:
            raise BackendError("the graph has no trainable parameters: there is nothing to train")
        self.model = model
        if config.optimizer == "adamw":
            # By the canonical shape (a zero-byte view of it), the one the rule is stated on.
            shapes = model.graph.all_param_shapes()
            decayed = [is_decayed(np.broadcast_to(np.float32(0.0), shapes[node_id][name]))
                       for node_id, name, _ in trainable]
            self.optimizer = AdamW(params, decayed, config)
            self.grad_fn = gradient_function(model, params, config.moe_aux_loss)
        else:
            self.optimizer = nn.Momentum(params, learning_rate=float(config.schedule.initial),
                                         momentum=float(config.momentum))
            self.grad_fn = gradient_function(model, self.optimizer.parameters, config.moe_aux_loss)
        self.grad_clip = None if config.grad_clip is None else float(config.grad_clip)
        self.reducer = reducer
        self.scaler = ms.amp.DynamicLossScaler(scale_value=2.0 ** 16, scale_factor=2, scale_window=1000) \
            if model.precision == "fp16" else None
        self.pending = None  # the gradients accumulated since the last update

    def set_lr(self, lr: float) -> None:
        if isinstance(self.optimizer, AdamW):
            self.optimizer.set_lr(lr)
        else:
            ops.assign(self.optimizer.learning_rate, Tensor(np.float32(lr)))

    def step(self, x, target: Tensor, global_batch: int, world: int = 1, masks=None) -> float:
        """One synchronous training step on this rank's shard: `x` an NHWC batch as to_cell_layout takes
        it, `target` its one-hot (smoothed) rows (`targets`); returns the shard's summed loss."""
        total = self.accumulate(x, target, global_batch, world, masks)
        self.apply()
        return total

    def accumulate(self, x, target: Tensor, global_batch: int, world: int = 1, masks=None) -> float:
        """Add the gradient of this rank's part of a (micro-)batch to the pending ones: its summed loss
        scaled by world / global_batch (the samples of the whole global batch, whose mean loss the
        update descends); returns that part's summed loss."""
        scale = world / global_batch
        if self.scaler is not None:
            scale *= float(self.scaler.scale_value.asnumpy())
        (_, total), grads = self.grad_fn(self.model.to_cell_layout(x), target, masks, Tensor(np.float32(scale)))
        self.pending = grads if self.pending is None else tuple(a + g for a, g in zip(self.pending, grads))
        return float(total.asnumpy())

    def apply(self) -> None:
        """The update with the accumulated gradients: all-reduced, unscaled (fp16), clipped, stepped."""
        grads, self.pending = self.pending, None
        if self.reducer is not None:
            grads = self.reducer(grads)
        if self.scaler is not None:
            grads = self.scaler.unscale(grads)
            finite = ms.amp.all_finite(grads)
            self.scaler.adjust(finite)
            if not bool(finite):
                return
        if self.grad_clip is not None:  # on the reduced, unscaled gradient: the global batch's own
            grads = clip_gradients(grads, self.grad_clip)
        self.optimizer(grads)


def evaluate(model, x: np.ndarray, labels: np.ndarray, label_smoothing: float) -> tuple[float, int, int]:
    """(summed loss as summed_loss's, correct predictions, images) over x in inference mode; for a
    sequence graph the images are sequences and the correct predictions positions."""
    was_training = model.training
    model.set_train(False)
    total, correct = 0.0, 0
    classes = model.graph.output_shape[-1]
    per_sample = positions(model.graph)
    try:
        for start in range(0, len(x), PREDICT_BATCH):
            xb = model.to_cell_layout(x[start:start + PREDICT_BATCH])
            yb = np.asarray(labels[start:start + PREDICT_BATCH], np.int64)
            out = model(xb, model.has_logits).asnumpy().astype(np.float64)
            if model.has_logits:  # out holds logits; argmax is the same as the softmax's
                shifted = out - out.max(axis=-1, keepdims=True)
                logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
            else:
                logp = np.log(np.clip(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
            target = one_hot(yb.reshape(-1), classes, label_smoothing, np.float64).reshape(logp.shape)
            total += float(-(target * logp).sum()) / per_sample
            correct += int((out.argmax(axis=-1) == yb).sum())
    finally:
        model.set_train(was_training)
    return total, correct, len(x)


class DeviceSynthetic:
    """Synthetic data made once on the device (aiperf_core.data.synthetic's device contract): the
    repeated pool of pixels and the one-hot targets of its labels become Tensors when training
    starts, and each batch is a window of them, sliced by a MindSpore op on the device target.
    MindSpore copies a Tensor's host data to the device when an op first uses it and keeps that
    copy, so the pool crosses once (on Ascend; unverified here, where the device is the host). The
    windows are exactly the batches the host stream would deliver."""

    def __init__(self, data, classes: int, label_smoothing: float, batch_size: int):
        from aiperf_core.data.synthetic import device_pool

        pool = device_pool(data, max(batch_size, PREDICT_BATCH))
        self.data = data
        self.pixels = Tensor(pool.pixels)
        self.targets = Tensor(one_hot(pool.labels, classes, label_smoothing))
        self.labels = pool.labels  # for the evaluation's loss and accuracy, computed on the host

    @staticmethod
    def applies(data, world: int) -> bool:
        from aiperf_core.backend import is_streaming
        from aiperf_core.data.synthetic import is_synthetic

        return world == 1 and is_streaming(data) and is_synthetic(data)

    def train(self, batch_size: int):
        """(pixels, targets) windows of every global batch (the same every epoch)."""
        from aiperf_core.data.stream import TRAIN
        from aiperf_core.data.synthetic import windows

        for w in windows(self.data, TRAIN, batch_size):
            yield self.pixels[w.offset:w.offset + w.length], self.targets[w.offset:w.offset + w.length]

    def val(self):
        """(pixels, labels, skipped) of every validation batch."""
        from aiperf_core.data.stream import VAL
        from aiperf_core.data.synthetic import windows

        for w in windows(self.data, VAL, PREDICT_BATCH):
            yield self.pixels[w.offset:w.offset + w.length], self.labels[w.offset:w.offset + w.length], 0


def run_epochs(model, data: Dataset, config: TrainConfig, *, rank: int = 0, world: int = 1,
               all_reduce: Callable[[list[float]], list[float]] | None = None,
               sum_counts: Callable[[np.ndarray], np.ndarray] | None = None, reducer=None,
               on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """The epoch loop over in-memory arrays, a StreamingDataset (aiperf_core.data.stream) or a
    TokenStream (aiperf_core.data.text_stream; a data-parallel rank reads it too).
    `all_reduce` sums a list of floats over the ranks (None when world == 1), `sum_counts` an int64
    array (the expert counts: exact), `reducer` averages gradients over them; `on_epoch` returns True to
    stop and must give every rank the same answer.

    The report's loss is the mean training loss over the epoch's images (as each step saw it), and
    val_loss the same cross-entropy (label smoothing included) on the validation images."""
    from aiperf_core.backend import is_streaming, is_token_stream

    if world > 1 and is_streaming(data) and not is_token_stream(data):
        raise BackendError("the mindspore backend trains a streamed image dataset on one device only")
    stepper = Stepper(model, config, reducer)
    classes = model.graph.output_shape[-1]
    per_sample = positions(model.graph)
    synthetic = DeviceSynthetic(data, classes, config.label_smoothing, config.batch_size) \
        if DeviceSynthetic.applies(data, world) else None
    if not is_streaming(data):  # convert once, not per batch (token ids stay integers)
        x_type = np.int64 if model.graph.takes_tokens else np.float32
        data = Dataset(np.ascontiguousarray(data.x_train, dtype=x_type), np.asarray(data.y_train, np.int64),
                       data.x_val, data.y_val, data.classes)
    # Dropout masks come from a stream seeded by config.seed and the rank: a run is reproducible.
    dropout_rng = np.random.default_rng(np.random.SeedSequence([config.seed, rank]))
    has_dropout = bool(model.dropout_nodes())
    compile_seconds = 0.0 if str(ms.get_context("device_target")) == "CPU" else None
    reports: list[EpochReport] = []
    clock = StepClock()
    # Micro-batches of the global batch: each rank's shard of one holds at most micro_batch samples.
    micro = None if config.micro_batch is None else config.micro_batch * world
    moe_ids = model.moe_ids()
    try:
        for epoch in range(config.epochs):
            stepper.set_lr(config.schedule.rate(epoch, config.epochs))
            model.set_train(True)
            received = [np.zeros(model.graph[n].attrs["experts"], np.int64) for n in moe_ids]
            loss_sum = 0.0
            images = skipped = 0
            for xb, labels, n, batch_skipped in _global_batches(data, synthetic, config, epoch):
                skipped += batch_skipped
                if not n:
                    continue
                for start, stop in micro_batches(n, micro):
                    # Data parallel: each rank takes its contiguous shard of the (micro-)batch; one
                    # smaller than the world is computed whole by every rank (local statistics).
                    split = 1 < world <= stop - start
                    lo, hi = _shard(start, stop, rank, world) if split else (start, stop)
                    target = labels[lo:hi] if isinstance(labels, Tensor) else \
                        targets(labels[lo:hi], classes, config.label_smoothing)
                    if world > 1:
                        from aiperf_backends.mindspore.distributed import synchronise_batch_norm

                        synchronise_batch_norm(model, split)
                    masks = model.masks_from(dropout_rng, hi - lo) if has_dropout else None
                    with clock:  # from the batch's transfer (the pass's first use of it) to its loss
                        total = stepper.accumulate(xb[lo:hi], target, n, world if split else 1, masks)
                    loss_sum += total if split or world == 1 else total / world  # summed over the ranks below
                    if split or rank == 0:  # a batch every rank computed whole is counted once
                        received = [a + b for a, b in zip(received, model.expert_counts())]
                with clock:
                    stepper.apply()
                clock.count(n)
                images += n
            val_loss, correct, val_total, val_skipped = _validate(model, data, synthetic, config, rank, world, clock)
            skipped += val_skipped
            if all_reduce is not None:
                loss_sum, val_loss, correct, val_total = all_reduce([loss_sum, val_loss, float(correct),
                                                                     float(val_total)])
                val_total = int(round(val_total))
            if sum_counts is not None and moe_ids:
                lengths = np.cumsum([len(r) for r in received])[:-1]
                received = np.split(sum_counts(np.concatenate(received)), lengths)
            expert_load = {n: tuple(int(c) for c in r) for n, r in zip(moe_ids, received)} if moe_ids else None
            report = EpochReport(epoch=epoch, train_images=images, val_images=val_total,
                                 loss=loss_sum / max(images, 1),
                                 val_loss=val_loss / val_total if val_total else 0.0,
                                 val_accuracy=float(round(correct)) / (val_total * per_sample) if val_total else 0.0,
                                 skipped_images=skipped, step_seconds=clock.lap(), compile_seconds=compile_seconds,
                                 expert_load=expert_load)
            reports.append(report)
            if on_epoch is not None and on_epoch(report):
                break
    finally:
        model.set_train(False)
    return reports


def _global_batches(data, synthetic: DeviceSynthetic | None, config: TrainConfig, epoch: int):
    """(x, labels, images, skipped) for each global batch of the epoch: device windows of synthetic
    data (x uint8 pixels and labels their one-hot targets, Tensors), or a host batch (x NHWC as it
    came: uint8 pixels or normalised floats, or token ids; labels int64)."""
    from aiperf_core.data.stream import train_batches

    if synthetic is not None:
        for pixels, target in synthetic.train(config.batch_size):
            yield pixels, target, len(pixels), 0
        return
    for batch in train_batches(data, epoch, config.seed, config.batch_size):
        yield batch.x, np.asarray(batch.y, np.int64), len(batch.y), batch.skipped


def _shard(start: int, stop: int, rank: int, world: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous shard of [start, stop): np.array_split's rule."""
    size, extra = divmod(stop - start, world)
    lo = start + rank * size + min(rank, extra)
    return lo, lo + size + (rank < extra)


def _validate(model, data, synthetic: DeviceSynthetic | None, config: TrainConfig, rank: int, world: int,
              clock: StepClock) -> tuple[float, int, int, int]:
    """(summed loss, correct, images, skipped) of this rank's part of the validation set: all of it
    on one device, its shard of every validation batch with data parallelism (the sums are then
    reduced)."""
    from aiperf_core.data.stream import val_batches

    batches = synthetic.val() if synthetic is not None else \
        ((b.x, b.y, b.skipped) for b in val_batches(data, PREDICT_BATCH, rank, world))
    total, correct, count, skipped = 0.0, 0, 0, 0
    for xv, yv, batch_skipped in batches:
        skipped += batch_skipped
        if len(yv):
            with clock:
                part_loss, part_correct, part_n = evaluate(model, xv, yv, config.label_smoothing)
            total, correct, count = total + part_loss, correct + part_correct, count + part_n
    return total, correct, count, skipped
