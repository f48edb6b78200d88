"""Byte-level text for the language-model workload: a prepared enwik8 folder (`aiperf data prepare
enwik8.zip OUT`, aiperf_core/data/enwik8.py) or the embedded corpus, as a TokenData; a trial reads
it through aiperf_core.data.text_stream.TokenStream. NumPy only.

Tokens are bytes: vocabulary 256, every byte value a token, nothing to learn or store.

The split rule, one for every size: the last N // 20 bytes are test, the N // 20 before them
validation, the rest train. For enwik8's 100,000,000 bytes that is the standard split (90,000,000 /
5,000,000 / 5,000,000); for any other size the same proportions, rounded the same way.

The embedded corpus is made at run time from `pydoc_data.topics` (the text of `help()` on Python's
keywords and topics, in every CPython installation): the `topics` dict's values in sorted key
order, joined by a newline, encoded as UTF-8. Nothing is downloaded. It differs between Python
versions (the documentation changes), so its digest is part of the run's record; within one Python
version it is the same bytes on every machine.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiperf_core.data.manifest import (BYTE_SPLITS, BYTES, MANIFEST, FileEntry, dataset_digest,
                                       read_manifest)
from aiperf_core.errors import AiperfError

VOCAB = 256
HELD_OUT_DIVISOR = 20  # validation and test are each 1/20 of the bytes (5% each, 90% train)
EMBEDDED = "embedded"


class TextDataError(AiperfError):
    pass


def split_sizes(total: int) -> dict[str, int]:
    """{train, val, test} byte counts of a corpus of `total` bytes (the module's rule). A corpus too
    small for a non-empty validation and test split is an error."""
    held_out = total // HELD_OUT_DIVISOR
    if held_out < 1:
        raise TextDataError(f"{total:,} bytes: too small to split (at least {HELD_OUT_DIVISOR} bytes, so that "
                            f"validation and test hold one byte each)")
    return {"train": total - 2 * held_out, "val": held_out, "test": held_out}


def split_bounds(total: int) -> dict[str, tuple[int, int]]:
    """{split: (start, stop)} byte offsets of each split in the corpus, in corpus order."""
    bounds, start = {}, 0
    for split, size in split_sizes(total).items():
        bounds[split] = (start, start + size)
        start += size
    return bounds


@dataclass
class TokenData:
    """A byte-level corpus split three ways: each split a 1-D uint8 array (an np.memmap of
    `<split>.bin` for a prepared folder, nothing read until used)."""
    name: str                   # "enwik8" or "embedded"
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    digest: str                 # the manifest's digest (for the embedded corpus: the same function of its splits)
    official: bool
    path: str | None = None     # the prepared folder; None for the embedded corpus
    source_sha256: str = ""     # SHA-256 of the whole corpus before the split
    vocab: int = VOCAB

    def split(self, split: str) -> np.ndarray:
        if split not in BYTE_SPLITS:
            raise TextDataError(f"split: {split!r} is not one of {', '.join(BYTE_SPLITS)}")
        return getattr(self, split)

    @property
    def split_bytes(self) -> dict[str, int]:
        return {split: int(len(self.split(split))) for split in BYTE_SPLITS}

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "layout": BYTES, "vocab": self.vocab,
                "split_bytes": self.split_bytes, "digest": self.digest, "official": self.official}


def _digest_of(splits: dict[str, bytes | np.ndarray]) -> str:
    """The digest a manifest of these splits as `<split>.bin` files would record."""
    return dataset_digest({f"{split}.bin": FileEntry(len(data), hashlib.sha256(data).hexdigest())
                           for split, data in splits.items()})


def embedded_bytes() -> bytes:
    """The embedded corpus (see the module's docstring)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def embedded_corpus() -> TokenData:
    """The embedded corpus, split by the module's rule. Never official."""
    corpus = embedded_bytes()
    array = np.frombuffer(corpus, dtype=np.uint8)
    parts = {split: array[start:stop] for split, (start, stop) in split_bounds(len(corpus)).items()}
    return TokenData(EMBEDDED, parts["train"], parts["val"], parts["test"], _digest_of(parts), official=False,
                     source_sha256=hashlib.sha256(corpus).hexdigest())


def open_prepared(path) -> TokenData:
    """The byte-level dataset `aiperf data prepare` wrote at `path`, its splits memory-mapped. Each
    file's size is checked against the manifest (one line naming the file when it differs); the
    checksums are `aiperf data check --deep`'s and `aiperf data stage`'s to check."""
    root = Path(path)
    if not root.is_dir():
        raise TextDataError(f"{root}: no such folder")
    manifest = read_manifest(root)
    if manifest is None:
        raise TextDataError(f"{root}: no {MANIFEST}: not a prepared dataset (run `aiperf data prepare enwik8.zip "
                            f"{root}` to make one)")
    if manifest.layout != BYTES:
        raise TextDataError(f"{root}: a dataset of layout {manifest.layout!r}, not byte-level text ({BYTES!r})")
    parts = {}
    for split in BYTE_SPLITS:
        file = root / f"{split}.bin"
        try:
            size = os.path.getsize(file)
            if size == manifest.split_bytes[split]:
                parts[split] = np.memmap(file, dtype=np.uint8, mode="r")
        except OSError as exc:
            raise TextDataError(f"{file}: cannot read: {exc.strerror or exc}") from None
        if size != manifest.split_bytes[split]:
            raise TextDataError(f"{file}: {size:,} bytes, its manifest says {manifest.split_bytes[split]:,}")
    return TokenData(str(manifest.extra.get("dataset") or root.name), parts["train"], parts["val"], parts["test"],
                     manifest.digest, manifest.official, str(root),
                     str(manifest.extra.get("member_sha256") or ""))
