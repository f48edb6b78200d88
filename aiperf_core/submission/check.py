"""`aiperf check SUBMISSION`: the reviewer's check. Nothing stored in the package is trusted.

In order, each step adding reasons (docs/submission.md lists them):
 1. unpack safely (aiperf_core.submission.unpack): a package that cannot be read is bad input;
 2. the manifest: every file's SHA-256 and size, no file missing or unlisted, the submission id;
 3. the system description, validated, placeholders refused;
 4. the run: every hash chain and pinned file (`aiperf score --verify`, the weights and the published
    history withheld), then the score, the regulated score and every rule recomputed from the logs
    and graphs by the same code as `aiperf score`; a stored score.json or summary.json that differs
    is reported, never used; one backend at one framework version, and every replica in the image
    run.json records (replica_start.container; workflow.container.image_reasons);
 5. the description against the inventory the run recorded (replica_start, the monitor's host
    records): node count, accelerators per node, accelerator model, host CPU model;
 6. certification: a non-quick kit report, for the run's backend and framework version, on the
    run's accelerator model, that conforms at every level, for every precision the trials trained at;
 7. plausibility: the score at most the declared peak, and at most the measured peak, times the
    number of accelerators;
 8. energy: how much of the machine and of the run was metered, and the power level.

The verdict: REJECTED when any of 2-7 fails; else ACCEPTED, official when the run also meets every
rule of the benchmark (unofficial, with the rules' reasons, otherwise).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiperf_core.errors import AiperfError
from aiperf_core.inventory import is_cpu_device
from aiperf_core.submission import SubmissionError
from aiperf_core.submission.package import (MANIFEST, MANIFEST_KIND, MANIFEST_SCHEMA_VERSION, RUN_PREFIX, WITHHELD,
                                            load_conformance_report, submission_id)
from aiperf_core.submission.unpack import DEFAULT_LIMITS, Limits, unpack

ACCEPTED, REJECTED = "ACCEPTED", "REJECTED"
STORED_SCORE_TOLERANCE = 1e-9  # relative: JSON round trips of the same float are exact
EXIT_ACCEPTED, EXIT_REJECTED = 0, 1  # bad input keeps the CLI's 2

# Power levels in the spirit of EEHPC's (Green500) quality levels: how much of the machine and of the
# scored window the energy counters covered. Level 3 also needs the accelerators' and the hosts'
# energy both measured (or a machine without accelerators).
POWER_LEVELS = (("L3", 1.0, 0.95), ("L2", 1 / 8, 0.8), ("L1", 1 / 64, 0.2))  # (level, node share, time share)


@dataclass
class Verdict:
    file: str
    submission_id: str | None = None
    rejections: list[str] = field(default_factory=list)  # why REJECTED
    rule_reasons: list[str] = field(default_factory=list)  # why unofficial
    findings: list[str] = field(default_factory=list)
    run_id: str | None = None
    log_digests: list[str] = field(default_factory=list)
    system: dict[str, Any] | None = None
    accelerators: int | None = None
    backend: str | None = None
    framework_version: str | None = None
    precisions: list[str] = field(default_factory=list)
    score_ops: float | None = None
    regulated_ops: float | None = None
    best_accuracy: float | None = None
    workload: str | None = None
    elapsed_s: float | None = None
    start_time: float | None = None
    declared_peak_ops: float | None = None
    measured_peak_ops: float | None = None
    energy: dict[str, Any] = field(default_factory=lambda: not_measured("not checked"))
    # The score over the score an ideal network would have given (aiperf_core.scoring.network); None where
    # no trial communicated. Reported, not scored.
    network_share: float | None = None  # of step time waiting on communication (aiperf_core.scoring.network)
    network_efficiency: float | None = None

    @property
    def accepted(self) -> bool:
        return not self.rejections

    @property
    def official(self) -> bool:
        return self.accepted and not self.rule_reasons

    @property
    def reasons(self) -> list[str]:
        return list(self.rejections) if self.rejections else list(self.rule_reasons)

    def headline(self) -> str:
        if not self.accepted:
            return f"{REJECTED}: {len(self.rejections)} reason(s)"
        return f"{ACCEPTED} official" if self.official else f"{ACCEPTED} unofficial: {len(self.rule_reasons)} reason(s)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file, "submission_id": self.submission_id, "workload": self.workload,
            "verdict": ACCEPTED if self.accepted else REJECTED, "official": self.official,
            "reasons": self.reasons, "findings": list(self.findings), "run_id": self.run_id,
            "log_digests": list(self.log_digests), "system": self.system, "accelerators": self.accelerators,
            "backend": self.backend, "framework_version": self.framework_version, "precisions": list(self.precisions),
            "score_ops": self.score_ops, "regulated_ops": self.regulated_ops, "best_accuracy": self.best_accuracy,
            "elapsed_s": self.elapsed_s, "start_time": self.start_time,
            "date": None if self.start_time is None else
            _dt.datetime.fromtimestamp(self.start_time, _dt.timezone.utc).date().isoformat(),
            "declared_peak_ops": self.declared_peak_ops, "measured_peak_ops": self.measured_peak_ops,
            "efficiency_declared": _ratio(self.score_ops, self.declared_peak_ops),
            "efficiency_measured": _ratio(self.score_ops, self.measured_peak_ops),
            "energy": dict(self.energy), "network_share": self.network_share,
            "network_efficiency": self.network_efficiency,
        }

    def render(self) -> str:
        from aiperf_core.scoring import format_ops

        lines = [f"{self.file}: {self.submission_id or 'no submission id'}"]
        if self.system:
            s = self.system
            lines.append(f"  system     {s['system_name']} at {s['site']} ({s['country']}), {s['nodes']} node(s) x "
                         f"{s['accelerators_per_node']} {s['accelerator_model']}")
        if self.backend:
            lines.append(f"  backend    {self.backend} {self.framework_version}, precision {', '.join(self.precisions)}")
        if self.score_ops is not None:
            lines.append(f"  score      {format_ops(self.score_ops)} (recomputed); regulated "
                         f"{format_ops(self.regulated_ops or 0.0)}")
        data = self.to_dict()
        for label, key in (("declared", "efficiency_declared"), ("measured", "efficiency_measured")):
            if data[key] is not None:
                lines.append(f"  efficiency {data[key]:.2%} of the {label} peak")
        lines.append(f"  energy     {self.energy['statement']}")
        if self.network_efficiency is not None:
            share = "" if self.network_share is None else f", {self.network_share:.2%} of step time waiting"
            lines.append(f"  network    efficiency {self.network_efficiency:.2%}{share} (reported, not scored)")
        lines += [f"  finding: {finding}" for finding in self.findings]
        lines.append(self.headline())
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)


def not_measured(why: str) -> dict[str, Any]:
    return {"measured": False, "joules": None, "ops_per_watt": None, "node_coverage": None,
            "time_coverage": None, "level": None, "statement": f"not measured: {why}"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def check_submission(package: str | os.PathLike, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """The verdict on one package; SubmissionError when it cannot be read as one (bad input)."""
    with unpack(package, limits) as unpacked:
        verdict = Verdict(str(package))
        root = unpacked.root
        listed = _check_manifest(verdict, root, unpacked.digests, str(package))
        verdict.log_digests = sorted(digest for name, (digest, _) in unpacked.digests.items()
                                     if name.endswith("events.jsonl"))
        description = _check_system(verdict, root)
        if not (root / RUN_PREFIX / "run.json").is_file():
            verdict.rejections.append("the package holds no run/run.json")
            return verdict
        try:
            run = _check_run(verdict, root / RUN_PREFIX)
        except AiperfError as exc:  # a run.json or log the scorer refuses: a rejection, named
            verdict.rejections.append(f"the run cannot be scored: {_relative(str(exc), root)}")
            return verdict
        inventory = _check_inventory(verdict, description, run)
        _check_certification(verdict, root, listed, inventory)
        _check_plausibility(verdict, root, listed, description, inventory)
        _check_energy(verdict, run, inventory)
        return verdict


def _relative(message: str, root: Path) -> str:
    """Messages name files inside the package, not inside our temporary directory."""
    return message.replace(f"{root}/{RUN_PREFIX}", RUN_PREFIX).replace(f"{root}/", "")


# -- 2. the manifest --------------------------------------------------------------------------
def _check_manifest(verdict: Verdict, root: Path, digests: dict[str, tuple[str, int]], package: str) -> set[str]:
    """Compare the manifest to what was unpacked; returns the names it lists. A package without a
    readable manifest is bad input; a manifest that does not match is a rejection."""
    if MANIFEST not in digests:
        raise SubmissionError(f"{package}: no {MANIFEST} (not a package made by aiperf submit)")
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise SubmissionError(f"{package}: {MANIFEST} is not JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise SubmissionError(f"{package}: {MANIFEST}: kind is not {MANIFEST_KIND!r}")
    if manifest.get("schema_version") != MANIFEST_SCHEMA_VERSION:
        raise SubmissionError(f"{package}: {MANIFEST}: schema_version {manifest.get('schema_version')!r} is not "
                              f"{MANIFEST_SCHEMA_VERSION}")
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
            for v in listed.values()):
        raise SubmissionError(f"{package}: {MANIFEST}: files must map each name to {{sha256, size}}")
    verdict.submission_id = submission_id(listed)
    if manifest.get("submission_id") != verdict.submission_id:
        verdict.rejections.append(f"{MANIFEST}: submission_id {manifest.get('submission_id')!r} is not the one its "
                                  f"file list gives ({verdict.submission_id})")
    bad = []
    for name, entry in sorted(listed.items()):
        found = digests.get(name)
        if found is None:
            bad.append(f"{name}: listed in {MANIFEST} but not in the package")
        elif found != (entry["sha256"], entry["size"]):
            bad.append(f"{name}: content differs from {MANIFEST} (changed after packing)")
    for name in sorted(set(digests) - set(listed) - {MANIFEST}):
        bad.append(f"{name}: in the package but not in {MANIFEST}")
    verdict.rejections += bad[:10]
    if len(bad) > 10:
        verdict.rejections.append(f"... and {len(bad) - 10} more file(s) that do not match {MANIFEST}")
    return set(listed)


# -- 3. the system description -----------------------------------------------------------------
def _check_system(verdict: Verdict, root: Path) -> dict[str, Any] | None:
    from aiperf_core.submission.system import device_count, load_system

    path = root / "system.toml"
    if not path.is_file():
        verdict.rejections.append("the package holds no system.toml")
        return None
    try:
        description = load_system(path)
    except SubmissionError as exc:
        verdict.rejections.append(_relative(str(exc), root))
        try:  # the other checks still run on a description with placeholders
            description = load_system(path, allow_placeholders=True)
        except SubmissionError:
            return None
    nodes, accelerators = description["nodes"], description["accelerators"]
    verdict.system = {"system_name": description["system_name"], "site": description["site"],
                      "country": description["country"], "submitter": description["submitter"],
                      "nodes": nodes["count"], "accelerator_kind": accelerators["kind"],
                      "accelerator_model": accelerators["model"], "accelerators_per_node": accelerators["per_node"]}
    verdict.accelerators = device_count(description)
    return description


# -- 4. the run ---------------------------------------------------------------------------------
@dataclass
class _Run:
    ledger: Any  # RunLedger
    result: Any  # ScoreResult
    monitors: Any  # report.Monitors


def _check_run(verdict: Verdict, run_root: Path) -> _Run:
    from aiperf_core.report import read_monitors
    from aiperf_core.rundir import RunDir
    from aiperf_core.scoring import verify_run
    from aiperf_core.scoring.ledger import RunLedger
    from aiperf_core.scoring.network import run_network
    from aiperf_core.scoring.score import score_ledger
    from aiperf_core.workflow.container import image_reasons

    problems = verify_run(run_root, withheld=WITHHELD)
    verdict.rejections += [f"verify: {RUN_PREFIX}{problem}" for problem in problems[:10]]
    if len(problems) > 10:
        verdict.rejections.append(f"verify: ... and {len(problems) - 10} more problem(s)")
    run_dir = RunDir(run_root)
    ledger = RunLedger(run_dir)
    ledger.refresh()
    result = score_ledger(ledger)
    if not result.ended:
        verdict.rejections.append("the run has not ended: the primary logged no run_end")
    verdict.run_id, verdict.start_time, verdict.elapsed_s = result.run_id, result.start_time, result.elapsed_s
    verdict.score_ops, verdict.regulated_ops = result.score_ops, result.regulated_ops
    verdict.best_accuracy, verdict.workload = result.best_accuracy, result.workload
    verdict.rule_reasons = list(result.reasons)
    network = run_network(ledger, result.score_ops, result.elapsed_s)
    verdict.network_share = None if network is None else network["share"]
    verdict.network_efficiency = None if network is None else network["efficiency"]
    verdict.precisions = sorted({str(t.precision) for t in ledger.trials.values()})
    _compare_stored(verdict, run_root, result)

    versions = ledger.framework_versions()
    if len(versions) != 1 or len(next(iter(versions.values()))) != 1:
        verdict.rejections.append("the replicas ran " + (
            "no backend" if not versions else
            "; ".join(f"{b} {', '.join(v)}" for b, v in versions.items())) + ": a submission certifies one backend "
            "at one framework version")
    if versions:
        verdict.backend, found = next(iter(versions.items()))
        verdict.framework_version = found[0]
    verdict.rejections += [f"image: {reason}: the replicas of one run must run one software stack"
                           for reason in image_reasons(ledger.info.run, ledger.replicas)]
    return _Run(ledger, result, read_monitors(run_dir, ledger, result))


def _compare_stored(verdict: Verdict, run_root: Path, result) -> None:
    for name in ("score.json", "summary.json"):
        try:
            stored = json.loads((run_root / name).read_text())
        except (OSError, ValueError):
            verdict.findings.append(f"{RUN_PREFIX}{name}: missing or not JSON; the recomputed score is used")
            continue
        for key, value in (("score_ops", result.score_ops), ("regulated_ops", result.regulated_ops)):
            claimed = stored.get(key) if isinstance(stored, dict) else None
            if not isinstance(claimed, (int, float)) or not math.isclose(claimed, value, rel_tol=STORED_SCORE_TOLERANCE,
                                                                          abs_tol=1e-9):
                verdict.findings.append(f"{RUN_PREFIX}{name}: stored {key} {claimed!r} differs from the recomputed "
                                        f"{value!r}; the recomputed one is used")


# -- 5. the description against the run's own inventory -----------------------------------------
@dataclass
class _Inventory:
    hosts: list[str]
    on_cpu: bool  # every replica trained on CPU devices
    model: str | None  # the compute device's model: the CPU's on CPU runs, the accelerators' otherwise
    per_node: int | None
    cpu_model: str | None


def replica_nodes(start: dict[str, Any]) -> list[tuple[str | None, list[str]]]:
    """(host, devices) of each node of a replica as its replica_start recorded it: every node of a
    replica across nodes (`nodes`), else the one host."""
    nodes = start.get("nodes") if isinstance(start.get("nodes"), list) else [start]
    return [(str(n["host"]) if n.get("host") is not None else None,
             [str(d) for d in n["devices"]] if isinstance(n.get("devices"), list) else []) for n in nodes
            if isinstance(n, dict)]


def recorded_inventory(run: _Run) -> _Inventory:
    """What the run itself recorded: replica_start (host, devices) and each replica's first monitor
    host record (CPU model, NVML accelerators)."""
    hosts: dict[str, dict[str, Any]] = {}
    on_cpu = True
    for replica, state in sorted(run.ledger.replicas.items()):
        start = state.starts[-1] if state.starts else {}
        record = run.monitors.host_records.get(replica, {})
        host = str(start.get("host") or record.get("host"))
        for node_host, devices in replica_nodes(start):  # a replica across nodes counts each of its hosts
            other = hosts.setdefault(node_host or host, {"cpu_models": set(), "uuids": set(), "names": set(),
                                                         "devices": 0})
            on_cpu = on_cpu and all(is_cpu_device(d) for d in devices)
            other["devices"] += len(devices)
        entry = hosts[host]
        if record.get("cpu_model"):
            entry["cpu_models"].add(str(record["cpu_model"]))
        for accelerator in record.get("accelerators") or []:
            entry["uuids"].add(str(accelerator.get("uuid") or accelerator.get("index")))
            entry["names"].add(str(accelerator.get("name")))
    cpu_models = set().union(*(h["cpu_models"] for h in hosts.values())) if hosts else set()
    names = set().union(*(h["names"] for h in hosts.values())) if hosts else set()
    cpu_model = next(iter(cpu_models)) if len(cpu_models) == 1 else None
    if on_cpu:
        model, per_node = cpu_model, 1
    else:
        model = next(iter(names)) if len(names) == 1 else None
        counts = {len(h["uuids"]) or h["devices"] for h in hosts.values()}
        per_node = next(iter(counts)) if len(counts) == 1 else None
    return _Inventory(sorted(hosts), on_cpu, model, per_node, cpu_model)


def _declared_matches(verdict: Verdict, field: str, declared: Any, recorded: Any, unrecorded: str) -> None:
    """Reject a system.toml value the run's own records contradict, or that they cannot confirm."""
    if recorded is None:
        verdict.rejections.append(unrecorded)
    elif declared != recorded:
        verdict.rejections.append(f"system.toml: {field} is {declared!r}, but the run recorded {recorded!r}")


