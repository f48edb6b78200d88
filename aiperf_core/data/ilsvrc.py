"""The three official ILSVRC2012 classification archives, read where they lie (nothing extracted).

- ILSVRC2012_img_train.tar: one inner `<wnid>.tar` per class, each holding that class's JPEGs.
- ILSVRC2012_img_val.tar: 50,000 flat `ILSVRC2012_val_000NNNNN.JPEG`.
- ILSVRC2012_devkit_t12.tar.gz: `data/meta.mat` (the synsets: ILSVRC2012_ID, WNID, words,
  num_children, num_train_images, ...) and `data/ILSVRC2012_validation_ground_truth.txt` (line N
  is the ILSVRC2012_ID of validation image N).

The devkit's ids are not in WNID order (id 1 is n02119789): the class index is the position of the
WNID among the sorted leaf synsets (num_children == 0), never "id - 1". A validation image's class
comes from the number in its file name, never from its place in the tar.

Everything here is checked up front, each problem one line naming the archive and what is wrong: a
missing archive, a truncated or damaged tar, a meta.mat that is not one or lacks a field, a ground
truth whose length differs from the validation images, names that are not the official ones.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aiperf_core.errors import AiperfError

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT = "ILSVRC2012_devkit_t12.tar.gz"
ARCHIVES = (TRAIN_TAR, VAL_TAR, DEVKIT)
META = "data/meta.mat"
GROUND_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})\.JPEG")
WNID = re.compile(r"n\d{8}")
BLOCK = tarfile.BLOCKSIZE
SYNSET_FIELDS = ("ILSVRC2012_ID", "WNID", "words", "num_children", "num_train_images")


class ArchiveError(AiperfError):
    pass


@dataclass(frozen=True)
class Member:
    """A regular file inside a tar: its name and where its bytes are."""
    name: str
    offset: int  # of the data, from the start of the tar
    size: int


@dataclass
class Devkit:
    wnids: list[str]                 # the leaf synsets' WNIDs, sorted: the class order
    words: dict[str, str]            # WNID -> its words ("kit fox, Vulpes macrotis")
    train_counts: dict[str, int]     # WNID -> meta.mat's num_train_images
    val_wnids: list[str]             # validation image N (1-based) -> WNID, at index N - 1

    @property
    def index(self) -> dict[str, int]:
        return {wnid: i for i, wnid in enumerate(self.wnids)}


def source_archives(source) -> dict[str, Path]:
    """The three archives in the folder `source`, by official name; a missing one is an error."""
    root = Path(source)
    if not root.is_dir():
        raise ArchiveError(f"{root}: no such folder (expected the official archives {', '.join(ARCHIVES)})")
    paths = {name: root / name for name in ARCHIVES}
    for name, path in paths.items():
        if not path.is_file():
            raise ArchiveError(f"{path}: missing (SOURCE must hold {', '.join(ARCHIVES)} under these names)")
    return paths


def tar_members(fh: BinaryIO, size: int, where: str) -> list[Member]:
    """The regular files of the uncompressed tar in `fh` (`size` bytes), in order. A tar that ends
    inside a member or before its end-of-archive blocks, or whose headers are damaged, is refused:
    tarfile would silently stop at the damage and lose the rest."""
    try:
        tar = tarfile.open(fileobj=fh, mode="r:")
        members = [Member(m.name, m.offset_data, m.size) for m in tar if m.isreg()]
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"{where}: truncated or damaged tar ({exc})") from None
    for m in members:
        if m.offset + m.size > size:
            raise ArchiveError(f"{where}: truncated: {m.name} needs {m.offset + m.size:,} bytes, "
                               f"the tar has {size:,}")
    fh.seek(tar.offset)
    end = fh.read(2 * BLOCK)
    if len(end) < 2 * BLOCK or end.count(0) != len(end):
        raise ArchiveError(f"{where}: truncated or damaged at byte {tar.offset:,} "
                           f"(no end-of-archive marker after {len(members):,} files)")
    return members


def list_tar(path: Path) -> list[Member]:
    try:
        with open(path, "rb") as fh:
            return tar_members(fh, os.fstat(fh.fileno()).st_size, str(path))
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read ({exc.strerror or exc})") from None


def _devkit_file(tar: tarfile.TarFile, suffix: str, where: str) -> bytes:
    for member in tar:
        if member.isreg() and (member.name == suffix or member.name.endswith("/" + suffix)):
            return tar.extractfile(member).read()
    raise ArchiveError(f"{where}: has no {suffix}")


def _scalar(value, field: str, where: str):
    import numpy as np

    array = np.asarray(value)
    if array.size != 1:
        raise ArchiveError(f"{where}: {META}: synsets.{field}: expected one value, found {array.size}")
    return array.reshape(-1)[0]


def parse_meta(data: bytes, where: str) -> list[dict]:
    """meta.mat's synsets: [{ILSVRC2012_ID, WNID, words, num_children, num_train_images}, ...]."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise ArchiveError("reading meta.mat needs scipy: pip install scipy") from None
    try:
        mat = loadmat(io.BytesIO(data), squeeze_me=False, struct_as_record=True)
    except Exception as exc:  # scipy raises ValueError, TypeError, MatReadError, ... on a damaged file
        raise ArchiveError(f"{where}: {META}: not a readable MAT file ({type(exc).__name__}: {exc})") from None
    synsets = mat.get("synsets")
    names = getattr(getattr(synsets, "dtype", None), "names", None) or ()
    if synsets is None or not names:
        raise ArchiveError(f"{where}: {META}: has no 'synsets' struct array")
    missing = [f for f in SYNSET_FIELDS if f not in names]
    if missing:
        raise ArchiveError(f"{where}: {META}: synsets lack the field(s) {', '.join(missing)}")
    out = []
    for row in synsets.reshape(-1):
        try:
            entry = {
                "ILSVRC2012_ID": int(_scalar(row["ILSVRC2012_ID"], "ILSVRC2012_ID", where)),
                "WNID": str(_scalar(row["WNID"], "WNID", where)),
                "words": str(_scalar(row["words"], "words", where)),
                "num_children": int(_scalar(row["num_children"], "num_children", where)),
                "num_train_images": int(_scalar(row["num_train_images"], "num_train_images", where)),
            }
        except (TypeError, ValueError) as exc:
            raise ArchiveError(f"{where}: {META}: a synset has a malformed field ({exc})") from None
        out.append(entry)
    return out


