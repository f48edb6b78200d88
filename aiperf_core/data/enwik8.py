"""`aiperf data prepare enwik8.zip OUT`: enwik8 from its zip to three raw byte files and a manifest.

Source. A zip holding a member named `enwik8` (the published enwik8.zip holds exactly that one).
The member is streamed in CHUNK pieces, never read whole, never extracted.

Output. OUT/train.bin, OUT/val.bin, OUT/test.bin (raw bytes, in corpus order, split by
text_corpus.split_sizes: 90,000,000 / 5,000,000 / 5,000,000 for the 100,000,000-byte enwik8, the
same proportions for any other size), then OUT/manifest.json (layout "bytes", manifest.py).

Official. The member is exactly enwik8's 100,000,000 bytes. No published SHA-256 of the member
itself was found, so its size is the rule; the member's SHA-256 is recorded, and so is whether the
zip is byte for byte the published enwik8.zip (evidence only: a re-zipped enwik8 is the same data).

Restart. Each split file is written atomically (atomic.write_atomic: a hidden temporary, fsync,
rename), then recorded (size, SHA-256) under OUT/.prepare/splits/. A rerun over the same OUT
keeps the splits that are recorded and present at their size (the stream still passes through
them, to hash the whole member), rewrites the others, and throws away a killed run's temporaries;
a final name never holds a half file. OUT/.prepare/ is removed once the manifest is written.
A member found damaged (its CRC-32 at its end, a broken deflate stream, bytes that differ from those
a kept split was written from) is refused with the split files and OUT/.prepare/ removed: no rerun
over the same zip could finish (prepare_out.py). An error reading the zip or writing OUT keeps them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import sys
import time
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aiperf_core.atomic import write_atomic, write_text_atomic
from aiperf_core.data.manifest import (BYTE_SPLITS, BYTES, ENWIK8, ENWIK8_BYTES, FileEntry, Manifest, file_sha256,
                                       write_manifest)
from aiperf_core.data.prepare_out import (STATE, PrepareError, SourceDamagedError, claim_out,
                                          discarded_if_source_damaged, read_state_json, remove_stale_temporaries)
from aiperf_core.data.text_corpus import VOCAB, TextDataError, split_sizes
from aiperf_core.workflow.duration import format_duration

MEMBER = "enwik8"
CHUNK = 1 << 20
# The published http://mattmahoney.net/dc/enwik8.zip, as Hugging Face's datasets library records
# it (huggingface/datasets, datasets/enwik8/dataset_infos.json, "download_checksums"): its size
# and SHA-256. This is the zip's checksum, not the member's.
PUBLISHED_ZIP_BYTES = 36_445_475
PUBLISHED_ZIP_SHA256 = "547994d9980ebed1288380d652999f38a14fe291a6247c157c3d33d4932534bc"
SPLIT_RULE = "train: the first N - 2 * (N // 20) bytes, val: the next N // 20, test: the last N // 20"
SPLIT_FILES = tuple(f"{split}.bin" for split in BYTE_SPLITS)
_STREAM_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, OSError)

Progress = Callable[[int, int], None]  # (bytes of the member done, its bytes)


class Enwik8Error(PrepareError):
    pass


class DamagedZipError(Enwik8Error, SourceDamagedError):
    pass


def _unreadable(path: Path, exc: Exception, what: str = f"its member {MEMBER} cannot be read") -> Enwik8Error:
    """An OSError reading the zip may pass (a rerun resumes); anything else zipfile raises is the
    zip's own damage (a bad CRC-32, a broken deflate stream, a method it cannot read)."""
    if isinstance(exc, OSError):
        return Enwik8Error(f"{path}: {what} ({exc.strerror or exc})")
    return DamagedZipError(f"{path}: {what}: damaged ({exc})")


@dataclass
class TextSummary:
    out: str
    source: str
    split_bytes: dict[str, int]
    digest: str
    official: bool
    reason: str                 # why it is official or not
    member_sha256: str
    kept: list[str] = field(default_factory=list)  # splits finished by an earlier, interrupted run
    seconds: float = 0.0
    already_complete: bool = False


def is_zip_source(source) -> bool:
    """Whether `aiperf data prepare` reads SOURCE as enwik8's zip: a file (a zip or not: this module
    says which it is), or a missing path named *.zip. A folder is ImageNet's archives."""
    path = Path(source)
    return path.is_file() or (not path.exists() and path.suffix.lower() == ".zip")


