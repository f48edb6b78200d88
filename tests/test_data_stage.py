"""`aiperf data stage`, `aiperf data check` on a prepared dataset, and the dataset digest from
run.json through each replica's log to the score rules.

The prepared datasets are written here: real JPEGs (the digit scans) in train/<wnid>/ and
val/<wnid>/, with a manifest made by aiperf_core.data.manifest, as `aiperf data prepare` makes it."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aiperf_core.backend import Dataset
from aiperf_core.cli import main
from aiperf_core.data import stage as stage_module
from aiperf_core.data.manifest import Manifest, file_entry, read_manifest, verify_files, write_manifest
from aiperf_core.data.samples import digits_tree
from aiperf_core.data.stage import LEASE, PARTIAL, stage, verify_folder
from aiperf_core.policy import Policy
from aiperf_core.registry import load_backend
from aiperf_core.replica import run_replica, write_run_json
from aiperf_core.rundir import RunDir, _boot_id, read_events
from aiperf_core.scoring import score_run
from aiperf_core.workflow import plan

WNIDS = [f"n{k:08d}" for k in range(1, 11)]


def prepare(root: Path) -> Manifest:
    """The manifest of the folder tree at `root` (every file listed), written into it."""
    files = {p.relative_to(root).as_posix(): file_entry(p) for p in sorted(root.rglob("*"))
             if p.is_file() and p.name != "manifest.json"}
    per_class = {split: {c.name: sum(1 for _ in c.iterdir()) for c in sorted((root / split).iterdir())}
                 for split in ("train", "val") if (root / split).is_dir()}
    classes = sorted(per_class.get("train", {}))
    manifest = Manifest("folder", classes, per_class, files)
    write_manifest(root, manifest)
    return manifest


def jpeg_dataset(root: Path) -> Manifest:
    """Ten classes of digit JPEGs named like ImageNet's WNIDs, 8 train and 2 val images each."""
    digits_tree(root, train_per_class=8, val_per_class=2, size=32)
    for split in ("train", "val"):
        for digit, wnid in enumerate(WNIDS):
            (root / split / str(digit)).rename(root / split / wnid)
    return prepare(root)


def bytes_dataset(root: Path, files: int, size: int) -> Manifest:
    """Random bytes in the same layout: enough data for a stage to be caught in the middle."""
    rng = np.random.default_rng(0)
    for i in range(files):
        path = root / ("train" if i % 10 else "val") / WNIDS[i % len(WNIDS)] / f"{i:05d}.JPEG"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.bytes(size))
    return prepare(root)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared") / "imagenet"
    return root, jpeg_dataset(root)


def cli_json(capsys, argv) -> tuple[int, dict]:
    code = main(argv + ["--json"])
    return code, json.loads(capsys.readouterr().out)


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# --- stage and check ------------------------------------------------------------------------------
def test_a_stage_copies_and_verifies_and_a_rerun_copies_nothing(prepared, tmp_path, capsys):
    src, manifest = prepared
    dst = tmp_path / "local" / "imagenet"
    code, first = cli_json(capsys, ["data", "stage", str(src), str(dst)])
    assert code == 0
    assert (first["copied"], first["copied_bytes"], first["kept"]) == (len(manifest.files), first["bytes"], 0)
    assert first["digest"] == manifest.digest and not first["complete_before"]
    assert read_manifest(dst).to_dict() == manifest.to_dict()
    assert sorted(p.name for p in dst.iterdir()) == ["manifest.json", "train", "val"]  # no lease, no partials
    code, again = cli_json(capsys, ["data", "stage", str(src), str(dst)])
    assert code == 0 and again["complete_before"] and again["copied"] == 0 and again["kept"] == len(manifest.files)

    code, check = cli_json(capsys, ["data", "check", str(dst), "--deep"])
    assert code == 0
    assert (check["manifest"], check["digest"], check["official"], check["ok"]) == (True, manifest.digest, False, True)
    assert check["images"] == {"train": 80, "val": 20} and check["checked"] == "sizes and checksums"
    assert main(["data", "check", str(dst)]) == 0
    text = capsys.readouterr().out
    assert f"digest {manifest.digest}" in text and "official ILSVRC2012: no" in text and text.endswith("ok\n")


