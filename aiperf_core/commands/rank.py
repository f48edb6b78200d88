"""aiperf rank SUBMISSION...: check every submission and rank the accepted ones (docs/submission.md, "The list")."""

from __future__ import annotations

import json
import sys
from typing import Any, Callable

from aiperf_core.atomic import write_text_atomic
from aiperf_core.errors import AiperfError

HELP = "check submission packages and rank the accepted ones: a text table, --json, --html and --csv lists"

EXIT_NONE_RANKED = 1  # every submission was rejected; bad input keeps cli.EXIT_USAGE


def add_arguments(p) -> None:
    p.add_argument("submissions", metavar="SUBMISSION", nargs="+", help="submission packages (NAME.tar.gz)")
    p.add_argument("--html", metavar="PATH", help="write the list as one self-contained HTML page")
    p.add_argument("--csv", metavar="PATH", help="write the ranked entries as CSV")
    p.add_argument("--json", action="store_true", help="print the list as one JSON object instead of tables")


def run(args) -> int:
    from aiperf_core.commands.options import writable_file
    from aiperf_core.submission.ranking import (lists_to_dict, render_lists_csv, render_lists_html,
                                                render_lists_text)

    for option, path in (("--html", args.html), ("--csv", args.csv)):  # before minutes of checking packages
        if path is not None:
            writable_file(option, path)
    rankings = rank_paths(args.submissions)
    for path, render in ((args.html, render_lists_html), (args.csv, render_lists_csv)):
        if path is None:
            continue
        try:
            write_text_atomic(path, render(rankings))
        except OSError as exc:
            raise AiperfError(f"{path}: cannot write: {exc.strerror or exc}") from exc
    sys.stdout.write(json.dumps(lists_to_dict(rankings), indent=1) + "\n" if args.json
                     else render_lists_text(rankings))
    for path in (args.html, args.csv):
        if path is not None:
            print(f"wrote {path}", file=sys.stderr)
    return 0 if any(r.entries for r in rankings) else EXIT_NONE_RANKED


def rank_paths(paths: list[str], check: Callable[[str], Any] | None = None):
    """Check each package (progress on stderr) and rank the verdicts, one list per workload. A
    package the check refuses with a SubmissionError is rejected with that one line; the others
    are still ranked."""
    from aiperf_core.submission import SubmissionError
    from aiperf_core.submission.ranking import rank_lists

    if check is None:
        from aiperf_core.submission.check import check_submission as check
    verdicts = []
    for n, path in enumerate(paths, start=1):
        print(f"checking {n}/{len(paths)} {path} ... ", end="", file=sys.stderr, flush=True)
        try:
            verdict = check(path).to_dict()
        except SubmissionError as exc:
            verdict = refused_verdict(str(path), str(exc))
        label = verdict["verdict"]
        if label == "ACCEPTED":
            label += " official" if verdict["official"] else " unofficial"
        print(label, file=sys.stderr, flush=True)
        verdicts.append(verdict)
    return rank_lists(verdicts)


def refused_verdict(path: str, reason: str) -> dict[str, Any]:
    """The verdict of a package the check could not read: REJECTED, nothing known of it."""
    return {"file": path, "submission_id": None, "workload": None, "verdict": "REJECTED", "official": False, "reasons": [reason],
            "findings": [], "run_id": None, "log_digests": [], "system": None, "accelerators": None,
            "backend": None, "framework_version": None, "precisions": [], "score_ops": None, "regulated_ops": None,
            "best_accuracy": None, "elapsed_s": None, "start_time": None, "date": None, "declared_peak_ops": None,
            "measured_peak_ops": None, "efficiency_declared": None, "efficiency_measured": None,
            "network_share": None, "network_efficiency": None,
            "energy": {"measured": False, "joules": None, "ops_per_watt": None, "node_coverage": None,
                       "time_coverage": None, "level": None, "statement": "not measured"}}
