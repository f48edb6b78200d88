"""`aiperf data prepare` on tiny archives with the official ILSVRC2012 structure (tests/ilsvrc_archives.py):
every image's label in both layouts against the generator's own truth, the content conversions, the
TFRecord keys, shuffle and DALI index, the manifest, each bad input refused with one line, archives
found damaged while converting leaving nothing prepared, a prepare interrupted (killed, Ctrl-C,
SIGTERM, a full disk, a worker killed) and resumed to the identical manifest without redoing
finished work, and a short real run training from each layout (DALI included)."""

from __future__ import annotations

import errno
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from aiperf_core.atomic import new_file_mode
from aiperf_core.cli import main
from aiperf_core.data import tfrecord
from aiperf_core.data.imagenet import open_imagenet
from aiperf_core.data.manifest import MANIFEST, file_entry, read_manifest
from aiperf_core.data import prepare as prepare_module
from aiperf_core.data.prepare import prepare
from aiperf_core.data.prepare_out import STATE
from ilsvrc_archives import LEAVES, NON_LEAVES, TRAIN_PER_CLASS, devkit, make_archives, meta_mat, overwrite_in_place
from test_workflow import TINY_POLICY

SHARDS = {"train": 4, "val": 2}
KINDS = {"jpeg": 32, "jpeg_grayscale": 1, "jpeg_cmyk": 2, "png": 1, "other": 0}


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    root = tmp_path_factory.mktemp("ilsvrc")
    return root / "src", make_archives(root / "src")


@pytest.fixture(scope="module")
def prepared(archives, tmp_path_factory):
    """Both layouts, prepared uninterrupted (the references of the resume tests)."""
    src, _ = archives
    root = tmp_path_factory.mktemp("prepared")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIPERF_DATA_CACHE", str(root / "cache"))
        out = {"tfrecord": root / "tf", "folder": root / "folder"}
        prepare(src, out["tfrecord"], "tfrecord", 2, SHARDS["train"], SHARDS["val"])
        prepare(src, out["folder"], "folder", 0)
        yield out


def _records(out: Path, prefix: str):
    """(shard name, data offset, features) of every record of the shards named prefix-*, in order."""
    for shard in sorted(out.glob(f"{prefix}-*-of-*")):
        if shard.suffix == ".idx":
            continue
        with open(shard, "rb") as fh:
            for offset, data in tfrecord.scan(fh, str(shard)):
                yield shard.name, offset, tfrecord.decode_example(data)


def _check_image(truth, name: str, stored: bytes) -> Image.Image:
    """A pass-through image keeps its bytes; a converted one is an RGB JPEG of the same picture."""
    original = truth.originals[name]
    image = Image.open(io.BytesIO(stored))
    if truth.kinds[name] == "jpeg":
        assert stored == original, name
    else:
        assert image.format == "JPEG" and image.mode == "RGB", (name, image.format, image.mode)
        expected = np.asarray(Image.open(io.BytesIO(original)).convert("RGB"), np.float32)
        assert np.abs(np.asarray(image, np.float32) - expected).mean() < 2.0, name
    return image


