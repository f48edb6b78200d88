"""The user's config file: TOML, `--config FILE`, else $AIPERF_CONFIG, else ./aiperf.toml if present.

Only what a command reads from it is interpreted here; today that is `backend`. The run
configuration with its fixed and customizable items builds on the same file.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Mapping

from aiperf_core.errors import AiperfError

DEFAULT_NAME = "aiperf.toml"
ENV_VAR = "AIPERF_CONFIG"
KNOWN_KEYS = {"backend"}


def load_config(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    environ = os.environ if environ is None else environ
    explicit = path or environ.get(ENV_VAR)
    candidate = Path(explicit) if explicit else Path(DEFAULT_NAME)
    if not candidate.is_file():
        if explicit:
            raise AiperfError(f"config file {candidate}: no such file")
        return {}
    try:
        data = tomllib.loads(candidate.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AiperfError(f"config file {candidate}: {exc}") from None
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown:
        raise AiperfError(f"config file {candidate}: unknown setting '{unknown[0]}' (known: {', '.join(sorted(KNOWN_KEYS))})")
    if "backend" in data and not (isinstance(data["backend"], str) and data["backend"]):
        raise AiperfError(f"config file {candidate}: 'backend' must be a non-empty string")
    return data
