"""Atomic file writes: a temporary file in the same folder, fsync, then rename.

A reader never sees a half-written file, and a crash never destroys the
previous version of a finished result.
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


def write_bytes_atomic(path, data: bytes, exclusive: bool = False) -> None:
    write_atomic(path, lambda fh: fh.write(data), exclusive)


def write_text_atomic(path, text: str, exclusive: bool = False) -> None:
    write_bytes_atomic(path, text.encode("utf-8"), exclusive)
