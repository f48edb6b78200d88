"""Check results and the kit's report: JSON for machines, a summary for people.

A report certifies a backend only if it ran checks, at least one passed, none failed, and it was not
a quick run. A report with no passing check (no check at all, or only expected failures) is never
"ok": a kit that checked nothing must not pass. A quick run (reduced sizes) is "ok" when nothing
failed, but it is marked, in the report and in the summary, as not a certification.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from aiperf_core.atomic import write_text_atomic

PASS, FAIL, XFAIL, XPASS, ERROR = "pass", "fail", "xfail", "xpass", "error"
BAD = (FAIL, XPASS, ERROR)
QUICK_NOTE = "quick: not a certification (reduced sizes)"


@dataclass
class CheckResult:
    level: str
    name: str
    status: str
    measured: Any = None
    expected: Any = None
    tolerance: Any = None
    message: str = ""
    seconds: float = 0.0
    precision: str = "fp32"
    device: str | None = None

    @property
    def id(self) -> str:
        from aiperf_conformance.kit import check_id

        return check_id(self.level, self.name, self.precision)


@dataclass
class Report:
    backend: str
    framework_version: str | None
    levels: list[str]
    results: list[CheckResult] = field(default_factory=list)
    device: str | None = None  # the device under test
    device_model: str | None = None  # its hardware model (Backend.device_model): what certification names
    precisions: list[str] = field(default_factory=list)  # the precisions checked there
    quick: bool = False
    expectations: dict | None = None  # {"file": {"path", "sha256"} | None, "defaults": {"path", "sha256"}}

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status in BAD]

    @property
    def passed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == PASS]

    @property
    def ok(self) -> bool:
        """Nothing failed and something passed (the exit status of `aiperf conformance`)."""
        return bool(self.passed) and not self.failed

    @property
    def certifies(self) -> bool:
        return self.ok and not self.quick

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in (PASS, FAIL, XFAIL, XPASS, ERROR)}
        for r in self.results:
            out[r.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"backend": self.backend, "framework_version": self.framework_version, "levels": self.levels,
                "device": self.device,
                "device_model": self.device_model, "precisions": self.precisions, "quick": self.quick,
                "note": QUICK_NOTE if self.quick else None, "expectations": self.expectations,
                "ok": self.ok, "certifies": self.certifies, "counts": self.counts(),
                "checks": [asdict(r) | {"id": r.id} for r in self.results]}

    def write(self, path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1, default=_plain))

    def verdict(self) -> str:
        c = self.counts()
        figures = f"{c[PASS]} passed, {c[FAIL] + c[ERROR] + c[XPASS]} failed, {c[XFAIL]} expected failures"
        if self.failed:
            word = "DOES NOT CONFORM"
        elif not self.results:
            word = "DOES NOT CONFORM: no check ran"
        elif not self.passed:
            word = "DOES NOT CONFORM: no check passed"
        else:
            word = "CONFORMS"
        if self.quick:
            return f"{word}: {figures} -- {QUICK_NOTE}"
        return f"{word}: {figures}"

    def summary(self) -> str:
        head = f"conformance of backend '{self.backend}' ({self.framework_version})"
        if self.quick:
            head = f"{QUICK_NOTE.upper()}: {head}"
        lines = [head,
                 f"  device under test: {self.device} ({self.device_model or 'model unknown'}); "
                 f"precisions: {', '.join(self.precisions)}; "
                 f"levels: {', '.join(self.levels)}"]
        if self.expectations:
            lines.append("  " + _describe_expectations(self.expectations))
        for level in self.levels:
            for precision in self.precisions:
                rows = [r for r in self.results if r.level == level and r.precision == precision]
                if not rows:
                    continue
                c = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, XFAIL, XPASS, ERROR)}
                lines.append(f"  {level:<8} {precision:<4} {c[PASS]:3d} passed  {c[FAIL] + c[ERROR] + c[XPASS]:3d} "
                             f"failed  {c[XFAIL]:3d} expected failures  ({sum(r.seconds for r in rows):.1f} s)")
        for r in self.results:
            if r.status in BAD:
                lines.append(f"  {r.status.upper():5} {r.id}: {r.message}")
            elif r.status == XFAIL:
                lines.append(f"  xfail {r.id}: {r.message}")
        lines.append(self.verdict())
        return "\n".join(lines)


def _describe_expectations(exp: dict) -> str:
    defaults = exp.get("defaults") or {}
    tail = f"defaults {defaults.get('path')} (sha256 {defaults.get('sha256')})"
    if exp.get("file"):
        return f"expectations: {exp['file']['path']} (sha256 {exp['file']['sha256']}); {tail}"
    return f"expectations: none (the backend has no expectations file); {tail}"


def _plain(value):
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(value)
