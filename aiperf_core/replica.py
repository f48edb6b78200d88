"""One replica's trial loop: pick parents from the shared history, morph, choose by NAS, tune by
HPO, train through the backend, record. Spec of every file and event: docs/run-directory.md;
the search itself: docs/search.md.

Round r of replica I is its trial number r - 1 (`r<I>-t<r-1>`); round 1 trains the initial
architecture. While round r trains on the accelerators, a CPU thread already plans round r + 1
(parents, candidates, NAS, HPO, the morphed weights), so the accelerators wait only for files
to be written and the next model to be lowered. That plan cannot know round r's result: the plan
of round r uses this replica's trials of rounds up to r - 2 and every other replica's finished
trials. Only when that leaves nothing (round 2 of a lone replica) is the plan made after the
previous trial ends, from everything finished. The rule depends on round numbers alone, so a run
with one replica and a fixed seed repeats its architectures and hyperparameters exactly.

Restart: a trial_start without trial_end in the replica's own log gets trial_end `interrupted`
first (its logged epochs keep counting, once); the trial sequence continues after it, and the
search state is rebuilt from the logs and trials/ (NAS and HPO keep no other state).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from aiperf_core import workloads
from aiperf_core.atomic import write_bytes_atomic, write_text_atomic
from aiperf_core.backend import (AUTO_PRECISION, PRECISIONS, Backend, Dataset, EpochReport, Schedule, StepClock,
                                 TrainConfig)
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph
from aiperf_core.monitoring.sampler import DEFAULT_INTERVAL_S, Sampler
from aiperf_core.policy import Policy
from aiperf_core.rundir import (EventLog, Lease, RunDir, replica_cadence, read_events, sha256_bytes, sha256_file,
                                trial_id)
from aiperf_core.search import curve, hpo, nas
from aiperf_core.search.history import SharedHistory, TrialRecord
from aiperf_core.weights import Weights
from aiperf_core.workflow.container import running_image

LEASE_LOST_EXIT = 75  # the replica's exit status when another process took its replica id over
MAX_CONSECUTIVE_FAILURES = 3  # failed trials in a row before the replica gives up (stop reason "failures")
STOP_FILE = "stop"  # RUN_DIR/primary/stop: the primary's request that every replica stop


class ReplicaError(AiperfError):
    pass


class _UnusableParent(ReplicaError):
    """A parent's files are missing, unreadable or not what its trial_end recorded."""

    def __init__(self, trial: str, problem: str):
        self.trial = trial
        super().__init__(f"trials/{trial}: {problem}")


@dataclass(frozen=True)
class RunSpec:
    """What a replica reads from run.json."""

    backend: str
    model: str
    dataset: dict
    policy: Policy
    seed: int
    deadline: float
    devices_per_replica: int
    stop_after_trials: int | None
    precision: str | None = None  # run.json's resolved precision; None: this replica resolves `auto`
    monitor_interval_s: float = DEFAULT_INTERVAL_S
    replicas: int = 1  # the run's replica count: it sets how often each one beats (rundir.replica_cadence)

    @classmethod
    def from_run(cls, run: Mapping[str, Any]) -> "RunSpec":
        def need(key: str, kind, what: str):
            value = run.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ReplicaError(f"run.json.{key}: {value!r} is not {what}")
            return value

        stop_after = run.get("stop_after_trials")
        if stop_after is not None and (not isinstance(stop_after, int) or isinstance(stop_after, bool)
                                       or stop_after < 0):
            raise ReplicaError(f"run.json.stop_after_trials: {stop_after!r} is not a non-negative integer or null")
        dataset = need("dataset", dict, "an object {name, path, classes, ...}")
        precision = run.get("precision")
        if precision is not None and precision not in PRECISIONS:
            raise ReplicaError(f"run.json.precision: {precision!r} is not one of {', '.join(PRECISIONS)} or null")
        interval = run.get("monitor_interval_s", DEFAULT_INTERVAL_S)
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or not interval > 0:
            raise ReplicaError(f"run.json.monitor_interval_s: {interval!r} is not a positive number of seconds")
        replicas = run.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ReplicaError(f"run.json.replicas: {replicas!r} is not a positive integer")
        return cls(backend=need("backend", str, "a backend name"), model=need("model", str, "a model name"),
                   dataset=dict(dataset), policy=Policy(need("policy", dict, "an object"), "run.json.policy"),
                   seed=need("seed", int, "an integer"), deadline=float(need("deadline", (int, float), "a Unix time")),
                   devices_per_replica=need("devices_per_replica", int, "an integer"),
                   stop_after_trials=stop_after, precision=precision, monitor_interval_s=float(interval),
                   replicas=replicas)


@dataclass
class Plan:
    """Everything one trial needs before it trains."""

    round: int
    parent: str | None
    morph: dict | None
    graph: Graph
    weights: Weights
    proposal: hpo.Proposal
    nas: dict | None  # the NAS selection's figures, for trial.json
    # Children the memory estimate kept out of this round's candidates (trial_start.over_memory).
    over_memory: list = field(default_factory=list)


def _seed(*entropy: int) -> int:
    return int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])


def _finite(value: float) -> float | None:
    value = float(value)
    return value if np.isfinite(value) else None


def _seconds(value: float | None) -> float | None:
    """A backend's reported seconds for the log: a finite number >= 0, else None (not measured)."""
    if value is None:
        return None
    value = _finite(value)
    return value if value is not None and value >= 0 else None