def _check_inventory(verdict: Verdict, description: dict[str, Any] | None, run: _Run) -> _Inventory:
    inventory = recorded_inventory(run)
    if description is None:
        return inventory
    nodes, accelerators = description["nodes"], description["accelerators"]
    recorded = (f"the run recorded {len(inventory.hosts)} host(s)")
    if nodes["count"] != len(inventory.hosts):
        verdict.rejections.append(f"system.toml: nodes.count is {nodes['count']}, but {recorded} "
                                  f"({', '.join(inventory.hosts[:4])}{', ...' if len(inventory.hosts) > 4 else ''})")
    _declared_matches(verdict, "nodes.cpu_model", nodes["cpu_model"], inventory.cpu_model,
                      "the run recorded no single host CPU model (monitor host records) to check "
                      "nodes.cpu_model against")
    if inventory.on_cpu != (accelerators["kind"] == "cpu"):
        verdict.rejections.append(f"system.toml: accelerators.kind is {accelerators['kind']!r}, but the run trained on "
                                  + ("CPU devices" if inventory.on_cpu else "accelerators"))
    _declared_matches(verdict, "accelerators.model", accelerators["model"], inventory.model,
                      "the run recorded no single accelerator model to check accelerators.model against")
    _declared_matches(verdict, "accelerators.per_node", accelerators["per_node"], inventory.per_node,
                      "the run's hosts recorded different accelerator counts: accelerators.per_node cannot be checked")
    return inventory


