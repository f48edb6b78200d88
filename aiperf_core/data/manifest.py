"""The manifest of a prepared dataset: what `aiperf data prepare` writes last, and what
`aiperf data stage`, `aiperf data check` and `aiperf run` read.

`OUT/manifest.json` lists every file of the dataset (relative POSIX path, size, SHA-256), the
image counts per split and per class, the source archives' sizes, how many images were converted
and why, and the dataset digest. A byte-level text dataset (layout "bytes": enwik8, from
aiperf_core/data/enwik8.py) has no classes or images: its manifest gives each split's byte count
instead (`split_bytes`, one file `<split>.bin` per split), and its `extra` what the source was.

The digest is the dataset's one identity: a SHA-256 over the sorted (path, size, SHA-256) of every
listed file, so two folders with the same digest hold the same bytes under the same names, whatever
machine wrote them. run.json's `dataset.digest` and each replica's `dataset_digest` are this value.

The manifest is written after every listed file is complete, so its presence means the dataset is
complete. manifest.json itself is not listed (it holds the digest of the others).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from aiperf_core.atomic import write_text_atomic
from aiperf_core.errors import AiperfError

MANIFEST = "manifest.json"
FORMAT = "aiperf-dataset-manifest"
VERSION = 1
IMAGE_LAYOUTS = ("tfrecord", "folder")
BYTES = "bytes"  # byte-level text: one raw file <split>.bin per split
LAYOUTS = IMAGE_LAYOUTS + (BYTES,)
SPLITS = ("train", "val")
BYTE_SPLITS = ("train", "val", "test")
# The official ILSVRC2012 classification set (the devkit's own figures).
OFFICIAL_CLASSES = 1000
OFFICIAL_IMAGES = {"train": 1_281_167, "val": 50_000}
# enwik8 (the first 10^8 bytes of an English Wikipedia dump, Hutter Prize) and its standard split:
# the first 90,000,000 bytes train, the next 5,000,000 validation, the last 5,000,000 test.
ENWIK8 = "enwik8"
ENWIK8_BYTES = 100_000_000
OFFICIAL_SPLIT_BYTES = {"train": 90_000_000, "val": 5_000_000, "test": 5_000_000}
CHUNK = 1 << 20


class ManifestError(AiperfError):
    pass


@dataclass
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    layout: str                                 # one of LAYOUTS
    classes: list[str]                          # WNIDs in label order (sorted)
    per_class: dict[str, dict[str, int]]        # split -> WNID -> images
    files: dict[str, FileEntry]                 # relative POSIX path -> size and checksum
    sources: dict[str, int] = field(default_factory=dict)       # archive name -> bytes
    conversions: dict[str, int] = field(default_factory=dict)   # kind of image -> count
    extra: dict[str, Any] = field(default_factory=dict)         # anything else the writer records
    split_bytes: dict[str, int] = field(default_factory=dict)   # layout "bytes": split -> bytes of <split>.bin

    @property
    def images(self) -> dict[str, int]:
        return {split: sum(counts.values()) for split, counts in self.per_class.items()}

    @property
    def digest(self) -> str:
        return dataset_digest(self.files)

    @property
    def official(self) -> bool:
        """Images: the complete official ILSVRC2012 set, 1,000 classes and the devkit's image totals.
        Bytes: enwik8 whole (its 100,000,000 bytes) in the standard split."""
        if self.layout == BYTES:
            return (self.extra.get("dataset") == ENWIK8 and self.extra.get("member_bytes") == ENWIK8_BYTES
                    and self.split_bytes == OFFICIAL_SPLIT_BYTES)
        return (len(self.classes) == OFFICIAL_CLASSES and self.images == OFFICIAL_IMAGES
                and all(set(self.per_class[split]) == set(self.classes) for split in SPLITS))

    def to_dict(self) -> dict[str, Any]:
        # split_bytes only in a bytes manifest: an image manifest keeps exactly its former keys.
        by_split = {"split_bytes": {s: self.split_bytes[s] for s in BYTE_SPLITS if s in self.split_bytes}} \
            if self.layout == BYTES else {}
        return {"format": FORMAT, "version": VERSION, "layout": self.layout, "digest": self.digest,
                "official": self.official, "images": self.images, **by_split, "classes": list(self.classes),
                "per_class": {split: dict(sorted(counts.items())) for split, counts in self.per_class.items()},
                "files": {path: {"size": e.size, "sha256": e.sha256} for path, e in sorted(self.files.items())},
                "sources": dict(sorted(self.sources.items())), "conversions": dict(sorted(self.conversions.items())),
                **({"extra": self.extra} if self.extra else {})}


def dataset_digest(files: dict[str, FileEntry]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(f"{path}\t{files[path].size}\t{files[path].sha256}\n".encode())
    return h.hexdigest()


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entry(path: str | os.PathLike) -> FileEntry:
    return FileEntry(os.path.getsize(path), file_sha256(path))


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> Path:
    path = Path(folder) / MANIFEST
    write_text_atomic(path, json.dumps(manifest.to_dict(), indent=1) + "\n")
    return path


def read_manifest(folder: str | os.PathLike) -> Manifest | None:
    """The manifest of `folder`; None when it has none. A malformed one is an error naming the field,
    and so is one whose recorded digest does not match its file list."""
    path = Path(folder) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from None

    def need(key: str, kind: type | tuple[type, ...]):
        if not isinstance(data, dict) or not isinstance(data.get(key), kind):
            raise ManifestError(f"{path}: {key}: missing or not {getattr(kind, '__name__', 'valid')}")
        return data[key]

    if need("format", str) != FORMAT:
        raise ManifestError(f"{path}: format: {data['format']!r} is not {FORMAT!r}")
    if need("version", int) != VERSION:
        raise ManifestError(f"{path}: version: {data['version']} is not supported (this aiperf reads {VERSION})")
    layout = need("layout", str)
    if layout not in LAYOUTS:
        raise ManifestError(f"{path}: layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    classes = need("classes", list)
    if not all(isinstance(c, str) and c for c in classes):
        raise ManifestError(f"{path}: classes: must be a list of non-empty strings")
    per_class = need("per_class", dict)
    for split, counts in per_class.items():
        if split not in SPLITS or not isinstance(counts, dict) or not all(
                isinstance(n, int) and n >= 0 for n in counts.values()):
            raise ManifestError(f"{path}: per_class.{split}: must be an object of class -> image count")
    files: dict[str, FileEntry] = {}
    for name, entry in need("files", dict).items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0
                or not isinstance(entry.get("sha256"), str) or len(entry["sha256"]) != 64):
            raise ManifestError(f"{path}: files.{name}: must be {{size, sha256}}")
        if name.startswith("/") or ".." in name.split("/") or name == MANIFEST:
            raise ManifestError(f"{path}: files.{name}: not a path inside the dataset")
        files[name] = FileEntry(entry["size"], entry["sha256"])
    split_bytes = _split_bytes(path, data, layout, classes, per_class, files)
    manifest = Manifest(layout, list(classes), {s: dict(c) for s, c in per_class.items()}, files,
                        dict(data.get("sources") or {}), dict(data.get("conversions") or {}),
                        dict(data.get("extra") or {}), split_bytes)
    recorded = need("digest", str)
    if recorded != manifest.digest:
        raise ManifestError(f"{path}: digest: {recorded} does not match its file list ({manifest.digest})")
    return manifest


def _split_bytes(path: Path, data: dict, layout: str, classes: list, per_class: dict,
                 files: dict[str, FileEntry]) -> dict[str, int]:
    """A bytes manifest's split_bytes, checked against its file list; {} for an image manifest."""
    if layout != BYTES:
        if "split_bytes" in data:
            raise ManifestError(f"{path}: split_bytes: only a manifest of layout {BYTES!r} has it")
        return {}
    if classes or per_class:
        raise ManifestError(f"{path}: {'classes' if classes else 'per_class'}: must be empty in a manifest of "
                            f"layout {BYTES!r}")
    split_bytes = data.get("split_bytes")
    if (not isinstance(split_bytes, dict) or set(split_bytes) != set(BYTE_SPLITS)
            or not all(type(n) is int and n > 0 for n in split_bytes.values())):
        raise ManifestError(f"{path}: split_bytes: must be an object of {', '.join(BYTE_SPLITS)} -> bytes (> 0)")
    for split in BYTE_SPLITS:
        entry = files.get(f"{split}.bin")
        if entry is None or entry.size != split_bytes[split]:
            listed = "not listed" if entry is None else f"listed with {entry.size:,} bytes"
            raise ManifestError(f"{path}: split_bytes.{split}: {split_bytes[split]:,} bytes, but files.{split}.bin "
                                f"is {listed}")
    return {split: split_bytes[split] for split in BYTE_SPLITS}