def expert_load_fields(load) -> dict:
    """epoch_end's `expert_load` (docs/run-directory.md): per moe node the tokens each expert received
    and their maximum over their mean (1 at an even load, E when one expert takes every token); no field
    for a graph without a moe node."""
    if not load:
        return {}
    out = {}
    for node, counts in load.items():
        counts = [int(c) for c in counts]
        mean = sum(counts) / len(counts)
        out[str(node)] = {"tokens": counts, "max_over_mean": round(max(counts) / mean, 4) if mean else None}
    return {"expert_load": out}


def all_to_all_fields(report, per_sample: tuple[int, int] | None) -> dict:
    """epoch_end's `all_to_all` (docs/run-directory.md) for an expert-parallel trial: the bytes the
    experts' all-to-all moved, analytic (`per_sample`: the bytes of a trained and of an evaluated
    sample, opcount.communication), the seconds the backend measured in it, and their ratio; no
    field when the trial did not run expert-parallel or the backend measured nothing."""
    seconds = _seconds(getattr(report, "all_to_all_seconds", None))
    if per_sample is None or seconds is None:
        return {}
    moved = per_sample[0] * int(report.train_images) + per_sample[1] * int(report.val_images)
    return {"all_to_all": {"bytes": moved, "seconds": seconds,
                           "bytes_per_second": moved / seconds if seconds > 0 else None}}


def pricing_fields(report) -> dict:
    """epoch_end's `pricing_seconds` (docs/run-directory.md): the backend's collectives outside the
    steps that priced their waits (EpochReport.pricing_seconds); no field where none ran."""
    seconds = _seconds(getattr(report, "pricing_seconds", None))
    return {} if seconds is None else {"pricing_seconds": seconds}


@dataclass(frozen=True)
class AllReduceLayout:
    """What a trial's all-reduce bytes are counted from: its graph, data-parallel degree (`ranks`, every
    device of every node), nodes, global batch and whether its experts were sharded."""

    graph: Graph
    ranks: int
    nodes: int
    batch_size: int
    expert_parallel: bool = False


def all_reduce_fields(report, layout: AllReduceLayout | None) -> dict:
    """epoch_end's `all_reduce` (docs/run-directory.md) for a data-parallel trial: the bytes the epoch's
    gradient all-reduces moved, analytic (opcount.communication.all_reduce_bytes over its optimiser
    steps), the seconds the backend measured waiting on them (null where it cannot measure), and their
    ratio; no field for a trial on one device (`layout` None or of one rank)."""
    if layout is None or layout.ranks < 2:
        return {}
    from aiperf_opcount.communication import all_reduce_bytes, optimiser_steps

    steps = optimiser_steps(int(report.train_images), layout.batch_size)
    moved = all_reduce_bytes(layout.graph, layout.ranks, layout.nodes, steps, layout.expert_parallel)
    seconds = _seconds(getattr(report, "all_reduce_seconds", None))
    return {"all_reduce": {"bytes": moved.bytes, "seconds": seconds,
                           "bytes_per_second": moved.bytes / seconds if seconds else None,
                           "ranks": layout.ranks, "nodes": layout.nodes, "steps": steps,
                           "expert_parallel": layout.expert_parallel, "inter_node_bytes": moved.inter_node_bytes,
                           "intra_node_bytes": moved.intra_node_bytes}}


