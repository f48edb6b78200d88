"""The live display of `aiperf run`: a block redrawn in place on a terminal (every ~2 s), plain
log lines when stdout is a file or a pipe (every 30 s), so that a batch job's log stays readable.

Figures come from aiperf_core.scoring.progress.snapshot, which reads the run directory
incrementally and uses the score's own definitions.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from aiperf_core.workflow.duration import format_duration

TTY_INTERVAL_S = 2.0
LOG_INTERVAL_S = 30.0


def render(progress: Any) -> list[str]:
    """The display's lines for one snapshot (an aiperf_core.scoring.progress.Progress)."""
    from aiperf_core.scoring import format_ops

    accuracy = "-" if progress.best_accuracy is None else f"{progress.best_accuracy:.2%}"
    lines = [
        f"elapsed {format_duration(progress.elapsed_s)} of {format_duration(progress.budget_s)} "
        f"({progress.fraction:.0%}), {format_duration(progress.remaining_s)} left",
        f"OPS {format_ops(progress.ops_per_s)}  regulated {format_ops(progress.regulated_ops)}  "
        f"best accuracy {accuracy}  trials done {progress.trials_done}, running {progress.trials_running}  "
        f"epochs {progress.epochs_counted}",
    ]
    for replica in progress.replicas:
        if replica.stopped:
            doing = "stopped"
        elif replica.running:
            doing = f"training {replica.running} (epoch {replica.running_epochs + 1})"
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
            self.stream.write(f"{time.strftime('%H:%M:%S')} " + " | ".join(line.strip() for line in lines[:2]) + "\n")
        self.stream.flush()

    def close(self) -> None:
        try:
            from aiperf_core.scoring.progress import forget
        except ImportError:
            return
        forget(self.run_dir)

    def _lines(self, now: float) -> list[str]:
        try:
            from aiperf_core.scoring.progress import snapshot

            return render(snapshot(self.run_dir, now))
        except Exception as exc:  # the display must never stop the run
            return [f"(progress unavailable: {type(exc).__name__}: {exc})"]

    def _erase(self) -> None:
        if self.interactive and self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F\x1b[J")  # up to the block's first line, clear below
            self._drawn = 0
