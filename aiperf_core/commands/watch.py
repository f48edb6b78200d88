"""aiperf watch RUN_DIR: the live display of `aiperf run` for any run directory, from any terminal,
read-only, until the run ends or Ctrl-C (docs/monitoring.md)."""

from __future__ import annotations

import sys
import time

HELP = "follow a run directory: the live display of aiperf run, read-only, until the run ends"
POLL_S = 0.5  # how often the run's end is looked for; the display redraws at its own interval


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (going or ended)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")


def run(args) -> int:
    from aiperf_core.monitoring.exporter.collector import open_run
    from aiperf_core.rundir import RunDir
    from aiperf_core.scoring.progress import forget, snapshot
    from aiperf_core.workflow.progress import LiveDisplay, live_figures, render

    root = open_run(args.run_dir)
    if args.once:
        progress = snapshot(root, _clock(root))
        print("\n".join(render(progress, live_figures(RunDir(root), progress))), flush=True)
        forget(root)
        return 0
    display = LiveDisplay(root, sys.stdout)
    try:
        while True:
            if snapshot(root).ended:
                display.tick(_clock(root), force=True)
                return 0
            display.tick(time.time())
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        return 0
    finally:
        display.close()


def _clock(root) -> float:
    """Now, or the run's end once it ended: the block of an ended run shows it as it ended, not
    its time since."""
    from aiperf_core.rundir import RunDir, read_events

    ends = [e["time"] for e in read_events(RunDir(root).primary_log) if e.get("event") == "run_end"]
    return min(time.time(), ends[-1]) if ends else time.time()
