"""An analytic model of a cluster's network, for the scale simulation (aiperf_core.workflow.simulation,
docs/performance.md "f. The scale simulation", issue #48 item 6).

It prices the two collectives a replica's step waits on, by their latency and bandwidth terms, as
ASTRA-sim's analytical backend and NCCL's own tuning model do (no packets, no flows):

- **ring all-reduce** of G bytes over n = N x D ranks (N nodes of D devices, ranks node-major, as
  aiperf_core.replica_layout places them): 2(n - 1) steps (n - 1 of reduce-scatter, n - 1 of
  all-gather), each moving a chunk of G / n over every ring link at once, so

      T_ar = 2(n - 1) x alpha + 2(n - 1)/n x G / B

  with alpha and B the latency and bandwidth of the ring's slowest link: on N > 1 nodes one link per
  node leaves it (its last device to the next node's first), priced at the node's injection
  bandwidth; on one node every link is intra-node (NVLink or the like). 2(n - 1)/n x G is what
  opcount.communication.ring_bytes_per_rank counts, so B is nccl-tests' bus bandwidth.

- **all-to-all** of a payload P (opcount.communication.all_to_all_bytes: every (token, choice) out and
  back, the whole replica's) over n ranks, spread evenly: each rank holds P / n and keeps 1/n of it;
  a node sends P (N - 1) / N^2 off-node through its injection link, and each rank P (D - 1) / n^2 to
  the other devices of its node. The two proceed at once on different links, so

      T_a2a = k x (n - 1) x alpha_a2a + max(P (N - 1)/N^2 / B_a2a,  P (D - 1)/n^2 / B_intra)

  for k collectives (a moe layer's exchanges: out and back, forward and backward) carrying P in all.

**The fat tree.** Nodes hang off leaf switches of `nodes_per_leaf` nodes; a leaf's uplinks carry
1/oversubscription of its nodes' injection bandwidth (1 is non-blocking). Every replica runs the same
collectives at once, so a leaf's uplinks carry f x (its nodes' inter-node bytes), f the share of a
node's inter-node bytes whose peer is on another leaf, averaged over the leaf. With r the ratio, the
uplinks take r x f times as long as the nodes' own links, and the slower bounds the transfer:

      B_effective = B / max(1, r x f)

f depends on where the scheduler puts a replica's nodes (`placement`):

- `packed`: replicas on consecutive nodes, one after another from the machine's first node (a
  topology-aware scheduler). f is counted over one period of that layout. A replica of
  N <= nodes_per_leaf nodes, N dividing it, never leaves its leaf: f = 0. One of N = m x leaf nodes:
  the ring leaves each leaf once (f = 1/leaf size, so r x f <= 1 whenever a leaf has at least r
  nodes), the all-to-all sends (N - leaf)/(N - 1) of its bytes off-leaf.
- `scattered`: a replica's nodes anywhere in a machine of M nodes (a topology-unaware or fragmented
  allocation): a peer is on another leaf with probability f = (M - leaf)/(M - 1), for both
  collectives.

What the model leaves out (docs/performance.md says so beside its figures): contention between flows
(it is a fluid bound per link: no congestion control, incast, retransmissions, or adaptive routing's
imbalance), the spread of f between leaves (the mean is used, where a ring waits on its slowest link),
NCCL's other algorithms (trees, hierarchical and NVLS all-reduce), bucketing (DDP's all-reduce of
several buckets, each paying its own latency), and the traffic of the shared filesystem and the
primary. Whether a step hides its communication behind computation is the caller's assumption
(simulation.ReplicaModel.all_reduce_overlap).

**Calibration.** `Network.from_probe` reads what `aiperf probe network` writes (kind
"aiperf-probe-network", version 1): each collective's fit of its measured times to
latency + bytes / bandwidth. Its bandwidth is nccl-tests' bus bandwidth, which is what B is. Its
latency is the whole collective's, so it is divided by the collective's rounds on the probe's n ranks:
alpha = latency / (2 (n - 1)) for the ring all-reduce, latency / (n - 1) for the all-to-all.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from aiperf_core.errors import AiperfError

PLACEMENTS = ("packed", "scattered")
PROBE_KIND, PROBE_VERSION = "aiperf-probe-network", 1
# Within an H100 (SXM) node: NVLink 4 moves 450 GB/s each way per GPU; a step across it starts in
# about a microsecond. Used for rings and exchanges that stay inside a node.
NVLINK_BYTES_PER_S = 450e9
NVLINK_LATENCY_S = 1e-6
# An InfiniBand or RoCE hop between nodes, per ring step: a few microseconds (NCCL's tuning model
# charges about this much per network step of its ring).
NETWORK_LATENCY_S = 5e-6
NODES_PER_LEAF = 32  # a leaf switch of 64 ports: 32 nodes down, 32 links up when non-blocking


@dataclass(frozen=True)
class Network:
    """A cluster's network (module docstring): each node's injection link to a leaf switch of a fat tree,
    and the links between the devices of a node."""

    injection_bytes_per_s: float  # each node's link, each way: the ring all-reduce's bus bandwidth
    latency_s: float = NETWORK_LATENCY_S  # alpha: one ring step (one message) between nodes
    oversubscription: float = 1.0  # a leaf's down-links over its up-links' bandwidth; 1 = non-blocking
    nodes_per_leaf: int = NODES_PER_LEAF
    placement: str = "packed"
    intra_node_bytes_per_s: float = NVLINK_BYTES_PER_S
    intra_node_latency_s: float = NVLINK_LATENCY_S
    # The all-to-all's own figures where a probe measured them (None: the all-reduce's).
    all_to_all_bytes_per_s: float | None = None
    all_to_all_latency_s: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        for field_name in ("injection_bytes_per_s", "intra_node_bytes_per_s"):
            if not getattr(self, field_name) > 0:
                raise AiperfError(f"network: {field_name} must be > 0, got {getattr(self, field_name)!r}")
        for field_name in ("latency_s", "intra_node_latency_s"):
            if not getattr(self, field_name) >= 0:
                raise AiperfError(f"network: {field_name} must be >= 0, got {getattr(self, field_name)!r}")
        if not self.oversubscription >= 1:
            raise AiperfError(f"network: oversubscription must be >= 1 (1 is non-blocking), "
                              f"got {self.oversubscription!r}")
        if isinstance(self.nodes_per_leaf, bool) or not isinstance(self.nodes_per_leaf, int) or self.nodes_per_leaf < 1:
            raise AiperfError(f"network: nodes_per_leaf must be a whole number >= 1, got {self.nodes_per_leaf!r}")
        if self.placement not in PLACEMENTS:
            raise AiperfError(f"network: placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")

    @classmethod
    def link(cls, gbit_per_s: float, **fields: Any) -> "Network":
        """A network of `gbit_per_s` per node (each way), e.g. Network.link(400) for NDR InfiniBand."""
        return cls(injection_bytes_per_s=gbit_per_s * 1e9 / 8, **fields)

    @classmethod
    def from_probe(cls, probe: "str | Path | Mapping[str, Any]", **fields: Any) -> "Network":
        """The network a probe measured (`aiperf probe network`'s JSON, a path to it or its dict): the all-reduce
        fit's bus bandwidth as the injection bandwidth, its latency over the ring's 2(n - 1) steps as alpha; the
        all-to-all's, where the probe fitted one, likewise (latency over n - 1 rounds; its bus bandwidth is per
        rank, so a node's link moves ranks_per_node of them, of which (n - ranks_per_node)/(n - 1) leave the
        node). `fields` sets the rest (the fat tree, the intra-node links)."""
        data = probe if isinstance(probe, Mapping) else _read_probe(Path(probe))
        where = "network probe"
        if data.get("kind") != PROBE_KIND or data.get("version") != PROBE_VERSION:
            raise AiperfError(f"{where}: not an {PROBE_KIND} record of version {PROBE_VERSION} "
                              f"(kind {data.get('kind')!r}, version {data.get('version')!r})")
        nodes, ranks, per_node = (_whole(data, key, where) for key in ("nodes", "ranks", "ranks_per_node"))
        if nodes < 2:
            raise AiperfError(f"{where}: it ran on {nodes} node; one node's collectives never touch the network")
        if ranks != nodes * per_node:
            raise AiperfError(f"{where}: {ranks} ranks are not {nodes} nodes x {per_node} ranks per node")
        fit = data.get("fit")
        if not isinstance(fit, Mapping) or not isinstance(fit.get("all_reduce"), Mapping):
            raise AiperfError(f"{where}: no fit.all_reduce")
        all_reduce = fit["all_reduce"]
        values = dict(injection_bytes_per_s=_positive(all_reduce, "busbw_bytes_per_s", f"{where} fit.all_reduce"),
                      latency_s=_non_negative(all_reduce, "latency_s", f"{where} fit.all_reduce") / (2 * (ranks - 1)),
                      name=f"probe of {nodes} nodes")
        all_to_all = fit.get("all_to_all")
        if isinstance(all_to_all, Mapping):
            busbw = _positive(all_to_all, "busbw_bytes_per_s", f"{where} fit.all_to_all")
            values["all_to_all_bytes_per_s"] = busbw * per_node * (ranks - per_node) / (ranks - 1)
            values["all_to_all_latency_s"] = (_non_negative(all_to_all, "latency_s", f"{where} fit.all_to_all")
                                              / (ranks - 1))
        values.update(fields)
        return cls(**values)

    def with_(self, **fields: Any) -> "Network":
        return replace(self, **fields)

    # --- the fat tree ---------------------------------------------------------------------------
    def off_leaf_share(self, collective: str, nodes: int, machine_nodes: int | None = None) -> float:
        """f: the share of a node's inter-node bytes whose peer is on another leaf, averaged over a leaf, for a
        replica of `nodes` nodes in a machine of `machine_nodes` (module docstring, "The fat tree")."""
        leaf = self.nodes_per_leaf
        if nodes <= 1:
            return 0.0
        if self.placement == "scattered":
            machine = max(machine_nodes or nodes, nodes)
            return max(0, machine - leaf) / (machine - 1)
        return _packed_off_leaf_share(collective, nodes, leaf)

    def slowdown(self, collective: str, nodes: int, machine_nodes: int | None = None) -> float:
        """max(1, r x f): how much slower than the nodes' own links the leaves' uplinks make inter-node bytes."""
        return max(1.0, self.oversubscription * self.off_leaf_share(collective, nodes, machine_nodes))

    # --- the collectives --------------------------------------------------------------------------
    def all_reduce_seconds(self, gradient_bytes: float, nodes: int, devices_per_node: int,
                           machine_nodes: int | None = None) -> float:
        """T_ar = 2(n - 1) alpha + 2(n - 1)/n x G / B over the ring's slowest link (module docstring)."""
        ranks = _ranks(nodes, devices_per_node)
        if ranks == 1 or gradient_bytes <= 0:
            return 0.0
        chunk = gradient_bytes / ranks
        step = self.intra_node_latency_s + chunk / self.intra_node_bytes_per_s if devices_per_node > 1 else 0.0
        if nodes > 1:
            bandwidth = self.injection_bytes_per_s / self.slowdown("all_reduce", nodes, machine_nodes)
            step = max(step, self.latency_s + chunk / bandwidth)
        return 2 * (ranks - 1) * step

    def all_to_all_seconds(self, payload_bytes: float, nodes: int, devices_per_node: int, collectives: int = 1,
                           machine_nodes: int | None = None) -> float:
        """T_a2a = k (n - 1) alpha + max(off-node bytes / B, intra-node bytes / B_intra) (module docstring):
        `collectives` all-to-alls carrying `payload_bytes` in all, over a replica of nodes x devices_per_node."""
        ranks = _ranks(nodes, devices_per_node)
        if ranks == 1 or payload_bytes <= 0:
            return 0.0
        intra = payload_bytes * (devices_per_node - 1) / ranks ** 2 / self.intra_node_bytes_per_s
        if nodes == 1:
            return collectives * (ranks - 1) * self.intra_node_latency_s + intra
        bandwidth = ((self.all_to_all_bytes_per_s or self.injection_bytes_per_s)
                     / self.slowdown("all_to_all", nodes, machine_nodes))
        latency = self.latency_s if self.all_to_all_latency_s is None else self.all_to_all_latency_s
        off_node = payload_bytes * (nodes - 1) / nodes ** 2 / bandwidth
        return collectives * (ranks - 1) * latency + max(off_node, intra)

    def describe(self) -> str:
        rate = self.injection_bytes_per_s * 8 / 1e9
        tree = "non-blocking" if self.oversubscription == 1 else f"{self.oversubscription:g}:1 oversubscribed"
        return (f"{self.name or f'{rate:g} Gb/s'}: {rate:.4g} Gb/s per node, alpha {self.latency_s * 1e6:.3g} us, "
                f"{tree}, {self.nodes_per_leaf} nodes a leaf, {self.placement}")


