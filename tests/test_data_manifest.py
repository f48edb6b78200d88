"""The dataset manifest (aiperf_core/data/manifest.py): its digest, its validation, and the quick
read of the digest that run.json and every replica start use."""

import json

import pytest

from aiperf_core.data.manifest import (MANIFEST, Manifest, ManifestError, file_entry, read_manifest,
                                       recorded_digest, verify_files, write_manifest)


@pytest.fixture
def dataset(tmp_path):
    for name, data in (("train/n2/a.JPEG", b"abc"), ("train/n1/b.JPEG", b"defg"), ("val/n1/c.JPEG", b"h"),
                       ("val/n2/d.JPEG", b"ij")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    files = {p.relative_to(tmp_path).as_posix(): file_entry(p) for p in tmp_path.rglob("*.JPEG")}
    manifest = Manifest("folder", ["n1", "n2"], {"train": {"n1": 1, "n2": 1}, "val": {"n1": 1, "n2": 1}}, files)
    write_manifest(tmp_path, manifest)
    return tmp_path, manifest


def test_digest_is_the_sorted_file_list_and_survives_a_round_trip(dataset):
    root, manifest = dataset
    again = read_manifest(root)
    assert again.digest == manifest.digest and again.images == {"train": 2, "val": 2} and not again.official
    reordered = Manifest("folder", ["n1", "n2"], manifest.per_class, dict(reversed(list(manifest.files.items()))))
    assert reordered.digest == manifest.digest
    renamed = dict(manifest.files)
    renamed["val/n2/e.JPEG"] = renamed.pop("val/n2/d.JPEG")
    assert Manifest("folder", [], {}, renamed).digest != manifest.digest


def test_the_quick_digest_read_agrees_with_the_whole_read(dataset, tmp_path_factory):
    root, manifest = dataset
    assert recorded_digest(root) == manifest.digest
    assert recorded_digest(None) is None and recorded_digest(tmp_path_factory.mktemp("empty")) is None
    compact = json.loads((root / MANIFEST).read_text())  # one line: the head read does not apply
    (root / MANIFEST).write_text(json.dumps(compact))
    assert recorded_digest(root) == manifest.digest
    compact["digest"] = "0" * 64
    (root / MANIFEST).write_text(json.dumps(compact))
    with pytest.raises(ManifestError, match="digest: 0+ does not match its file list"):
        recorded_digest(root)


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(format="other"), "format"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(layout="zip"), "layout"),
    (lambda d: d["files"].update({"../x": {"size": 1, "sha256": "0" * 64}}), "files.../x"),
    (lambda d: d["files"]["val/n1/c.JPEG"].update(size=-1), "files.val/n1/c.JPEG"),
    (lambda d: d["per_class"].update(test={"n1": 1}), "per_class.test"),
    (lambda d: d.pop("digest"), "digest"),
])
def test_a_malformed_manifest_is_one_error_naming_the_field(dataset, change, field):
    root, _ = dataset
    data = json.loads((root / MANIFEST).read_text())
    change(data)
    (root / MANIFEST).write_text(json.dumps(data, indent=1))
    with pytest.raises(ManifestError, match=f"{MANIFEST}: {field}"):
        read_manifest(root)


def test_verify_finds_missing_resized_and_changed_files(dataset):
    root, manifest = dataset
    assert verify_files(root, manifest, deep=True) == []
    (root / "train/n1/b.JPEG").unlink()
    (root / "val/n1/c.JPEG").write_bytes(b"hh")
    (root / "val/n2/d.JPEG").write_bytes(b"xy")
    assert verify_files(root, manifest) == ["train/n1/b.JPEG: missing", "val/n1/c.JPEG: 2 bytes, manifest says 1"]
    deep = verify_files(root, manifest, deep=True)
    assert deep[:2] == ["train/n1/b.JPEG: missing", "val/n1/c.JPEG: 2 bytes, manifest says 1"]
    assert deep[2].startswith("val/n2/d.JPEG: checksum ") and len(deep) == 3
