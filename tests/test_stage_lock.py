"""`aiperf data stage`'s lease against a holder that stops renewing it: a real stage process caught
in the middle of its copy and stopped by SIGSTOP. Alive, a waiter gives up with one line naming it;
killed, a waiter takes it over (exactly one of several) and finishes the copy.

Every process here renews its lease every RENEW_S and waits WAIT_S, so that a test takes seconds."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aiperf_core.cli import main
from aiperf_core.data.stage import LEASE, stage, verify_folder
from aiperf_core.data.manifest import Manifest, file_entry, write_manifest

RENEW_S = 0.1
WAIT_S = 1.0  # for a waiter that is to give up; one that is to wait for a live holder gets LONG_WAIT_S
LONG_WAIT_S = 60.0
# A stage that copies until it has finished a batch of files, then blocks while its lease thread
# goes on renewing, until the file named by its third argument exists.
HOLDER = """
import os, sys, time
from aiperf_core.data.stage import stage

def progress(phase, files, total_files, done, total):
    if phase == "copy" and files and not os.path.exists(sys.argv[3]):
        print("copying", flush=True)
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.02)

result = stage(sys.argv[1], sys.argv[2], workers=1, progress=progress, renew_s=float(sys.argv[4]))
print(result.copied, flush=True)
"""
# `aiperf ARGS...` with the stage's renewal interval set (its default is minutes' worth of waiting).
CLI = """
import sys
from aiperf_core.data import stage
stage.RENEW_S = float(sys.argv[1])
from aiperf_core.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, Manifest]:
    """A prepared dataset of 600 files of random bytes: 10 batches of 64, a copy to catch midway."""
    root = tmp_path_factory.mktemp("source") / "imagenet"
    rng = np.random.default_rng(0)
    classes = [f"n{k:08d}" for k in range(1, 11)]
    for i in range(600):
        path = root / "train" / classes[i % 10] / f"{i:05d}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(2048))
    files = {p.relative_to(root).as_posix(): file_entry(p) for p in sorted(root.rglob("*.JPEG"))}
    manifest = Manifest("folder", classes, {"train": {c: 60 for c in classes}}, files)
    write_manifest(root, manifest)
    return root, manifest


def start_holder(src: Path, dst: Path, go: Path) -> subprocess.Popen:
    """A stage of src to dst that holds its lease midway through the copy (once it prints 'copying')."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(src), str(dst), str(go), str(RENEW_S)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "copying\n"
    return holder


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, str(RENEW_S), *argv], capture_output=True, text=True,
                          timeout=60)


def end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGCONT)
        process.kill()
    process.wait()


def test_a_waiter_gives_up_on_a_stopped_holder_with_one_line_naming_it(source, tmp_path):
    src, manifest = source
    dst, go = tmp_path / "local", tmp_path / "go"
    holder = start_holder(src, dst, go)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        lease = json.loads((dst / LEASE).read_text())
        waiter = cli("data", "stage", str(src), str(dst), "--wait", f"{WAIT_S}s", "--quiet")
        assert waiter.returncode == 2 and waiter.stdout == ""
        assert len(waiter.stderr.splitlines()) == 1, waiter.stderr
        line = waiter.stderr
        acquired = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease["acquired"]))
        assert line.startswith(f"aiperf: error: {dst / LEASE}: held by aiperf data stage pid {holder.pid} on host "
                               f"{socket.gethostname()} since {acquired}, last renewed ")
        assert "past --wait 1s): its process is alive but not renewing its lease (stopped or hung)" in line
        assert f"kill {holder.pid}" in line
        assert json.loads((dst / LEASE).read_text())["token"] == lease["token"]  # a live holder's lease is left

        # Running again, it renews: a waiter with the same --wait waits for it longer than that.
        os.kill(holder.pid, signal.SIGCONT)
        while json.loads((dst / LEASE).read_text())["renewed"] == lease["renewed"]:
            time.sleep(0.02)
        waiter = subprocess.Popen([sys.executable, "-c", CLI, str(RENEW_S), "data", "stage", str(src), str(dst),
                                   "--wait", str(WAIT_S)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
        try:
            assert "waiting: in use by the aiperf data stage" in waiter.stderr.readline()
            time.sleep(2 * WAIT_S)
            assert waiter.poll() is None  # still waiting, neither gone nor copying
        finally:
            end(waiter)
        go.touch()
        assert holder.communicate(timeout=60)[0] == f"{len(manifest.files)}\n"
        assert holder.returncode == 0
    finally:
        end(holder)
    assert verify_folder(dst, deep=True).ok and not (dst / LEASE).exists()


def test_the_lease_of_a_stopped_then_killed_holder_is_taken_over_by_exactly_one_waiter(source, tmp_path):
    src, manifest = source
    dst, go = tmp_path / "local", tmp_path / "go"
    holder = start_holder(src, dst, go)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        holder.kill()
        holder.wait()
    finally:
        end(holder)
    copied_before = len(list(dst.rglob("*.JPEG")))
    assert 0 < copied_before < len(manifest.files) and not (dst / "manifest.json").exists()
    assert json.loads((dst / LEASE).read_text())["pid"] == holder.pid  # the dead holder's lease is in place

    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(3), context.Queue()

    def waiter():
        barrier.wait()
        results.put(stage(src, dst, workers=2, wait_s=LONG_WAIT_S, renew_s=RENEW_S).to_dict())

    waiters = [context.Process(target=waiter) for _ in range(3)]
    for p in waiters:
        p.start()
    found = [results.get(timeout=60) for _ in waiters]
    for p in waiters:
        p.join(timeout=60)
        assert p.exitcode == 0
    copier = [r for r in found if not r["complete_before"]]
    assert len(copier) == 1 and all(r["copied"] == 0 for r in found if r is not copier[0])  # one copied
    # ... and it resumed the dead holder's copy: its verified files kept, the rest copied
    assert (copier[0]["kept"], copier[0]["copied"]) == (copied_before, len(manifest.files) - copied_before)
    check = verify_folder(dst, deep=True)
    assert check.ok and check.manifest.digest == manifest.digest and not (dst / LEASE).exists()


def test_wait_is_a_duration_of_at_least_two_renewals(source, tmp_path, capsys):
    src, _ = source
    dst = tmp_path / "local"
    assert main(["data", "stage", str(src), str(dst), "--wait", "soon"]) == 2
    assert capsys.readouterr().err == "aiperf: error: --wait: 'soon' is not a duration (for example 90m, 12h, 1h30m)\n"
    assert main(["data", "stage", str(src), str(dst), "--wait", "20s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aiperf: error: --wait 20 s: must be at least 30 s: a stage renews its lease every 15 s")
    assert len(err.splitlines()) == 1 and not (dst / "train").exists()  # refused before any work