def read_devkit(path: Path) -> Devkit:
    where = str(path)
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            meta = _devkit_file(tar, META, where)
        with tarfile.open(path, mode="r:gz") as tar:
            truth = _devkit_file(tar, GROUND_TRUTH, where)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ArchiveError(f"{where}: not a readable .tar.gz ({exc})") from None
    synsets = parse_meta(meta, where)
    leaves = [s for s in synsets if s["num_children"] == 0]
    if not leaves:
        raise ArchiveError(f"{where}: {META}: no leaf synsets (num_children == 0)")
    by_id: dict[int, dict] = {}
    for s in leaves:
        if not WNID.fullmatch(s["WNID"]):
            raise ArchiveError(f"{where}: {META}: {s['WNID']!r} is not a WNID (n########)")
        if s["ILSVRC2012_ID"] in by_id:
            raise ArchiveError(f"{where}: {META}: ILSVRC2012_ID {s['ILSVRC2012_ID']} is used twice")
        if s["num_train_images"] < 1:
            raise ArchiveError(f"{where}: {META}: class {s['WNID']} has num_train_images {s['num_train_images']}")
        by_id[s["ILSVRC2012_ID"]] = s
    if len({s["WNID"] for s in leaves}) != len(leaves):
        raise ArchiveError(f"{where}: {META}: a leaf WNID appears twice")
    val_wnids = []
    try:
        lines = truth.decode("ascii").split()
    except UnicodeDecodeError:
        raise ArchiveError(f"{where}: {GROUND_TRUTH}: not text") from None
    for number, text in enumerate(lines, start=1):
        if not text.isdigit() or int(text) not in by_id:
            raise ArchiveError(f"{where}: {GROUND_TRUTH}: line {number}: {text!r} is not the ILSVRC2012_ID "
                               f"of a leaf synset")
        val_wnids.append(by_id[int(text)]["WNID"])
    if not val_wnids:
        raise ArchiveError(f"{where}: {GROUND_TRUTH}: empty")
    return Devkit(sorted(s["WNID"] for s in leaves), {s["WNID"]: s["words"] for s in leaves},
                  {s["WNID"]: s["num_train_images"] for s in leaves}, val_wnids)


def train_classes(members: list[Member], devkit: Devkit, where: str) -> dict[str, Member]:
    """The outer train tar's inner tars by WNID: exactly one per leaf synset."""
    found: dict[str, Member] = {}
    for m in members:
        name = os.path.basename(m.name)
        wnid = name[:-4] if name.endswith(".tar") else ""
        if not WNID.fullmatch(wnid):
            raise ArchiveError(f"{where}: {m.name}: not a class tar (<wnid>.tar)")
        if wnid in found:
            raise ArchiveError(f"{where}: class {wnid} appears twice")
        found[wnid] = m
    counts = devkit.train_counts
    extra = sorted(set(found) - set(counts))
    if extra:
        raise ArchiveError(f"{where}: class {extra[0]} is not a leaf synset of the devkit's meta.mat")
    missing = sorted(set(counts) - set(found))
    if missing:
        raise ArchiveError(f"{where}: class {missing[0]} is missing ({len(missing)} of the devkit's "
                           f"{len(counts)} classes)")
    return found


def val_images(members: list[Member], devkit: Devkit, where: str) -> list[tuple[int, Member]]:
    """(image number, member) of every validation image, checked against the ground truth."""
    out, seen = [], set()
    for m in members:
        match = VAL_NAME.fullmatch(os.path.basename(m.name))
        if not match:
            raise ArchiveError(f"{where}: {m.name}: not a validation image name (ILSVRC2012_val_NNNNNNNN.JPEG)")
        number = int(match.group(1))
        if number in seen:
            raise ArchiveError(f"{where}: {m.name} appears twice")
        seen.add(number)
        out.append((number, m))
    truth = len(devkit.val_wnids)
    if len(out) != truth:
        raise ArchiveError(f"{where}: holds {len(out):,} validation images, the devkit's ground truth "
                           f"has {truth:,} lines")
    beyond = sorted(n for n in seen if not 1 <= n <= truth)
    if beyond:
        raise ArchiveError(f"{where}: ILSVRC2012_val_{beyond[0]:08d}.JPEG has no ground-truth line "
                           f"(the ground truth has {truth:,})")
    return out