def test_tfrecord_labels_keys_shuffle_and_dali_index(prepared, archives, monkeypatch, tmp_path):
    _, truth = archives
    out = prepared["tfrecord"]
    for split, prefix, names in (("train", "train", truth.train), ("val", "validation", truth.val)):
        seen, shard_classes, order = [], {}, []
        for shard, _, f in _records(out, prefix):
            name = f["image/filename"][0].decode()
            wnid = names[name]
            assert f["image/class/label"] == [truth.classes.index(wnid) + 1]  # 1-based, sorted WNIDs
            assert f["image/class/synset"] == [wnid.encode()]
            assert f["image/class/text"] == [truth.words[wnid].encode()]
            assert f["image/format"] == [b"JPEG"] and f["image/colorspace"] == [b"RGB"] and f["image/channels"] == [3]
            image = _check_image(truth, name, f["image/encoded"][0])
            assert (f["image/height"], f["image/width"]) == ([image.height], [image.width])
            seen.append(name)
            shard_classes.setdefault(shard, set()).add(wnid)
            order.append(truth.classes.index(wnid))
        assert sorted(seen) == sorted(names)  # every image exactly once
        assert sorted(shard_classes) == [f"{prefix}-{k:05d}-of-{SHARDS[split]:05d}" for k in range(SHARDS[split])]
        assert all(len(c) > 1 for c in shard_classes.values())  # shuffled across classes
        assert order != sorted(order)
    # DALI's tfrecord2idx format: "offset length" of every whole record, beside each shard.
    for shard in sorted(out.glob("*-of-*[0-9]")):
        with open(shard, "rb") as fh:
            starts = [offset - tfrecord.HEADER.size for offset, _ in tfrecord.scan(fh, str(shard))]
        ends = starts[1:] + [shard.stat().st_size]
        lines = (out / (shard.name + ".idx")).read_text().splitlines()
        assert lines == [f"{s} {e - s}" for s, e in zip(starts, ends)]
    # The loader takes the shards and not their index files, and agrees on every label.
    monkeypatch.setenv("AIPERF_DATA_CACHE", str(tmp_path))
    source = open_imagenet(out)
    assert source.layout == "tfrecord" and list(source.class_names) == truth.classes
    for split in ("train", "val"):
        assert len(source.shards(split)) == SHARDS[split]
        for i, label in enumerate(source.labels(split)):
            assert label == truth.label(source.read(split, i)[1])


def test_folder_labels_and_conversions(prepared, archives):
    _, truth = archives
    out = prepared["folder"]
    for split, names in (("train", truth.train), ("val", truth.val)):
        assert sorted(p.name for p in (out / split).iterdir()) == truth.classes
        found = {p.name: p for p in (out / split).glob("*/*")}
        assert sorted(found) == sorted(names)
        for name, path in found.items():
            assert path.parent.name == names[name]
            _check_image(truth, name, path.read_bytes())
    source = open_imagenet(out)
    assert source.layout == "imagefolder" and list(source.class_names) == truth.classes
    for split in ("train", "val"):
        for path, label in zip(source.files(split), source.labels(split)):
            assert label == truth.label(os.path.basename(path))  # 0-based, sorted WNIDs


@pytest.mark.parametrize("layout", ["tfrecord", "folder"])
def test_every_output_file_is_readable_as_the_umask_allows(prepared, layout):
    """As open(2) would make it (not a temporary file's 0600): every node's stager and every user
    of a site reads a prepared dataset."""
    modes = {str(p.relative_to(prepared[layout])): stat.S_IMODE(p.stat().st_mode)
             for p in prepared[layout].rglob("*") if p.is_file()}
    assert MANIFEST in modes and {name: mode for name, mode in modes.items() if mode != new_file_mode()} == {}


@pytest.mark.parametrize("layout", ["tfrecord", "folder"])
def test_manifest_lists_every_file_counts_and_conversions(prepared, archives, layout):
    src, truth = archives
    out = prepared[layout]
    manifest = read_manifest(out)
    assert manifest.layout == layout and manifest.classes == truth.classes and not manifest.official
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest.files) == on_disk and not (out / STATE).exists()
    for name, entry in manifest.files.items():
        assert file_entry(out / name) == entry
    assert manifest.per_class["train"] == TRAIN_PER_CLASS
    assert manifest.per_class["val"] == {w: list(truth.val.values()).count(w) for w in truth.classes}
    assert manifest.conversions == KINDS
    assert manifest.sources == {p.name: p.stat().st_size for p in src.iterdir()}


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def _copy_archives(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _truncate(path: Path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep(data)])


def _val_member_end(path: Path) -> int:
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    return last.offset_data + last.size + (-last.size) % 512


