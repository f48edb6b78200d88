"""The lists: checked submissions ranked by score, one list per workload (a CNN result and an LM
result never share one), as text, CSV, JSON and one self-contained HTML page.

Input is what the reviewer's check says of each package (`Verdict.to_dict()` of
aiperf_core/submission/check.py), never the package itself: the list believes only recomputed
figures. The rules (order, one entry per system, duplicates, the Green list) are in
docs/submission.md, "The list".
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from html import escape
from typing import Any, Callable

from aiperf_core.policy import WORKLOADS
from aiperf_core.scoring.rules import RULES_VERSIONS
from aiperf_core.scoring.units import format_ops
from aiperf_core.submission import SubmissionError

VERDICTS = ("ACCEPTED", "REJECTED")


@dataclass
class Ranking:
    """`entries`: one per system, best first, each the verdict plus its 1-based "rank".
    `green`: the entries that metered energy, by OPS per watt, each with its "green_rank".
    `superseded`: a system's other accepted results, each with "superseded_by" and "reason".
    `rejected`: {file, submission_id, run_id, system_name, site, reasons} of each rejected or
    duplicate submission, in argument order."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    green: list[dict[str, Any]] = field(default_factory=list)
    superseded: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    workload: str | None = None  # None: packages refused before their workload could be read

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "rules_version": RULES_VERSIONS.get(self.workload),
                "entries": self.entries, "green": self.green,
                "superseded": self.superseded, "rejected": self.rejected}


def rank_lists(verdicts: list[dict[str, Any]]) -> list[Ranking]:
    """One Ranking per workload the verdicts name, in WORKLOADS' order (cnn first), each from that
    workload's verdicts alone; packages refused before their workload was read come last, in a
    list of rejections of their own."""
    groups: dict[str | None, list[dict[str, Any]]] = {}
    for verdict in verdicts:
        groups.setdefault(verdict.get("workload"), []).append(verdict)
    known = [w for w in WORKLOADS if w in groups]
    other = sorted(w for w in groups if w is not None and w not in WORKLOADS)
    return [rank(groups[w], w) for w in known + other + ([None] if None in groups else [])]


# What `aiperf rank --json` prints, so a reader can tell the shapes apart: 1 was one list,
# `{"entries", "green", "superseded", "rejected"}` (before lists per workload, 2026-11-27, an
# object without this field); 2 is {"format": 2, "lists": [Ranking.to_dict(), ...]}.
JSON_FORMAT = 2


def lists_to_dict(rankings: list[Ranking]) -> dict[str, Any]:
    return {"format": JSON_FORMAT, "lists": [r.to_dict() for r in rankings]}


def rank(verdicts: list[dict[str, Any]], workload: str | None = "cnn") -> Ranking:
    """Rank the verdicts of `aiperf check` of one workload, given in the order the submissions
    were named."""
    ranking = Ranking(workload=workload)
    seen_submission: dict[str, str] = {}
    seen_run: dict[str, str] = {}
    seen_digest: dict[str, str] = {}
    accepted = []
    for verdict in verdicts:
        _require_fields(verdict)
        duplicate = _duplicate_of(verdict, seen_submission, seen_run, seen_digest)
        if verdict["verdict"] == "REJECTED" or duplicate:
            reasons = ([duplicate] if duplicate else []) + (
                list(verdict["reasons"]) if verdict["verdict"] == "REJECTED" else [])
            ranking.rejected.append(_rejected_record(verdict, reasons))
            continue
        # Only a result that can be ranked blocks later copies of itself: a package the check
        # refused never does, so a site may fix its description and pack the same run again.
        seen_submission[verdict["submission_id"]] = verdict["file"]
        if verdict["run_id"] is not None:
            seen_run.setdefault(verdict["run_id"], verdict["file"])
        for digest in verdict["log_digests"]:
            seen_digest.setdefault(digest, verdict["file"])
        accepted.append(verdict)

    best_of_system: dict[tuple[str, str], dict[str, Any]] = {}
    for verdict in sorted(accepted, key=order_key):
        system = (verdict["system"]["system_name"], verdict["system"]["site"])
        best = best_of_system.get(system)
        if best is None:
            best_of_system[system] = verdict
            ranking.entries.append({"rank": len(ranking.entries) + 1, **verdict, "workload": workload})
        else:
            ranking.superseded.append({**verdict, "superseded_by": best["submission_id"],
                                       "reason": f"superseded by {best['submission_id']}"})

    metered = [e for e in ranking.entries if e["energy"]["measured"] and e["energy"]["ops_per_watt"] is not None]
    metered.sort(key=lambda e: (-e["energy"]["ops_per_watt"], e["rank"]))
    ranking.green = [{"green_rank": n, **entry} for n, entry in enumerate(metered, start=1)]
    return ranking


