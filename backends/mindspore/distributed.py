"""Data parallelism with MindSpore's collective communication: HCCL on Ascend, NCCL on GPUs, MCCL
on CPUs, one process per device.

How a data-parallel trial runs
------------------------------
`train_data_parallel` (called by MindSporeBackend.train when devices() lists several devices)
starts MindSpore's *dynamic cluster* itself, the way ``msrun`` does: one scheduler process
(``MS_ROLE=MS_SCHED``) and one worker process per device (``MS_ROLE=MS_WORKER``, ``MS_NODE_ID`` =
rank), all told ``MS_WORKER_NUM``, ``MS_SCHED_HOST`` (127.0.0.1) and a free ``MS_SCHED_PORT``.
No rank table file is needed. Each worker (``python -m aiperf_backends.mindspore.distributed``):

1. binds its device: ``mindspore.set_device('Ascend', rank)`` on Ascend (likewise on GPU);
2. calls ``mindspore.communication.init()``, which picks HCCL on Ascend (NCCL on GPU, MCCL on CPU);
3. sets ``set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL,
   gradients_mean=True, device_num=world)``, MindSpore's data-parallel mode;
4. lowers the same graph with the same weights, synchronises every batch norm (below) and runs
   training.run_epochs with its rank: every rank draws the same shuffled order, cuts the same
   global batches and takes its own contiguous shard of each; a ``nn.DistributedGradReducer``
   (mean over the ranks, an all-reduce per step) averages the gradients, whose per-rank loss is
   scaled so that the average is exactly the gradient of the global batch's mean loss. Every rank
   then applies the same step to that averaged gradient (training.Stepper: SGD with momentum or
   AdamW, config.grad_clip on the averaged gradient's norm, after fp16's unscaling), so the ranks'
   weights and optimizer states stay identical without further communication. A global
   batch smaller than the number of ranks (a short last batch) is not split: every rank computes
   it whole, with local batch statistics, so the step is exactly the single-device one.

Batch norm is synchronised: the batch statistics are those of the whole global batch (sums
all-reduced over the ranks, two passes as the single-device kernel, the moving averages updated
identically on every rank), so data-parallel training is mathematically training on one device
with the global batch: a benchmark's result must not depend on how many accelerators ran it.
``ops.AllReduce`` is differentiable (its gradient is the all-reduced gradient), so the backward
pass needs nothing extra.

Nothing is pickled: the graph goes as IR JSON, the weights and the data as ``.npz`` (loaded with
allow_pickle=False), the config as JSON, in a private temporary folder (mode 0700). Rank 0 reports
each epoch to the parent as a JSON line on a pipe; the parent calls the caller's on_epoch and
answers on rank 0's stdin; rank 0 all-reduces the decision so every rank stops together. At the end
rank 0 writes the trained weights and the parent loads them into its model.

Where it runs: Ascend (the path above, HCCL); on CPUs the same code runs over MCCL when several
CPU workers are asked for with AIPERF_CPU_DEVICES=N (the contract's CPU_DEVICES_ENV: devices()
then lists cpu:0 ... cpu:N-1; tests/test_mindspore_backend.py checks that two CPU workers train
exactly as one process does). TrainConfig.devices picks the devices: rank r binds the r-th of
them, and a single accelerator that is not this process's own trains in a one-worker cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np

from aiperf_core.backend import CPU_DEVICES_ENV, BackendError, Dataset, EpochReport, Schedule, TrainConfig
from aiperf_core.ir import Graph
from aiperf_core.weights import load_weights, save_weights

SCHED_HOST = "127.0.0.1"
TIMEOUT_ENV = "AIPERF_MINDSPORE_DP_TIMEOUT"  # seconds the cluster may take to form (MS_TOPO_TIMEOUT)


# ---------------------------------------------------------------------------
# Synchronised batch norm (called from lowering.BatchNorm when its `sync` is set)
# ---------------------------------------------------------------------------


def synced_batch_norm(bn, x):
    """Training-mode batch norm over the union of every rank's batch (x is NCHW float32)."""
    from mindspore import ops

    all_reduce = bn.sync
    channels = x.shape[1]
    local = ops.ones((1,), x.dtype) * float(x.size // channels)
    count = ops.stop_gradient(all_reduce(local))
    mean = all_reduce(x.sum(axis=(0, 2, 3))) / count
    centred = x - mean.reshape(1, channels, 1, 1)
    var = all_reduce((centred * centred).sum(axis=(0, 2, 3))) / count
    bessel = ops.where(count > 1.0, count / ops.maximum(count - 1.0, 1.0), ops.ones_like(count))
    bn.update_moving(mean, var * bessel)
    scale = (bn.gamma * ops.rsqrt(var + bn.epsilon)).reshape(1, channels, 1, 1)
    return centred * scale + bn.beta.reshape(1, channels, 1, 1)


def synchronise_batch_norm(model, enabled: bool) -> None:
    """Turn the global-batch statistics of every batch norm on (after init()) or off."""
    from mindspore import ops

    from aiperf_backends.mindspore.lowering import BatchNorm

    for cell in model.layers:
        if isinstance(cell, BatchNorm):
            cell.sync = (cell.sync or ops.AllReduce()) if enabled else None


# ---------------------------------------------------------------------------
# The parent: start the cluster, relay epoch reports, collect the weights
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((SCHED_HOST, 0))
        return s.getsockname()[1]


def _config_to_dict(config: TrainConfig) -> dict:
    out = asdict(config)
    out["schedule"] = asdict(config.schedule)
    out["devices"] = None  # a worker trains on the one device it was bound to, as one rank
    return out


def _config_from_dict(data: dict) -> TrainConfig:
    data = dict(data)
    data["schedule"] = Schedule(**data["schedule"])
    data["betas"] = tuple(data["betas"])  # JSON has no tuples; the frozen config stays hashable
    return TrainConfig(**data)


def train_data_parallel(model, data: Dataset, config: TrainConfig, devices: list[str],
                        on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    from aiperf_core.backend import is_streaming

    if is_streaming(data):
        raise BackendError("the mindspore backend trains a streaming dataset on one device only "
                           f"(asked for {', '.join(devices)}): give TrainConfig.devices one device")
    world = len(devices)
    workdir = Path(tempfile.mkdtemp(prefix="aiperf-ms-dp-"))  # mode 0700: only this user reads it
    try:
        (workdir / "graph.json").write_text(model.graph.to_json())
        save_weights(model.export_canonical(), workdir / "weights.npz")
        x_type = np.int64 if model.graph.takes_tokens else np.float32  # token ids stay integers
        np.savez(workdir / "data.npz", x_train=np.asarray(data.x_train, x_type),
                 y_train=np.asarray(data.y_train, np.int64), x_val=np.asarray(data.x_val, x_type),
                 y_val=np.asarray(data.y_val, np.int64), classes=np.int64(data.classes))
        (workdir / "config.json").write_text(json.dumps(_config_to_dict(config)))
        reports = _run_cluster(workdir, devices, on_epoch)
        model.load_canonical(load_weights(workdir / "trained.npz"))
        return reports
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run_cluster(workdir: Path, devices: list[str], on_epoch) -> list[EpochReport]:
    """One scheduler and one worker per device ('Ascend:3' binds NPU 3; CPU workers bind nothing)."""
    world = len(devices)
    root = str(Path(__file__).resolve().parents[2])
    base_env = dict(os.environ)
    base_env.update({"MS_WORKER_NUM": str(world), "MS_SCHED_HOST": SCHED_HOST, "MS_SCHED_PORT": str(_free_port()),
                     "MS_TOPO_TIMEOUT": os.environ.get(TIMEOUT_ENV, "600"), "GLOG_v": base_env.get("GLOG_v", "3"),
                     "PYTHONPATH": os.pathsep.join(filter(None, [root, base_env.get("PYTHONPATH")]))})
    base_env.pop(CPU_DEVICES_ENV, None)  # a worker trains as one rank, never spawns a cluster of its own
    command = [sys.executable, "-m", "aiperf_backends.mindspore.distributed", str(workdir)]
    logs = []
    processes = []
    report_read, report_write = os.pipe()
    try:
        for role, rank in [("MS_SCHED", None)] + [("MS_WORKER", r) for r in range(world)]:
            env = dict(base_env, MS_ROLE=role)
            if rank is not None:
                env["MS_NODE_ID"] = str(rank)
            log = open(workdir / f"{'scheduler' if rank is None else f'rank{rank}'}.log", "w")
            logs.append(log)
            is_rank0 = rank == 0
            kind, _, index = devices[rank or 0].partition(":")
            processes.append(subprocess.Popen(
                command + [kind, index or "0", str(report_write) if is_rank0 else "-1"], env=env, cwd=root, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.PIPE if is_rank0 else subprocess.DEVNULL,
                pass_fds=(report_write,) if is_rank0 else ()))
        os.close(report_write)
        report_write = -1
        reports = _relay(os.fdopen(report_read, "r"), processes[1], on_epoch)
        codes = [p.wait() for p in processes]
    finally:
        if report_write >= 0:
            os.close(report_write)
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(codes):
        tails = []
        for name in ["scheduler"] + [f"rank{r}" for r in range(world)]:
            text = (workdir / f"{name}.log").read_text(errors="replace").strip().splitlines()
            errors = [line for line in text if "Error" in line or "error" in line]
            tails.append(f"{name}: {(errors or text or ['(no output)'])[-1]}")
        raise BackendError(f"data-parallel training failed (exit codes {codes}): " + "; ".join(tails))
    return reports


def _relay(reports_in, rank0: subprocess.Popen, on_epoch) -> list[EpochReport]:
    """Read rank 0's epoch reports; answer each with the caller's decision to stop (1) or go on (0)."""
    reports: list[EpochReport] = []
    with reports_in:
        for line in reports_in:
            report = EpochReport(**json.loads(line))
            reports.append(report)
            stop = bool(on_epoch(report)) if on_epoch is not None else False
            rank0.stdin.write(b"1\n" if stop else b"0\n")
            rank0.stdin.flush()
    rank0.stdin.close()
    return reports


# ---------------------------------------------------------------------------
# A worker (one rank)
# ---------------------------------------------------------------------------


def _worker(workdir: Path, device_kind: str, device_id: int, report_fd: int) -> None:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_group_size, get_rank, init

    from aiperf_backends.mindspore.lowering import lower_graph
    from aiperf_backends.mindspore.training import run_epochs

    if device_kind in ("Ascend", "GPU"):
        ms.set_device(device_kind, device_id)
    init()  # HCCL on Ascend, NCCL on GPU, MCCL on CPU
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world)
    graph = Graph.from_json((workdir / "graph.json").read_text())
    config = _config_from_dict(json.loads((workdir / "config.json").read_text()))
    with np.load(workdir / "data.npz", allow_pickle=False) as arrays:
        data = Dataset(arrays["x_train"], arrays["y_train"], arrays["x_val"], arrays["y_val"], int(arrays["classes"]))
    model = lower_graph(graph, load_weights(workdir / "weights.npz"), "fp32")
    all_reduce = ops.AllReduce()

    def sum_over_ranks(values: list[float]) -> list[float]:
        # float32: the collectives have no float64 (sums of losses and counts need no more here)
        return [float(v) for v in all_reduce(Tensor(np.asarray(values, np.float32))).asnumpy()]

    reports_out = os.fdopen(report_fd, "w") if rank == 0 else None

    def on_epoch(report: EpochReport) -> bool:
        stop = 0.0
        if reports_out is not None:
            reports_out.write(json.dumps(asdict(report)) + "\n")
            reports_out.flush()
            stop = float(sys.stdin.readline().strip() == "1")
        return sum_over_ranks([stop])[0] > 0.0  # every rank takes rank 0's decision

    synchronise_batch_norm(model, True)
    reducer = nn.DistributedGradReducer([p for _, _, p in model.trainable()], mean=True, degree=world)
    with model.computing_in(config.precision):
        run_epochs(model, data, config, rank=rank, world=world, all_reduce=sum_over_ranks, reducer=reducer,
                   on_epoch=on_epoch)
    if rank == 0:
        save_weights(model.export_canonical(), workdir / "trained.npz")
        reports_out.close()


def main(argv: list[str]) -> int:
    workdir, device_kind, device_id, report_fd = Path(argv[0]), argv[1], int(argv[2]), int(argv[3])
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        os.environ.setdefault("GLOG_v", "3")
        from mindspore.communication import init

        init()  # the scheduler serves the cluster until the workers finish
        return 0
    _worker(workdir, device_kind, device_id, report_fd)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
