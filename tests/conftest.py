"""How `make test` spreads the suite over pytest-xdist's worker processes (DEVELOPERS.md, "Test tiers").

With `--dist loadgroup`, each group of tests runs whole in one worker, in collection order. A test
file is one group, so that its module-scoped fixtures (a compiled model, a trained replica) are
built once. A backend's conformance checks are one group, as one kit run is one process: the kit's
context caches the backend's models and reference outputs, the parallel level's child starts with
the backend's first check (parallel.start_early), and torch's parallel checks must follow its other
levels (tests/test_conformance_parallel_after_other_levels.py).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker reads the groups into the items' ids
def pytest_collection_modifyitems(config, items) -> None:
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    from aiperf_conformance.pytest_support import Case

    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        case = getattr(item, "case", None) or getattr(getattr(item, "callspec", None), "params", {}).get("case")
        group = f"kit-{case.backend}" if isinstance(case, Case) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
