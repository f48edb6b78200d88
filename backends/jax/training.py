"""Loss, the jit-compiled SGD step, evaluation and the epoch loop.

SGD with momentum is torch.optim.SGD's: v = momentum * v + g; w -= lr * v (v starts at zero, so
the first step is w -= lr * g). The learning rate is a traced argument of the step, so a new rate
per epoch (config.schedule.rate(epoch, epochs)) does not recompile.

Every training image is seen once per epoch, in the order np.random.default_rng(seed + epoch)
.permutation(n), in batches of config.batch_size; the last batch is short and not dropped (jit
compiles the step once more for its shape), so images are counted exactly and each step's loss is
exactly the mean over the images it saw. With several devices the batch axis is sharded over a
1-D mesh (distributed.py); the code is written over the global batch, so the gradients and the
batch-norm statistics are those of the global batch whatever the number of devices.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import numpy as np

from aiperf_core.backend import BackendError, Dataset, EpochReport, StepClock, TrainConfig, is_streaming
from aiperf_core.data.stream import train_batches, val_batches

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
PREDICT_BATCH = 256


def summed_loss(graph, params, state, x, labels, label_smoothing, *, precision="fp32", masks=None, key=None):
    """(summed cross-entropy over the batch, new BN state), training mode.

    With a softmax output the loss comes from its logits (stable log-softmax); otherwise the
    output is read as probabilities clipped to [1e-7, 1 - 1e-7], as the reference does."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import apply

    has_logits = graph[graph.output_id].op == "softmax"
    out, new_state = apply(graph, params, state, x, training=True, logits=has_logits, precision=precision,
                           masks=masks, key=key)
    classes = out.shape[-1]
    target = jax.nn.one_hot(labels, classes, dtype=jnp.float32) * (1.0 - label_smoothing) + label_smoothing / classes
    if has_logits:
        logp = jax.nn.log_softmax(out, axis=-1)
    else:
        logp = jnp.log(jnp.clip(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
    return -jnp.sum(target * logp), new_state


def eval_sums(graph, params, state, x, labels, valid, label_smoothing, precision):
    """(summed loss, correct predictions) over the rows where `valid` is true, inference mode."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import apply

    has_logits = graph[graph.output_id].op == "softmax"
    out, _ = apply(graph, params, state, x, training=False, logits=has_logits, precision=precision)
    classes = out.shape[-1]
    target = jax.nn.one_hot(labels, classes, dtype=jnp.float32) * (1.0 - label_smoothing) + label_smoothing / classes
    if has_logits:
        logp = jax.nn.log_softmax(out, axis=-1)
    else:
        logp = jnp.log(jnp.clip(out, PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP))
    per = -jnp.sum(target * logp, axis=-1)
    correct = (jnp.argmax(out, axis=-1) == labels) & valid
    return jnp.sum(jnp.where(valid, per, 0.0)), jnp.sum(correct)


def make_train_step(graph, precision: str, momentum: float, label_smoothing: float):
    """A jitted step (params, state, velocity, x, labels, lr, key) -> (params, state, velocity, summed loss).

    params and velocity are donated: the update happens in place where the device allows."""
    import jax

    def step(params, state, velocity, x, labels, lr, key):
        def loss_fn(p):
            total, new_state = summed_loss(graph, p, state, x, labels, label_smoothing, precision=precision, key=key)
            return total / x.shape[0], (total, new_state)

        grads, (total, new_state) = jax.grad(loss_fn, has_aux=True)(params)
        velocity = jax.tree_util.tree_map(lambda v, g: momentum * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda w, v: w - lr * v, params, velocity)
        return params, new_state, velocity, total

    return jax.jit(step, donate_argnums=(0, 2))


def predict_fn(model):
    import jax

    from aiperf_backends.jax.lowering import apply

    key = ("predict",)
    if key not in model.cache:
        graph, precision = model.graph, model.precision
        model.cache[key] = jax.jit(lambda p, s, x: apply(graph, p, s, x, training=False, precision=precision)[0])
    return model.cache[key]


def bucket(n: int, cap: int = PREDICT_BATCH) -> int:
    """Padded batch size for inference: the next power of two up to `cap` (few compiled shapes)."""
    size = 1
    while size < n:
        size *= 2
    return min(size, cap)


def predict(model, x: np.ndarray) -> np.ndarray:
    """Inference in chunks padded to a power of two; each image's output does not depend on the
    others in inference mode, so the padding rows are simply dropped."""
    import jax.numpy as jnp

    fn = predict_fn(model)
    outputs = []
    for start in range(0, len(x), PREDICT_BATCH):
        chunk = x[start:start + PREDICT_BATCH]
        size = bucket(len(chunk))
        padded = np.zeros((size,) + chunk.shape[1:], np.float32)
        padded[:len(chunk)] = chunk
        out = fn(model.params, model.state, jnp.asarray(padded))
        outputs.append(np.asarray(out, dtype=np.float32)[:len(chunk)])
    return np.ascontiguousarray(np.concatenate(outputs), dtype=np.float32)


def evaluate(model, params, state, x: np.ndarray, labels: np.ndarray, label_smoothing: float) -> tuple[float, int]:
    """(summed loss, correct predictions) over x in inference mode, in padded chunks."""
    import jax
    import jax.numpy as jnp

    key = ("eval", float(label_smoothing))
    if key not in model.cache:
        model.cache[key] = jax.jit(partial(eval_sums, model.graph, label_smoothing=label_smoothing,
                                           precision=model.precision))
    fn = model.cache[key]
    total, correct = 0.0, 0
    for start in range(0, len(x), PREDICT_BATCH):
        chunk = np.asarray(x[start:start + PREDICT_BATCH], np.float32)
        lab = np.asarray(labels[start:start + PREDICT_BATCH], np.int32)
        size = bucket(len(chunk))
        xp = np.zeros((size,) + chunk.shape[1:], np.float32)
        xp[:len(chunk)] = chunk
        yp = np.zeros(size, np.int32)
        yp[:len(chunk)] = lab
        valid = np.arange(size) < len(chunk)
        s, c = fn(params, state, jnp.asarray(xp), jnp.asarray(yp), jnp.asarray(valid))
        total += float(s)
        correct += int(c)
    return total, correct


def run_epochs(model, data: Dataset, config: TrainConfig, mesh=None,
               on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    """The epoch loop; the trained parameters and BN statistics are stored back into `model`.
    `data` is in-memory arrays or a StreamingDataset (aiperf_core.data.stream)."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.distributed import place_batch, replicate

    if not model.params:
        raise BackendError("the graph has no trainable parameters: there is nothing to train")
    key = ("train", config.precision, float(config.momentum), float(config.label_smoothing))
    if key not in model.cache:
        model.cache[key] = make_train_step(model.graph, config.precision, float(config.momentum),
                                           float(config.label_smoothing))
    step = model.cache[key]
    params = replicate(mesh, jax.tree_util.tree_map(jnp.array, model.params))  # copies: donation is safe
    state = replicate(mesh, model.state)
    velocity = replicate(mesh, jax.tree_util.tree_map(jnp.zeros_like, model.params))
    if not is_streaming(data):  # convert once, not per batch
        data = Dataset(np.ascontiguousarray(data.x_train, dtype=np.float32), np.asarray(data.y_train, np.int32),
                       data.x_val, data.y_val, data.classes)
    rng_key = jax.random.PRNGKey(config.seed)
    reports: list[EpochReport] = []
    clock = StepClock()
    step_index = 0
    try:
        for epoch in range(config.epochs):
            lr = jnp.float32(config.schedule.rate(epoch, config.epochs))
            pending = []
            images = skipped = 0
            # Streamed batches come from the shared threaded pipeline, which decodes the next batches
            # while the (asynchronously dispatched) step runs.
            for batch in train_batches(data, epoch, config.seed, config.batch_size):
                skipped += batch.skipped
                if not len(batch.y):
                    continue
                x_host, y_host = np.asarray(batch.x, np.float32), np.asarray(batch.y, np.int32)
                with clock:  # from the batch's transfer, which waits while the device is busy
                    xb, yb = place_batch(mesh, x_host, y_host)
                    params, state, velocity, total = step(params, state, velocity, xb, yb, lr,
                                                          jax.random.fold_in(rng_key, step_index))
                pending.append(total)
                step_index += 1
                images += len(batch.y)
            with clock:  # waits for the asynchronously dispatched steps
                loss_sum = float(np.sum([np.float64(t) for t in pending]))
            val_loss, correct, val_total = 0.0, 0, 0
            for batch in val_batches(data, PREDICT_BATCH):
                skipped += batch.skipped
                if len(batch.y):
                    with clock:
                        part_loss, part_correct = evaluate(model, params, state, batch.x, batch.y,
                                                           config.label_smoothing)
                    val_loss, correct = val_loss + part_loss, correct + part_correct
                    val_total += len(batch.y)
            report = EpochReport(epoch=epoch, train_images=images, val_images=val_total,
                                 loss=loss_sum / max(images, 1),
                                 val_loss=val_loss / val_total if val_total else 0.0,
                                 val_accuracy=correct / val_total if val_total else 0.0,
                                 skipped_images=skipped, step_seconds=clock.lap())
            reports.append(report)
            if on_epoch is not None and on_epoch(report):
                break
    finally:
        model.params = params
        model.state = state
    return reports
