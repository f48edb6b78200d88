"""ImageNet on disk, in either of its two common layouts, found automatically.

ImageFolder: PATH/train/<class>/<image>.JPEG and PATH/val/<class>/<image>.JPEG ('validation' is
accepted for 'val'). Classes are the folder names, sorted; images the files with an image
extension, sorted.

TFRecord: shards PATH/train-*-of-* and PATH/validation-*-of-* ('val-*' accepted), each record a
tf.train.Example with image/encoded (the JPEG) and image/class/label (an int64, 1-based in the
usual conversion), plus image/class/synset when present. Classes are the synsets when the records
have them, else the label values; either way sorted, so the class index does not depend on whether
labels start at 0 or 1. Random access needs each record's offset, which takes one pass over a
shard: it is done once and kept in an index file (offsets, lengths, class keys) in the cache folder
$AIPERF_DATA_CACHE (default ~/.cache/aiperf/data), keyed by the shard's path, size and mtime. A
record whose checksum is wrong stays in the index with class key '' and is skipped when read.
"""

from __future__ import annotations

import abc
import hashlib
import io
import os
from pathlib import Path

import numpy as np

from aiperf_core.atomic import write_atomic
from aiperf_core.data import tfrecord
from aiperf_core.data.preprocess import CorruptImage
from aiperf_core.data.stream import SPLITS, TRAIN, VAL, ImageSource
from aiperf_core.errors import AiperfError

NAME = "imagenet"
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
SPLIT_FOLDERS = {TRAIN: ("train",), VAL: ("val", "validation")}
SHARD_PREFIXES = {TRAIN: ("train-",), VAL: ("validation-", "val-")}
INDEX_VERSION = 1


class ClassMismatch(AiperfError):
    pass


def _class_order(keys) -> list[str]:
    """Sorted class keys: numerically when they are all integers (TFRecord labels), else as text."""
    keys = sorted(set(keys))
    if keys and all(k.lstrip("-").isdigit() for k in keys):
        return sorted(keys, key=int)
    return keys


def class_mismatch(train: list[str], val: list[str]) -> str | None:
    """A one-line description of how the class sets differ, or None when they agree."""
    only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
    if not only_train and not only_val:
        return None
    parts = []
    if only_train:
        parts.append(f"{len(only_train)} class(es) only in train ({', '.join(only_train[:5])}"
                     f"{', ...' if len(only_train) > 5 else ''})")
    if only_val:
        parts.append(f"{len(only_val)} class(es) only in val ({', '.join(only_val[:5])}"
                     f"{', ...' if len(only_val) > 5 else ''})")
    return "train and val classes differ: " + "; ".join(parts)


class _Split:
    """Per split: a class key per image and what is needed to read it."""

    def __init__(self, keys: list[str], locations, shards: list[str] | None = None):
        self.keys = keys
        # ImageFolder: a list of file paths. TFRecord: an int64 array of rows (shard number, data
        # offset, data length), compact for ImageNet's 1.28 million records.
        self.locations = locations
        self.shards = shards or []  # TFRecord shard paths
        self.labels = np.zeros(0, np.int64)


class _LayoutSource(ImageSource):
    name = NAME

    def __init__(self, path, strict: bool = True):
        self.path = str(path)
        self._splits = splits = {split: self._read_split(Path(path), split) for split in SPLITS}
        present = {s: sorted({k for k in split.keys if k}) for s, split in splits.items()}
        train_classes = _class_order(present[TRAIN])
        self.mismatch = class_mismatch(train_classes, present[VAL])
        if strict:
            for split in SPLITS:
                if not splits[split].keys:
                    raise AiperfError(f"{self.path}: split '{split}' is empty")
            if self.mismatch:
                raise ClassMismatch(f"{self.path}: {self.mismatch}")
        self.class_names = tuple(train_classes)
        position = {k: i for i, k in enumerate(self.class_names)}
        for split in splits.values():
            # -1: a record whose class cannot be read (it is skipped when loaded) or a val class
            # missing from train (only possible when strict is off, for `aiperf data check`).
            split.labels = np.array([position.get(k, -1) for k in split.keys], np.int64)

    @abc.abstractmethod
    def _read_split(self, root: Path, split: str) -> _Split:
        """The split's images; raises AiperfError naming the split when it is missing."""

    def labels(self, split: str) -> np.ndarray:
        return self._splits[split].labels

    def split_classes(self, split: str) -> list[str]:
        """The classes that have images in the split (which may differ from class_names)."""
        return _class_order(k for k in self._splits[split].keys if k)


