"""The data-parallel gradient all-reduce, priced apart from the step (EpochReport.all_reduce_seconds).

With several devices the step is written over the global batch and XLA inserts the gradients'
all-reduce into the compiled step (distributed.py), scheduled among the backward's products, where no
host clock can see it. As the experts' all-to-all (expert_parallel.AllToAllTimer), it is measured apart
instead: at the end of every epoch, while no step runs, a jitted shard_map of jax.lax.psum over the
step's own mesh, on a float32 buffer of the elements the step all-reduces per device (every trainable
parameter but the expert stacks under expert parallelism: aiperf_opcount.communication.gradient_bytes),
compiled once per mesh and size, is run a few times and the median taken; the epoch's figure is that
times the optimiser steps whose batch was split over the devices (a batch that does not split evenly
is replicated, and its gradients need no all-reduce). It is the collective's whole duration: what XLA
overlaps with the backward's computation in the real step is not taken off, so it bounds the step's
wait from above. The bytes are analytic (docs/scoring.md), not this buffer's.
"""

from __future__ import annotations

from aiperf_backends.jax.distributed import AXIS
from aiperf_backends.jax.expert_parallel import time_all_to_all

# (device names, elements) -> (the jitted all-reduce, a buffer on the mesh)
_REDUCES: dict = {}


class AllReduceTimer:
    """The epoch's all-reducing steps, counted as they run (`add`), and their time (`lap`)."""

    def __init__(self, mesh, names: tuple[str, ...], elements: int):
        self.mesh, self.names, self.elements = mesh, tuple(names), int(elements)
        self.steps = 0

    def add(self) -> None:
        self.steps += 1

    def lap(self) -> float | None:
        """The seconds of the steps counted since the last lap (None when none ran), the all-reduce timed
        now: call it between epochs, while no step runs (on every node alike: it is a collective)."""
        steps, self.steps = self.steps, 0
        if not steps or not self.elements:
            return None
        key = (self.names, self.elements)
        if key not in _REDUCES:
            _REDUCES[key] = compiled_all_reduce(self.mesh, self.elements)
        return float(steps * time_all_to_all(*_REDUCES[key]))


def compiled_all_reduce(mesh, elements: int):
    """(a jitted jax.lax.psum of a float32 buffer of `elements` per device over `mesh`; a buffer for it on
    the mesh), compiled by one call."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    world = int(mesh.shape[AXIS])
    reduce = jax.jit(jax.shard_map(lambda b: lax.psum(b, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    # Made sharded, so that no device ever holds more than its own `elements` (a whole world's copy of the
    # gradients on one device could exceed its memory beside a large model's).
    buffer = jax.jit(lambda: jnp.ones((world * elements,), jnp.float32), out_shardings=NamedSharding(mesh, P(AXIS)))()
    reduce(buffer).block_until_ready()  # compiles
    return reduce, buffer
