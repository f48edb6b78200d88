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

Across nodes (TrainConfig.layout with several nodes; docs/backends/jax.md, "Across nodes"): each node
is one process, and the processes are one jax program. `start_node` joins them through jax's own
distributed runtime (jax.distributed.initialize at node 0's coordination service, CPU collectives
through gloo) before the process first touches a device. The mesh is then every node's training
devices in the layout's order (global rank = node rank * devices per node + local rank:
`Placement.across_nodes`), and everything above holds over it unchanged, since every process traces
and runs the same jitted programs in the same order. What differs is what crosses between host and
devices: a batch is built with jax.make_array_from_process_local_data, each process giving its own
devices' rows of the global batch (every node reads the same data, so it can cut its own part); the
arrays a process cannot see whole (the expert stacks, sharded on E over every node) are gathered
(`Placement.to_host`: process_allgather); and the leader's stop decision reaches every process
(`agreed_stop`: broadcast_one_to_all), so that none runs a step the others do not.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from aiperf_core.backend import BackendError
from aiperf_core.replica_layout import ReplicaLayout

AXIS = "batch"
# agreed_stop's codes, broadcast from the leader
CONTINUE, STOP, ABORT = 0, 1, 2
_joined: tuple | None = None  # (coordinator, nodes, node rank) this process joined by start_node


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


def host_port(addr: str, port: int) -> str:
    """addr:port as gRPC reads it (an IPv6 address in brackets)."""
    return f"[{addr}]:{port}" if ":" in addr and not addr.startswith("[") else f"{addr}:{port}"


def start_node(layout: ReplicaLayout, initialise: Callable[[], Any]) -> None:
    """Join this process to its replica's jax program: jax.distributed.initialize at the launch's
    coordinator (node 0 starts the coordination service there), once per process, before jax makes
    its clients; `initialise` (backend.initialise) then makes them. A second call with the same
    layout does nothing.

    The bound of the layout (timeout_s) is each of jax's own: how long a node waits for the others to
    join (initialization_timeout, and the CPU client's topology exchange, in whole minutes), and how
    long a node may go without a heartbeat before the coordination service declares it dead
    (heartbeat_timeout_seconds), whereupon jax ends every other process of the program (its fatal
    "Terminating process because the JAX distributed service detected fatal errors", naming the
    task, which is the node rank): a lost node fails its peers within about that bound rather than
    leave them waiting in a collective. Cluster detection is off: the layout names the coordinator
    (the roster's, whatever started the nodes); jax's SLURM detection would also cut each process
    down to one device (SLURM_LOCALID), where an aiperf node is one process driving all its devices.
    jax's preemption service is off too: it catches SIGTERM, and an executor ends a replica with it."""
    import jax

    global _joined
    address = host_port(layout.coordinator_addr, layout.coordinator_port)
    wanted = (address, layout.nodes, layout.node_rank)
    if jax.distributed.is_initialized():
        if _joined != wanted:
            raise BackendError(f"this process already joined a jax program ({_joined or 'not by start_node'}); it "
                               f"cannot join {address} as node {layout.node_rank} of {layout.nodes}")
        initialise()
        return
    bound = max(1, math.ceil(layout.timeout_s))
    minutes = max(1, math.ceil(layout.timeout_s / 60))
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_enable_preemption_service", False)
        jax.config.update("jax_cpu_get_local_topology_timeout_minutes", minutes)
        jax.config.update("jax_cpu_get_global_topology_timeout_minutes", minutes + 1)
        jax.distributed.initialize(coordinator_address=address, num_processes=layout.nodes,
                                   process_id=layout.node_rank, cluster_detection_method="deactivate",
                                   initialization_timeout=bound, heartbeat_timeout_seconds=bound,
                                   shutdown_timeout_seconds=bound,
                                   coordinator_bind_address=address if layout.leads else None)
    except (RuntimeError, ValueError) as exc:  # e.g. jax already made its clients in this process
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise BackendError(f"node {layout.node_rank} ({layout.host(layout.node_rank)}) could not join the jax "
                           f"program at {address}: {first}") from None
    _joined = wanted
    initialise()


def check_joined(layout: ReplicaLayout) -> None:
    """A BackendError unless this process is node `layout.node_rank` of a jax program of `layout.nodes`
    processes (start_node)."""
    import jax

    if not jax.distributed.is_initialized():
        raise BackendError(f"TrainConfig.layout: {layout.nodes} nodes, but this process never joined them "
                           f"(Backend.start_node was not called before jax first ran)")
    if (jax.process_count(), jax.process_index()) != (layout.nodes, layout.node_rank):
        raise BackendError(f"TrainConfig.layout: node {layout.node_rank} of {layout.nodes}, but this process joined "
                           f"as node {jax.process_index()} of {jax.process_count()}")


