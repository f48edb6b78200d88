"""Argument types shared by several subcommands."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import tempfile
from pathlib import Path
from typing import Iterator

from aiperf_core.errors import AiperfError


def image_shape(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not HxWxC (for example 224x224x3)")
    shape = tuple(int(g) for g in m.groups())
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': every size must be at least 1")
    return shape


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 1")
    return value


def positive_int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' must not be negative")
    return value


def add_model_arguments(p, what: str = "builder name (resnet50, resnet_small), IR .json or .onnx file") -> None:
    """MODEL plus the builder-only shape options, shared by every command that takes a model."""
    p.add_argument("model", metavar="MODEL", help=what)
    p.add_argument("--input", type=image_shape, default=None, metavar="HxWxC",
                   help="input shape for builder models (default: the builder's, 224x224x3 for resnet50)")
    p.add_argument("--classes", type=positive_int, default=None, metavar="N",
                   help="number of classes for builder models (default: the builder's, 1000 for resnet50)")


GPT_SIZE_FLAGS = (("--layers", "transformer blocks"), ("--hidden", "model width H"),
                  ("--heads", "attention heads (they divide H)"),
                  ("--kv-heads", "llama: key-value heads (they divide the heads; default: the heads)"),
                  ("--seq-len", "tokens per sequence S"), ("--vocab", "vocabulary size V"),
                  ("--ffn", "MLP width (default: gpt 4H, llama 8H/3 rounded up to a multiple of 64)"))


def add_gpt_size_arguments(p) -> None:
    """The transformer builders' size options (builders.GPT_DEFAULTS, builders.LLAMA_DEFAULTS)."""
    group = p.add_argument_group("gpt and llama builder sizes (defaults: 2 layers, hidden 128, 4 heads, seq-len 128, "
                                 "vocab 256)")
    for flag, what in GPT_SIZE_FLAGS:
        group.add_argument(flag, type=positive_int, default=None, metavar="N", help=what)


def gpt_sizes(args) -> dict:
    """The gpt size options as load_model's keyword arguments (None: the builder's default)."""
    return {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _ in GPT_SIZE_FLAGS}


def path_problem(what: str, path: str | os.PathLike, exc: OSError) -> AiperfError:
    """One line for a filesystem error: `what` (an option and `path`, or `path`), the reason, and
    the path that failed where it is another one (a parent folder, a file inside)."""
    name = exc.filename2 if exc.filename2 is not None else exc.filename  # a rename's target is the problem
    failed = None if name is None else Path(os.fsdecode(name))
    reason = exc.strerror or str(exc)
    if isinstance(exc, (FileExistsError, NotADirectoryError)) and failed is not None:
        blocker = next((p for p in (failed, *failed.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():  # mkdir's 'File exists' says nothing useful
            return AiperfError(f"{what}: cannot write there: {blocker} is a file, not a folder")
    if failed is not None and failed != Path(path):
        reason += f" ({failed})"
    return AiperfError(f"{what}: cannot write there: {reason}")


@contextlib.contextmanager
def writing(path: str | os.PathLike, option: str | None = None) -> Iterator[None]:
    """An OSError inside becomes path_problem: the CLI prints one line naming the option and
    `path` (where the error is about writing there) and exits 2."""
    try:
        yield
    except OSError as exc:
        raise path_problem(f"{option} {path}" if option else f"{path}", path, exc) from None


def writable_folder(option: str | None, path: str | os.PathLike, files: tuple[str, ...] = ()) -> Path:
    """Check, before any long work, that a folder can be written at `path`: it is a folder that accepts
    a new file, or it does not exist yet and its nearest existing parent is such a folder (the commands
    make their output folder with its parents); none of the `files` the command writes in it is a
    folder. `option` names the option in the one-line error, None for an argument. Returns the path."""
    target = Path(path)
    what = f"{option} {target}" if option else f"{target}"
    with writing(target, option):  # a folder on the way that cannot even be looked into
        _accepts_new_file(what, target, target, may_be_made=True)
        for name in files:
            if (target / name).is_dir():
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target / name))
    return target


def writable_file(option: str | None, path: str | os.PathLike, folder_made: bool = True) -> Path:
    """Check, before any long work, that a file can be written at `path`: `path` is not a folder, and
    its folder accepts a new file or, where the writer makes it (`folder_made`, as atomic.write_atomic
    does), does not exist yet below one that does. Returns the path."""
    target = Path(path)
    what = f"{option} {target}" if option else f"{target}"
    with writing(target, option):  # a folder on the way that cannot even be looked into
        if target.is_dir():
            raise AiperfError(f"{what}: is a folder, not a file")
        _accepts_new_file(what, target, target.parent, may_be_made=folder_made)
    return target


def _accepts_new_file(what: str, target: Path, folder: Path, may_be_made: bool) -> None:
    """Refuse, in one line starting with `what`, a `folder` in which no file can be made. Nothing is
    left behind: a missing folder is not made (a command that fails later leaves no empty folder
    behind), and the probe file is removed at once."""
    chain = [folder, *folder.absolute().parents]
    found = next(k for k, p in enumerate(chain) if p.exists())  # "/" always exists
    existing, missing = chain[found], chain[found - 1] if found else None
    if not existing.is_dir():
        raise AiperfError(f"{what}: cannot write there: {existing} is a file, not a folder")
    if missing is not None and not may_be_made:
        raise AiperfError(f"{what}: cannot write there: its folder {folder} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".aiperf-", suffix=".probe", dir=existing)
    except OSError as exc:  # named as the folder the writer would fail on, not the probe's random name
        raise path_problem(what, target, OSError(exc.errno, exc.strerror, str(missing or existing))) from None
    os.close(fd)
    os.unlink(probe)
