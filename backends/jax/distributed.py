"""Where a model's arrays live, and data parallelism over local devices with jax.sharding.

A `Placement` is the devices a model lives on: one device, or a 1-D mesh over several (axis
'batch'). Every path that feeds a model goes through its placement: lowering and weight import
(parameters), predict and loss_and_grads (inputs), training and evaluation (batches), so an input
never lands on a device other than its model's (issue 15.4).

With several devices one process drives them all. The parameters, the optimizer's state (SGD's
momentum buffers or AdamW's two moments) and batch-norm statistics are replicated (P()), and each
global batch is placed with NamedSharding(mesh, P('batch')) (its rows split over the devices). The
step is written over the global batch array, so XLA's SPMD partitioner inserts the all-reduces
itself: the gradients are those of the global batch's mean loss, and so are their 2-norm and the
clip it sets (TrainConfig.grad_clip), and the batch-norm statistics are those of the whole global
batch, exactly as on one device (up to float32 summation order). A batch whose size does not
divide by the number of devices (the last, short one) is replicated instead of sharded: the same
computation, done by every device.

Gradient accumulation (TrainConfig.micro_batch, training.make_micro_step): each device runs its
own rows of a split batch as consecutive micro-batches under shard_map and sums their gradients
locally, in an accumulator with a leading device axis; the update adds the devices' sums, the one
all-reduce of the step, then clips and updates as above. A replicated (short) batch accumulates
like one device's.

Expert parallelism (TrainConfig.expert_parallel, expert_parallel.py) uses the same mesh: each moe
node's expert stacks, and their optimizer state, are laid out NamedSharding(mesh, P('batch')) on their
E axis instead of replicated, and the moe runs under shard_map with all-to-all exchanges of tokens; the
rest of the model is data-parallel as above.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from aiperf_core.backend import BackendError

AXIS = "batch"


def device_name(device) -> str:
    """A jax device as the backend names it in devices(): 'cpu:0', 'gpu:1', 'tpu:0'."""
    return f"{device.platform}:{device.id}"


def local_device(name: str):
    """The local jax device called `name` (as devices() lists it)."""
    import jax

    for device in jax.local_devices():
        if device_name(device) == name:
            return device
    raise BackendError(f"jax has no local device '{name}' (it has {', '.join(map(device_name, jax.local_devices()))})")


class Placement:
    """The devices a model lives on: one device, or a 1-D mesh over several."""

    def __init__(self, devices: Sequence):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

        self.devices = tuple(devices)
        if not self.devices:
            raise BackendError("a placement needs at least one device")
        if len(self.devices) == 1:
            self.mesh = None
            self._replicated = self._sharded = SingleDeviceSharding(self.devices[0])
        else:
            self.mesh = Mesh(np.array(self.devices), (AXIS,))
            self._replicated = NamedSharding(self.mesh, P())
            self._sharded = NamedSharding(self.mesh, P(AXIS))

    @classmethod
    def default(cls) -> "Placement":
        """The first local device of the default platform (what lower() uses)."""
        import jax

        return cls(jax.local_devices()[:1])

    @classmethod
    def named(cls, names: Sequence[str]) -> "Placement":
        return cls([local_device(n) for n in names])

    @property
    def world(self) -> int:
        return len(self.devices)

    def names(self) -> list[str]:
        return [device_name(d) for d in self.devices]

    def replicate(self, tree):
        """A pytree (NumPy or jax arrays) on every device of the placement."""
        import jax

        return jax.device_put(tree, self._replicated)

    @property
    def replicated(self):
        """The sharding of an array every device holds whole."""
        return self._replicated

    def splits(self, rows: int) -> bool:
        """Whether a batch of `rows` is split over several devices (else each holds it whole)."""
        return self.world > 1 and rows % self.world == 0

    def batch_sharding(self, rows: int):
        """How a batch of `rows` images is laid out: its rows split over the devices when they split
        evenly, else replicated."""
        return self._sharded if rows % self.world == 0 else self._replicated

    def put_batch(self, *arrays):
        """Host arrays with a leading batch axis, issued to the devices (asynchronously: the copy
        overlaps whatever step the devices are running)."""
        import jax

        sharding = self.batch_sharding(len(arrays[0]))
        return jax.device_put(arrays, sharding)
