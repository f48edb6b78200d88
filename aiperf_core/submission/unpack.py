"""Unpacking a submission someone else made, as if it were hostile.

Everything is written under one fresh private directory (mode 0700), by this code, never by
tarfile's extract: a member is refused unless it is a regular file (or a folder) whose name is a
plain relative path without '..', '.', empty parts, backslashes or control characters. Links,
devices and FIFOs are refused, and so is a name given twice. Sizes are checked against the limits
from the header before a byte is read, and the bytes read are counted as well, so that neither a
lying header nor a gzip bomb can fill the disk. Every file's SHA-256 is taken while it is written.

A package that cannot be read as one (not gzip, truncated, an unsafe member, over a limit) raises
SubmissionError with one line: that is bad input, not a verdict.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from aiperf_core.submission import SubmissionError

_CHUNK = 1 << 20
_SAFE_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=@-]*$")


@dataclass(frozen=True)
class Limits:
    """What a package may hold. The defaults fit a 12-hour run on 4096 nodes several times over."""

    max_member_bytes: int = 2 << 30  # one file
    max_total_bytes: int = 32 << 30  # all files
    max_members: int = 2_000_000


DEFAULT_LIMITS = Limits()


@dataclass
class Unpacked:
    root: Path  # the private directory; remove it with close()
    digests: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (sha256, size)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Unpacked":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unpack(package: str | os.PathLike, limits: Limits = DEFAULT_LIMITS) -> Unpacked:
    package = Path(package)
    if not package.is_file():
        raise SubmissionError(f"{package}: no such file")
    with open(package, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            raise SubmissionError(f"{package}: not a gzip file (a submission is a .tar.gz made by aiperf submit)")
    out = Unpacked(Path(tempfile.mkdtemp(prefix="aiperf-check-")))
    os.chmod(out.root, 0o700)
    try:
        _extract(package, out, limits)
    except BaseException:
        out.close()
        raise
    return out


def _extract(package: Path, out: Unpacked, limits: Limits) -> None:
    total = count = 0
    try:
        with tarfile.open(package, mode="r:gz") as tar:
            for member in tar:
                count += 1
                if count > limits.max_members:
                    raise SubmissionError(f"{package}: more than {limits.max_members} members")
                name = _check_name(package, member.name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise SubmissionError(f"{package}: member {member.name!r} is a {_kind(member)}: only regular "
                                          "files are allowed")
                if name in out.digests:
                    raise SubmissionError(f"{package}: member {name!r} appears twice")
                if member.size > limits.max_member_bytes:
                    raise SubmissionError(f"{package}: member {name!r} is {member.size} bytes, over the limit of "
                                          f"{limits.max_member_bytes}")
                total += member.size
                if total > limits.max_total_bytes:
                    raise SubmissionError(f"{package}: the members add up to more than {limits.max_total_bytes} bytes")
                out.digests[name] = _write(package, tar, member, out.root / name)
    except OSError as exc:
        if exc.errno:  # our side: the disk, not the package (gzip's BadGzipFile has no errno)
            raise SubmissionError(f"{package}: cannot unpack: {exc.strerror}: {exc.filename}") from None
        raise SubmissionError(f"{package}: truncated or corrupt tar.gz ({exc})") from None
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise SubmissionError(f"{package}: truncated or corrupt tar.gz ({type(exc).__name__}: {exc})") from None


def _check_name(package: Path, name: str) -> str:
    parts = name.rstrip("/").split("/")
    if (not name or name.startswith("/") or "\\" in name or any(ord(c) < 32 for c in name)
            or any(part in ("", ".", "..") for part in parts)):
        raise SubmissionError(f"{package}: member {name!r} has an unsafe path (absolute, '..', or not plain)")
    if not all(_SAFE_PART.match(part) for part in parts):
        raise SubmissionError(f"{package}: member {name!r} has characters a submission never uses")
    return "/".join(parts)


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"symbolic link to {member.linkname!r}"
    if member.islnk():
        return f"hard link to {member.linkname!r}"
    if member.ischr() or member.isblk():
        return "device"
    if member.isfifo():
        return "FIFO"
    return f"member of type {member.type!r}"


def _write(package: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path) -> tuple[str, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    digest, size = hashlib.sha256(), 0
    # O_EXCL | O_NOFOLLOW: nothing written earlier, link or file, is ever followed or overwritten
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        while True:
            block = source.read(_CHUNK)
            if not block:
                break
            size += len(block)
            if size > member.size:  # cannot happen with tarfile's reader; a guard, not a trust
                raise SubmissionError(f"{package}: member {member.name!r} holds more than its header says")
            digest.update(block)
            f.write(block)
    if size != member.size:
        raise SubmissionError(f"{package}: truncated: member {member.name!r} ends after {size} of {member.size} bytes")
    return digest.hexdigest(), size
