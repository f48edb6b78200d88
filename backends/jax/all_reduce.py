"""The data-parallel gradient all-reduce, priced apart from the step (EpochReport.all_reduce_seconds).

With several devices the step is written over the global batch and XLA inserts the gradients'
all-reduce into the compiled step (distributed.py), scheduled among the backward's products, where no
host clock can see it. As the experts' all-to-all (expert_parallel.AllToAllTimer), it is measured apart
instead: at the end of every epoch, while no step runs, a jitted shard_map of jax.lax.psum over the
step's own mesh, on a float32 buffer of the elements the step all-reduces per device (every trainable
parameter but the expert stacks under expert parallelism: aiperf_opcount.communication.gradient_bytes),
compiled ahead of time once per mesh and size (lowered and compiled, never run to compile it), is run
and timed (`price`, below); the epoch's figure is that
times the optimiser steps whose batch was split over the devices (a batch that does not split evenly
is replicated, and its gradients need no all-reduce). It is the collective's whole duration: what XLA
overlaps with the backward's computation in the real step is not taken off, so it bounds the step's
wait from above. The bytes are analytic (docs/scoring.md), not this buffer's.

The pricing is itself communication outside the steps: on a slow link each run costs what a step's
all-reduce does (0.75 s for 1.87 MB at 20 Mbit/s, docs/performance.md, "2026-12-07: the interconnect on
this machine"). Its wall seconds are reported apart (`AllReduceTimer.priced_in`: EpochReport.pricing_seconds),
which the run's ideal-network score gives back with the waits. It is kept short all the same: the
compilation runs none, and a run that took LONG_RUN_S or more is the price by itself (its timer's noise
is small beside it); a shorter one is run PRICING_REPEATS times in all and the median taken, which
ignores one outlier. Every process must run the collective as many times, so they decide on the mean of
their first runs' times, summed by a scalar psum over the same mesh: the same figure on every process.
"""

from __future__ import annotations

import statistics
import time

from aiperf_backends.jax.distributed import AXIS
from aiperf_backends.jax.expert_parallel import time_all_to_all

# (device names, elements) -> (the compiled all-reduce, a buffer on the mesh)
_REDUCES: dict = {}
PRICING_REPEATS = 3  # runs of a short all-reduce at each epoch's end (the module's docstring)
LONG_RUN_S = 0.1  # a first run this long is the price by itself


class AllReduceTimer:
    """The epoch's all-reducing steps, counted as they run (`add`), and their time (`lap`)."""

    def __init__(self, mesh, names: tuple[str, ...], elements: int):
        self.mesh, self.names, self.elements = mesh, tuple(names), int(elements)
        self.steps = 0
        self.priced_in = 0.0  # wall seconds of the last lap's collectives, compilation excluded

    def add(self) -> None:
        self.steps += 1

    def lap(self) -> float | None:
        """The seconds of the steps counted since the last lap (None when none ran), the all-reduce timed
        now: call it between epochs, while no step runs (on every node alike: it is a collective)."""
        steps, self.steps, self.priced_in = self.steps, 0, 0.0
        if not steps or not self.elements:
            return None
        for elements in (self.elements, 1):  # the gradients', and the scalar that agrees on the repeats
            if (self.names, elements) not in _REDUCES:
                _REDUCES[(self.names, elements)] = compiled_all_reduce(self.mesh, elements)
        started = time.perf_counter()
        seconds = price(_REDUCES[(self.names, self.elements)], _REDUCES[(self.names, 1)], self.mesh)
        self.priced_in = time.perf_counter() - started
        return float(steps * seconds)


def price(gradients, scalar, mesh) -> float:
    """Seconds of one run of the compiled all-reduce `gradients` (reduce, buffer): its first run where the
    processes' mean first run took LONG_RUN_S or more (the module's docstring), else the median of
    PRICING_REPEATS runs. `scalar` (reduce, buffer) is the same psum of one element per device."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    reduce, buffer = gradients
    started = time.perf_counter()
    reduce(buffer).block_until_ready()
    first = time.perf_counter() - started
    local = len(mesh.local_devices)
    mine = jax.make_array_from_process_local_data(NamedSharding(mesh, P(AXIS)), np.full(local, first, np.float32))
    summed = scalar[0](mine)
    mean_first = float(np.asarray(summed.addressable_shards[0].data)[0]) / int(mesh.shape[AXIS])
    if mean_first >= LONG_RUN_S:
        return first
    return statistics.median([first] + [time_all_to_all(reduce, buffer, repeats=1) for _ in range(PRICING_REPEATS - 1)])


def compiled_all_reduce(mesh, elements: int):
    """(a jax.lax.psum of a float32 buffer of `elements` per device over `mesh`, compiled ahead of time; a
    buffer for it on the mesh)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P

    world = int(mesh.shape[AXIS])
    reduce = jax.jit(jax.shard_map(lambda b: lax.psum(b, AXIS), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
    # Made sharded, so that no device ever holds more than its own `elements` (a whole world's copy of the
    # gradients on one device could exceed its memory beside a large model's).
    buffer = jax.jit(lambda: jnp.ones((world * elements,), jnp.float32), out_shardings=NamedSharding(mesh, P(AXIS)))()
    return reduce.lower(buffer).compile(), buffer  # compiled without running: no bytes sent
