"""TorchBackend: the aiperf Backend contract on PyTorch.

torch is imported lazily, inside methods, so that `import aiperf_backends.torch` and listing backends work
where torch is not installed.

* devices: every CUDA device ('cuda:0', ...) when CUDA is available, else ['cpu']. With
  AIPERF_CPU_DEVICES=N (the contract's CPU_DEVICES_ENV) and no CUDA device, N CPU devices
  'cpu:0' ... 'cpu:N-1': data-parallel training then runs N gloo processes on this CPU, which is
  how the kit's `parallel` level certifies the parallel path here. Read once a process.
* precisions (precision.py says what each means): fp32 (IEEE: TF32 off inside the model's scope)
  everywhere; tf32 on CUDA devices of compute capability 8.0+; bf16 and fp16 as mixed precision
  (torch.autocast, fp32 master weights; fp16 training uses a GradScaler). A mixed precision is
  declared only where the device runs it natively (CUDA: fp16 always, bf16 where
  torch.cuda.is_bf16_supported(); CPU: where the CPU has the instructions, the contract's rule
  (CPU_NATIVE_FLAGS), and oneDNN has the kernels) and a small
  probe (conv, batch norm, dense and the loss, forward and backward, in the precision's scope)
  produced finite values in the expected dtype. torch 2.13's CPU autocast accepts both bf16 and fp16
  on any x86 CPU, and oneDNN reports bf16 on any AVX-512 one, but without the instructions it
  emulates them, slower than fp32, which a benchmark should not offer as a choice.
* ops: every op of the IR (lowering.py says how each is lowered), image and sequence graphs alike.
* train: TrainConfig.devices (default: every local device). One device trains in this process
  (the model moves there); several train data parallel, one spawned process per device
  (distributed.py). The step is TrainConfig.optimizer's (SGD with momentum or AdamW; AdamW fused on
  CUDA), after the optional global-norm clip of TrainConfig.grad_clip, over TrainConfig.micro_batch
  micro-batches where that is set, with each block's activations recomputed in the backward pass
  under TrainConfig.checkpoint_blocks (training.py). Streamed text (a TokenStream) is read a batch
  at a time (feeds.TokenFeed).
* device_memory: a CUDA device's total memory; a CPU device's share of RAM (the contract's rule).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from aiperf_core.backend import (CPU_DEVICES_ENV, Availability, Backend, BackendError, Dataset, EpochCallback,
                                 EpochReport, NativeCounter, Parallelism, requested_cpu_devices,
                                 TrainConfig)
from aiperf_core.ir import ALL_OPS, Graph
from aiperf_core.weights import Weights

_THREADS_SET = False
_cpu_devices: int | None = None  # AIPERF_CPU_DEVICES as read when this process first used the backend (0: unset)



def _torch():
    import torch

    global _THREADS_SET, _cpu_devices
    if _cpu_devices is None:
        _cpu_devices = requested_cpu_devices()
    if not _THREADS_SET:
        # torch takes one thread per core it detects; in a container limited to fewer cores
        # (CPU affinity) that oversubscribes, so cap it at the cores this process may use.
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        if torch.get_num_threads() > cores:
            torch.set_num_threads(cores)
        _THREADS_SET = True
    return torch


def _probe_precision(device: str, precision: str) -> bool:
    """Whether `precision` (mixed or tf32) trains a tiny conv/BN/dense net on `device`."""
    torch = _torch()
    from aiperf_backends.torch.lowering import torch_device
    from aiperf_backends.torch.precision import AUTOCAST_DTYPES, math_scope, runs_tf32

    dev = torch_device(device)
    try:
        if precision == "tf32":
            if not runs_tf32(dev):
                return False
            dtype = torch.float32
        else:
            dtype = AUTOCAST_DTYPES[precision]
            if not torch.amp.is_autocast_available(dev.type):
                return False
            if dev.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
                return False
            if dev.type == "cpu" and not _onednn_runs(torch, precision):
                return False
        gen = torch.Generator().manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                  torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3)).to(dev)
        x = torch.randn(2, 3, 6, 6, generator=gen).to(dev)
        with math_scope(dev, precision):
            hidden = net[0](x)
            logits = net[1:](hidden)
            loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor([0, 2], device=dev))
            if hidden.dtype != dtype:
                return False
            if precision == "fp16":
                scaler = torch.amp.GradScaler(dev.type)
                scaler.scale(loss).backward()
                opt = torch.optim.SGD(net.parameters(), lr=0.1)
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
        return bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in net.parameters())
    except Exception:  # an unsupported dtype raises in many ways; it just is not declared
        return False


def _onednn_runs(torch, precision: str) -> bool:
    """Whether this torch's oneDNN has CPU kernels for `precision`. Whether the CPU has the
    instructions is the contract's rule (Backend._runs, CPU_NATIVE_FLAGS), applied before this probe:
    oneDNN alone reports bf16 on any AVX-512 CPU, where it emulates it (4.1x slower than fp32 on a
    Cascade Lake), and fp16 on AVX512-FP16 without AMX-FP16, where training is 25x slower
    (docs/backends/torch.md)."""
    try:
        supported = {"bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
                     "fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[precision]
        return bool(supported())
    except (AttributeError, RuntimeError):
        return False


class TorchBackend(Backend):
    name = "torch"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        return cls.import_availability("torch", "torch")

    def framework_version(self) -> str:
        return _torch().__version__

    def devices(self) -> list[str]:
        torch = _torch()
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        if _cpu_devices:
            return [f"cpu:{i}" for i in range(_cpu_devices)]
        return ["cpu"]

    def device_model(self, device: str) -> str | None:
        if device.split(":")[0] != "cuda":
            return super().device_model(device)
        return _torch().cuda.get_device_name(device)

    def device_memory(self, device: str) -> int | None:
        """A CUDA device's whole memory (torch.cuda.get_device_properties(i).total_memory; the trial
        owns the device); a CPU device's share of RAM as the contract says. Unverified on a GPU."""
        if device.split(":")[0] != "cuda":
            return super().device_memory(device)
        torch = _torch()
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)

    def runs_precision(self, device: str, precision: str) -> bool:
        return _probe_precision(device, precision)

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        from aiperf_backends.torch.peak import matmul_seconds

        return matmul_seconds(device, precision, size, repeats)

    def probe_collectives(self, layout, collectives: tuple[str, ...], sizes: list[int], iterations: int,
                          warmup: int, seconds_per_size: float) -> dict[str, Any] | None:
        from aiperf_backends.torch.network_probe import probe_collectives

        return probe_collectives(layout, self.devices(), collectives, sizes, iterations, warmup, seconds_per_size)

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True, multi_node=True,
                           notes="DistributedDataParallel, one process per device (NCCL on GPUs, gloo on CPUs), the "
                                 "ranks of every node of a replica in one process group met at node 0's TCP store; "
                                 "SyncBatchNorm on CUDA, DistributedBatchNorm elsewhere; expert parallelism by "
                                 "all_to_all_single (expert_parallel.py)")

    def supported_ops(self) -> frozenset[str]:
        return ALL_OPS

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.torch.counter import TorchFlopCounter

        return TorchFlopCounter()

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        from aiperf_backends.torch.lowering import lower_graph

        weights = self.starting_weights(graph, weights, precision)
        _torch()
        return lower_graph(graph, weights, precision, self.devices()[0])

    def model_type(self) -> type:
        from aiperf_backends.torch.lowering import LoweredModel

        return LoweredModel

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        self.check_model(model).load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        torch = _torch()
        from aiperf_backends.torch.precision import math_scope
        from aiperf_backends.torch.training import PREDICT_BATCH, device_of

        device = device_of(model)
        was_training = model.training
        model.eval()
        outputs = []
        try:
            with torch.no_grad(), math_scope(device, model.precision):
                for start in range(0, len(x), PREDICT_BATCH):
                    xb = torch.from_numpy(x[start:start + PREDICT_BATCH]).to(device)
                    outputs.append(model(xb).to("cpu", torch.float32).numpy())
        finally:
            model.train(was_training)
        return np.ascontiguousarray(np.concatenate(outputs), dtype=np.float32)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        torch = _torch()
        from aiperf_backends.torch.loss import summed_loss
        from aiperf_backends.torch.precision import autocast, float32_math
        from aiperf_backends.torch.training import device_of, preserved

        device = device_of(model)
        was_training = model.training
        # Training mode (batch statistics), but the running statistics and any gradients already
        # held are restored: computing gradients never changes the model.
        with preserved(model):
            model.train()
            try:
                xt = torch.from_numpy(x).to(device)
                yt = torch.from_numpy(labels).to(device)
                # Dropout masks are the NumPy reference's for seed 0: deterministic, and comparable.
                with float32_math(device, model.precision == "tf32"):
                    with autocast(device, model.precision), model.dropout_masks(np.random.default_rng(0)):
                        total = summed_loss(model, xt, yt, label_smoothing)
                    loss = total / len(x)
                    if loss.requires_grad:  # a graph without parameters has no gradient to take
                        loss.backward()
                grads = model.canonical_grads()
            finally:
                model.train(was_training)
        return float(loss.detach()), grads

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        from aiperf_backends.torch.lowering import place, torch_device
        from aiperf_backends.torch.training import device_of, run_epochs

        devices = self.train_devices(config)
        if len(devices) > 1 or (config.layout is not None and config.layout.multi_node):
            from aiperf_backends.torch.distributed import train_data_parallel

            return train_data_parallel(model, data, config, devices, on_epoch)
        _torch()
        device = torch_device(devices[0])
        if device_of(model) != device:
            place(model, device)
        return run_epochs(model, data, config, device, on_epoch=on_epoch)
