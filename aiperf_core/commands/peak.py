"""aiperf peak: measure each local device's dense matrix-multiply rate and write peak.json."""

from __future__ import annotations

import sys
from pathlib import Path

HELP = ("measure the dense matrix-multiply peak of every device of a backend, at every precision it declares, "
        "with the backend's own framework, and write peak.json (for aiperf submit --peak)")


def add_arguments(p) -> None:
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="backend (default: $AIPERF_BACKEND, else the config file's 'backend', else tensorflow)")
    p.add_argument("--precision", default=None, metavar="P[,P...]",
                   help="measure only these precisions, each declared on every device (default: every declared one)")
    p.add_argument("--budget", default=None, metavar="DURATION",
                   help="the time one device may take over all its precisions, e.g. 10s, 2m (default: 30s on a "
                   "CPU, 40s on an accelerator); a larger size is tried only while it fits")
    p.add_argument("--out", default="peak.json", metavar="FILE", help="where to write the peak file (default: ./peak.json)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")


def parse_precision_list(text: str | None) -> list[str] | None:
    """--precision as a list (None: every declared precision); the names are checked by measure_peak."""
    from aiperf_core.errors import AiperfError

    if text is None or text.strip() == "all":
        return None
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise AiperfError("--precision: no precision given")
    return items


def render(record: dict) -> str:
    """The peak record as a table: one row per device and precision (the spread of the repeats at
    the best size: "-" in a file written before spreads were recorded)."""
    from aiperf_core.scoring import format_ops

    header = ("device", "model", "precision", "size", "best", "spread")
    rows = [(entry["device"], entry["model"] or "unknown", precision, f"{m['size']}", format_ops(m["ops_per_s"]),
             f"{m['spread']:.1%}" if "spread" in m else "-")
            for entry in record["devices"] for precision, m in entry["precisions"].items()]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"backend {record['backend']} {record['framework_version']} on {record['host']}"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


def run(args) -> int:
    from aiperf_core.commands.options import writable_file
    from aiperf_core.config_file import load_config
    from aiperf_core.registry import load_backend, resolve_backend_name
    from aiperf_core.submission import SubmissionError
    from aiperf_core.submission.peak import measure_peak, spread_warnings, write_peak
    from aiperf_core.workflow.duration import parse_duration

    out = Path(args.out)
    if out.exists() and not args.force:  # refused before minutes of measuring, and again when written
        raise SubmissionError(f"{out}: exists (give --force to overwrite it)")
    writable_file("--out", out)
    precisions = parse_precision_list(args.precision)
    budget_s = None if args.budget is None else parse_duration(args.budget, "--budget")
    backend = load_backend(resolve_backend_name(args.backend, config=load_config(args.config)))

    def progress(line: str) -> None:
        print(f"  {line}", file=sys.stderr, flush=True)

    record = measure_peak(backend, precisions, budget_s=budget_s, progress=progress)
    write_peak(record, out, force=args.force)
    print(render(record))
    for line in spread_warnings(record):
        print(f"warning: {line}", file=sys.stderr)
    print(f"wrote {out}")
    return 0
