"""Shared helpers for benchmark scripts: best-of-N timing and one JSON line per figure."""

from __future__ import annotations

import json
import time


def best_of(fn, repeat: int = 20) -> float:
    """Best wall time of `repeat` calls, in seconds (the least disturbed run)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


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
    from opcount import count
    totals = count(graph)
    return totals.fp + totals.bp


def report_peak_fraction(framework: str, images_per_s: float, ops_per_image: int, matmul, n: int = 2048) -> dict:
    """Achieved analytic OPS of a training run as a fraction of the framework's own dense-GEMM peak.

    `matmul` runs one n x n fp32 matrix product to completion (synchronised) in the framework.
    The peak is the best of several products, at 2 n^3 operations each, so the fraction says how
    much of what the framework can do on this machine the lowered network turns into counted work.
    """
    matmul()  # compile / warm up
    peak = 2 * n ** 3 / best_of(matmul, repeat=5)
    achieved = images_per_s * ops_per_image
    report(f"{framework} dense GEMM peak ({n}x{n} fp32)", peak / 1e9, "GOPS", None, lower_is_better=False)
    report(f"{framework} resnet50 train, achieved analytic OPS", achieved / 1e9, "GOPS", None, lower_is_better=False)
    return report(f"{framework} achieved / GEMM peak", achieved / peak, "fraction", None, lower_is_better=False)
