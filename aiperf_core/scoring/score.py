"""The score (paper section 4.4): analytic operations per second, sampled every 0.1 h.

    OPS(t) = sum of ops(e) over epochs e finished by t (and by the deadline) / (t - start_time)
    ops(e) = train_images(e) * (FP + BP) + val_images(e) * FP

FP and BP are the per-image counts of the epoch's trial graph (opcount, paper convention). OPS(t)
is sampled at start + 0.1 h, start + 0.2 h, ... and at the end of the run; the last sample is the
score. The regulated score is -ln(error) * OPS(t), with the best validation error reached by t.
Everything is recomputed from the event logs and the trial graphs: nothing a backend reports
about operations is used.

A run *produced nothing* (`ScoreResult.failure`) when no trial succeeded (ended ok or
early_stopped), no trial still open at the end had finished an epoch, and something failed: a
trial ended failed, or a replica attempt crashed or was lost. `aiperf run` then exits non-zero,
and the failure names the first cause.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import time as _time
from dataclasses import dataclass, field
from typing import Any

from aiperf_core.rundir import RunDir
from aiperf_core.gcpause import gc_paused
from aiperf_core.scoring.ledger import RunLedger, Trial
from aiperf_core.scoring.rules import validity_reasons
from aiperf_core.scoring.units import format_ops

SAMPLE_INTERVAL_S = 360.0  # 0.1 h, the paper's step
SUCCEEDED = ("ok", "early_stopped")


CURVE_POINTS = 1000


@dataclass(frozen=True)
class RunFailure:
    """Why a run produced nothing: what failed, and the first failure in time."""

    failed_trials: int
    failed_attempts: int  # replica attempts that crashed or were lost
    first_where: str  # "trial r0000-t00000" or "replica 0, attempt 1"
    first_cause: str  # one line
    first_time: float

    def describe(self) -> str:
        return (f"no trial succeeded ({self.failed_trials} failed trial(s), {self.failed_attempts} failed replica "
                f"attempt(s)); first failure, {self.first_where}: {self.first_cause}")

    def to_dict(self) -> dict[str, Any]:
        return {"message": self.describe(), "failed_trials": self.failed_trials,
                "failed_attempts": self.failed_attempts, "first_where": self.first_where,
                "first_cause": self.first_cause, "first_time": self.first_time}


@dataclass
class ScoreResult:
    run_id: str | None
    start_time: float
    deadline: float
    end_time: float  # the last sample's time: the deadline, the run's end, or `now`
    ended: bool  # the primary logged run_end
    score_ops: float  # OPS at end_time: the score
    regulated_ops: float  # -ln(best error) * score_ops
    best_accuracy: float | None
    best_error: float | None
    samples: list[tuple[float, float, float, float | None]]  # (t - start, OPS, regulated, best error)
    total_ops: int  # operations of the counted epochs
    epochs_counted: int
    epochs_after_deadline: int  # finished after the deadline: not counted
    epochs_uncountable: int  # their trial's graph is missing or changed: not counted
    trials: int
    trials_by_status: dict[str, int]
    valid: bool
    reasons: list[str]  # why the run is unofficial; empty when valid
    notes: list[str] = field(default_factory=list)  # log oddities that do not change the score
    # OPS(t) at each counted epoch's end, thinned to at most CURVE_POINTS: the report's fine curve
    # between the 0.1 h samples. Same tuples as `samples`; it never changes the score.
    curve: list[tuple[float, float, float, float | None]] = field(default_factory=list)
    failure: RunFailure | None = None  # the run produced nothing (see the module's docstring)
    workload: str = "cnn"  # what the error measures (aiperf_core.workloads)

    @property
    def elapsed_s(self) -> float:
        return self.end_time - self.start_time

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "workload": self.workload,
            "score_ops": self.score_ops,
            "score": format_ops(self.score_ops),
            "regulated_ops": self.regulated_ops,
            "regulated": format_ops(self.regulated_ops),
            "best_accuracy": self.best_accuracy,
            "best_error": self.best_error,
            "valid": self.valid,
            "label": "official" if self.valid else "unofficial",
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "start_time": self.start_time,
            "deadline": self.deadline,
            "end_time": self.end_time,
            "elapsed_s": self.elapsed_s,
            "ended": self.ended,
            "total_ops": self.total_ops,
            "epochs_counted": self.epochs_counted,
            "epochs_after_deadline": self.epochs_after_deadline,
            "epochs_uncountable": self.epochs_uncountable,
            "trials": self.trials,
            "trials_by_status": dict(self.trials_by_status),
            "sample_interval_s": SAMPLE_INTERVAL_S,
            "samples": [list(s) for s in self.samples],
            "failure": None if self.failure is None else self.failure.to_dict(),
        }


def epoch_ops(per_image: tuple[int, int], train_images: int, val_images: int) -> int:
    """Training FP+BP over the training images plus validation FP over the validation images."""
    fp, bp = per_image
    return train_images * (fp + bp) + val_images * fp


def regulated(ops_per_s: float, error: float | None) -> float:
    """-ln(error) * OPS; before any validation result the error is taken as 1, so this is 0 (never
    -0.0: an error of exactly 1, a model that knows nothing, prints as 0)."""
    return 0.0 if error is None or error >= 1.0 else -math.log(error) * ops_per_s


def end_of_scoring(ledger: RunLedger, now: float | None) -> float:
    """The deadline, or earlier: the run's end, or `now` for a run still going."""
    end = ledger.info.deadline
    if ledger.run_end is not None:
        end = min(end, ledger.run_end["time"])
    return min(end, _time.time() if now is None else now)