# -- ImageFolder -------------------------------------------------------------------------------


def _split_folder(root: Path, split: str) -> Path | None:
    for name in SPLIT_FOLDERS[split]:
        if (root / name).is_dir():
            return root / name
    return None


def _scan_folder(folder: Path) -> _Split:
    keys, files = [], []
    for class_dir in sorted((e for e in os.scandir(folder) if e.is_dir()), key=lambda e: e.name):
        names = sorted(e.name for e in os.scandir(class_dir.path)
                       if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES))
        keys += [class_dir.name] * len(names)
        files += [os.path.join(class_dir.path, n) for n in names]
    return _Split(keys, files)


class ImageFolderSource(_LayoutSource):
    layout = "imagefolder"

    def _read_split(self, root: Path, split: str) -> _Split:
        folder = _split_folder(root, split)
        if folder is None:
            raise AiperfError(f"{root}: split '{split}' is missing (expected folder "
                              f"{' or '.join(SPLIT_FOLDERS[split])}/<class>/*.JPEG)")
        return _scan_folder(folder)

    def where(self, split: str, index: int) -> str:
        return self._splits[split].locations[index]

    def encoded(self, split: str, index: int) -> bytes:
        where = self.where(split, index)
        try:
            with open(where, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise CorruptImage(f"{where}: cannot read ({exc.strerror or exc})") from None

    def files(self, split: str) -> list[str]:
        return list(self._splits[split].locations)


# -- TFRecord ----------------------------------------------------------------------------------


INDEX_SUFFIX = ".idx"  # DALI's per-shard record index (tfrecord2idx), kept beside the shard


def shard_files(root: Path, split: str) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.name.startswith(SHARD_PREFIXES[split])
                  and not p.name.endswith(INDEX_SUFFIX))


def cache_folder() -> Path:
    return Path(os.environ.get("AIPERF_DATA_CACHE") or Path.home() / ".cache" / "aiperf" / "data")


def record_class_key(features: dict) -> str:
    synset = features.get("image/class/synset")
    if synset:
        return synset[0].decode("utf-8", "replace")
    label = features.get("image/class/label")
    if label:
        return str(int(label[0]))
    raise tfrecord.CorruptRecord("no image/class/label")


def build_index(shard: Path) -> dict[str, np.ndarray]:
    """Offsets, lengths and class keys of every record of a shard (one pass over it)."""
    offsets, lengths, keys = [], [], []
    with open(shard, "rb") as fh:
        while True:
            start = fh.tell()
            try:
                length = tfrecord.read_header(fh, f"{shard} @{start}")
            except tfrecord.CorruptRecord:
                offsets.append(start), lengths.append(-1), keys.append("")  # unframeable rest of file
                break
            if length is None:
                break
            offset = fh.tell()
            data, footer = fh.read(length), fh.read(tfrecord.FOOTER.size)
            offsets.append(offset), lengths.append(length)
            try:
                tfrecord.check_data(data, footer, length, str(shard))
                keys.append(record_class_key(tfrecord.decode_example(data)))
            except tfrecord.CorruptRecord:
                keys.append("")
    return {"offsets": np.array(offsets, np.int64), "lengths": np.array(lengths, np.int64),
            "keys": np.array(keys, dtype=str)}