# -- 6. certification ----------------------------------------------------------------------------
def _report_problems(report: dict[str, Any], verdict: Verdict, model: str | None) -> list[str]:
    """Why a kit report does not certify this run's backend on this model; empty when it does.
    Its verdict is recomputed from its checks, not read from its 'ok' or 'certifies'."""
    from aiperf_conformance.kit import LEVELS
    from aiperf_conformance.results import BAD, PASS, UNSUPPORTED

    problems = []
    if report.get("quick"):
        problems.append("a quick run (reduced sizes), not a certification")
    if report.get("backend") != verdict.backend:
        problems.append(f"for backend {report.get('backend')!r}, not {verdict.backend!r}")
    if report.get("framework_version") != verdict.framework_version:
        problems.append(f"for framework version {report.get('framework_version')!r}, not {verdict.framework_version!r}")
    if report.get("device_model") != model:
        problems.append(f"on {report.get('device_model')!r}, not the run's {model!r}")
    missing = [level for level in LEVELS if level not in report["levels"]]
    if missing:
        problems.append(f"levels not run: {', '.join(missing)}")
    statuses = [c.get("status") for c in report["checks"] if isinstance(c, dict)]
    failed = sum(s in BAD for s in statuses)
    if failed or PASS not in statuses:
        problems.append(f"does not conform ({failed} failed, {statuses.count(PASS)} passed)")
    # A run needs the kit's checks of its workload to have run, at every level (a report from before
    # workloads holds CNN checks only, and no workload_scope).
    workload = verdict.workload or "cnn"
    if workload not in report.get("workload_scope", ["cnn"]):
        problems.append(f"the {workload} workload was not checked "
                        f"(--workload {','.join(map(str, report['workload_scope']))})")
    levels = {c.get("level") for c in report["checks"] if isinstance(c, dict) and c.get("workload", "cnn") == workload}
    without = [level for level in LEVELS if level in report["levels"] and level not in levels]
    if without:
        problems.append(f"no {workload} check at levels: {', '.join(without)}")
    unsupported = [c.get("id") for c in report["checks"] if isinstance(c, dict) and c.get("status") == UNSUPPORTED
                   and c.get("workload", "cnn") == workload]
    if unsupported:
        problems.append(f"the {workload} workload is not certified: {len(unsupported)} of its checks unsupported "
                        f"({unsupported[0]}, ...)")
    return problems


