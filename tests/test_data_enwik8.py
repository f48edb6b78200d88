"""enwik8 and the embedded byte corpus (aiperf_core/data/enwik8.py, aiperf_core/data/text_corpus.py):
`aiperf data prepare enwik8.zip OUT` on an enwik8-shaped zip made here (100,000,000 bytes of a
numeric pattern, never the real file): the standard split, the digest, official or not, a restart
after SIGKILL, bad input, what a refusal leaves (nothing prepared from a damaged zip, the resumable
state after an interruption), staging; and the embedded corpus with its batch sampler."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from aiperf_core.cli import main
from aiperf_core.data import enwik8
from aiperf_core.data.manifest import (MANIFEST, OFFICIAL_SPLIT_BYTES, Manifest, ManifestError, file_entry,
                                       read_manifest, recorded_digest)
from aiperf_core.data.prepare_out import STATE
from aiperf_core.data.stage import verify_folder
from aiperf_core.data.text_corpus import (TextDataError, embedded_bytes, embedded_corpus, open_prepared,
                                          split_sizes)
from aiperf_core.data.text_stream import TokenStream

ROOT = Path(__file__).resolve().parents[1]
ENWIK8_BYTES = 100_000_000
SPLITS = ("train", "val", "test")
PIECE = 1 << 22


def pattern(start: int, stop: int) -> bytes:
    """Bytes [start, stop) of the stand-in for enwik8: no period that lines up with the splits."""
    i = np.arange(start, stop, dtype=np.int64)
    return ((i * 31 + i // 9973) % 256).astype(np.uint8).tobytes()


def make_zip(path: Path, size: int, member: str = "enwik8", method=zipfile.ZIP_STORED) -> dict[str, str]:
    """A zip holding `member`: `size` bytes of the pattern, written in pieces. Returns the SHA-256 of
    each split (text_corpus's rule) and of the whole member, hashed as written."""
    sizes = split_sizes(size)
    bounds = {"train": (0, sizes["train"]), "val": (sizes["train"], sizes["train"] + sizes["val"]),
              "test": (size - sizes["test"], size)}
    hashes = {name: hashlib.sha256() for name in (*SPLITS, "member")}
    with zipfile.ZipFile(path, "w", method, compresslevel=1 if method == zipfile.ZIP_DEFLATED else None) as archive:
        with archive.open(member, "w") as fh:
            for split, (start, stop) in bounds.items():
                for piece in range(start, stop, PIECE):
                    data = pattern(piece, min(stop, piece + PIECE))
                    fh.write(data)
                    hashes[split].update(data)
                    hashes["member"].update(data)
    return {name: h.hexdigest() for name, h in hashes.items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("source") / "enwik8.zip"
    return path, make_zip(path, ENWIK8_BYTES)


@pytest.fixture(scope="module")
def prepared(source):
    out = source[0].parent.parent / "prepared"
    summary = enwik8.prepare_enwik8(source[0], out)
    assert not summary.already_complete and summary.kept == []
    return out


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name not in {MANIFEST, "train.bin", "val.bin", "test.bin"})


def _inodes(paths) -> dict:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


# --- the standard split, the digest, official --------------------------------------------------------
def test_the_standard_split_its_digest_and_official(source, prepared):
    path, truth = source
    manifest = read_manifest(prepared)
    assert manifest.layout == "bytes" and manifest.split_bytes == OFFICIAL_SPLIT_BYTES == split_sizes(ENWIK8_BYTES)
    assert manifest.official and manifest.to_dict()["official"] is True
    assert sorted(p.name for p in prepared.iterdir()) == sorted([MANIFEST, "train.bin", "val.bin", "test.bin"])
    for split in SPLITS:
        entry = manifest.files[f"{split}.bin"]
        assert (entry.size, entry.sha256) == (OFFICIAL_SPLIT_BYTES[split], truth[split])
        assert file_entry(prepared / f"{split}.bin") == entry
    with open(prepared / "val.bin", "rb") as fh:  # the split is at the standard offsets
        assert fh.read(1000) == pattern(90_000_000, 90_001_000)
    with open(prepared / "test.bin", "rb") as fh:
        fh.seek(-1000, os.SEEK_END)
        assert fh.read() == pattern(ENWIK8_BYTES - 1000, ENWIK8_BYTES)
    extra = manifest.extra
    assert (extra["dataset"], extra["vocab"], extra["member"], extra["member_bytes"]) == ("enwik8", 256, "enwik8",
                                                                                          ENWIK8_BYTES)
    assert extra["member_sha256"] == truth["member"] and extra["published_zip"] is False
    assert extra["official_reason"] == "the member enwik8 is 100,000,000 bytes: enwik8 whole, in the standard split"
    assert manifest.sources == {"enwik8.zip": path.stat().st_size}
    assert recorded_digest(prepared) == manifest.digest  # what run.json and every replica record

    data = open_prepared(prepared)
    assert (data.name, data.official, data.digest, data.vocab) == ("enwik8", True, manifest.digest, 256)
    assert data.split_bytes == OFFICIAL_SPLIT_BYTES and isinstance(data.train, np.memmap)
    x, y, _, _ = TokenStream(data, 128, epoch_tokens=512, val_tokens=512).load("val", np.array([0, 128, 256, 384]))
    assert x.shape == y.shape == (4, 128) and x.dtype == np.int32 and np.array_equal(x[:, 1:], y[:, :-1])


def test_a_rerun_on_a_finished_folder_does_nothing(source, prepared, capsys):
    before = _inodes(prepared.iterdir())
    assert main(["data", "prepare", str(source[0]), str(prepared)]) == 0
    captured = capsys.readouterr()
    assert "already prepared from this enwik8 member; nothing to do" in captured.out
    assert "official: yes" in captured.out and captured.err == ""
    assert _inodes(prepared.iterdir()) == before


def test_another_size_is_prepared_unofficial_with_the_reason(tmp_path, capsys):
    zipped = tmp_path / "small.zip"
    truth = make_zip(zipped, 1_000, method=zipfile.ZIP_DEFLATED)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(zipped), str(out)]) == 0
    captured = capsys.readouterr()
    assert "official: no (the member enwik8 is 1,000 bytes, not enwik8's 100,000,000)" in captured.out
    assert "900 train, 50 val and 50 test bytes" in captured.out and "prepare: enwik8: " in captured.err
    manifest = read_manifest(out)
    assert manifest.split_bytes == {"train": 900, "val": 50, "test": 50} and not manifest.official
    assert (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes() + (out / "test.bin").read_bytes() == \
        pattern(0, 1_000)
    assert {s: manifest.files[f"{s}.bin"].sha256 for s in SPLITS} == {s: truth[s] for s in SPLITS}
    assert main(["data", "prepare", str(zipped), str(tmp_path / "quiet"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    assert read_manifest(tmp_path / "quiet").digest == manifest.digest  # the same bytes, the same identity


# --- restart ----------------------------------------------------------------------------------------
KILLER = """
import os, signal, sys
from aiperf_core.data import enwik8
original = enwik8._split_done
def killed(*args, **kwargs):
    original(*args, **kwargs)
    os.kill(os.getpid(), getattr(signal, sys.argv[3]))
enwik8._split_done = killed
from aiperf_core.cli import main
main(["data", "prepare", sys.argv[1], sys.argv[2], "--quiet"])
"""


def _killed_after_the_first_split(zipped: Path, out: Path, signal_name: str) -> None:
    killed = subprocess.run([sys.executable, "-c", KILLER, str(zipped), str(out), signal_name], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -getattr(signal, signal_name), killed.stderr


def test_killed_after_the_first_split_resumes_keeping_it(source, prepared, tmp_path, capsys):
    out = tmp_path / "out"
    _killed_after_the_first_split(source[0], out, "SIGKILL")
    assert sorted(p.name for p in out.iterdir()) == [STATE, "train.bin"]  # recorded; nothing else in sight
    train = _inodes([out / "train.bin"])
    assert main(["data", "prepare", str(source[0]), str(out), "--quiet"]) == 0
    assert "resumed: train kept from the interrupted run" in capsys.readouterr().out
    assert _inodes([out / "train.bin"]) == train  # not rewritten
    assert (out / MANIFEST).read_text() == (prepared / MANIFEST).read_text()
    assert _leftovers(out) == []


def test_killed_in_the_middle_of_a_file_leaves_no_half_file_and_resumes(source, prepared, tmp_path, capsys):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "aiperf_core", "data", "prepare", str(source[0]), str(out),
                                "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while not _partly_written(out, ".train.bin."):
            assert process.poll() is None, "the prepare finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.002)
    finally:
        process.kill()
        process.wait()
    for split in SPLITS:  # a final name never holds a half file
        if (out / f"{split}.bin").exists():
            assert (out / f"{split}.bin").stat().st_size == OFFICIAL_SPLIT_BYTES[split]
    assert main(["data", "prepare", str(source[0]), str(out), "--quiet"]) == 0
    assert (out / MANIFEST).read_text() == (prepared / MANIFEST).read_text()
    assert _leftovers(out) == []


def _partly_written(out: Path, prefix: str) -> bool:
    for path in out.glob(f"{prefix}*.tmp") if out.is_dir() else ():
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:  # renamed into place meanwhile
            pass
    return False


# --- bad input ----------------------------------------------------------------------------------------
def _zip_of(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# Split 180,000 / 10,000 / 10,000: zipfile reads a stored member 4 KiB ahead and checks its CRC-32
# on reaching its end, so the end is reached only while the last split is read.
SMALL = 200_000


def _bad_crc(path: Path, at: int = 100) -> Path:
    """A zip whose member's byte `at` differs from what its CRC-32 (and its size) were made of."""
    _zip_of(path, {"enwik8": pattern(0, SMALL)})
    data = bytearray(path.read_bytes())
    data[data.index(pattern(0, 64)) + at] ^= 0xFF  # one byte of the stored member, not its CRC
    path.write_bytes(bytes(data))
    return path


BAD_SOURCES = {
    "not a zip": (lambda d: _text(d / "enwik8.zip", "hello"), "not a zip archive"),
    "a zip without enwik8": (lambda d: _zip_of(d / "enwik9.zip", {"enwik9": b"x" * 100, "notes.txt": b"y"}),
                             "holds no member named 'enwik8' (it holds enwik9, notes.txt)"),
    "a missing file": (lambda d: d / "nope.zip", "nope.zip: no such file"),
    "an empty member": (lambda d: _zip_of(d / "empty.zip", {"enwik8": b""}), "its member enwik8 is empty"),
    "a member too small to split": (lambda d: _zip_of(d / "tiny.zip", {"enwik8": b"0123456789"}),
                                    "too small to split"),
    "a damaged member": (lambda d: _bad_crc(d / "damaged.zip"), "cannot be read: damaged (Bad CRC-32"),
}


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_a_bad_source_is_one_line(tmp_path, capsys, case):
    make, message = BAD_SOURCES[case]
    path = make(tmp_path)
    err = _error(capsys, ["data", "prepare", str(path), str(tmp_path / "out"), "--quiet"])
    assert err.startswith(f"aiperf: error: {path}: ") and message in err, err
    assert not (tmp_path / "out").exists()  # made for nothing, or emptied of what the damaged member filled


def test_imagenet_options_and_a_bad_out_are_one_line(tmp_path, capsys):
    zipped = tmp_path / "small.zip"
    make_zip(zipped, 100)
    for option in (["--layout", "folder"], ["--train-shards", "4"], ["--val-shards", "2"]):
        err = _error(capsys, ["data", "prepare", str(zipped), str(tmp_path / "out"), *option])
        assert f"{option[0]}: applies to ImageNet's archives, not to the zip {zipped}" in err
    assert not (tmp_path / "out").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert f"{other}: exists and is not empty" in _error(capsys, ["data", "prepare", str(zipped), str(other)])
    assert (other / "notes.txt").read_text() == "mine" and sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert str(blocker) in _error(capsys, ["data", "prepare", str(zipped), str(blocker / "out")])
    assert "no such folder" in _error(capsys, ["data", "prepare", str(tmp_path / "no-archives"), str(tmp_path / "o")])


def test_a_finished_folder_of_another_member_is_refused(tmp_path, capsys):
    first, second = tmp_path / "a.zip", tmp_path / "b.zip"
    make_zip(first, 200)
    make_zip(second, 300)
    out = tmp_path / "out"
    assert main(["data", "prepare", str(first), str(out), "--quiet"]) == 0
    assert "already holds a prepared dataset made with other settings or sources" in _error(
        capsys, ["data", "prepare", str(second), str(out), "--quiet"])


# --- what a refusal leaves -------------------------------------------------------------------------------
def _listing(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def _after_train(monkeypatch, then) -> list:
    """Calls then() right after the train split is recorded; returns OUT's listing at each split."""
    seen, original = [], enwik8._split_done

    def recorded(state, split, *rest):
        original(state, split, *rest)
        seen.append(_listing(state.parent))
        if split == "train":
            then()
    monkeypatch.setattr(enwik8, "_split_done", recorded)
    return seen


def _ctrl_c() -> None:
    raise KeyboardInterrupt


def test_a_member_damaged_at_its_end_leaves_no_split_file(tmp_path, capsys, monkeypatch):
    zipped = _bad_crc(tmp_path / "damaged.zip")
    out = tmp_path / "out"
    out.mkdir()  # made by its user: emptied, not removed
    seen = _after_train(monkeypatch, lambda: None)
    err = _error(capsys, ["data", "prepare", str(zipped), str(out), "--quiet"])
    assert "its member enwik8 cannot be read: damaged (Bad CRC-32" in err
    assert err.endswith(f"; nothing prepared is left in {out}"), err
    assert seen[-1] == [STATE, "train.bin", "val.bin"]  # the CRC-32 fails after two splits were in place
    assert _listing(out) == []
    # A rerun cannot mend it: the same refusal, and again nothing left.
    assert "Bad CRC-32" in _error(capsys, ["data", "prepare", str(zipped), str(out), "--quiet"])
    assert _listing(out) == []


@pytest.mark.parametrize("damaged_at, message", [
    (100, "train.bin: written by an earlier run from other bytes than"),  # inside the kept split
    (SMALL - 50, "cannot be read: damaged (Bad CRC-32"),  # in the last split, found at its end
])
def test_damage_found_on_resume_removes_the_earlier_runs_splits_too(tmp_path, capsys, monkeypatch, damaged_at,
                                                                    message):
    zipped = _zip_of(tmp_path / "enwik8.zip", {"enwik8": pattern(0, SMALL)})
    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        _after_train(patch, _ctrl_c)
        assert main(["data", "prepare", str(zipped), str(out), "--quiet"]) == 130
    assert capsys.readouterr().err == "aiperf: interrupted\n" and _listing(out) == [STATE, "train.bin"]
    _bad_crc(zipped, damaged_at)  # the same size and recorded CRC-32: the rerun resumes, then finds the damage
    err = _error(capsys, ["data", "prepare", str(zipped), str(out), "--quiet"])
    assert message in err and err.endswith(f"; nothing prepared is left in {out}"), err
    assert _listing(out) == []  # the folder the interrupted run made stays, empty


def _disk_full(target: Path) -> None:
    if target.name == "val.bin":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))


def _stopped_by(how: str, zipped: Path, out: Path, capsys, monkeypatch) -> None:
    """The prepare of `zipped` into `out` stopped after its train split by `how`, as a user sees it."""
    if how == "SIGTERM":
        _killed_after_the_first_split(zipped, out, "SIGTERM")
        return
    with monkeypatch.context() as patch:
        if how == "Ctrl-C":
            _after_train(patch, _ctrl_c)
            assert main(["data", "prepare", str(zipped), str(out), "--quiet"]) == 130
            assert capsys.readouterr().err == "aiperf: interrupted\n"
        elif how == "disk full":
            write = enwik8.write_atomic
            patch.setattr(enwik8, "write_atomic", lambda target, fill: (_disk_full(target), write(target, fill)))
            assert f"{out}: cannot write there: No space left on device" in _error(
                capsys, ["data", "prepare", str(zipped), str(out), "--quiet"])
        else:  # the zip cannot be read for a moment
            read = zipfile.ZipExtFile.read
            failing = []

            def flaky(stream, *args):
                if failing:
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return read(stream, *args)
            patch.setattr(zipfile.ZipExtFile, "read", flaky)
            _after_train(patch, lambda: failing.append(True))
            err = _error(capsys, ["data", "prepare", str(zipped), str(out), "--quiet"])
            assert f"{zipped}: its member enwik8 cannot be read (Input/output error)" in err and "damaged" not in err


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "disk full", "a read error on the zip"])
def test_an_interruption_keeps_what_a_rerun_resumes(tmp_path, capsys, monkeypatch, how):
    zipped = _zip_of(tmp_path / "enwik8.zip", {"enwik8": pattern(0, SMALL)})
    reference = enwik8.prepare_enwik8(zipped, tmp_path / "reference")
    out = tmp_path / "out"
    _stopped_by(how, zipped, out, capsys, monkeypatch)
    assert _listing(out) == [STATE, "train.bin"]
    assert main(["data", "prepare", str(zipped), str(out), "--quiet"]) == 0
    assert "resumed: train kept from the interrupted run" in capsys.readouterr().out
    assert read_manifest(out).digest == reference.digest and _leftovers(out) == []


# --- the manifest, stage and check ----------------------------------------------------------------------
def test_a_bytes_manifest_is_read_strictly(tmp_path):
    zipped = tmp_path / "small.zip"
    make_zip(zipped, 400)
    out = tmp_path / "out"
    enwik8.prepare_enwik8(zipped, out)
    original = json.loads((out / MANIFEST).read_text())
    assert list(original)[:4] == ["format", "version", "layout", "digest"]  # the digest in the head read
    for change, field in [(lambda d: d.pop("split_bytes"), "split_bytes"),
                          (lambda d: d["split_bytes"].update(val=51), "split_bytes.val"),
                          (lambda d: d["split_bytes"].update(extra=1), "split_bytes"),
                          (lambda d: d.update(classes=["n1"]), "classes"),
                          (lambda d: d.update(layout="folder"), "split_bytes")]:
        data = json.loads(json.dumps(original))
        change(data)
        (out / MANIFEST).write_text(json.dumps(data, indent=1))
        with pytest.raises(ManifestError, match=f"{MANIFEST}: {field}"):
            read_manifest(out)
    images = Manifest("folder", ["n1"], {"train": {"n1": 1}, "val": {"n1": 1}}, {})
    assert "split_bytes" not in images.to_dict() and not images.official


def test_stage_and_check_deep_verify_an_enwik8_folder(prepared, tmp_path, capsys):
    manifest = read_manifest(prepared)
    dst = tmp_path / "local" / "enwik8"
    assert main(["data", "stage", str(prepared), str(dst), "--json", "--quiet"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert (staged["copied"], staged["bytes"], staged["digest"]) == (3, ENWIK8_BYTES, manifest.digest)
    assert read_manifest(dst).to_dict() == manifest.to_dict() and recorded_digest(dst) == manifest.digest
    assert main(["data", "check", str(dst), "--deep", "--json", "--quiet"]) == 0
    check = json.loads(capsys.readouterr().out)
    assert (check["ok"], check["official"], check["digest"], check["checked"]) == (
        True, True, manifest.digest, "sizes and checksums")
    assert main(["data", "check", str(dst), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "byte-level text dataset" in text and "  train   90,000,000 bytes" in text
    assert "official enwik8: yes" in text and "ILSVRC" not in text and "classes" not in text

    with open(dst / "val.bin", "r+b") as fh:  # damage of the same size: only a checksum sees it
        fh.seek(12345)
        fh.write(b"\0")
    assert verify_folder(dst).ok and not verify_folder(dst, deep=True).ok
    assert main(["data", "stage", str(prepared), str(dst), "--deep", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["replaced"] == ["val.bin"]
    assert verify_folder(dst, deep=True).ok

    os.truncate(dst / "test.bin", OFFICIAL_SPLIT_BYTES["test"] - 1)
    with pytest.raises(TextDataError, match="test.bin: 4,999,999 bytes, its manifest says 5,000,000"):
        open_prepared(dst)
    with pytest.raises(TextDataError, match="no manifest.json"):
        open_prepared(tmp_path)


# --- the embedded corpus and the batch sampler -----------------------------------------------------------
def test_the_embedded_corpus_is_deterministic_and_split_by_the_rule():
    corpus = embedded_bytes()
    first, second = embedded_corpus(), embedded_corpus()
    assert first.digest == second.digest and first.source_sha256 == hashlib.sha256(corpus).hexdigest()
    assert (first.name, first.official, first.vocab, first.path) == ("embedded", False, 256, None)
    held_out = len(corpus) // 20
    assert first.split_bytes == {"train": len(corpus) - 2 * held_out, "val": held_out, "test": held_out}
    assert len(corpus) > 100_000  # enough text for a small model
    assert bytes(first.train) + bytes(first.val) + bytes(first.test) == corpus
    assert split_sizes(20) == {"train": 18, "val": 1, "test": 1}
    with pytest.raises(TextDataError, match="too small to split"):
        split_sizes(19)


def test_stream_windows_are_next_byte_pairs_of_their_split():
    data = embedded_corpus()
    stream = TokenStream(data, 64, epoch_tokens=512, val_tokens=512)
    offsets = stream.plan("train", 0, 0, 8)[0]
    x, y, _, _ = stream.load("train", offsets)
    assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    train = bytes(data.train)
    for row_x, row_y in zip(x, y):  # each row a window of the split, y its continuation by one byte
        assert bytes(np.append(row_x, row_y[-1]).astype(np.uint8)) in train
    with pytest.raises(TextDataError, match="split: 'dev' is not one of train, val, test"):
        data.split("dev")
