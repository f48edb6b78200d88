"""aiperf report RUN_DIR: report.html (plots, self-contained) and summary.json in the run directory."""

from __future__ import annotations

import json

HELP = "write report.html (score, error, trial timeline and utilisation plots) and summary.json for a run"


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")


def run(args) -> int:
    from aiperf_core.commands.options import writable_folder, writing
    from aiperf_core.report import REPORT_FILES, write_report

    writable_folder(None, args.run_dir, REPORT_FILES)  # before the logs are read and the score recomputed
    with writing(args.run_dir):
        html_path, summary_path = write_report(args.run_dir)
    summary = json.loads(summary_path.read_text())
    label = "official" if summary["valid"] else "unofficial"
    if summary["failure"] is not None:
        print(f"FAILED: the run produced nothing: {summary['failure']['message']}")
    print(f"score {summary['score']}, regulated {summary['regulated']} ({label})")
    print(f"wrote {html_path}")
    print(f"wrote {summary_path}")
    return 0
