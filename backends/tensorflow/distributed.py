"""Data parallelism over the local devices with tf.distribute.MirroredStrategy (in process).

`train_data_parallel` re-lowers the graph under the strategy's scope with the model's current
weights (mirrored variables, one copy per device), trains it with training.run_epochs (each global
batch cut into one contiguous shard per replica, gradients all-reduced with SUM of the per-shard
losses divided by the global batch size) and loads the trained weights back into the caller's
model.

Batch norm is synchronised across the replicas (lowering.LoweredModel._batch_norm all-reduces the
per-replica sums and counts, then the centred sums of squares), so a training step's statistics
are those of the whole global batch and the moving averages are updated identically on every
replica: data-parallel training is mathematically the same as single-device training on the
global batch, whatever the number of devices. Validation runs in inference mode on the first
device.
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from aiperf_core.backend import Dataset, EpochReport, TrainConfig


def make_strategy(devices: list[str]) -> tf.distribute.MirroredStrategy:
    from aiperf_backends.tensorflow.backend import tf_device_name

    names = [tf_device_name(d) for d in devices]
    return tf.distribute.MirroredStrategy(names)


def mirrored_copy(model, strategy):
    """The model lowered again under `strategy` (mirrored variables) with the same weights."""
    from aiperf_backends.tensorflow.lowering import LoweredModel

    with strategy.scope():
        return LoweredModel(model.graph, model.export_canonical(), model.precision)


def train_data_parallel(model, data: Dataset, config: TrainConfig, devices: list[str],
                        on_epoch: Callable[[EpochReport], Any] | None = None) -> list[EpochReport]:
    from aiperf_backends.tensorflow.training import Trainer, run_epochs

    strategy = make_strategy(devices)
    replica = mirrored_copy(model, strategy)
    trainer = Trainer(replica, config, strategy)
    reports = run_epochs(trainer, data, config, on_epoch)
    model.load_canonical(replica.export_canonical())
    return reports