class Placement:
    """The devices a model lives on: one device, or a 1-D mesh over several (of this process, or of
    every process of a replica across nodes: `across_nodes`)."""

    def __init__(self, devices: Sequence):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

        self.devices = tuple(devices)
        if not self.devices:
            raise BackendError("a placement needs at least one device")
        # Where this process's devices sit in the mesh: a contiguous run (across_nodes orders them so).
        mine = [i for i, d in enumerate(self.devices) if d.process_index == jax.process_index()]
        self.spans_processes = len(mine) < len(self.devices)
        self.own = (mine[0], mine[-1] + 1) if mine else (0, 0)
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

    @classmethod
    def across_nodes(cls, names: Sequence[str], layout: ReplicaLayout) -> "Placement":
        """Every node's training devices, this node's being `names`, in the layout's order: node by node,
        each node's in its own order. The processes tell each other which devices they train on (a
        collective: every node calls this, at the same point of its trial)."""
        import jax
        from jax.experimental import multihost_utils

        check_joined(layout)
        local = [local_device(n) for n in names]
        ids = np.asarray(multihost_utils.process_allgather(np.array([d.id for d in local], np.int32)))
        if ids.shape != (layout.nodes, layout.devices_per_node):
            raise BackendError(f"TrainConfig.layout: {layout.devices_per_node} device(s) per node, but the nodes train "
                               f"on {ids.reshape(layout.nodes, -1).shape[1]} each")
        by_id = {d.id: d for d in jax.devices()}
        return cls([by_id[int(i)] for i in ids.reshape(-1)])

    @property
    def world(self) -> int:
        return len(self.devices)

    def names(self) -> list[str]:
        return [device_name(d) for d in self.devices]

    def replicate(self, tree):
        """A pytree (NumPy or jax arrays) on every device of the placement."""
        return self.put(tree, self._replicated)

    def put(self, tree, shardings):
        """A pytree (NumPy or jax arrays) laid out by `shardings` (one, or a pytree of them, on this
        placement's devices). Across processes every process holds the same values and places its own
        devices' parts from the host: jax moves no array of one process to another's devices."""
        import jax

        if self.spans_processes:  # an array on this process's devices only goes by the host
            tree = jax.tree_util.tree_map(lambda leaf: leaf if getattr(leaf, "is_fully_addressable", True) is False
                                          else np.asarray(leaf), tree)
        return jax.device_put(tree, shardings)

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
        if not self.spans_processes:
            return jax.device_put(arrays, sharding)
        # Each process gives its own devices' rows (all of them where the batch is replicated).
        rows = slice(None)
        if sharding is self._sharded:
            per = len(arrays[0]) // self.world
            rows = slice(self.own[0] * per, self.own[1] * per)
        return tuple(jax.make_array_from_process_local_data(sharding, np.ascontiguousarray(a[rows]), a.shape)
                     for a in arrays)

    def to_host(self, tree):
        """A pytree of arrays on the placement as whole NumPy arrays. An array split over processes (an
        expert stack across nodes) is gathered from all of them: across nodes every process calls this
        at the same point."""
        import jax
        from jax.experimental import multihost_utils

        leaves, structure = jax.tree_util.tree_flatten(tree)
        split = [i for i, leaf in enumerate(leaves) if not (leaf.is_fully_addressable or leaf.is_fully_replicated)]
        gathered = multihost_utils.process_allgather([leaves[i] for i in split], tiled=True) if split else []
        whole = dict(zip(split, gathered))
        return jax.tree_util.tree_unflatten(structure, [np.asarray(whole[i] if i in whole else leaf)
                                                        for i, leaf in enumerate(leaves)])


def agreed_stop(placement: Placement, on_epoch, report) -> bool:
    """on_epoch's answer for `report` (whether training stops after this epoch). Across processes only
    the leader has on_epoch; its answer reaches every process, which must run the same programs in the
    same order. A leader whose on_epoch raised tells the others to end the trial, then raises."""
    if not placement.spans_processes:
        return bool(on_epoch(report)) if on_epoch is not None else False
    from jax.experimental import multihost_utils

    code, error = CONTINUE, None
    if on_epoch is not None:
        try:
            code = STOP if on_epoch(report) else CONTINUE
        except BaseException as exc:  # the followers must not wait for a next step that never comes
            code, error = ABORT, exc
    code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
    if error is not None:
        raise error
    if code == ABORT:
        raise BackendError(f"node 0 ended the trial after epoch {report.epoch} (its epoch callback failed)")
    return code == STOP
