"""A test backend whose steps only take time: the NumPy reference backend for everything but
training, whose epochs are `steps` sleeps of `step_s` seconds, each timed by a StepClock and
counted with StepClock.count(), as a real backend's steps are. Its behaviour comes from the
environment variable BEHAVIOUR (JSON), so that replica processes started by a real primary get it:

    {"step_s": 0.2, "steps": 5,
     "hang": {"trial": 2, "epoch": 1, "step": 1, "marker": "/tmp/x/hung"},
     "gate": {"trial": 2, "file": "/tmp/x/go"}}

`hang`: the step given (of the process's trial number `trial`, 1-based) never ends, once per
marker file: the first process to get there creates the marker and hangs, later ones go on.
`gate`: the process's trial number `trial` waits before its first step until the file exists, so
that a test holds a run in training while it checks something, then lets it go on to its end.

`install(folder)` writes an installed-distribution record there that registers the backend as
`stepping` in the `aiperf.backends` entry-point group; a process whose PYTHONPATH holds that
folder and this one finds it (`environment(folder)`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from aiperf_core.backend import EpochReport, StepClock
from aiperf_numpy.backend import NumpyBackend

BEHAVIOUR = "AIPERF_TEST_STEPPING"
NAME = "stepping"
_trials = 0  # train() calls in this process


class SteppingBackend(NumpyBackend):
    name = NAME

    def train_checked(self, model, data, config, on_epoch):
        global _trials
        _trials += 1
        behaviour = json.loads(os.environ.get(BEHAVIOUR, "{}"))
        step_s, steps = float(behaviour.get("step_s", 0.05)), int(behaviour.get("steps", 4))
        hang = behaviour.get("hang") or {}
        gate = behaviour.get("gate") or {}
        if gate.get("trial") == _trials:
            while not Path(gate["file"]).exists():
                time.sleep(0.05)
        clock = StepClock()
        reports = []
        for epoch in range(config.epochs):
            for step in range(steps):
                if (hang.get("trial"), hang.get("epoch"), hang.get("step")) == (_trials, epoch, step) \
                        and _claim(Path(hang["marker"])):
                    with clock:
                        while True:  # a collective that a dead peer never joins
                            time.sleep(1)
                with clock:
                    time.sleep(step_s)
                clock.count(config.batch_size)
            with clock:  # evaluation
                time.sleep(min(step_s, 0.05))
            report = EpochReport(epoch=epoch, train_images=steps * config.batch_size, val_images=len(data.y_val),
                                 loss=1.0 / (epoch + 1), val_loss=1.0 / (epoch + 1), val_accuracy=0.5,
                                 step_seconds=clock.lap())
            reports.append(report)
            if on_epoch is not None and on_epoch(report):
                break
        return reports


def _claim(marker: Path) -> bool:
    try:
        with open(marker, "x") as f:
            f.write(str(os.getpid()))
        return True
    except FileExistsError:
        return False


def install(folder: Path) -> None:
    info = Path(folder) / "aiperf_test_stepping-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aiperf-test-stepping\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[aiperf.backends]\n{NAME} = stepping_backend:SteppingBackend\n")


def environment(folder: Path, **behaviour) -> dict[str, str]:
    """os.environ for a child process that finds the backend and behaves as asked."""
    here = str(Path(__file__).parent)
    path = os.pathsep.join(p for p in (str(folder), here, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, BEHAVIOUR: json.dumps(behaviour), "OMP_NUM_THREADS": "1"}
