"""Data parallelism over several local devices with tf.distribute.MirroredStrategy (in process).

`train_data_parallel` re-lowers the graph under the strategy's scope with the model's current
weights (mirrored variables, one copy on each of exactly the devices asked for), trains it with
training.run_epochs (each global batch cut into one contiguous shard per replica, gradients
all-reduced with SUM of the per-shard losses divided by the global batch size; every replica then
applies the same optimizer update, SGD with momentum or AdamW, to the all-reduced gradients,
clipped by their global norm when TrainConfig.grad_clip asks) and loads the trained weights back
into the caller's model.

Batch norm is synchronised across the replicas (lowering.LoweredModel._batch_norm all-reduces the
per-replica sums and counts, then the centred sums of squares), so a training step's statistics
are those of the whole global batch and the moving averages are updated identically on every
replica: data-parallel training is mathematically the same as single-device training on the
global batch, whatever the number of devices. Validation runs in inference mode on the first
device. The data-parallel step is not compiled with XLA (the all-reduces sit inside it).

With TrainConfig.micro_batch, a replica whose shard is larger runs it as micro-batches and the
gradients are all-reduced once, after the last of them (training.Trainer._accumulated_gradients);
batch norm then normalises each micro-batch by its own statistics, unsynchronised. Streamed data
(an image stream, a TokenStream) is read in this process, one global batch at a time, and cut into
the replicas' shards on their devices: nothing is copied to other processes.
"""

from __future__ import annotations

from typing import Any, Callable

from aiperf_core.backend import Dataset, EpochReport, TrainConfig
from aiperf_backends.tensorflow.backend import framework

tf = framework()  # configured before any use (backend.py): oneDNN, threads, AIPERF_CPU_DEVICES


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A MirroredStrategy whose collectives have group keys of their own. TensorFlow numbers every
    strategy's collective groups from 1, so a second strategy over a different set of devices in
    the same process (two trials on different devices, the kit's one- and two-device runs) would
    join group 1 with another size, and its first all-reduce would abort."""

    def __init__(self, devices: list[str], key_base: int):
        self._collective_key_base = key_base  # read by MirroredExtended's constructor
        super().__init__(devices)


_strategies: dict[tuple[str, ...], tf.distribute.MirroredStrategy] = {}
_KEYS_PER_STRATEGY = 1 << 20  # group keys apart: far more groups than one strategy makes


def make_strategy(devices: list[str]) -> tf.distribute.MirroredStrategy:
    """The strategy over exactly `devices` (backend device names), made once a process per set."""
    from aiperf_backends.tensorflow.backend import tf_device_name

    key = tuple(devices)
    if key not in _strategies:
        _strategies[key] = _MirroredStrategy([tf_device_name(d) for d in devices],
                                             key_base=len(_strategies) * _KEYS_PER_STRATEGY)
    return _strategies[key]


def mirrored_copy(model, strategy, first_device: str):
    """The model lowered again under `strategy` (mirrored variables) with the same weights."""
    from aiperf_backends.tensorflow.lowering import LoweredModel

    with strategy.scope():
        return LoweredModel(model.graph, model.export_canonical(), model.precision, first_device)


def train_data_parallel(model, data: Dataset, config: TrainConfig, devices: list[str],
                        on_epoch: Callable[[EpochReport], Any] | None = None) -> list[EpochReport]:
    from aiperf_backends.tensorflow.training import Trainer, run_epochs

    strategy = make_strategy(devices)
    replica = mirrored_copy(model, strategy, devices[0])
    trainer = Trainer(replica, config, strategy)
    reports = run_epochs(trainer, data, config, on_epoch)
    model.load_canonical(replica.export_canonical())
    return reports
