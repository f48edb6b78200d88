"""From command-line flags and the config file to run.json: every check runs before anything starts.

Precedence, strongest first: the flag, the config file, the default (the backend also honours
$AIPERF_BACKEND between the flag and the file). On `--resume` the run's own run.json stands in
for the defaults, and any fixed setting the user gives again must agree with it: the fixed
configuration (CONFIG_KEYS) is hashed into run.json's `config_sha256`, and a resume whose
configuration hashes differently is refused before anything starts.

The backend is probed in a child process (BackendProbe) for what the checks need: its devices,
whether it trains data-parallel, and the precisions it declares on the run's device; for `auto`,
it also times the seed model's steps at each of them (workflow.auto_precision). The policy's
`precision` (default `auto`) is resolved against them here, once, and the result is recorded as
run.json's `precision`, part of the fixed configuration: a resume trains at the recorded precision.
The timings behind `auto` go to run.json's `precision_probe`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from aiperf_core.errors import AiperfError
from aiperf_core.rundir import Lease, RunDir, RunDirError
from aiperf_core.workflow.duration import parse_duration

# What makes two runs the same run. Executor options (SLURM partition, restart limit, heartbeat
# timeout) are not in it: they may change on --resume, for example to move to another partition.
CONFIG_KEYS = ("backend", "executor", "model", "dataset", "policy", "precision", "replicas", "devices_per_replica",
               "seed", "time_budget_s", "stop_after_trials")
DEFAULT_TIME_BUDGET = "1h"
# The lm workload on the embedded corpus (0.4 MB) is sized for one CPU, as digits' 32 px is for the
# cnn: these are its defaults where the config sets nothing (docs/search.md). The fixed ones among
# them make such a run unofficial, as the corpus does.
EMBEDDED_LM_DEFAULTS = {"epoch_tokens": 16_384, "val_tokens": 16_384, "seq_len": 128, "initial_architecture": "gpt_small",
                        "batch_size": 16, "reference_batch_size": 16, "learning_rate": 0.005,
                        "hpo_batch_size_bounds": [8, 128], "max_bits_per_byte": 4.0}
DEFAULT_MAX_RESTARTS = 3
DEFAULT_HEARTBEAT_TIMEOUT = "10m"
DEFAULT_STALL_TIMEOUT = "10m"  # the floor of the stall timeout (aiperf_core.workflow.primary.stall_limit)
DEFAULT_STOP_GRACE = "30s"
POLICY_OPTIONS = ("nodes_per_replica",)
SLURM_OPTIONS = ("partition", "account", "time_limit", "gpus_per_node", "cpus_per_task", "extra_args")


def config_sha256(run: Mapping[str, Any]) -> str:
    """SHA-256 of the fixed configuration as recorded in run.json (canonical JSON)."""
    fixed = {key: run.get(key) for key in CONFIG_KEYS}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class RunRequest:
    """What the user asked for, flags already merged over the config file. None: not given."""

    backend: str | None = None
    executor: str | None = None
    replicas: int | None = None
    devices_per_replica: int | None = None
    time_budget: str | None = None
    workload: str | None = None
    data: str | None = None
    data_workers: int | None = None
    run_dir: str | None = None
    seed: int | None = None
    max_restarts: int | None = None
    heartbeat_timeout: str | None = None
    stall_timeout: str | None = None
    stop_grace: str | None = None
    stop_after_trials: int | None = None
    policy: dict[str, Any] = field(default_factory=dict)
    slurm: dict[str, Any] = field(default_factory=dict)
    hosts: dict[str, Any] = field(default_factory=dict)  # hostfile, launcher


def merge_request(flags: Mapping[str, Any], config: Mapping[str, Any]) -> RunRequest:
    """Flags (None when not given) over the config file's values."""
    request = RunRequest(policy=dict(config.get("policy", {})), slurm=dict(config.get("slurm", {})))
    for name in ("backend", "executor", "replicas", "devices_per_replica", "time_budget", "workload", "data", "run_dir",
                 "seed",
                 "max_restarts", "heartbeat_timeout", "stall_timeout", "stop_after_trials"):
        value = flags.get(name)
        setattr(request, name, value if value is not None else config.get(name))
    request.data_workers = flags.get("data_workers")
    # Policy items that are also run options and top-level config keys: the flag over the key over
    # the config's [policy] table.
    for name in POLICY_OPTIONS:
        value = flags.get(name) if flags.get(name) is not None else config.get(name)
        if value is not None:
            request.policy[name] = value
    request.stop_grace = flags.get("stop_grace")
    for name in SLURM_OPTIONS:
        if flags.get(f"slurm_{name}") is not None:
            request.slurm[name] = flags[f"slurm_{name}"]
    for name in ("hostfile", "launcher"):
        if flags.get(name) is not None:
            request.hosts[name] = flags[name]
    return request