def order_key(verdict: dict[str, Any]) -> tuple:
    """The list's order: official first, then score descending, regulated score descending,
    declared peak ascending (the same score on less hardware ranks higher), submission id."""
    regulated = verdict["regulated_ops"]
    peak = verdict["declared_peak_ops"]
    return (not verdict["official"], -verdict["score_ops"],
            regulated is None, -(regulated or 0.0),
            peak is None, peak or 0.0,
            verdict["submission_id"])


def _require_fields(verdict: dict[str, Any]) -> None:
    name = verdict.get("file", "?")
    if verdict.get("verdict") not in VERDICTS:
        raise SubmissionError(f"{name}: verdict {verdict.get('verdict')!r} is not one of {', '.join(VERDICTS)}")
    if verdict["verdict"] == "REJECTED":
        return
    system = verdict.get("system") or {}
    for key, value in (("submission_id", verdict.get("submission_id")), ("score_ops", verdict.get("score_ops")),
                       ("system.system_name", system.get("system_name")), ("system.site", system.get("site")),
                       ("energy", verdict.get("energy"))):
        if value is None:
            raise SubmissionError(f"{name}: an ACCEPTED verdict without {key}")


def _duplicate_of(verdict: dict[str, Any], seen_submission: dict[str, str], seen_run: dict[str, str],
                  seen_digest: dict[str, str]) -> str | None:
    if verdict["submission_id"] in seen_submission:
        return f"same submission as {seen_submission[verdict['submission_id']]}"
    if verdict["run_id"] in seen_run:
        return f"same run {verdict['run_id']} as {seen_run[verdict['run_id']]}"
    for digest in verdict.get("log_digests") or ():
        if digest in seen_digest:
            return f"same event log as {seen_digest[digest]} under another name"
    return None


def _rejected_record(verdict: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    system = verdict.get("system") or {}
    return {"file": verdict["file"], "submission_id": verdict.get("submission_id"), "run_id": verdict.get("run_id"),
            "system_name": system.get("system_name"), "site": system.get("site"), "reasons": reasons}


# ----------------------------------------------------------------------------------------------
# Columns: one table, the same order in the text table, the CSV and the HTML page.


def _percent(value: float) -> str:
    percent = 100 * value
    return f"{percent:.1f}%" if abs(percent) >= 0.1 or percent == 0 else f"{percent:.2g}%"


PEAK_UNDER_MEASURED, PEAK_UNDERSTATED = "peak under-measured", "peak understated"


def _efficiency(value: float, above_one: str = PEAK_UNDER_MEASURED) -> str:
    """An efficiency against a peak, as a person reads it. Above 1 it is no efficiency: the peak
    was under-measured (a declared one understated), and the cell says so beside the figure
    (issue 51; aiperf check rejects such a result, so only a verdict from elsewhere shows one).
    The CSV and the JSON keep the number."""
    return _percent(value) if not value > 1.0 else f"{_percent(value)} ({above_one})"


def _declared_efficiency(value: float) -> str:
    return _efficiency(value, PEAK_UNDERSTATED)


def _ops_per_watt(value: float) -> str:
    return f"{format_ops(value)}/W"


def _accelerators(entry: dict[str, Any]) -> str | None:
    system = entry["system"]
    if entry["accelerators"] is None:
        return None
    return f"{system['accelerator_model'] or system['accelerator_kind']} x {entry['accelerators']}"


def _backend(entry: dict[str, Any]) -> str | None:
    """'torch 2.3.1': the backend and its framework's version, the name said once."""
    backend, version = entry["backend"], entry["framework_version"]
    if not version:
        return backend
    if not backend or version.startswith(f"{backend} "):
        return version
    return f"{backend} {version}" if version[:1].isdigit() else f"{backend} ({version})"


def _hours(entry: dict[str, Any]) -> float | None:
    return None if entry["elapsed_s"] is None else entry["elapsed_s"] / 3600


def _power_level(entry: dict[str, Any]) -> str:
    energy = entry["energy"]
    if not energy["measured"]:
        return "not measured"
    return energy["level"] or "below L1"  # metered, but too little of the machine or the run for L1


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[dict[str, Any]], Any]  # the raw value (CSV, numeric sort); None where unknown
    human: Callable[[Any], str] = str  # the value as a person reads it (text table, HTML)
    numeric: bool = False
    sort: Callable[[dict[str, Any]], Any] | None = None  # the HTML sort key where not the value