def source_member(source) -> tuple[Path, int, zipfile.ZipInfo]:
    """(the zip, its size, its `enwik8` member), or one line saying why `source` is not such a zip."""
    path = Path(source)
    expected = f"expected a zip holding the file {MEMBER}, such as enwik8.zip"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise Enwik8Error(f"{path}: no such file ({expected})") from None
    except OSError as exc:
        raise Enwik8Error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise Enwik8Error(f"{path}: is a folder, not a zip file ({expected})")
    if not stat.S_ISREG(mode):
        raise Enwik8Error(f"{path}: not a regular file ({expected})")
    try:
        with open(path, "rb") as fh:
            is_zip = zipfile.is_zipfile(fh)
        if not is_zip:
            raise Enwik8Error(f"{path}: not a zip archive ({expected})")
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
    except OSError as exc:
        raise Enwik8Error(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError) as exc:
        raise Enwik8Error(f"{path}: damaged zip archive ({exc})") from None
    members = [info for info in infos if info.filename == MEMBER]
    if not members:
        names = [info.filename for info in infos]
        held = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") or "nothing"
        raise Enwik8Error(f"{path}: holds no member named {MEMBER!r} (it holds {held})")
    if len(members) > 1:
        raise Enwik8Error(f"{path}: holds {len(members)} members named {MEMBER!r}; which one is enwik8 is unclear")
    info = members[0]
    if info.is_dir() or info.file_size == 0:
        raise Enwik8Error(f"{path}: its member {MEMBER} is empty")
    if info.flag_bits & 0x1:
        raise Enwik8Error(f"{path}: its member {MEMBER} is encrypted")
    return path, path.stat().st_size, info


def _settings(info: zipfile.ZipInfo, sizes: dict[str, int]) -> dict:
    """What a resumed or repeated prepare must find unchanged: the member (its size and the CRC-32
    its zip records) and the split. The zip's name may change (the manifest's sources says which)."""
    return {"layout": BYTES, "dataset": ENWIK8, "member": MEMBER, "member_bytes": info.file_size,
            "member_crc32": info.CRC, "split_bytes": sizes}


def _read(stream, size: int, path: Path) -> bytes:
    try:
        return stream.read(size)
    except _STREAM_ERRORS as exc:
        raise _unreadable(path, exc) from None


def _pass(stream, size: int, path: Path, hashes, sink, progress: Callable[[int], None]) -> None:
    """`size` bytes of the member through `hashes` and, when `sink` is given, into it."""
    left = size
    while left:
        chunk = _read(stream, min(CHUNK, left), path)
        if not chunk:
            raise DamagedZipError(f"{path}: its member {MEMBER} ends {left:,} bytes early: damaged")
        for digest in hashes:
            digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
        left -= len(chunk)
        progress(len(chunk))


def _record(state: Path, split: str) -> Path:
    return state / "splits" / f"{split}.json"


def _split_done(state: Path, split: str, size: int, sha256: str) -> None:
    """Called as each split file is in place: from now on a rerun keeps it."""
    write_text_atomic(_record(state, split), json.dumps({"size": size, "sha256": sha256}))


def _kept(out: Path, state: Path, split: str, size: int) -> dict | None:
    """The record of a split an earlier run finished, if its file is still there at its size."""
    record = read_state_json(_record(state, split))
    if record is None or record.get("size") != size:
        return None
    try:
        return record if os.path.getsize(out / f"{split}.bin") == size else None
    except OSError:
        return None


def _reason(member_bytes: int) -> str:
    if member_bytes == ENWIK8_BYTES:
        return f"the member {MEMBER} is {ENWIK8_BYTES:,} bytes: enwik8 whole, in the standard split"
    return f"the member {MEMBER} is {member_bytes:,} bytes, not enwik8's {ENWIK8_BYTES:,}"


def _summary(out: Path, source: Path, manifest: Manifest, **more) -> TextSummary:
    return TextSummary(str(out), str(source), dict(manifest.split_bytes), manifest.digest, manifest.official,
                       str(manifest.extra.get("official_reason", "")), str(manifest.extra.get("member_sha256", "")),
                       **more)


