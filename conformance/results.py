"""Check results and the kit's report: JSON for machines, a summary for people.

A report certifies a backend only if it ran checks, at least one passed, none failed, and it was not
a quick run. A report with no passing check (no check at all, or only expected failures) is never
"ok": a kit that checked nothing must not pass. A quick run (reduced sizes) is "ok" when nothing
failed, but it is marked, in the report and in the summary, as not a certification.

A check whose graphs need an op the backend does not declare (Backend.supported_ops) is
'unsupported': neither a pass nor a failure, counted apart. Each check certifies a workload: `cnn`
(the ResNet family), `lm` (the transformer checks) or `ir` (the model-zoo CNN ops, which no workload
needs). A workload is certified where the report certifies and every check of that workload ran
(none unsupported): a plugin that lowers only the CNN ops certifies for the CNN workload, not the LM
one, and `aiperf conformance` still exits 0 for it. `--workload` runs the checks of some tags only
(`workload_scope`); the others are then not certified.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from aiperf_core.atomic import write_text_atomic

PASS, FAIL, XFAIL, XPASS, ERROR, UNSUPPORTED = "pass", "fail", "xfail", "xpass", "error", "unsupported"
BAD = (FAIL, XPASS, ERROR)
STATUSES = (PASS, FAIL, XFAIL, XPASS, ERROR, UNSUPPORTED)
WORKLOADS = ("cnn", "lm")  # what a scored run trains
CHECK_TAGS = WORKLOADS + ("ir",)  # what a check certifies; 'ir' (the model-zoo CNN ops) is no workload's
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
    workload: str = "cnn"  # what the check certifies (CHECK_TAGS)
    missing_ops: list[str] = field(default_factory=list)  # why it is unsupported: the ops the backend lacks

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
    # The check tags whose checks the kit ran (`--workload`); a workload left out is not certified.
    workload_scope: list[str] = field(default_factory=lambda: list(CHECK_TAGS))

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

    def workloads(self) -> dict[str, bool]:
        """{workload: certified}: the report certifies, and the workload's checks ran (at least one, and
        none unsupported). A check result without a workload is a CNN one (reports from before workloads;
        aiperf_core/submission/check.py reads them so)."""
        out = {}
        for workload in WORKLOADS:
            rows = [r for r in self.results if r.workload == workload]
            out[workload] = self.certifies and bool(rows) and all(r.status != UNSUPPORTED for r in rows)
        return out

    def unsupported(self) -> dict[str, tuple[int, list[str]]]:
        """{workload: (unsupported checks, the ops the backend lacks for them)}, for each workload that has any."""
        found: dict[str, tuple[int, list[str]]] = {}
        for r in self.results:
            if r.status == UNSUPPORTED:
                count, ops = found.get(r.workload, (0, []))
                found[r.workload] = (count + 1, sorted(set(ops) | set(r.missing_ops)))
        return dict(sorted(found.items(), key=lambda item: CHECK_TAGS.index(item[0]) if item[0] in CHECK_TAGS
                           else len(CHECK_TAGS)))

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for r in self.results:
            out[r.status] += 1
        return out

    def to_dict(self) -> dict:
        return {"backend": self.backend, "framework_version": self.framework_version, "levels": self.levels,
                "device": self.device,
                "device_model": self.device_model, "precisions": self.precisions, "quick": self.quick,
                "note": QUICK_NOTE if self.quick else None, "expectations": self.expectations,
                "ok": self.ok, "certifies": self.certifies, "workload_scope": self.workload_scope,
                "workloads": self.workloads(), "counts": self.counts(),
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
        scope = []
        if self.results and not self.quick:
            scope.append(f"workloads certified: {', '.join(w for w, ok in self.workloads().items() if ok) or 'none'}")
        if c[UNSUPPORTED]:
            scope.append(f"unsupported: {c[UNSUPPORTED]} checks of {', '.join(self.unsupported())}")
        left_out = [t for t in CHECK_TAGS if t not in self.workload_scope]
        if left_out:
            scope.append(f"not run (--workload): {', '.join(left_out)}")
        if scope:
            figures += f" ({'; '.join(scope)})"
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
                c = {s: sum(r.status == s for r in rows) for s in STATUSES}
                unsupported = f"  {c[UNSUPPORTED]:3d} unsupported" if c[UNSUPPORTED] else ""
                lines.append(f"  {level:<8} {precision:<4} {c[PASS]:3d} passed  {c[FAIL] + c[ERROR] + c[XPASS]:3d} "
                             f"failed  {c[XFAIL]:3d} expected failures{unsupported}  "
                             f"({sum(r.seconds for r in rows):.1f} s)")
        for workload, (count, ops) in self.unsupported().items():
            lines.append(f"  unsupported: {count} checks of workload '{workload}': the backend does not lower "
                         f"{', '.join(ops)} (Backend.supported_ops)")
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
