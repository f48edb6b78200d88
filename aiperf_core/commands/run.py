"""aiperf run: the primary. Starts the replicas, watches them, stops them at the time budget,
then scores the run and writes its report. It never trains (docs/workflow.md)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from aiperf_core.commands.options import non_negative_int, positive_int, positive_int_or_auto
from aiperf_core.errors import AiperfError
from aiperf_core.workflow.container import RUNTIMES
from aiperf_core.monitoring.exporter.options import DEFAULT_HOST, port_number

FINAL_SCRAPE_S = 120.0  # the endpoint outlives the run until a scraper has read its end, at most this long
HELP = "run the benchmark: start replicas (local processes or SLURM jobs), stop them at the time budget, score"


def add_arguments(p) -> None:
    p.add_argument("--backend", default=None, metavar="NAME", help="backend (default: $AIPERF_BACKEND, the config "
                   "file, else tensorflow)")
    p.add_argument("--executor", choices=("local", "slurm", "hosts"), default=None,
                   help="where replicas run: processes on this machine (default), SLURM jobs, or the hosts of a "
                   "--hostfile started by a --launcher")
    p.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="number of replicas (local default: one, with every accelerator)")
    p.add_argument("--devices-per-replica", type=positive_int, default=None, metavar="K",
                   help="accelerators per replica (local default: all of them divided by --replicas)")
    p.add_argument("--nodes-per-replica", type=positive_int_or_auto, default=None, metavar="N|auto",
                   help="nodes each replica spans, its devices N times one node's (policy item nodes_per_replica; "
                   "default 1, lm: auto, 2 where the machine has 2 or more nodes; docs/workflow.md, \"A replica "
                   "across nodes\")")
    p.add_argument("--time-budget", default=None, metavar="DURATION", help="the run's length, e.g. 90m, 12h "
                   "(default 1h)")
    p.add_argument("--workload", choices=("cnn", "lm"), default=None,
                   help="what the replicas grow and train: cnn (ResNet-50 on images, the default) or lm (a GPT on "
                   "byte-level text); each workload is ranked in its own list")
    p.add_argument("--data", default=None, metavar="digits|synthetic|embedded|PATH",
                   help="the dataset: cnn: an ImageNet folder (ImageFolder or TFRecord layout), or digits/synthetic "
                   "for an unofficial run; lm: a folder `aiperf data prepare enwik8.zip` wrote, or embedded "
                   "(the default, unofficial)")
    p.add_argument("--data-workers", type=positive_int, default=None, metavar="N",
                   help="data transformation workers per replica (policy item data_workers)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the run directory, on a shared filesystem for SLURM (default: runs/<run id>)")
    p.add_argument("--seed", type=non_negative_int, default=None, metavar="S", help="the run's seed (default 0)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue a run that was interrupted or killed; its run.json fixes the configuration")
    p.add_argument("--max-restarts", type=non_negative_int, default=None, metavar="N",
                   help="restarts of a crashed replica before it is given up (default 3)")
    p.add_argument("--heartbeat-timeout", default=None, metavar="DURATION",
                   help="a running replica silent this long is lost and restarted (default 10m)")
    p.add_argument("--stall-timeout", default=None, metavar="DURATION",
                   help="a training replica that finishes no step for this long, or for 20 times its longest step "
                   "if that is more, is lost and restarted; a trial's first step gets 20m more (default 10m)")
    p.add_argument("--stop-grace", default=None, metavar="DURATION",
                   help="how long replicas may take to stop after the deadline before they are killed (default 30s)")
    p.add_argument("--stop-after-trials", type=positive_int, default=None, metavar="N",
                   help="each replica stops after N trials (bounded test runs)")
    metrics = p.add_argument_group("monitoring (docs/monitoring.md)")
    metrics.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                         help="serve the run's live figures to Prometheus on this port (/metrics)")
    metrics.add_argument("--metrics-host", default=None, metavar="ADDRESS",
                         help=f"address the metrics endpoint listens on (default {DEFAULT_HOST}: this machine only)")
    slurm = p.add_argument_group("SLURM executor")
    slurm.add_argument("--slurm-partition", default=None, metavar="NAME")
    slurm.add_argument("--slurm-account", default=None, metavar="NAME")
    slurm.add_argument("--slurm-time-limit", default=None, metavar="DURATION",
                       help="per replica job (default: the time budget plus 10 minutes)")
    slurm.add_argument("--slurm-gpus-per-node", type=non_negative_int, default=None, metavar="N")
    slurm.add_argument("--slurm-cpus-per-task", type=positive_int, default=None, metavar="N")
    slurm.add_argument("--slurm-extra", default=None, metavar="ARGS",
                       help="more sbatch options, passed as given, e.g. \"--qos=high --constraint=a100\"")
    hosts = p.add_argument_group("hosts executor (clusters without SLURM; docs/workflow.md)")
    hosts.add_argument("--hostfile", default=None, metavar="FILE",
                       help="the hosts, one a line with its devices: 'node7 slots=8' (DeepSpeed's format)")
    hosts.add_argument("--launcher", default=None, metavar="TEMPLATE",
                       help="what starts a node's command on {host} (default: 'ssh -o BatchMode=yes {host}')")
    container = p.add_argument_group("containers (docs/deploy.md)")
    container.add_argument("--container", default=None, metavar="IMAGE",
                           help="run every replica in this aiperf image (make image): a folder or SquashFS file "
                           "for charliecloud, a SIF for apptainer, an image name for podman or pyxis")
    container.add_argument("--container-runtime", choices=RUNTIMES, default=None,
                           help="what starts the image (default: the first of ch-run, apptainer, podman on PATH)")


def run(args: argparse.Namespace) -> int:
    from aiperf_core.config_file import load_config
    from aiperf_core.workflow.plan import merge_request

    config = load_config(args.config)
    flags = dict(vars(args))
    flags["slurm_extra_args"] = flags.pop("slurm_extra", None)
    request = merge_request(flags, config)
    if args.resume:
        prepared = _prepare_resume(args, config, request)
        metrics = _start_metrics(args, prepared[1]["executor"])
    else:
        metrics = _start_metrics(args, request.executor or "local")  # before anything is written
        try:
            prepared = _prepare_fresh(args, config, request)
        except BaseException:
            if metrics is not None:
                metrics.close()
            raise
    try:
        return _run_primary(*prepared, metrics=metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _start_metrics(args, executor_kind: str):
    """The started metrics endpoint (its run directory attached later), or None without --metrics-port."""
    if args.metrics_port is None:
        if args.metrics_host is not None:
            raise AiperfError("--metrics-host: give --metrics-port too")
        return None
    if executor_kind == "slurm" and args.metrics_host is None:
        # The primary of a SLURM run sits on a login node, which the centre's Prometheus reaches over
        # the network: on the loopback default nothing outside that node could scrape it.
        raise AiperfError(f"--metrics-port: a SLURM run's primary on {DEFAULT_HOST} serves only its own node; "
                          "give --metrics-host (0.0.0.0 or this node's address, or 127.0.0.1 to keep it local)")
    from aiperf_core.monitoring.exporter.collector import RunCollector
    from aiperf_core.monitoring.exporter.server import serve

    return serve(args.metrics_host or DEFAULT_HOST, args.metrics_port, RunCollector(), "--metrics-port",
                 "--metrics-host")


def _prepare_fresh(args, config, request):
    from aiperf_core.registry import resolve_backend_name
    from aiperf_core.workflow import plan
    from aiperf_core.workflow.container import describe_in_image, from_flags, running_image
    from aiperf_core.workflow.duration import parse_duration

    backend_name = resolve_backend_name(args.backend, config=config)
    executor_kind = request.executor or "local"
    _executor_class(executor_kind).preflight()  # cheap, so first
    time_budget_s = parse_duration(request.time_budget or plan.DEFAULT_TIME_BUDGET)
    name, path = plan.data_choice(request)
    policy = plan.build_policy(request, name)
    watch = plan.watch_settings(request)
    container = from_flags(args.container, args.container_runtime, backend_name, executor_kind,
                           request.run_dir or "runs", path, watch.slurm.get("gpus_per_node"))
    # A SLURM primary does not run where replicas train: their precisions are not probed here.
    # `auto` is timed in the probe, before run_record() takes the run's start_time: its seconds are
    # not in the time budget (docs/scoring.md, "The precision of a run").
    local = executor_kind == "local"
    with plan.BackendProbe(backend_name, precisions=local, container=container) as probe:
        dataset = (describe_in_image(container, name, path, policy) if container else
                   plan.describe_dataset(name, path, policy))
        facts = probe.facts(auto=plan.auto_request(policy, dataset) if local else None)
    machine_nodes = []  # asked only for auto

    def count_machine_nodes() -> int:
        machine_nodes.append(_executor_class(executor_kind).machine_nodes(watch))
        return machine_nodes[0]

    policy["nodes_per_replica"] = nodes = plan.resolve_nodes_per_replica(policy["nodes_per_replica"],
                                                                         count_machine_nodes)
    if machine_nodes and nodes > 1:  # so that a refusal naming --nodes-per-replica N is understood
        print(f"nodes_per_replica auto: {nodes}, the machine has {machine_nodes[0]} nodes (executor {executor_kind})",
              file=sys.stderr)
    replicas, devices_per_replica, environments = _layout(executor_kind, facts.devices, request.replicas,
                                                          request.devices_per_replica, watch, nodes)
    plan.check_parallelism(backend_name, facts, devices_per_replica,
                           "--devices-per-replica" if executor_kind == "local" else "--slurm-gpus-per-node", nodes)
    precision = plan.resolve_precision(policy["precision"], facts, backend_name)
    record = plan.run_record(backend=backend_name, executor=executor_kind, replicas=replicas,
                             devices_per_replica=devices_per_replica, seed=request.seed or 0,
                             time_budget_s=time_budget_s, policy=policy, dataset=dataset,
                             stop_after_trials=request.stop_after_trials, watch=watch, precision=precision,
                             precision_probe=facts.precision_probe,
                             container=container.record() if container else running_image())
    root = Path(request.run_dir or Path("runs") / record["run_id"]).expanduser().resolve()
    executor = _executor(executor_kind, root, record, watch, environments)
    executor.container = container
    run_dir = plan.prepare_run_dir(root)
    run_dir.write_run(record, new=True)
    return run_dir, run_dir.read_run(), executor, watch, False


def _prepare_resume(args, config, request):
    from aiperf_core.rundir import RunDir
    from aiperf_core.workflow import plan
    from aiperf_core.workflow.container import for_resume

    run_dir = RunDir(Path(args.resume).expanduser().resolve())
    if args.run_dir and Path(args.run_dir).expanduser().resolve() != run_dir.root:
        raise AiperfError("--run-dir: give either --resume RUN_DIR or --run-dir, not two different folders")
    run = plan.check_resumable(run_dir)
    _executor_class(run["executor"]).preflight()
    asked = plan.resumed_configuration(run, request, args.backend or config.get("backend"))
    if plan.config_sha256(asked) != run["config_sha256"]:
        raise AiperfError(f"--resume {run_dir.root}: the run was made with a different fixed configuration "
                          f"({plan.first_difference(run, asked)})")
    watch = plan.watch_settings(request, run.get("watch"))
    container = for_resume(run, run_dir.root, args.container, args.container_runtime, watch.slurm.get("gpus_per_node"))
    nodes = run["policy"].get("nodes_per_replica", 1)
    devices = []
    if run["executor"] == "local":
        with plan.BackendProbe(run["backend"], container=container) as probe:
            facts = probe.facts()
        plan.check_parallelism(run["backend"], facts, run["devices_per_replica"], "--devices-per-replica", nodes)
        plan.check_recorded_precision(run, facts)
        devices = facts.devices
    _, _, environments = _layout(run["executor"], devices, run["replicas"], run["devices_per_replica"], watch, nodes)
    executor = _executor(run["executor"], run_dir.root, run, watch, environments)
    executor.container = container
    return run_dir, run, executor, watch, True


def _layout(kind, devices, replicas, devices_per_replica, watch, nodes: int = 1):
    """(replicas, devices per replica on all its nodes, per-replica environment) for the executor."""
    if devices_per_replica is not None and devices_per_replica % nodes:
        raise AiperfError(f"--devices-per-replica {devices_per_replica}: does not divide between the replica's "
                          f"{nodes} nodes (--nodes-per-replica)")
    if kind == "hosts":  # each replica on `nodes` hosts of the hostfile, with their slots
        placement = _host_placement(watch, replicas, nodes)
        per_replica = placement[0][0].slots * nodes
        if devices_per_replica not in (None, per_replica):
            raise AiperfError(f"--devices-per-replica: a replica gets its hosts' slots ({per_replica} on {nodes} "
                              f"host(s)); set them in the hostfile instead")
        return len(placement), per_replica, None
    if kind == "slurm":  # each replica is one job of `nodes` nodes, each with that node's GPUs
        gpus = watch.slurm.get("gpus_per_node") or 0
        if devices_per_replica not in (None, (gpus or 1) * nodes):
            raise AiperfError(f"--devices-per-replica: a SLURM replica gets --slurm-gpus-per-node devices on each "
                              f"of its nodes ({gpus or 1} x {nodes}); set that instead")
        return replicas or 1, (gpus or 1) * nodes, None
    from aiperf_core.workflow.executors.local import plan_layout, replica_environment

    accelerators = [d for d in devices if not d.startswith("cpu")]
    cpu_devices = max(1, len([d for d in devices if d.startswith("cpu:")]))
    if accelerators:  # the replica's accelerators, split between its nodes' processes
        layout = plan_layout(accelerators, replicas, devices_per_replica, cpu_devices=cpu_devices)
        if layout.devices_per_replica % nodes:
            raise AiperfError(f"--nodes-per-replica {nodes}: a replica's {layout.devices_per_replica} accelerators "
                              f"do not divide between its nodes")
        per_replica = layout.devices_per_replica
    else:  # each node's process trains on the CPU's devices
        layout = plan_layout([], replicas, None if devices_per_replica is None else devices_per_replica // nodes,
                             cpu_devices=cpu_devices)
        cores = os.cpu_count() or 1
        if layout.replicas * nodes > cores:
            raise AiperfError(f"--nodes-per-replica {nodes}: {layout.replicas} replica(s) of {nodes} node processes "
                              f"on {cores} cores would oversubscribe the CPU")
        per_replica = layout.devices_per_replica * nodes
    environments = [replica_environment(devices, layout.threads_per_replica) for devices in layout.devices]
    return layout.replicas, per_replica, environments


def _host_placement(watch, replicas, nodes):
    from aiperf_core.workflow.executors.hosts import hostfile_hosts, place_replicas

    return place_replicas(hostfile_hosts(watch), replicas, nodes)


def _executor_class(kind):
    if kind == "hosts":
        from aiperf_core.workflow.executors.hosts import HostsExecutor

        return HostsExecutor
    if kind == "local":
        from aiperf_core.workflow.executors.local import LocalExecutor

        return LocalExecutor
    from aiperf_core.workflow.executors.slurm import SlurmExecutor

    return SlurmExecutor


def _executor(kind, root, run, watch, environments):
    executor_class = _executor_class(kind)
    if kind == "local":
        return executor_class(root, environments)
    if kind == "hosts":
        from aiperf_core.workflow.executors.hosts import DEFAULT_LAUNCHER

        return executor_class(root, _host_placement(watch, run["replicas"], run["policy"]["nodes_per_replica"]),
                              watch.hosts.get("launcher") or DEFAULT_LAUNCHER)
    slurm = watch.slurm
    return executor_class(root, run["run_id"], run["time_budget_s"], partition=slurm.get("partition"),
                          account=slurm.get("account"), time_limit_s=slurm.get("time_limit_s"),
                          gpus_per_node=slurm.get("gpus_per_node") or 0, cpus_per_task=slurm.get("cpus_per_task"),
                          extra_args=slurm.get("extra_args"))


def _run_primary(run_dir, run, executor, watch, resume: bool, metrics=None) -> int:
    from aiperf_core.workflow.primary import Primary
    from aiperf_core.workflow.progress import CheckpointWriter, LiveDisplay

    display = LiveDisplay(run_dir.root)
    checkpoints = CheckpointWriter(run_dir.root, display.note)
    verb = "resuming" if resume else "starting"
    display.note(f"{verb} run {run['run_id']} in {run_dir.root}: backend {run['backend']}, executor "
                 f"{run['executor']}, {run['replicas']} replica(s) x {run['devices_per_replica']} device(s), "
                 f"precision {_precision_text(run)}, dataset {run['dataset'].get('name')}, "
                 f"budget {run['time_budget_s']:.0f} s")
    if metrics is not None:
        metrics.collector.attach(run_dir.root)
        display.note(f"serving metrics on {metrics.url}")
    def tick(now: float) -> None:
        display.tick(now)
        checkpoints.tick(now)

    primary = Primary(run_dir, run, executor, watch, resume=resume, notify=display.note, tick=tick)
    try:
        reason = primary.run_to_end()
        checkpoints.write()
    finally:
        display.close()
    if reason == "interrupted":
        print(f"interrupted; continue with: aiperf run --resume {run_dir.root}", file=sys.stderr)
        return 130
    result = _score_and_report(run_dir.root)
    if metrics is not None and not metrics.collector.ended_scraped.is_set() and metrics.collector.scrapes:
        print(f"waiting up to {FINAL_SCRAPE_S:.0f} s for a last scrape of {metrics.url}", flush=True)
        metrics.wait_for_final_scrape(FINAL_SCRAPE_S)
    if result.failure is not None or reason == "all_replicas_failed":
        what = ("every replica failed" if result.failure is None
                else f"the run produced nothing: {result.failure.describe()}")
        print(f"{what}; see {run_dir.root}/replicas/<I>/replica.log and the replica_exit events of "
              "primary/events.jsonl", file=sys.stderr)
        return 1
    return 0


def _precision_text(run) -> str:
    """'fp32 (auto: fp32 0.21 s/step, bf16 0.35 s/step)', 'fp32', or how a SLURM run resolves auto."""
    from aiperf_core.workflow.auto_precision import describe

    asked, resolved = run["policy"].get("precision"), run.get("precision")
    if resolved is None:
        return f"{asked}, resolved by each replica on its node"
    return f"{resolved} ({describe(run.get('precision_probe'))})" if asked == "auto" else resolved


def _score_and_report(root: Path):
    """Score (printing the summary) and write the report once the run has ended; the ScoreResult."""
    from aiperf_core.commands import score as score_command
    from aiperf_core.report import write_report

    result, _, _ = score_command.score_and_record(root)
    print(score_command.render(result))
    html_path, summary_path = write_report(root)
    print(f"wrote {html_path}")
    print(f"wrote {summary_path}")
    return result
