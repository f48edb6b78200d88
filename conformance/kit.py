"""The conformance kit: levels from single ops to data-parallel training (after Deep500's levels).

Each level is a module in conformance/levels/ with a function `checks(ctx)` that yields
`Check(level, name, run, precision, needs_counter, workload, ops)`; `run(ctx)` returns an Outcome. The
runner applies the backend's expected failures, times each check, and turns exceptions into 'error'
results, so one broken check never hides the others. The NumPy reference executor (package
aiperf_numpy) is the oracle.

A check names the workload it certifies (cnn, lm, or ir for the model-zoo CNN ops) and the IR ops
its graphs need beyond the CNN ones (new_ops). Where the backend does not declare one of those
(Backend.supported_ops), the check is not run: its result is 'unsupported', never a pass.

Check ids. A check's id is `level/name` at fp32 and `level/name@precision` at any other precision,
e.g. `op/conv_1x1/forward` and `op/conv_1x1/forward@bf16`. The op, graph and train levels run once
per precision the backend declares on the device under test (its first device); the morph, count
and parallel levels run at fp32 only. `catalogue()` lists every check the kit has, without a
backend, which is what `aiperf conformance --list` prints, what xfail patterns are validated
against, and what the vendor guide's check table is generated from.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from aiperf_core.backend import PRECISIONS, Backend
from aiperf_core.errors import AiperfError
from aiperf_conformance.results import ERROR, FAIL, PASS, UNSUPPORTED, XFAIL, XPASS, CheckResult, Report

LEVELS = ("op", "graph", "morph", "train", "count", "parallel")
PER_PRECISION_LEVELS = ("op", "graph", "train")  # the others run at fp32 only


def check_id(level: str, name: str, precision: str = "fp32") -> str:
    return f"{level}/{name}" if precision == "fp32" else f"{level}/{name}@{precision}"


def new_ops(*graphs) -> frozenset[str]:
    """The ops of `graphs` beyond the CNN ones: what a check needs a backend to declare."""
    from aiperf_core.ir import VERSION_1_OPS, lowering_need

    return frozenset(lowering_need(n) for g in graphs for n in g.nodes) - VERSION_1_OPS


@dataclass
class Outcome:
    passed: bool
    measured: Any = None
    expected: Any = None
    tolerance: Any = None
    message: str = ""
    device: str | None = None  # where the check ran, when not (only) the device under test


@dataclass(frozen=True)
class Check:
    level: str
    name: str
    run: Callable[["Context"], Outcome]
    precision: str = "fp32"
    needs_counter: bool = False  # fails by design on a backend without a native op counter
    workload: str = "cnn"  # what it certifies: cnn, lm, or ir (the model-zoo ops; results.CHECK_TAGS)
    ops: frozenset[str] = frozenset()  # the IR ops its graphs hold beyond the CNN ones (VERSION_1_OPS)

    @property
    def id(self) -> str:
        return check_id(self.level, self.name, self.precision)


@dataclass
class Context:
    """What the checks of one kit run share. `backend` is None when the kit only lists its checks
    (catalogue()): a level then yields every check it can have."""

    backend: Backend | None
    expectations: Any  # aiperf_conformance.expectations.Expectations
    seed: int = 0
    quick: bool = False  # reduced sizes, for smoke runs; never a certification
    device: str | None = None  # the device under test: the backend's first device
    precisions: tuple[str, ...] = ("fp32",)  # those checked: declared on `device` (or asked for)
    cache: dict = field(default_factory=dict)
    # The workloads whose checks this run certifies (--workload); None: every one. A level whose
    # checks share work (parallel: one child process) does only the selected checks' part.
    workloads: tuple[str, ...] | None = None

    def rng(self, salt: int = 0) -> np.random.Generator:
        return np.random.default_rng(self.seed * 1_000_003 + salt)

    def tolerance(self, key: str, precision: str = "fp32") -> float:
        return self.expectations.tolerance(key, precision)


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


def normwise_error(measured: np.ndarray, expected: np.ndarray) -> float:
    """||measured - expected|| / ||expected|| (2-norms over the whole tensor)."""
    measured = np.asarray(measured, np.float64)
    expected = np.asarray(expected, np.float64)
    if not expected.size:
        return 0.0
    return float(np.linalg.norm(measured - expected)) / max(float(np.linalg.norm(expected)), 1e-300)


def compare(measured, expected, tolerance: float, what: str, normwise: bool = False) -> Outcome:
    """Max-abs relative error (relative_error), or the normwise one where a check says so."""
    measured = np.asarray(measured)
    expected = np.asarray(expected)
    if measured.shape != expected.shape:
        return Outcome(False, list(measured.shape), list(expected.shape), None,
                       f"{what}: shape {list(measured.shape)}, IR says {list(expected.shape)}")
    if not np.all(np.isfinite(measured)):
        return Outcome(False, "non-finite", "finite", tolerance, f"{what}: non-finite values")
    err = normwise_error(measured, expected) if normwise else relative_error(measured, expected)
    kind = "normwise relative error" if normwise else "relative error"
    return Outcome(err <= tolerance, err, 0.0, tolerance, f"{what}: {kind} {err:.3g} (tolerance {tolerance:g})")


def _parse_choices(text: str | Iterable[str], choices: tuple[str, ...], option: str, noun: str) -> list[str]:
    """'all', one choice or a comma-separated list -> choices in their own order; an empty or unknown
    list is an error naming `option` (a kit that runs nothing must never pass)."""
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else [str(x).strip() for x in text]
    items = [x for x in items if x]
    known = f"{noun}s: {', '.join(choices)}, all"
    if not items:
        raise AiperfError(f"{option}: no {noun} given ({known})")
    if items == ["all"]:
        return list(choices)
    for item in items:
        if item not in choices:
            raise AiperfError(f"{option}: unknown {noun} '{item}' ({known})")
    return [c for c in choices if c in items]


def parse_levels(text: str | Iterable[str]) -> list[str]:
    """'all', one level or a comma-separated list -> levels in kit order."""
    return _parse_choices(text, LEVELS, "--level", "level")


def parse_workloads(text: str | Iterable[str] | None) -> list[str]:
    """'all' (or None), one check tag or a comma-separated list -> tags in CHECK_TAGS order."""
    from aiperf_conformance.results import CHECK_TAGS

    return list(CHECK_TAGS) if text is None else _parse_choices(text, CHECK_TAGS, "--workload", "workload")


def parse_precisions(text: str | None, declared: tuple[str, ...], backend_name: str, device: str) -> tuple[str, ...]:
    """The precisions to check: every declared one (None or 'all'), or the listed ones, each of
    which the backend must declare on the device under test."""
    if text is None or text.strip() == "all":
        return tuple(declared)
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise AiperfError(f"--precision: no precision given (precisions: {', '.join(PRECISIONS)}, all)")
    for p in items:
        if p not in PRECISIONS:
            raise AiperfError(f"--precision: unknown precision '{p}' (precisions: {', '.join(PRECISIONS)}, all)")
        if p not in declared:
            raise AiperfError(f"--precision: backend '{backend_name}' does not declare '{p}' on {device} "
                              f"(declared: {', '.join(declared)})")
    return tuple(p for p in PRECISIONS if p in items)


def collect(ctx: Context, levels: Iterable[str]) -> list[Check]:
    out: list[Check] = []
    for level in levels:
        module = importlib.import_module(f"aiperf_conformance.levels.{level}")
        out.extend(module.checks(ctx))
    return out


def catalogue(levels: Iterable[str] = LEVELS, precisions: Iterable[str] = PRECISIONS) -> list[Check]:
    """Every check the kit has at these precisions, whatever the backend (both variants of the
    parallel level: data-parallel and single-device)."""
    return collect(Context(None, None, precisions=tuple(precisions)), levels)


def catalogue_ids() -> list[str]:
    return [c.id for c in catalogue()]


# -- child processes -----------------------------------------------------------------------------
# A level that runs work in a child process (parallel) starts it with ChildRun. Every Python
# process in that tree (the child, and what it spawns: torch's ranks) has faulthandler on, so one
# that dies of a signal prints its Python stack on stderr; stderr goes to a file, and a death is
# reported with its exit status or signal, the tail of stderr and those stacks (child_account).

STDERR_TAIL_LINES = 40
FAULTHANDLER_ENV = "PYTHONFAULTHANDLER"
_STACK_LINE_STARTS = ("Fatal Python error", "Thread 0x", "Current thread 0x", "  File ", "  <no Python frame>",
                      "  ...", "Extension modules:", "<Cannot show all threads while the GIL is disabled>")


class ChildProcessFailed(Exception):
    """Work a check ran in a child process failed. The message spans lines: what failed, then
    (child_account) how the process ended, the tail of its stderr and the Python stacks that
    faulthandler wrote; the kit's result keeps all of it."""


