"""Check results and the kit's report: JSON for machines, a summary for people."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from aiperf_core.atomic import write_text_atomic

PASS, FAIL, XFAIL, XPASS, ERROR = "pass", "fail", "xfail", "xpass", "error"
BAD = (FAIL, XPASS, ERROR)


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

    @property
    def id(self) -> str:
        return f"{self.level}/{self.name}"


@dataclass
class Report:
    backend: str
    framework_version: str | None
    levels: list[str]
    results: list[CheckResult] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckResult]:
        return [r for r in self.results if r.status in BAD]

    @property
    def ok(self) -> bool:
        return not self.failed

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in (PASS, FAIL, XFAIL, XPASS, ERROR)}
        for r in self.results:
            out[r.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"backend": self.backend, "framework_version": self.framework_version, "levels": self.levels,
                "ok": self.ok, "counts": self.counts(), "checks": [asdict(r) | {"id": r.id} for r in self.results]}

    def write(self, path) -> None:
        write_text_atomic(path, json.dumps(self.to_dict(), indent=1, default=_plain))

    def summary(self) -> str:
        lines = [f"conformance of backend '{self.backend}' ({self.framework_version}), levels: {', '.join(self.levels)}"]
        for level in self.levels:
            rows = [r for r in self.results if r.level == level]
            if not rows:
                continue
            c = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, XFAIL, XPASS, ERROR)}
            lines.append(f"  {level:<6} {c[PASS]:3d} passed  {c[FAIL] + c[ERROR] + c[XPASS]:3d} failed  "
                         f"{c[XFAIL]:3d} expected failures  ({sum(r.seconds for r in rows):.1f} s)")
        for r in self.results:
            if r.status in BAD:
                lines.append(f"  {r.status.upper():5} {r.id}: {r.message}")
            elif r.status == XFAIL:
                lines.append(f"  xfail {r.id}: {r.message}")
        c = self.counts()
        verdict = "CONFORMS" if self.ok else "DOES NOT CONFORM"
        lines.append(f"{verdict}: {c[PASS]} passed, {c[FAIL] + c[ERROR] + c[XPASS]} failed, {c[XFAIL]} expected failures")
        return "\n".join(lines)


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