def recorded_digest(folder: str | os.PathLike | None) -> str | None:
    """The digest `folder`'s manifest records; None for no folder or one without a manifest. What
    run.json's `dataset.digest` and each replica's `dataset_digest` hold. The data is not read, and
    neither is the file list when the manifest is as write_manifest writes it: the digest sits in
    its first lines, and a folder-layout ImageNet manifest lists 1.33 M files (~170 MB of JSON) that
    every replica start would otherwise parse. `aiperf data stage` and `aiperf data check` are what
    hold the files to that list."""
    if not folder:
        return None
    try:
        with open(Path(folder) / MANIFEST, "rb") as f:
            head = f.read(HEAD_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"{Path(folder) / MANIFEST}: cannot read: {exc.strerror or exc}") from None
    found = _HEAD_DIGEST.search(head)
    if found and f'"format": "{FORMAT}"' in head:
        return found.group(1)
    manifest = read_manifest(folder)  # not written by write_manifest: read and check it whole
    return None if manifest is None else manifest.digest


HEAD_BYTES = 4096
_HEAD_DIGEST = re.compile(r'^ "digest": "([0-9a-f]{64})",$', re.MULTILINE)


def verify_files(folder: str | os.PathLike, manifest: Manifest, deep: bool = False,
                 names: Iterable[str] | None = None, workers: int = 0,
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Every problem of `folder`'s copy of the manifest's files (all, or `names`): a missing file, a
    size that differs and, with `deep`, a checksum that differs. One line each; empty when it holds."""
    root = Path(folder)
    names = sorted(manifest.files if names is None else names)
    problems: list[str] = []
    to_hash: list[str] = []
    for name in names:
        expected = manifest.files[name]
        try:
            size = os.path.getsize(root / name)
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != expected.size:
            problems.append(f"{name}: {size:,} bytes, manifest says {expected.size:,}")
        elif deep:
            to_hash.append(name)
    if to_hash:
        paths = [str(root / name) for name in to_hash]
        if workers > 1:
            from concurrent.futures import ProcessPoolExecutor
            with ProcessPoolExecutor(workers) as pool:
                sums = pool.map(file_sha256, paths, chunksize=8)
                checked = _progressing(zip(to_hash, sums), len(to_hash), progress)
                problems.extend(_checksum_problems(checked, manifest))
        else:
            checked = _progressing(((n, file_sha256(p)) for n, p in zip(to_hash, paths)), len(to_hash), progress)
            problems.extend(_checksum_problems(checked, manifest))
    return problems


def _progressing(pairs, total: int, progress):
    for done, pair in enumerate(pairs, start=1):
        if progress is not None:
            progress(done, total)
        yield pair


def _checksum_problems(checked, manifest: Manifest) -> list[str]:
    return [f"{name}: checksum {digest[:12]}... differs from the manifest's {manifest.files[name].sha256[:12]}..."
            for name, digest in checked if digest != manifest.files[name].sha256]
