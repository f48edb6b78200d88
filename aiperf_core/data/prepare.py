"""`aiperf data prepare`: ImageNet from the three official archives to TFRecord shards or an
ImageFolder tree, streamed, in parallel, restartable, ending with OUT/manifest.json.

Streaming. Nothing is extracted: the parent lists the outer train tar's headers once, and each worker
reads one inner `<wnid>.tar` in one positioned read and parses it in memory; the validation tar is
cut into runs of VAL_CHUNK consecutive images, read the same way. Each archive byte is read once.

Units and outputs. A unit is a train class or a validation chunk; units run on `workers` processes.
- folder: a train unit writes its class folder under OUT/.prepare/ and renames it into
  OUT/train/<wnid> (atomic); validation images are gathered per class under OUT/.prepare/ and each
  class folder is renamed into OUT/val/<wnid> once every chunk is done.
- tfrecord: a shard mixes images of every class (a seeded permutation of the whole split decides
  each image's shard and place), so no shard can be written before the last class is read. A unit
  therefore writes its finished records (encoded, framed, checksummed) to spool files under
  OUT/.prepare/, one per group of GROUP_SHARDS shards, in shard order; then each shard is assembled
  from the spools (concatenation in permutation order, no re-encoding) and written atomically with
  its DALI index, and each group's spools are deleted as soon as its shards are complete. The spool is
  the output's own bytes: the disk holds the archives, the output and at most one group of spool
  beyond it.

Restart. Every unit records what it wrote (OUT/.prepare/units/*.json, each file's size and
SHA-256) after its outputs are complete, and every shard its record before the shard appears; a run
over the same OUT skips what is recorded, so a killed run resumes without redoing finished work or
leaving a half file. OUT/.prepare/ is removed once the manifest is written. Archives found damaged
while converting (an inner tar, an image that cannot be decoded, a count that contradicts the
devkit) are refused with every shard or class folder written removed, and the resume state with
them: no rerun over the same archives could finish (prepare_out.py).

Content, not names. Each image's format is read from its bytes: a JPEG's components (from its
frame header: 3 kept, 1 grayscale, 4 CMYK/YCCK) or the PNG signature. Grayscale and CMYK JPEGs and
PNGs are decoded and re-encoded as RGB JPEG at quality JPEG_QUALITY with 4:4:4 chroma (as close to
the original pixels as baseline JPEG goes; TensorFlow's conversion re-encodes CMYK and PNG at
quality 100 too); every other file keeps its bytes exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from aiperf_core.atomic import write_atomic, write_text_atomic
from aiperf_core.data import ilsvrc, tfrecord
from aiperf_core.data.crc32c import masked_crc32c
from aiperf_core.data.imagenet import INDEX_SUFFIX
from aiperf_core.data.manifest import FileEntry, Manifest, write_manifest
from aiperf_core.data.prepare_out import (STATE, PrepareError, SourceDamagedError, claim_out,
                                          discarded_if_source_damaged, read_state_json, remove_stale_temporaries)
from aiperf_core.data.stream import prefetch_map
from aiperf_core.workflow.duration import format_duration

LAYOUTS = ("tfrecord", "folder")
TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)
SHARD_PREFIX = {TRAIN: "train", VAL: "validation"}  # as the common conversion names them
DEFAULT_SHARDS = {TRAIN: 1024, VAL: 128}
SHUFFLE_SEED = 12345  # the seed of TensorFlow's build_imagenet_data.py; part of the dataset's identity
GROUP_SHARDS = 64  # shards per spool group: the spool left beside the output is at most one group
VAL_CHUNK = 1000  # validation images per unit
JPEG_QUALITY = 100
KINDS = ("jpeg", "jpeg_grayscale", "jpeg_cmyk", "png", "other")  # "jpeg": an RGB (YCbCr) JPEG, kept
CONVERTED = ("jpeg_grayscale", "jpeg_cmyk", "png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# -- what an image really is ---------------------------------------------------------------------


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """(components, height, width) from a JPEG's frame header (SOFn), or None if `data` is not a
    JPEG whose header can be read. Only the marker segments before the frame are walked."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # segments without a length
            pos += 2
            continue
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if pos + 10 > end:
                return None
            height = data[pos + 5] << 8 | data[pos + 6]
            width = data[pos + 7] << 8 | data[pos + 8]
            return data[pos + 9], height, width
        if marker == 0xDA:  # scan data before any frame header
            return None
        pos += 2 + (data[pos + 2] << 8 | data[pos + 3])
    return None


