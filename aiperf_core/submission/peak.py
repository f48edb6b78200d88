"""The measured peak (peak.json): `aiperf peak`, and reading a peak file back.

What is measured: each local device's dense matrix-multiply rate, per precision the backend
declares on it, with the backend's own framework (Backend.matmul_seconds): square products of a
ladder of sizes, several timed repeats each after a warm-up, and the best rate over every size and
repeat. One product of size n counts 2*n**3 ops (a multiply-accumulate is two ops, as opcount
counts them), so the measured peak is in the unit of the score. It is the Rmax-like ceiling a
submission's score is read against: the list shows the score as a fraction of it, and the check
calls a score above it times the accelerator count implausible (docs/submission.md).

How long it takes: the ladder (SIZES) depends on the kind of device, and a device's time budget
(BUDGET_S) is shared by its precisions: a larger size is tried only while the time it is projected
to take, from the size before, still fits the precision's share. So a slow device stops early and a
fast one reaches the sizes where it runs at its best.

peak.json, schema version 1:
    {"schema_version": 1, "kind": "aiperf-peak", "backend": "torch", "framework_version": "2.13.0",
     "host": "node01", "measured_at": "2026-11-25T15:40:00+00:00",
     "devices": [{"device": "cuda:0", "model": "NVIDIA H100 80GB HBM3",
                  "precisions": {"fp32": {"ops_per_s": 5.1e13, "size": 16384, "best_seconds": 0.172,
                                          "repeats": 5, "spread": 0.02}}}]}
`model` is Backend.device_model (null where the backend cannot tell); `size` is the size of the
best product, `best_seconds` its time, `repeats` the timed products at that size, and
`ops_per_s` = 2*size**3 / best_seconds (load_peak checks that it is). `spread` (since issue 51;
absent in older files) is (slowest - fastest) / fastest of the repeats at that size: above
SPREAD_WARNING (10%) the device was not quiet while it was measured, the peak is likely low, and
`aiperf peak` and `aiperf check` say so (spread_warnings).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from aiperf_core.backend import PRECISIONS, Backend, BackendError
from aiperf_core.inventory import is_cpu_device
from aiperf_core.submission import SubmissionError

SCHEMA_VERSION = 1
KIND = "aiperf-peak"

# Sizes tried, smallest first, per kind of device; the budget decides how far up a device goes. A
# core's BLAS is at its best by 512-2048, a many-core CPU needs 4096 or 8192 to keep every core busy,
# and an accelerator 8192 or more to fill its tensor cores (three 16384 fp32 matrices take 3 GiB).
SIZES = {"cpu": (256, 512, 1024, 2048, 4096, 8192), "accelerator": (2048, 4096, 8192, 16384)}
REPEATS = 5  # timed products per size, after one warm-up
# A best size whose repeats are further apart than this was measured on a device that was not quiet:
# its best rate is likely below the device's, and every efficiency against it reads high.
SPREAD_WARNING = 0.10
# Seconds one device may take over all its precisions (each precision gets an equal share): well
# under a minute with the framework's start-up, and enough for a slow device's mid-size products.
BUDGET_S = {"cpu": 30.0, "accelerator": 40.0}

Progress = Callable[[str], None]


def ops_per_product(size: int) -> int:
    """Ops of one (size x size) @ (size x size) product: size**3 multiply-accumulates, two ops each."""
    return 2 * size ** 3


def spread(seconds: Sequence[float]) -> float:
    """(slowest - fastest) / fastest of repeated products: 0 on a quiet device."""
    return (max(seconds) - min(seconds)) / min(seconds)


def device_kind(device: str) -> str:
    """'cpu' for a backend's CPU device ('cpu', 'cpu:1', 'cpu (x86_64)'), else 'accelerator'."""
    return "cpu" if is_cpu_device(device) else "accelerator"


def _chosen_precisions(backend: Backend, devices: Sequence[str], precisions: Iterable[str] | None) -> dict[str, tuple[str, ...]]:
    """Per device, the precisions to measure: every declared one, or the asked ones, each of which
    must be declared on every device."""
    declared = {device: tuple(backend.precisions(device)) for device in devices}
    if precisions is None:
        return declared
    asked = list(precisions)
    if not asked:
        raise BackendError(f"no precision given (precisions: {', '.join(PRECISIONS)})")
    for precision in asked:
        if precision not in PRECISIONS:
            raise BackendError(f"unknown precision '{precision}' (precisions: {', '.join(PRECISIONS)})")
        for device in devices:
            if precision not in declared[device]:
                raise BackendError(f"backend '{backend.name}' does not declare precision '{precision}' on {device} "
                                   f"(declared: {', '.join(declared[device])})")
    return {device: tuple(p for p in PRECISIONS if p in asked) for device in devices}


