"""The OUT folder of `aiperf data prepare`, whatever it prepares (prepare.py: ImageNet, enwik8.py:
enwik8): claiming it, the resume state under OUT/.prepare/, and what a refusal leaves in it.

A failure that a rerun of the same command can mend keeps what is finished: an interruption
(Ctrl-C, SIGTERM, SIGKILL, a worker process killed) or an error writing OUT (a full disk) leaves the
finished files and the resume state, and the rerun continues from them. A source that is itself
damaged (SourceDamagedError) would fail the same way on every rerun: the prepare then removes every
file it wrote in OUT and its resume state, so that nothing is left that looks prepared (no split
file or shard that `aiperf data check` or a loader would read as a dataset).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from aiperf_core.atomic import write_text_atomic
from aiperf_core.data.manifest import Manifest, read_manifest
from aiperf_core.errors import AiperfError

STATE = ".prepare"  # resume state, hidden: the loaders and the manifest ignore it
SETTINGS = "settings.json"


class PrepareError(AiperfError):
    pass


class SourceDamagedError(PrepareError):
    """The source cannot be prepared whatever the rerun: a damaged archive member, an image that
    cannot be decoded, counts that contradict the devkit."""


def read_state_json(path: Path) -> dict | None:
    """A JSON record of the resume state, or None where there is none yet."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        state = next((p for p in path.parents if p.name == STATE), path.parent)
        raise PrepareError(f"{path}: damaged resume state ({exc}); remove {state} to start over") from None


def claim_out(out: Path, settings: dict, manifest_settings: dict | None = None) -> Manifest | None:
    """Make `out` this prepare's, or refuse it in one line where it holds something else. Returns
    the manifest where `out` already holds this very dataset (its recorded settings are
    `manifest_settings`, by default `settings`); otherwise None, with `settings` recorded under
    OUT/.prepare/, where a rerun must find them unchanged to resume."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"{out}: exists and is not a folder")
    manifest = read_manifest(out) if out.is_dir() else None
    if manifest is not None:
        if manifest.extra.get("settings") != (settings if manifest_settings is None else manifest_settings):
            raise PrepareError(f"{out}: already holds a prepared dataset made with other settings or sources")
        return manifest
    state = read_state_json(out / STATE / SETTINGS)
    if state is None:
        if out.is_dir() and any(p.name != STATE for p in out.iterdir()):
            raise PrepareError(f"{out}: exists and is not empty (and holds no unfinished prepare): "
                               f"choose a new or empty folder")
        write_text_atomic(out / STATE / SETTINGS, json.dumps(settings))
    elif state != settings:
        differs = sorted(k for k in set(state) | set(settings) if state.get(k) != settings.get(k))
        raise PrepareError(f"{out}: holds an unfinished prepare with other settings ({', '.join(differs)}); "
                           f"rerun it with those, or use a new folder")
    return None


def remove_stale_temporaries(out: Path) -> None:
    """write_atomic's temporary files left by a killed run (hidden, never a finished file)."""
    for folder in (out, *(p for p in (out / STATE).rglob("*") if p.is_dir())):
        for path in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                path.unlink()


@contextlib.contextmanager
def discarded_if_source_damaged(out: Path, outputs: Iterable[str]) -> Iterator[None]:
    """Around a prepare from its claim of `out` on: on SourceDamagedError, remove `outputs` (the
    names the prepare writes in OUT: files or folders), their temporaries and the resume state, and
    OUT itself where this prepare made it; the error then says so. Any other failure leaves OUT as
    it is, for the rerun to resume."""
    made = not out.exists()
    try:
        yield
    except SourceDamagedError as exc:
        for name in outputs:
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    path.unlink()
        for path in out.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                path.unlink()
        shutil.rmtree(out / STATE, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):
                out.rmdir()  # only where it is empty
        exc.args = (f"{exc}; nothing prepared is left in {out}",)
        raise
