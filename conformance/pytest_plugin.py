"""The kit as a pytest plugin (registered through the `pytest11` entry point of the aiperf
distribution, so any environment with aiperf installed has it):

    pytest --aiperf-backend mychip                                # every level, one item per check
    pytest --aiperf-backend mychip --aiperf-level op,graph --aiperf-quick
    pytest --aiperf-backend mychip --aiperf-precision bf16 -k conv

Without --aiperf-backend the plugin does nothing (and imports nothing beyond this module). Items are
named `NAME:CHECK_ID`; an expected failure from the backend's expectations file is reported as
xfail, a failure, an error or an unexpected pass fails with the kit's one-line message, and a check
that needs an op the backend does not declare (the kit's 'unsupported') is reported as skipped with
the missing ops: neither a pass nor a failure. A backend
that cannot load, an empty or unknown level list or an undeclared precision is a usage error.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("aiperf", "aiperf conformance kit")
    group.addoption("--aiperf-backend", action="append", default=[], metavar="NAME",
                    help="run the conformance kit on this backend (repeat for several)")
    group.addoption("--aiperf-level", default="all", metavar="LEVELS",
                    help="op, graph, morph, train, count, parallel, a comma-separated list, or all (default)")
    group.addoption("--aiperf-quick", action="store_true",
                    help="reduced sizes: a smoke test, never a certification")
    group.addoption("--aiperf-precision", default=None, metavar="LIST",
                    help="check only these declared precisions (default: every declared one)")


class ConformanceFailure(Exception):
    """A check that failed, erred or passed unexpectedly (reported without a traceback)."""


class ConformanceItem(pytest.Item):
    def __init__(self, *, case, **kwargs):
        super().__init__(**kwargs)
        self.case = case
        self.add_marker(pytest.mark.aiperf_conformance)

    def runtest(self) -> None:
        from aiperf_conformance.pytest_support import run_case

        try:
            run_case(self.case)
        except AssertionError as exc:
            raise ConformanceFailure(str(exc)) from None

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"aiperf conformance {self.name}"


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "aiperf_conformance: a check of the aiperf conformance kit")


@pytest.hookimpl(tryfirst=True)  # before -k and -m deselect, so that they apply to these items too
def pytest_collection_modifyitems(session, config, items) -> None:
    names = [n.strip() for value in config.getoption("aiperf_backend") for n in value.split(",") if n.strip()]
    if not names:
        return
    from aiperf_core.errors import AiperfError
    from aiperf_conformance.pytest_support import conformance_cases

    try:
        cases = conformance_cases(names, config.getoption("aiperf_level"), quick=config.getoption("aiperf_quick"),
                                  precisions=config.getoption("aiperf_precision"))
    except AiperfError as exc:
        raise pytest.UsageError(f"aiperf conformance: {exc}") from None
    items.extend(ConformanceItem.from_parent(session, name=str(case), case=case) for case in cases)


def pytest_collection_finish(session) -> None:
    """Hand the selected conformance cases (this plugin's items, and a test file's `case`
    parameters) to pytest_support.will_run, so that a backend's parallel level, if selected, starts
    its child process when the backend's first case runs."""
    import sys

    support = sys.modules.get("aiperf_conformance.pytest_support")
    if support is None:  # nothing collected made a case
        return
    cases = (getattr(item, "case", None) or getattr(getattr(item, "callspec", None), "params", {}).get("case")
             for item in session.items)
    support.will_run(case for case in cases if isinstance(case, support.Case))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.getoption("aiperf_backend") and config.getoption("aiperf_quick"):
        from aiperf_conformance.results import QUICK_NOTE

        terminalreporter.write_line(f"aiperf conformance: {QUICK_NOTE}", yellow=True, bold=True)