def _total_compile_seconds(values) -> float | None:
    """The sum of the measured values; None when none was measured."""
    measured = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return float(sum(measured)) if measured else None


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Replica:
    """Replica `replica_id` of the run in `run_dir`. `backend` and `dataset` default to what run.json
    names; tests pass their own."""

    def __init__(self, run_dir: str | os.PathLike, replica_id: int, *, backend: Backend | None = None,
                 dataset: Dataset | None = None, node_rank: int = 0):
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise ReplicaError(f"replica id must be a non-negative integer, got {replica_id!r}")
        self.run_dir = RunDir(run_dir)
        self.id = replica_id
        self.spec = RunSpec.from_run(self.run_dir.read_run())
        self.policy = self.spec.policy
        self.nodes = self.policy.get("nodes_per_replica", 1)
        if not 0 <= node_rank < self.nodes:
            raise ReplicaError(f"--node-rank {node_rank}: the run's replicas have {self.nodes} node(s) "
                               f"(policy nodes_per_replica)")
        self.node_rank = node_rank
        self._roster = None  # replica_nodes.NodeRoster of a replica across nodes
        self._lost_nodes: list[dict] = []
        self.workload = workloads.get(self.policy["workload"])
        self._backend = backend
        self._dataset = dataset
        self.history = SharedHistory(self.run_dir, replica=replica_id,  # its own trials join as they end
                                     workload=self.workload.name)
        self._parent_graphs: dict[str, Graph] = {}
        self._distances = nas.DistanceCache()
        self._rejected: set[str] = set()  # trials whose files failed their checks
        self._state = _Status()
        self._log: EventLog | None = None

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> str:
        """Run trials until the deadline, a stop request or stop_after_trials; return the stop reason.

        The replica first takes the lease on its id (replicas/<I>/lease.json): while another live
        process holds it, this one refuses with a ReplicaError naming it, so two processes never
        append to one event log. A lease left by a process of another host is waited for until it
        is stale (rundir.Lease). Steps report their progress (StepClock) to a node-local file that
        the heartbeat carries to the primary. On a node other than a replica's first, it follows
        the leader's trials instead (replica_nodes) and returns 'followed'."""
        if self.node_rank > 0:
            from aiperf_core.replica_nodes import follow

            return follow(self)
        self._cadence = replica_cadence(self.spec.replicas)
        self._lease = Lease(self.run_dir.replica_lease(self.id), f"replica {self.id}",
                            stale_s=self._cadence.lease_stale_s)
        try:
            self._lease.acquire(wait=True)
        except AiperfError as exc:
            raise ReplicaError(f"replica {self.id} of {self.run_dir.root}: {exc}") from None
        if self._lease.taken_over:
            old = self._lease.taken_over
            print(f"replica {self.id}: took over the lease of pid {old.get('pid')} on host {old.get('host')} "
                  f"({'its process is gone' if old['verdict'] == 'gone' else 'it was stale'})", file=sys.stderr,
                  flush=True)
        progress_dir = _progress_dir()
        self._state.progress_file = Path(progress_dir) / "progress.json"
        inherited = os.environ.get(StepClock.PROGRESS_FILE_ENV)
        os.environ[StepClock.PROGRESS_FILE_ENV] = str(self._state.progress_file)  # for spawned ranks too
        try:
            return self._run_owned()
        finally:
            if inherited is None:
                os.environ.pop(StepClock.PROGRESS_FILE_ENV, None)
            else:
                os.environ[StepClock.PROGRESS_FILE_ENV] = inherited
            shutil.rmtree(progress_dir, ignore_errors=True)
            self._lease.release()

    def _run_owned(self) -> str:
        backend = self._backend
        if backend is None:
            from aiperf_core.registry import load_backend
            backend = load_backend(self.spec.backend)
        self.backend = backend
        if self._dataset is None:
            self._dataset = self.workload.data.open(self.spec.dataset, self.policy)
        dataset_digest = self.workload.data.digest(self._dataset, self.spec.dataset)  # this node's copy
        past = read_events(self.run_dir.replica_log(self.id))
        nodes = self._join_nodes() if self.nodes > 1 else None
        self._log = EventLog(self.run_dir.replica_log(self.id), lease=self._lease).open()
        stopping = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(stopping,), name=f"heartbeat-{self.id}", daemon=True)
        planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"planner-{self.id}")
        sampler = Sampler(self.run_dir, self.id, self.spec.monitor_interval_s).start()
        try:
            self._recover(past)
            self.precision = self._training_precision(past)
            self._append("replica_start", pid=os.getpid(), host=socket.gethostname(), backend=self.spec.backend,
                         framework_version=backend.framework_version(), devices=list(backend.devices()),
                         precision=self.precision, attempt=1 + sum(e.get("event") == "replica_start" for e in past),
                         dataset_digest=dataset_digest, container=running_image(),
                         **({"nodes": nodes} if nodes else {}))
            beat.start()
            next_seq = sum(e.get("event") == "trial_start" for e in past)
            reason = self._loop(next_seq, planner)
            self._append("replica_stop", reason=reason)
            return reason
        finally:
            if self._roster is not None:
                from aiperf_core.replica_nodes import end_followers

                end_followers(self._roster)
            stopping.set()
            sampler.stop()
            planner.shutdown(wait=True, cancel_futures=True)
            if beat.is_alive():
                beat.join()
            self._log.close()

    def _join_nodes(self) -> list[dict]:
        """Node 0 of a replica across nodes: join its launch's roster and wait for every other node
        (NodeError naming the first missing one after the policy's node_timeout_s); their records
        for replica_start, by node rank."""
        from aiperf_core.replica_nodes import join_as_leader

        self._roster, records = join_as_leader(self)
        return [{key: record.get(key) for key in ("node_rank", "host", "addr", "devices", "pid")} for record in records]

    def _training_precision(self, past: list[dict]) -> str:
        """run.json's resolved precision. Where the primary could not probe the devices (SLURM) it
        is the policy's explicit precision, or `auto` as this replica first resolved it (its earliest
        replica_start: a restart trains as before), or, on its first start, the fastest precision
        the backend declares on this node's first device, timed on the seed model as the primary
        times it (workflow.auto_precision; the timings go to replica.log)."""
        if self.spec.precision is not None:
            return self.spec.precision
        if self.policy["precision"] != AUTO_PRECISION:
            return self.policy["precision"]
        earlier = [e.get("precision") for e in past if e.get("event") == "replica_start"]
        if earlier and earlier[0] in PRECISIONS:
            return earlier[0]
        from aiperf_core.workflow import auto_precision

        device = self.backend.devices()[0]
        probe = auto_precision.measure(self.backend, device, self.initial_graph(), self.backend.precisions(device),
                                       auto_precision.batch_size_for(device, self.policy["batch_size"]))
        print(f"replica {self.id}: precision {probe['chosen']} ({auto_precision.describe(probe)})",
              file=sys.stderr, flush=True)
        return probe["chosen"]

    def _loop(self, seq: int, planner: ThreadPoolExecutor) -> str:
        failures = 0
        pending: Future | None = None
        while True:
            reason = self._stop_reason(seq)
            if reason is not None:
                return reason
            round_number = seq + 1
            plan = pending.result() if pending is not None else self._plan(round_number, latest=True)
            pending = None

            def plan_next(round_number=round_number):
                nonlocal pending
                if self._stop_reason(seq + 1) is None and self._usable(round_number + 1, latest=False):
                    pending = planner.submit(self._plan, round_number + 1, False)

            status = self._trial(seq, plan, on_start=plan_next)
            if self._lost_nodes:
                lost = ", ".join(f"node {n.get('node_rank')} ({n.get('host')})" for n in self._lost_nodes)
                raise ReplicaError(f"lost {lost}: the replica cannot go on without it")
            failures = failures + 1 if status == "failed" else 0
            if failures >= MAX_CONSECUTIVE_FAILURES:
                return "failures"
            seq += 1

    def _stop_reason(self, seq: int) -> str | None:
        if (self.run_dir.primary_dir / STOP_FILE).exists():
            return "stopped"
        if time.time() >= self.spec.deadline:
            return "deadline"
        if self.spec.stop_after_trials is not None and seq >= self.spec.stop_after_trials:
            return "max_trials"
        return None

    # -- planning (runs on the planner thread, except for round 1 and round 2 of a lone replica) --
    def _usable(self, round_number: int, latest: bool) -> list[TrialRecord]:
        """The trials the plan of round_number may use: this replica's up to round_number - 2 and
        every other replica's; with latest, everything finished when that leaves nothing."""
        self.history.refresh()
        usable = [r for r in self.history.records if (r.replica != self.id or r.round <= round_number - 2)
                  and r.trial not in self._rejected]
        if not usable and latest:
            usable = [r for r in self.history.records if r.trial not in self._rejected]
        return usable

    def _plan(self, round_number: int, latest: bool) -> Plan:
        seed = self.spec.seed
        usable = self._usable(round_number, latest) if round_number > 1 else []
        observations = [hpo.Observation(r.hpo_point, r.target) for r in usable if r.replica == self.id]
        proposal = hpo.propose(self.policy, round_number, observations, [seed, self.id],
                               self.workload.hpo.dimensions(self.policy))
        while usable:
            try:
                return self._morph_plan(round_number, usable, proposal)
            except _UnusableParent as exc:
                # A damaged parent must not stall every later round: drop it and plan again.
                print(f"replica {self.id}: {exc}; not used as a parent again", file=sys.stderr, flush=True)
                self._rejected.add(exc.trial)
                usable = [r for r in usable if r.trial != exc.trial]
        graph = self.initial_graph()
        from aiperf_core.weights import init_weights
        return Plan(round_number, None, None, graph, init_weights(graph, _seed(seed, self.id, round_number)),
                    proposal, None)

    def initial_graph(self) -> Graph:
        return self.workload.seed.build(self.policy, self._dataset)

    def _morph_plan(self, round_number: int, usable: list[TrialRecord], proposal: hpo.Proposal) -> Plan:
        from aiperf_core.morph import signature_hash

        morphs = self.workload.morphs
        parents = nas.best_trials(usable, self.policy["nas_parents"])
        for trial in set(self._parent_graphs) - {p.trial for p in parents}:
            del self._parent_graphs[trial]  # keep only the graphs of current parents in memory
        wanted = self.policy["nas_candidates"]
        candidates = []  # (parent record, parent graph, MorphResult without weights)
        over_memory: list[dict] = []
        memory = self._memory_check(proposal.batch_size, over_memory)
        for k, parent in enumerate(parents):
            graph = self._parent_graph(parent)
            share = wanted // len(parents) + (1 if k < wanted % len(parents) else 0)
            for result in morphs.generate_candidates(graph, None, max(share, 1),
                                                     _seed(self.spec.seed, self.id, round_number, k), self.policy,
                                                     memory):
                candidates.append((parent, graph, result))
        if over_memory:
            print(f"replica {self.id}: round {round_number}: {len(over_memory)} grown child(ren) skipped: their "
                  f"smallest step needs {min(c['estimate_bytes'] for c in over_memory) / 2**30:.2f} GiB or more "
                  f"a device, over its {over_memory[0]['budget_bytes'] / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
        known = {r.signature for r in self.history.records}
        fresh = [c for c in candidates if signature_hash(c[2].graph) not in known] or candidates
        if not fresh:
            raise ReplicaError(f"round {round_number}: no morph of parents {[p.trial for p in parents]} is possible")
        codes = [self.workload.distance_code(c[2].graph) for c in fresh]
        position = {id(r): k for k, r in enumerate(self.history.records)}
        summaries = self.history.summaries()[[position[id(r)] for r in usable]]
        selection = nas.select(usable, summaries, codes, self.policy, self._distances)
        parent, parent_graph, chosen = fresh[selection.index]
        record = morphs.tune_morph(dict(chosen.record), proposal)
        child = morphs.replay(parent_graph, self._parent_weights(parent, parent_graph), record)
        return Plan(round_number, parent.trial, child.record, child.graph, child.weights, proposal,
                    selection.describe(), over_memory)

    # -- memory (opcount.memory; the lm policy's micro_batch and activation_checkpointing) ---------
    def _device_shard(self, batch_size: int) -> int:
        """The samples of a global batch one device takes: data parallelism splits it evenly."""
        return -(-batch_size // self.world)

    @property
    def world(self) -> int:
        """Every device of this replica, on every node."""
        return len(self.backend.devices()) * self.nodes

    def memory_plan(self, graph: Graph, batch_size: int):
        """How each device runs its shard of a global batch (micro-batches, checkpointing), chosen by
        the memory estimate against the device's memory; None for a workload without those policy
        items (the cnn trains every shard whole). A ReplicaError where nothing fits."""
        if "micro_batch" not in self.policy:
            return None
        from aiperf_opcount.memory import plan_memory

        device = self.backend.devices()[0]
        budget = self.backend.device_memory(device)
        plan = plan_memory(graph, self._device_shard(batch_size), budget, self.precision, self.policy["optimizer"],
                           self.policy["micro_batch"], self.policy["activation_checkpointing"],
                           expert_devices=self._expert_devices(graph))
        if plan is None:
            raise ReplicaError(f"the graph does not fit {device}'s {budget / 2**30:.2f} GiB even one sample at a time "
                               f"(policy micro_batch {self.policy['micro_batch']}, activation_checkpointing "
                               f"{self.policy['activation_checkpointing']})")
        return plan

    def _expert_devices(self, graph: Graph) -> int:
        """The devices a trial of `graph` shards its experts over (1: every expert on every device)."""
        return self.world if expert_parallel(self.policy, self.backend, graph, self.world) else 1

    def _memory_check(self, batch_size: int, over_memory: list):
        """The candidate filter's memory test (workloads' Morphs.generate_candidates): the estimate of
        a child's smallest step the policy allows against the device's memory, each child over it
        noted in `over_memory`; None where the workload has no memory policy or the device cannot
        tell its memory."""
        if "micro_batch" not in self.policy:
            return None
        budget = self.backend.device_memory(self.backend.devices()[0])
        if budget is None:
            return None
        from aiperf_opcount.memory import MEMORY_HEADROOM, smallest_step

        shard = self._device_shard(batch_size)

        def needs(graph: Graph) -> int | None:
            """The bytes over the budget this child's smallest step needs; None when it fits."""
            total = smallest_step(graph, shard, self.precision, self.policy["optimizer"], self.policy["micro_batch"],
                                  self.policy["activation_checkpointing"],
                                  expert_devices=self._expert_devices(graph)).total
            if total <= budget * MEMORY_HEADROOM:
                return None
            over_memory.append({"estimate_bytes": total, "budget_bytes": budget, "params": graph.num_params()})
            return total

        from aiperf_core.morph import MemoryCheck

        return MemoryCheck(needs, int(budget * MEMORY_HEADROOM))

    def _parent_graph(self, parent: TrialRecord) -> Graph:
        graph = self._parent_graphs.get(parent.trial)
        if graph is None:
            try:
                raw = (self.run_dir.trial_dir(parent.trial) / "graph.json").read_bytes()
            except OSError as exc:
                raise _UnusableParent(parent.trial, f"graph.json: {_one_line(exc)}") from None
            if sha256_bytes(raw) != parent.files.get("graph.json"):
                raise _UnusableParent(parent.trial, "graph.json changed since its trial ended")
            graph = Graph.from_json(raw.decode("utf-8"))  # it hashed as recorded: written by a replica
            self._parent_graphs[parent.trial] = graph
        return graph

    def _parent_weights(self, parent: TrialRecord, graph: Graph) -> Weights:
        from aiperf_core.weights import load_weights

        path = self.run_dir.trial_dir(parent.trial) / "weights.npz"
        try:
            digest = sha256_file(path)
        except OSError as exc:
            raise _UnusableParent(parent.trial, f"weights.npz: {_one_line(exc)}") from None
        if digest != parent.files.get("weights.npz"):
            raise _UnusableParent(parent.trial, "weights.npz changed since its trial ended")
        return load_weights(path, graph)

    # -- one trial -----------------------------------------------------------------------------
    def _trial(self, seq: int, plan: Plan, on_start) -> str:
        policy, trial = self.policy, trial_id(self.id, seq)
        folder = self.run_dir.trial_dir(trial)
        graph_bytes = (plan.graph.to_json() + "\n").encode("utf-8")
        write_bytes_atomic(folder / "graph.json", graph_bytes)
        files = {"graph.json": sha256_bytes(graph_bytes)}
        hyper = {**plan.proposal.point, "epochs": policy.epochs_for(plan.round),
                 "learning_rate": self.workload.hpo.learning_rate(policy, plan.proposal),
                 "patience": policy.patience_for(plan.round), "label_smoothing": policy["label_smoothing"],
                 "precision": self.precision}
        memory, memory_error = None, None
        try:
            memory = self.memory_plan(plan.graph, hyper["batch_size"])
        except ReplicaError as exc:
            memory_error = exc
        extra = {"memory": memory.to_dict()} if memory is not None else {}
        if plan.over_memory:
            extra["over_memory"] = plan.over_memory
        self._append("trial_start", trial=trial, round=plan.round, parent=plan.parent, morph=plan.morph,
                     hyper=hyper, graph_sha256=files["graph.json"], **extra)
        self._state.update(state="training", trial=trial, round=plan.round, epoch=None)
        on_start()
        watch = _EpochWatch(self, trial, hyper["patience"])
        trial_seed = _seed(self.spec.seed, self.id, plan.round, 1 << 20)
        config = train_config(policy, hyper, trial_seed)
        if memory is not None:
            config = replace(config, micro_batch=memory.micro_batch, checkpoint_blocks=memory.checkpoint_blocks)
        config = replace(config, expert_parallel=expert_parallel(policy, self.backend, plan.graph, self.world))
        if config.expert_parallel:
            from aiperf_opcount.communication import bytes_per_sample
            watch.all_to_all_per_sample = (bytes_per_sample(plan.graph, config.precision, True),
                                           bytes_per_sample(plan.graph, config.precision, False))
        if self.world > 1:
            watch.all_reduce_layout = AllReduceLayout(plan.graph, self.world, self.nodes, config.batch_size,
                                                      config.expert_parallel)
        weights = None
        try:
            if memory_error is not None:
                raise memory_error
            data = self.workload.data.trial_data(self._dataset, policy, trial_seed)
            if self._roster is not None:
                from aiperf_core.replica_nodes import lead_trial

                config = lead_trial(self, seq, trial, folder / "graph.json", files["graph.json"], plan.weights,
                                    config, trial_seed)
            model = self.backend.lower(plan.graph, plan.weights, hyper["precision"])
            plan.weights = None  # the backend holds them now; free the copy during training
            watch.started = time.time()
            self.backend.train(model, data, config, watch)
            if watch.stop_reason == "diverged":
                raise ReplicaError("training diverged: a loss is not finite")
            weights = self.backend.export_weights(model)
            status = "early_stopped" if watch.stop_reason else "ok"
            reason = watch.stop_reason
        except Exception as exc:  # a failed trial is recorded and the loop goes on
            status, reason = "failed", _one_line(exc)
            if self._roster is not None:
                self._lost_nodes = self._roster.lost(list(range(1, self.nodes)))
                if self._lost_nodes:
                    lost = self._lost_nodes[0]
                    reason = f"lost node {lost.get('node_rank')} ({lost.get('host')}): {reason}"
            print(f"replica {self.id}: trial {trial} failed: {reason}", file=sys.stderr, flush=True)
        self._state.update(state="recording", epoch=None)
        accuracies = watch.accuracies
        best = max((a for a in accuracies if a is not None), default=None)
        qualities = [None if e is None else 1.0 - e for e in watch.errors]
        best_quality = max((q for q in qualities if q is not None), default=None)
        predicted = None
        if status != "failed" and policy.is_warmup(plan.round):
            predicted = curve.predict_final_accuracy(qualities, policy["max_epochs"])
        target = None if status == "failed" else (predicted if predicted is not None else best_quality)
        if weights is not None:
            from aiperf_core.weights import save_weights
            save_weights(weights, folder / "weights.npz")
            files["weights.npz"] = sha256_file(folder / "weights.npz")
        from aiperf_core.morph import signature_hash
        info = {"trial": trial, "replica": self.id, "round": plan.round, "parent": plan.parent, "morph": plan.morph,
                "hyper": hyper, "hpo": plan.proposal.source, "hpo_point": dict(plan.proposal.point), "nas": plan.nas,
                "status": status, "reason": reason, "epochs": len(accuracies), "val_accuracy": accuracies,
                "val_loss": watch.losses, "best_val_accuracy": best, "predicted_accuracy": predicted,
                "target": target, "compile_seconds": watch.compile_seconds,
                "arch": self.workload.distance_code(plan.graph).to_json(), "signature": signature_hash(plan.graph)}
        files["trial.json"] = self._write_trial_json(folder, info)
        self._append("trial_end", trial=trial, status=status, reason=reason, epochs=len(accuracies),
                     best_val_accuracy=best, predicted_accuracy=predicted, compile_seconds=watch.compile_seconds,
                     files=files)
        self._state.update(state="planning", trial=None)
        return status

    @staticmethod
    def _write_trial_json(folder: Path, info: dict) -> str:
        text = json.dumps(info, sort_keys=True, allow_nan=False) + "\n"
        write_text_atomic(folder / "trial.json", text)
        return sha256_bytes(text.encode("utf-8"))

    # -- restart -------------------------------------------------------------------------------
    def _recover(self, past: list[dict]) -> None:
        """Close every trial a crash left open, with trial_end `interrupted`, before anything else."""
        starts = {e["trial"]: e for e in past if e.get("event") == "trial_start"}
        ended = {e.get("trial") for e in past if e.get("event") == "trial_end"}
        for trial, start in starts.items():
            if trial in ended:
                continue
            epochs = [e for e in past if e.get("event") == "epoch_end" and e.get("trial") == trial]
            accuracies = [e.get("val_accuracy") for e in epochs]
            best = max((a for a in accuracies if a is not None), default=None)
            compile_seconds = _total_compile_seconds(e.get("compile_seconds") for e in epochs)
            folder = self.run_dir.trial_dir(trial)
            files = {}
            if (folder / "graph.json").exists():
                files["graph.json"] = sha256_file(folder / "graph.json")
            reason = "the replica stopped mid-trial (crash or kill); restarted"
            info = {"trial": trial, "replica": self.id, "round": start.get("round"), "parent": start.get("parent"),
                    "morph": start.get("morph"), "hyper": start.get("hyper"), "status": "interrupted",
                    "reason": reason, "epochs": len(accuracies), "val_accuracy": accuracies,
                    "best_val_accuracy": best, "predicted_accuracy": None, "target": None,
                    "compile_seconds": compile_seconds}
            files["trial.json"] = self._write_trial_json(folder, info)
            self._append("trial_end", trial=trial, status="interrupted", reason=reason, epochs=len(accuracies),
                         best_val_accuracy=best, predicted_accuracy=None, compile_seconds=compile_seconds,
                         files=files)

    # -- records -------------------------------------------------------------------------------
    def _append(self, event: str, **fields: Any) -> dict:
        return self._log.append(event, replica=self.id, **fields)

    def _heartbeat(self, stopping: threading.Event) -> None:
        renewed = time.monotonic()
        while True:
            try:
                self.run_dir.write_heartbeat(self.id, **self._state.beat())
                if time.monotonic() - renewed >= self._cadence.lease_renew_s:
                    if not self._lease.renew():
                        # Another process took this replica id over (this one was frozen for longer
                        # than a lease lives): it owns the logs now, so stop writing at once.
                        print(f"replica {self.id}: lost its lease on the replica id to another process; exiting",
                              file=sys.stderr, flush=True)
                        os._exit(LEASE_LOST_EXIT)
                    renewed = time.monotonic()
            except OSError as exc:  # a full or flaky shared disk must not kill training; retry next beat
                print(f"replica {self.id}: heartbeat not written: {exc}", file=sys.stderr, flush=True)
            if stopping.wait(self._cadence.heartbeat_s):
                return


def train_config(policy: Policy, hyper: Mapping[str, Any], seed: int) -> TrainConfig:
    """A trial's TrainConfig: the policy's optimizer and schedule at the trial's hyperparameters.
    The AdamW and clip items are the lm's (the cnn trains with SGD alone: TrainConfig's defaults)."""
    adamw = {"betas": tuple(policy["adam_betas"]), "weight_decay": policy["weight_decay"]} \
        if policy["optimizer"] == "adamw" else {}
    return TrainConfig(epochs=hyper["epochs"], batch_size=hyper["batch_size"],
                       schedule=Schedule(hyper["learning_rate"], policy["final_lr_fraction"],
                                         policy["lr_warmup_epochs"], policy["lr_schedule"]),
                       momentum=policy["momentum"], label_smoothing=hyper["label_smoothing"],
                       precision=hyper["precision"], seed=seed, compile=policy["compile"],
                       optimizer=policy["optimizer"], grad_clip=policy.get("grad_clip") or None,
                       moe_aux_loss=policy.get("moe_aux_loss", 0.0), **adamw)


def expert_parallel(policy: Policy, backend: Backend, graph: Graph, devices: int | None = None) -> bool:
    """The policy item `expert_parallel` for one trial: 'auto' is on where the backend implements it,
    the replica trains on several devices (`devices`, on every node; default this node's) and they
    divide every moe node's experts (else the trial runs data-parallel with every expert on every
    device, as 'none' does)."""
    if policy.get("expert_parallel", "none") != "auto" or not backend.parallelism().expert_parallel:
        return False
    devices = len(backend.devices()) if devices is None else devices
    moe = [node.attrs["experts"] for node in graph.nodes if node.op == "moe"]
    return devices > 1 and bool(moe) and all(experts % devices == 0 for experts in moe)


PROGRESS_DIR_PREFIX = "aiperf-progress-"


def _progress_dir() -> str:
    """A private node-local folder for this process's progress file, named after its pid. Folders
    that processes killed before they could remove theirs left behind (a stalled replica is
    stopped with SIGKILL) are removed first: those of this user whose process is gone."""
    import psutil

    base = Path(tempfile.gettempdir())
    try:
        left = [p for p in base.iterdir() if p.name.startswith(PROGRESS_DIR_PREFIX)]
    except OSError:
        left = []
    for folder in left:
        pid = folder.name[len(PROGRESS_DIR_PREFIX):].split("-")[0]
        try:
            if folder.stat().st_uid == os.getuid() and pid.isdigit() and not psutil.pid_exists(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass
    return tempfile.mkdtemp(prefix=f"{PROGRESS_DIR_PREFIX}{os.getpid()}-")


class _Status:
    """What the heartbeat says: the replica's state (starting, planning, training, recording), its
    trial, round and epoch, since when it is in that state and trial, and, while it trains, the
    progress of its steps as StepClock writes it (ignored when older than the state: a previous
    trial's), with the longest step and the longest trial start-up this process has seen."""

    def __init__(self):
        self._fields: dict[str, Any] = {"state": "starting", "trial": None, "round": None, "epoch": None}
        self._since = time.time()
        self._lock = threading.Lock()  # updated by the training thread, read by the heartbeat thread
        self.progress_file: Path | None = None
        self.longest_step_s = 0.0  # of the steps after each trial's first
        self.longest_startup_s = 0.0  # from entering a trial to the end of its first step

    def update(self, **fields: Any) -> None:
        with self._lock:
            if any(key in fields and fields[key] != self._fields[key] for key in ("state", "trial")):
                self._since = time.time()
            self._fields.update(fields)

    def beat(self) -> dict[str, Any]:
        with self._lock:
            fields, since = dict(self._fields), self._since
        progress = self._progress(since) if fields["state"] == "training" else None
        if progress is not None:
            self.longest_step_s = max(self.longest_step_s, float(progress.get("longest_step_s") or 0.0))
            first_end = progress.get("first_step_end")
            if isinstance(first_end, (int, float)):
                self.longest_startup_s = max(self.longest_startup_s, first_end - since)
        return {**fields, "since": since, "progress": progress, "longest_step_s": self.longest_step_s,
                "longest_startup_s": self.longest_startup_s}

    def _progress(self, since: float) -> dict[str, Any] | None:
        if self.progress_file is None:
            return None
        try:
            progress = json.loads(self.progress_file.read_text())
        except (OSError, ValueError):
            return None
        stamp = progress.get("time") if isinstance(progress, dict) else None
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or stamp < since:
            return None
        return progress


class _EpochWatch:
    """The on_epoch callback: logs each epoch and says when to stop."""

    def __init__(self, replica: Replica, trial: str, patience: int):
        self.replica, self.trial, self.patience = replica, trial, patience
        self.started = time.time()
        self.accuracies: list[float | None] = []
        self.losses: list[float | None] = []
        self.errors: list[float | None] = []  # the workload's error of each epoch
        self.best_loss = float("inf")
        self.since_best = 0
        self.stop_reason: str | None = None
        self.compile_seconds: float | None = None  # the trial's, summed over its epochs; None: not measured
        self.all_to_all_per_sample: tuple[int, int] | None = None  # set for an expert-parallel trial
        self.all_reduce_layout: AllReduceLayout | None = None  # set for a data-parallel trial

    def __call__(self, report: EpochReport) -> bool:
        loss, val_loss, accuracy = _finite(report.loss), _finite(report.val_loss), _finite(report.val_accuracy)
        event = self.replica._append("epoch_end", trial=self.trial, epoch=report.epoch, started=self.started,
                                     train_images=int(report.train_images), val_images=int(report.val_images),
                                     loss=loss, val_loss=val_loss, val_accuracy=accuracy,
                                     skipped_images=int(getattr(report, "skipped_images", 0)),
                                     step_seconds=None if report.step_seconds is None else _finite(report.step_seconds),
                                     compile_seconds=_seconds(getattr(report, "compile_seconds", None)),
                                     **expert_load_fields(getattr(report, "expert_load", None)),
                                     **all_to_all_fields(report, self.all_to_all_per_sample),
                                     **all_reduce_fields(report, self.all_reduce_layout),
                                     **pricing_fields(report))
        self.compile_seconds = _total_compile_seconds([self.compile_seconds, event["compile_seconds"]])
        self.started = event["time"]
        self.accuracies.append(accuracy)
        self.losses.append(val_loss)
        self.errors.append(self.replica.workload.validity.error(accuracy, val_loss, int(report.val_images)))
        self.replica._state.update(epoch=report.epoch)
        if loss is None or val_loss is None:
            self.stop_reason = "diverged"
        elif (self.replica.run_dir.primary_dir / STOP_FILE).exists():
            self.stop_reason = "stopped"
        elif event["time"] >= self.replica.spec.deadline:
            self.stop_reason = "deadline"
        else:
            if val_loss < self.best_loss:
                self.best_loss, self.since_best = val_loss, 0
            else:
                self.since_best += 1
            if self.since_best >= self.patience:
                self.stop_reason = "patience"
        return self.stop_reason is not None


def run_replica(run_dir: str | os.PathLike, replica_id: int, *, backend: Backend | None = None,
                dataset: Dataset | None = None, node_rank: int = 0) -> str:
    """Run replica replica_id of the run in run_dir until it stops; return the stop reason
    (deadline, stopped, max_trials or failures; 'followed' on a node other than its first)."""
    return Replica(run_dir, replica_id, backend=backend, dataset=dataset, node_rank=node_rank).run()


def write_run_json(run_dir: str | os.PathLike, *, backend: str = "numpy", dataset: Mapping[str, Any] | None = None,
                   policy: Mapping[str, Any] | None = None, seed: int = 0, time_budget_s: float = 3600.0,
                   replicas: int = 1, devices_per_replica: int = 1, stop_after_trials: int | None = None,
                   executor: str = "local", precision: str | None = None) -> dict:
    """Write run.json as `aiperf run` does (aiperf_core.workflow.plan.run_record), for tests and
    benchmarks that run replicas without a primary. The model is policy["initial_architecture"];
    the dataset defaults to digits at 32x32. `precision` is the resolved precision to record
    (default: the policy's, and fp32, what `auto` gives on a CPU without AMX, for `auto`).
    An lm policy's dataset defaults to the embedded corpus. Returns what was written."""
    from aiperf_core.workflow.plan import RunRequest, resolve_nodes_per_replica, run_record, watch_settings

    policy = Policy(policy or {}, "policy").to_json()
    # Written without a primary, on this one machine: `auto` is its one node's value.
    policy["nodes_per_replica"] = resolve_nodes_per_replica(policy["nodes_per_replica"], lambda: 1)
    if dataset is None and policy["workload"] == "lm":
        from aiperf_core.data.text_corpus import embedded_corpus

        dataset = embedded_corpus().describe()
    dataset = dict(dataset or {"name": "digits", "path": None, "layout": "embedded", "classes": 10,
                               "train_images": 1438, "val_images": 359, "image_size": 32})
    if precision is None:
        precision = "fp32" if policy["precision"] == AUTO_PRECISION else policy["precision"]
    run = run_record(backend=backend, executor=executor, replicas=replicas, devices_per_replica=devices_per_replica,
                     seed=seed, time_budget_s=time_budget_s, policy=policy, dataset=dataset,
                     stop_after_trials=stop_after_trials, watch=watch_settings(RunRequest()), precision=precision)
    RunDir(run_dir).write_run(run)
    return RunDir(run_dir).read_run()
