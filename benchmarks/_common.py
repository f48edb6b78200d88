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
