"""Loss, the SGD step and the epoch loop, for one device or MirroredStrategy over several.

SGD with momentum is written out with torch.optim.SGD's semantics (``v = m * v + g``;
``w -= lr * v``), not Keras SGD's (``v = m * v - lr * g``; ``w += v``): the two differ as soon as the
learning rate changes between epochs, and every aiperf backend must train the same way.

Data parallelism (strategy with several replicas): every global batch of ``config.batch_size``
images (the same shuffled order as on one device, np.random.default_rng(seed + epoch)) is cut into
contiguous shards, one per replica (np.array_split, so the last short batch is shared as evenly as
it can be; an empty shard still takes part in the collectives). Each replica's loss is its shard's
summed cross-entropy divided by the *global* batch size; the gradients are all-reduced with SUM,
so they are exactly the gradients of the global batch's mean loss. Batch norm is synchronised (see
lowering.py): the step is the same computation as on one device with the global batch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from aiperf_core.backend import BackendError, Dataset, EpochReport, TrainConfig, batches
from backends.tensorflow.lowering import make_variable, use_xla

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
PREDICT_BATCH = 256


def targets(labels, classes: int, label_smoothing: float):
    y = tf.one_hot(labels, classes, dtype=tf.float32)
    if label_smoothing:
        y = y * (1.0 - label_smoothing) + label_smoothing / classes
    return y


def summed_loss(model, x, labels, label_smoothing: float, training: bool = True, masks=None):
    """(summed categorical cross-entropy of the batch, batch-norm updates, output used).

    With a softmax output the loss comes from its logits (a stable log-softmax); otherwise the
    output is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does."""
    out, updates = model.call(x, training, logits=True, masks=masks)
    out = tf.cast(out, tf.float32)
    y = targets(labels, model.graph.output_shape[-1], label_smoothing)
    if model.has_logits:
        total = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=out))
    else:
        clipped = tf.clip_by_value(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP)
        total = -tf.reduce_sum(y * tf.math.log(clipped))
    return total, updates, out


class Trainer:
    """The compiled train and eval steps of a model under a strategy (default: one device)."""

    def __init__(self, model, config: TrainConfig, strategy: tf.distribute.Strategy | None = None):
        if not model.trainables:
            raise BackendError("the graph has no trainable parameters: there is nothing to train")
        self.model = model
        self.config = config
        self.strategy = strategy
        self.world = strategy.num_replicas_in_sync if strategy is not None else 1
        scope = strategy.scope() if strategy is not None else _null()
        with scope:
            self.slots = [make_variable(tf.zeros(v.shape), f"momentum_{i}", trainable=False)
                          for i, v in enumerate(model.trainables)]
        momentum = float(config.momentum)
        smoothing = float(config.label_smoothing)
        world = self.world

        def replica_step(x, y, lr, global_n):
            with tf.GradientTape() as tape:
                total, updates, _ = summed_loss(model, x, y, smoothing, True)
                loss = total / global_n
            grads = tape.gradient(loss, model.trainables)
            grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
                     for g, v in zip(grads, model.trainables)]
            if world > 1:
                grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)
            for var, slot, g in zip(model.trainables, self.slots, grads):
                velocity = momentum * slot + g
                slot.assign(velocity)
                var.assign_sub(lr * velocity)
            for var, value in updates:
                var.assign(value)
            return total

        spec = [tf.TensorSpec([None] + list(model.graph.input_shape), tf.float32),
                tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.float32), tf.TensorSpec([], tf.float32)]
        if strategy is None:
            self._step = tf.function(replica_step, input_signature=spec, jit_compile=use_xla() or None)
        else:
            @tf.function(reduce_retracing=True)
            def distributed(x, y, lr, global_n):
                per_replica = strategy.run(replica_step, args=(x, y, lr, global_n))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._step = distributed

        def eval_fn(x, y):
            out, _ = model.call(x, False, logits=True)
            out = tf.cast(out, tf.float32)
            t = targets(y, model.graph.output_shape[-1], smoothing)
            if model.has_logits:
                total = tf.reduce_sum(tf.nn.softmax_cross_entropy_with_logits(labels=t, logits=out))
            else:
                total = -tf.reduce_sum(t * tf.math.log(tf.clip_by_value(out, PROBABILITY_CLIP, 1 - PROBABILITY_CLIP)))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, axis=-1), y), tf.int64))
            return total, correct

        self._eval = tf.function(eval_fn, input_signature=spec[:2], jit_compile=use_xla() or None)

    def step(self, x: np.ndarray, y: np.ndarray, lr: float) -> float:
        """One synchronous SGD step on a global batch; returns its summed loss."""
        n = np.float32(len(y))
        if self.strategy is None:
            return self._step(x, y, np.float32(lr), n)
        parts = np.array_split(np.arange(len(y)), self.world)
        xs = [tf.constant(x[p]) for p in parts]
        ys = [tf.constant(y[p]) for p in parts]
        xd = self.strategy.experimental_distribute_values_from_function(lambda ctx: xs[ctx.replica_id_in_sync_group])
        yd = self.strategy.experimental_distribute_values_from_function(lambda ctx: ys[ctx.replica_id_in_sync_group])
        return self._step(xd, yd, tf.constant(lr, tf.float32), tf.constant(n))

    def evaluate(self, x: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        """(summed loss, correct predictions) in inference mode (on the first device)."""
        total, correct = 0.0, 0
        for start in range(0, len(x), PREDICT_BATCH):
            xb = np.ascontiguousarray(x[start:start + PREDICT_BATCH], dtype=np.float32)
            yb = np.asarray(labels[start:start + PREDICT_BATCH], dtype=np.int64)
            t, c = self._eval(xb, yb)
            total += float(t)
            correct += int(c)
        return total, correct


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def run_epochs(trainer: Trainer, data: Dataset, config: TrainConfig,
               on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """Per epoch: the learning rate config.schedule.rate(epoch, epochs); every training image once,
    in the order np.random.default_rng(config.seed + epoch).permutation(n), in batches of
    config.batch_size (the last one short, never dropped); then the validation set in inference
    mode. The report's loss is the mean training loss over the epoch's images (as each step saw
    it), and val_loss the same cross-entropy (label smoothing included) on the validation images."""
    tf.random.set_seed(config.seed)  # dropout masks: a run is reproducible
    x_train = np.ascontiguousarray(data.x_train, dtype=np.float32)
    y_train = np.asarray(data.y_train, dtype=np.int64)
    n = len(y_train)
    reports: list[EpochReport] = []
    for epoch in range(config.epochs):
        lr = config.schedule.rate(epoch, config.epochs)
        loss_sum = 0.0
        images = 0
        pending = []
        for idx in batches(n, config.batch_size, np.random.default_rng(config.seed + epoch)):
            pending.append(trainer.step(x_train[idx], y_train[idx], lr))
            images += len(idx)
        loss_sum = float(sum(float(t) for t in pending))
        val_n = len(data.y_val)
        val_loss, correct = trainer.evaluate(data.x_val, data.y_val) if val_n else (0.0, 0)
        report = EpochReport(epoch=epoch, train_images=images, val_images=val_n, loss=loss_sum / max(images, 1),
                             val_loss=val_loss / val_n if val_n else 0.0,
                             val_accuracy=correct / val_n if val_n else 0.0)
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports
