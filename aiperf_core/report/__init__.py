"""The report of a run: report.html (self-contained, inline SVG plots) and summary.json.

    write_report(run_dir) -> (html_path, summary_path)

Both are recomputed from the run directory alone (event logs, trial graphs, monitor samples,
run.json) and written atomically, so a report of a run still going can be rewritten at any time.
Next to the score they give the precision trained at, the energy of the run with the analytic
operations per joule (aiperf_core.report.energy), the time spent compiling training steps, the load
balance of mixtures of experts, the communication (the experts' all-to-all, the gradient all-reduce) and
what the network cost the score, and, for a run that produced nothing, its first failure.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiperf_core.atomic import write_text_atomic
from aiperf_core.monitoring.sampler import read_monitor
from aiperf_core.report.energy import Energy, EnergyTally
from aiperf_core.report.page import render_page
from aiperf_core.rundir import RunDir
from aiperf_core.scoring.ledger import RunLedger
from aiperf_core.scoring.score import ScoreResult, epoch_ops, score_ledger

SUMMARY_SCHEMA_VERSION = 1
UTILISATION_BUCKETS = 240  # points per utilisation line, whatever the run's length
REPORT_FILES = ("report.html", "summary.json")  # what write_report writes in the run directory
# Where the report looks for `aiperf probe network`'s record (aiperf probe network --out RUN_DIR/...).
NETWORK_PROBE_FILE = "network-probe.json"


def write_report(run_dir: str | os.PathLike, as_of_run_end: bool = False) -> tuple[Path, Path]:
    """report.html and summary.json of the run. With `as_of_run_end` (a submission package), an
    ended run's summary is dated at its run_end instead of now, so that the same run always packs
    to the same bytes."""
    run = RunDir(run_dir)
    ledger = RunLedger(run)
    ledger.refresh()
    result = score_ledger(ledger)
    monitors = read_monitors(run, ledger, result)
    summary = build_summary(ledger, result, node_descriptions(ledger, monitors.host_records), monitors.energy)
    ended = ledger.run_end.get("time") if as_of_run_end and ledger.run_end else None
    if isinstance(ended, (int, float)):
        summary["generated"] = _dt.datetime.fromtimestamp(ended, _dt.timezone.utc).isoformat(timespec="seconds")
    html_path, summary_path = (run.root / name for name in REPORT_FILES)
    write_text_atomic(summary_path, json.dumps(summary, indent=1) + "\n")
    write_text_atomic(html_path, render_page(summary, result, ledger, monitors.utilisation, monitors.power))
    return html_path, summary_path


def node_descriptions(ledger: RunLedger, host_records: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per replica: host, devices and software (the image it ran in: null on the host) from its
    latest replica_start, and the hardware its monitor saw (CPU count, memory, accelerator names)."""
    nodes = []
    for replica, state in sorted(ledger.replicas.items()):
        start = state.starts[-1] if state.starts else {}
        host_record = host_records.get(replica, {})
        nodes.append({
            "replica": replica, "host": start.get("host", host_record.get("host")),
            # every node of a replica across nodes: [{node_rank, host, devices}]; null on one node
            "nodes": [{k: n.get(k) for k in ("node_rank", "host", "devices")} for n in start["nodes"]]
            if isinstance(start.get("nodes"), list) else None,
            "devices": start.get("devices"), "backend": start.get("backend"),
            "framework_version": start.get("framework_version"), "container": start.get("container"),
            "attempts": len(state.starts),
            "cpus": host_record.get("cpus"), "memory_total": host_record.get("memory_total"),
            "accelerators": [a.get("name") for a in host_record.get("accelerators") or []],
            "nvml": host_record.get("nvml"), "rapl": host_record.get("rapl"),
            "step_seconds": state.step_seconds, "busy_fraction": state.busy_fraction(),
            "compile_seconds": state.compile_seconds,
        })
    return nodes


def build_summary(ledger: RunLedger, result: ScoreResult, nodes: list[dict[str, Any]],
                  energy: Energy) -> dict[str, Any]:
    run = ledger.info.run
    accelerators: dict[str, int] = {}
    for node in nodes:
        for name in node["accelerators"]:
            accelerators[name] = accelerators.get(name, 0) + 1
    return {
        "schema_version": SUMMARY_SCHEMA_VERSION,
        "generated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **result.to_dict(),
        "precision": precision_summary(ledger),
        "energy": energy.to_dict(result.total_ops),
        "compile": compile_summary(ledger),
        "expert_load": expert_load_summary(ledger),
        "communication": communication_summary(ledger, result.score_ops, result.elapsed_s),
        "network_probe": network_probe_summary(ledger.run_dir.root),
        "machine": {
            "replicas": len(nodes), "replicas_configured": run.get("replicas"),
            "devices_per_replica": run.get("devices_per_replica"), "executor": run.get("executor"),
            **replica_nodes(run),
            "hosts": sorted({str(host) for n in nodes for host in [n["host"], *(m["host"] for m in n["nodes"] or [])]
                             if host is not None}),
            "accelerators": accelerators, "busy_fraction": busy_fraction(ledger), "nodes": nodes,
        },
        "software": {
            "backend": run.get("backend"),
            "framework_versions": ledger.framework_versions(),
            "aiperf": _aiperf_version(),
            "report_python": platform.python_version(),
        },
        "configuration": run,
    }


