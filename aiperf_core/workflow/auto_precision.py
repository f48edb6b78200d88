"""The precision `auto` resolves to, measured: the run's seed model, at the run's input size, trains a
few steps at each precision the backend declares on the run's device, and the fastest per step is
the precision every trial trains at. The preference order that fastest_precision() assumes can be
wrong: TensorFlow's bf16 steps on 32x32 images were slower than its fp32 ones on a Sapphire Rapids
with AMX (README).

The cost is bounded: per precision, WARMUP_STEPS step(s) that lowering, tracing and compilation
land in, then TIMED_STEPS timed ones (their median is the figure), on synthetic data made once, at
a batch of at most CPU_BATCH_SIZE images on a CPU and the policy's batch_size on an accelerator
(what the run's first trials train at). Where the device declares one precision nothing is
measured. On an H100, ResNet-50 at 224x224 and batch 128, the four precisions took 5.4 s in all.

Its operations are never counted: it trains outside any trial, and the score counts trial epochs
only. The primary measures in its backend probe, before run.json's start_time is taken, so its
time is outside the time budget; a SLURM replica measures at its first start, inside it
(docs/scoring.md, "The precision of a run").
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from aiperf_core.errors import AiperfError

WARMUP_STEPS = 1
TIMED_STEPS = 3
CPU_BATCH_SIZE = 8
LEARNING_RATE = 0.01  # small: a few steps from random weights stay finite at every precision


def batch_size_for(device: str, policy_batch_size: int) -> int:
    """Images per probe step on `device`."""
    from aiperf_core.inventory import is_cpu_device

    return min(policy_batch_size, CPU_BATCH_SIZE) if is_cpu_device(device) else policy_batch_size


def measure_seed_model(backend, device: str, precisions, seed: dict[str, Any]) -> dict[str, Any]:
    """measure() on the seed model that `seed` names (workflow.plan.auto_request: model,
    input_shape, classes, batch_size): the primary's backend probe, before the run starts."""
    from aiperf_core.builders import build

    if "sizes" in seed:  # a transformer (gpt, llama): its sizes, no image shape
        graph = build(seed["model"], **seed["sizes"])
    else:
        graph = build(seed["model"], tuple(seed["input_shape"]), seed["classes"])
    return measure(backend, device, graph, precisions, batch_size_for(device, seed["batch_size"]))


def measure(backend, device: str, graph, precisions, batch_size: int) -> dict[str, Any]:
    """run.json's `precision_probe`: {"device", "chosen", "seconds_per_step": {precision: seconds or
    null where it failed}, and where anything was measured "batch_size", "timed_steps", "seconds"
    (the whole probe) and "errors" ({precision: one line}, where one failed)}. A precision that
    fails to train is not chosen; an AiperfError where every one does."""
    precisions = tuple(precisions)
    if len(precisions) == 1:
        return {"device": device, "chosen": precisions[0], "seconds_per_step": {}}
    data = _synthetic(graph, batch_size)
    started = time.perf_counter()
    seconds: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    with _not_progress():
        for precision in precisions:
            try:
                seconds[precision] = _seconds_per_step(backend, device, graph, data, precision, batch_size)
            except Exception as exc:  # noqa: BLE001 - a precision that cannot train is just not chosen
                seconds[precision] = None
                errors[precision] = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    timed = {p: s for p, s in seconds.items() if s is not None}
    if not timed:
        first = next(iter(errors))
        raise AiperfError(f"precision auto: the seed model trained at no precision on {device} "
                          f"({first}: {errors[first]})")
    probe = {"device": device, "chosen": min(timed, key=timed.get), "seconds_per_step": seconds,
             "batch_size": batch_size, "timed_steps": TIMED_STEPS,
             "seconds": round(time.perf_counter() - started, 3)}
    if errors:
        probe["errors"] = errors
    return probe


def describe(probe: dict[str, Any] | None) -> str:
    """What the start line and the report say after 'precision X (auto' ...: the timings behind
    the pick, e.g. 'auto: fp32 0.21 s/step, bf16 0.35 s/step'."""
    if not isinstance(probe, dict):  # a run.json from before auto was measured: it was assumed
        return "auto: the fastest the backend declares on the run's device"
    seconds = probe.get("seconds_per_step") or {}
    if not seconds:
        return f"auto: the only precision declared on {probe.get('device')}"
    from aiperf_core.backend import PRECISIONS

    order = sorted(seconds, key=lambda p: PRECISIONS.index(p) if p in PRECISIONS else len(PRECISIONS))
    timings = ", ".join(f"{p} {seconds[p]:.3g} s/step" if isinstance(seconds[p], (int, float)) else f"{p} failed"
                        for p in order)  # run.json sorts its keys: PRECISIONS order again
    return f"auto: {timings}"


def _synthetic(graph, n: int):
    """An in-memory Dataset of `n` random samples for `graph` (images or tokens), validated on one."""
    from aiperf_core.backend import Dataset

    rng = np.random.default_rng(0)
    classes = int(graph.output_shape[-1])
    if graph.takes_tokens:
        x = rng.integers(0, graph.vocab, (n, *graph.input_shape), dtype=np.int64)
        y = rng.integers(0, classes, (n, *graph.output_shape[:-1]), dtype=np.int64)
    else:
        x = rng.standard_normal((n, *graph.input_shape), dtype=np.float32)
        y = rng.integers(0, classes, n, dtype=np.int64)
    return Dataset(x, y, x[:1], y[:1], classes)


def _seconds_per_step(backend, device: str, graph, data, precision: str, batch_size: int) -> float:
    """The median wall seconds of the timed steps: one step an epoch, so that each epoch's end (the
    backend's callback) closes one step; an epoch also evaluates one image, as a trial's does."""
    from aiperf_core.backend import Schedule, TrainConfig

    model = backend.lower(graph, None, precision)
    config = TrainConfig(epochs=WARMUP_STEPS + TIMED_STEPS, batch_size=batch_size,
                         schedule=Schedule(LEARNING_RATE), precision=precision, devices=(device,),
                         compile="never")  # compiling a model per precision would cost minutes
    ends: list[float] = []
    backend.train(model, data, config, lambda report: ends.append(time.perf_counter()))
    if len(ends) != config.epochs:
        raise AiperfError(f"the backend reported {len(ends)} of {config.epochs} epochs")
    return round(statistics.median(b - a for a, b in zip(ends[WARMUP_STEPS - 1:], ends[WARMUP_STEPS:])), 6)


class _not_progress:
    """The probe is not a trial: its steps must not show as a replica's live progress (StepClock)."""

    def __enter__(self):
        from aiperf_core.backend import StepClock

        self.saved = os.environ.pop(StepClock.PROGRESS_FILE_ENV, None)

    def __exit__(self, *exc):
        from aiperf_core.backend import StepClock

        if self.saved is not None:
            os.environ[StepClock.PROGRESS_FILE_ENV] = self.saved
        return False