def _certified_precisions(report: dict[str, Any]) -> set[str]:
    from aiperf_conformance.results import PASS

    return {str(p) for p in report["precisions"]
            if any(isinstance(c, dict) and c.get("precision") == p and c.get("status") == PASS for c in report["checks"])}


def _check_certification(verdict: Verdict, root: Path, listed: set[str], inventory: _Inventory) -> None:
    names = sorted((n for n in listed if n.startswith("conformance/") and (root / n).is_file()),
                   key=lambda n: (len(n), n))
    if not names:
        verdict.rejections.append("the package holds no conformance report")
        return
    covered: set[str] = set()
    why: list[str] = []
    for name in names:
        try:
            report = load_conformance_report(root / name)
        except SubmissionError as exc:
            why.append(_relative(str(exc), root))
            continue
        problems = _report_problems(report, verdict, inventory.model)
        if problems:
            why.append(f"{name}: " + "; ".join(problems))
        else:
            covered |= _certified_precisions(report)
    uncovered = [p for p in verdict.precisions if p not in covered]
    if uncovered:
        verdict.rejections.append(
            f"backend {verdict.backend} {verdict.framework_version} is not certified on {inventory.model!r} at "
            f"{', '.join(uncovered)}" + (f": {' | '.join(why)}" if why else
                                         ": no conforming report checked that precision"))