def image_kind(data: bytes) -> tuple[str, int, int]:
    """(kind, height, width): kind one of KINDS; height and width 0 where the header does not say."""
    frame = jpeg_frame(data)
    if frame is not None:
        components, height, width = frame
        kind = {3: "jpeg", 1: "jpeg_grayscale", 4: "jpeg_cmyk"}.get(components, "other")
        return kind, height, width
    if data.startswith(PNG_SIGNATURE) and len(data) >= 24:
        return "png", int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")
    return "other", 0, 0


def rgb_jpeg(data: bytes, where: str) -> tuple[bytes, int, int]:
    """The image decoded and re-encoded as an RGB JPEG: (bytes, height, width)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except Exception as exc:  # Pillow raises OSError, SyntaxError, ValueError... on damaged images
        raise SourceDamagedError(f"{where}: cannot be decoded for conversion to RGB JPEG ({exc})") from None
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=JPEG_QUALITY, subsampling=0)
    return out.getvalue(), rgb.height, rgb.width


def normalised(data: bytes, where: str) -> tuple[bytes, str, int, int]:
    """(stored bytes, kind, height, width): RGB JPEGs and unknown files as they are, the rest converted."""
    kind, height, width = image_kind(data)
    if kind in CONVERTED:
        data, height, width = rgb_jpeg(data, where)
    return data, kind, height, width


# -- settings, plan and resume state ---------------------------------------------------------------


@dataclass
class Plan:
    """What every worker needs, sent once per worker process."""
    source: dict[str, str]
    out: str
    layout: str
    classes: list[str]
    words: dict[str, str]
    train_counts: dict[str, int]
    val_wnids: list[str]
    shards: dict[str, int]
    positions: dict[str, np.ndarray] = field(default_factory=dict)   # split -> image -> place in the split
    labels: dict[str, int] = field(init=False)                        # WNID -> 0-based class index

    def __post_init__(self):
        self.labels = {wnid: i for i, wnid in enumerate(self.classes)}

    @property
    def state(self) -> Path:
        return Path(self.out) / STATE

    def shard_name(self, split: str, shard: int) -> str:
        return shard_name(split, shard, self.shards[split])


def shard_name(split: str, shard: int, shards: int) -> str:
    return f"{SHARD_PREFIX[split]}-{shard:05d}-of-{shards:05d}"


def _shard_of(position: int, total: int, shards: int) -> int:
    """Shard s holds the places [s * total // shards, (s + 1) * total // shards)."""
    shard = position * shards // total
    while (shard + 1) * total // shards <= position:
        shard += 1
    while shard * total // shards > position:
        shard -= 1
    return shard


def _positions(total: int, seed: int, split: str) -> np.ndarray:
    order = np.random.default_rng([seed, SPLITS.index(split)]).permutation(total)
    positions = np.empty(total, np.int64)
    positions[order] = np.arange(total, dtype=np.int64)
    return positions


def _settings(layout: str, shards: dict[str, int], sources: dict[str, int]) -> dict:
    return {"layout": layout, "seed": SHUFFLE_SEED, "train_shards": shards[TRAIN], "val_shards": shards[VAL],
            "val_chunk": VAL_CHUNK, "group_shards": GROUP_SHARDS, "jpeg_quality": JPEG_QUALITY,
            "sources": sources}


def _settings_for_layout(settings: dict) -> dict:
    """The settings that shape the output (shard counts and seed mean nothing to a folder tree)."""
    if settings["layout"] == "folder":
        return {k: v for k, v in settings.items() if k not in ("train_shards", "val_shards", "seed", "group_shards")}
    return settings


def _unit_record(plan: Plan, name: str) -> Path:
    return plan.state / "units" / f"{name}.json"


# -- the units ---------------------------------------------------------------------------------------


def _read_span(path: str, offset: int, size: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = os.pread(fh.fileno(), size, offset)
    except OSError as exc:  # the archive, not OUT; perhaps for a moment (a rerun resumes)
        raise PrepareError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) != size:
        raise SourceDamagedError(f"{path}: truncated: {size:,} bytes expected at offset {offset:,}")
    return data


def _train_images(plan: Plan, wnid: str, member: ilsvrc.Member) -> list[tuple[str, str, bytes, int]]:
    """(file name, WNID, bytes, image number in the split) of one class, from its inner tar."""
    where = f"{plan.source[ilsvrc.TRAIN_TAR]}:{member.name}"
    data = _read_span(plan.source[ilsvrc.TRAIN_TAR], member.offset, member.size)
    try:
        members = sorted(ilsvrc.tar_members(io.BytesIO(data), len(data), where), key=lambda m: m.name)
    except ilsvrc.ArchiveError as exc:
        raise SourceDamagedError(str(exc)) from None
    expected = plan.train_counts[wnid]
    if len(members) != expected:
        raise SourceDamagedError(f"train class {wnid}: {len(members):,} images in {member.name}, the devkit's "
                                 f"meta.mat says num_train_images = {expected:,}")
    first = sum(plan.train_counts[c] for c in plan.classes[:plan.labels[wnid]])
    view = memoryview(data)
    out = []
    for k, m in enumerate(members):
        name = _file_name(m.name, where)
        out.append((name, wnid, view[m.offset:m.offset + m.size], first + k))
    return out


def _val_images(plan: Plan, members: list[tuple[int, ilsvrc.Member]]) -> list[tuple[str, str, bytes, int]]:
    path = plan.source[ilsvrc.VAL_TAR]
    start = members[0][1].offset
    end = max(m.offset + m.size for _, m in members)
    view = memoryview(_read_span(path, start, end - start))
    return [(_file_name(m.name, path), plan.val_wnids[number - 1], view[m.offset - start:m.offset - start + m.size],
             number - 1) for number, m in members]


def _file_name(name: str, where: str) -> str:
    base = name.rsplit("/", 1)[-1]
    if not base or base.startswith(".") or "\\" in base:
        raise SourceDamagedError(f"{where}: {name!r} is not a usable image file name")
    return base


def _class_features(plan: Plan, wnid: str) -> bytes:
    """The serialized map entries of the features every image of a class shares."""
    return _entries({
        "image/class/label": [plan.labels[wnid] + 1],  # 1-based, as the common conversion writes it
        "image/class/synset": [wnid.encode()],
        "image/class/text": [plan.words[wnid].encode("utf-8")],
        "image/channels": [3],
        "image/colorspace": [b"RGB"],
        "image/format": [b"JPEG"],
    })


def _entries(features: dict) -> bytes:
    """tf.train.Features' map entries (an Example is field 1 holding them), as tfrecord.encode_example writes them."""
    return _strip_prefix(tfrecord.encode_example(features))


def _strip_prefix(message: bytes) -> bytes:
    pos = 1  # the tag byte of field 1, then the payload's length
    while message[pos] & 0x80:
        pos += 1
    return message[pos + 1:]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _prefix(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length."""
    return _varint(number << 3 | 2) + _varint(length)


_ENCODED_KEY = _prefix(1, len(b"image/encoded")) + b"image/encoded"


def _example(shared: bytes, name: str, data: bytes, height: int, width: int) -> bytes:
    """The tf.train.Example of an image: the class's shared entries, then the image's own, the
    image bytes copied once (tfrecord.encode_example nests them five times; this is the hot path)."""
    own = _entries({"image/height": [height], "image/width": [width], "image/filename": [name.encode("utf-8")]})
    bytes_list = _prefix(1, len(data))                                   # BytesList.value
    feature = _prefix(1, len(bytes_list) + len(data))                    # Feature.bytes_list
    value = _prefix(2, len(feature) + len(bytes_list) + len(data))       # map entry value
    entry_length = len(_ENCODED_KEY) + len(value) + len(feature) + len(bytes_list) + len(data)
    entry = _prefix(1, entry_length)                                     # Features.feature entry
    body = len(shared) + len(own) + len(entry) + entry_length
    return b"".join((_prefix(1, body), shared, own, entry, _ENCODED_KEY, value, feature, bytes_list, data))


def run_unit(plan: Plan, job: tuple) -> dict:
    """Convert one unit and write its outputs and then its record; returns the record."""
    split, name, what = job
    images = _train_images(plan, name.split("-", 1)[1], what) if split == TRAIN else _val_images(plan, what)
    counts: dict[str, int] = defaultdict(int)
    kinds: dict[str, int] = defaultdict(int)
    record: dict = {"split": split, "unit": name}
    if plan.layout == "tfrecord":
        shared = {wnid: _class_features(plan, wnid) for wnid in {image[1] for image in images}}
        spool: dict[str, list] = {}
        with _Spools(plan, split, name) as spools:
            for file_name, wnid, raw, number in images:
                data, kind, height, width = normalised(bytes(raw), f"{name}/{file_name}")
                kinds[kind] += 1
                counts[wnid] += 1
                position = int(plan.positions[split][number])
                shard = _shard_of(position, len(plan.positions[split]), plan.shards[split])
                group = shard // GROUP_SHARDS
                offset, length = spools.write(group, tfrecord.frame(_example(shared[wnid], file_name, data, height,
                                                                             width)))
                spool.setdefault(str(group), []).append([position, shard, offset, length])
        record["spool"] = {group: sorted(entries) for group, entries in sorted(spool.items(), key=lambda g: int(g[0]))}
    else:
        files = {}
        if split == TRAIN:
            wnid = name.split("-", 1)[1]
            building = plan.state / "building" / TRAIN / wnid
            shutil.rmtree(building, ignore_errors=True)
        for file_name, wnid, raw, number in images:
            data, kind, height, width = normalised(bytes(raw), f"{name}/{file_name}")
            kinds[kind] += 1
            counts[wnid] += 1
            folder = building if split == TRAIN else plan.state / "gathering" / VAL / wnid
            files[f"{split}/{wnid}/{file_name}"] = [len(data), hashlib.sha256(data).hexdigest()]
            _write_file(folder / file_name, data)
        _sync_files(plan.state / ("building" if split == TRAIN else "gathering"), files, split)
        record["files"] = files
    record["counts"] = dict(counts)
    record["conversions"] = dict(kinds)
    write_text_atomic(_unit_record(plan, name), json.dumps(record))
    if plan.layout == "folder" and split == TRAIN:
        target = Path(plan.out) / TRAIN / name.split("-", 1)[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(building, target)
        _fsync_dir(target.parent)
    return record


def _write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


def _sync_files(root: Path, files: dict, split: str) -> None:
    """fsync a unit's files after all are written (the kernel writes them back together), and their folders."""
    folders = set()
    for relative in files:
        _, wnid, name = relative.split("/")
        path = root / split / wnid / name
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folders.add(path.parent)
    for folder in folders:
        _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Spools:
    """A unit's spool files, one per shard group, each record written as soon as it is framed (so
    that a unit never holds its images' records in memory: on two cores the conversion is bound by
    memory traffic, and a record written at once is written from memory still in cache). Each file
    is renamed into place when the unit's conversion ends, without fsync: a spool is scratch, and
    what a power loss could leave damaged in it is caught at assembly by the records' own CRCs (a
    killed process loses nothing: its writes are in the page cache)."""

    def __init__(self, plan: Plan, split: str, unit: str):
        self.plan, self.split, self.unit = plan, split, unit
        self.files: dict[int, tuple[Path, Any]] = {}

    def __enter__(self) -> "_Spools":
        return self

    def write(self, group: int, record: bytes) -> tuple[int, int]:
        """(offset, length) of `record` in its group's spool."""
        entry = self.files.get(group)
        if entry is None:
            path = _spool_path(self.plan, self.split, group, self.unit)
            path.parent.mkdir(parents=True, exist_ok=True)
            entry = self.files[group] = (path, open(path.with_name(f".{path.name}.tmp"), "wb"))
        offset = entry[1].tell()
        entry[1].write(record)
        return offset, len(record)

    def __exit__(self, kind, *_):
        for path, fh in self.files.values():
            fh.close()
            if kind is None:
                os.replace(fh.name, path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(fh.name)


def _spool_path(plan: Plan, split: str, group: int, unit: str) -> Path:
    return plan.state / "spool" / split / f"group-{group:04d}" / f"{unit}.rec"


# -- shards ----------------------------------------------------------------------------------------


def _shard_record(plan: Plan, split: str, shard: int) -> Path:
    return plan.state / "shards" / f"{plan.shard_name(split, shard)}.json"


def _check_framed(record: bytes, length: int, spool: str, plan: Plan) -> None:
    """A spooled record is whole: its length and both CRC-32Cs (the spool is not fsynced)."""
    head = tfrecord.HEADER.size
    ok = len(record) == length >= head + tfrecord.FOOTER.size
    if ok:
        size, crc = tfrecord.HEADER.unpack_from(record)
        ok = (head + size + tfrecord.FOOTER.size == length and masked_crc32c(record[:8]) == crc
              and masked_crc32c(record[head:head + size]) == tfrecord.FOOTER.unpack_from(record, head + size)[0])
    if not ok:
        raise PrepareError(f"{spool}: a spooled record is damaged (a crash of the machine?): remove {plan.state} "
                           f"and rerun")


def dali_index(records: list[int]) -> bytes:
    """DALI's tfrecord2idx format: one line 'offset length' per record, in bytes of the whole record."""
    lines, offset = [], 0
    for length in records:
        lines.append(f"{offset} {length}\n")
        offset += length
    return "".join(lines).encode()


def assemble_shard(plan: Plan, job: tuple) -> dict:
    """Concatenate a shard's records from the spools in permutation order; write its DALI index, its
    record, then the shard itself (each atomically: the shard's presence means all three are done)."""
    split, shard, pieces = job
    pieces = sorted(pieces)  # (position, spool file, offset, length)
    handles: dict[str, int] = {}
    try:
        chunks = []
        for _, spool, offset, length in pieces:
            fd = handles.get(spool)
            if fd is None:
                fd = handles[spool] = os.open(spool, os.O_RDONLY)
            chunk = os.pread(fd, length, offset)
            _check_framed(chunk, length, spool, plan)
            chunks.append(chunk)
    finally:
        for fd in handles.values():
            os.close(fd)
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    index = dali_index([len(c) for c in chunks])
    name = plan.shard_name(split, shard)
    out = Path(plan.out)
    record = {name: [sum(len(c) for c in chunks), digest.hexdigest()],
              name + INDEX_SUFFIX: [len(index), hashlib.sha256(index).hexdigest()]}
    _write_shared(out / (name + INDEX_SUFFIX), [index])
    write_text_atomic(_shard_record(plan, split, shard), json.dumps(record))
    _write_shared(out / name, chunks)
    return record


def _write_shared(path: Path, pieces: list[bytes]) -> None:
    """One output file of the dataset, whole or not at all."""
    write_atomic(path, lambda fh: fh.writelines(pieces))


# -- the pipeline ------------------------------------------------------------------------------------


@dataclass
class Summary:
    out: str
    layout: str
    images: dict[str, int]
    classes: int
    conversions: dict[str, int]
    digest: str
    resumed_units: int = 0
    seconds: float = 0.0
    already_complete: bool = False


Progress = Callable[[str, int, int], None]  # (what: "images" or "shards", done, total)


def prepare(source, out, layout: str = "tfrecord", workers: int = 1, train_shards: int | None = None,
            val_shards: int | None = None, progress: Progress | None = None) -> Summary:
    """Prepare ImageNet at `out` from the official archives in `source` (shard counts default to
    DEFAULT_SHARDS). Resumes an unfinished run with the same settings; a finished one is left as it
    is; archives found damaged while converting leave nothing prepared (prepare_out.py)."""
    started = time.monotonic()
    train_shards = train_shards or DEFAULT_SHARDS[TRAIN]
    val_shards = val_shards or DEFAULT_SHARDS[VAL]
    if layout not in LAYOUTS:
        raise PrepareError(f"--layout: {layout!r} is not one of {', '.join(LAYOUTS)}")
    paths = ilsvrc.source_archives(source)
    devkit = ilsvrc.read_devkit(paths[ilsvrc.DEVKIT])
    train_members = ilsvrc.list_tar(paths[ilsvrc.TRAIN_TAR])
    classes = ilsvrc.train_classes(train_members, devkit, str(paths[ilsvrc.TRAIN_TAR]))
    val = sorted(ilsvrc.val_images(ilsvrc.list_tar(paths[ilsvrc.VAL_TAR]), devkit, str(paths[ilsvrc.VAL_TAR])),
                 key=lambda item: item[1].offset)
    totals = {TRAIN: sum(devkit.train_counts.values()), VAL: len(devkit.val_wnids)}
    shards = {TRAIN: train_shards, VAL: val_shards}
    if layout == "tfrecord":
        for split, option in ((TRAIN, "--train-shards"), (VAL, "--val-shards")):
            if not 1 <= shards[split] <= totals[split]:
                raise PrepareError(f"{option}: {shards[split]} must be between 1 and the split's "
                                   f"{totals[split]:,} images")
    sources = {name: path.stat().st_size for name, path in paths.items()}
    settings = _settings(layout, shards, sources)
    out = Path(out)
    with discarded_if_source_damaged(out, _outputs(layout, shards)):
        finished = claim_out(out, settings, _settings_for_layout(settings))
        if finished is not None:
            return Summary(str(out), finished.layout, finished.images, len(finished.classes), finished.conversions,
                           finished.digest, already_complete=True)
        plan = Plan({k: str(v) for k, v in paths.items()}, str(out), layout, devkit.wnids, devkit.words,
                    devkit.train_counts, devkit.val_wnids, shards)
        if layout == "tfrecord":
            plan.positions = {split: _positions(totals[split], SHUFFLE_SEED, split) for split in SPLITS}
        remove_stale_temporaries(out)
        jobs = [(TRAIN, f"train-{wnid}", member) for wnid, member in
                sorted(classes.items(), key=lambda item: item[1].offset)]
        jobs += [(VAL, f"val-{k // VAL_CHUNK:05d}", val[k:k + VAL_CHUNK]) for k in range(0, len(val), VAL_CHUNK)]
        records, resumed = _run_units(plan, jobs, sum(totals.values()), workers, progress)
        files: dict[str, FileEntry] = {}
        if layout == "tfrecord":
            files.update(_write_shards(plan, records, workers, progress))
        else:
            _place_val_folders(plan, records)
            for record in records.values():
                files.update({path: FileEntry(*entry) for path, entry in record["files"].items()})
        per_class, conversions = _totals(records, devkit)

    manifest = Manifest(layout, list(devkit.wnids), per_class, files, sources, conversions,
                        {"settings": _settings_for_layout(settings), "jpeg_quality": JPEG_QUALITY,
                         **({"shuffle_seed": SHUFFLE_SEED} if layout == "tfrecord" else {})})
    write_manifest(out, manifest)
    shutil.rmtree(plan.state, ignore_errors=True)
    return Summary(str(out), layout, manifest.images, len(devkit.wnids), conversions, manifest.digest,
                   resumed, time.monotonic() - started)


def _outputs(layout: str, shards: dict[str, int]) -> list[str]:
    """What a prepare writes in OUT besides its manifest and its resume state."""
    if layout == "folder":
        return [TRAIN, VAL]
    names = [shard_name(split, shard, shards[split]) for split in SPLITS for shard in range(shards[split])]
    return names + [name + INDEX_SUFFIX for name in names]


def _run_units(plan: Plan, jobs: list[tuple], total_images: int, workers: int,
               progress: Progress | None) -> tuple[dict, int]:
    """Every unit's record (those of an earlier run read back, the others made now), and how many
    were read back."""
    out = Path(plan.out)
    records, todo = {}, []
    for job in jobs:
        record = read_state_json(_unit_record(plan, job[1]))
        finished = record is not None and (plan.layout == "tfrecord" or job[0] == VAL
                                            or (out / TRAIN / job[1].split("-", 1)[1]).is_dir())
        if finished:
            records[job[1]] = record
        else:
            todo.append(job)
    # Longest units first (a class of 1,300 images or a validation chunk of 1,000 before a class of
    # 732): the workers then finish together instead of one of them taking a big unit last.
    todo.sort(key=lambda job: -(plan.train_counts[job[1].split("-", 1)[1]] if job[0] == TRAIN else len(job[2])))
    resumed = len(records)
    already = sum(sum(r["counts"].values()) for r in records.values())
    if progress:
        progress("images", already, total_images)
    for record in prefetch_map(run_unit, plan, iter(todo), workers, prefetch=_window(workers)):
        _unit_done(record, records)
        already += sum(record["counts"].values())
        if progress:
            progress("images", already, total_images)
    return records, resumed


def _totals(records: dict, devkit: ilsvrc.Devkit) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(images per split and class, images by kind), the counts checked against the devkit's."""
    per_class = {split: {wnid: 0 for wnid in devkit.wnids} for split in SPLITS}
    conversions = {kind: 0 for kind in KINDS}
    for record in records.values():
        for wnid, n in record["counts"].items():
            per_class[record["split"]][wnid] += n
        for kind, n in record["conversions"].items():
            conversions[kind] += n
    _check_counts(per_class, devkit)
    return per_class, conversions


def _window(workers: int) -> int:
    """Units or shards in flight. prefetch_map returns results in order, so a long one at the head
    holds back the next submissions: a window of twice the workers keeps them busy meanwhile (each
    result is a small record: the images go to disk)."""
    return 2 * workers + 2


def _unit_done(record: dict, records: dict) -> None:
    """Called in the parent as each unit's record arrives."""
    records[record["unit"]] = record


def _shard_done(record: dict, files: dict) -> None:
    """Called in the parent as each shard's record arrives."""
    files.update({name: FileEntry(*entry) for name, entry in record.items()})


def _write_shards(plan: Plan, records: dict, workers: int, progress: Progress | None) -> dict:
    """Assemble every shard of both splits in one pass over the workers (one pass per split would
    leave workers idle at each split's last shards), deleting each group's spool once its last
    shard is written."""
    out = Path(plan.out)
    pieces: dict[tuple[str, int], list] = defaultdict(list)
    for record in records.values():
        split = record["split"]
        for group, entries in record["spool"].items():
            spool = str(_spool_path(plan, split, int(group), record["unit"]))
            for position, shard, offset, length in entries:
                pieces[split, shard].append((position, spool, offset, length))
    files: dict[str, FileEntry] = {}
    todo = []
    waiting: dict[tuple[str, int], int] = defaultdict(int)  # (split, group) -> shards not yet written
    for split in SPLITS:
        for shard in range(plan.shards[split]):
            record = read_state_json(_shard_record(plan, split, shard))
            if record is not None and (out / plan.shard_name(split, shard)).is_file():
                _shard_done(record, files)
            else:
                todo.append((split, shard, pieces[split, shard]))
                waiting[split, shard // GROUP_SHARDS] += 1
    total = 2 * sum(plan.shards.values())  # a shard and its DALI index each
    if progress:
        progress("shards", len(files), total)
    for split in SPLITS:  # groups finished before a restart
        for group in range(-(-plan.shards[split] // GROUP_SHARDS)):
            if not waiting[split, group]:
                shutil.rmtree(plan.state / "spool" / split / f"group-{group:04d}", ignore_errors=True)
    shards = prefetch_map(assemble_shard, plan, iter(todo), workers, prefetch=_window(workers))
    for (split, shard, _), record in zip(todo, shards):  # prefetch_map keeps the order
        _shard_done(record, files)
        waiting[split, shard // GROUP_SHARDS] -= 1
        if not waiting[split, shard // GROUP_SHARDS]:
            shutil.rmtree(plan.state / "spool" / split / f"group-{shard // GROUP_SHARDS:04d}", ignore_errors=True)
        if progress:
            progress("shards", len(files), total)
    return files


def _place_val_folders(plan: Plan, records: dict) -> None:
    out = Path(plan.out)
    (out / VAL).mkdir(parents=True, exist_ok=True)
    for wnid in plan.classes:
        target = out / VAL / wnid
        if target.is_dir():
            continue
        gathered = plan.state / "gathering" / VAL / wnid
        if gathered.is_dir():
            os.rename(gathered, target)
        else:
            target.mkdir()
    _fsync_dir(out / VAL)


def _check_counts(per_class: dict[str, dict[str, int]], devkit: ilsvrc.Devkit) -> None:
    """The devkit's own figures: num_train_images per class, the ground truth's per-class counts."""
    for wnid in devkit.wnids:
        if per_class[TRAIN][wnid] != devkit.train_counts[wnid]:
            raise SourceDamagedError(f"train class {wnid}: {per_class[TRAIN][wnid]:,} images written, the devkit's "
                                     f"meta.mat says num_train_images = {devkit.train_counts[wnid]:,}")
    truth: dict[str, int] = defaultdict(int)
    for wnid in devkit.val_wnids:
        truth[wnid] += 1
    for wnid in devkit.wnids:
        if per_class[VAL][wnid] != truth[wnid]:
            raise SourceDamagedError(f"val class {wnid}: {per_class[VAL][wnid]:,} images written, the devkit's "
                                     f"ground truth has {truth[wnid]:,}")
    if sum(per_class[VAL].values()) != len(devkit.val_wnids):
        raise SourceDamagedError(f"val: {sum(per_class[VAL].values()):,} images written, the ground truth has "
                                 f"{len(devkit.val_wnids):,} lines")


class ProgressLine:
    """A live stderr line: images done, images/s (this run's), ETA; rewritten at most 4 times a second."""

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.last = 0.0
        self.start: tuple[float, int] | None = None
        self.what = ""

    def __call__(self, what: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if what != self.what:
            if self.what:
                self.stream.write("\n")
            self.what, self.start, self.last = what, (now, done), 0.0
        if done < total and now - self.last < 0.25:
            return
        self.last = now
        elapsed = now - self.start[0]
        rate = (done - self.start[1]) / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {format_duration((total - done) / rate)}" if rate > 0 and done < total else ""
        unit = "images" if what == "images" else "files"
        line = (f"\rprepare: {what}: {done:,}/{total:,} {unit} ({100.0 * done / max(total, 1):.0f}%)  "
                f"{rate:,.0f} {unit}/s  {eta}")
        self.stream.write(line.ljust(78) + ("\n" if done >= total else ""))
        if done >= total:
            self.what = ""
        self.stream.flush()
