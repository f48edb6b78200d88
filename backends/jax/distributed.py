"""Data parallelism over the local devices with jax.sharding.

One process drives every local device. A 1-D mesh over jax.devices() has the axis 'batch'; each
global batch is placed with NamedSharding(mesh, P('batch')) (its rows split over the devices) and
the parameters, momentum buffers and batch-norm statistics are replicated (P()). The step is
written over the global batch array, so XLA's SPMD partitioner inserts the all-reduces itself:
the gradients are those of the global batch's mean loss and the batch-norm statistics are those
of the whole global batch, exactly as on one device (up to float32 summation order). A batch
whose size does not divide by the number of devices (the last, short one) is replicated instead
of sharded: the same computation, done by every device. With one device there is no mesh and
nothing is placed: a no-op.
"""

from __future__ import annotations

import numpy as np

AXIS = "batch"


def make_mesh(devices=None):
    """A 1-D mesh over `devices` (default: all local devices), or None for a single device."""
    import jax
    from jax.sharding import Mesh

    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) < 2:
        return None
    return Mesh(np.array(devices), (AXIS,))


def replicate(mesh, tree):
    if mesh is None:
        return tree
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(tree, NamedSharding(mesh, P()))


def place_batch(mesh, x: np.ndarray, y: np.ndarray):
    """The global batch on the devices: rows sharded when they split evenly, else replicated."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if mesh is None:
        return jnp.asarray(x), jnp.asarray(y)
    world = mesh.devices.size
    spec = P(AXIS) if len(x) % world == 0 else P()
    return jax.device_put(x, NamedSharding(mesh, spec)), jax.device_put(y, NamedSharding(mesh, spec))
