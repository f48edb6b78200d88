"""`aiperf watch RUN_DIR`: the live block of `aiperf run` for any run directory, read-only.
`--once` against `aiperf score` on a hand-made ended run (the builder lives in test_score.py), and
the block redrawn in place under a pseudo-terminal until the run ends."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from aiperf_core.cli import main
from aiperf_core.scoring import format_ops, score_run
from test_score import GRAPH_1, RunBuilder, standard_run

ROOT = Path(__file__).resolve().parent.parent


def test_watch_once_prints_the_block_with_the_score_figures(tmp_path, capsys):
    b = standard_run(tmp_path)
    b.finish(1960)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["watch", "--once", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = score_run(tmp_path)
    assert lines[0] == "elapsed 16m00s of 15m00s (100%), 0s left"  # to run_end at 1960
    ended = sum(n for status, n in result.trials_by_status.items() if status != "running")
    assert lines[1] == (f"OPS {format_ops(result.score_ops)}  regulated {format_ops(result.regulated_ops)}  "
                        f"best accuracy {result.best_accuracy:.2%}  trials done {ended}, running 1  "
                        f"epochs {result.epochs_counted}")
    assert lines[2:] == ["  replica 0 on node0: attempt 1, 2 trials done, stopped",
                         "  replica 1 on node1: attempt 2, 2 trials done, training r0001-t00002 (epoch 2)"]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # read-only


def test_watch_redraws_the_block_under_a_terminal_until_the_run_ends(tmp_path):
    now = time.time()
    b = RunBuilder(tmp_path, start_time=now - 60, time_budget_s=3600.0, deadline=now + 3540, replicas=1)
    b.replica_start(0, now - 50)
    trial = b.trial_start(0, now - 40, GRAPH_1)
    main_fd, child_fd = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "aiperf_core", "watch", str(tmp_path)], stdin=child_fd,
                               stdout=child_fd, stderr=child_fd, cwd=ROOT, close_fds=True)
    os.close(child_fd)
    output = b""

    def read_until(predicate, timeout_s):
        nonlocal output
        deadline = time.monotonic() + timeout_s
        while not predicate(output) and time.monotonic() < deadline:
            ready, _, _ = select.select([main_fd], [], [], 0.5)
            if ready:
                try:
                    output += os.read(main_fd, 65536)
                except OSError:  # the child closed the terminal
                    break
        return predicate(output)

    try:
        assert read_until(lambda out: out.count(b"epochs 0") >= 1, 120), output
        b.epoch(0, trial, time.time(), 0, 1000, 100, 0.5)  # the next draw shows the epoch
        # The block is erased (cursor up over its lines, clear to the end) and drawn again.
        assert read_until(lambda out: b"\x1b[3F\x1b[J" in out and b"epochs 1" in out, 60), output
        b.trial_end(0, trial, time.time())
        b.log(0).append("replica_stop", replica=0, reason="deadline")
        b.finish(time.time())
        assert process.wait(timeout=60) == 0
        read_until(lambda out: False, 1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(main_fd)
    text = output.decode()
    last = text.rsplit("\x1b[J", 1)[-1].replace("\r\n", "\n").strip().splitlines()
    assert last[0].startswith("elapsed ") and "trials done 1, running 0  epochs 1" in last[1]
    assert last[2] == "  replica 0 on node0: attempt 1, 1 trials done, stopped"