def sample_times(start: float, end: float) -> list[float]:
    """start + 0.1 h, start + 0.2 h, ... strictly before `end`, then `end` itself."""
    if end <= start:
        return []
    steps = int((end - start) // SAMPLE_INTERVAL_S)
    times = [start + k * SAMPLE_INTERVAL_S for k in range(1, steps + 1)]
    if not times or times[-1] < end:
        times.append(end)
    return times


def score_run(run_dir: str | os.PathLike | RunDir, now: float | None = None) -> ScoreResult:
    """Score a run directory from its event logs and trial graphs alone."""
    ledger = RunLedger(run_dir)
    ledger.refresh()
    with gc_paused():
        return score_ledger(ledger, now)


def score_ledger(ledger: RunLedger, now: float | None = None) -> ScoreResult:
    info = ledger.info
    end = end_of_scoring(ledger, now)

    counted: list[tuple[float, int, float | None, float | None]] = []  # (time, ops, error, accuracy)
    after_deadline = uncountable = 0
    deadline = info.deadline
    for time, trial, train_images, val_images, accuracy, error in ledger.epochs:
        if time > end:
            if time > deadline:
                after_deadline += 1
            continue  # else finished after `now` (a writer's clock ahead of ours): not yet
        if trial.per_image is None:
            uncountable += 1
            continue
        counted.append((time, epoch_ops(trial.per_image, train_images, val_images), error, accuracy))
    counted.sort(key=lambda e: e[0])

    # Running totals in time order: cumulative ops and the best error so far.
    times, cumulative_ops, best_errors = [], [], []
    total, best, best_accuracy = 0, None, None
    for time, ops, error, accuracy in counted:
        total += ops
        if error is not None and (best is None or error < best):
            best, best_accuracy = error, accuracy
        times.append(time)
        cumulative_ops.append(total)
        best_errors.append(best)

    samples = []
    for t in sample_times(info.start_time, end):
        k = bisect.bisect_right(times, t)  # epochs finished by t
        ops_by_t = cumulative_ops[k - 1] if k else 0
        error_by_t = best_errors[k - 1] if k else None
        ops_per_s = ops_by_t / (t - info.start_time)
        samples.append((t - info.start_time, ops_per_s, regulated(ops_per_s, error_by_t), error_by_t))
    step = max(1, -(-len(times) // CURVE_POINTS))
    curve = [(t - info.start_time, cumulative_ops[k] / (t - info.start_time),
              regulated(cumulative_ops[k] / (t - info.start_time), best_errors[k]), best_errors[k])
             for k, t in enumerate(times) if (k % step == 0 or k == len(times) - 1) and t > info.start_time]
    score = samples[-1][1] if samples else 0.0
    regulated_score = samples[-1][2] if samples else 0.0

    trials = list(ledger.trials.values())
    _fill_precision_from_trial_files(ledger, trials)
    reasons = validity_reasons(info.run, trials, best, ledger.replicas)
    reasons += ledger.damaged_logs()
    for trial in ledger.unresolved_trials():
        reasons.append(f"{trial.problem}: {trial.epochs} epoch(s) of {trial.id} not counted")
    if ledger.run_end is None and end < info.deadline:
        reasons.append(f"the run has not ended: scored {end - info.start_time:.0f} s into its "
                       f"{info.budget_s:.0f} s budget")
    elif ledger.run_end is None:
        reasons.append("the primary logged no run_end: the run did not finish cleanly, and nothing pins "
                       "the end of the replica logs")
    elif ledger.run_end.get("reason") in ("interrupted", "all_replicas_failed"):
        reasons.append(f"the run ended before its deadline with run_end reason '{ledger.run_end['reason']}'")

    by_status: dict[str, int] = {}
    for trial in trials:
        status = trial.status or "running"
        by_status[status] = by_status.get(status, 0) + 1
    return ScoreResult(
        run_id=info.run.get("run_id"), start_time=info.start_time, deadline=info.deadline, end_time=end,
        ended=ledger.run_end is not None, score_ops=score, regulated_ops=regulated_score,
        best_accuracy=best_accuracy, best_error=best, samples=samples, total_ops=total,
        epochs_counted=len(counted), epochs_after_deadline=after_deadline, epochs_uncountable=uncountable,
        trials=len(trials), trials_by_status=dict(sorted(by_status.items())), valid=not reasons,
        reasons=reasons, notes=list(ledger.problems), curve=curve, failure=run_failure(ledger, trials),
        workload=ledger.workload)


def run_failure(ledger: RunLedger, trials: list[Trial]) -> RunFailure | None:
    """Why the run produced nothing, or None when it produced something or nothing failed (a
    budget that ended before the first epoch is not a failure)."""
    if any(t.status in SUCCEEDED or (t.status is None and t.epochs) for t in trials):
        return None
    failures = [(t.ended, f"trial {t.id}", str(t.reason or "no reason recorded")) for t in trials
                if t.status == "failed" and t.ended is not None]
    attempts = 0
    for event in ledger.primary_events:
        if event.get("event") == "replica_exit" and event.get("status") in ("crashed", "lost"):
            attempts += 1
            cause = str(event.get("reason"))
            logged = event.get("log_tail")
            tail = [str(line).strip() for line in logged if str(line).strip()] if isinstance(logged, list) else []
            if tail:  # the replica's last words: the exception, or aiperf's one-line error
                cause += f"; its log ends: {tail[-1]}"
            failures.append((event["time"], f"replica {event.get('replica')}, attempt {event.get('attempt')}", cause))
    if not failures:
        return None
    when, where, cause = min(failures, key=lambda f: f[0])
    return RunFailure(sum(t.status == "failed" for t in trials), attempts, where, cause, when)


def _fill_precision_from_trial_files(ledger: RunLedger, trials: list[Trial]) -> None:
    """A trial_start without hyper.precision: its trial.json (written at trial_end) may hold it."""
    for trial in trials:
        if trial.precision is not None:
            continue
        try:
            record = json.loads((ledger.run_dir.trial_dir(trial.id) / "trial.json").read_text())
            trial.precision = record["hyper"]["precision"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