def _packed_off_leaf_share(collective: str, nodes: int, leaf: int) -> float:
    """f under `packed` placement, counted over one period of the layout (lcm(nodes, leaf) nodes): replicas on
    consecutive nodes, leaves of `leaf` consecutive nodes. The ring's bytes cross where a node's successor in
    its replica (node-major, wrapping) is on another leaf; the all-to-all's for every pair of a replica's nodes
    on different leaves."""
    off = total = 0
    for first in range(0, math.lcm(nodes, leaf), nodes):
        leaves = [(first + k) // leaf for k in range(nodes)]
        if collective == "all_reduce":
            off += sum(leaves[k] != leaves[(k + 1) % nodes] for k in range(nodes))
            total += nodes
        else:
            off += sum(count * (nodes - count) for count in Counter(leaves).values())
            total += nodes * (nodes - 1)
    return off / total


def _ranks(nodes: int, devices_per_node: int) -> int:
    for name, value in (("nodes", nodes), ("devices_per_node", devices_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise AiperfError(f"network: {name} must be a whole number >= 1, got {value!r}")
    return nodes * devices_per_node


def _read_probe(path: Path) -> Mapping[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise AiperfError(f"network probe {path}: cannot read it: {e}") from None
    if not isinstance(data, Mapping):
        raise AiperfError(f"network probe {path}: not a JSON object")
    return data


def _whole(data: Mapping[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AiperfError(f"{where}: {key} must be a whole number >= 1, got {value!r}")
    return value


def _number(data: Mapping[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise AiperfError(f"{where}: {key} must be a finite number, got {value!r}")
    return float(value)


def _positive(data: Mapping[str, Any], key: str, where: str) -> float:
    value = _number(data, key, where)
    if value <= 0:
        raise AiperfError(f"{where}: {key} must be > 0, got {value!r}")
    return value


def _non_negative(data: Mapping[str, Any], key: str, where: str) -> float:
    # A least-squares fit can give a slightly negative intercept on a fast link: it is read as 0.
    return max(0.0, _number(data, key, where))
