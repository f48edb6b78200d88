"""Per-backend tolerances and expected failures, read from data files (as ONNX's backend tests do).

Lookup order: conformance/data/<backend>.json (first-party backends), then the file the backend
itself ships (Backend.conformance_file()), then the defaults below. Every expected failure needs a
reason; a check listed as expected to fail that passes is reported as 'xpass' and fails the kit,
so the data files cannot go stale silently.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiperf_core.errors import AiperfError

DATA_DIR = Path(__file__).parent / "data"

DEFAULT_TOLERANCES = {
    "op": 1e-4,          # float32 backends against the float64 reference, max error / max |reference|
    "op_grad": 1e-4,
    "graph": 1e-3,
    "morph": 1e-4,       # child vs parent on the same backend
    "train_grad": 1e-3,
    "count": 0.0,        # exact where conventions coincide
    "count_other": 0.05, # categories where the native counter's rule differs by a declared amount
    "train_accuracy": 0.90,
}


@dataclass
class Expectations:
    tolerances: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    xfail: dict[str, str] = field(default_factory=dict)  # check-id glob -> reason
    source: str = "defaults"

    def tolerance(self, key: str) -> float:
        return self.tolerances[key]

    def xfail_reason(self, check_id: str) -> str | None:
        for pattern, reason in self.xfail.items():
            if fnmatch.fnmatchcase(check_id, pattern):
                return reason
        return None


def load_expectations(backend_name: str, backend=None) -> Expectations:
    path = DATA_DIR / f"{backend_name}.json"
    if not path.is_file() and backend is not None and getattr(backend, "conformance_file", None):
        candidate = backend.conformance_file()
        path = Path(candidate) if candidate else path
    if not path.is_file():
        return Expectations()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AiperfError(f"{path}: cannot read conformance expectations: {exc}") from None
    tolerances = dict(DEFAULT_TOLERANCES)
    for key, value in data.get("tolerances", {}).items():
        if key not in DEFAULT_TOLERANCES:
            raise AiperfError(f"{path}: unknown tolerance '{key}' (known: {', '.join(DEFAULT_TOLERANCES)})")
        if not isinstance(value, (int, float)) or value < 0:
            raise AiperfError(f"{path}: tolerance '{key}' must be a non-negative number")
        tolerances[key] = float(value)
    xfail = {}
    for entry in data.get("xfail", []):
        if not isinstance(entry, dict) or not entry.get("check") or not entry.get("reason"):
            raise AiperfError(f"{path}: every xfail entry needs 'check' and 'reason'")
        xfail[entry["check"]] = entry["reason"]
    return Expectations(tolerances, xfail, str(path))
