"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A reader never sees a half-written file, and a crash never destroys the
previous version of a finished result. The file gets the mode a plain open(2) would give it
(0666 less the umask), not mkstemp's 0600: run directories and datasets are read by other users
of a site (a metrics exporter, a colleague checking a result, every node's stager).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, IO


def write_atomic(path, write: Callable[[IO[bytes]], None], exclusive: bool = False) -> None:
    """Write `path` whole or not at all. With `exclusive`, FileExistsError if it exists: the complete
    file is linked into place (link(2) fails on an existing name, also on NFS), so of two writers
    racing to create it exactly one succeeds."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if exclusive:
            os.link(tmp, target)
            os.unlink(tmp)
        else:
            os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def new_file_mode() -> int:
    """0666 less this process's umask: the mode open(2) gives a new file. Read from /proc where it
    can be (Linux 4.7 on), because os.umask can only be read by setting it, which races with other
    threads creating files."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_bytes_atomic(path, data: bytes, exclusive: bool = False) -> None:
    write_atomic(path, lambda fh: fh.write(data), exclusive)


def write_text_atomic(path, text: str, exclusive: bool = False) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), exclusive)


def read_small_file(path, max_bytes: int, what: str, error: type[Exception]) -> bytes:
    """A file that should be small, read whole: `error` in one line naming the file when it cannot be
    read or is larger than `max_bytes` (then it is not `what`), so a wrong path never fills memory."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: larger than {max_bytes} bytes: not {what}")
    return data
