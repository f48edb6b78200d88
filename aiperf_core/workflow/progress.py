"""The live display of `aiperf run`: a block redrawn in place on a terminal (every ~2 s), plain
log lines when stdout is a file or a pipe (every 30 s), so that a batch job's log stays readable.

Scored figures come from aiperf_core.scoring.progress.snapshot, which reads the run directory
incrementally and uses the score's own definitions: they move only when epochs end. Live figures
(training images/s and the analytic OPS they mean) come from the replicas' heartbeats, which
carry the progress of their steps: they show a working run from its first step, and are never
part of the score. A replica that is not stepping says what it does instead (`replica_state`):
compiling, evaluating, between trials or starting.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

from aiperf_core.workflow.duration import format_duration

TTY_INTERVAL_S = 2.0
LOG_INTERVAL_S = 30.0
LIVE_INTERVAL_S = 10.0  # heartbeats are read for the live figures at most this often
LIVE_FRESH_S = 60.0  # an older heartbeat gives no live figure: its replica may be gone
QUIET_STEP_S = 60.0  # a replica whose last step is older than this says how long ago it was
# What a live replica does (replica_state): only a stepping one has a rate.
STEPPING, COMPILING, EVALUATING, BETWEEN_TRIALS, STARTING = (
    "stepping", "compiling", "evaluating", "between trials", "starting")


@dataclass(frozen=True)
class LiveReplica:
    """One training replica's live progress, from its heartbeat."""

    images_per_s: float | None  # training images per second over its current epoch so far
    ops_per_s: float | None  # images_per_s x the running trial's analytic FP+BP per image
    last_step_age_s: float | None  # seconds since its last step ended; None before the trial's first
    trial_age_s: float | None  # seconds since it entered its current trial (or state, outside a trial)
    state: str = STEPPING  # replica_state
    running: bool = True  # the ledger has a trial running on it


@dataclass(frozen=True)
class Live:
    replicas: dict[int, LiveReplica] = field(default_factory=dict)

    @property
    def images_per_s(self) -> float:
        return sum(r.images_per_s or 0.0 for r in self.replicas.values())

    @property
    def ops_per_s(self) -> float | None:
        """None until a reporting replica's running trial is counted (never a misleading 0)."""
        known = [r.ops_per_s for r in self.replicas.values() if r.ops_per_s is not None]
        return sum(known) if known else None


def replica_state(beat: dict, running: str | None) -> str:
    """What a replica does, from its heartbeat (docs/run-directory.md) and the trial the ledger has
    running on it: STARTING before its first trial; BETWEEN_TRIALS while it records one or plans
    the next (or its heartbeat has not reached the trial the ledger shows yet); COMPILING in a
    trial whose first step has not ended (lowering, tracing, compiling: the first step includes
    them); EVALUATING when its last step was a validation step (one that ended after the last
    training step, which StepClock.count marks); else STEPPING."""
    state = beat.get("state")
    if state == "starting":
        return STARTING
    if state != "training" or running is None or beat.get("trial") != running:
        return BETWEEN_TRIALS
    step = beat.get("progress") if isinstance(beat.get("progress"), dict) else {}
    last_step, last_train_step = _number(step.get("time")), _number(step.get("train_time"))
    if last_step is None:
        return COMPILING
    if last_train_step is not None and last_step > last_train_step:
        return EVALUATING
    return STEPPING


def live_figures(run_dir: Any, progress: Any) -> Live:
    """Live progress of every replica of a snapshot (a scoring.progress.Progress) that has not
    stopped, from its heartbeat (docs/run-directory.md, heartbeat.json): what it does, and while
    it steps, its images/s and the analytic OPS they mean. A replica without a fresh heartbeat is
    left out (it may be gone)."""
    figures = {}
    for replica in progress.replicas:
        if replica.stopped:
            continue
        beat = run_dir.read_heartbeat(replica.replica) or {}
        beat_time, since = _number(beat.get("time")), _number(beat.get("since"))
        if beat_time is None or progress.now - beat_time > LIVE_FRESH_S:
            continue
        state = replica_state(beat, replica.running)
        step = beat.get("progress") if isinstance(beat.get("progress"), dict) else {}
        last_step, epoch_start = _number(step.get("time")), _number(step.get("epoch_start"))
        rate = ops = None
        if state == STEPPING:
            images = _number(step.get("images")) or 0.0
            rate = images / (last_step - epoch_start) if epoch_start and last_step > epoch_start else None
            per_image = replica.running_per_image
            ops = rate * (per_image[0] + per_image[1]) if rate is not None and per_image else None
        figures[replica.replica] = LiveReplica(
            images_per_s=rate or None, ops_per_s=ops or None,
            last_step_age_s=None if last_step is None or state == BETWEEN_TRIALS else max(progress.now - last_step, 0.0),
            trial_age_s=None if since is None else max(progress.now - since, 0.0),
            state=state, running=replica.running is not None)
    return Live(figures)


