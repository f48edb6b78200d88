"""A scale simulation: the real primary, history and scoring driven by simulated replicas on a
virtual clock, so that thousands of replicas and a 12-hour budget fit in minutes on one machine
(docs/performance.md, issue #10).

What is real: the Primary (aiperf_core.workflow.primary) and its executor protocol, every file of
the run directory (run.json, the hash-chained event logs written through rundir.EventLog,
heartbeats, graph.json, trial.json, the history the primary publishes), SharedHistory reading it,
and score_run scoring it.

What is simulated: the replicas. A SimulatedReplica trains nothing. Its accelerators run at a
fixed rate (`device_ops_per_s`, one node's accelerators together), so an epoch takes its analytic
operations divided by that rate times the replica's nodes in virtual time, and it writes exactly
the events and files a real replica writes (docs/run-directory.md). Weights are not simulated:
every trial's weights.npz is a hard link to one small stand-in file, whose real hash trial_end
records. Graphs come from a small pool of real IR graphs (ResNet-50 and morphs of it), written
once and hard-linked into each trial's folder, as a run full of repeated architectures would have
them; scoring still reads and hashes every trial's graph.json.

The network (issue #48 item 6): given a `Network` (aiperf_core.network.model), a replica
of `nodes` nodes also waits, every optimiser step, on its ring all-reduce of the graph's gradients
and, under expert parallelism, on its experts' all-to-all, priced by the network's latency and
bandwidth terms (ReplicaModel.epoch_time). The communication is exposed: it adds to the epoch's
time, less `all_reduce_overlap` of the all-reduce (at most the compute time), as a backward pass
would hide it. Without a network a replica never waits, as before. The epochs' events carry no
`all_reduce` or `all_to_all` records: the run's score feels the network through its time only.

Time: the primary, the run directory and every event log take a VirtualClock (an
aiperf_core.clock.Clock); the primary's sleeps advance it instantly. On every poll round the
SimulatedExecutor's refresh() moves each replica forward to the virtual now, writing the events
that fall due. Replica-side costs that grow with the run are charged in virtual time before each
trial: reading what is new in the shared history (measured on the growing run directory by a
real SharedHistory of replica 0, `HistoryProbe`) and NAS selection at the history's current size
(`NasCostModel`, measured at a few sizes and interpolated). They are charged in series, as if
the replica's planner thread did not overlap training (the real replica overlaps it from round 3
on), so the weak-scaling efficiency this gives is a lower bound.

Filesystem calls: with `count_fs_calls`, `FsCalls` counts every open, stat, listdir, scandir and
mkdir/rename/link/unlink on the run directory made in this process, by the primary, the
simulated replicas and the history probe (issue #23, item 3).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from aiperf_core.atomic import write_text_atomic
from aiperf_core.ir import Graph
from aiperf_core.policy import Policy
from aiperf_core.rundir import EventLog, RunDir, read_events, sha256_bytes, sha256_file, trial_id
from aiperf_core.workflow.executors.base import Executor, ProcessEnd, ReplicaCommand, ReplicaHandle
from aiperf_core.network.model import Network
from aiperf_core.workflow.plan import WatchSettings, run_record

IMAGENET = {"name": "imagenet", "path": "/simulated/imagenet", "layout": "simulated", "classes": 1000,
            "train_images": 1_281_167, "val_images": 50_000, "image_size": 224}
HEARTBEAT_GAP_S = 60.0  # virtual seconds; epochs must end within the primary's heartbeat timeout minus this
SIGTERM_END = ProcessEnd(False, "killed by signal 15 (SIGTERM)", signal=15)


# --- the clock ----------------------------------------------------------------------------------
class VirtualClock:
    """An aiperf_core.clock.Clock on virtual time: time() and monotonic() read the virtual now,
    sleep() advances it at once."""

    def __init__(self, start: float):
        self.now = float(start)

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, float(seconds))


# --- what a trial trains ------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolGraph:
    """One architecture of the pool, with everything a trial record needs computed once."""

    path: Path  # written once, hard-linked into trial folders
    sha256: str
    fp: int  # analytic operations per image, paper convention (what scoring counts)
    bp: int
    arch: dict  # ArchCode.to_json(), what the NAS distance reads
    signature: str
    # What a step communicates (opcount.communication), for a replica on a network:
    gradient_bytes: int = 0  # every trainable parameter's float32 gradient
    expert_gradient_bytes: int = 0  # of those, the moe nodes' expert stacks (out of an expert-parallel all-reduce)
    all_to_all_train_bytes: int = 0  # the experts' all-to-all payload of one training sample (forward and backward)
    all_to_all_eval_bytes: int = 0  # ... of one evaluated sample (forward)
    moe_nodes: int = 0  # each: 4 all-to-alls a training step (out and back, forward and backward), 2 an evaluation step

    def epoch_ops(self, train_images: int, val_images: int) -> int:
        return train_images * (self.fp + self.bp) + val_images * self.fp


def write_graph_pool(graphs: Sequence[Graph], folder: Path, precision: str = "bf16") -> list[PoolGraph]:
    """Write each graph once as a replica would write graph.json; count and encode it once, and count what
    its steps communicate (the all-to-all's elements at `precision`)."""
    from aiperf_core.morph import signature_hash
    from aiperf_core.search.arch import encode
    from aiperf_opcount import count
    from opcount.communication import bytes_per_sample, gradient_bytes

    folder.mkdir(parents=True, exist_ok=True)
    pool = []
    for k, graph in enumerate(graphs):
        data = (graph.to_json() + "\n").encode("utf-8")
        path = folder / f"graph-{k}.json"
        path.write_bytes(data)
        totals = count(graph)
        every = gradient_bytes(graph)
        pool.append(PoolGraph(path, sha256_bytes(data), totals.fp, totals.bp, encode(graph).to_json(),
                              signature_hash(graph), every, every - gradient_bytes(graph, expert_parallel=True),
                              bytes_per_sample(graph, precision, True), bytes_per_sample(graph, precision, False),
                              sum(node.op == "moe" for node in graph.nodes)))
    return pool


def resnet50_family(size: int, seed: int = 0) -> list[Graph]:
    """ResNet-50 and size - 1 descendants by random morph walks: the architectures of a run."""
    from aiperf_core.builders import resnet50
    from aiperf_core.morph.cnn import random_morph

    rng = np.random.default_rng(seed)
    family = [resnet50((224, 224, 3), 1000)]
    while len(family) < size:
        parent = family[int(rng.integers(len(family)))]
        family.append(random_morph(parent, None, rng).graph)
    return family


def write_weights_stand_in(path: Path) -> str:
    """A valid, empty .npz: trials carry a weights file with a real hash, but no weights."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f)
    return sha256_file(path)


# --- counting filesystem calls -------------------------------------------------------------------
class FsCalls:
    """Counts this process's path-based filesystem calls on one directory tree, by kind and by who
    made them: what a metadata server would be asked. Installed, it wraps the module attributes that
    every caller here goes through (pathlib, tempfile, os.path and the aiperf code all call `os.stat`,
    `os.open`, `io.open`... by attribute), so calls on other paths and calls on open file descriptors
    (fstat, read, write, fsync) are not counted. Kinds: open, stat (stat, lstat), list (listdir,
    scandir) and change (mkdir, rmdir, rename, replace, link, unlink: what a writer adds)."""

    WRAPPED = {"open": ("open",), "stat": ("stat", "lstat"), "list": ("listdir", "scandir"),
               "change": ("mkdir", "rmdir", "rename", "replace", "link", "unlink")}
    KINDS = tuple(WRAPPED)

    def __init__(self, root: Path):
        self.root = os.path.abspath(root)
        self.prefix = self.root + os.sep
        self.who = "primary"
        self.counts: dict[str, dict[str, int]] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def charged_to(self, who: str) -> "_Charged":
        """Within the block, calls count for `who` (the simulated replicas, the history probe)."""
        return _Charged(self, who)

    def total(self, who: str | None = None, kinds: Sequence[str] = ("open", "stat", "list")) -> int:
        rows = self.counts.values() if who is None else [self.counts.get(who, {})]
        return sum(row.get(kind, 0) for row in rows for kind in kinds)

    def _count(self, kind: str, path: Any) -> None:
        if isinstance(path, (str, os.PathLike)):
            name = os.fspath(path)
            if isinstance(name, str) and (name.startswith(self.prefix) or name == self.root):
                row = self.counts.setdefault(self.who, {})
                row[kind] = row.get(kind, 0) + 1

    def __enter__(self) -> "FsCalls":
        import builtins
        import io

        for kind, names in self.WRAPPED.items():
            for name in names:
                self._wrap(os, name, kind)
        self._wrap(io, "open", "open")
        self._wrap(builtins, "open", "open")
        return self

    def _wrap(self, module: Any, name: str, kind: str) -> None:
        real = getattr(module, name)
        count = self._count

        def counted(path, *args, **kwargs):
            count(kind, path)
            return real(path, *args, **kwargs)

        self._saved.append((module, name, real))
        setattr(module, name, counted)

    def __exit__(self, *exc) -> None:
        while self._saved:
            module, name, real = self._saved.pop()
            setattr(module, name, real)


class _Charged:
    def __init__(self, calls: FsCalls, who: str):
        self.calls, self.who = calls, who

    def __enter__(self) -> None:
        self.before, self.calls.who = self.calls.who, self.who

    def __exit__(self, *exc) -> None:
        self.calls.who = self.before


def _charged(calls: FsCalls | None, who: str):
    return contextlib.nullcontext() if calls is None else calls.charged_to(who)


# --- replica-side costs that grow with the run ----------------------------------------------------
class NasCostModel:
    """NAS selection time as a function of the history's size: measured at a few sizes,
    interpolated linearly between them and extrapolated along the last segment."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]):
        self.sizes = list(sizes)
        self.seconds = list(seconds)

    @classmethod
    def free(cls) -> "NasCostModel":
        return cls([0], [0.0])

    @classmethod
    def measure(cls, architectures: Sequence[Graph], sizes: Sequence[int], repeat: int = 2, seed: int = 0,
                policy: Policy | None = None) -> "NasCostModel":
        """Time the real selection as benchmarks/nas_selection.py defines it (parents, encoding
        the candidates, nas.select with a cold distance cache, as on a replica's first round after
        a start) over histories drawn from `architectures`. Use many: the distances between
        distinct architectures are what selection spends its time on."""
        from aiperf_core.morph.cnn import generate_candidates
        from aiperf_core.search import nas
        from aiperf_core.search.arch import encode
        from aiperf_core.search.history import SharedHistory, TrialRecord

        policy = policy or Policy()
        rng = np.random.default_rng(seed)
        codes = [encode(graph) for graph in architectures]
        children = [c.graph for c in generate_candidates(architectures[0], None, policy["nas_candidates"], seed)]
        seconds = []
        for size in sizes:
            history = SharedHistory(None)
            for k in range(size):
                history.add(TrialRecord(trial_id(k % 4096, k // 4096), k % 4096, k // 4096 + 1,
                                        float(rng.uniform(0.3, 0.9)), 0.0, {"batch_size": 256, "kernel_size": 3},
                                        codes[int(rng.integers(len(codes)))], f"trial-{k}"))
            best = float("inf")
            for _ in range(repeat):
                start = time.perf_counter()
                nas.best_trials(history.records, policy["nas_parents"])
                candidates = [encode(child) for child in children]
                nas.select(history.records, history.summaries(), candidates, policy)
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
        return cls(sizes, seconds)

    def __call__(self, size: int) -> float:
        if len(self.sizes) == 1:
            return self.seconds[0]
        k = min(max(bisect.bisect_right(self.sizes, size) - 1, 0), len(self.sizes) - 2)
        x0, x1, y0, y1 = self.sizes[k], self.sizes[k + 1], self.seconds[k], self.seconds[k + 1]
        return max(0.0, y0 + (y1 - y0) * (size - x0) / (x1 - x0))


class HistoryProbe:
    """A real SharedHistory of replica 0 on the growing run directory, refreshed once per
    `interval_s` of virtual time (about one trial): the wall time of its latest refresh is what a
    replica pays to catch up with the history before planning a trial."""

    def __init__(self, run_dir: RunDir, interval_s: float | None, fs_calls: FsCalls | None = None):
        from aiperf_core.search.history import SharedHistory

        self.history = SharedHistory(run_dir, replica=0)  # what replica 0 reads
        self.interval_s = interval_s
        self.fs_calls = fs_calls
        self.next_at = 0.0
        self.last_refresh_s = 0.0
        self.refreshes: list[tuple[float, int, float]] = []  # (virtual time, history trials, wall seconds)
        self.calls: list[int] = []  # filesystem calls (open, stat, list) of each refresh, with fs_calls

    def maybe_refresh(self, now: float) -> None:
        if self.interval_s is None or now < self.next_at:
            return
        before = 0 if self.fs_calls is None else self.fs_calls.total("history probe")
        with _charged(self.fs_calls, "history probe"):
            start = time.perf_counter()
            self.history.refresh()
            self.last_refresh_s = time.perf_counter() - start
        if self.fs_calls is not None:
            self.calls.append(self.fs_calls.total("history probe") - before)
        self.refreshes.append((now, len(self.history.records), self.last_refresh_s))
        self.next_at = now + self.interval_s


# --- the simulated replica ----------------------------------------------------------------------
@dataclass(frozen=True)
class EpochTime:
    """An epoch of a simulated replica, in virtual seconds: its computation, and the communication its steps
    wait on (exposed: what is not hidden behind the computation)."""

    compute_s: float
    all_reduce_s: float = 0.0  # exposed
    all_to_all_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute_s + self.all_reduce_s + self.all_to_all_s


@dataclass
class ReplicaModel:
    """How simulated replicas behave. Epoch time = the epoch's analytic ops / (device_ops_per_s x nodes),
    plus, on a network, the communication its steps wait on (epoch_time)."""

    device_ops_per_s: float  # one node's `devices` accelerators together
    devices: int = 8  # per node
    startup_s: float = 0.0  # from launch to replica_start (process start, framework import)
    improving_epochs: int = 3  # validation loss improves this many epochs, then patience stops the trial
    train_images: int = IMAGENET["train_images"]  # samples (images, or sequences of the lm workload)
    val_images: int = IMAGENET["val_images"]
    batch_size: int = 256  # the global batch: one all-reduce per batch
    nodes: int = 1  # a replica's nodes
    network: Network | None = None  # None: communication is free, as before issue #48
    expert_parallel: bool = False  # the experts sharded over the replica's devices: their all-to-all, and
    # their stacks out of the all-reduce (docs/search.md, "Expert parallelism")
    all_reduce_overlap: float = 0.0  # the share of the all-reduce a backward pass hides (0: all exposed)

    def epoch_time(self, graph: PoolGraph, machine_nodes: int | None = None) -> EpochTime:
        """One epoch of `graph` on this replica in a machine of `machine_nodes` nodes (for the fat tree's
        placement): compute, then per optimiser step the ring all-reduce of the gradients and, under expert
        parallelism, per moe node 4 all-to-alls a training step and 2 an evaluation step."""
        compute = graph.epoch_ops(self.train_images, self.val_images) / (self.device_ops_per_s * self.nodes)
        network = self.network
        if network is None:
            return EpochTime(compute)
        steps = -(-self.train_images // self.batch_size)
        gradients = graph.gradient_bytes - (graph.expert_gradient_bytes if self.expert_parallel else 0)
        all_reduce = steps * network.all_reduce_seconds(gradients, self.nodes, self.devices, machine_nodes)
        all_reduce -= min(self.all_reduce_overlap * all_reduce, compute)
        all_to_all = 0.0
        if self.expert_parallel and graph.moe_nodes:
            eval_steps = -(-self.val_images // self.batch_size)
            all_to_all = (network.all_to_all_seconds(self.train_images * graph.all_to_all_train_bytes, self.nodes,
                                                     self.devices, 4 * graph.moe_nodes * steps, machine_nodes)
                          + network.all_to_all_seconds(self.val_images * graph.all_to_all_eval_bytes, self.nodes,
                                                       self.devices, 2 * graph.moe_nodes * eval_steps, machine_nodes))
        return EpochTime(compute, all_reduce, all_to_all)


class SimulatedReplica:
    """One attempt of one replica: a generator of its events in virtual time (see _events)."""

    def __init__(self, executor: "SimulatedExecutor", replica: int, attempt: int, launched: float):
        self.executor = executor
        self.run_dir = executor.run_dir
        self.id = replica
        self.attempt = attempt
        self.launched = launched
        self.end: ProcessEnd | None = None
        self.last_beat = float("-inf")
        self.log = EventLog(self.run_dir.replica_log(replica), self.run_dir.clock)
        self._life = self._events()
        self.next_time = next(self._life)

    def advance(self, now: float) -> None:
        """Write every event due by `now`."""
        while self.end is None and self.next_time <= now:
            try:
                self.next_time = self._life.send(None)
            except StopIteration:
                self.end = ProcessEnd(True, "exit code 0", exit_code=0)
                self.log.close()

    def kill(self) -> None:
        if self.end is None:
            self.end = SIGTERM_END
            self._life.close()
            self.log.close()

    def _append(self, event: str, at: float, **fields: Any) -> None:
        self.log.append(event, time=at, replica=self.id, **fields)
        # A real replica beats every 5 s; the primary only needs a beat within its timeout, and
        # one per event at most HEARTBEAT_GAP_S apart keeps the simulation's own cost down.
        now = self.executor.clock.now
        if now - self.last_beat >= HEARTBEAT_GAP_S:
            self.run_dir.write_heartbeat(self.id, state=event, trial=fields.get("trial"))
            self.last_beat = now

    def _stop_reason(self, seq: int, now: float) -> str | None:
        sim = self.executor
        if sim.stop_path.exists():
            return "stopped"
        if now >= sim.deadline:
            return "deadline"
        if sim.stop_after_trials is not None and seq >= sim.stop_after_trials:
            return "max_trials"
        return None

    def _events(self):
        """Yields the virtual time of the next event; resumed at that time, writes it."""
        sim, model, policy = self.executor, self.executor.model, self.executor.policy
        t = self.launched + model.startup_s
        yield t
        # A restarted attempt continues the trial sequence, as a real replica does.
        past_starts = sum(e.get("event") == "trial_start" for e in read_events(self.log.path))
        self.log.open()
        self._append("replica_start", t, pid=os.getpid(), host="simulated", backend=sim.backend,
                     framework_version="simulated", devices=[f"sim:{d}" for d in range(model.devices)],
                     attempt=self.attempt)
        seq = past_starts
        while True:
            reason = self._stop_reason(seq, t)
            if reason is not None:
                self._append("replica_stop", t, reason=reason)
                return
            round_number = seq + 1
            charge = sim.planning_charge(round_number)
            t += charge
            yield t
            trial = trial_id(self.id, seq)
            graph = sim.graph_for(seq)
            folder = self.run_dir.trial_dir(trial)
            folder.mkdir(parents=True, exist_ok=True)
            os.link(graph.path, folder / "graph.json")
            batch = model.batch_size
            patience = policy.patience_for(round_number)
            hyper = {"batch_size": batch, "kernel_size": 3, "epochs": policy.epochs_for(round_number),
                     "learning_rate": policy.learning_rate_for(batch), "patience": patience,
                     "label_smoothing": policy["label_smoothing"], "precision": sim.precision}
            self._append("trial_start", t, trial=trial, round=round_number, parent=None, morph=None, hyper=hyper,
                         graph_sha256=graph.sha256)
            sim.trials_started += 1
            epoch_s = model.epoch_time(graph, sim.machine_nodes).seconds
            planned = min(hyper["epochs"], model.improving_epochs + patience)
            accuracies, losses, stop = [], [], None
            for epoch in range(planned):
                started = t
                t += epoch_s
                yield t
                # Improves for improving_epochs up to 76% (the paper's ResNet-50 region), then
                # stays flat, so that patience ends the trial.
                accuracy = round(0.76 - 0.3 * (1 - min(epoch + 1, model.improving_epochs) / model.improving_epochs), 5)
                val_loss = round(1.0 - accuracy, 5)
                self._append("epoch_end", t, trial=trial, epoch=epoch, started=started,
                             train_images=model.train_images, val_images=model.val_images, loss=val_loss,
                             val_loss=val_loss, val_accuracy=accuracy, skipped_images=0)
                accuracies.append(accuracy)
                losses.append(val_loss)
                if sim.stop_path.exists():
                    stop = "stopped"
                elif t >= sim.deadline:
                    stop = "deadline"
                if stop:
                    break
            if stop is None and len(accuracies) < hyper["epochs"]:
                stop = "patience"
            status = "early_stopped" if stop else "ok"
            best = max(accuracies)
            info = {"trial": trial, "replica": self.id, "round": round_number, "parent": None, "morph": None,
                    "hyper": hyper, "hpo": "warmup" if policy.is_warmup(round_number) else "hpo", "nas": None,
                    "hpo_point": {"batch_size": batch, "kernel_size": 3},
                    "status": status, "reason": stop, "epochs": len(accuracies), "val_accuracy": accuracies,
                    "val_loss": losses, "best_val_accuracy": best, "predicted_accuracy": None, "target": best,
                    "arch": graph.arch, "signature": graph.signature}
            text = json.dumps(info, sort_keys=True, allow_nan=False) + "\n"
            os.link(sim.weights_path, folder / "weights.npz")
            write_text_atomic(folder / "trial.json", text)
            files = {"graph.json": graph.sha256, "trial.json": sha256_bytes(text.encode("utf-8")),
                     "weights.npz": sim.weights_sha256}
            self._append("trial_end", t, trial=trial, status=status, reason=stop, epochs=len(accuracies),
                         best_val_accuracy=best, predicted_accuracy=None, files=files)
            sim.trials_ended += 1
            seq += 1


# --- the executor -------------------------------------------------------------------------------
class SimulatedHandle(ReplicaHandle):
    def __init__(self, command: ReplicaCommand, replica: SimulatedReplica):
        super().__init__(command, f"sim-{command.replica}-{command.attempt}")
        self.simulated = replica

    def poll(self) -> ProcessEnd | None:
        return self.simulated.end

    def started(self) -> bool:
        return True


class SimulatedExecutor(Executor):
    """The executor protocol over in-process simulated replicas. Its own work (advancing the
    replicas, probing the history) is timed in `simulation_s`, so that what is left of the
    primary's wall time is the primary's own."""

    name = "simulated"

    def __init__(self, run_dir: RunDir, run: dict, clock: VirtualClock, model: ReplicaModel,
                 pool: Sequence[PoolGraph], weights_path: Path, *, poll_interval_s: float = 5.0,
                 nas_cost: NasCostModel | None = None, probe_interval_s: float | None = None,
                 fs_calls: FsCalls | None = None):
        self.run_dir = run_dir
        self.clock = clock
        self.model = model
        self.pool = list(pool)
        self.policy = Policy(run["policy"])
        self.precision = run["precision"]
        self.backend = run["backend"]
        self.deadline = float(run["deadline"])
        self.stop_after_trials = run.get("stop_after_trials")
        self.machine_nodes = int(run["replicas"]) * model.nodes  # every replica on its own nodes
        self.stop_path = run_dir.primary_dir / "stop"
        self.poll_interval_s = poll_interval_s
        self.weights_path = weights_path
        self.weights_sha256 = sha256_file(weights_path)
        self.nas_cost = nas_cost or NasCostModel.free()
        self.fs_calls = fs_calls
        self.probe = HistoryProbe(run_dir, probe_interval_s, fs_calls)
        self.simulation_s = 0.0
        self.trials_started = 0
        self.trials_ended = 0
        self.charged_s = 0.0  # virtual seconds charged for history reads and NAS, all replicas
        self.replicas: list[SimulatedReplica] = []

    def graph_for(self, seq: int) -> PoolGraph:
        """Round 1 trains the pool's first graph (the initial architecture), later rounds its morphs
        in turn. Every replica trains the same sequence, so that OPS(N) / N differs from OPS(1)
        only by what the run's size costs, not by which architectures a replica happened to draw."""
        if seq == 0 or len(self.pool) == 1:
            return self.pool[0]
        return self.pool[1 + (seq - 1) % (len(self.pool) - 1)]

    def planning_charge(self, round_number: int) -> float:
        """Virtual seconds a replica spends before a trial on work that grows with the run."""
        if round_number == 1:
            return 0.0  # the initial architecture: no history to read
        charge = self.probe.last_refresh_s + self.nas_cost(self.trials_ended)
        self.charged_s += charge
        return charge

    def launch(self, command: ReplicaCommand) -> SimulatedHandle:
        start = time.perf_counter()
        with _charged(self.fs_calls, "replicas"):
            replica = SimulatedReplica(self, command.replica, command.attempt, self.clock.now)
        self.replicas.append(replica)
        self.simulation_s += time.perf_counter() - start
        return SimulatedHandle(command, replica)

    def refresh(self, handles: list[ReplicaHandle]) -> None:
        start = time.perf_counter()
        now = self.clock.now
        self.probe.maybe_refresh(now)
        with _charged(self.fs_calls, "replicas"):
            for handle in handles:
                handle.simulated.advance(now)
        self.simulation_s += time.perf_counter() - start

    def stop(self, handles: list[ReplicaHandle], grace_s: float) -> None:
        start = time.perf_counter()
        with _charged(self.fs_calls, "replicas"):
            for handle in handles:
                handle.simulated.kill()
        self.simulation_s += time.perf_counter() - start

    def end_leftover(self, replica: int, job: str) -> None:
        """Simulated replicas live in this process: nothing is left over from an earlier primary."""


# --- one simulated run --------------------------------------------------------------------------
@dataclass
class SimulationResult:
    run_dir: RunDir
    replicas: int
    time_budget_s: float
    end_reason: str
    wall_s: float  # the whole primary run, simulation included
    primary_s: float  # wall_s minus the simulated replicas' and the probe's work
    trials_started: int
    trials_ended: int
    charged_s: float
    probe_refreshes: list[tuple[float, int, float]] = field(default_factory=list)
    probe_calls: list[int] = field(default_factory=list)  # filesystem calls of each probe refresh
    fs_calls: FsCalls | None = None

    @property
    def primary_s_per_trial(self) -> float:
        return self.primary_s / max(self.trials_started, 1)


def simulate(root: Path, replicas: int, time_budget_s: float, model: ReplicaModel, pool: Sequence[PoolGraph],
             weights_path: Path, *, start_time: float = 1.8e9, poll_interval_s: float = 5.0,
             nas_cost: NasCostModel | None = None, probe_interval_s: float | None = None,
             policy: dict | None = None, stop_after_trials: int | None = None,
             watch: WatchSettings | None = None, count_fs_calls: bool = False) -> SimulationResult:
    """Run the real Primary over `replicas` simulated replicas for `time_budget_s` of virtual time
    in a new run directory at `root` (on the same filesystem as the pool, for the hard links).
    With count_fs_calls, the result's `fs_calls` holds every filesystem call made on the run
    directory (FsCalls), by the primary, the simulated replicas and the history probe."""
    from aiperf_core.workflow.primary import Primary

    clock = VirtualClock(start_time)
    run_dir = RunDir(root, clock)
    watch = watch or WatchSettings(max_restarts=3, heartbeat_timeout_s=600.0, stop_grace_s=30.0, slurm={})
    policy_json = Policy(policy or {}).to_json()
    # `auto` as it resolves on the accelerators the simulation models (GPUs: bf16 first).
    precision = "bf16" if policy_json["precision"] == "auto" else policy_json["precision"]
    run = run_record(backend="simulated", executor="simulated", replicas=replicas,
                     devices_per_replica=model.devices, seed=0, time_budget_s=time_budget_s, policy=policy_json,
                     dataset=dict(IMAGENET), stop_after_trials=stop_after_trials, watch=watch, now=start_time,
                     precision=precision)
    run_dir.write_run(run)
    run_dir.primary_dir.mkdir(parents=True, exist_ok=True)
    fs_calls = FsCalls(root) if count_fs_calls else None
    executor = SimulatedExecutor(run_dir, run, clock, model, pool, weights_path, poll_interval_s=poll_interval_s,
                                 nas_cost=nas_cost, probe_interval_s=probe_interval_s, fs_calls=fs_calls)
    primary = Primary(run_dir, run, executor, watch, clock=clock)
    with fs_calls or contextlib.nullcontext():
        started = time.perf_counter()
        reason = primary.run_to_end()
        wall = time.perf_counter() - started
    return SimulationResult(run_dir, replicas, time_budget_s, reason, wall, wall - executor.simulation_s,
                            executor.trials_started, executor.trials_ended, executor.charged_s,
                            executor.probe.refreshes, executor.probe.calls, fs_calls)


def expected_ops(pool_graph: PoolGraph, model: ReplicaModel) -> int:
    """Analytic operations of one simulated epoch of `pool_graph` (what scoring must count)."""
    return pool_graph.epoch_ops(model.train_images, model.val_images)


def run_dir_bytes(run_dir: RunDir, replica: int = 0) -> int:
    """Bytes a replica reads to load the whole history: the published history and its own log, or,
    in a run without a published history, every replica log and trial.json."""
    if run_dir.history_file.exists():
        return run_dir.history_file.stat().st_size + run_dir.replica_log(replica).stat().st_size
    total = 0
    for replica in run_dir.replica_ids():
        total += run_dir.replica_log(replica).stat().st_size
    trials = run_dir.root / "trials"
    if trials.is_dir():
        for folder in trials.iterdir():
            try:
                total += (folder / "trial.json").stat().st_size
            except FileNotFoundError:
                pass
    return total

