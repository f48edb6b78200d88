"""One object names a replica's parallel layout, and where this process stands in it.

A replica is one or more nodes (the policy item `nodes_per_replica`), each with the same number of
devices. Its devices are numbered node by node: global rank = node_rank * devices_per_node +
local rank, so the ranks of one node are contiguous and a node's devices are its local devices in
the backend's order. Every device takes a contiguous shard of each global batch (data parallelism,
degree = every device of the replica); under expert parallelism each moe node's experts are split
over the same devices (degree = the same). A backend builds its process groups or its mesh from
this object and nothing else (torchtitan's ParallelDims is the model).

Node 0 leads: it runs the replica's trial loop and reports. The nodes meet at the coordinator, an
address of node 0 and a port it chose for the trial (torch's TCP store, jax's coordination
service). docs/workflow.md, "A replica across nodes", tells the whole story.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiperf_core.errors import AiperfError

NODE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ReplicaLayout:
    nodes: int = 1
    devices_per_node: int = 1
    node_rank: int = 0  # this process's node
    local_devices: tuple[str, ...] = ()  # this node's devices, by local rank (backend device names)
    hosts: tuple[str, ...] = ()  # every node's host name, by node rank, for messages and records
    coordinator_addr: str = "127.0.0.1"  # where the nodes meet: node 0's address ...
    coordinator_port: int = 0  # ... and the port it chose (0: not chosen; one node needs none)
    expert_parallel: bool = False
    # How long a node waits on its peers (the rendezvous, a collective) before it gives up on them:
    # the bound within which a lost node fails its trial (the policy item `node_timeout_s`).
    timeout_s: float = NODE_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AiperfError(f"replica layout: {name} must be a whole number >= 1, got {value!r}")
        if not 0 <= self.node_rank < self.nodes:
            raise AiperfError(f"replica layout: node_rank {self.node_rank} is not one of the {self.nodes} nodes")
        if self.local_devices and len(self.local_devices) != self.devices_per_node:
            raise AiperfError(f"replica layout: {len(self.local_devices)} local devices, but devices_per_node is "
                              f"{self.devices_per_node}")
        if self.hosts and len(self.hosts) != self.nodes:
            raise AiperfError(f"replica layout: {len(self.hosts)} hosts for {self.nodes} nodes")
        if not self.timeout_s > 0:
            raise AiperfError(f"replica layout: timeout_s must be > 0, got {self.timeout_s!r}")
        if self.nodes > 1 and not 0 < self.coordinator_port < 65536:
            raise AiperfError(f"replica layout: {self.nodes} nodes need a coordinator port, got "
                              f"{self.coordinator_port!r}")

    @property
    def world(self) -> int:
        """Every device of the replica."""
        return self.nodes * self.devices_per_node

    @property
    def data_parallel(self) -> int:
        return self.world

    @property
    def expert_parallel_degree(self) -> int:
        return self.world if self.expert_parallel else 1

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def leads(self) -> bool:
        """Whether this process's node runs the trial loop and receives the reports."""
        return self.node_rank == 0

    def global_rank(self, local_rank: int) -> int:
        if not 0 <= local_rank < self.devices_per_node:
            raise AiperfError(f"replica layout: local rank {local_rank} is not one of the {self.devices_per_node} "
                              f"devices of a node")
        return self.node_rank * self.devices_per_node + local_rank

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def host(self, node_rank: int) -> str:
        """A node's host name for a message, or 'node K' where the hosts are not known."""
        return self.hosts[node_rank] if self.hosts else f"node {node_rank}"

    def describe(self) -> str:
        return (f"{self.nodes} node(s) x {self.devices_per_node} device(s)"
                + (", experts sharded over every device" if self.expert_parallel else ""))
