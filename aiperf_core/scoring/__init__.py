"""Scoring a run: analytic OPS over time, the regulated score, the rules, hash verification.

Public API (aiperf_core.report and the workflow call these):
    score_run(run_dir, now=None) -> ScoreResult
    verify_run(run_dir) -> list[str]          one line per problem; empty when intact
    format_ops(value) -> str                  "12.3 Tera-OPS"
    snapshot(run_dir, now=None) -> Progress   live progress, cheap to call every few seconds
The definitions are in docs/scoring.md.
"""

from aiperf_core.scoring.progress import Progress, ReplicaProgress, snapshot
from aiperf_core.scoring.score import SAMPLE_INTERVAL_S, ScoreResult, score_run
from aiperf_core.scoring.units import format_ops
from aiperf_core.scoring.verify import verify_run

__all__ = ["SAMPLE_INTERVAL_S", "Progress", "ReplicaProgress", "ScoreResult", "format_ops", "score_run",
           "snapshot", "verify_run"]