@dataclass(frozen=True)
class WatchSettings:
    """How the primary watches replicas; not part of the fixed configuration."""

    max_restarts: int
    heartbeat_timeout_s: float
    stop_grace_s: float
    slurm: dict[str, Any]
    stall_timeout_s: float = 600.0  # the floor; see aiperf_core.workflow.primary.stall_limit
    hosts: dict[str, Any] = field(default_factory=dict)  # the hosts executor's hostfile and launcher

    def to_json(self) -> dict[str, Any]:
        return {"max_restarts": self.max_restarts, "heartbeat_timeout_s": self.heartbeat_timeout_s,
                "stall_timeout_s": self.stall_timeout_s, "stop_grace_s": self.stop_grace_s, "slurm": self.slurm,
                **({"hosts": self.hosts} if self.hosts else {})}


def watch_settings(request: RunRequest, recorded: Mapping[str, Any] | None = None) -> WatchSettings:
    """Watch settings: the request's, else those recorded in run.json (on --resume), else defaults."""
    recorded = recorded or {}
    max_restarts = request.max_restarts if request.max_restarts is not None else recorded.get(
        "max_restarts", DEFAULT_MAX_RESTARTS)
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise AiperfError(f"--max-restarts: must be a whole number >= 0, got {max_restarts!r}")
    timeout = (parse_duration(request.heartbeat_timeout, "--heartbeat-timeout") if request.heartbeat_timeout
               else recorded.get("heartbeat_timeout_s") or parse_duration(DEFAULT_HEARTBEAT_TIMEOUT))
    stall = (parse_duration(request.stall_timeout, "--stall-timeout") if request.stall_timeout
             else recorded.get("stall_timeout_s") or parse_duration(DEFAULT_STALL_TIMEOUT))
    grace = (parse_duration(request.stop_grace, "--stop-grace") if request.stop_grace
             else recorded.get("stop_grace_s") or parse_duration(DEFAULT_STOP_GRACE))
    slurm = {**recorded.get("slurm", {}), **request.slurm}
    if slurm.get("time_limit") is not None:
        slurm["time_limit_s"] = parse_duration(slurm.pop("time_limit"), "--slurm-time-limit")
    hosts = {**recorded.get("hosts", {}), **request.hosts}
    if "hostfile" in hosts:
        hosts["hostfile"] = str(Path(hosts["hostfile"]).expanduser().resolve())
    return WatchSettings(max_restarts, float(timeout), float(grace), slurm, stall_timeout_s=float(stall), hosts=hosts)


def workload_of(request: RunRequest) -> str:
    """--workload (or the config's `workload`), else the policy's `workload`, else cnn."""
    from aiperf_core import workloads

    name = request.workload or request.policy.get("workload") or workloads.DEFAULT
    if request.workload and request.policy.get("workload") not in (None, request.workload):
        raise AiperfError(f"--workload {request.workload}: the config's policy.workload says "
                          f"{request.policy['workload']!r}")
    return workloads.get(name).name


def data_choice(request: RunRequest) -> tuple[str, str | None]:
    """(dataset name, absolute path or None) from --data. The CNN's: digits, synthetic, or a folder
    (ImageNet); the LM's: embedded (the default), or a folder `aiperf data prepare` wrote (enwik8)."""
    data = request.data
    if workload_of(request) == "lm":
        from aiperf_core.data.text_corpus import EMBEDDED

        if data is None or data == EMBEDDED:
            return EMBEDDED, None
        path = Path(data).expanduser()
        if not path.is_dir():
            raise AiperfError(f"--data {data}: not a folder (the lm workload reads embedded, or the folder "
                              f"`aiperf data prepare enwik8.zip OUT` wrote)")
        return "enwik8", str(path.resolve())
    if data is None:
        named = request.policy.get("dataset")
        if named in ("digits", "synthetic"):
            return named, None
        raise AiperfError("--data: give the ImageNet folder (--data PATH), or --data digits|synthetic "
                          "for an unofficial run")
    if data in ("digits", "synthetic"):
        return data, None
    path = Path(data).expanduser()
    if not path.exists():
        raise AiperfError(f"--data {data}: no such file or directory")
    return "imagenet", str(path.resolve())