def _timed(backend: Backend, device: str, precision: str, size: int, repeats: int) -> list[float]:
    seconds = backend.matmul_seconds(device, precision, size, repeats)
    if len(seconds) != repeats or not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in seconds):
        raise BackendError(f"backend '{backend.name}' timed {size}x{size} products on {device} at {precision} as "
                           f"{seconds!r}: expected {repeats} positive seconds")
    return [float(s) for s in seconds]


def measure_precision(backend: Backend, device: str, precision: str, sizes: Sequence[int], repeats: int,
                      budget_s: float, progress: Progress | None = None) -> dict[str, Any]:
    """The best rate of `precision` on `device` over `sizes` (ascending), stopping before a size
    projected to overrun `budget_s`; {"ops_per_s", "size", "best_seconds", "repeats", "spread"}
    (the spread of the repeats at the best size)."""
    if not sizes:
        raise BackendError("no matrix size to measure")
    best: dict[str, Any] | None = None
    started = time.perf_counter()
    for index, size in enumerate(sizes):
        call_start = time.perf_counter()
        seconds = _timed(backend, device, precision, size, repeats)
        call_s = time.perf_counter() - call_start
        rate = ops_per_product(size) / min(seconds)
        if best is None or rate > best["ops_per_s"]:
            best = {"ops_per_s": rate, "size": size, "best_seconds": min(seconds), "repeats": repeats,
                    "spread": spread(seconds)}
        if progress is not None:
            from aiperf_core.scoring import format_ops

            progress(f"{device} {precision} {size}x{size}: best {min(seconds):.4g} s, {format_ops(rate)} "
                     f"({repeats} repeats, spread {spread(seconds):.1%}, {call_s:.1f} s)")
        if index + 1 < len(sizes):
            # The products scale with the cube of the size, the rest (making inputs, compiling,
            # warming up) with at most its square.
            products_s = sum(seconds) * (repeats + 1) / repeats
            growth = sizes[index + 1] / size
            projected = products_s * growth ** 3 + max(call_s - products_s, 0.0) * growth ** 2
            used = time.perf_counter() - started
            if used + projected > budget_s:
                if progress is not None:
                    progress(f"{device} {precision}: {sizes[index + 1]}x{sizes[index + 1]} and larger skipped "
                             f"(about {projected:.0f} s projected, {used:.0f} s used of a {budget_s:.0f} s budget)")
                break
    return best


