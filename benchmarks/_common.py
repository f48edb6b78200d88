"""Shared helpers for benchmark scripts: timing, one JSON line per figure, and the paired
lowered-against-hand-written comparison of every *_throughput.py, and the folder a benchmark writes in."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable


def best_of(fn, repeat: int = 20) -> float:
    """Best wall time of `repeat` calls, in seconds (the least disturbed run)."""
    return min(timed(fn) for _ in range(repeat))


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call; `fn` must wait for its own result (asynchronous devices)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def report(name: str, value: float, unit: str, goal: float | None = None, lower_is_better: bool = True) -> dict:
    met = None if goal is None else (value <= goal if lower_is_better else value >= goal)
    row = {"name": name, "value": value, "unit": unit, "goal": goal, "met": met}
    status = "" if met is None else ("  goal met" if met else "  GOAL MISSED")
    goal_text = "" if goal is None else f" (goal {'<=' if lower_is_better else '>='} {goal:g} {unit})"
    print(f"{name:<48} {value:10.3f} {unit}{goal_text}{status}")
    print("BENCH " + json.dumps(row))
    return row


def training_ops_per_image(graph) -> int:
    """Analytic FP+BP operations of one training image (the paper's convention, as scored)."""
    from aiperf_opcount import count
    totals = count(graph)
    return totals.fp + totals.bp


def report_peak_fraction(framework: str, images_per_s: float, ops_per_image: int, matmul, n: int = 2048) -> dict:
    """Achieved analytic OPS of a training run as a fraction of the framework's own dense-GEMM peak.

    `matmul` runs one n x n fp32 matrix product to completion (synchronised) in the framework.
    The peak is the best of ten products, at 2 n^3 operations each, so the fraction says how much
    of what the framework's matrix product does on this machine the lowered network turns into
    counted work. It can exceed 1 where the framework's convolutions use a faster library than its
    matrix product (torch on AMD CPUs: oneDNN convolutions, MKL matmul; docs/performance.md).
    """
    matmul()  # compile / warm up
    peak = 2 * n ** 3 / best_of(matmul, repeat=10)
    achieved = images_per_s * ops_per_image
    report(f"{framework} dense GEMM peak ({n}x{n} fp32)", peak / 1e9, "GOPS", None, lower_is_better=False)
    report(f"{framework} resnet50 train, achieved analytic OPS", achieved / 1e9, "GOPS", None, lower_is_better=False)
    return report(f"{framework} achieved / GEMM peak", achieved / peak, "fraction", None, lower_is_better=False)


def compare_training_throughput(framework: str, batch: int, lowered_step: Callable[[], Any],
                                hand_steps: dict[str, Callable[[], Any]], pairs: int, probe_steps: int = 1,
                                timer: Callable[[Callable[[], Any]], float] = timed, model: str = "resnet50",
                                unit: str = "images/s") -> float:
    """Time one training step at a time of the IR-lowered model and of the hand-written one, report
    both rates and their ratio (goal >= 0.97), and return the lowered model's samples per second.

    With several hand-written variants (memory formats, execution modes) the fastest over
    `probe_steps` steps each is the reference, so a variant choice cannot flatter the ratio. The
    timed steps come in `pairs` (one step of each model, in alternating order) and the ratio is
    the median of the pairs' ratios: on a shared machine a step's time varies by 10-20%, and a
    pair's two steps see the same load. Warm-up and compilation are the caller's, before this."""
    probe = {}
    if len(hand_steps) > 1:
        probe = {name: statistics.median(timer(step) for _ in range(probe_steps)) for name, step in hand_steps.items()}
        for name, seconds in probe.items():
            print(f"hand-written ({name}) step {seconds:.3f} s", flush=True)
    best = min(probe, key=probe.get) if probe else next(iter(hand_steps))
    hand_step = hand_steps[best]
    low_times, hand_times, ratios = [], [], []
    for i in range(pairs):
        if i % 2:
            hand, low = timer(hand_step), timer(lowered_step)
        else:
            low, hand = timer(lowered_step), timer(hand_step)
        low_times.append(low)
        hand_times.append(hand)
        ratios.append(hand / low)
        print(f"pair {i + 1}: lowered {low:.3f} s, hand-written {hand:.3f} s", flush=True)
    lowered_rate = batch / statistics.median(low_times)
    report(f"{framework} {model} train, IR-lowered", lowered_rate, unit, None, lower_is_better=False)
    report(f"{framework} {model} train, hand-written ({best})", batch / statistics.median(hand_times), unit,
           None, lower_is_better=False)
    for name, seconds in probe.items():
        if name != best:
            report(f"{framework} {model} train, hand-written ({name})", batch / seconds, unit, None,
                   lower_is_better=False)
    report(f"{framework} lowered / hand-written ({best})", statistics.median(ratios), "ratio", 0.97,
           lower_is_better=False)
    return lowered_rate


@contextlib.contextmanager
def benchmark_folder(keep: Path | None, prefix: str, parent: Path | None = None):
    """The folder a benchmark writes its runs in: `keep` (left in place), else a new temporary one,
    removed at the end. The load average is printed at the start and at a normal end: the machine is
    shared, and a figure means little without it."""
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    work = keep or Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    work.mkdir(parents=True, exist_ok=True)
    try:
        yield work
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
