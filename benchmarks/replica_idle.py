"""Accelerator idle time between consecutive trials of one replica at steady state (goal <= 2%).

A short local run (digits 32x32, resnet_small, the torch backend if installed, else numpy; 3 epochs
per trial) is measured from its event log alone: the idle gap between trials t and t+1 runs from
t's last epoch_end to the `started` of t+1's first epoch (when the replica handed the next model
to backend.train). Steady state leaves out the first two trials: round 2 of a lone replica is
planned only after round 1 ends (docs/search.md). The fraction is the gaps' sum over the wall
time from the first to the last counted epoch.
"""

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import report  # noqa: E402
from aiperf_core.backend import BackendError  # noqa: E402
from aiperf_core.registry import load_backend  # noqa: E402
from aiperf_core.replica import run_replica, write_run_json  # noqa: E402
from aiperf_core.rundir import RunDir, read_events  # noqa: E402

TRIALS = 8
SKIP = 2  # trials before steady state


def idle_gaps(events):
    by_trial: dict[str, list[dict]] = {}
    for e in events:
        if e["event"] == "epoch_end":
            by_trial.setdefault(e["trial"], []).append(e)
    trials = sorted(by_trial)
    gaps = [(by_trial[b][0]["started"] - by_trial[a][-1]["time"]) for a, b in zip(trials, trials[1:])]
    return trials, by_trial, gaps


if __name__ == "__main__":
    try:
        load_backend("torch")
        backend = "torch"
    except BackendError:
        backend = "numpy"
    policy = {"dataset": "digits", "initial_architecture": "resnet_small", "batch_size": 64,
              "warmup_epochs": [3, 3, 3], "max_epochs": 3, "nas_candidates": 8}
    with tempfile.TemporaryDirectory() as folder:
        write_run_json(folder, backend=backend, policy=policy, stop_after_trials=TRIALS, seed=1)
        t = time.time()
        run_replica(folder, 0)
        wall = time.time() - t
        trials, epochs, gaps = idle_gaps(read_events(RunDir(folder).replica_log(0)))
    steady = gaps[SKIP - 1:]
    first, last = trials[SKIP - 1], trials[-1]
    span = epochs[last][-1]["time"] - epochs[first][-1]["time"]
    print(f"{backend}: {len(trials)} trials in {wall:.1f} s; gaps (s): {', '.join(f'{g:.3f}' for g in gaps)}")
    report("replica: mean idle gap between trials (steady state)", sum(steady) / len(steady), "s")
    report("replica: idle fraction of wall time (steady state)", sum(steady) / span, "fraction", goal=0.02)
