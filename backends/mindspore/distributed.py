"""Data parallelism with MindSpore's collective communication: HCCL on Ascend, NCCL on GPUs, MCCL
on CPUs, one process per device.

The cluster: started once per replica
-------------------------------------
The first data-parallel `train_data_parallel` of a process (MindSporeBackend.train when it trains
on several devices) starts MindSpore's *dynamic cluster* itself, the way ``msrun`` does: one
scheduler process (``MS_ROLE=MS_SCHED``) and one worker process per device (``MS_ROLE=MS_WORKER``,
``MS_NODE_ID`` = rank), all told ``MS_WORKER_NUM``, ``MS_SCHED_HOST`` (127.0.0.1) and a free
``MS_SCHED_PORT``. No rank table file is needed. Each worker (``python -m
aiperf_backends.mindspore.distributed worker ...``) once:

1. binds its device: ``mindspore.set_device('Ascend', rank)`` on Ascend (likewise on GPU);
2. calls ``mindspore.communication.init()``, which picks HCCL on Ascend (NCCL on GPU, MCCL on CPU);
3. sets ``set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL,
   gradients_mean=True, device_num=world)``, MindSpore's data-parallel mode;

and then trains every trial the parent sends it, one after the other: the cluster lives as long as
the replica, so that a trial pays neither the processes' start (each imports MindSpore, about 2 s)
nor the cluster's forming (docs/performance.md has the figures). A trial on other devices than the
running cluster's stops it and starts one on those. The cluster is stopped *in order* (the workers
first, told to end by the end of their input, then the scheduler, which ends when its workers
have; a process that does not end in time is terminated) when the process exits (atexit), when it
gets SIGTERM (a handler installed from the main thread with the first cluster stops the cluster
and then does what the previous handler did: by default, the process dies of the SIGTERM), and
after a trial that failed (its ranks' state is unknown: one may wait in a collective). The next
trial then starts a fresh cluster. The cluster's processes run in their own session, so that a
signal to the replica's process group reaches the replica, which stops them in order; each watches
its parent and exits when the replica is gone, however it ended (SIGKILL included). A worker found
dead when a trial starts (killed, out of memory) is reported with one line on stderr (the
replica's log) and the cluster is restarted; one that dies during a trial fails that trial, with
one line, and the cluster starts again with the next.

A trial
-------
The parent writes the trial into a private temporary folder (mode 0700): the graph as IR JSON,
the weights as ``.npz``, the config as JSON, in-memory data as ``.npz`` (all loaded with
allow_pickle=False) or a TokenStream pickled as itself (issue #39: it pickles cheaply and a
prepared corpus is reopened from its path, so a rank reads only its batches' windows, never an
epoch of arrays). It sends each worker the folder's path on the worker's stdin. Each worker lowers
the same graph with the same weights, synchronises every batch norm (below) and runs
training.run_epochs with its rank: every rank draws the same shuffled order (or the stream's
windows), cuts the same global batches and takes its own contiguous shard of each; a
``nn.DistributedGradReducer`` (mean over the ranks, an all-reduce per step) averages the
gradients, whose per-rank loss is scaled so that the average is exactly the gradient of the global
batch's mean loss. Every rank then applies the same step to that averaged gradient
(training.Stepper: SGD with momentum or AdamW, config.grad_clip on the averaged gradient's norm,
after fp16's unscaling), so the ranks' weights and optimizer states stay identical without further
communication. A global batch smaller than the number of ranks (a short last batch) is not split:
every rank computes it whole, with local batch statistics, so the step is exactly the
single-device one.

Each worker reports on a pipe of its own, as JSON lines: ready (once), each epoch's report (rank 0),
done or the error that ended its trial. The parent calls the caller's on_epoch with rank 0's
reports and answers on rank 0's stdin; rank 0 all-reduces the decision so every rank stops
together. At the end rank 0 writes the trained weights and the parent loads them into its model.

Batch norm is synchronised: the batch statistics are those of the whole global batch (sums
all-reduced over the ranks, two passes as the single-device kernel, the moving averages updated
identically on every rank), so data-parallel training is mathematically training on one device
with the global batch: a benchmark's result must not depend on how many accelerators ran it.
``ops.AllReduce`` is differentiable (its gradient is the all-reduced gradient), so the backward
pass needs nothing extra.

Where it runs: Ascend (the path above, HCCL); on CPUs the same code runs over MCCL when several
CPU workers are asked for with AIPERF_CPU_DEVICES=N (the contract's CPU_DEVICES_ENV: devices()
then lists cpu:0 ... cpu:N-1; tests/test_mindspore_backend.py checks that two CPU workers train
exactly as one process does). TrainConfig.devices picks the devices: rank r binds the r-th of
them, and a single accelerator that is not this process's own trains in a one-worker cluster.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from aiperf_core.backend import (CPU_DEVICES_ENV, BackendError, Dataset, EpochReport, Schedule, TrainConfig,
                                 is_streaming, is_token_stream)
from aiperf_core.ir import Graph
from aiperf_core.weights import load_weights, save_weights

SCHED_HOST = "127.0.0.1"
TIMEOUT_ENV = "AIPERF_MINDSPORE_DP_TIMEOUT"  # seconds the cluster may take to form (MS_TOPO_TIMEOUT)
STOP_GRACE_S = 10.0  # how long an ordered stop waits for the workers, then for the scheduler, to end
KILL_GRACE_S = 3.0  # after SIGTERM, before SIGKILL
WATCH_INTERVAL_S = 0.5  # how often a cluster process checks that its parent lives, and the parent the cluster


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
# The parent: one cluster per process, reused by every trial
# ---------------------------------------------------------------------------


def _log(line: str) -> None:
    print(f"aiperf mindspore: {line}", file=sys.stderr, flush=True)


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


def _ended(process: subprocess.Popen) -> str:
    code = process.returncode
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class _Lines:
    """Complete lines read from a pipe without blocking on a partial one (for selectors)."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""

    def read(self) -> list[str] | None:
        """The lines that arrived, or None at the end of the pipe (the writer ended)."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines]

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class _Rank:
    rank: int
    device: str
    process: subprocess.Popen
    reports: _Lines
    done: bool = field(default=False)


class ClusterFailed(BackendError):
    """A trial failed in the cluster: a rank raised, or (`lost`) a cluster process ended."""

    def __init__(self, message: str, lost: bool = False):
        super().__init__(message)
        self.lost = lost


class Cluster:
    """MindSpore's dynamic cluster on `devices`: a scheduler and a worker per device, started once
    (its processes' logs in a private folder, removed when it stops) and given one trial at a time."""

    def __init__(self, devices: tuple[str, ...]):
        self.devices = tuple(devices)
        self.owner = os.getpid()
        self.logdir = Path(tempfile.mkdtemp(prefix="aiperf-ms-cluster-"))  # mode 0700
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env.update({"MS_WORKER_NUM": str(len(devices)), "MS_SCHED_HOST": SCHED_HOST,
                    "MS_SCHED_PORT": str(_free_port()), "MS_TOPO_TIMEOUT": os.environ.get(TIMEOUT_ENV, "600"),
                    "GLOG_v": env.get("GLOG_v", "3"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))})
        env.pop(CPU_DEVICES_ENV, None)  # a worker trains as one rank, never spawns a cluster of its own
        command = [sys.executable, "-m", "aiperf_backends.mindspore.distributed"]
        parent = str(os.getpid())
        self.ranks: list[_Rank] = []
        self.scheduler = None
        try:
            with open(self.logdir / "scheduler.log", "wb") as log:
                # Their own session: a signal to the replica's process group is the replica's to
                # handle, and it stops the cluster in order.
                self.scheduler = subprocess.Popen(command + ["scheduler", parent], env=dict(env, MS_ROLE="MS_SCHED"),
                                                  cwd=root, stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT, start_new_session=True)
            for rank, device in enumerate(self.devices):
                kind, _, index = device.partition(":")
                report_read, report_write = os.pipe()
                try:
                    with open(self.logdir / f"rank{rank}.log", "wb") as log:
                        process = subprocess.Popen(
                            command + ["worker", kind, index or "0", str(report_write), parent],
                            env=dict(env, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank)), cwd=root, stdin=subprocess.PIPE,
                            stdout=log, stderr=subprocess.STDOUT, pass_fds=(report_write,), start_new_session=True)
                finally:
                    os.close(report_write)
                self.ranks.append(_Rank(rank, device, process, _Lines(report_read)))
        except BaseException:
            self.stop()
            raise

    # -- health -------------------------------------------------------------------------------
    def dead(self) -> str | None:
        """Which of its processes has ended, in words; None while all of them run."""
        for r in self.ranks:
            if r.process.poll() is not None:
                return f"rank {r.rank} ({r.device}, pid {r.process.pid}) {_ended(r.process)}"
        if self.scheduler is not None and self.scheduler.poll() is not None:
            return f"the scheduler (pid {self.scheduler.pid}) {_ended(self.scheduler)}"
        return None

    def _log_tails(self) -> str:
        tails = []
        for name in ["scheduler"] + [f"rank{r.rank}" for r in self.ranks]:
            try:
                text = (self.logdir / f"{name}.log").read_text(errors="replace").strip().splitlines()
            except OSError:
                text = []
            errors = [line for line in text if "Error" in line or "error" in line]
            tails.append(f"{name}: {(errors or text or ['(no output)'])[-1]}")
        return "; ".join(tails)

    # -- a trial ------------------------------------------------------------------------------
    def _send(self, r: _Rank, line: str) -> None:
        try:
            r.process.stdin.write(line.encode() + b"\n")
            r.process.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: its stdin was closed by a stop
            r.process.poll()
            raise ClusterFailed(f"data-parallel rank {r.rank} ({r.device}) is gone "
                                f"({_ended(r.process) if r.process.returncode is not None else 'its input closed'})",
                                lost=True) from None

    def run(self, workdir: Path, on_epoch) -> list[EpochReport]:
        """Train the trial written in `workdir` on every rank; rank 0's epoch reports, each answered
        with on_epoch's decision to stop."""
        for r in self.ranks:
            r.done = False
            self._send(r, json.dumps({"job": str(workdir)}))
        reports: list[EpochReport] = []
        with selectors.DefaultSelector() as selector:
            for r in self.ranks:
                selector.register(r.reports.fd, selectors.EVENT_READ, r)
            while not all(r.done for r in self.ranks):
                ready = selector.select(timeout=WATCH_INTERVAL_S)
                if not ready and self.scheduler.poll() is not None:
                    raise ClusterFailed(f"data-parallel training failed: the scheduler {_ended(self.scheduler)} "
                                        f"during the trial ({self._log_tails()})", lost=True)
                for key, _ in ready:
                    r = key.data
                    lines = r.reports.read()
                    if lines is None:
                        selector.unregister(r.reports.fd)
                        r.process.wait()
                        raise ClusterFailed(f"data-parallel training failed: rank {r.rank} ({r.device}, pid "
                                            f"{r.process.pid}) {_ended(r.process)} during the trial "
                                            f"({self._log_tails()})", lost=True)
                    for line in lines:
                        message = json.loads(line)
                        if "error" in message:
                            raise ClusterFailed(f"data-parallel training failed on rank {r.rank} ({r.device}): "
                                                f"{message['error']}")
                        if "epoch" in message:
                            report = _epoch_report(message["epoch"])
                            reports.append(report)
                            stop = bool(on_epoch(report)) if on_epoch is not None else False
                            self._send(r, "1" if stop else "0")
                        elif "done" in message:
                            r.done = True
        return reports

    # -- the end ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop in order: the workers (the end of their input, then SIGTERM, then SIGKILL), then the
        scheduler, which ends by itself once its workers have. Idempotent; only the process that
        started the cluster acts (a forked child inherits this object, not the cluster)."""
        if os.getpid() != self.owner:
            return
        workers = [r.process for r in self.ranks]
        for process in workers:
            if process.stdin is not None and not process.stdin.closed:
                try:
                    process.stdin.close()
                except OSError:  # a broken pipe: the worker is gone
                    pass
        _end(workers, STOP_GRACE_S)
        if self.scheduler is not None:
            _end([self.scheduler], STOP_GRACE_S)
        for r in self.ranks:
            if r.reports.fd >= 0:
                r.reports.close()
                r.reports.fd = -1
        self.ranks = []
        self.scheduler = None
        shutil.rmtree(self.logdir, ignore_errors=True)


def _end(processes: list[subprocess.Popen], grace_s: float) -> None:
    """Wait for `processes` to end by themselves for grace_s, then SIGTERM them, then SIGKILL them."""
    deadline = time.monotonic() + grace_s
    for sig, wait_until in ((None, deadline), (signal.SIGTERM, None), (signal.SIGKILL, None)):
        running = [p for p in processes if p.poll() is None]
        if not running:
            return
        if sig is not None:
            for p in running:
                p.send_signal(sig)
            wait_until = time.monotonic() + KILL_GRACE_S
        for p in running:
            try:
                p.wait(timeout=max(0.0, wait_until - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


_cluster: Cluster | None = None
_hooks_installed = False
_previous_sigterm = None


def stop_cluster() -> None:
    """Stop this process's cluster, if it has one (the next data-parallel trial starts another)."""
    global _cluster
    cluster, _cluster = _cluster, None
    if cluster is not None:
        cluster.stop()