def replica_nodes(run: dict[str, Any]) -> dict[str, Any]:
    """The nodes each replica spanned, and whether its steps loaded a network: only a replica of two
    or more nodes sends its gradients over a network link (the local executor's nodes share one machine)."""
    nodes = (run.get("policy") or {}).get("nodes_per_replica", 1)
    return {"nodes_per_replica": nodes,
            "network_loaded": isinstance(nodes, int) and nodes >= 2 and run.get("executor") != "local"}


def precision_summary(ledger: RunLedger) -> dict[str, Any]:
    """What the policy asked (`auto` or a precision), what run.json resolved it to (null where each
    replica resolves it: SLURM), the trials per precision they trained at, and the timings `auto`
    was resolved by (`probe`, run.json's `precision_probe`: only where the primary timed them)."""
    run = ledger.info.run
    trials: dict[str, int] = {}
    for trial in ledger.trials.values():
        trials[str(trial.precision)] = trials.get(str(trial.precision), 0) + 1
    policy = run.get("policy") if isinstance(run.get("policy"), dict) else {}
    summary = {"policy": policy.get("precision"), "resolved": run.get("precision"), "trials": dict(sorted(trials.items()))}
    if isinstance(run.get("precision_probe"), dict):
        summary["probe"] = run["precision_probe"]
    return summary


def compile_summary(ledger: RunLedger) -> dict[str, Any]:
    """Seconds spent tracing and compiling training steps (epoch_end.compile_seconds), for the run
    and as a share of the replicas' summed lives (the busy fraction's denominator); null when no
    backend measured it."""
    measured = [s for s in ledger.replicas.values() if s.compile_seconds is not None]
    seconds = sum(s.compile_seconds for s in measured) if measured else None
    lives = sum(s.life_seconds() or 0.0 for s in ledger.replicas.values())
    return {"seconds": seconds, "share": seconds / lives if seconds is not None and lives > 0 else None,
            "trials_measured": sum(t.compile_seconds is not None for t in ledger.trials.values())}


EXPERT_LOAD_LISTED = 10  # the trials whose experts' load was least even, in summary.json and the report


def expert_load_summary(ledger: RunLedger) -> dict[str, Any] | None:
    """The load balance of the trials with a mixture of experts (epoch_end.expert_load, latest epoch):
    per trial its least even moe layer's maximum over mean tokens per expert (1 at an even load), their
    mean and worst over the run, and the EXPERT_LOAD_LISTED least even trials; null when no trial had a
    mixture of experts. Reported beside the score, not part of it."""
    worst_per_trial = {t.id: max(t.expert_load.values()) for t in ledger.trials.values() if t.expert_load}
    if not worst_per_trial:
        return None
    ranked = sorted(worst_per_trial.items(), key=lambda item: (-item[1], item[0]))[:EXPERT_LOAD_LISTED]
    return {"trials": len(worst_per_trial),
            "mean_max_over_mean": sum(worst_per_trial.values()) / len(worst_per_trial),
            "worst_max_over_mean": ranked[0][1],
            "least_even": [{"trial": tid, "max_over_mean": ledger.trials[tid].expert_load} for tid, _ in ranked]}


def network_probe_summary(root: Path) -> dict[str, Any] | None:
    """What `aiperf probe network` measured, where its record was written into the run directory
    (NETWORK_PROBE_FILE): the fitted latency and bus bandwidth of each collective and the bus
    bandwidth at its largest size (network.probe.summary); {"unreadable": why} for a bad record;
    None where there is none."""
    from aiperf_core.network.probe import ProbeError, load_probe, summary

    path = Path(root) / NETWORK_PROBE_FILE
    if not path.exists():
        return None
    try:
        return summary(load_probe(path))
    except ProbeError as exc:
        return {"unreadable": str(exc)}


