"""Replica busy fraction over a multi-trial local run (goal >= 0.95), and the idle gap between trials.

    python benchmarks/replica_busy.py [--workload cnn|lm]

A short local run (cnn: digits 32x32, resnet_small; lm: the embedded corpus, gpt_small, epochs of
16,384 tokens; the torch backend if installed, else numpy; 3 epochs per trial, 8 trials) is
measured from its event log alone. Each epoch_end carries step_seconds,
the time the backend spent in train and eval steps (aiperf_core.backend.StepClock: from a batch's
transfer to the device to its results, never the host's reading, decoding or indexing of batches).

- Busy fraction, steady state: the step seconds of the epochs from trial 3 on, over the wall time
  from trial 2's last epoch_end to the last epoch_end. The first two trials are left out because
  round 2 of a lone replica is planned only after round 1 ends (docs/search.md).
- Busy fraction, whole replica: all step seconds over replica_start .. replica_stop, which also
  holds the one-off start (framework import, dataset load, first plan): seconds that a 12-hour run
  spends once. Reported without a goal.
- Idle gap between trials t and t+1: from t's last epoch_end to the `started` of t+1's first epoch
  (when the replica handed the next model to backend.train).
- Data wait within epochs (goal <= 0.05): each epoch's wall time (`started` to its epoch_end) less
  its step seconds, over the epochs' wall time: what the steps waited for batches, and the
  per-epoch bookkeeping.
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


def epochs_by_trial(events) -> dict[str, list[dict]]:
    by_trial: dict[str, list[dict]] = {}
    for e in events:
        if e["event"] == "epoch_end":
            by_trial.setdefault(e["trial"], []).append(e)
    return by_trial


def idle_gaps(by_trial: dict[str, list[dict]]) -> list[float]:
    trials = sorted(by_trial)
    return [by_trial[b][0]["started"] - by_trial[a][-1]["time"] for a, b in zip(trials, trials[1:])]


def step_seconds(epochs: list[dict]) -> float:
    missing = [e for e in epochs if e.get("step_seconds") is None]
    if missing:
        raise SystemExit(f"trial {missing[0]['trial']} epoch {missing[0]['epoch']}: no step_seconds in its epoch_end")
    return sum(e["step_seconds"] for e in epochs)


POLICIES = {
    "cnn": {"dataset": "digits", "initial_architecture": "resnet_small", "batch_size": 64,
            "warmup_epochs": [3, 3, 3], "max_epochs": 3, "nas_candidates": 8},
    "lm": {"workload": "lm", "dataset": "embedded", "initial_architecture": "gpt_small", "epoch_tokens": 16384,
           "val_tokens": 16384, "warmup_epochs": [3, 3, 3], "max_epochs": 3, "nas_candidates": 8},
}

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(POLICIES), default="cnn")
    workload = parser.parse_args().workload
    try:
        load_backend("torch")
        backend = "torch"
    except BackendError:
        backend = "numpy"
    policy = POLICIES[workload]
    with tempfile.TemporaryDirectory() as folder:
        write_run_json(folder, backend=backend, policy=policy, stop_after_trials=TRIALS, seed=1)
        t = time.time()
        run_replica(folder, 0)
        wall = time.time() - t
        events = read_events(RunDir(folder).replica_log(0))
    by_trial = epochs_by_trial(events)
    trials = sorted(by_trial)
    if len(trials) <= SKIP + 1:
        raise SystemExit(f"only {len(trials)} trials ran: too few for a steady state")
    gaps = idle_gaps(by_trial)
    steady_epochs = [e for trial in trials[SKIP:] for e in by_trial[trial]]
    steady_wall = by_trial[trials[-1]][-1]["time"] - by_trial[trials[SKIP - 1]][-1]["time"]
    life = {e["event"]: e["time"] for e in events if e["event"] in ("replica_start", "replica_stop")}
    all_epochs = [e for trial in trials for e in by_trial[trial]]
    print(f"{workload}, {backend}: {len(trials)} trials, {len(all_epochs)} epochs in {wall:.1f} s; "
          f"idle gaps (s): {', '.join(f'{g:.3f}' for g in gaps)}")
    print(f"steady state: {step_seconds(steady_epochs):.1f} s in steps of {steady_wall:.1f} s wall; "
          f"whole replica: {step_seconds(all_epochs):.1f} s of {life['replica_stop'] - life['replica_start']:.1f} s")
    report("replica busy fraction (steady state)", step_seconds(steady_epochs) / steady_wall, "fraction",
           goal=0.95, lower_is_better=False)
    report("replica busy fraction (whole replica, one-off start)",
           step_seconds(all_epochs) / (life["replica_stop"] - life["replica_start"]), "fraction", None,
           lower_is_better=False)
    steady_gaps = gaps[SKIP - 1:]
    report("replica: mean idle gap between trials (steady state)", sum(steady_gaps) / len(steady_gaps), "s")
    report("replica: idle fraction between trials (steady state)", sum(steady_gaps) / steady_wall, "fraction",
           goal=0.02)
    epoch_wall = sum(e["time"] - e["started"] for e in all_epochs)
    report("replica: data wait within epochs", (epoch_wall - step_seconds(all_epochs)) / epoch_wall, "fraction",
           goal=0.05)