COLUMNS = (
    Column("rank", lambda e: e["rank"], numeric=True),
    Column("system", lambda e: e["system"]["system_name"]),
    Column("site", lambda e: e["system"]["site"]),
    Column("country", lambda e: e["system"]["country"]),
    Column("submitter", lambda e: e["system"]["submitter"]),
    Column("nodes", lambda e: e["system"]["nodes"], numeric=True),
    Column("accelerators", _accelerators, numeric=True, sort=lambda e: e["accelerators"]),
    Column("backend", _backend),
    Column("precision", lambda e: ", ".join(e["precisions"]) or None),
    Column("score (OPS)", lambda e: e["score_ops"], format_ops, numeric=True),
    Column("declared peak (OPS)", lambda e: e["declared_peak_ops"], format_ops, numeric=True),
    Column("efficiency vs declared peak", lambda e: e["efficiency_declared"], _declared_efficiency, numeric=True),
    Column("efficiency vs measured peak", lambda e: e["efficiency_measured"], _efficiency, numeric=True),
    Column("regulated score (OPS)", lambda e: e["regulated_ops"], format_ops, numeric=True),
    Column("best accuracy", lambda e: e["best_accuracy"], _percent, numeric=True),
    Column("run length (h)", _hours, lambda h: f"{h:.2f}", numeric=True),
    # Reported, not scored (docs/scoring.md, "What the network cost"); a verdict from before it has none.
    Column("network share", lambda e: e.get("network_share"), _percent, numeric=True),
    Column("network efficiency", lambda e: e.get("network_efficiency"), _percent, numeric=True),
    Column("OPS per watt", lambda e: e["energy"]["ops_per_watt"], _ops_per_watt, numeric=True),
    Column("power level", _power_level),
    Column("date", lambda e: e["date"]),
    Column("official", lambda e: "yes" if e["official"] else "no"),
    Column("submission id", lambda e: e["submission_id"]),
    Column("workload", lambda e: e.get("workload")),
)

UNKNOWN = "-"


def _human(column: Column, entry: dict[str, Any]) -> str:
    value = column.value(entry)
    return UNKNOWN if value is None else column.human(value)


# ----------------------------------------------------------------------------------------------
# CSV