def communication_summary(ledger: RunLedger, score_ops: float, run_seconds: float) -> dict[str, Any] | None:
    """The run's communication (docs/run-directory.md, summary.json): the experts' all-to-all of the
    expert-parallel trials (epoch_end.all_to_all) and the gradient all-reduce of the data-parallel ones
    (epoch_end.all_reduce), every epoch that logged them, inside the scored window or not: analytic bytes,
    measured seconds and their ratio; what the network cost (aiperf_core.scoring.network: the share of
    step time spent waiting, the network efficiency, the ideal-network score); and each trial's, by trial
    id. Null when no trial communicated. The seconds add up over replicas that ran at once, so a ratio is
    the bandwidth one replica achieved, weighted by time, not the machine's aggregate. Reported beside the
    score, not part of it (docs/scoring.md, "Communication: reported, not scored")."""
    from aiperf_core.scoring.network import run_network, trial_network

    trials = sorted((t for t in ledger.trials.values() if t.communicated()), key=lambda t: t.id)
    if not trials:
        return None
    operations: dict[str, int] = {}  # trial id -> the operations of its epochs (a counted graph's)
    for _, trial, train_images, val_images, *_ in ledger.epochs:
        if trial.per_image is not None:
            operations[trial.id] = operations.get(trial.id, 0) + epoch_ops(trial.per_image, train_images, val_images)
    a2a = [t for t in trials if t.all_to_all_bytes is not None]
    moved, seconds = sum(t.all_to_all_bytes for t in a2a), sum(t.all_to_all_seconds for t in a2a)
    all_to_all = {"trials": len(a2a), "bytes": moved, "seconds": seconds,
                  "bytes_per_second": moved / seconds if seconds > 0 else None} if a2a else None
    reduced = [t.to_dict()["all_reduce"] for t in trials if t.all_reduce is not None]
    all_reduce = None
    if reduced:
        timed = [r["seconds"] for r in reduced if r["seconds"] is not None]
        all_reduce = {"trials": len(reduced), "bytes": ledger.all_reduce_bytes,
                      "inter_node_bytes": sum(r["inter_node_bytes"] for r in reduced),
                      "intra_node_bytes": sum(r["intra_node_bytes"] for r in reduced),
                      "seconds": sum(timed) if timed else None,
                      "bytes_per_second": (ledger.all_reduce_timed_bytes / ledger.all_reduce_seconds
                                           if ledger.all_reduce_seconds > 0 else None)}
    return {"all_to_all": all_to_all, "all_reduce": all_reduce, "network": run_network(ledger, score_ops, run_seconds),
            "per_trial": [{"trial": t.id, "all_to_all": t.to_dict()["all_to_all"],
                           "all_reduce": t.to_dict()["all_reduce"],
                           "network": trial_network(t, operations.get(t.id))} for t in trials]}


def busy_fraction(ledger: RunLedger) -> float | None:
    """All replicas' time in train and eval steps over the sum of their lives (ReplicaState)."""
    lives = [(s.step_seconds, s.life_seconds()) for s in ledger.replicas.values() if s.busy_fraction() is not None]
    return sum(a for a, _ in lives) / sum(b for _, b in lives) if lives else None


def _aiperf_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiperf")
    except PackageNotFoundError:
        return None


@dataclass
class Monitors:
    host_records: dict[int, dict[str, Any]]  # replica -> its first 'host' record
    utilisation: dict[str, list[tuple[float, float]]]  # label -> [(hours, percent)]
    power: dict[str, list[tuple[float, float]]]  # label -> [(hours, watts)]
    energy: Energy


def read_monitors(run: RunDir, ledger: RunLedger, result: ScoreResult) -> Monitors:
    """One pass over every replica's monitor.jsonl: its first 'host' record, the mean utilisation
    over all replicas in time buckets, mean power in the same buckets, and the energy of the
    scored window (EnergyTally).

    Buckets keep the plot the same size for a 10-minute run on a laptop and a 12-hour run on
    4096 nodes; a bucket averages every sample of every node that falls in it. Files are read one
    at a time: a 12-hour run on 4096 nodes holds millions of samples."""
    start = ledger.info.start_time
    span = max(result.end_time - start, 1.0)
    width = max(span / UTILISATION_BUCKETS, 30.0)
    sums: dict[str, dict[int, list[float]]] = {k: {} for k in ("CPU", "memory", "accelerator", "accelerator memory")}
    energy = EnergyTally(start, result.end_time, bucket_width=width)

    def add(label: str, bucket: int, value) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            cell = sums[label].setdefault(bucket, [0.0, 0])
            cell[0] += value
            cell[1] += 1

    host_records: dict[int, dict[str, Any]] = {}
    for replica, path in ((r, p) for r in ledger.replicas for p in run.monitor_logs(r)):
        energy.new_file()  # each node of a replica across nodes samples itself: their energies add up
        for record in read_monitor(path):
            energy.add(record)
            if record.get("kind") == "host":
                host_records.setdefault(replica, record)  # the replica's first node's
            if record.get("kind") != "sample" or not isinstance(record.get("time"), (int, float)):
                continue
            offset = record["time"] - start
            if offset < 0 or offset > span:
                continue
            bucket = int(offset // width)
            add("CPU", bucket, record.get("cpu_percent"))
            add("memory", bucket, record.get("memory_percent"))
            for device in record.get("accelerators") or []:
                add("accelerator", bucket, device.get("utilization"))
                used, total = device.get("memory_used"), device.get("memory_total")
                if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total > 0:
                    add("accelerator memory", bucket, 100.0 * used / total)
    utilisation = {label: [((b + 0.5) * width / 3600, s / n) for b, (s, n) in sorted(cells.items())]
                   for label, cells in sums.items() if cells}
    return Monitors(host_records, utilisation, energy.power(), energy.result())