# -- 7. plausibility ------------------------------------------------------------------------------
def _check_plausibility(verdict: Verdict, root: Path, listed: set[str], description: dict[str, Any] | None,
                        inventory: _Inventory) -> None:
    from aiperf_core.scoring import format_ops
    from aiperf_core.submission.peak import load_peak, peak_per_device, spread_warnings
    from aiperf_core.submission.system import declared_peak_ops

    if description is None or verdict.score_ops is None:
        return
    count = verdict.accelerators or 0
    per_device = []
    for precision in verdict.precisions:
        peak = declared_peak_ops(description, precision)
        if peak is None:
            verdict.rejections.append(f"system.toml: accelerators.peak_ops declares no {precision} peak, and the "
                                      f"run trained at {precision}")
        else:
            per_device.append(peak)
    if per_device:
        verdict.declared_peak_ops = max(per_device) * count
        if verdict.score_ops > verdict.declared_peak_ops:
            verdict.rejections.append(f"implausible: the score {format_ops(verdict.score_ops)} exceeds the declared "
                                      f"peak {format_ops(verdict.declared_peak_ops)} ({count} device(s))")
    if "peak.json" not in listed or not (root / "peak.json").is_file():
        return
    try:
        peak = load_peak(root / "peak.json")
    except SubmissionError as exc:
        verdict.rejections.append(_relative(str(exc), root))
        return
    measured = []
    for precision in verdict.precisions:
        value = peak_per_device(peak, precision, inventory.model)
        if value is None:
            verdict.findings.append(f"peak.json: no {precision} measurement on {inventory.model!r}")
        else:
            measured.append(value)
    if measured:
        verdict.measured_peak_ops = max(measured) * count
        if verdict.declared_peak_ops and verdict.measured_peak_ops > MEASURED_OVER_DECLARED * verdict.declared_peak_ops:
            # A declared peak below what the hardware measurably does flatters the efficiency the
            # list shows against it: the reviewer is told, the result is not refused for it.
            verdict.findings.append(f"the measured matrix-multiply peak {format_ops(verdict.measured_peak_ops)} is "
                                    f"{verdict.measured_peak_ops / verdict.declared_peak_ops:.1f}x the declared peak "
                                    f"{format_ops(verdict.declared_peak_ops)}: system.toml's accelerators.peak_ops "
                                    "looks understated")
        if verdict.score_ops > verdict.measured_peak_ops:
            # An efficiency above 1 against the measured peak: the peak was under-measured (a loaded
            # node, too small a product) or the score is wrong; either way not a figure to list.
            verdict.rejections.append(f"implausible: efficiency {verdict.score_ops / verdict.measured_peak_ops:.1%} "
                                      f"against the measured peak exceeds 1: the score {format_ops(verdict.score_ops)} "
                                      f"exceeds the measured matrix-multiply peak "
                                      f"{format_ops(verdict.measured_peak_ops)} ({count} device(s)); peak.json "
                                      "under-measures the devices or the score is wrong")
        verdict.findings += [f"peak.json: {line}" for line in spread_warnings(peak, verdict.precisions, inventory.model)]


