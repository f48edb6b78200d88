"""Running the kit from pytest: one pytest item per check, so CI shows each check by its id.

The registered pytest plugin (aiperf_conformance.pytest_plugin, entry point `pytest11`) is the way a
vendor runs it: `pytest --aiperf-backend NAME [--aiperf-level op,graph] [--aiperf-quick]`. A test
file can also build the items itself:

    from aiperf_conformance.pytest_support import conformance_cases, run_case
    @pytest.mark.parametrize("case", conformance_cases(["mychip"]), ids=str)
    def test_conformance(case): run_case(case)

An expected failure listed in the backend's expectations file passes as 'xfail'; a failure, an error
or an unexpected pass fails the test with the kit's message; an unsupported check (an op the backend
does not declare) is skipped, naming the ops.

Once every check of a backend has run in the session, session_report(NAME) gives the report
`aiperf conformance --backend NAME --report` would have written (every level and workload), made of
the session's results: a later test can submit it without running the kit again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from aiperf_conformance.kit import (LEVELS, Check, Context, collect, make_context, new_report, parse_levels,
                                   parse_workloads, reference, run_check)
from aiperf_conformance.results import BAD, UNSUPPORTED, XFAIL, CheckResult, Report

_contexts: dict[tuple, Context] = {}
# What each context's cases gave, by check id: the session's report of a backend (session_report).
_results: dict[tuple, dict[str, CheckResult]] = {}
# The contexts whose parallel checks the session will run: their first case to run starts the
# level's child process (parallel.start_early), so that it trains beside the other levels' cases.
_parallel_ahead: set[tuple] = set()


@dataclass(frozen=True)
class Case:
    backend: str
    check: Check
    context_key: tuple

    def __str__(self) -> str:
        return f"{self.backend}:{self.check.id}"


def _context(key: tuple) -> Context:
    if key not in _contexts:
        from aiperf_core.registry import load_backend

        name, quick, precisions = key
        reference()
        _contexts[key] = make_context(load_backend(name), name, quick=quick, precisions=precisions)
    return _contexts[key]


def conformance_cases(backend_names: Iterable[str], levels: str | Iterable[str] = LEVELS, *, quick: bool = False,
                      precisions: str | None = None) -> list[Case]:
    """Collect checks per backend, at every precision it declares on its first device (or those of
    `precisions`). A backend that cannot load, or an empty or unknown level list, fails collection
    loudly."""
    levels = parse_levels(levels)
    cases = []
    for name in backend_names:
        key = (name, quick, precisions)
        cases.extend(Case(name, check, key) for check in collect(_context(key), levels))
    return cases


def will_run(cases: Iterable[Case]) -> None:
    """Note the session's selected cases (after -k and -m): a context with parallel checks among them
    starts the level's child when its first case runs (the plugin calls this for every session)."""
    _parallel_ahead.update(case.context_key for case in cases if case.check.level == "parallel")


def run_case(case: Case) -> None:
    ctx = _context(case.context_key)
    if case.context_key in _parallel_ahead:
        from aiperf_conformance.levels.parallel import start_early

        start_early(ctx)
    result = run_check(ctx, case.check)
    _results.setdefault(case.context_key, {})[case.check.id] = result
    if result.status in BAD:
        raise AssertionError(f"{case}: {result.status}: {result.message}")
    if result.status == XFAIL:
        import pytest

        pytest.xfail(result.message)
    if result.status == UNSUPPORTED:  # the backend declares it does not lower the op: not a pass
        import pytest

        pytest.skip(f"unsupported: {result.message}")


def session_report(backend_name: str, *, quick: bool = False, precisions: str | None = None) -> Report | None:
    """The report `aiperf conformance --backend NAME` would write (every level and workload), made of
    the results of this session's cases on that backend; None unless every one of its checks ran here
    (a deselected check leaves the report incomplete, and an incomplete report certifies nothing)."""
    key = (backend_name, quick, precisions)
    if key not in _contexts:
        return None
    ctx, ran = _contexts[key], _results.get(key, {})
    checks = collect(ctx, LEVELS)
    if any(check.id not in ran for check in checks):
        return None
    report = new_report(ctx, LEVELS, parse_workloads(None))
    report.results = [ran[check.id] for check in checks]
    return report