def _not_stepping(live: Live) -> str:
    """What the replicas that are not stepping do: 'compiling' for one, '1 compiling, 1 evaluating'."""
    idle = [r.state for r in live.replicas.values() if r.state != STEPPING]
    if len(live.replicas) == 1:
        return ", ".join(idle)
    return ", ".join(f"{n} {state}" for state, n in sorted(Counter(idle).items()))


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _rate(images_per_s: float) -> str:
    return f"{images_per_s:,.0f}" if images_per_s >= 100 else f"{images_per_s:.1f}"


def render(progress: Any, live: Live | None = None) -> list[str]:
    """The display's lines for one snapshot (an aiperf_core.scoring.progress.Progress): summary
    lines first, then one indented line per replica."""
    from aiperf_core import workloads
    from aiperf_core.scoring import format_ops

    workload = workloads.get(progress.workload)
    best = workload.validity.brief(progress.best_error, progress.best_accuracy)
    samples = workload.data.samples
    lines = [
        f"elapsed {format_duration(progress.elapsed_s)} of {format_duration(progress.budget_s)} "
        f"({progress.fraction:.0%}), {format_duration(progress.remaining_s)} left",
        f"OPS {format_ops(progress.ops_per_s)}  regulated {format_ops(progress.regulated_ops)}  "
        f"{best}  trials done {progress.trials_done}, running {progress.trials_running}  "
        f"epochs {progress.epochs_counted}",
    ]
    bandwidth = progress.all_to_all_bytes_per_second
    if bandwidth is not None:  # an expert-parallel epoch was logged: the experts' all-to-all, not scored
        lines.append(f"all-to-all {bandwidth / 1e9:.3g} GB/s ({progress.all_to_all_bytes / 1e9:.3g} GB in "
                     f"{progress.all_to_all_seconds:.3g} s, {progress.all_to_all_trials} expert-parallel "
                     "trials), not scored")
    bus = progress.all_reduce_bytes_per_second
    if progress.all_reduce_trials:  # a data-parallel epoch was logged: the gradient all-reduce, not scored
        rate = "not timed" if bus is None else f"{bus / 1e9:.3g} GB/s"
        share, efficiency = progress.network_share, progress.network_efficiency
        network = ("" if share is None else f", {share:.1%} of step time waiting") + (
            "" if efficiency is None else f", network efficiency {efficiency:.1%}")
        lines.append(f"all-reduce {rate} ({progress.all_reduce_bytes / 1e9:.3g} GB per rank in "
                     f"{progress.all_reduce_seconds:.3g} s, {progress.all_reduce_trials} data-parallel trials)"
                     f"{network}, not scored")
    if live is not None and live.replicas:
        stepping = any(r.state == STEPPING for r in live.replicas.values())
        idle = _not_stepping(live)
        if stepping:
            ops = "- OPS" if live.ops_per_s is None else format_ops(live.ops_per_s)
            line = f"live, not scored: {_rate(live.images_per_s)} {samples}/s  {ops} analytic"
        else:  # never '0.0 images/s' for a run that compiles, evaluates or plans
            line = f"live, not scored: {idle}"
        if progress.trials_running:
            reporting = sum(r.running for r in live.replicas.values())
            line += f" ({reporting} of {progress.trials_running} training replicas reporting"
            line += f"; {idle})" if stepping and idle else ")"
        lines.append(line)
    for replica in progress.replicas:
        if replica.stopped:
            doing = "stopped"
        elif replica.running:
            doing = f"training {replica.running} (epoch {replica.running_epochs + 1}"
            now = (live.replicas.get(replica.replica) if live is not None else None)
            if now is not None and now.state == COMPILING:
                doing += f", compiling: no step yet after {format_duration(now.trial_age_s or 0.0)}"
            elif now is not None and now.state != STEPPING:
                doing += f", {now.state}"
            elif now is not None:
                if now.images_per_s is not None:
                    doing += f", {_rate(now.images_per_s)} {samples}/s"
                if now.last_step_age_s is not None and now.last_step_age_s >= QUIET_STEP_S:
                    doing += f", last step {format_duration(now.last_step_age_s)} ago"
            doing += ")"
        else:
            doing = "planning"
        lines.append(f"  replica {replica.replica} on {replica.host or '?'}: attempt {replica.attempts}, "
                     f"{replica.trials_done} trials done, {doing}")
    return lines


