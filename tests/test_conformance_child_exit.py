"""A kit child process that dies says how: the check's message (and so the report) carries the exit
status or the signal, the last 40 lines of its stderr, and the Python stack faulthandler wrote.

The fake backends are NumPy ones that declare data parallelism and see two CPU devices only with
AIPERF_CPU_DEVICES set, so the parallel level runs them in its child process; training on two
devices dies on purpose there: in a process the child spawns (as a torch rank would), or in the
child itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from aiperf_core.backend import CPU_DEVICES_ENV, Parallelism
from aiperf_numpy.backend import NumpyBackend
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import (STDERR_TAIL_LINES, ChildProcessFailed, ChildRun, Context, child_account,
                                    collect, exit_description, fault_stacks, run_check)
from aiperf_conformance.levels.parallel import DATA_PARALLEL_CHECKS, EXPERT_PARALLEL_REFUSED, MULTI_NODE_REFUSED

# A rank that prints 50 numbered lines, then aborts inside a named function.
_ABORTING_RANK = textwrap.dedent("""
    import os, sys
    for i in range(50):
        print(f"rank 1 line {i}", file=sys.stderr)
    sys.stderr.flush()

    def all_reduce_of_rank_one():
        os.abort()

    all_reduce_of_rank_one()
""")


class _ChildOnlyTwoDevices(NumpyBackend):
    def devices(self):
        n = int(os.environ.get(CPU_DEVICES_ENV, "1"))
        return [f"cpu:{i}" for i in range(n)] if n > 1 else ["cpu"]

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True, notes="emulated",
                           expert_parallel_why_not="emulated without it", multi_node_why_not="emulated on one host")


class RankAborts(_ChildOnlyTwoDevices):
    """Training on two devices starts a 'rank' that aborts, then raises as torch's spawn does."""

    name = "rankaborts"

    def train_checked(self, model, data, config, on_epoch):
        if len(self.train_devices(config)) < 2:
            return super().train_checked(model, data, config, on_epoch)
        rank = subprocess.run([sys.executable, "-c", _ABORTING_RANK])
        raise RuntimeError(f"process 1 terminated with {exit_description(rank.returncode)}")


def _abort_in_the_child():
    os.abort()


class ChildAborts(_ChildOnlyTwoDevices):
    """Training on two devices aborts the kit's child process itself."""

    name = "childaborts"

    def train_checked(self, model, data, config, on_epoch):
        if len(self.train_devices(config)) < 2:
            return super().train_checked(model, data, config, on_epoch)
        print("the child's last words", file=sys.stderr, flush=True)
        _abort_in_the_child()


def parallel_results(backend):
    ctx = Context(backend, Expectations(), quick=True, device=backend.devices()[0])
    return {c.name: run_check(ctx, c) for c in collect(ctx, ["parallel"])}


def test_a_rank_that_aborts_is_reported_with_its_signal_stderr_and_stack(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    results = parallel_results(RankAborts())
    assert set(results) == set(DATA_PARALLEL_CHECKS) | {EXPERT_PARALLEL_REFUSED, MULTI_NODE_REFUSED}
    # Refusing expert parallelism, or a replica across nodes, starts no rank (the contract refuses
    # them before training).
    assert results.pop(EXPERT_PARALLEL_REFUSED).status == "pass"
    assert results.pop(MULTI_NODE_REFUSED).status == "pass"
    for name, result in results.items():
        assert result.status == "error", (name, result.message)
        head, *rest = result.message.splitlines()
        assert head == (f"raised ChildProcessFailed: on child process with {CPU_DEVICES_ENV}=2: cpu:0, cpu:1: "
                        f"RuntimeError: process 1 terminated with signal SIGABRT")
        text = "\n".join(rest)
        # The tail of this scenario's stderr: the rank's last lines, not its first ones, and
        # nothing of the other scenarios' ranks (each wrote the same lines once).
        assert f"stderr (last {STDERR_TAIL_LINES} of" in text
        assert text.count("rank 1 line 49") == 1 and "rank 1 line 0\n" not in text
        # faulthandler's stack of the rank, down to the function that aborted.
        stack = text[text.index("Python stack (faulthandler):"):]
        assert "Fatal Python error: Aborted" in stack
        assert "in all_reduce_of_rank_one" in stack


def test_a_child_that_aborts_is_reported_with_its_signal_stderr_and_stack(monkeypatch):
    monkeypatch.delenv(CPU_DEVICES_ENV, raising=False)
    results = parallel_results(ChildAborts())
    for name, result in results.items():
        assert result.status == "error", (name, result.message)
        assert result.message.startswith(f"raised ChildProcessFailed: the child process ({CPU_DEVICES_ENV}=2) failed\n"
                                          "the child process ended with signal SIGABRT\n")
        assert "the child's last words" in result.message
        assert "Fatal Python error: Aborted" in result.message
        assert "in _abort_in_the_child" in result.message and "in train_checked" in result.message


def test_a_child_run_reports_an_exit_status_and_a_timeout_counted_from_its_start(tmp_path):
    err = str(tmp_path / "stderr.txt")
    try:
        ChildRun([sys.executable, "-c", "import sys; print('bad input', file=sys.stderr); sys.exit(3)"],
                 dict(os.environ), 60, err, "the helper").wait()
    except ChildProcessFailed as exc:
        assert str(exc) == ("the helper failed\nthe child process ended with exit status 3\n"
                            "stderr (last 1 of 1 lines):\nbad input")
    else:
        raise AssertionError("a child that exits 3 must fail")
    # Started, then awaited later (as the parallel level's child is): its bound runs from its start. A
    # child of 3 s with a bound of 1.5 s, awaited 2 s in: a bound counted from the wait would let it finish.
    sleeper = ChildRun([sys.executable, "-c", "import time; print('waiting', flush=True); time.sleep(3)"],
                       dict(os.environ), 1.5, err, "the sleeper")
    time.sleep(2.0)
    try:
        sleeper.wait()
    except ChildProcessFailed as exc:
        assert str(exc).startswith("the sleeper did not finish in 1.5 s\n")
    else:
        raise AssertionError("a child that overruns must fail")
    assert sleeper.proc.returncode is not None  # stopped, not left running


def test_exit_descriptions_and_stacks():
    assert exit_description(0) == "exit status 0"
    assert exit_description(-signal.SIGABRT) == "signal SIGABRT"
    assert exit_description(-signal.SIGKILL) == "signal SIGKILL"
    text = ("noise before\nFatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
            "  File \"a.py\", line 3 in f\n\nCurrent thread 0x00008f (most recent call first):\n"
            "  <no Python frame>\n\nExtension modules: numpy (total: 1)\nnoise after\n")
    assert fault_stacks(text) == ["Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
                                  "  File \"a.py\", line 3 in f\n\nCurrent thread 0x00008f (most recent call "
                                  "first):\n  <no Python frame>\n\nExtension modules: numpy (total: 1)"]
    assert child_account("") == "stderr: empty"
    many = "\n".join(f"line {i}" for i in range(100))
    account = child_account(many, -signal.SIGSEGV).splitlines()
    assert account[:2] == ["the child process ended with signal SIGSEGV", "stderr (last 40 of 100 lines):"]
    assert account[2] == "line 60" and account[-1] == "line 99"