def _csv_cell(column: Column, entry: dict[str, Any]) -> str:
    value = column.value(entry)
    if value is None:
        return ""
    if column.numeric and not isinstance(value, str):
        return repr(value)
    text = str(value)
    # A spreadsheet runs a cell that starts like a formula; a submitted name is not to be run.
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def render_csv(ranking: Ranking) -> str:
    """The entries, one row each, numbers unrounded (OPS, fractions, hours); empty where unknown."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([c.header for c in COLUMNS])
    for entry in ranking.entries:
        writer.writerow([_csv_cell(c, entry) for c in COLUMNS])
    return out.getvalue()


# ----------------------------------------------------------------------------------------------
# Text


def _printable(text: str) -> str:
    """A submitted string made safe for a terminal: control characters would move the cursor."""
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def _table(headers: list[str], rows: list[list[str]], right: list[bool]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _list_name(ranking: Ranking) -> str:
    if ranking.workload is None:
        return "packages not read"
    version = RULES_VERSIONS.get(ranking.workload)
    return f"aiperf {ranking.workload} list" + (f" (rules version {version})" if version else "")


def render_lists_text(rankings: list[Ranking]) -> str:
    return "\n".join(render_text(r) for r in rankings)


def render_lists_csv(rankings: list[Ranking]) -> str:
    """Every list's entries, one after the other, each row naming its list in the `workload` column."""
    return "".join(render_csv(r) if k == 0 else render_csv(r).split("\n", 1)[1] for k, r in enumerate(rankings))