def test_concurrent_stages_on_one_node_copy_once(prepared, tmp_path):
    src, manifest = prepared
    dst = tmp_path / "local"
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(4), context.Queue()

    def one():
        barrier.wait()
        results.put(stage(src, dst, workers=2).to_dict())

    processes = [context.Process(target=one) for _ in range(4)]
    for p in processes:
        p.start()
    found = [results.get(timeout=60) for _ in processes]
    for p in processes:
        p.join(timeout=60)
        assert p.exitcode == 0
    copied = sorted(r["copied"] for r in found)
    assert copied == [0, 0, 0, len(manifest.files)]  # exactly one copied, and each file once
    assert sum(r["complete_before"] for r in found) == 3  # the others waited, then found the verified copy
    check = verify_folder(dst, deep=True)
    assert check.ok and check.manifest.digest == manifest.digest


def test_a_corrupted_copy_is_found_and_replaced(prepared, tmp_path, capsys):
    src, manifest = prepared
    dst = tmp_path / "local"
    stage(src, dst)
    flipped, truncated = f"train/{WNIDS[3]}/3_00002.JPEG", f"val/{WNIDS[1]}/1_00000.JPEG"
    data = bytearray((dst / flipped).read_bytes())
    data[100] ^= 0xFF
    (dst / flipped).write_bytes(bytes(data))  # same size: only checksums see it

    assert main(["data", "check", str(dst)]) == 0  # the quick check trusts sizes
    capsys.readouterr()
    code, check = cli_json(capsys, ["data", "check", str(dst), "--deep"])
    assert code == 1 and len(check["problems"]) == 1 and check["problems"][0].startswith(f"{flipped}: checksum ")
    assert stage(src, dst).copied == 0  # a verified copy is left alone: its sizes and digest hold
    deep = stage(src, dst, deep=True)
    assert (deep.copied, deep.replaced) == (1, [flipped])

    with open(dst / truncated, "r+b") as f:
        f.truncate(10)
    code, check = cli_json(capsys, ["data", "check", str(dst)])
    assert code == 1 and check["problems"] == [f"{truncated}: 10 bytes, manifest says {manifest.files[truncated].size:,}"]
    quick = stage(src, dst)
    assert (quick.copied, quick.replaced, quick.kept_by) == (1, [truncated], "size")
    assert verify_folder(dst, deep=True).ok

    (dst / "train" / WNIDS[0] / "stray.JPEG").write_bytes(b"x")  # a file beyond the manifest would be trained on
    code, check = cli_json(capsys, ["data", "check", str(dst)])
    assert code == 1 and check["problems"] == [f"train/{WNIDS[0]}/stray.JPEG: not in the manifest"]


def test_an_interrupted_stage_resumes_after_a_dead_holder(prepared, tmp_path):
    """What a stage killed midway leaves: some files in place, one of them damaged (a crash after
    its rename, before the disk had it), a partial copy, and the lease of a process that is gone."""
    src, manifest = prepared
    dst = tmp_path / "local"
    names = sorted(manifest.files)
    for name in names[:50]:
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, dst / name)
    damaged = names[7]
    (dst / damaged).write_bytes(b"\0" * manifest.files[damaged].size)
    partial = dst / names[50]
    partial.parent.mkdir(parents=True, exist_ok=True)
    (partial.parent / f".{partial.name}{PARTIAL}").write_bytes(b"half")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (dst / LEASE).write_text(json.dumps({"owner": "aiperf data stage", "host": socket.gethostname(),
                                         "boot_id": _boot_id(), "pid": int(dead.stdout), "pid_started": 1.0,
                                         "token": "dead", "acquired": time.time(), "renewed": time.time()}))
    result = stage(src, dst)
    assert (result.copied, result.kept, result.replaced) == (len(names) - 49, 49, [damaged])
    assert not list(dst.rglob(f"*{PARTIAL}")) and not (dst / LEASE).exists()
    assert verify_folder(dst, deep=True).ok


