"""What `aiperf data check` and `aiperf data convert` do: a full scan of an ImageNet folder, and
conversion between its ImageFolder and TFRecord layouts (images are copied, never re-encoded)."""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aiperf_core.atomic import write_atomic
from aiperf_core.data import tfrecord
from aiperf_core.data.imagenet import open_imagenet
from aiperf_core.data.preprocess import CorruptImage, verify_image
from aiperf_core.data.stream import SPLITS, TRAIN, VAL, prefetch_map
from aiperf_core.errors import AiperfError

LAYOUTS = ("tfrecord", "imagefolder")
SHARD_NAMES = {TRAIN: "train", VAL: "validation"}
FOLDER_NAMES = {TRAIN: "train", VAL: "val"}
DEFAULT_SHARD_SIZE = 1024  # images per TFRecord shard: about 1250 shards for ImageNet's training set
CHUNK = 64  # images per unit of parallel work

Progress = Callable[[str, int, int], None]  # (split, done, total)


@dataclass
class SplitReport:
    images: int = 0
    classes: int = 0
    corrupt: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    path: str
    layout: str
    classes: int
    splits: dict[str, SplitReport]
    mismatch: str | None

    @property
    def ok(self) -> bool:
        return self.mismatch is None and all(s.images and not s.corrupt for s in self.splits.values())

    def to_dict(self) -> dict:
        return {"path": self.path, "layout": self.layout, "classes": self.classes, "mismatch": self.mismatch,
                "ok": self.ok, "splits": {k: {"images": v.images, "classes": v.classes, "corrupt": v.corrupt}
                                          for k, v in self.splits.items()}}


def _chunks(n: int) -> list[range]:
    return [range(start, min(start + CHUNK, n)) for start in range(0, n, CHUNK)]


def _read_chunk(source, task: tuple[str, range]) -> list[tuple[int, bytes | None, str, str | None]]:
    """(index, encoded bytes or None, stored file name, error or None) for each image of the
    task's (split, indices), each one checked by decoding it fully."""
    split, indices = task
    out = []
    for i in indices:
        try:
            data, name = source.read(split, i)
            verify_image(data, source.where(split, i))
            out.append((i, data, name, None))
        except CorruptImage as exc:
            out.append((i, None, "", str(exc)))
    return out


def _each_image(source, split: str, workers: int, progress: Progress | None):
    """Every image of a split in order, read and decoded by `workers` worker processes."""
    total = source.count(split)
    done = 0
    for chunk in prefetch_map(_read_chunk, source, ((split, r) for r in _chunks(total)), workers):
        for item in chunk:
            yield item
        done += len(chunk)
        if progress is not None:
            progress(split, done, total)


def check(path, workers: int = 4, progress: Progress | None = None) -> CheckReport:
    """Counts per split and classes, every image decoded to find the corrupt ones, and whether
    the train and val class sets agree. A missing split raises AiperfError."""
    source = open_imagenet(path, strict=False)
    splits = {}
    for split in SPLITS:
        report = SplitReport(images=source.count(split), classes=len(source.split_classes(split)))
        report.corrupt = [error for *_, error in _each_image(source, split, workers, progress) if error]
        splits[split] = report
    return CheckReport(source.path, source.layout, len(source.class_names), splits, source.mismatch)


def check_prepared(path, deep: bool = False, workers: int = 4, progress: Progress | None = None):
    """The check of a prepared or staged dataset (a folder with manifest.json): the folder against
    its manifest (sizes; `deep`: checksums), a stage.FolderCheck. None for a folder without one,
    which `check` scans instead. Images are not decoded: `aiperf data prepare` decoded each one, and
    the checksums prove the bytes are still those."""
    from aiperf_core.data.stage import verify_folder

    counting = None if progress is None else (lambda done, total: progress("checksums", done, total))
    return verify_folder(path, deep, workers, counting)


def _safe_name(name: str, fallback: str) -> str:
    """A file or folder name from stored text: no separators, no dot-only names."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(name))
    return cleaned if cleaned.strip(".") else fallback


def convert(src, dst, to: str, workers: int = 4, shard_size: int = DEFAULT_SHARD_SIZE,
            progress: Progress | None = None) -> dict:
    """Write the dataset at `src` to `dst` in layout `to`. Images that cannot be read or decoded
    are left out and counted. Returns {split: {"written": n, "skipped": [errors]}}."""
    if to not in LAYOUTS:
        raise AiperfError(f"--to: unknown layout {to!r} (choose from {', '.join(LAYOUTS)})")
    if shard_size < 1:
        raise AiperfError(f"--shard-size: must be >= 1, got {shard_size}")
    source = open_imagenet(src)
    if source.layout == to:
        raise AiperfError(f"{src}: already in the {to} layout")
    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise AiperfError(f"{dst}: exists and is not an empty folder (refusing to overwrite)")
    dst.mkdir(parents=True, exist_ok=True)
    result = {}
    for split in SPLITS:
        images = _each_image(source, split, workers, progress)
        if to == "tfrecord":
            written, skipped = _write_shards(source, split, images, dst, shard_size)
        else:
            written, skipped = _write_folders(source, split, images, dst)
        result[split] = {"written": written, "skipped": skipped}
    return result


def _example(source, split: str, index: int, data: bytes, stored_name: str) -> bytes:
    label = int(source.labels(split)[index])
    synset = source.class_names[label]
    return tfrecord.encode_example({
        "image/encoded": [data],
        "image/format": [b"JPEG"],
        "image/class/label": [label + 1],  # 1-based, as the common ImageNet conversion writes it
        "image/class/synset": [synset.encode("utf-8")],
        "image/filename": [stored_name.encode("utf-8")],
    })


def _write_shards(source, split: str, images, dst: Path, shard_size: int) -> tuple[int, list[str]]:
    total = source.count(split)
    shards = max(1, -(-total // shard_size))
    written, skipped, buffer, number = 0, [], io.BytesIO(), 0

    def flush():
        nonlocal buffer, number
        data = buffer.getvalue()
        write_atomic(dst / f"{SHARD_NAMES[split]}-{number:05d}-of-{shards:05d}", lambda fh: fh.write(data))
        buffer, number = io.BytesIO(), number + 1

    seen = 0
    for index, data, stored_name, error in images:
        seen += 1
        if error:
            skipped.append(error)
        else:
            buffer.write(tfrecord.frame(_example(source, split, index, data, stored_name)))
            written += 1
        if seen % shard_size == 0:
            flush()
    if seen % shard_size or number < shards:
        flush()
    return written, skipped


def _write_folders(source, split: str, images, dst: Path) -> tuple[int, list[str]]:
    written, skipped, used = 0, [], set()
    for index, data, stored_name, error in images:
        if error:
            skipped.append(error)
            continue
        label = int(source.labels(split)[index])
        folder = dst / FOLDER_NAMES[split] / _safe_name(source.class_names[label], f"class_{label}")
        name = _safe_name(stored_name, "")
        if not name or (folder / name) in used:
            name = f"{index:08d}.JPEG"
        used.add(folder / name)
        write_atomic(folder / name, lambda fh, d=data: fh.write(d))
        written += 1
    return written, skipped
