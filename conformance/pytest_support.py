"""Running the kit from pytest: one pytest item per check, so CI shows each check by its id.

A vendor's test file needs three lines:

    from aiperf_conformance.pytest_support import conformance_cases, run_case
    @pytest.mark.parametrize("case", conformance_cases(["mychip"]), ids=str)
    def test_conformance(case): run_case(case)

An expected failure listed in the backend's data file passes as 'xfail'; a failure, an error or
an unexpected pass fails the test with the kit's message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from aiperf_conformance.kit import LEVELS, Check, Context, collect, make_context, run_check
from aiperf_conformance.results import BAD, XFAIL

_contexts: dict[str, Context] = {}


@dataclass(frozen=True)
class Case:
    backend: str
    check: Check

    def __str__(self) -> str:
        return f"{self.backend}:{self.check.id}"


def _context(backend_name: str) -> Context:
    if backend_name not in _contexts:
        from aiperf_core.registry import load_backend

        _contexts[backend_name] = make_context(load_backend(backend_name), backend_name)
    return _contexts[backend_name]


def conformance_cases(backend_names: Iterable[str], levels: Iterable[str] = LEVELS) -> list[Case]:
    """Collect checks per backend. A backend that cannot load fails collection loudly."""
    cases = []
    for name in backend_names:
        ctx = _context(name)
        cases.extend(Case(name, check) for check in collect(ctx, levels))
    return cases


def run_case(case: Case) -> None:
    result = run_check(_context(case.backend), case.check)
    if result.status in BAD:
        raise AssertionError(f"{case}: {result.status}: {result.message}")
    if result.status == XFAIL:
        import pytest

        pytest.xfail(result.message)