def render_text(ranking: Ranking) -> str:
    """The list as plain tables for a terminal: entries, Green list, superseded, rejected."""
    lines = [f"{_list_name(ranking)}: {len(ranking.entries)} system(s) ranked, {len(ranking.superseded)} "
             f"superseded, {len(ranking.rejected)} rejected", ""]
    if ranking.entries:
        lines += _table([c.header for c in COLUMNS],
                        [[_printable(_human(c, e)) for c in COLUMNS] for e in ranking.entries],
                        [c.numeric for c in COLUMNS])
    else:
        lines.append("no accepted submission")
    lines += ["", "Green list (OPS per watt, metered results only)"]
    if ranking.green:
        lines += _table(["green rank", "rank", "system", "site", "OPS per watt", "power level", "score (OPS)"],
                        [[str(g["green_rank"]), str(g["rank"]), _printable(g["system"]["system_name"]),
                          _printable(g["system"]["site"]), _ops_per_watt(g["energy"]["ops_per_watt"]),
                          _power_level(g), format_ops(g["score_ops"])] for g in ranking.green],
                        [True, True, False, False, True, False, True])
    else:
        lines.append("no ranked result metered its energy")
    if ranking.superseded:
        lines += ["", "Superseded (a better result of the same system is ranked)"]
        lines += _table(["system", "site", "score (OPS)", "official", "submission id", "superseded by"],
                        [[_printable(s["system"]["system_name"]), _printable(s["system"]["site"]),
                          format_ops(s["score_ops"]), "yes" if s["official"] else "no",
                          _printable(s["submission_id"]), _printable(s["superseded_by"])] for s in ranking.superseded],
                        [False, False, True, False, False, False])
    if ranking.rejected:
        lines += ["", "Rejected"]
        for r in ranking.rejected:
            named = f" ({_printable(r['submission_id'])})" if r["submission_id"] else ""
            lines.append(_printable(r["file"]) + named)
            lines += [f"  - {_printable(reason)}" for reason in r["reasons"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# HTML

# Efficiency against the declared peak: the marker colour of the plot, best band first.
EFFICIENCY_BANDS = ((0.5, "#1a7f37", ">= 50%"), (0.25, "#7cb342", "25-50%"), (0.10, "#f9a825", "10-25%"),
                    (0.0, "#d84315", "< 10%"))
UNKNOWN_COLOR = "#9e9e9e"

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 8px 10px; color: #222; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 11px; }
td, th { padding: 3px 2px 3px 3px; text-align: left; vertical-align: top; border-bottom: 1px solid #eee; }
thead th { background: #f3f3f3; border-bottom: 2px solid #ccc; font-size: 10.5px; }
table.sortable thead th { cursor: pointer; user-select: none; }
table.sortable thead th[aria-sort="ascending"]::after { content: " \\25B2"; }
table.sortable thead th[aria-sort="descending"]::after { content: " \\25BC"; }
td.num { text-align: right; white-space: nowrap; }
td.wrap { text-align: left; white-space: normal; min-width: 7em; }
td.nowrap { white-space: nowrap; }
td.id { word-break: break-all; min-width: 9em; font-size: 10.5px; }
tr.unofficial td { color: #666; }
ul.reasons { margin: 0; padding-left: 1.2em; }
.chart { display: block; margin: 0.8em 0; font-size: 11px; max-width: 100%; height: auto; }
.chart .chart-title { font-size: 13px; font-weight: 600; }
.chart .grid { stroke: #cdcdcd; }
.chart .grid.minor { stroke: #eeeeee; }
.chart .frame { fill: none; stroke: #888; }
.chart .point-label { font-size: 11px; fill: #333; }
"""

# Click a header to sort by that column; again to reverse. A numeric column sorts by each cell's
# data-sort value; an unknown value goes last either way.
_SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  var heads = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(heads, function (th, col) {
    th.addEventListener("click", function () {
      var numeric = th.getAttribute("data-type") === "num";
      var dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
      Array.prototype.forEach.call(heads, function (h) { h.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", dir === 1 ? "ascending" : "descending");
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[col];
        var v = cell.hasAttribute("data-sort") ? cell.getAttribute("data-sort") : cell.textContent.trim();
        if (numeric) { return v === "" ? null : Number(v); }
        return v === "-" ? null : v;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null || y === null) { return (x === null) - (y === null); }
        if (numeric) { return (x - y) * dir; }
        return x.localeCompare(y) * dir;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def _efficiency_color(efficiency: float | None) -> str:
    if efficiency is None:
        return UNKNOWN_COLOR
    return next(color for low, color, _ in EFFICIENCY_BANDS if efficiency >= low)


def _sortable_table(headers: list[tuple[str, bool]], rows: list[tuple[str, list[str]]], css_class: str = "") -> str:
    """headers: (text, numeric); rows: (tr class, ready-made <td> cells)."""
    numeric_attribute = ' data-type="num"'
    head = "".join(f'<th{numeric_attribute if numeric else ""}>{escape(text)}</th>' for text, numeric in headers)
    body = "".join(f'<tr class="{row_class}">{"".join(cells)}</tr>' for row_class, cells in rows)
    return (f'<div class="scroll"><table class="sortable {css_class}"><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def _td(text: str, numeric: bool = False, sort: Any = None, css: str = "", title: str | None = None) -> str:
    classes = " ".join(c for c in ("num" if numeric else "", css) if c)
    attributes = f' class="{classes}"' if classes else ""
    if numeric:
        attributes += f' data-sort="{"" if sort is None else escape(repr(sort))}"'
    if title:
        attributes += f' title="{escape(title)}"'
    return f"<td{attributes}>{escape(text)}</td>"


def _entry_cells(entry: dict[str, Any]) -> list[str]:
    cells = []
    for column in COLUMNS:
        value = column.value(entry)
        sort = column.sort(entry) if column.sort else value
        title = f"{value:.6g}" if column.human is format_ops and value is not None else None
        css = {"submission id": "id", "accelerators": "wrap", "date": "nowrap"}.get(column.header, "")
        cells.append(_td(_human(column, entry), column.numeric, sort, css, title))
    return cells


def _green_table(ranking: Ranking) -> str:
    if not ranking.green:
        return "<p>No ranked result metered its energy.</p>"
    headers = [("green rank", True), ("rank", True), ("system", False), ("site", False), ("accelerators", True),
               ("OPS per watt", True), ("energy (J)", True), ("nodes metered", True), ("run metered", True),
               ("power level", False), ("score (OPS)", True), ("official", False)]
    rows = []
    for g in ranking.green:
        energy = g["energy"]
        coverage = [_td(UNKNOWN if energy[k] is None else _percent(energy[k]), True, energy[k])
                    for k in ("node_coverage", "time_coverage")]
        rows.append(("official" if g["official"] else "unofficial", [
            _td(str(g["green_rank"]), True, g["green_rank"]), _td(str(g["rank"]), True, g["rank"]),
            _td(g["system"]["system_name"]), _td(g["system"]["site"]),
            _td(_accelerators(g) or UNKNOWN, True, g["accelerators"]),
            _td(_ops_per_watt(energy["ops_per_watt"]), True, energy["ops_per_watt"]),
            _td(UNKNOWN if energy["joules"] is None else f"{energy['joules']:.4g}", True, energy["joules"]),
            *coverage, _td(_power_level(g), title=energy.get("statement")),
            _td(format_ops(g["score_ops"]), True, g["score_ops"]), _td("yes" if g["official"] else "no")]))
    return _sortable_table(headers, rows)


def _superseded_table(ranking: Ranking) -> str:
    if not ranking.superseded:
        return "<p>None.</p>"
    headers = [("system", False), ("site", False), ("score (OPS)", True), ("regulated score (OPS)", True),
               ("official", False), ("date", False), ("submission id", False), ("superseded by", False),
               ("file", False)]
    rows = [("official" if s["official"] else "unofficial", [
        _td(s["system"]["system_name"]), _td(s["system"]["site"]),
        _td(format_ops(s["score_ops"]), True, s["score_ops"]),
        _td(UNKNOWN if s["regulated_ops"] is None else format_ops(s["regulated_ops"]), True, s["regulated_ops"]),
        _td("yes" if s["official"] else "no"), _td(s["date"] or UNKNOWN), _td(s["submission_id"], css="id"),
        _td(s["superseded_by"], css="id"), _td(s["file"])]) for s in ranking.superseded]
    return _sortable_table(headers, rows)


def _rejected_table(ranking: Ranking) -> str:
    if not ranking.rejected:
        return "<p>None.</p>"
    headers = [("file", False), ("submission id", False), ("system", False), ("site", False), ("reasons", False)]
    rows = []
    for r in ranking.rejected:
        reasons = "".join(f"<li>{escape(reason)}</li>" for reason in r["reasons"])
        rows.append(("rejected", [_td(r["file"]), _td(r["submission_id"] or UNKNOWN, css="id"),
                                  _td(r["system_name"] or UNKNOWN), _td(r["site"] or UNKNOWN),
                                  f'<td><ul class="reasons">{reasons}</ul></td>']))
    return _sortable_table(headers, rows)


# The scatter plot: score against accelerator count, both on log axes.
PLOT_W, PLOT_H = 1000, 460
PLOT_LEFT, PLOT_RIGHT, PLOT_TOP, PLOT_BOTTOM = 100, 200, 34, 46


def _decades(values: list[float]) -> tuple[float, float]:
    """log10 range covering the values with a margin, at least one decade wide."""
    low, high = math.log10(min(values)) - 0.25, math.log10(max(values)) + 0.25
    if high - low < 1.0:
        middle = (low + high) / 2
        low, high = middle - 0.5, middle + 0.5
    return low, high


def _count_text(value: float) -> str:
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def _ops_tick(value: float) -> str:
    return format_ops(value, digits=1)


LABEL_HEIGHT, LABEL_CHAR_WIDTH = 13, 6.2  # 11px text, an average character's width


def _place_labels(points: list[tuple[float, float, str]], right_edge: float) -> list[tuple]:
    """(x, y, label_x, label_y, text-anchor) for each (x, y, name): the name beside its point, on
    the left near the right edge, moved down where it would overprint a name placed before it."""
    placed: list[tuple[float, float, float]] = []  # (left, right, baseline) of each label drawn
    out = []
    for x, y, name in points:
        width = LABEL_CHAR_WIDTH * len(name)
        left_side = x + 10 + width > right_edge
        start = x - 10 - width if left_side else x + 10
        label_y = y + 4
        for other_left, other_right, other_y in sorted(placed, key=lambda p: p[2]):
            if start < other_right and start + width > other_left and abs(label_y - other_y) < LABEL_HEIGHT:
                label_y = other_y + LABEL_HEIGHT
        placed.append((start, start + width, label_y))
        out.append((x, y, x - 10 if left_side else x + 10, label_y, "end" if left_side else "start"))
    return out


def _log_ticks(lo: float, hi: float):
    """(value, is a power of ten) for 1, 2, ... 9 times each power of ten with log10 in [lo, hi]."""
    for decade in range(math.floor(lo), math.ceil(hi) + 1):
        for m in range(1, 10):
            value = m * 10.0 ** decade
            if lo <= math.log10(value) <= hi:
                yield value, m == 1


def scatter_plot(entries: list[dict[str, Any]]) -> str:
    """Inline SVG: each entry's score against its accelerator count on log-log axes, labelled with
    the system name, coloured by efficiency against the declared peak; hollow where unofficial."""
    title = "Score against accelerator count (log-log)"
    head = (f'<svg role="img" viewBox="0 0 {PLOT_W} {PLOT_H}" width="{PLOT_W}" height="{PLOT_H}" '
            f'class="chart scatter"><title>{escape(title)}</title>'
            f'<text x="{PLOT_LEFT}" y="20" class="chart-title">{escape(title)}</text>')
    points = [e for e in entries if (e["accelerators"] or 0) > 0 and e["score_ops"] > 0]
    if not points:
        return head + f'<text x="{PLOT_W / 2}" y="{PLOT_H / 2}" text-anchor="middle">no data</text></svg>'
    x_lo, x_hi = _decades([float(e["accelerators"]) for e in points])
    y_lo, y_hi = _decades([e["score_ops"] for e in points])
    plot_w = PLOT_W - PLOT_LEFT - PLOT_RIGHT
    plot_h = PLOT_H - PLOT_TOP - PLOT_BOTTOM

    def px(x: float) -> float:
        return PLOT_LEFT + (math.log10(x) - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return PLOT_TOP + plot_h - (math.log10(y) - y_lo) / (y_hi - y_lo) * plot_h

    parts = [head]
    for value, major in _log_ticks(x_lo, x_hi):
        x = px(value)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{PLOT_TOP}" y2="{PLOT_TOP + plot_h}" '
                     f'class="grid{"" if major else " minor"}"/>')
        if major:
            parts.append(f'<text x="{x:.1f}" y="{PLOT_TOP + plot_h + 16}" text-anchor="middle">'
                         f'{escape(_count_text(value))}</text>')
    for value, major in _log_ticks(y_lo, y_hi):
        y = py(value)
        parts.append(f'<line x1="{PLOT_LEFT}" x2="{PLOT_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'class="grid{"" if major else " minor"}"/>')
        if major:
            parts.append(f'<text x="{PLOT_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                         f'{escape(_ops_tick(value))}</text>')
    parts.append(f'<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{plot_w}" height="{plot_h}" class="frame"/>')
    parts.append(f'<text x="{PLOT_LEFT + plot_w / 2}" y="{PLOT_H - 8}" text-anchor="middle">'
                 f'accelerators (log scale)</text>')
    parts.append(f'<text transform="translate(16 {PLOT_TOP + plot_h / 2}) rotate(-90)" text-anchor="middle">'
                 f'score, OPS (log scale)</text>')
    labels = _place_labels([(px(float(e["accelerators"])), py(e["score_ops"]), e["system"]["system_name"])
                            for e in points], PLOT_LEFT + plot_w)
    for e, (x, y, label_x, label_y, anchor) in zip(points, labels):
        color = _efficiency_color(e["efficiency_declared"])
        fill = color if e["official"] else "#fff"
        efficiency = "unknown" if e["efficiency_declared"] is None else _declared_efficiency(e["efficiency_declared"])
        tooltip = (f"#{e['rank']} {e['system']['system_name']}: {format_ops(e['score_ops'])} on {_accelerators(e)}, "
                   f"{efficiency} of declared peak, {'official' if e['official'] else 'unofficial'}")
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="6" fill="{fill}" stroke="{color}" stroke-width="2.5">'
                     f'<title>{escape(tooltip)}</title></circle>'
                     f'<text x="{label_x:.1f}" y="{label_y:.1f}" class="point-label" '
                     f'text-anchor="{anchor}">{escape(e["system"]["system_name"])}</text>')
    legend_x = PLOT_LEFT + plot_w + 16
    parts.append(f'<text x="{legend_x}" y="{PLOT_TOP + 12}" font-weight="600">efficiency vs declared peak</text>')
    legend = [(label, color) for _, color, label in EFFICIENCY_BANDS] + [("unknown", UNKNOWN_COLOR)]
    for i, (label, color) in enumerate(legend):
        y = PLOT_TOP + 32 + 18 * i
        parts.append(f'<circle cx="{legend_x + 6}" cy="{y - 4}" r="6" fill="{color}" stroke="{color}" '
                     f'stroke-width="2.5"/><text x="{legend_x + 18}" y="{y}">{escape(label)}</text>')
    y = PLOT_TOP + 32 + 18 * len(legend) + 14
    parts.append(f'<circle cx="{legend_x + 6}" cy="{y - 4}" r="6" fill="#555" stroke="#555" stroke-width="2.5"/>'
                 f'<text x="{legend_x + 18}" y="{y}">official</text>'
                 f'<circle cx="{legend_x + 6}" cy="{y + 14}" r="6" fill="#fff" stroke="#555" stroke-width="2.5"/>'
                 f'<text x="{legend_x + 18}" y="{y + 18}">unofficial</text>')
    parts.append("</svg>")
    left_out = len(entries) - len(points)
    note = (f"<p>{left_out} ranked result(s) without an accelerator count are not plotted.</p>"
            if left_out else "")
    return "".join(parts) + note


def render_html(ranking: Ranking, title: str = "aiperf list") -> str:
    """One self-contained page: inline CSS, SVG and script; nothing fetched."""
    return render_lists_html([ranking], title)


def render_lists_html(rankings: list[Ranking], title: str = "aiperf lists") -> str:
    """One self-contained page, a section per list: inline CSS, SVG and script; nothing fetched."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
             f"<style>{_CSS}</style></head><body>", f"<h1>{escape(title)}</h1>"]
    for ranking in rankings:
        parts += _html_section(ranking, len(rankings) > 1)
    parts += [f"<script>{_SORT_SCRIPT}</script>", "</body></html>"]
    return "\n".join(parts) + "\n"


def _html_section(ranking: Ranking, named: bool) -> list[str]:
    main_rows = [("official" if e["official"] else "unofficial", _entry_cells(e)) for e in ranking.entries]
    main_table = (_sortable_table([(c.header, c.numeric) for c in COLUMNS], main_rows, "list")
                  if ranking.entries else "<p>No accepted submission.</p>")
    return [
        f"<h2>The {escape(_list_name(ranking))}</h2>" if named else "",
        f"<p>{len(ranking.entries)} system(s) ranked, {len(ranking.superseded)} result(s) superseded, "
        f"{len(ranking.rejected)} submission(s) rejected. Every figure was recomputed from the submitted "
        f"event logs by <code>aiperf check</code>. Order: official results first, then score, then "
        f"regulated score, then the smaller declared peak. Click a column header to sort.</p>",
        main_table,
        scatter_plot(ranking.entries),
        "<h2>Green list: OPS per watt</h2>",
        "<p>The ranked results that metered their energy, by analytic operations per joule. "
        "The power level says how much of the machine and of the run was metered.</p>",
        _green_table(ranking),
        "<h2>Superseded</h2>",
        "<p>Other accepted results of a ranked system (same system name and site).</p>",
        _superseded_table(ranking),
        "<h2>Rejected</h2>",
        _rejected_table(ranking),
    ]