def build_policy(request: RunRequest, dataset: str, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Policy values (checked): run.json's on resume, else defaults; the config's [policy] and the
    flags over them. The image size defaults to the dataset's own (32 for digits, 224 for ImageNet)."""
    from aiperf_core import data
    from aiperf_core.policy import Policy

    values = dict(base or {})
    values.update(request.policy)
    values["workload"] = values.get("workload", "cnn") if base else workload_of(request)
    values["dataset"] = dataset
    if request.data_workers is not None:
        values["data_workers"] = request.data_workers
    from aiperf_core.data.text_corpus import EMBEDDED

    if values["workload"] == "lm" and dataset == EMBEDDED:
        for name, value in EMBEDDED_LM_DEFAULTS.items():
            values.setdefault(name, value)
    if values["workload"] == "cnn" and "image_size" not in values:
        values["image_size"] = data.DEFAULT_IMAGE_SIZE.get(dataset, 224)
    return Policy(values, source="policy").to_json()


def describe_dataset(name: str, path: str | None, policy: Mapping[str, Any]) -> dict[str, Any]:
    """run.json's `dataset`: the data is opened and checked now, with the loader the policy names,
    so a bad one (or DALI asked for where it has nothing to decode) fails before the start. `digest`
    is the one identity of the data: its manifest's (docs/data.md), None for a folder without one;
    for text, the digest of its three splits (the embedded corpus's made as a manifest would)."""
    from aiperf_core import data
    from aiperf_core.data.manifest import recorded_digest

    if policy["workload"] == "lm":
        from aiperf_core import workloads
        from aiperf_core.policy import Policy

        try:
            corpus = workloads.get("lm").data.open({"name": name, "path": path}, Policy(policy))
        except AiperfError as exc:
            raise AiperfError(f"--data {path or name}: {exc}") from None
        return corpus.describe()
    image_size, data_loader = policy["image_size"], policy["data_loader"]

    spec = {"name": name, "path": path, "image_size": image_size, "data_loader": data_loader}
    try:
        described = data.describe(spec)
    except AiperfError as exc:
        raise AiperfError(f"--data {path or name}: {exc}") from None
    keep = ("name", "path", "layout", "classes", "train_images", "val_images", "image_size")
    return {**{key: described.get(key, spec.get(key)) for key in keep}, "digest": recorded_digest(path)}


def run_device(devices: list[str]) -> str:
    """The device whose precisions a run uses: the first accelerator (replica 0's first device in
    the local layout), else the first device, a CPU. A node's accelerators are taken to be alike."""
    return next((d for d in devices if not d.startswith("cpu")), devices[0])


@dataclass(frozen=True)
class BackendFacts:
    """What the primary's checks need to know about the backend on this machine."""

    devices: list[str]
    data_parallel: bool  # Backend.parallelism().data_parallel
    device: str | None = None  # run_device(devices); None when precisions were not probed
    precisions: tuple[str, ...] | None = None  # Backend.precisions(device)
    precision_probe: dict[str, Any] | None = None  # auto_precision.measure(): what `auto` gives, where asked
    multi_node_why_not: str | None = None  # None: Backend.parallelism().multi_node; else why it is not


# Run in a child process: initialising a framework's devices can take GPU memory for as long as
# the process lives (JAX preallocates most of it), and the primary lives as long as the run.
_PROBE = """
import json, sys
from aiperf_core.errors import AiperfError
from aiperf_core.registry import load_backend
from aiperf_core.workflow.plan import run_device
try:
    backend = load_backend(sys.argv[1])
    devices = list(backend.devices())
    declared = backend.parallelism()
    facts = {"devices": devices, "data_parallel": bool(declared.data_parallel),
             "multi_node_why_not": None if declared.multi_node else (declared.multi_node_why_not or "")}
    if sys.argv[2] == "precisions":
        device = run_device(devices)
        facts.update(device=device, precisions=list(backend.precisions(device)))
        seed = json.loads(sys.stdin.read() or "null")  # sent once the primary has described the dataset
        if seed is not None:
            from aiperf_core.workflow.auto_precision import measure_seed_model
            facts["precision_probe"] = measure_seed_model(backend, device, facts["precisions"], seed)
    print(json.dumps(facts))
except AiperfError as exc:
    print(json.dumps({"error": str(exc)}))
"""


class BackendProbe:
    """What backend `name` is on this machine (BackendFacts), found by a child process that runs
    while the primary does its other checks. With `precisions`, the precisions of the run's device
    are probed too (a short step per mixed precision), and, where facts() is given the seed model,
    timed for `auto`; without, only devices and parallelism (a SLURM primary, whose node is not
    where replicas train). An unknown or unavailable backend is an AiperfError naming --backend."""

    def __init__(self, name: str, precisions: bool = True, timeout_s: float = 600, container=None):
        """`container`: the image replicas run in (workflow.container.ContainerSpec): the backend
        is probed there, as its replicas will see it."""
        import subprocess
        import sys

        from aiperf_core.workflow.container import launch_command

        self.name, self.timeout_s = name, timeout_s
        argv, env = launch_command(container, [sys.executable, "-c", _PROBE, name,
                                               "precisions" if precisions else "devices"], os.environ)
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=env)

    def __enter__(self) -> "BackendProbe":
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:  # another check failed first: the answer is not needed
            self.process.kill()
            self.process.communicate()

    def facts(self, auto: dict[str, Any] | None = None) -> BackendFacts:
        """`auto`: the seed model whose steps `auto` times (auto_request), or None: nothing timed."""
        import subprocess

        try:
            out, err = self.process.communicate(json.dumps(auto) if auto is not None else "", timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise AiperfError(f"--backend {self.name}: loading it took more than {self.timeout_s:.0f} s") from None
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (IndexError, ValueError):
            last = (err.strip().splitlines() or [f"exit code {self.process.returncode}"])[-1]
            raise AiperfError(f"--backend {self.name}: loading it failed: {last}") from None
        if "error" in result:
            raise AiperfError(f"--backend {self.name}: {result['error']}")
        precisions = result.get("precisions")
        return BackendFacts(devices=result["devices"], data_parallel=result["data_parallel"],
                            device=result.get("device"), precision_probe=result.get("precision_probe"),
                            precisions=None if precisions is None else tuple(precisions),
                            multi_node_why_not=result.get("multi_node_why_not"))


def auto_request(policy: Mapping[str, Any], dataset: Mapping[str, Any]) -> dict[str, Any] | None:
    """What BackendProbe.facts() times for `auto`: the run's seed model at its input size and
    first batch size; None where the policy asks for a precision."""
    from aiperf_core.backend import AUTO_PRECISION

    if policy["precision"] != AUTO_PRECISION:
        return None
    if policy["workload"] == "lm":
        from aiperf_core.workloads.lm import SEED_MODELS, SEEDS

        seed = policy["initial_architecture"]
        return {"model": SEED_MODELS[seed], "sizes": {**SEEDS[seed], "seq_len": policy["seq_len"],
                                          "vocab": dataset["vocab"]}, "batch_size": policy["batch_size"]}
    size = policy["image_size"]
    return {"model": policy["initial_architecture"], "input_shape": [size, size, 3],
            "classes": dataset["classes"], "batch_size": policy["batch_size"]}


def resolve_precision(asked: str, facts: BackendFacts, backend: str) -> str | None:
    """The precision the run trains at (run.json `precision`): `auto` resolved to the fastest the
    backend declares on the run's device, as timed (facts.precision_probe), or the precision asked
    for, which that device must declare. Where precisions were not probed (SLURM: the devices are
    on the compute nodes), an explicit precision is recorded as asked and `auto` as None: each
    replica resolves it on its node."""
    from aiperf_core.backend import AUTO_PRECISION

    if facts.precisions is None:
        return None if asked == AUTO_PRECISION else asked
    if asked == AUTO_PRECISION:
        if facts.precision_probe is None:
            raise ValueError("auto needs the timings of BackendProbe.facts(auto=auto_request(...))")
        return facts.precision_probe["chosen"]
    if asked not in facts.precisions:
        raise AiperfError(f"policy.precision: backend '{backend}' does not declare {asked} on {facts.device} "
                          f"(it declares {', '.join(facts.precisions)}; auto picks the fastest)")
    return asked


def check_recorded_precision(run: Mapping[str, Any], facts: BackendFacts) -> None:
    """On --resume: the precision the run trains at must still be declared on the run's device."""
    recorded = run.get("precision")
    if recorded is not None and facts.precisions is not None and recorded not in facts.precisions:
        raise AiperfError(f"--resume: the run trains at {recorded} (run.json precision), which backend "
                          f"'{run.get('backend')}' does not declare on {facts.device} here "
                          f"(it declares {', '.join(facts.precisions)})")


def resolve_nodes_per_replica(value: int | str, machine_nodes: Callable[[], int]) -> int:
    """The policy item nodes_per_replica as a number: `auto` is 2 where the machine has 2 or more
    nodes, else 1 (the lm rules' value, docs/search.md, "The official LM track"); `machine_nodes` is
    asked only for auto."""
    if value != "auto":
        return value
    return 2 if machine_nodes() >= 2 else 1


def check_parallelism(backend: str, facts: BackendFacts, devices_per_replica: int, option: str,
                      nodes_per_replica: int = 1) -> None:
    """A backend that declares no data parallelism gets one device per replica, never more; one that
    declares no multi-node training gets one node per replica."""
    if nodes_per_replica > 1 and facts.multi_node_why_not is not None:
        why = f": {facts.multi_node_why_not}" if facts.multi_node_why_not else ""
        raise AiperfError(f"--nodes-per-replica {nodes_per_replica}: backend {backend} does not train a replica "
                          f"across nodes{why}")
    if devices_per_replica > 1 and not facts.data_parallel:
        raise AiperfError(f"--backend {backend}: trains on one device only (it declares no data parallelism), "
                          f"but each replica would get {devices_per_replica} devices; give {option} 1")


def new_run_id(now: float) -> str:
    return datetime.fromtimestamp(now, timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def prepare_run_dir(path: Path) -> RunDir:
    """Create the run directory (and check it is writable) for a fresh run; refuse one in use."""
    run_dir = RunDir(path)
    if run_dir.run_file.exists():
        raise AiperfError(f"--run-dir {path}: already holds a run; continue it with --resume {path}")
    try:
        for folder in (run_dir.root, run_dir.primary_dir, run_dir.root / "replicas", run_dir.root / "trials"):
            folder.mkdir(parents=True, exist_ok=True)
        run_dir.executor_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(run_dir.executor_dir, 0o700)
        probe = run_dir.primary_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise AiperfError(f"--run-dir {path}: not writable: {exc.strerror or exc}") from None
    return run_dir


def check_resumable(run_dir: RunDir) -> dict[str, Any]:
    """run.json of a run to resume, after checking that nobody edited its fixed configuration."""
    try:
        run = run_dir.read_run()
    except RunDirError as exc:
        raise AiperfError(f"--resume: {exc}") from None
    if "precision" not in run:
        raise AiperfError(f"--resume {run_dir.root}: run.json records no resolved precision: the run was made by "
                          f"aiperf {run.get('aiperf_version', 'unknown')}, older than this one; resume it with "
                          "that version")
    if run.get("config_sha256") != config_sha256(run):
        raise AiperfError(f"--resume {run_dir.root}: run.json's configuration does not match its config_sha256 "
                          "(the file was edited)")
    if not os.access(run_dir.root, os.W_OK):
        raise AiperfError(f"--resume {run_dir.root}: not writable")
    try:  # the primary takes the lease when it starts; refuse now, before anything else is done
        Lease(run_dir.primary_lease, "primary").check()
    except RunDirError as exc:
        raise AiperfError(f"--resume {run_dir.root}: {exc}") from None
    return run


def first_difference(recorded: Mapping[str, Any], asked: Mapping[str, Any]) -> str | None:
    """The first fixed setting that differs, as 'key: recorded -> asked' (policy items by name)."""
    for key in CONFIG_KEYS:
        a, b = recorded.get(key), asked.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    return f"{key}.{sub}: {a.get(sub)!r} in the run, {b.get(sub)!r} now"
        return f"{key}: {a!r} in the run, {b!r} now"
    return None


def resumed_configuration(run: Mapping[str, Any], request: RunRequest, backend_given: str | None) -> dict[str, Any]:
    """run.json's fixed configuration with whatever the user gave again laid over it; equal to
    the recorded one (same hash) unless the user asked for something else."""
    asked = {key: run.get(key) for key in CONFIG_KEYS}
    if backend_given:
        asked["backend"] = backend_given
    for key in ("executor", "replicas", "devices_per_replica", "seed", "stop_after_trials"):
        if getattr(request, key) is not None:
            asked[key] = getattr(request, key)
    if request.time_budget is not None:
        asked["time_budget_s"] = parse_duration(request.time_budget)
    dataset = dict(run.get("dataset") or {})
    if request.data is not None:
        name, path = data_choice(request)
        if (name, path) != (dataset.get("name"), dataset.get("path")):
            dataset = {**dataset, "name": name, "path": path}
    asked["dataset"] = dataset
    asked["policy"] = build_policy(request, dataset.get("name"), base=run.get("policy"))
    if asked["policy"].get("nodes_per_replica") == "auto":  # auto was resolved once, on the machine the run began on
        asked["policy"]["nodes_per_replica"] = (run.get("policy") or {}).get("nodes_per_replica")
    asked["model"] = asked["policy"]["initial_architecture"]
    return asked


def run_record(*, backend: str, executor: str, replicas: int, devices_per_replica: int, seed: int,
               time_budget_s: float, policy: dict[str, Any], dataset: dict[str, Any],
               stop_after_trials: int | None, watch: WatchSettings, precision: str | None = None,
               precision_probe: dict[str, Any] | None = None, now: float | None = None,
               container: dict[str, Any] | None = None) -> dict[str, Any]:
    """run.json's content (schema_version is added by RunDir.write_run). `precision` is the resolved
    one (resolve_precision); None only where each replica resolves `auto` on its node.
    `precision_probe`: the timings `auto` was resolved by (BackendFacts.precision_probe), kept out
    of the fixed configuration: a measurement, not a setting. `container`: {image, digest, runtime}
    of the image the replicas run in (workflow.container), None on the host."""
    from aiperf_core.backend import AUTO_PRECISION, PRECISIONS
    from aiperf_core.policy import Policy
    from aiperf_core.scoring.rules import RULES_VERSIONS

    if policy.get("nodes_per_replica") == "auto":
        raise AiperfError("policy.nodes_per_replica: auto is resolved before the run is recorded "
                          "(resolve_nodes_per_replica)")
    asked = policy["precision"]
    if precision is not None and (precision not in PRECISIONS or asked not in (AUTO_PRECISION, precision)):
        raise AiperfError(f"precision {precision!r} is not a resolution of policy.precision {asked!r}")
    if precision_probe is not None and precision_probe.get("chosen") != precision:
        raise AiperfError(f"precision {precision!r} is not what the precision probe chose")
    now = time.time() if now is None else now
    run = {
        "run_id": new_run_id(now),
        "created": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"),
        "start_time": now,
        "time_budget_s": time_budget_s,
        "deadline": now + time_budget_s,
        "backend": backend,
        "executor": executor,
        "replicas": replicas,
        "devices_per_replica": devices_per_replica,
        "seed": seed,
        "workload": policy.get("workload", "cnn"),
        "model": policy["initial_architecture"],
        "dataset": dataset,
        "policy": policy,
        "policy_overridden_fixed": Policy(policy).overridden_fixed(),
        "rules_version": RULES_VERSIONS[policy["workload"]],
        "precision": precision,
        "stop_after_trials": stop_after_trials,
        "watch": watch.to_json(),
        "aiperf_version": _version(),
    }
    if stop_after_trials is None:
        del run["stop_after_trials"]  # optional key: present only in a bounded (test) run
    if precision_probe is not None:
        run["precision_probe"] = precision_probe  # optional key: present where the primary timed `auto`
    run["container"] = container
    run["config_sha256"] = config_sha256(run)
    return run


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiperf")
    except PackageNotFoundError:
        return "unknown"