BAD_INPUTS = {
    "missing archive": (lambda d: (d / "ILSVRC2012_img_val.tar").unlink(), "ILSVRC2012_img_val.tar: missing"),
    "train tar truncated inside a class tar": (
        lambda d: _truncate(d / "ILSVRC2012_img_train.tar", lambda b: len(b) // 2),
        "ILSVRC2012_img_train.tar: truncated"),
    "val tar cut before its end marker": (
        lambda d: _truncate(d / "ILSVRC2012_img_val.tar", lambda b: _val_member_end(d / "ILSVRC2012_img_val.tar")),
        "ILSVRC2012_img_val.tar: truncated or damaged at byte"),
    "corrupt meta.mat": (
        lambda d: (d / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(devkit(meta_mat()[:200] + b"\0" * 300, "1\n")),
        "data/meta.mat: not a readable MAT file"),
    "ground truth of the wrong length": (
        lambda d: (d / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(devkit(meta_mat(), "1\n2\n3\n")),
        "holds 12 validation images, the devkit's ground truth has 3 lines"),
    "ground truth naming a non-leaf synset": (
        lambda d: (d / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(devkit(meta_mat(), "5\n" * 12)),
        "line 1: '5' is not the ILSVRC2012_ID of a leaf synset"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_up_front_with_one_line(archives, tmp_path, capsys, case):
    damage, message = BAD_INPUTS[case]
    src = _copy_archives(archives[0], tmp_path / "src")
    damage(src)
    err = _error(capsys, ["data", "prepare", str(src), str(tmp_path / "out"), "--quiet"])
    assert err.startswith("aiperf: error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_class_count_differing_from_the_devkit_is_an_error_naming_the_class(archives, tmp_path, capsys):
    src = _copy_archives(archives[0], tmp_path / "src")
    counts = {**TRAIN_PER_CLASS, "n04592741": 7}
    with tarfile.open(archives[0] / "ILSVRC2012_devkit_t12.tar.gz") as tar:
        gt = tar.extractfile("ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").read().decode()
    (src / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(devkit(meta_mat(LEAVES, NON_LEAVES, counts), gt))
    err = _error(capsys, ["data", "prepare", str(src), str(tmp_path / "out"), "--quiet", "--workers", "0",
                          "--train-shards", "4", "--val-shards", "2"])
    assert "train class n04592741: 6 images in n04592741.tar, the devkit's meta.mat says num_train_images = 7" in err
    assert not (tmp_path / "out").exists()  # no rerun over these archives could finish: nothing is left


KILLER = """
import os, signal, sys
from aiperf_core.data import prepare as p
target, after, src, out, layout, signal_name = sys.argv[1], int(sys.argv[2]), *sys.argv[3:]
original, calls = getattr(p, target), [0]
def patched(*args, **kwargs):
    result = original(*args, **kwargs)
    calls[0] += 1
    if calls[0] == after:
        os.kill(os.getpid(), getattr(signal, signal_name))
    return result
setattr(p, target, patched)
p.prepare(src, out, layout, 0, 4, 2)
"""


def _killed(src, out, layout, target, after, signal_name="SIGKILL"):
    """prepare killed by `signal_name` right after the `after`-th call of prepare.<target>."""
    result = subprocess.run([sys.executable, "-c", KILLER, target, str(after), str(src), str(out), layout,
                             signal_name], capture_output=True, text=True, timeout=120)
    assert result.returncode == -getattr(signal, signal_name), result.stderr


def _inodes(paths) -> dict:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.parametrize("layout, second_kill", [("tfrecord", ("_write_shared", 3)), ("folder", ("_write_file", 3))])
def test_a_killed_prepare_resumes_to_the_identical_manifest(archives, prepared, tmp_path, capsys, layout, second_kill):
    src, _ = archives
    out = tmp_path / "out"
    _killed(src, out, layout, "_unit_done", 2)  # two classes finished, the rest not started
    units = sorted((out / STATE / "units").glob("*.json"))
    assert len(units) == 2
    first = _inodes(units)
    # Killed again, in the middle of writing a class folder or between a shard's index and the shard.
    _killed(src, out, layout, *second_kill)
    assert _inodes(units) == first  # the finished classes were not redone
    visible = [p for p in out.rglob("*") if p.is_file() and STATE not in p.relative_to(out).parts]
    if layout == "tfrecord":
        assert sorted(p.name for p in visible) == ["train-00000-of-00004", "train-00000-of-00004.idx",
                                                   "train-00001-of-00004.idx"]
    else:
        # Whole class folders only; a finished validation unit stays hidden until every chunk is done.
        classes = {u.stem.split("-", 1)[1] for u in units if u.stem.startswith("train-")}
        assert {p.parent.name for p in visible} == classes
        assert len(list((out / STATE / "building" / "train").glob("*/*"))) == 3  # the half class, hidden
    finished = _inodes(visible)
    assert main(["data", "prepare", str(src), str(out), "--layout", layout, "--workers", "2",
                 "--train-shards", "4", "--val-shards", "2", "--quiet"]) == 0
    assert "resumed after" in capsys.readouterr().out
    assert _inodes(p for p in finished if not p.name.endswith(".idx")) == \
        {p: v for p, v in finished.items() if not p.name.endswith(".idx")}  # finished files not rewritten
    assert (out / MANIFEST).read_text() == (prepared[layout] / MANIFEST).read_text()
    assert not (out / STATE).exists() and not list(out.glob(".*"))


# --- what a refusal leaves -------------------------------------------------------------------------------
# Units run longest first: the validation chunk, then n02085620, n02119789, n04592741 (holding the
# PNG), n01440765; so two or three classes are in place when the damage is found.
def _damage(src: Path, truth, case: str) -> str:
    """Damage the train tar in place (its size kept); returns what the refusal says."""
    train = src / "ILSVRC2012_img_train.tar"
    if case == "an image that cannot be decoded":
        png = next(name for name, kind in truth.kinds.items() if kind == "png")
        overwrite_in_place(train, truth.originals[png], 24, len(truth.originals[png]))  # keeps its signature
        return f"{png}: cannot be decoded for conversion to RGB JPEG"
    last = min(name for name, wnid in truth.train.items() if wnid == "n01440765")
    overwrite_in_place(train, truth.originals[last], -512, 0)  # its tar header
    return "n01440765.tar: truncated or damaged"


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _watched(monkeypatch, name: str, out: Path) -> list:
    """OUT's files as each call of prepare.<name> begins."""
    seen, original = [], getattr(prepare_module, name)

    def watched(*args):
        seen.append(_files(out))
        return original(*args)
    monkeypatch.setattr(prepare_module, name, watched)
    return seen


@pytest.mark.parametrize("layout, case", [("folder", "an image that cannot be decoded"),
                                          ("folder", "a damaged class tar"),
                                          ("tfrecord", "an image that cannot be decoded")])
def test_archives_found_damaged_while_converting_leave_nothing_prepared(archives, tmp_path, capsys, monkeypatch,
                                                                        layout, case):
    src = _copy_archives(archives[0], tmp_path / "src")
    message = _damage(src, archives[1], case)
    out = tmp_path / "out"
    seen = _watched(monkeypatch, "_unit_done", out)
    err = _error(capsys, ["data", "prepare", str(src), str(out), "--layout", layout, "--workers", "0",
                          "--train-shards", "4", "--val-shards", "2", "--quiet"])
    assert message in err and err.endswith(f"; nothing prepared is left in {out}"), err
    written = seen[-1]
    if layout == "folder":
        assert {f.split("/")[1] for f in written if f.startswith("train/")} >= {"n02085620", "n02119789"}
    else:  # no shard before every class is read: the spooled records were all there was
        assert any(f.startswith(f"{STATE}/spool/") for f in written)
    assert not out.exists()


def test_archives_found_damaged_on_resume_take_the_earlier_runs_output_with_them(archives, tmp_path, capsys):
    src = _copy_archives(archives[0], tmp_path / "src")
    out = tmp_path / "out"
    _killed(src, out, "folder", "_unit_done", 2)
    assert [f for f in _files(out) if f.startswith("train/n02085620/")]
    message = _damage(src, archives[1], "an image that cannot be decoded")
    err = _error(capsys, ["data", "prepare", str(src), str(out), "--layout", "folder", "--workers", "0",
                          "--train-shards", "4", "--val-shards", "2", "--quiet"])  # as _killed ran it
    assert message in err
    assert list(out.iterdir()) == []  # made by the killed run: kept, emptied


def test_damage_found_after_the_shards_removes_them_and_their_indexes(archives, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    original = prepare_module._check_counts
    seen = []

    def one_val_image_short(per_class, devkit):
        seen.append(_files(out))
        wnid = devkit.wnids[0]
        return original({**per_class, "val": {**per_class["val"], wnid: per_class["val"][wnid] - 1}}, devkit)
    monkeypatch.setattr(prepare_module, "_check_counts", one_val_image_short)
    err = _error(capsys, ["data", "prepare", str(archives[0]), str(out), "--workers", "0", "--train-shards", "4",
                          "--val-shards", "2", "--quiet"])
    assert f"val class {archives[1].classes[0]}: 2 images written, the devkit's ground truth has 3" in err
    shards = [f for f in seen[0] if not f.startswith(STATE)]
    assert len(shards) == 2 * (SHARDS["train"] + SHARDS["val"]) and "validation-00001-of-00002.idx" in shards
    assert not out.exists()


FOLDER_PREPARE = ["--layout", "folder", "--train-shards", "4", "--val-shards", "2", "--quiet"]  # as _killed runs it
STOPPED_WORKER = """
import os, signal, sys
from aiperf_core.cli import main
from aiperf_core.data import prepare as p
original = p.run_unit
def killed_on_one_class(plan, job):
    if job[1] == "train-n04592741":
        os.kill(os.getpid(), signal.SIGKILL)
    return original(plan, job)
p.run_unit = killed_on_one_class
sys.exit(main(["data", "prepare", *sys.argv[1:], "--workers", "2"]))
"""


def _interrupted(how: str, src: Path, out: Path, capsys, monkeypatch) -> None:
    """A folder prepare of `src` into `out` stopped midway by `how`, as a user sees it."""
    argv = ["data", "prepare", str(src), str(out), *FOLDER_PREPARE, "--workers", "0"]
    if how == "SIGTERM":
        _killed(src, out, "folder", "_unit_done", 2, "SIGTERM")
    elif how == "a worker process killed":
        result = subprocess.run([sys.executable, "-c", STOPPED_WORKER, str(src), str(out), *FOLDER_PREPARE],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and "a data worker process died" in result.stderr, result.stderr
    elif how == "Ctrl-C":
        original = prepare_module._unit_done

        def interrupted(record, records):
            original(record, records)
            if len(records) == 2:
                raise KeyboardInterrupt
        with monkeypatch.context() as patch:
            patch.setattr(prepare_module, "_unit_done", interrupted)
            assert main(argv) == 130
        assert capsys.readouterr().err == "aiperf: interrupted\n"
    else:  # the disk fills in the third class
        original, calls = prepare_module._write_file, [0]

        def filling(path, data):
            calls[0] += 1
            if calls[0] == 20:  # 12 validation images, 7 of n02085620, then n02119789's first
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            original(path, data)
        with monkeypatch.context() as patch:
            patch.setattr(prepare_module, "_write_file", filling)
            assert f"{out}: cannot write there: No space left on device" in _error(capsys, argv)


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGTERM", "a full disk", "a worker process killed"])
def test_an_interrupted_prepare_keeps_what_a_rerun_resumes(archives, prepared, tmp_path, capsys, monkeypatch, how):
    src, _ = archives
    out = tmp_path / "out"
    _interrupted(how, src, out, capsys, monkeypatch)
    assert (out / STATE / "settings.json").is_file()
    if how != "a worker process killed":  # which classes the other worker finished meanwhile varies
        assert sorted(p.name for p in (out / "train").iterdir()) == ["n02085620"]
    assert main(["data", "prepare", str(src), str(out), *FOLDER_PREPARE, "--workers", "0"]) == 0
    resumed = capsys.readouterr().out
    assert how == "a worker process killed" or "resumed after 2 finished units" in resumed, resumed
    assert (out / MANIFEST).read_text() == (prepared["folder"] / MANIFEST).read_text()
    assert not (out / STATE).exists() and not list(out.glob(".*"))


def test_rerun_on_a_finished_folder_and_other_settings(archives, prepared, tmp_path, capsys):
    src, _ = archives
    out = prepared["tfrecord"]
    before = _inodes(p for p in out.iterdir())
    assert main(["data", "prepare", str(src), str(out), "--train-shards", "4", "--val-shards", "2", "--quiet"]) == 0
    assert "already prepared" in capsys.readouterr().out and _inodes(p for p in out.iterdir()) == before
    assert "already holds a prepared dataset made with other settings" in _error(
        capsys, ["data", "prepare", str(src), str(out), "--train-shards", "3", "--val-shards", "2", "--quiet"])
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert "exists and is not empty" in _error(capsys, ["data", "prepare", str(src), str(other), "--layout", "folder",
                                                        "--quiet"])
    assert "--train-shards: 99 must be between 1 and the split's 24 images" in _error(
        capsys, ["data", "prepare", str(src), str(tmp_path / "new"), "--train-shards", "99", "--quiet"])


def test_progress_line_on_stderr_and_quiet(archives, tmp_path, capsys):
    src, _ = archives
    assert main(["data", "prepare", str(src), str(tmp_path / "a"), "--layout", "folder", "--workers", "0"]) == 0
    captured = capsys.readouterr()
    assert "prepare: images: 36/36 images (100%)" in captured.err and "images/s" in captured.err
    assert "jpeg 32, jpeg_grayscale 1, jpeg_cmyk 2, png 1, other 0" in captured.out
    assert main(["data", "prepare", str(src), str(tmp_path / "b"), "--layout", "folder", "--workers", "0",
                 "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_dali_own_tfrecord_reader_reads_the_shards_through_their_index_files(prepared, archives):
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    import nvidia.dali.tfrecord as tfrec
    from nvidia.dali import fn, pipeline_def

    _, truth = archives
    shards = [str(p) for p in sorted(prepared["tfrecord"].glob("train-*-of-*[0-9]"))]

    @pipeline_def(batch_size=8, num_threads=1, device_id=None)
    def reader():
        f = fn.readers.tfrecord(path=shards, index_path=[s + ".idx" for s in shards], random_shuffle=False,
                                features={"image/encoded": tfrec.FixedLenFeature((), tfrec.string, ""),
                                          "image/class/label": tfrec.FixedLenFeature([1], tfrec.int64, -1),
                                          "image/filename": tfrec.FixedLenFeature((), tfrec.string, "")})
        return f["image/class/label"], f["image/filename"], fn.decoders.image(f["image/encoded"], device="cpu")

    pipe = reader()
    pipe.build()
    seen = []
    for _ in range(len(truth.train) // 8):
        labels, names, images = pipe.run()
        for i in range(8):
            name = bytes(names.at(i)).decode()
            assert int(labels.at(i)[0]) == truth.label(name) + 1 and images.at(i).shape[2] == 3
            seen.append(name)
    assert sorted(seen) == sorted(truth.train)


@pytest.mark.parametrize("layout, loader", [("folder", "native"), ("folder", "dali"), ("tfrecord", "native"),
                                            ("tfrecord", "dali")])
def test_a_short_real_run_trains_from_the_prepared_layout(prepared, tmp_path, layout, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    config = tmp_path / "aiperf.toml"
    config.write_text(TINY_POLICY + f'image_size = 32\ndata_loader = "{loader}"\n')
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "aiperf_core", "run", "--backend", "numpy", "--data", str(prepared[layout]),
         "--config", str(config), "--run-dir", str(run_dir), "--time-budget", "5m", "--stop-after-trials", "1"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "AIPERF_DATA_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout + result.stderr
    run = json.loads((run_dir / "run.json").read_text())
    assert run["dataset"]["name"] == "imagenet" and run["policy"]["data_loader"] == loader
    assert (run["dataset"]["train_images"], run["dataset"]["val_images"], run["dataset"]["classes"]) == (24, 12, 4)
    epochs = [json.loads(line) for line in (run_dir / "replicas/0/events.jsonl").read_text().splitlines()]
    epochs = [e for e in epochs if e["event"] == "epoch_end"]
    assert epochs and epochs[0]["train_images"] == 24 and epochs[0]["val_images"] == 12
    assert epochs[0]["skipped_images"] == 0 and np.isfinite(epochs[0]["loss"])
