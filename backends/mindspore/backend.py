"""MindSporeBackend: the aiperf Backend contract on MindSpore 2.

mindspore is imported lazily, inside functions, so that `import aiperf_backends.mindspore` and listing
backends work where it is not installed; availability() then says why not.

* devices: MindSpore picks its device target when it is imported: 'Ascend' where the Ascend
  package and a device are present (['Ascend:0', ...], one entry per NPU), else 'GPU', else 'CPU'
  (['cpu']; ['cpu:0', ..., 'cpu:N-1'] when AIPERF_CPU_DEVICES=N > 1, the contract's
  CPU_DEVICES_ENV, read once when the backend first loads MindSpore: N data-parallel CPU worker
  processes, so that the parallel path can be certified on a CPU machine). A MindSpore tensor has
  no device of its own: every op runs on the context's device target and copies host inputs there,
  so an input can never sit on another device than its model (issue 15.4); each data-parallel
  worker process binds its own device.
* execution: PyNative (eager), node by node (lowering.py). On CPU the lowered ResNet-50 step in
  PyNative kept pace with a hand-written one compiled by ``ms.jit`` (graph mode), whose compile
  cost minutes per network, and the search trains a new network per candidate
  (benchmarks/mindspore_throughput.py, docs/backends/mindspore.md).
* precisions: fp32 everywhere; mixed fp16 (with dynamic loss scaling) and bf16 (float32 master
  weights, batch norm and loss in float32) where the first device runs them natively and a small
  probe trains finitely: on Ascend by the probe alone; on a CPU only where it has the instructions
  (the contract's rule, Backend._runs: AMX-FP16 for fp16, AVX512-BF16 or AMX-BF16 for bf16) *and*
  MindSpore has the kernels. MindSpore 2.10's CPU Conv2D has no bfloat16 kernel, so bf16 is never
  declared on a CPU; lower() and train() reject the others with a clear error.
* train: SGD with momentum (nn.Momentum) or AdamW (torch's arithmetic, written out in MindSpore
  ops), with an optional global gradient-norm clip (training.py), in this process on
  TrainConfig.devices (default: every device); with several devices, data parallel with one
  process per device (distributed.py: HCCL on Ascend; the cluster is started once per process and
  reused by every trial), and a single accelerator other than this process's in one worker bound
  to it. Streamed batches arrive as uint8 pixels and are normalised on the device (lowering.py);
  synthetic data is uploaded once and sliced on the device (training.py); a TokenStream is read a
  batch at a time, by every rank. Gradient accumulation over TrainConfig.micro_batch (training.py)
  and activation checkpointing of the graph's blocks with mindspore.recompute (lowering.py).
* device memory: a CPU device's share of the node's RAM (the contract's); a GPU's total memory and
  the bound Ascend NPU's, from mindspore.hal.get_device_properties (unverified: no such device here).
* native counter: MindSpore's own ``flops_collection`` (graph mode), per conv, dense and attention node
  (counter.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiperf_core.backend import (CPU_DEVICES_ENV, Availability, Backend, BackendError, Dataset,
                                 EpochCallback, EpochReport, NativeCounter, Parallelism, requested_cpu_devices,
                                 TrainConfig)
from aiperf_core.ir import ALL_OPS, Graph
from aiperf_core.registry import set_framework_logging
from aiperf_core.weights import Weights

_OFFERED = ("fp16", "bf16")  # tf32 is a CUDA precision: Ascend and CPUs have none


_cpu_devices: int | None = None  # AIPERF_CPU_DEVICES as read when the backend first loaded MindSpore (0: unset)



def _ms():
    global _cpu_devices
    if _cpu_devices is None:
        _cpu_devices = requested_cpu_devices()
    set_framework_logging()  # GLOG_v: MindSpore's routine warnings off (registry.FRAMEWORK_LOG_LEVELS)
    import mindspore

    import aiperf_backends.mindspore.lowering  # noqa: F401  (settles MindSpore's NumPy bridge on first import)

    return mindspore


def _probe_precision(precision: str) -> bool:
    """Whether a tiny conv/BN/dense net trains one step in mixed `precision` with finite values."""
    try:
        from aiperf_core.builders import resnet_small
        from aiperf_core.weights import init_weights
        from aiperf_backends.mindspore.lowering import lower_graph
        from aiperf_backends.mindspore.training import gradient_function, targets

        _ms()
        from mindspore import Tensor

        graph = resnet_small((8, 8, 3), 3)
        model = lower_graph(graph, init_weights(graph, seed=0), precision)
        model.set_train(True)
        x = np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype(np.float32)
        params = [p for _, _, p in model.trainable()]
        (_, total), grads = gradient_function(model, params)(model.to_cell_layout(x), targets(np.array([0, 2]), 3, 0.0),
                                                            None, Tensor(np.float32(1.0)))
        return bool(np.isfinite(total.asnumpy())) and all(bool(np.all(np.isfinite(g.asnumpy()))) for g in grads)
    except Exception:  # an unsupported dtype fails in many ways; it is just not declared
        return False


class MindSporeBackend(Backend):
    name = "mindspore"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        set_framework_logging()  # the probe imports MindSpore first
        return cls.import_availability("mindspore", "mindspore")

    def framework_version(self) -> str:
        return _ms().__version__

    def devices(self) -> list[str]:
        target = device_target()
        if target == "CPU":  # several only as data-parallel CPU workers (AIPERF_CPU_DEVICES)
            return ["cpu"] if _cpu_devices <= 1 else [f"cpu:{i}" for i in range(_cpu_devices)]
        ms = _ms()
        context = getattr(ms.device_context, target.lower())
        return [f"{target}:{i}" for i in range(max(int(context.device_count()), 1))]

    def runs_precision(self, device: str, precision: str) -> bool:
        return precision in _OFFERED and _probe_precision(precision)

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        from aiperf_backends.mindspore.peak import matmul_seconds

        return matmul_seconds(device, precision, size, repeats)

    def device_memory(self, device: str) -> int | None:
        """A CPU device's share of RAM (the contract's rule); an accelerator's total memory from
        mindspore.hal.get_device_properties: any GPU, and on Ascend this process's own NPU once it is
        initialised (the API answers for the current device only, and 0 before). None where it
        cannot tell: another NPU, or an API that fails (it is marked for deprecation)."""
        kind, _, index = device.partition(":")
        if kind.lower() == "cpu":
            return super().device_memory(device)
        ms = _ms()
        if kind == "Ascend" and not runs_in_this_process(device):
            return None
        try:
            total = int(getattr(ms.hal.get_device_properties(int(index or 0), kind), "total_memory", 0) or 0)
        except Exception:  # a removed or failing API means it cannot tell, never a failed trial
            return None
        return total or None

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True,
                           expert_parallel_why_not=("this backend trains in DATA_PARALLEL mode, which replicates "
                                                    "every parameter; sharding a lowered graph's experts would need "
                                                    "SEMI_AUTO_PARALLEL and its AlltoAll, which the backend does not "
                                                    "use (docs/backends/mindspore.md, \"Expert parallelism\")"),
                           multi_node_why_not=("the backend starts its scheduler and workers on this host "
                                               "(127.0.0.1, local Popen); a dynamic cluster with its scheduler "
                                               "at the leader's address and workers on every node is not wired "
                                               "yet (docs/backends/mindspore.md, \"Across nodes\")"),
                           notes="DATA_PARALLEL over HCCL (Ascend) or MCCL (CPU workers), gradients_mean, synchronised batch norm")

    def supported_ops(self) -> frozenset[str]:
        return ALL_OPS  # every op, forward and backward, at every declared precision (lowering.py)

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.mindspore.counter import MindSporeFlopsCounter

        return MindSporeFlopsCounter()

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        weights = self.starting_weights(graph, weights, precision)
        _ms()
        from aiperf_backends.mindspore.lowering import lower_graph

        return lower_graph(graph, weights, precision)

    def model_type(self) -> type:
        _ms()
        from aiperf_backends.mindspore.lowering import LoweredCell

        return LoweredCell

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        model = self.check_model(model)
        from aiperf_core.weights import validate_weights

        validate_weights(model.graph, weights)
        model.load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        from aiperf_backends.mindspore.training import predict

        return predict(model, x)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        from mindspore import Tensor

        from aiperf_backends.mindspore.lowering import to_canonical
        from aiperf_backends.mindspore.training import gradient_function, preserved, targets

        trainable = model.trainable()
        was_training = model.training
        # Training mode (batch statistics), but the moving statistics are restored afterwards:
        # computing gradients never changes the model.
        with preserved(model):
            model.set_train(True)
            try:
                # Dropout masks are the NumPy reference's for seed 0: deterministic, and comparable.
                masks = model.masks_from(np.random.default_rng(0), len(x))
                target = targets(labels, model.graph.output_shape[-1], label_smoothing)
                params = [p for _, _, p in trainable]
                (_, total), grads = gradient_function(model, params)(model.to_cell_layout(x), target, masks,
                                                                     Tensor(np.float32(1.0 / len(x))))
            finally:
                model.set_train(was_training)
        # Every node with parameters, as the reference: a node of constants alone has no gradient.
        out: Weights = {node_id: {} for node_id in model.graph.all_param_shapes()}
        for (node_id, pname, _), grad in zip(trainable, grads):
            out[node_id][pname] = to_canonical(pname, grad.asnumpy())
        return float(total.asnumpy()) / len(x), out

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        from aiperf_backends.mindspore.training import run_epochs

        devices = self.train_devices(config)
        with model.computing_in(config.precision), model.checkpointing(config.checkpoint_blocks):
            if len(devices) > 1 or not runs_in_this_process(devices[0]):
                from aiperf_backends.mindspore.distributed import train_data_parallel

                return train_data_parallel(model, data, config, devices, on_epoch)
            return run_epochs(model, data, config, on_epoch=on_epoch)


def device_target() -> str:
    """'Ascend', 'GPU' or 'CPU': the target MindSpore chose at import for this machine."""
    return str(_ms().get_context("device_target"))


def runs_in_this_process(device: str) -> bool:
    """Whether this process computes on `device`: any CPU device (CPU workers are the same host),
    or the accelerator this process is bound to (MindSpore binds one device per process, once)."""
    kind, _, index = device.partition(":")
    if kind.lower() == "cpu":
        return True
    return int(index or 0) == int(_ms().get_context("device_id"))