def measure_peak(backend: Backend, precisions: Iterable[str] | None = None, sizes: Sequence[int] | None = None,
                 repeats: int = REPEATS, budget_s: float | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Measure every device of backend.devices() at every precision it declares there (or the
    given ones): the peak.json record (module docstring). `sizes` (default SIZES by kind of
    device) and `budget_s` (default BUDGET_S by kind, per device) bound the time taken."""
    if repeats < 1:
        raise BackendError(f"repeats must be >= 1, got {repeats}")
    if sizes is not None and (not sizes or any(not isinstance(n, int) or n < 1 for n in sizes)):
        raise BackendError(f"sizes must be positive whole numbers, got {list(sizes)}")
    devices = list(backend.devices())
    chosen = _chosen_precisions(backend, devices, precisions)
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "kind": KIND, "backend": backend.name,
        "framework_version": backend.framework_version(), "host": socket.gethostname(),
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "devices": [],
    }
    for device in devices:
        kind = device_kind(device)
        ladder = sorted(sizes if sizes is not None else SIZES[kind])
        share = (budget_s if budget_s is not None else BUDGET_S[kind]) / len(chosen[device])
        measured = {precision: measure_precision(backend, device, precision, ladder, repeats, share, progress)
                    for precision in chosen[device]}
        record["devices"].append({"device": device, "model": backend.device_model(device), "precisions": measured})
    return record


def write_peak(record: dict[str, Any], path: str | os.PathLike, force: bool = False) -> None:
    """Write a peak record to `path` atomically; an existing file is refused unless `force`."""
    from aiperf_core.atomic import write_text_atomic

    text = json.dumps(record, indent=2) + "\n"
    try:
        write_text_atomic(path, text, exclusive=not force)
    except FileExistsError:
        raise SubmissionError(f"{path}: exists (give --force to overwrite it)") from None
    except OSError as exc:
        raise SubmissionError(f"{path}: cannot write: {exc.strerror or exc}") from None


# -- reading ---------------------------------------------------------------------------------------
def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _non_negative_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_measurement(fail: Callable[[str, str], None], where: str, m: Any) -> None:
    if not isinstance(m, dict):
        fail(where, f"expected an object, got {type(m).__name__}")
    for key in ("ops_per_s", "size", "best_seconds", "repeats"):
        if key not in m:
            fail(f"{where}.{key}", "missing")
    if not _positive_number(m["ops_per_s"]):
        fail(f"{where}.ops_per_s", f"must be a positive number of ops per second, got {m['ops_per_s']!r}")
    if not _positive_int(m["size"]):
        fail(f"{where}.size", f"must be a positive whole number, got {m['size']!r}")
    if not _positive_number(m["best_seconds"]):
        fail(f"{where}.best_seconds", f"must be a positive number of seconds, got {m['best_seconds']!r}")
    if not _positive_int(m["repeats"]):
        fail(f"{where}.repeats", f"must be a positive whole number, got {m['repeats']!r}")
    if "spread" in m and not _non_negative_number(m["spread"]):
        fail(f"{where}.spread", f"must be a non-negative number, got {m['spread']!r}")
    expected = ops_per_product(m["size"]) / m["best_seconds"]
    if not math.isclose(m["ops_per_s"], expected, rel_tol=1e-6):
        fail(f"{where}.ops_per_s", f"{m['ops_per_s']!r} is not 2*size**3/best_seconds = {expected!r}")


def validate_peak(record: Any, path: str | os.PathLike) -> dict[str, Any]:
    """`record` if it is a valid peak.json (schema version 1), else SubmissionError naming the field."""

    def fail(field: str, problem: str) -> None:
        raise SubmissionError(f"{path}: {field}: {problem}")

    if not isinstance(record, dict):
        fail("(top level)", f"expected a JSON object, got {type(record).__name__}")
    if record.get("kind") != KIND:
        fail("kind", f"expected '{KIND}', got {record.get('kind')!r}")
    version = record.get("schema_version")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        fail("schema_version", f"this aiperf reads version {SCHEMA_VERSION}, got {version!r}")
    for key in ("backend", "framework_version", "host", "measured_at"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            fail(key, "missing" if key not in record else f"must be a non-empty string, got {record[key]!r}")
    try:
        measured_at = datetime.fromisoformat(record["measured_at"])
    except ValueError:
        fail("measured_at", f"not an ISO 8601 time: {record['measured_at']!r}")
    if measured_at.tzinfo is None:
        fail("measured_at", f"has no time zone (UTC expected): {record['measured_at']!r}")
    devices = record.get("devices")
    if not isinstance(devices, list) or not devices:
        fail("devices", "missing" if devices is None else "must be a non-empty list of devices")
    for i, entry in enumerate(devices):
        where = f"devices[{i}]"
        if not isinstance(entry, dict):
            fail(where, f"expected an object, got {type(entry).__name__}")
        if not isinstance(entry.get("device"), str) or not entry["device"].strip():
            fail(f"{where}.device", "missing" if "device" not in entry else "must be a non-empty string")
        if "model" not in entry:
            fail(f"{where}.model", "missing (null where the backend cannot tell)")
        if entry["model"] is not None and (not isinstance(entry["model"], str) or not entry["model"].strip()):
            fail(f"{where}.model", f"must be a non-empty string or null, got {entry['model']!r}")
        measurements = entry.get("precisions")
        if not isinstance(measurements, dict) or not measurements:
            fail(f"{where}.precisions", "missing" if measurements is None else
                 "must be a non-empty object of precision -> measurement")
        for precision, m in measurements.items():
            if precision not in PRECISIONS:
                fail(f"{where}.precisions.{precision}", f"unknown precision (precisions: {', '.join(PRECISIONS)})")
            _check_measurement(fail, f"{where}.precisions.{precision}", m)
    return record


def load_peak(path: str | os.PathLike) -> dict[str, Any]:
    """A peak.json file, validated (validate_peak); a bad file is a one-line SubmissionError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SubmissionError(f"{path}: cannot read: {exc.strerror if isinstance(exc, OSError) else exc}") from None
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise SubmissionError(f"{path}: not JSON: {exc}") from None
    return validate_peak(record, path)


def spread_warnings(peak: dict[str, Any], precisions: Iterable[str] | None = None,
                    model: str | None = None) -> list[str]:
    """One line per measurement (of `precisions` and `model` when given) whose repeats spread more
    than SPREAD_WARNING: its device was not quiet, so its peak is likely low and an efficiency
    against it reads high. A file without spreads (written before they were recorded) has none."""
    lines = []
    for entry in peak["devices"]:
        if model is not None and entry["model"] != model:
            continue
        for precision, m in entry["precisions"].items():
            if (precisions is None or precision in precisions) and m.get("spread", 0.0) > SPREAD_WARNING:
                lines.append(f"{entry['device']} {precision}: the {m['repeats']} products at {m['size']}x{m['size']} "
                             f"spread {m['spread']:.0%} (more than {SPREAD_WARNING:.0%}): the device was not quiet, "
                             f"so the peak is likely under-measured; measure it again on an idle node")
    return lines


def peak_per_device(peak: dict[str, Any], precision: str, model: str | None = None) -> float | None:
    """The best ops_per_s measured at `precision` over the devices of a peak record (those of
    `model` when given); None when none was measured there."""
    rates = [entry["precisions"][precision]["ops_per_s"] for entry in peak["devices"]
             if precision in entry["precisions"] and (model is None or entry["model"] == model)]
    return max(rates) if rates else None
