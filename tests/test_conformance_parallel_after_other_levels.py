"""The suite runs torch's parallel level after the kit's other levels, in one process.

The parallel level's child process once aborted a rank now and then, but only when the whole kit
had run before it in the same process (docs/backends/torch.md, "Data-parallel teardown"): the level
alone never did. The ranks' teardown is checked on every run: a rank whose process group outlives
its teardown fails its training (backends/torch/distributed.py, end_process_group), so a torch
parallel check fails every time the fault is there, not one time in five.

tests/test_conformance.py runs the kit that way: one pytest item per check, in kit order, in one
process, so torch's parallel checks run after every other level of torch's kit, all through one
context. Their data-parallel trainings run in the level's child, which starts with torch's first
check and trains beside the other levels (parallel.start_early), so the ranks' teardown is checked
on a machine busier than the failing runs' was. This file used to run `aiperf conformance
--level count,parallel --quick` for torch in a subprocess of its own (about a minute), a repeat of
what test_conformance.py does with the whole kit before the level. What it checks now is that the
guarantee holds, cheaply: test_conformance.py's parametrisation, and the session's order of its
items where this session collected them, put torch's parallel checks after its other levels.
"""

from __future__ import annotations

from aiperf_conformance.kit import LEVELS
from aiperf_conformance.levels.parallel import CHILD_DEVICES, DATA_PARALLEL_CHECKS
from aiperf_conformance.pytest_support import _context


def _torch_cases():
    import test_conformance  # collected already where pytest collected tests/test_conformance.py

    assert "torch" in test_conformance.BACKENDS
    (mark,) = [m for m in test_conformance.test_conformance.pytestmark if m.name == "parametrize"]
    argname, cases = mark.args[0], list(mark.args[1])
    assert argname == "case"
    return [case for case in cases if case.backend == "torch"]


def test_conformance_runs_torchs_parallel_checks_after_its_other_levels_in_one_process(request):
    torch_cases = _torch_cases()
    levels = [case.check.level for case in torch_cases]
    first = levels.index("parallel")
    # Every other level of the kit, then the parallel level, and nothing of torch's after it.
    assert set(levels[:first]) == set(LEVELS) - {"parallel"}, levels
    assert set(levels[first:]) == {"parallel"}, levels
    # Its data-parallel checks (two-rank trainings, whose teardown is checked) are among them.
    ran = {case.check.name for case in torch_cases[first:]}
    assert set(DATA_PARALLEL_CHECKS) <= ran, ran
    # One context (backend, cache) for all of them, as one kit run has, and the level's work in its
    # child process with AIPERF_CPU_DEVICES=2, where the ranks are spawned.
    assert len({case.context_key for case in torch_cases}) == 1
    backend = _context(torch_cases[0].context_key).backend
    assert backend.parallelism().data_parallel and len(backend.devices()) < CHILD_DEVICES
    # Nothing spreads or reorders the items: one process, in collection order.
    assert not request.config.pluginmanager.hasplugin("xdist"), "pytest-xdist would split the kit across processes"
    assert not request.config.pluginmanager.hasplugin("randomly"), "pytest-randomly would reorder the kit's items"
    session = [item.name for item in request.session.items if item.path.name == "test_conformance.py"]
    in_session = [name for name in session if name.startswith("test_conformance[torch:")]
    # Where this session runs them too (`make test`), it runs them in the parametrised order.
    expected = [f"test_conformance[{case}]" for case in torch_cases]
    assert in_session == [name for name in expected if name in in_session]