def _on_sigterm(signum, frame) -> None:
    stop_cluster()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:  # the default: die of the signal, as without a cluster
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    """atexit and SIGTERM stop the cluster, once per process. A SIGTERM handler can only be set
    from the main thread; elsewhere the cluster's processes still end when they see the replica
    gone."""
    global _hooks_installed, _previous_sigterm
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(stop_cluster)
    if threading.current_thread() is threading.main_thread():
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def cluster_for(devices: tuple[str, ...]) -> Cluster:
    """This process's running cluster on `devices`, started (or restarted, when one of its
    processes has died: one line on stderr) as needed."""
    global _cluster
    if _cluster is not None and _cluster.devices != tuple(devices):
        stop_cluster()
    if _cluster is not None:
        dead = _cluster.dead()
        if dead is not None:
            _log(f"data-parallel cluster on {', '.join(_cluster.devices)}: {dead}; restarting the cluster")
            stop_cluster()
    if _cluster is None:
        _install_hooks()
        _cluster = Cluster(tuple(devices))
    return _cluster


def _write_trial(workdir: Path, model, data, config: TrainConfig) -> None:
    (workdir / "graph.json").write_text(model.graph.to_json())
    save_weights(model.export_canonical(), workdir / "weights.npz")
    if is_token_stream(data):  # the stream itself: each rank reads its batches' windows
        with open(workdir / "data.pickle", "wb") as out:
            pickle.dump(data, out, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        x_type = np.int64 if model.graph.takes_tokens else np.float32  # token ids stay integers
        np.savez(workdir / "data.npz", x_train=np.asarray(data.x_train, x_type),
                 y_train=np.asarray(data.y_train, np.int64), x_val=np.asarray(data.x_val, x_type),
                 y_val=np.asarray(data.y_val, np.int64), classes=np.int64(data.classes))
    (workdir / "config.json").write_text(json.dumps(_config_to_dict(config)))


def _epoch_report(fields: dict) -> EpochReport:
    """An EpochReport from its JSON form (rank 0's message): expert_load's counts back to tuples."""
    load = fields.get("expert_load")
    return EpochReport(**{**fields, "expert_load": None if load is None else
                          {node: tuple(int(c) for c in counts) for node, counts in load.items()}})


def _read_trial(workdir: Path):
    graph = Graph.from_json((workdir / "graph.json").read_text())
    config = _config_from_dict(json.loads((workdir / "config.json").read_text()))
    if (workdir / "data.pickle").exists():
        with open(workdir / "data.pickle", "rb") as source:  # written by this user's replica, mode 0700
            data = pickle.load(source)
    else:
        with np.load(workdir / "data.npz", allow_pickle=False) as arrays:
            data = Dataset(arrays["x_train"], arrays["y_train"], arrays["x_val"], arrays["y_val"],
                           int(arrays["classes"]))
    return graph, load_weights(workdir / "weights.npz"), data, config


def train_data_parallel(model, data, config: TrainConfig, devices: list[str],
                        on_epoch: Callable[[EpochReport], bool | None] | None = None) -> list[EpochReport]:
    if is_streaming(data) and not is_token_stream(data):
        raise BackendError("the mindspore backend trains a streamed image dataset on one device only "
                           f"(asked for {', '.join(devices)}): give TrainConfig.devices one device")
    cluster = cluster_for(tuple(devices))
    workdir = Path(tempfile.mkdtemp(prefix="aiperf-ms-dp-"))  # mode 0700: only this user reads it
    try:
        _write_trial(workdir, model, data, config)
        try:
            reports = cluster.run(workdir, on_epoch)
        except BaseException as exc:  # its ranks' state is unknown: the next trial starts a fresh cluster
            if isinstance(exc, ClusterFailed) and exc.lost:
                _log(f"{exc}; the cluster is stopped and starts again with the next trial")
            stop_cluster()
            raise
        model.load_canonical(load_weights(workdir / "trained.npz"))
        return reports
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# ---------------------------------------------------------------------------
# A cluster process: the scheduler, or a worker (one rank)
# ---------------------------------------------------------------------------


def _watch_parent(parent: int) -> None:
    """End this process when the replica that started it is gone (a daemon thread)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _worker(device_kind: str, device_id: int, report_fd: int) -> int:
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    # Before init(): importing the lowering settles MindSpore's NumPy bridge by catching the error of
    # a first op (lowering._settle_numpy_bridge); after init() that error leaves the worker unable
    # to leave the cluster at exit, and the scheduler waits for it until its heartbeat times out.
    from aiperf_backends.mindspore import training  # noqa: F401

    if device_kind in ("Ascend", "GPU"):
        ms.set_device(device_kind, device_id)
    init()  # HCCL on Ascend, NCCL on GPU, MCCL on CPU
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 device_num=world)
    reports_out = os.fdopen(report_fd, "w", buffering=1)

    def send(message: dict) -> None:
        reports_out.write(json.dumps(message) + "\n")
        reports_out.flush()

    send({"ready": rank})
    while True:
        line = sys.stdin.readline()
        if not line:  # the parent stops the cluster
            return 0
        try:
            _train_trial(Path(json.loads(line)["job"]), rank, world, send)
        except Exception as exc:  # the cluster's state is unknown now: the parent stops it
            send({"error": f"{type(exc).__name__}: {exc}"})
            return 1
        send({"done": rank})


def _train_trial(workdir: Path, rank: int, world: int, send: Callable[[dict], None]) -> None:
    from mindspore import Tensor, nn, ops

    from aiperf_backends.mindspore.lowering import lower_graph
    from aiperf_backends.mindspore.training import run_epochs

    graph, weights, data, config = _read_trial(workdir)
    model = lower_graph(graph, weights, "fp32")
    all_reduce = ops.AllReduce()

    def sum_over_ranks(values: list[float]) -> list[float]:
        # float32: the collectives have no float64 (sums of losses and counts need no more here)
        return [float(v) for v in all_reduce(Tensor(np.asarray(values, np.float32))).asnumpy()]

    def sum_counts(counts: np.ndarray) -> np.ndarray:
        # The CPU collective takes float32 alone (no int32), exact only to 2^24: the counts cross as base-4096
        # digits, exact while an expert's assignments in an epoch, over the ranks, stay below 2^36.
        digits = np.concatenate([counts % 4096, counts // 4096]).astype(np.float32)
        summed = all_reduce(Tensor(digits)).asnumpy().astype(np.int64)
        return summed[:len(counts)] + 4096 * summed[len(counts):]

    def on_epoch(report: EpochReport) -> bool:
        stop = 0.0
        if rank == 0:
            send({"epoch": asdict(report)})
            # Any answer but "go on" stops, the end of the input too: the parent is stopping the
            # cluster (the trial failed there), and the ranks end together at this all-reduce.
            stop = float(sys.stdin.readline().strip() != "0")
        return sum_over_ranks([stop])[0] > 0.0  # every rank takes rank 0's decision

    synchronise_batch_norm(model, True)
    reducer = nn.DistributedGradReducer([p for _, _, p in model.trainable()], mean=True, degree=world)
    with model.computing_in(config.precision), model.checkpointing(config.checkpoint_blocks):
        run_epochs(model, data, config, rank=rank, world=world, all_reduce=sum_over_ranks, sum_counts=sum_counts,
                   reducer=reducer, on_epoch=on_epoch)
    if rank == 0:
        save_weights(model.export_canonical(), workdir / "trained.npz")


def main(argv: list[str]) -> int:
    role, parent = argv[0], int(argv[-1])
    _watch_parent(parent)
    if role == "scheduler":
        os.environ.setdefault("GLOG_v", "3")
        from mindspore.communication import init

        init()  # the scheduler serves the cluster until its workers end
        return 0
    _, device_kind, device_id, report_fd, _ = argv
    return _worker(device_kind, int(device_id), int(report_fd))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