def exit_description(returncode: int) -> str:
    """'exit status 3', or 'signal SIGABRT' for a process a signal killed (a negative returncode)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit status {returncode}"


def fault_stacks(text: str) -> list[str]:
    """The Python stacks faulthandler wrote in `text`, each from its 'Fatal Python error' line."""
    stacks, current = [], None
    for line in text.splitlines():
        if line.startswith("Fatal Python error"):
            current = [line]
            stacks.append(current)
        elif current is not None and (not line.strip() or line.startswith(_STACK_LINE_STARTS)):
            current.append(line)
        else:
            current = None
    return ["\n".join(stack).strip() for stack in stacks]


def child_account(stderr: str, returncode: int | None = None) -> str:
    """How a child process ended (when it did not end well), the last STDERR_TAIL_LINES lines of
    its stderr and any faulthandler stack in it, one item after the other on separate lines."""
    lines = stderr.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    parts = [] if returncode is None else [f"the child process ended with {exit_description(returncode)}"]
    if lines:
        tail = lines[-STDERR_TAIL_LINES:]
        parts.append(f"stderr (last {len(tail)} of {len(lines)} lines):\n" + "\n".join(tail))
    else:
        parts.append("stderr: empty")
    for stack in fault_stacks(stderr):
        parts.append(f"Python stack (faulthandler):\n{stack}")
    return "\n".join(parts)


class ChildRun:
    """A Python child of the kit (`args`), started now with faulthandler on and stderr into
    `stderr_path`, and awaited by `wait`: a level may start its child before the kit reaches it,
    so that the child's work runs beside the levels before it. A child still running when this
    process exits is killed."""

    def __init__(self, args: list[str], env: dict, timeout: float, stderr_path: str, what: str):
        self.timeout, self.stderr_path, self.what = timeout, stderr_path, what
        self.started = time.monotonic()
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(args, env=dict(env, **{FAULTHANDLER_ENV: "1"}), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err)
        atexit.register(self._kill)

    def wait(self) -> None:
        """Until the child exits; ChildProcessFailed, naming `what` with child_account, if it runs
        past `timeout` seconds from its start or does not exit 0."""
        try:
            returncode = self.proc.wait(timeout=max(self.timeout - (time.monotonic() - self.started), 0.0))
        except subprocess.TimeoutExpired:
            self._kill()
            raise ChildProcessFailed(f"{self.what} did not finish in {self.timeout:g} s\n"
                                     + child_account(read_text(self.stderr_path))) from None
        finally:
            atexit.unregister(self._kill)
        if returncode != 0:
            raise ChildProcessFailed(f"{self.what} failed\n" + child_account(read_text(self.stderr_path), returncode))

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def read_text(path: str, start: int = 0, end: int | None = None) -> str:
    """Bytes [start, end) of a child's output file as text (what is not UTF-8 replaced)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(-1 if end is None else max(end - start, 0))
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"
    return data.decode("utf-8", "replace")