def shard_index(shard: Path) -> dict[str, np.ndarray]:
    """The shard's index from the cache, built and cached when missing or stale."""
    stat = shard.stat()
    tag = f"{INDEX_VERSION}|{shard.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    cached = cache_folder() / "tfrecord-index" / (hashlib.sha256(tag.encode()).hexdigest()[:32] + ".npz")
    if cached.is_file():
        try:
            with np.load(cached, allow_pickle=False) as z:
                return {k: z[k] for k in ("offsets", "lengths", "keys")}
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache entry is rebuilt
    index = build_index(shard)

    def write(fh):
        buf = io.BytesIO()
        np.savez(buf, **index)
        fh.write(buf.getvalue())

    try:
        write_atomic(cached, write)
    except OSError:
        pass  # a read-only cache only costs the next run another pass
    return index


class TFRecordSource(_LayoutSource):
    layout = "tfrecord"

    def _read_split(self, root: Path, split: str) -> _Split:
        shards = shard_files(root, split)
        if not shards:
            raise AiperfError(f"{root}: split '{split}' is missing (expected TFRecord shards "
                              f"{' or '.join(p + '*' for p in SHARD_PREFIXES[split])})")
        keys, locations = [], []
        for number, shard in enumerate(shards):
            index = shard_index(shard)
            keys += [str(k) for k in index["keys"]]
            locations.append(np.stack([np.full(len(index["offsets"]), number, np.int64), index["offsets"],
                                       index["lengths"]], axis=1))
        return _Split(keys, np.concatenate(locations), [str(s) for s in shards])

    def where(self, split: str, index: int) -> str:
        number, offset, _ = (int(v) for v in self._splits[split].locations[index])
        return f"{self._splits[split].shards[number]} @{offset}"

    def encoded(self, split: str, index: int) -> bytes:
        return self.read(split, index)[0]

    def read(self, split: str, index: int) -> tuple[bytes, str]:
        part = self._splits[split]
        number, offset, length = (int(v) for v in part.locations[index])
        where = f"{part.shards[number]} @{offset}"
        if length < 0:
            raise CorruptImage(f"{where}: unreadable record framing")
        try:
            with open(part.shards[number], "rb") as fh:
                data = tfrecord.read_at(fh, offset, length, where)
            features = tfrecord.decode_example(data)
        except tfrecord.CorruptRecord as exc:
            raise CorruptImage(str(exc)) from None
        except OSError as exc:
            raise CorruptImage(f"{where}: cannot read ({exc.strerror or exc})") from None
        image, filename = features.get("image/encoded"), features.get("image/filename")
        if not image:
            raise CorruptImage(f"{where}: record has no image/encoded")
        return image[0], filename[0].decode("utf-8", "replace") if filename else ""

    def shards(self, split: str) -> list[str]:
        return list(self._splits[split].shards)


# -- layout detection ----------------------------------------------------------------------------


def detect_layout(path) -> str:
    root = Path(path)
    if not root.exists():
        raise AiperfError(f"{root}: no such dataset folder")
    if not root.is_dir():
        raise AiperfError(f"{root}: not a folder (expected an ImageFolder tree or TFRecord shards)")
    if any(_split_folder(root, s) for s in SPLITS):
        return "imagefolder"
    if any(shard_files(root, s) for s in SPLITS):
        return "tfrecord"
    raise AiperfError(f"{root}: neither an ImageFolder tree (train/<class>/*.JPEG) nor TFRecord shards "
                      f"(train-*, validation-*)")


def open_imagenet(path, strict: bool = True) -> _LayoutSource:
    """The ImageNet source at `path`, layout detected. strict: an empty split or different train
    and val class sets raise AiperfError (the check before training); otherwise they are recorded
    (`mismatch`) for `aiperf data check` to report."""
    layout = detect_layout(path)
    return ImageFolderSource(path, strict) if layout == "imagefolder" else TFRecordSource(path, strict)
