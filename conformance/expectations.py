"""Per-backend tolerances and expected failures, read from data files (as ONNX's backend tests do).

Two files decide what a backend is held to:

* `conformance/defaults.json` (this package): the default tolerance of every key at every precision,
  each with the reason for its value (JSON has no comments: every tolerance is
  `{"value": number, "reason": text}`).
* The backend's own expectations file, if it has one: the file its `conformance_file()` names (a
  plugin ships it inside its package), else `conformance/data/<backend>.json` (first-party backends).
  A `conformance_file()` that names no existing file is an error, never "no expectations".

An expectations file is read strictly. Its top level has only `about` (free text), `tolerances` and
`xfail`:

    {"about": "...",
     "tolerances": {"bf16": {"graph": {"value": 0.05, "reason": "..."}}},
     "xfail": [{"check": "count/*", "reason": "no native op counter"}]}

`tolerances` maps a precision (aiperf_core.backend.PRECISIONS) to tolerance keys (TOLERANCE_KEYS);
the keys of a level that runs at fp32 only (morph, count, parallel) exist only under fp32. An
`xfail` entry has exactly `check` (a glob over check ids, see kit.check_id) and `reason`; a pattern
that matches no check the kit has, at any precision, is an error (a typo would otherwise excuse
nothing and go unnoticed). A check listed as expected to fail that passes is reported as 'xpass' and
fails the kit, so the data files cannot go stale silently. Unknown keys anywhere are errors.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from aiperf_core.backend import PRECISIONS
from aiperf_core.errors import AiperfError

DATA_DIR = Path(__file__).parent / "data"
DEFAULTS_FILE = Path(__file__).parent / "defaults.json"

# Tolerance keys per precision. The op, graph and train levels run at every declared precision; the
# morph, count and parallel levels at fp32 only, so their keys exist only there.
PER_PRECISION_KEYS = ("op", "op_grad", "op_grad_lm", "graph", "graph_lm", "graph_zoo", "train_grad", "optimizer")
FP32_ONLY_KEYS = ("morph", "count", "count_other", "parallel")
TOLERANCE_KEYS = PER_PRECISION_KEYS + FP32_ONLY_KEYS
TOP_LEVEL_KEYS = ("about", "tolerances", "xfail")
XFAIL_KEYS = ("check", "reason")
_PATTERN_CHARS = re.compile(r"^[A-Za-z0-9_./@*?\[\]!-]+$")


def keys_at(precision: str) -> tuple[str, ...]:
    return TOLERANCE_KEYS if precision == "fp32" else PER_PRECISION_KEYS


@dataclass(frozen=True)
class Tolerance:
    value: float
    reason: str
    source: str  # the file that set it


@dataclass(frozen=True)
class SourceFile:
    path: str
    sha256: str

    def to_dict(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}


@dataclass
class Expectations:
    """Tolerances per precision and key, and expected failures (check-id glob -> reason).

    `file` is the backend's expectations file (None: the backend has none and is held to the
    defaults); `defaults` is the defaults file. Both are named, with their sha256, in every report."""

    tolerances: dict[str, dict[str, Tolerance]] = field(default_factory=lambda: load_defaults()[0])
    xfail: dict[str, str] = field(default_factory=dict)
    file: SourceFile | None = None
    defaults: SourceFile | None = field(default_factory=lambda: load_defaults()[1])

    def tolerance(self, key: str, precision: str = "fp32") -> float:
        try:
            return self.tolerances[precision][key].value
        except KeyError:
            raise AiperfError(f"no tolerance '{key}' at precision '{precision}'") from None

    def xfail_reason(self, check_id: str) -> str | None:
        for pattern, reason in self.xfail.items():
            if fnmatch.fnmatchcase(check_id, pattern):
                return reason
        return None

    def describe(self) -> str:
        """One line for summaries: which file, and its hash."""
        if self.file is None:
            return f"expectations: none (defaults only: {self.defaults.path}, sha256 {self.defaults.sha256})"
        return f"expectations: {self.file.path} (sha256 {self.file.sha256})"

    def to_dict(self) -> dict:
        return {"file": self.file.to_dict() if self.file else None,
                "defaults": self.defaults.to_dict() if self.defaults else None}


def _read_json(path: Path) -> tuple[dict, SourceFile]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise AiperfError(f"{path}: cannot read conformance expectations: {exc.strerror or exc}") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AiperfError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise AiperfError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data, SourceFile(str(path), hashlib.sha256(raw).hexdigest())


def _unknown(path, where: str, keys: Iterable[str], allowed: Iterable[str]) -> None:
    extra = sorted(set(keys) - set(allowed))
    if extra:
        raise AiperfError(f"{path}: unknown key '{extra[0]}' in {where} (allowed: {', '.join(allowed)})")


def _tolerances(path, data, required: bool) -> dict[str, dict[str, Tolerance]]:
    """The `tolerances` table of a file: {precision: {key: Tolerance}}, checked strictly."""
    table = data.get("tolerances", {})
    if not isinstance(table, dict):
        raise AiperfError(f"{path}: 'tolerances' must be an object of precisions")
    out: dict[str, dict[str, Tolerance]] = {}
    for precision, keys in table.items():
        if precision in TOLERANCE_KEYS:
            raise AiperfError(f"{path}: tolerances are given per precision: write \"tolerances\": "
                              f"{{\"fp32\": {{\"{precision}\": {{\"value\": ..., \"reason\": ...}}}}}}")
        if precision not in PRECISIONS:
            raise AiperfError(f"{path}: unknown precision '{precision}' in tolerances "
                              f"(precisions: {', '.join(PRECISIONS)})")
        if not isinstance(keys, dict):
            raise AiperfError(f"{path}: tolerances.{precision} must be an object of tolerance keys")
        _unknown(path, f"tolerances.{precision}", keys, keys_at(precision))
        out[precision] = {}
        for key, entry in keys.items():
            where = f"tolerances.{precision}.{key}"
            if not isinstance(entry, dict):
                raise AiperfError(f"{path}: {where} must be {{\"value\": number, \"reason\": text}}")
            _unknown(path, where, entry, ("value", "reason"))
            value, reason = entry.get("value"), entry.get("reason")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise AiperfError(f"{path}: {where}.value must be a finite number >= 0, got {value!r}")
            if not isinstance(reason, str) or not reason.strip():
                raise AiperfError(f"{path}: {where} needs a 'reason' (why this value)")
            out[precision][key] = Tolerance(float(value), reason.strip(), str(path))
    if required:
        for precision in PRECISIONS:
            missing = [k for k in keys_at(precision) if k not in out.get(precision, {})]
            if missing:
                raise AiperfError(f"{path}: no default tolerance '{missing[0]}' at precision '{precision}'")
    return out


_defaults_cache: dict[str, tuple[dict[str, dict[str, Tolerance]], SourceFile]] = {}


def load_defaults(path: Path = DEFAULTS_FILE) -> tuple[dict[str, dict[str, Tolerance]], SourceFile]:
    """The default tolerances (a fresh copy of the table) and the defaults file's identity."""
    key = str(path)
    if key not in _defaults_cache:
        data, source = _read_json(Path(path))
        _unknown(path, "the top level", data, ("about", "tolerances"))
        _defaults_cache[key] = (_tolerances(path, data, required=True), source)
    table, source = _defaults_cache[key]
    return {p: dict(keys) for p, keys in table.items()}, source


