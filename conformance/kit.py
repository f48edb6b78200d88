"""The conformance kit: levels from single ops to training (after Deep500's validation levels).

Each level is a module in conformance/levels/ with a function `checks(ctx)` that yields
`Check(name, run)`; `run(ctx)` returns an Outcome. The runner applies the backend's expected
failures, times each check, and turns exceptions into 'error' results, so one broken check never
hides the others. The NumPy reference executor (package aiperf_numpy) is the oracle.
"""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from aiperf_core.backend import Backend
from aiperf_core.errors import AiperfError
from aiperf_conformance.expectations import Expectations, load_expectations
from aiperf_conformance.results import ERROR, FAIL, PASS, XFAIL, XPASS, CheckResult, Report

LEVELS = ("op", "graph", "morph", "train", "count")


@dataclass
class Outcome:
    passed: bool
    measured: Any = None
    expected: Any = None
    tolerance: Any = None
    message: str = ""


@dataclass(frozen=True)
class Check:
    level: str
    name: str
    run: Callable[["Context"], Outcome]

    @property
    def id(self) -> str:
        return f"{self.level}/{self.name}"


@dataclass
class Context:
    backend: Backend
    expectations: Expectations
    seed: int = 0
    quick: bool = False  # fewer epochs and cases; for smoke runs, never for a verdict
    cache: dict = field(default_factory=dict)

    def rng(self, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng(self.seed * 1_000_003 + salt)


def reference():
    try:
        return importlib.import_module("aiperf_numpy")
    except ImportError:
        raise AiperfError("the conformance kit needs the NumPy reference: pip install -e plugins/aiperf-numpy") from None


def relative_error(measured: np.ndarray, expected: np.ndarray) -> float:
    """Max absolute error relative to the largest reference magnitude."""
    measured = np.asarray(measured, np.float64)
    expected = np.asarray(expected, np.float64)
    scale = max(float(np.max(np.abs(expected))) if expected.size else 0.0, 1e-12)
    return float(np.max(np.abs(measured - expected))) / scale if expected.size else 0.0


def compare(measured, expected, tolerance: float, what: str) -> Outcome:
    measured = np.asarray(measured)
    expected = np.asarray(expected)
    if measured.shape != expected.shape:
        return Outcome(False, list(measured.shape), list(expected.shape), None,
                       f"{what}: shape {list(measured.shape)}, IR says {list(expected.shape)}")
    if not np.all(np.isfinite(measured)):
        return Outcome(False, "non-finite", "finite", tolerance, f"{what}: non-finite values")
    err = relative_error(measured, expected)
    return Outcome(err <= tolerance, err, 0.0, tolerance,
                   f"{what}: relative error {err:.3g} (tolerance {tolerance:g})")


def collect(ctx: Context, levels: Iterable[str]) -> list[Check]:
    out: list[Check] = []
    for level in levels:
        module = importlib.import_module(f"aiperf_conformance.levels.{level}")
        out.extend(module.checks(ctx))
    return out


def run_check(ctx: Context, check: Check) -> CheckResult:
    start = time.perf_counter()
    reason = ctx.expectations.xfail_reason(check.id)
    try:
        outcome = check.run(ctx)
    except Exception as exc:  # an exception is a finding about the backend, not a crash of the kit
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
        outcome = Outcome(False, message=f"raised {detail}")
        status = XFAIL if reason else ERROR
    else:
        if reason:
            status = XPASS if outcome.passed else XFAIL
        else:
            status = PASS if outcome.passed else FAIL
    message = outcome.message
    if status == XFAIL:
        message = f"expected failure ({reason}); {message}"
    elif status == XPASS:
        message = f"listed as an expected failure ({reason}) but passed: update the data file"
    return CheckResult(check.level, check.name, status, outcome.measured, outcome.expected, outcome.tolerance,
                       message, time.perf_counter() - start)


def iter_results(ctx: Context, checks: list[Check]) -> Iterator[CheckResult]:
    for check in checks:
        yield run_check(ctx, check)


def make_context(backend: Backend, backend_name: str | None = None, seed: int = 0, quick: bool = False) -> Context:
    name = backend_name or backend.name
    return Context(backend, load_expectations(name, backend), seed=seed, quick=quick)


def run_conformance(backend: Backend, levels: Iterable[str] = LEVELS, *, seed: int = 0, quick: bool = False,
                    progress: Callable[[CheckResult], None] | None = None) -> Report:
    levels = list(levels)
    for level in levels:
        if level not in LEVELS:
            raise AiperfError(f"unknown conformance level '{level}' (levels: {', '.join(LEVELS)}, all)")
    reference()
    ctx = make_context(backend, seed=seed, quick=quick)
    report = Report(backend.name, backend.framework_version(), levels)
    for result in iter_results(ctx, collect(ctx, levels)):
        report.results.append(result)
        if progress:
            progress(result)
    return report
