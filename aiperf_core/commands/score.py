"""aiperf score RUN_DIR: the score, recomputed from the event logs and trial graphs alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from aiperf_core.atomic import write_text_atomic

HELP = "score a run directory from its event logs and trial graphs; --verify checks their recorded hashes"

EXIT_TAMPERED = 1  # --verify found a changed or missing file; usage errors keep cli.EXIT_USAGE


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verify", action="store_true",
                   help="check the event-log hash chains and the hashes of every trial file; exit 1 on a problem")


def run(args) -> int:
    result, out, problems = score_and_record(args.run_dir, args.verify)
    print(json.dumps(out) if args.json else render(result, problems))
    return EXIT_TAMPERED if problems else 0


def score_and_record(run_dir, verify: bool = False):
    """(ScoreResult, its JSON form, --verify's problems or None); score.json written when it can be."""
    from aiperf_core.scoring import score_run, verify_run

    result = score_run(run_dir)
    out = result.to_dict()
    problems = None
    if verify:
        problems = verify_run(run_dir)
        out["verify"] = {"intact": not problems, "problems": problems}
    try:
        write_text_atomic(Path(run_dir) / "score.json", json.dumps(out, indent=1) + "\n")
    except OSError as exc:  # a read-only copy of someone else's run can still be scored
        print(f"aiperf: warning: score.json not written: {exc}", file=sys.stderr)
    return result, out, problems


def render(result, problems: list[str] | None = None) -> str:
    from aiperf_core.scoring import format_ops

    from aiperf_core import workloads

    accuracy = workloads.get(result.workload).validity.best(result.best_error, result.best_accuracy)
    statuses = ", ".join(f"{status} {n}" for status, n in result.trials_by_status.items())
    lines = [f"FAILED: the run produced nothing: {result.failure.describe()}"] if result.failure else []
    lines += [
        f"score      {format_ops(result.score_ops)}  ({result.score_ops:.6g} OPS)",
        f"regulated  {format_ops(result.regulated_ops)}  ({result.regulated_ops:.6g} OPS)",
        f"{accuracy}",
        f"{result.epochs_counted} epochs counted ({result.total_ops:.4g} operations) over "
        f"{result.elapsed_s / 3600:.2f} h; {result.epochs_after_deadline} finished after the deadline",
        f"{result.trials} trials ({statuses or 'none'})",
    ]
    if result.valid:
        lines.append("official: every rule of the benchmark is met")
    else:
        lines.append("unofficial:")
        lines += [f"  - {reason}" for reason in result.reasons]
    lines += [f"note: {note}" for note in result.notes]
    if problems is not None:
        lines.append("verify: intact" if not problems else f"verify: {len(problems)} problem(s)")
        lines += [f"  - {problem}" for problem in problems]
    return "\n".join(lines)