def output_size(path: str) -> int:
    """How far a child's output file has grown (the start of the next span for read_text)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def unsupported_ops(backend: Backend, check: Check) -> list[str]:
    return sorted(check.ops - backend.supported_ops())


def run_check(ctx: Context, check: Check) -> CheckResult:
    start = time.perf_counter()
    missing = unsupported_ops(ctx.backend, check)
    if missing:  # declared by the backend: never run, never a pass
        return CheckResult(check.level, check.name, UNSUPPORTED, None, None, None,
                           f"backend '{ctx.backend.name}' does not lower {', '.join(missing)} (Backend.supported_ops)",
                           0.0, check.precision, ctx.device, check.workload, missing)
    reason = ctx.expectations.xfail_reason(check.id)
    try:
        outcome = check.run(ctx)
    except Exception as exc:  # an exception is a finding about the backend, not a crash of the kit
        if isinstance(exc, ChildProcessFailed):  # the whole account: stderr tail and stacks span lines
            detail = f"{type(exc).__name__}: {exc}"
        else:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
        outcome = Outcome(False, message=f"raised {detail}")
        status = XFAIL if reason else ERROR
    else:
        if reason:
            status = XPASS if outcome.passed else XFAIL
        else:
            status = PASS if outcome.passed else FAIL
    message, device = outcome.message, outcome.device or ctx.device
    if status == XFAIL:
        message = f"expected failure ({reason}); {message}"
    elif status == XPASS:
        message = f"listed as an expected failure ({reason}) but passed: update the expectations file"
    return CheckResult(check.level, check.name, status, outcome.measured, outcome.expected, outcome.tolerance,
                       message, time.perf_counter() - start, check.precision, device, check.workload)


def iter_results(ctx: Context, checks: list[Check]) -> Iterator[CheckResult]:
    for check in checks:
        yield run_check(ctx, check)


def make_context(backend: Backend, backend_name: str | None = None, seed: int = 0, quick: bool = False,
                 precisions: str | None = None) -> Context:
    """The context of a kit run on `backend`'s first device, at every precision it declares there
    (or those of `precisions`, a comma-separated list)."""
    from aiperf_conformance.expectations import load_expectations

    name = backend_name or backend.name
    device = backend.devices()[0]
    checked = parse_precisions(precisions, backend.precisions(device), name, device)
    return Context(backend, load_expectations(name, backend), seed=seed, quick=quick, device=device,
                   precisions=checked)


def new_report(ctx: Context, levels: list[str], workloads: list[str]) -> Report:
    """A report with no results yet, for the checks of `levels` and `workloads` run in `ctx`."""
    backend = ctx.backend
    return Report(backend.name, backend.framework_version(), list(levels), device=ctx.device,
                  device_model=backend.device_model(ctx.device), precisions=list(ctx.precisions), quick=ctx.quick,
                  expectations=ctx.expectations.to_dict(), workload_scope=list(workloads))


def run_conformance(backend: Backend, levels: str | Iterable[str] = LEVELS, *, seed: int = 0, quick: bool = False,
                    precisions: str | None = None, workloads: str | Iterable[str] | None = None,
                    progress: Callable[[CheckResult], None] | None = None) -> Report:
    """The kit's report: `levels` at `precisions`, the checks of `workloads` only (None: every one)."""
    levels = parse_levels(levels)
    workloads = parse_workloads(workloads)
    reference()
    ctx = make_context(backend, seed=seed, quick=quick, precisions=precisions)
    ctx.workloads = tuple(workloads)
    report = new_report(ctx, levels, workloads)
    checks = [c for c in collect(ctx, levels) if c.workload in workloads]
    if any(c.level == "parallel" for c in checks):
        from aiperf_conformance.levels.parallel import start_early

        start_early(ctx)
    for result in iter_results(ctx, checks):
        report.results.append(result)
        if progress:
            progress(result)
    return report
