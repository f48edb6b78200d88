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

from aiperf_core.backend import BackendError, Dataset, EpochReport, StepClock, TrainConfig, batches, is_streaming
from aiperf_backends.tensorflow.lowering import make_variable, use_xla

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
        # Contiguous shards as slices, which work on NumPy arrays and on tensors from tf.data alike.
        sizes = [len(p) for p in np.array_split(np.arange(len(y)), self.world)]
        bounds = np.cumsum([0] + sizes)
        xs = [tf.convert_to_tensor(x[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        ys = [tf.convert_to_tensor(y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
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
    if is_streaming(data):
        return _stream_epochs(trainer, data, config, on_epoch)
    x_train = np.ascontiguousarray(data.x_train, dtype=np.float32)
    y_train = np.asarray(data.y_train, dtype=np.int64)
    n = len(y_train)
    reports: list[EpochReport] = []
    clock = StepClock()
    for epoch in range(config.epochs):
        lr = config.schedule.rate(epoch, config.epochs)
        images = 0
        pending = []
        for idx in batches(n, config.batch_size, np.random.default_rng(config.seed + epoch)):
            xb, yb = x_train[idx], y_train[idx]
            with clock:
                pending.append(trainer.step(xb, yb, lr))
            images += len(idx)
        with clock:  # waits for the dispatched steps
            loss_sum = float(sum(float(t) for t in pending))
        val_n = len(data.y_val)
        with clock:
            val_loss, correct = trainer.evaluate(data.x_val, data.y_val) if val_n else (0.0, 0)
        report = EpochReport(epoch=epoch, train_images=images, val_images=val_n, loss=loss_sum / max(images, 1),
                             val_loss=val_loss / val_n if val_n else 0.0,
                             val_accuracy=correct / val_n if val_n else 0.0, step_seconds=clock.lap())
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports


# ---------------------------------------------------------------------------
# Streamed data (aiperf_core.data.stream.StreamingDataset) through tf.data
# ---------------------------------------------------------------------------

MEAN = tf.constant([0.485 * 255, 0.456 * 255, 0.406 * 255], tf.float32)  # as aiperf_core.data.preprocess
STD = tf.constant([0.229 * 255, 0.224 * 255, 0.225 * 255], tf.float32)
CROP_AREA = (0.08, 1.0)
CROP_RATIO = (3.0 / 4.0, 4.0 / 3.0)
VAL_CROP_FRACTION = 0.875


def _crop_window(shape, seed):
    """A random-resized-crop window (offset, size) for an image of `shape`, stateless in `seed`."""
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=CROP_RATIO, area_range=CROP_AREA, max_attempts=10, use_image_if_no_bounding_boxes=True)
    return begin, size


def _train_image(encoded, seed, size: int):
    """Decode (only the crop, for JPEGs), random-resized crop, flip, normalise."""

    def jpeg():
        begin, crop = _crop_window(tf.io.extract_jpeg_shape(encoded), seed)
        return tf.image.decode_and_crop_jpeg(encoded, tf.stack([begin[0], begin[1], crop[0], crop[1]]), channels=3)

    def other():  # PNG, GIF, BMP: decode everything, then crop
        image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
        begin, crop = _crop_window(tf.shape(image), seed)
        return tf.slice(image, begin, crop)

    image = tf.cond(tf.io.is_jpeg(encoded), jpeg, other)
    image = tf.image.resize(image, [size, size], method="bilinear", antialias=True)
    image = tf.image.stateless_random_flip_left_right(image, seed)
    return (image - MEAN) / STD


def _val_image(encoded, size: int):
    """Decode, resize the shorter side to size / 0.875, central crop, normalise."""
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    hw = tf.cast(tf.shape(image)[:2], tf.float32)
    short = float(max(round(size / VAL_CROP_FRACTION), size))
    new = tf.maximum(tf.cast(tf.round(hw * short / tf.reduce_min(hw)), tf.int32), size)
    image = tf.image.resize(image, new, method="bilinear", antialias=True)
    top, left = (new[0] - size) // 2, (new[1] - size) // 2
    image = tf.image.crop_to_bounding_box(image, top, left, size, size)
    return (image - MEAN) / STD


def tf_input(data, split: str, epoch: int, seed: int, batch_size: int) -> tf.data.Dataset:
    """One epoch of a split as a tf.data pipeline: read (natively for ImageFolder files; for TFRecord
    shards by offset through the source, which checks the CRCs), decode and augment with
    data.workers parallel calls, drop what fails to decode, batch, prefetch. Augmentation is
    stateless, seeded by (seed, epoch, image index), so it does not depend on thread timing."""
    from aiperf_core.data.stream import TRAIN

    source = data.source
    plan = data.plan(split, epoch, seed, batch_size)
    order = np.concatenate(plan).astype(np.int64) if plan else np.zeros(0, np.int64)
    labels = source.labels(split)[order]
    parallel = max(data.workers, 1)
    if source.layout == "imagefolder":
        files = np.asarray(source.files(split))[order]
        ds = tf.data.Dataset.from_tensor_slices((files, order, labels))
        ds = ds.map(lambda f, i, y: (tf.io.read_file(f), i, y), num_parallel_calls=parallel)
    else:
        def fetch(i):
            return source.encoded(split, int(i))  # raises on a bad checksum: the record is dropped

        ds = tf.data.Dataset.from_tensor_slices((order, labels))
        ds = ds.map(lambda i, y: (tf.py_function(fetch, [i], tf.string), i, y), num_parallel_calls=parallel)
    size = data.image_size
    epoch_seed = (seed * 1_000_003 + epoch) & 0x7FFFFFFF
    if split == TRAIN:
        def transform(encoded, i, y):
            stateless = tf.stack([tf.constant(epoch_seed, tf.int64), i])
            return _train_image(encoded, stateless, size), y
    else:
        def transform(encoded, i, y):
            return _val_image(encoded, size), y
    ds = ds.map(transform, num_parallel_calls=parallel)
    # A corrupt image fails in read or decode; it is dropped here and counted by the caller.
    ds = ds.ignore_errors().batch(batch_size).prefetch(max(data.prefetch, 1))
    options = tf.data.Options()
    options.deterministic = True
    return ds.with_options(options)


def stream_batches(data, split: str, epoch: int, seed: int, batch_size: int):
    """(images, labels) batches of an epoch: tf.data for stored images, the shared threaded NumPy
    pipeline for generated ones (synthetic data has nothing to decode)."""
    if data.source.layout in ("imagefolder", "tfrecord"):
        yield from tf_input(data, split, epoch, seed, batch_size)
        return
    for batch in data.iterate(split, epoch, seed, batch_size):
        if len(batch.y):
            yield batch.x, batch.y


def _stream_epochs(trainer: Trainer, data, config: TrainConfig, on_epoch) -> list[EpochReport]:
    """The epoch loop over streamed data. What did not decode is what did not arrive: the skipped
    images are the split's count minus the images processed."""
    from aiperf_core.data.stream import TRAIN, VAL

    reports: list[EpochReport] = []
    clock = StepClock()
    for epoch in range(config.epochs):
        lr = config.schedule.rate(epoch, config.epochs)
        pending, images = [], 0
        for x, y in stream_batches(data, TRAIN, epoch, config.seed, config.batch_size):
            with clock:
                pending.append(trainer.step(x, y, lr))
            images += int(len(y))
        with clock:
            loss_sum = float(sum(float(t) for t in pending))
        val_loss, correct, val_n = 0.0, 0, 0
        for x, y in stream_batches(data, VAL, 0, 0, PREDICT_BATCH):
            with clock:
                part_loss, part_correct = trainer.evaluate(x, y)
            val_loss, correct, val_n = val_loss + part_loss, correct + part_correct, val_n + int(len(y))
        skipped = (data.train_images - images) + (data.val_images - val_n)
        report = EpochReport(epoch=epoch, train_images=images, val_images=val_n, loss=loss_sum / max(images, 1),
                             val_loss=val_loss / val_n if val_n else 0.0,
                             val_accuracy=correct / val_n if val_n else 0.0, skipped_images=skipped,
                             step_seconds=clock.lap())
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports
