"""JaxBackend: the aiperf Backend contract on JAX (XLA).

jax is imported lazily, inside functions, so that `import aiperf_backends.jax` and listing backends work
where jax is not installed; availability() then says why not.

* devices: jax.local_devices() of the default platform ('cpu:0', 'gpu:0', 'tpu:0', ...). With
  AIPERF_CPU_DEVICES=N (the contract's CPU_DEVICES_ENV) and no accelerator platform asked for in
  JAX_PLATFORMS, XLA's host platform is split into N devices ('cpu:0' ... 'cpu:N-1') by
  --xla_force_host_platform_device_count=N in XLA_FLAGS, set before jax first initialises
  (`initialise`), so that the data-parallel path can be certified on a CPU machine.
* precisions: fp32 everywhere (IEEE: Precision.HIGHEST on every conv and dot, lowering.py); tf32
  on CUDA GPUs of compute capability 8.0 and newer; bf16 (bfloat16 compute, float32 master
  weights and BN statistics) on GPUs and TPUs. Each mixed precision also needs a small probe to
  train finitely on the device. On CPUs XLA emulates bfloat16 convolutions by converting to
  float32 (slower than fp32), so bf16 is not offered there. fp16 is not offered: it would need
  loss scaling, which this backend does not implement; check_precision rejects it loudly.
* model: a pure function over a parameter pytree (lowering.py), jit-compiled per model, on the
  devices of its placement (distributed.py).
* train: SGD with momentum or AdamW, with optional gradient clipping, in a jitted step
  (training.py), on in-memory arrays, streamed images or streamed text (a TokenStream), with
  gradient accumulation (TrainConfig.micro_batch) and activation checkpointing per block
  (TrainConfig.checkpoint_blocks: jax.checkpoint, lowering.py); data parallel over
  TrainConfig.devices (default: every local device) by sharding the batch axis over a mesh of
  exactly those devices (distributed.py); expert parallel (TrainConfig.expert_parallel) by sharding
  each moe node's experts over the same mesh and sending tokens to them by all-to-all
  (expert_parallel.py), EpochReport.all_to_all_seconds measured apart from the step; across nodes
  (TrainConfig.layout), one jax program over every node's devices, joined by start_node through
  jax.distributed (distributed.py, docs/backends/jax.md "Across nodes").
* device_memory: an accelerator's memory_stats()['bytes_limit'] (None where not reported; the base
  class's share of RAM on a CPU).
* native counter: XLA's cost analysis, always compiled for the CPU client of this process, whatever
  the training device (counter.py).
* logging: XLA's C++ INFO lines are off (TF_CPP_MIN_LOG_LEVEL=1 unless set, 0 under `aiperf --debug`:
  aiperf_core.registry.set_framework_logging), its warnings and errors shown.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from aiperf_core.backend import (CPU_DEVICES_ENV, Availability, Backend, BackendError, Dataset, EpochCallback,
                                 EpochReport, NativeCounter, Parallelism, requested_cpu_devices, TrainConfig)
from aiperf_core.ir import Graph
from aiperf_core.registry import set_framework_logging
from aiperf_core.replica_layout import ReplicaLayout
from aiperf_core.weights import Weights, init_weights

_HOST_DEVICE_COUNT = re.compile(r"--xla_force_host_platform_device_count=(\S*)")
_cpu_devices: int | None = None  # AIPERF_CPU_DEVICES as read when this process first initialised jax (0: unset)



def _accelerator_wanted() -> bool:
    """Whether JAX_PLATFORMS names a platform other than the host's."""
    platforms = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return any(p != "cpu" for p in platforms)


def initialise():
    """jax, with AIPERF_CPU_DEVICES applied before jax creates its CPU client; read once a process.

    XLA reads --xla_force_host_platform_device_count when the CPU client is created, so the flag
    must be in XLA_FLAGS before the first jax.devices(); a process that initialised jax earlier
    gets a one-line error instead of a silently different device count."""
    global _cpu_devices
    if _cpu_devices is None:
        set_framework_logging()  # XLA reads TF_CPP_MIN_LOG_LEVEL when jaxlib loads
        wanted = requested_cpu_devices()
        if wanted and not _accelerator_wanted():
            flags = os.environ.get("XLA_FLAGS", "")
            found = _HOST_DEVICE_COUNT.search(flags)
            if found and found.group(1) != str(wanted):
                raise BackendError(f"{CPU_DEVICES_ENV}={wanted} contradicts XLA_FLAGS "
                                   f"--xla_force_host_platform_device_count={found.group(1)}")
            if not found:
                os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={wanted}".strip()
        import jax

        if wanted and jax.default_backend() == "cpu" and len(jax.local_devices()) != wanted:
            raise BackendError(f"{CPU_DEVICES_ENV}={wanted}, but jax's CPU client already has "
                               f"{len(jax.local_devices())} device(s): jax was initialised before the variable "
                               "could take effect (set it before the process first uses jax)")
        _cpu_devices = wanted
    import jax

    return jax


def cuda_compute_capability(device) -> float | None:
    """The CUDA compute capability of a jax device (9.0 for an H100), None for any other device."""
    if device.platform not in ("gpu", "cuda"):
        return None
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    if "rocm" in version or "hip" in version:
        return None
    try:
        return float(getattr(device, "compute_capability", ""))
    except (TypeError, ValueError):
        return None


def device_runs_natively(device, precision: str) -> bool:
    """Whether the hardware of a jax device runs `precision` natively (before any probe): tf32 on
    CUDA 8.0+ (TF32 tensor cores), bf16 on GPUs and TPUs. fp16 never: no loss scaling here."""
    if precision == "tf32":
        capability = cuda_compute_capability(device)
        return capability is not None and capability >= 8.0
    if precision == "bf16":
        return device.platform in ("gpu", "cuda", "rocm", "tpu")
    return False


def _probe(device, precision: str) -> bool:
    """Whether a tiny conv/BN/dense net trains in `precision` with finite values on `device`."""
    try:
        import jax

        from aiperf_core.builders import resnet_small
        from aiperf_backends.jax.distributed import Placement
        from aiperf_backends.jax.lowering import lower_graph
        from aiperf_backends.jax.training import summed_loss

        placement = Placement([device])
        graph = resnet_small((8, 8, 3), 3)
        model = lower_graph(graph, init_weights(graph, seed=0), precision, placement)
        x, y = placement.put_batch(np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype(np.float32),
                                   np.array([0, 2], np.int32))
        loss, grads = jax.jit(jax.value_and_grad(
            lambda p: summed_loss(graph, p, model.state, x, y, 0.0, precision=precision)[0]))(model.params)
        leaves = jax.tree_util.tree_leaves(grads)
        return bool(np.isfinite(np.asarray(loss))) and all(bool(np.all(np.isfinite(np.asarray(g)))) for g in leaves)
    except Exception:  # an unsupported dtype fails in many ways; it is just not declared
        return False


