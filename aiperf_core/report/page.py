"""report.html: one self-contained page (inline CSS and SVG, no script, nothing fetched)."""

from __future__ import annotations

import json
from html import escape
from typing import Any

from aiperf_core.report.svg import Bar, Series, line_chart, timeline_chart
from aiperf_core.scoring.ledger import RunLedger
from aiperf_core import workloads
from aiperf_core.scoring.rules import quality_rules, run_policy
from aiperf_core.scoring.score import ScoreResult
from aiperf_core.scoring.units import format_ops, ops_prefix
from aiperf_core.workflow.auto_precision import describe as describe_precision_probe

TIMELINE_ROWS = 64  # replicas drawn in the timeline; a 4096-row chart is unreadable and huge
TABLE_ROWS = 64  # replicas listed in the node table
STATUS_COLORS = {"ok": "#2ca02c", "early_stopped": "#1f77b4", "failed": "#d62728", "interrupted": "#ff7f0e",
                 "running": "#999999"}

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 980px; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; }
td, th { padding: 2px 10px 2px 0; text-align: left; vertical-align: top; }
.big { font-size: 1.4em; font-weight: 600; }
.official { color: #1a7f37; font-weight: 600; }
.unofficial { color: #b3261e; font-weight: 600; }
.chart { display: block; margin: 0.8em 0; font-size: 11px; max-width: 100%; height: auto; }
.chart .chart-title { font-size: 13px; font-weight: 600; }
.chart .grid { stroke: #e4e4e4; }
.chart .frame { fill: none; stroke: #888; }
pre { background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12px; }
"""


def render_page(summary: dict[str, Any], result: ScoreResult, ledger: RunLedger,
                utilisation: dict[str, list[tuple[float, float]]],
                power: dict[str, list[tuple[float, float]]] | None = None) -> str:
    run_id = summary.get("run_id") or ledger.run_dir.root.name
    label = "official" if result.valid else "unofficial"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>aiperf report: {escape(str(run_id))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>aiperf run {escape(str(run_id))}</h1>",
        f'<p class="big">Score {escape(format_ops(result.score_ops))} &middot; regulated score '
        f'{escape(format_ops(result.regulated_ops))}{_efficiency_headline(summary)} &middot; '
        f'<span class="{label}">{label}</span></p>',
        _failure(result),
        _facts_table(summary, result),
        _validity(result),
        _communication(summary.get("communication")),
        _network_probe(summary.get("network_probe")),
        "<h2>Score over time</h2>",
        _score_charts(result, ledger.info.run),
        "<h2>Trials per replica</h2>",
        _timeline(result, ledger),
        "<h2>Utilisation</h2>",
        _utilisation_chart(utilisation),
        "<h2>Power</h2>",
        _power_chart(power or {}),
        _expert_load(summary.get("expert_load")),
        "<h2>Machine and software</h2>",
        _machine(summary),
        "<h2>Configuration (run.json)</h2>",
        f"<pre>{escape(json.dumps(summary.get('configuration'), indent=1, sort_keys=True))}</pre>",
        f"<p>Generated {escape(str(summary.get('generated')))} from the run directory by "
        f"<code>aiperf report</code>; the figures are recomputed by <code>aiperf score</code>.</p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _row(name: str, value: str) -> str:
    return f"<tr><th>{escape(name)}</th><td>{value}</td></tr>"


def _failure(result: ScoreResult) -> str:
    if result.failure is None:
        return ""
    return (f'<p class="unofficial">Failed: the run produced nothing: {escape(result.failure.describe())}</p>')


def _precision(summary: dict[str, Any]) -> str:
    precision = summary.get("precision", {})
    asked, resolved = precision.get("policy"), precision.get("resolved")
    if resolved is None:
        text = f"{asked}, resolved by each replica on its node"
    else:
        text = f"{resolved} ({describe_precision_probe(precision.get('probe'))})" if asked == "auto" else str(resolved)
    trained = ", ".join(f"{name} {n}" for name, n in precision.get("trials", {}).items())
    return escape(text) + (f" &mdash; trials: {escape(trained)}" if trained else "")


def _efficiency_headline(summary: dict[str, Any]) -> str:
    """OPS/W next to the score: against the total energy, else the accelerators' alone."""
    per_joule = summary.get("energy", {}).get("ops_per_joule", {})
    for key, suffix in (("total", ""), ("accelerators", " (accelerators)")):
        if per_joule.get(key) is not None:
            return f" &middot; {escape(format_ops(per_joule[key]))}/W{suffix}"
    return ""


def _joules(value: float | None) -> str:
    if value is None:
        return "not measured"
    for divisor, unit in ((3.6e6, "kWh"), (1e3, "kJ")):
        if value >= divisor:
            return f"{value / divisor:.3g} {unit} ({value:.4g} J)"
    return f"{value:.3g} J"


def _energy_rows(summary: dict[str, Any]) -> list[str]:
    energy = summary.get("energy", {})
    per_joule = energy.get("ops_per_joule", {})
    coverage = energy.get("coverage", {})

    def measured(key: str) -> str:
        share = coverage.get(key)
        return _joules(energy.get(f"{key}_j")) + ("" if share is None else f", sampled over {share:.0%} of the window")

    def efficiency(key: str) -> str:
        value = per_joule.get(key)
        return "not measured" if value is None else f"{escape(format_ops(value))}/W ({value:.4g} operations per joule)"

    rows = [_row("energy: accelerators", measured("accelerators")), _row("energy: host CPU+DRAM", measured("host")),
            _row("energy: total", _joules(energy.get("total_j"))),
            _row("OPS/W (analytic operations per joule)", efficiency("total")),
            _row("OPS/W, accelerators only", efficiency("accelerators"))]
    rows += [_row("energy not measured", escape(line)) for line in energy.get("missing", [])]
    return rows


def _facts_table(summary: dict[str, Any], result: ScoreResult) -> str:
    accuracy = workloads.get(result.workload).validity.best(result.best_error, result.best_accuracy)
    statuses = ", ".join(f"{escape(k)} {v}" for k, v in result.trials_by_status.items()) or "none"
    software = summary.get("software", {})
    versions = "; ".join(f"{escape(backend)} {escape(', '.join(found))}"
                         for backend, found in software.get("framework_versions", {}).items())
    rows = [
        _row("score (OPS at the end)", f"{escape(format_ops(result.score_ops))} ({result.score_ops:.6g} OPS)"),
        _row("regulated score", f"{escape(format_ops(result.regulated_ops))} ({result.regulated_ops:.6g} OPS)"),
        _row("best validation result", accuracy),
        _row("time scored", f"{result.elapsed_s / 3600:.3f} h of {(result.deadline - result.start_time) / 3600:.3f} h "
                            f"budget{'' if result.ended else ' (run not ended)'}"),
        _row("operations counted", f"{result.total_ops:.4g} over {result.epochs_counted} epochs "
                                   f"({result.epochs_after_deadline} finished after the deadline)"),
        _row("trials", f"{result.trials} ({statuses})"),
        _row("backend", escape(str(software.get("backend"))) + (f" &mdash; {versions}" if versions else "")),
        _row("replicas", str(summary.get("machine", {}).get("replicas"))),
        _row("nodes per replica", _replica_nodes(summary.get("machine", {}))),
        _row("time in train and eval steps", _fraction(summary.get("machine", {}).get("busy_fraction"))
             + " of the replicas' wall time"),
        _row("time compiling training steps", _compile(summary.get("compile", {}))),
        _row("precision", _precision(summary)),
        *_energy_rows(summary),
    ]
    return "<table>" + "".join(rows) + "</table>"


def _replica_nodes(machine: dict[str, Any]) -> str:
    nodes = machine.get("nodes_per_replica", 1)
    if machine.get("network_loaded"):
        return f"{nodes}: every step's gradients crossed the network"
    if machine.get("executor") == "local" and nodes != 1:
        return f"{nodes} processes on one machine: no network was loaded"
    return f"{nodes}: no network was loaded"


def _validity(result: ScoreResult) -> str:
    if result.valid:
        out = '<p class="official">Official: every rule of the benchmark is met.</p>'
    else:
        items = "".join(f"<li>{escape(r)}</li>" for r in result.reasons)
        out = f'<p class="unofficial">Unofficial, because:</p><ul>{items}</ul>'
    if result.notes:
        out += "<p>Notes on the logs:</p><ul>" + "".join(f"<li>{escape(n)}</li>" for n in result.notes) + "</ul>"
    return out


def _score_charts(result: ScoreResult, run: dict[str, Any]) -> str:
    workload = workloads.of_run(run)
    validity, rules = workload.validity, quality_rules(run_policy(run))
    hours = [t / 3600 for t, _, _, _ in result.samples]
    top = max([s[1] for s in result.samples + result.curve] + [s[2] for s in result.samples + result.curve] + [0.0])
    divisor, prefix = ops_prefix(top)
    unit = f"{prefix}OPS"

    def at_epochs(index: int, label: str) -> Series:
        return Series(label, [(point[0] / 3600, point[index] / divisor) for point in result.curve],
                      color="#bbbbbb")

    score = Series("0.1 h samples", [(h, s[1] / divisor) for h, s in zip(hours, result.samples)], color="#1f77b4")
    reg = Series("0.1 h samples", [(h, s[2] / divisor) for h, s in zip(hours, result.samples)],
                 color="#9467bd")
    # The best error only changes at epoch ends, so the epoch curve draws it exactly.
    error_points = [(point[0] / 3600, validity.display(point[3])) for point in sorted(result.curve + result.samples)
                    if point[3] is not None]
    limit_value = validity.display(validity.limit(rules))
    limit = [(0.0, limit_value), (hours[-1], limit_value)] if hours else []
    return "".join([
        line_chart("Score: OPS(t), sampled every 0.1 h (grey: at each epoch's end)",
                   [at_epochs(1, "each epoch"), score], "hours since start", unit),
        line_chart("Regulated score: -ln(error) x OPS(t)",
                   [at_epochs(2, "each epoch"), reg], "hours since start", unit),
        line_chart("Best validation error so far",
                   [Series("best error", error_points, step=True),
                    Series(f"limit {limit_value:g}", limit, color="#999999")],
                   "hours since start", validity.unit, y_max=validity.display(1.0)),
    ])


def _timeline(result: ScoreResult, ledger: RunLedger) -> str:
    start = result.start_time
    by_replica: dict[int, list[Bar]] = {replica: [] for replica in sorted(ledger.replicas)}
    for trial in ledger.trials.values():
        status = trial.status or "running"
        end = trial.ended if trial.ended is not None else max(result.end_time, trial.last_epoch_time or trial.started)
        accuracy = "-" if trial.best_accuracy is None else f"{trial.best_accuracy:.2%}"
        compiled = "" if trial.compile_seconds is None else f", {trial.compile_seconds:.1f} s compiling"
        balance = "" if not trial.expert_load else f", expert load {max(trial.expert_load.values()):.2f} x the mean"
        bandwidth = trial.all_to_all_bytes_per_second()
        moved = "" if bandwidth is None else f", all-to-all {_gigabytes(bandwidth)}/s"
        bus = trial.all_reduce_bytes_per_second()
        moved += "" if bus is None else f", all-reduce {_gigabytes(bus)}/s"
        tooltip = f"{trial.id}: {status}, {trial.epochs} epochs, best accuracy {accuracy}{compiled}{balance}{moved}"
        by_replica.setdefault(trial.replica, []).append(
            Bar((trial.started - start) / 3600, (end - start) / 3600, STATUS_COLORS.get(status, "#555555"), tooltip))
    replicas = sorted(by_replica)
    shown = replicas[:TIMELINE_ROWS]
    rows = [(f"replica {r}", by_replica[r]) for r in shown]
    x_max = max([(result.deadline - start) / 3600] + [b.end for _, bars in rows for b in bars])
    legend = [(name, color) for name, color in STATUS_COLORS.items()]
    deadline = (result.deadline - start) / 3600
    chart = timeline_chart("Trials of each replica over time (colour: outcome)", rows, x_max, "hours since start",
                           legend, marker=(deadline, "deadline"))
    note = (f"<p>Showing the first {len(shown)} of {len(replicas)} replicas.</p>" if len(replicas) > len(shown)
            else "")
    return chart + note


def _utilisation_chart(utilisation: dict[str, list[tuple[float, float]]]) -> str:
    series = [Series(f"{label} %", points) for label, points in utilisation.items()]
    chart = line_chart("Mean utilisation over all replicas (monitor samples)", series, "hours since start",
                       "percent", y_max=100.0)
    if "accelerator" not in utilisation:
        chart += "<p>No accelerator samples: NVML was not available on the replica nodes.</p>"
    return chart


def _compile(compiled: dict[str, Any]) -> str:
    seconds = compiled.get("seconds")
    if seconds is None:
        return "not measured"
    return f"{seconds:.1f} s ({_fraction(compiled.get('share'))} of the replicas' wall time)"


def _expert_load(load: dict[str, Any] | None) -> str:
    """The mixture-of-experts section: nothing for a run without one."""
    if not load:
        return ""
    rows = "".join(
        f"<tr><td>{escape(str(entry['trial']))}</td><td>"
        + escape(", ".join(f"{node} {ratio:.2f}" for node, ratio in sorted(entry["max_over_mean"].items())))
        + "</td></tr>" for entry in load["least_even"])
    return (f"<h2>Mixture of experts: load balance</h2><p>{load['trials']} trials with a mixture of experts. The "
            f"tokens each expert received in a trial's last epoch, their maximum over their mean (1: even; E: "
            f"one expert takes every token): {load['mean_max_over_mean']:.2f} on average over the trials' least "
            f"even layers, {load['worst_max_over_mean']:.2f} at worst. Reported beside the score, not part of it."
            f"</p><table><tr><th>least even trials</th><th>per moe layer</th></tr>{rows}</table>")


def _gigabytes(count: float) -> str:
    """Bytes in GB (10^9), to three significant digits."""
    return f"{count / 1e9:.3g} GB"


def _rate(bandwidth: float | None) -> str:
    return "no time measured" if bandwidth is None else f"{_gigabytes(bandwidth)}/s ({bandwidth:.4g} bytes/s)"


def _communication(communication: dict[str, Any] | None) -> str:
    """The communication section beside the score: nothing for a run where no trial communicated."""
    if not communication:
        return ""
    rows = []
    a2a, reduce = communication.get("all_to_all"), communication.get("all_reduce")
    network = communication.get("network")
    if a2a:
        rows += [_row("all-to-all bytes (analytic)", f"{_gigabytes(a2a['bytes'])} ({a2a['bytes']} bytes)"),
                 _row("seconds in all-to-all (measured)", f"{a2a['seconds']:.4g} s"),
                 _row("all-to-all bandwidth", _rate(a2a.get("bytes_per_second"))),
                 _row("trials that ran expert-parallel", str(a2a["trials"]))]
    if reduce:
        seconds = "not measured" if reduce["seconds"] is None else f"{reduce['seconds']:.4g} s"
        inter, intra = _gigabytes(reduce["inter_node_bytes"]), _gigabytes(reduce["intra_node_bytes"])
        per_rank = f"{_gigabytes(reduce['bytes'])} ({reduce['bytes']} bytes)"
        rows += [_row("all-reduce bytes per rank (analytic)", per_rank),
                 _row("all-reduce bytes over the nodes' network links", f"{inter} ({intra} inside nodes)"),
                 _row("seconds waiting on the all-reduce (measured)", seconds),
                 _row("all-reduce bus bandwidth", _rate(reduce.get("bytes_per_second"))),
                 _row("trials that ran data-parallel", str(reduce["trials"]))]
    if network:
        share, ratio, ideal = network["share"], network["efficiency"], network["ideal_score_ops"]
        bound = "" if network["complete"] else " (an upper bound: some all-reduce seconds were not measured)"
        rows += [_row("share of step time waiting on communication", _fraction(share)),
                 _row("network efficiency", _fraction(ratio) + bound),
                 _row("score an ideal network would have given", "-" if ideal is None else format_ops(ideal))]
    return ("<h2>Communication: the network</h2><p>Data-parallel trials all-reduce their gradients every "
            "step; expert-parallel trials move tokens to their experts' devices and back by all-to-all. The "
            "bytes are counted from the graph and the replica's layout (opcount.communication), the seconds "
            "measured by the backend; a bandwidth is their ratio over the trials' epochs (per replica, not the "
            "machine's aggregate). The network efficiency is the score over the score an ideal network would "
            "have given: the same operations in the replicas' time less their waits on communication. "
            "Reported beside the score, not part of it (docs/scoring.md).</p><table>" + "".join(rows) + "</table>")


def _network_probe(probe: dict[str, Any] | None) -> str:
    """What `aiperf probe network` measured between the nodes: nothing where no probe was recorded."""
    if not probe:
        return ""
    if "unreadable" in probe:
        return f"<h2>Network probe</h2><p>network-probe.json: {escape(probe['unreadable'])}</p>"
    rows = [_row("ranks", f"{probe['ranks']} on {probe['nodes']} node(s), {escape(str(probe['backend']))} on "
                          f"{escape(str(probe['device']))}")]
    for collective in ("all_reduce", "all_to_all"):
        figures = probe.get(collective)
        if not figures:
            continue
        name = collective.replace("_", "-")
        rows += [_row(f"{name} latency (fitted)", f"{figures['latency_s'] * 1e6:.4g} us"),
                 _row(f"{name} bus bandwidth (fitted)", _rate(figures["busbw_bytes_per_s"])),
                 _row(f"{name} bus bandwidth at {figures['largest_bytes']} bytes",
                      _rate(figures["largest_busbw_bytes_per_s"]))]
    return ("<h2>Network probe</h2><p>Measured between the nodes by <code>aiperf probe network</code> (its "
            "record in the run directory, network-probe.json), as nccl-tests measures: latency and bus bandwidth "
            "fitted to time = latency + bus bytes / bandwidth over the sizes, and the bus bandwidth at the largest "
            "size. Compare with the declared interconnect (system.toml) and with the bandwidth the trials "
            "reached above.</p><table>" + "".join(rows) + "</table>")


def _power_chart(power: dict[str, list[tuple[float, float]]]) -> str:
    if not power:
        return "<p>No power samples: neither NVML power nor RAPL energy was readable on the replica nodes.</p>"
    series = [Series(label, points) for label, points in power.items()]
    return line_chart("Mean power draw (monitor samples)", series, "hours since start", "watts")


def _fraction(value: float | None) -> str:
    return "not measured" if value is None else f"{100 * value:.1f}%"


def _image_text(container: Any, full: bool = False) -> str:
    """A replica_start's or run.json's `container`: 'none' on the host, else the runtime and the
    digest (the image's name too, with `full`)."""
    if not isinstance(container, dict):
        return "none"
    digest = str(container.get("digest"))
    text = f"{container.get('runtime') or 'started by hand'} {digest if full else digest[:19]}"
    return f"{container.get('image')} ({text})" if full else text


def _hosts_text(node: dict[str, Any]) -> str:
    """A replica's host, or every host of a replica across nodes, its first node's first."""
    nodes = node.get("nodes") or [{"host": node["host"]}]
    return ", ".join(str(n.get("host")) for n in nodes)


def _devices_text(node: dict[str, Any]) -> str:
    nodes = node.get("nodes")
    if not nodes:
        return str(node["devices"])
    return "; ".join(f"{n.get('host')}: {', '.join(map(str, n.get('devices') or []))}" for n in nodes)


def _machine(summary: dict[str, Any]) -> str:
    machine = summary.get("machine", {})
    accelerators = ", ".join(f"{n} x {escape(str(name))}" for name, n in machine.get("accelerators", {}).items())
    head = ("<table>" + _row("hosts", escape(", ".join(machine.get("hosts", [])[:16]) +
                                             (" ..." if len(machine.get("hosts", [])) > 16 else "")))
            + _row("accelerators seen", accelerators or "none reported")
            + _row("executor", escape(str(machine.get("executor"))))
            + _row("container", escape(_image_text(summary.get("configuration", {}).get("container"), full=True)))
            + _row("aiperf", escape(str(summary.get("software", {}).get("aiperf")))) + "</table>")
    nodes = machine.get("nodes", [])
    rows = "".join(
        f"<tr><td>{n['replica']}</td><td>{escape(_hosts_text(n))}</td><td>{escape(_devices_text(n))}</td>"
        f"<td>{escape(str(n['backend']))} {escape(str(n['framework_version']))}</td>"
        f"<td>{escape(_image_text(n.get('container')))}</td><td>{n['attempts']}</td>"
        f"<td>{escape(str(n['cpus']))}</td><td>{_fraction(n.get('busy_fraction'))}</td></tr>"
        for n in nodes[:TABLE_ROWS])
    table = ("<table><tr><th>replica</th><th>host</th><th>devices</th><th>framework</th><th>image</th>"
             f"<th>starts</th><th>CPUs</th><th>in steps</th></tr>{rows}</table>")
    more = (f"<p>First {TABLE_ROWS} of {len(nodes)} replicas; all are in summary.json.</p>"
            if len(nodes) > TABLE_ROWS else "")
    return head + table + more