def check_pattern(path, pattern, known_ids: Iterable[str] | None) -> str:
    """An xfail glob: a non-empty pattern over the characters of check ids, with balanced brackets,
    that matches at least one of `known_ids` (the kit's whole catalogue) when given."""
    if not isinstance(pattern, str) or not pattern:
        raise AiperfError(f"{path}: xfail 'check' must be a non-empty check-id pattern, got {pattern!r}")
    if not _PATTERN_CHARS.match(pattern):
        raise AiperfError(f"{path}: xfail pattern {pattern!r} has characters no check id has "
                          f"(ids are level/name[@precision]; wildcards * ? [...])")
    if pattern.count("[") != pattern.count("]"):
        raise AiperfError(f"{path}: xfail pattern {pattern!r} has unbalanced brackets")
    if known_ids is not None and not any(fnmatch.fnmatchcase(i, pattern) for i in known_ids):
        raise AiperfError(f"{path}: xfail pattern {pattern!r} matches no check of the kit "
                          f"(aiperf conformance --list shows every check id)")
    return pattern


def read_expectations(path, known_ids: Iterable[str] | None = None) -> Expectations:
    """An expectations file on top of the defaults. `known_ids`: every check id the kit can run
    (kit.catalogue_ids()); each xfail pattern must match one of them."""
    path = Path(path)
    data, source = _read_json(path)
    _unknown(path, "the top level", data, TOP_LEVEL_KEYS)
    if "about" in data and not isinstance(data["about"], str):
        raise AiperfError(f"{path}: 'about' must be text")
    tolerances, defaults = load_defaults()
    for precision, keys in _tolerances(path, data, required=False).items():
        tolerances[precision].update(keys)
    entries = data.get("xfail", [])
    if not isinstance(entries, list):
        raise AiperfError(f"{path}: 'xfail' must be a list of {{\"check\": pattern, \"reason\": text}}")
    known = list(known_ids) if known_ids is not None else None
    xfail: dict[str, str] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise AiperfError(f"{path}: xfail[{i}] must be {{\"check\": pattern, \"reason\": text}}")
        _unknown(path, f"xfail[{i}]", entry, XFAIL_KEYS)
        pattern = check_pattern(path, entry.get("check"), known)
        reason = entry.get("reason")
        if not isinstance(reason, str) or not reason.strip():
            raise AiperfError(f"{path}: xfail[{i}] ({pattern}) needs a 'reason'")
        if pattern in xfail:
            raise AiperfError(f"{path}: xfail pattern {pattern!r} is listed twice")
        xfail[pattern] = reason.strip()
    return Expectations(tolerances, xfail, source, defaults)


def expectations_path(backend_name: str, backend=None) -> Path | None:
    """The backend's expectations file: what its conformance_file() names (which must exist), else
    conformance/data/<name>.json if present, else None (defaults only)."""
    declared = getattr(backend, "conformance_file", None) if backend is not None else None
    if declared is not None:
        candidate = declared()
        if candidate is not None:
            path = Path(candidate)
            if not path.is_file():
                raise AiperfError(f"backend '{backend_name}': conformance_file() names {path}, which does not "
                                  f"exist (is it listed in the package data?)")
            return path
    path = DATA_DIR / f"{backend_name}.json"
    return path if path.is_file() else None


def load_expectations(backend_name: str, backend=None) -> Expectations:
    from aiperf_conformance.kit import catalogue_ids

    path = expectations_path(backend_name, backend)
    if path is None:
        return Expectations()
    return read_expectations(path, catalogue_ids())