class LiveDisplay:
    """Renders snapshots to `stream`; notes (launches, exits) are printed above the block."""

    def __init__(self, run_dir, stream: IO[str] | None = None, interactive: bool | None = None):
        self.run_dir = run_dir
        self.stream = stream or sys.stdout
        self.interactive = self.stream.isatty() if interactive is None else interactive
        self.interval = TTY_INTERVAL_S if self.interactive else LOG_INTERVAL_S
        self._drawn = 0  # lines of the block on screen
        self._last = float("-inf")
        self._live: Live | None = None
        self._live_read = float("-inf")  # monotonic time the heartbeats were last read

    def note(self, text: str) -> None:
        self._erase()
        self.stream.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.stream.flush()

    def tick(self, now: float, force: bool = False) -> None:
        if not force and time.monotonic() - self._last < self.interval:
            return
        self._last = time.monotonic()
        lines = self._lines(now)
        if not lines:
            return
        if self.interactive:
            self._erase()
            self.stream.write("".join(line + "\n" for line in lines))
            self._drawn = len(lines)
        else:
            summary = [line for line in lines if not line.startswith(" ")]
            self.stream.write(f"{time.strftime('%H:%M:%S')} " + " | ".join(summary) + "\n")
        self.stream.flush()

    def close(self) -> None:
        try:
            from aiperf_core.scoring.progress import forget
        except ImportError:
            return
        forget(self.run_dir)

    def _lines(self, now: float) -> list[str]:
        try:
            from aiperf_core.rundir import RunDir
            from aiperf_core.scoring.progress import snapshot

            progress = snapshot(self.run_dir, now)
            if time.monotonic() - self._live_read >= LIVE_INTERVAL_S:
                self._live, self._live_read = live_figures(RunDir(self.run_dir), progress), time.monotonic()
            return render(progress, self._live)
        except Exception as exc:  # the display must never stop the run
            return [f"(progress unavailable: {type(exc).__name__}: {exc})"]

    def _erase(self) -> None:
        if self.interactive and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")  # up to the block's first line, clear below
            self._drawn = 0


class CheckpointWriter:
    """The primary's side of primary/progress.json (aiperf_core.scoring.progress.write_checkpoint):
    written every CHECKPOINT_INTERVAL_S from the live display's ledger, and once at the end, so that
    a later `aiperf metrics` or `aiperf watch` starts from it instead of reading every log. A failed
    write is said once and never stops the run: the file only saves readers time."""

    def __init__(self, run_dir, notify=None):
        self.run_dir = run_dir
        self.notify = notify or (lambda text: None)
        self._last = time.monotonic()  # the first one a full interval in: a new run has little to save
        self._failed = False

    def tick(self, now: float) -> None:
        from aiperf_core.scoring.progress import CHECKPOINT_INTERVAL_S

        if time.monotonic() - self._last >= CHECKPOINT_INTERVAL_S:
            self.write(now)

    def write(self, now: float | None = None) -> None:
        from aiperf_core.scoring.progress import write_checkpoint

        self._last = time.monotonic()
        try:
            write_checkpoint(self.run_dir, now)
        except Exception as exc:  # noqa: BLE001 - monitoring's file must never stop the run
            if not self._failed:
                self._failed = True
                self.notify(f"primary/progress.json not written ({type(exc).__name__}: {exc}); monitoring "
                            "reads the logs whole instead")