class JaxBackend(Backend):
    name = "jax"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        set_framework_logging()  # the probe imports jax first
        return cls.import_availability("jax", "jax")

    def framework_version(self) -> str:
        return initialise().__version__

    def devices(self) -> list[str]:
        from aiperf_backends.jax.distributed import device_name

        return [device_name(d) for d in initialise().local_devices()]

    def device_model(self, device: str) -> str | None:
        if device.split(":")[0] == "cpu":
            return super().device_model(device)
        from aiperf_backends.jax.distributed import local_device

        initialise()
        return local_device(device).device_kind

    def device_memory(self, device: str) -> int | None:
        """An accelerator's bytes_limit from jax's memory_stats() (the allocator's pool: what XLA
        lets one process use, after XLA_PYTHON_CLIENT_MEM_FRACTION), None where the device reports
        none; a CPU device is the base class's share of RAM (jax's CPU client reports no limit)."""
        if device.split(":")[0] == "cpu":
            return super().device_memory(device)
        from aiperf_backends.jax.distributed import local_device

        initialise()
        try:
            stats = local_device(device).memory_stats()
        except Exception:  # a platform without memory_stats raises (not implemented) rather than return None
            return None
        limit = (stats or {}).get("bytes_limit")
        return int(limit) if limit else None

    def runs_precision(self, device: str, precision: str) -> bool:
        from aiperf_backends.jax.distributed import local_device

        initialise()
        found = local_device(device)
        return device_runs_natively(found, precision) and _probe(found, precision)

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        from aiperf_backends.jax.peak import matmul_seconds

        return matmul_seconds(device, precision, size, repeats)

    def probe_collectives(self, layout: ReplicaLayout, collectives: tuple[str, ...], sizes: list[int],
                          iterations: int, warmup: int, seconds_per_size: float) -> dict[str, Any] | None:
        from aiperf_backends.jax.network_probe import probe_collectives

        return probe_collectives(layout, self.devices(), collectives, sizes, iterations, warmup, seconds_per_size)

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True, multi_node=True,
                           notes="the batch axis sharded over a mesh of the training devices in one jitted step; "
                                 "batch statistics over the global batch array; with expert_parallel, each moe "
                                 "node's experts sharded over the same mesh, tokens exchanged by all-to-all under "
                                 "shard_map (expert_parallel.py); across nodes, one jax program over every node's "
                                 "devices (jax.distributed, gloo on CPUs)")

    def start_node(self, layout: ReplicaLayout) -> None:
        """jax.distributed.initialize at the launch's coordinator, before jax makes its clients
        (distributed.start_node); devices() then names this node's devices."""
        from aiperf_backends.jax.distributed import start_node

        set_framework_logging()  # XLA reads TF_CPP_MIN_LOG_LEVEL when jaxlib loads
        start_node(layout, initialise)

    def supported_ops(self) -> frozenset[str]:
        from aiperf_core.ir import ALL_OPS  # every op, forward and backward (lowering.py)

        return ALL_OPS

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.jax.counter import XlaCostCounter, counting_device

        initialise()
        # No CPU client (JAX_PLATFORMS without 'cpu'): XLA's GPU cost analysis cannot count cuDNN
        # convolutions (-1 each), so the counter is declared unavailable rather than wrong.
        return XlaCostCounter() if counting_device() is not None else None

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        from aiperf_backends.jax.lowering import lower_graph

        initialise()
        weights = self.starting_weights(graph, weights, precision)
        return lower_graph(graph, weights, precision)

    def model_type(self) -> type:
        from aiperf_backends.jax.lowering import JaxModel

        return JaxModel

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        self.check_model(model).load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        from aiperf_backends.jax.training import predict

        return predict(model, x)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        import jax

        from aiperf_backends.jax.lowering import host_input, reference_dropout_masks
        from aiperf_backends.jax.training import summed_loss

        graph = model.graph
        # Dropout masks are the NumPy reference's for seed 0: deterministic, and comparable.
        shapes = {n.id: (len(x),) + tuple(graph.shapes[n.id]) for n in graph.nodes if n.op == "dropout"}
        masks = reference_dropout_masks(graph, shapes, 0)
        key = ("loss_and_grads", label_smoothing)
        if key not in model.cache:
            precision = model.precision

            def loss_fn(params, state, xb, yb, dropout_masks):
                total = summed_loss(graph, params, state, xb, yb, label_smoothing, precision=precision,
                                    masks=dropout_masks)[0]
                return total / yb.size  # the mean over every label: images, or every token

            model.cache[key] = jax.jit(jax.value_and_grad(loss_fn))
        inputs = model.placement.replicate((host_input(graph, x), labels.astype(np.int32), masks))
        # Functional: the model's parameters and BN statistics are untouched.
        loss, grads = model.cache[key](model.params, model.state, *inputs)
        out: Weights = {}
        for node_id, params in grads.items():
            out[node_id] = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
        return float(loss), out

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        from aiperf_backends.jax.distributed import Placement
        from aiperf_backends.jax.training import run_epochs

        devices = self.train_devices(config)
        if config.layout is not None and config.layout.multi_node:
            placement = Placement.across_nodes(devices, config.layout)
        else:
            placement = Placement.named(devices)
        return run_epochs(model, data, config, placement, on_epoch=on_epoch)