# -- 8. energy --------------------------------------------------------------------------------------
MEASURED_OVER_DECLARED = 1.1  # a measured peak this far above the declared one is reported


def power_level(node_share: float, time_share: float, both_measured: bool) -> str | None:
    for level, nodes, time in POWER_LEVELS:
        if node_share >= nodes - 1e-12 and time_share >= time and (level != "L3" or both_measured):
            return level
    return None


def _check_energy(verdict: Verdict, run: _Run, inventory: _Inventory) -> None:
    energy = run.monitors.energy
    if energy.total_j is None or energy.total_j <= 0:
        verdict.energy = not_measured("; ".join(energy.missing) or "no energy counter")
        return
    nodes = max((verdict.system or {}).get("nodes") or 0, len(inventory.hosts), 1)
    node_share = min(energy.hosts / nodes, 1.0)
    shares = [v for v in energy.coverage.values() if v is not None]
    time_share = min(shares) if shares else 0.0
    both = energy.accelerators_j is not None or energy.accelerators == 0
    level = power_level(node_share, time_share, both)
    ops_per_watt = run.result.total_ops / energy.total_j
    verdict.energy = {
        "measured": True, "joules": energy.total_j, "ops_per_watt": ops_per_watt, "node_coverage": node_share,
        "time_coverage": time_share, "level": level,
        "statement": (f"{energy.total_j:.4g} J over {node_share:.0%} of the nodes and {time_share:.0%} of the run; "
                      f"{ops_per_watt:.4g} OPS per watt; power level {level or 'below L1'}")}