def prepare_enwik8(source, out, progress: Progress | None = None) -> TextSummary:
    """Prepare enwik8 at `out` from the zip `source` (see the module's docstring). Resumes an
    unfinished prepare of the same member; leaves a finished one as it is."""
    started = time.monotonic()
    path, zip_bytes, info = source_member(source)
    try:
        sizes = split_sizes(info.file_size)
    except TextDataError as exc:
        raise Enwik8Error(f"{path}: its member {MEMBER}: {exc}") from None
    settings = _settings(info, sizes)
    out = Path(out)
    member_hash = hashlib.sha256()
    files: dict[str, FileEntry] = {}
    kept: list[str] = []
    with discarded_if_source_damaged(out, SPLIT_FILES):
        finished = claim_out(out, settings)
        if finished is not None:
            shutil.rmtree(out / STATE, ignore_errors=True)  # left when a run was killed right after its manifest
            return _summary(out, path, finished, already_complete=True)
        remove_stale_temporaries(out)
        try:
            archive = zipfile.ZipFile(path)
        except _STREAM_ERRORS as exc:
            raise _unreadable(path, exc, "cannot be read") from None
        with archive:
            try:
                stream = archive.open(info)
            except _STREAM_ERRORS as exc:
                raise _unreadable(path, exc) from None
            _stream_member(stream, path, out, sizes, info.file_size, member_hash, files, kept, progress)

    source_sha256 = file_sha256(path) if zip_bytes == PUBLISHED_ZIP_BYTES else None
    extra = {"dataset": ENWIK8, "vocab": VOCAB, "member": MEMBER, "member_bytes": info.file_size,
             "member_sha256": member_hash.hexdigest(), "official_reason": _reason(info.file_size),
             "published_zip": source_sha256 == PUBLISHED_ZIP_SHA256, "split_rule": SPLIT_RULE, "settings": settings}
    manifest = Manifest(BYTES, [], {}, files, {path.name: zip_bytes}, {}, extra, dict(sizes))
    write_manifest(out, manifest)
    shutil.rmtree(out / STATE, ignore_errors=True)
    return _summary(out, path, manifest, kept=kept, seconds=time.monotonic() - started)


def _stream_member(stream, path: Path, out: Path, sizes: dict[str, int], total: int, member_hash,
                   files: dict[str, FileEntry], kept: list[str], progress: Progress | None) -> None:
    """The member, in order, into the split files (or through those an earlier run finished)."""
    state = out / STATE
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress is not None:
            progress(done[0], total)

    with stream:
        if progress is not None:
            progress(0, total)
        for split in BYTE_SPLITS:
            target = out / f"{split}.bin"
            record = _kept(out, state, split, sizes[split])
            split_hash = hashlib.sha256()
            if record is not None:
                _pass(stream, sizes[split], path, (member_hash, split_hash), None, advance)
                if split_hash.hexdigest() != record.get("sha256"):
                    raise DamagedZipError(f"{target}: written by an earlier run from other bytes than {path} "
                                          f"holds now under the same CRC-32: one of them was damaged")
                kept.append(split)
            else:
                write_atomic(target, lambda fh: _pass(stream, sizes[split], path, (member_hash, split_hash), fh,
                                                      advance))
                _split_done(state, split, sizes[split], split_hash.hexdigest())
            files[target.name] = FileEntry(sizes[split], split_hash.hexdigest())
        if _read(stream, 1, path):  # also where zipfile compares the member's CRC-32 with the zip's
            raise DamagedZipError(f"{path}: its member {MEMBER} is longer than its zip entry says: damaged")


class BytesProgress:
    """A live stderr line: megabytes of the member done, MB/s of this run, ETA; rewritten at most
    ten times a second."""

    INTERVAL_S = 0.1

    def __init__(self, stream=None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.last = 0.0
        self.start: tuple[float, int] | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.start is None:
            self.start = (now, done)
        if done < total and now - self.last < self.INTERVAL_S:
            return
        self.last = now
        elapsed = now - self.start[0]
        rate = (done - self.start[1]) / elapsed if elapsed > 0 else 0.0
        eta = f"ETA {format_duration((total - done) / rate)}" if rate > 0 and done < total else ""
        line = (f"\rprepare: {MEMBER}: {done / 1e6:,.1f}/{total / 1e6:,.1f} MB ({100.0 * done / max(total, 1):.0f}%)"
                f"  {rate / 1e6:,.0f} MB/s  {eta}")
        self.stream.write(line.ljust(78) + ("\n" if done >= total else ""))
        self.stream.flush()