def test_a_killed_stage_never_leaves_a_partial_file_under_its_final_name(tmp_path):
    src = tmp_path / "src"
    manifest = bytes_dataset(src, files=400, size=256 * 1024)
    dst = tmp_path / "local"
    command = [sys.executable, "-m", "aiperf_core", "data", "stage", str(src), str(dst), "--workers", "1", "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (dst / "train").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    present = [p.relative_to(dst).as_posix() for p in dst.rglob("*.JPEG")]
    assert verify_files(dst, manifest, deep=True, names=present) == []  # every final name holds a verified file
    if not (dst / "manifest.json").exists():  # killed before the end: nothing claims the copy is complete
        assert verify_folder(src).ok and len(present) < len(manifest.files)
    result = stage(src, dst)
    assert result.copied + result.kept == len(manifest.files) and verify_folder(dst, deep=True).ok


def test_bad_input_is_one_line(prepared, tmp_path, capsys, monkeypatch):
    src, _ = prepared
    bare = tmp_path / "bare"
    digits_tree(bare, 1, 1, 16, 2)
    assert "run `aiperf data prepare`" in one_line_error(capsys, ["data", "stage", str(bare), str(tmp_path / "d")])
    assert "is inside SRC" in one_line_error(capsys, ["data", "stage", str(src), str(src / "copy")])
    assert "is inside SRC" in one_line_error(capsys, ["data", "stage", str(src), str(src)])
    other = tmp_path / "other"
    (other / "notes").mkdir(parents=True)
    (other / "notes" / "todo.txt").write_text("x")
    assert "not part of SRC's dataset (e.g. notes/todo.txt)" in one_line_error(
        capsys, ["data", "stage", str(src), str(other)])
    monkeypatch.setattr(stage_module.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10, 10, 1000))
    err = one_line_error(capsys, ["data", "stage", str(src), str(tmp_path / "small")])
    assert "not enough free space: 100 file(s) to copy need" in err
    assert "--deep" in one_line_error(capsys, ["data", "check", str(bare), "--deep"])


# --- the dataset's identity: run.json, the replicas, the score --------------------------------
def test_run_json_records_the_digest_of_a_dataset_with_a_manifest(prepared, tmp_path):
    src, manifest = prepared
    policy = Policy({"image_size": 32}).to_json()
    entry = plan.describe_dataset("imagenet", str(src), policy)
    assert entry["digest"] == manifest.digest and entry["train_images"] == 80
    bare = tmp_path / "bare"
    digits_tree(bare, 2, 1, 16, 2)
    assert plan.describe_dataset("imagenet", str(bare), policy)["digest"] is None
    assert plan.describe_dataset("digits", None, policy)["digest"] is None


def test_a_replica_that_read_other_data_makes_the_run_unofficial(prepared, tmp_path, capsys):
    """Two nodes whose copies at the same path differ: replica 1's was changed (and its manifest
    made again, so it verifies on its own): its digest is not the run's."""
    src, manifest = prepared
    local = tmp_path / "local"
    stage(src, local)
    run = tmp_path / "run"
    dataset = {"name": "imagenet", "path": str(local), "layout": "imagefolder", "classes": 10, "train_images": 80,
               "val_images": 20, "image_size": 32, "digest": manifest.digest}
    write_run_json(run, backend="numpy", dataset=dataset, replicas=2, time_budget_s=1e-3,
                   policy={"dataset": "digits", "initial_architecture": "resnet_small"})
    rng = np.random.default_rng(0)
    data = Dataset(rng.normal(size=(8, 32, 32, 3)).astype(np.float32), np.arange(8) % 10,
                   rng.normal(size=(4, 32, 32, 3)).astype(np.float32), np.arange(4), 10)
    assert run_replica(run, 0, backend=load_backend("numpy"), dataset=data) == "deadline"
    (local / "val" / WNIDS[0] / "0_00000.JPEG").unlink()  # the other node's copy
    (local / "val" / WNIDS[0] / "0_00001.JPEG").rename(local / "val" / WNIDS[0] / "0_00000.JPEG")
    other = prepare(local)
    assert run_replica(run, 1, backend=load_backend("numpy"), dataset=data) == "deadline"

    starts = [e for r in (0, 1) for e in read_events(RunDir(run).replica_log(r)) if e["event"] == "replica_start"]
    assert [e["dataset_digest"] for e in starts] == [manifest.digest, other.digest]
    expected = (f"replica 1 read dataset digest {other.digest[:16]}... (attempt 1), not the run's "
                f"{manifest.digest[:16]}...")
    result = score_run(run)
    assert not result.valid and expected in result.reasons
    assert not any(reason.startswith("replica 0 ") for reason in result.reasons)
    main(["score", str(run), "--verify"])
    assert expected in capsys.readouterr().out

    shutil.rmtree(local)
    stage(src, local)  # that node gets the run's data again, and replica 1 starts over
    os.remove(RunDir(run).replica_log(1))
    assert run_replica(run, 1, backend=load_backend("numpy"), dataset=data) == "deadline"
    assert not any("dataset digest" in reason for reason in score_run(run).reasons)
