"""Collective timing on jax, for `aiperf probe network` (Backend.probe_collectives).

The ranks are every node's devices, one process per node, the processes one jax program joined by
Backend.start_node (jax.distributed, CPU collectives through gloo), the mesh every node's devices in
the layout's order (Placement.across_nodes, as training builds it); on one node, its local devices.
all-reduce is a jitted shard_map of jax.lax.psum, all-to-all of jax.lax.all_to_all (tiled: each
device sends an equal share of its buffer to every device), each compiled ahead of time on a float32
buffer of zeros sharded over the mesh, so that no compilation is timed. A barrier is a compiled psum
of one element per device; each timed iteration is a barrier, the clock, the collective, and
block_until_ready. The processes' times are gathered (process_allgather) and each iteration's slowest
kept, so that every process plans a size's iterations from the same figure.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import numpy as np

from aiperf_core.network.probe import element_count, iteration_plan
from aiperf_core.replica_layout import ReplicaLayout

HOST_NAME_BYTES = 255  # a host name travels as a fixed row of bytes (process_allgather gathers arrays)


def probe_collectives(layout: ReplicaLayout, devices: list[str], collectives: tuple[str, ...], sizes: list[int],
                      iterations: int, warmup: int, seconds_per_size: float) -> dict[str, Any] | None:
    """Backend.probe_collectives on jax; `devices` this node's (start_node already joined the nodes)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from aiperf_backends.jax.distributed import AXIS, Placement

    placement = Placement.across_nodes(devices, layout) if layout.multi_node else Placement.named(devices)
    mesh, world = placement.mesh, placement.world
    sharded = NamedSharding(mesh, P(AXIS))

    def slowest(values: list[float]) -> list[float]:
        gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.float64)))
        return gathered.reshape(-1, len(values)).max(axis=0).tolist()

    name = socket.gethostname().encode()[:HOST_NAME_BYTES]
    row = np.zeros(HOST_NAME_BYTES, np.uint8)
    row[:len(name)] = np.frombuffer(name, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(row)).reshape(-1, HOST_NAME_BYTES)
    hosts = [bytes(r).rstrip(b"\0").decode(errors="replace") for r in rows]

    def compiled(body, count: int):
        function = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        buffer = jax.jit(lambda: jnp.zeros((world * count,), jnp.float32), out_shardings=sharded)()
        return function.lower(buffer).compile(), buffer

    barrier, token = compiled(lambda b: lax.psum(b, AXIS), 1)
    bodies = {"all_reduce": lambda b: lax.psum(b, AXIS),
              "all_to_all": lambda b: lax.all_to_all(b, AXIS, 0, 0, tiled=True)}
    results: dict[str, list[dict[str, Any]]] = {}
    for collective in collectives:
        out = []
        for size in sizes:
            count = element_count(collective, size, world)
            run, buffer = compiled(bodies[collective], count)

            def timed() -> float:
                barrier(token).block_until_ready()
                start = time.perf_counter()
                run(buffer).block_until_ready()
                return time.perf_counter() - start

            first = slowest([timed()])[0]
            extra_warmup, timed_iterations = iteration_plan(first, iterations, warmup, seconds_per_size)
            for _ in range(extra_warmup):
                run(buffer).block_until_ready()
            out.append({"bytes": count * 4, "seconds": slowest([timed() for _ in range(timed_iterations)])})
            del run, buffer
        results[collective] = out
    if not layout.leads:
        return None
    return {"device": placement.devices[0].platform, "hosts": hosts, "ranks_per_node": len(devices),
            "collectives": results}
