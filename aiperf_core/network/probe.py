"""The network probe (`aiperf probe network`): nccl-tests' all-reduce and all-to-all over a replica's ranks.

What is measured: the time of one collective over every rank of the nodes the probe was started
on, for each buffer size from MIN_BYTES to MAX_BYTES, with the backend's own collectives
(Backend.probe_collectives: torch.distributed, gloo on CPUs and NCCL on GPUs; jax's collectives
over jax.distributed's processes). The figures follow nccl-tests (its PERFORMANCE.md):

    latency   the median over the timed iterations of one collective's time (each iteration is
              started together on every rank and lasts until the slowest rank has finished it)
    algbw     bytes / latency, `bytes` the buffer of one rank (all-to-all: what one rank sends,
              split evenly over the ranks, its own share included)
    busbw     algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for all-to-all, n the ranks: the
              rate one rank's link carries, comparable with the link's own rate

Per size, one warm-up collective is timed first; its time (the slowest rank's) bounds the rest, the
same on every rank: up to `iterations` timed iterations, as many as fit `seconds_per_size`, at least
one, after up to `warmup` - 1 more warm-ups in a quarter of it. A size cut short that way is marked
"bounded" in the record and with "*" in the table: 256 MB over a slow link takes one iteration, not
twenty.

The fit: per collective, a least-squares alpha-beta model over the sizes, time = alpha + bus bytes
/ beta (bus bytes = bytes * the busbw factor), which the network simulation reads as its
calibration. The residuals are absolute seconds, so the large sizes, where the bandwidth shows, set
beta: relative residuals would weigh the many small sizes as much, and on a link shaped by a token
bucket those under its burst cross at the unshaped rate (measured: beta twice the shaped rate). Where
the best alpha is below zero, alpha is the smallest size's latency (the latency-bound end) and beta
the least-squares fit given it. Where the times do not grow with the size at all (every size
latency-bound, or noise), the fit is marked "flat": alpha the median latency, beta the fastest busbw
measured.

The record (JSON; written atomically by write_probe), version 1:
    {"kind": "aiperf-probe-network", "version": 1, "backend": "torch", "framework_version": "2.5.1",
     "nodes": 2, "ranks": 2, "ranks_per_node": 1, "hosts": ["node0", "node1"], "device": "cpu",
     "collectives": {"all_reduce": [{"bytes": 8, "iterations": 20, "latency_s": ..., "algbw_bytes_per_s": ...,
                                     "busbw_bytes_per_s": ..., "bounded": false}, ...],
                     "all_to_all": [...]},
     "fit": {"all_reduce": {"latency_s": alpha, "busbw_bytes_per_s": beta}, "all_to_all": {...}},
              (and "flat": true in a collective's fit where the times did not grow with the size)
     "measured_at": "2026-12-07T01:40:00+00:00", "seconds_per_size": 2.0}
"""

from __future__ import annotations

import json
import math
import os
import statistics
from datetime import datetime, timezone
from typing import Any, Sequence

from aiperf_core.errors import AiperfError

KIND = "aiperf-probe-network"
VERSION = 1
COLLECTIVES = ("all_reduce", "all_to_all")
MIN_BYTES = 8
MAX_BYTES = 256 << 20
STEP_FACTOR = 2
ITERATIONS = 20
WARMUP = 5
SECONDS_PER_SIZE = 2.0
ELEMENT_BYTES = 4  # float32 buffers, as nccl-tests' default
# A probe record is a few kilobytes; a larger file read back is not one.
MAX_FILE_BYTES = 1 << 20


class ProbeError(AiperfError):
    pass


def bus_factor(collective: str, ranks: int) -> float:
    """busbw / algbw (nccl-tests): the share of a rank's buffer its link carries each way."""
    if collective == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    if collective == "all_to_all":
        return (ranks - 1) / ranks
    raise ProbeError(f"unknown collective {collective!r} (collectives: {', '.join(COLLECTIVES)})")


def probe_sizes(min_bytes: int = MIN_BYTES, max_bytes: int = MAX_BYTES, factor: int = STEP_FACTOR) -> list[int]:
    """min_bytes, min_bytes * factor, ... up to max_bytes (max_bytes itself when the ladder misses it)."""
    if min_bytes < ELEMENT_BYTES:
        raise ProbeError(f"--min-bytes: must be >= {ELEMENT_BYTES} (one float32), got {min_bytes}")
    if max_bytes < min_bytes:
        raise ProbeError(f"--max-bytes: must be >= --min-bytes ({min_bytes}), got {max_bytes}")
    if factor < 2:
        raise ProbeError(f"--step-factor: must be >= 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    if len(sizes) < 2:
        raise ProbeError(f"--max-bytes: the fit needs at least two sizes, got only {min_bytes} bytes "
                         f"(raise --max-bytes above --min-bytes)")
    return sizes


def element_count(collective: str, size_bytes: int, ranks: int) -> int:
    """float32 elements of one rank's buffer for `size_bytes`: all-to-all rounds down to a whole
    number of elements per rank (nccl-tests does the same), at least one each."""
    count = max(1, size_bytes // ELEMENT_BYTES)
    if collective == "all_to_all":
        count = max(ranks, count // ranks * ranks)
    return count


def iteration_plan(first_s: float, iterations: int, warmup: int, seconds_per_size: float) -> tuple[int, int]:
    """(further warm-ups, timed iterations) for a size whose first warm-up took `first_s` on the
    slowest rank: every rank computes the same plan from the same figure, so that their collectives
    pair up."""
    per = max(first_s, 1e-9)
    extra_warmup = max(0, min(warmup - 1, int(0.25 * seconds_per_size / per)))
    timed = max(1, min(iterations, int(seconds_per_size / per)))
    return extra_warmup, timed


# -- from a backend's timings to the record -------------------------------------------------------

def entry(collective: str, size_bytes: int, seconds: Sequence[float], ranks: int, iterations: int) -> dict[str, Any]:
    """One row of the record from the timed iterations of one size."""
    if not seconds or not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in seconds):
        raise ProbeError(f"{collective} of {size_bytes} bytes: expected positive seconds, got {list(seconds)!r}")
    latency = float(statistics.median(seconds))
    algbw = size_bytes / latency
    return {"bytes": int(size_bytes), "iterations": len(seconds), "latency_s": latency, "algbw_bytes_per_s": algbw,
            "busbw_bytes_per_s": algbw * bus_factor(collective, ranks), "bounded": len(seconds) < iterations}


def fit_alpha_beta(collective: str, rows: Sequence[dict[str, Any]], ranks: int) -> dict[str, float]:
    """{"latency_s": alpha, "busbw_bytes_per_s": beta}: time = alpha + bus bytes / beta, ordinary least
    squares over the sizes (module docstring); where that alpha is below zero, alpha is the smallest
    size's latency and beta the least-squares fit given it."""
    points = sorted((row["bytes"] * bus_factor(collective, ranks), row["latency_s"]) for row in rows)
    if len({x for x, _ in points}) < 2:
        raise ProbeError(f"{collective}: the fit needs at least two sizes")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    g = (sum((x - mean_x) * (t - mean_t) for x, t in points) / sum((x - mean_x) ** 2 for x, _ in points))
    alpha = mean_t - g * mean_x
    if alpha < 0:
        alpha = points[0][1]
        g = sum(x * (t - alpha) for x, t in points) / sum(x * x for x, _ in points)
    if not g > 0:
        # Latency-bound over every size (small sizes on a fast link, or noise on a busy machine): no
        # slope to read a bandwidth from. The fit says so, and gives the fastest busbw measured, a
        # bound the link reached, rather than fail a probe whose rows are all sound.
        return {"latency_s": float(statistics.median(t for _, t in points)),
                "busbw_bytes_per_s": float(max(row["busbw_bytes_per_s"] for row in rows)), "flat": True}
    return {"latency_s": float(alpha), "busbw_bytes_per_s": float(1.0 / g)}


def make_record(backend_name: str, framework_version: str, timings: dict[str, Any], nodes: int,
                iterations: int, seconds_per_size: float) -> dict[str, Any]:
    """The record from what Backend.probe_collectives returned on node 0."""
    ranks_per_node = int(timings["ranks_per_node"])
    ranks = nodes * ranks_per_node
    collectives: dict[str, list[dict[str, Any]]] = {}
    for collective, sizes in timings["collectives"].items():
        collectives[collective] = [entry(collective, size["bytes"], size["seconds"], ranks, iterations)
                                   for size in sizes]
    return {"kind": KIND, "version": VERSION, "backend": backend_name, "framework_version": framework_version,
            "nodes": nodes, "ranks": ranks, "ranks_per_node": ranks_per_node, "hosts": list(timings["hosts"]),
            "device": timings["device"], "collectives": collectives,
            "fit": {c: fit_alpha_beta(c, rows, ranks) for c, rows in collectives.items()},
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds_per_size": seconds_per_size}


# -- showing and writing --------------------------------------------------------------------------

def format_bytes(count: float) -> str:
    """A size as nccl-tests' users read it: 8 B, 64 KiB, 256 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.3g} {unit}"
    return f"{count:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """A bandwidth in GB/s (10^9 bytes per second), as nccl-tests prints it, to four decimals below 1
    GB/s (a shaped or slow link's rate stays readable)."""
    rate = bytes_per_s / 1e9
    return f"{rate:.1f}" if rate >= 100 else f"{rate:.2f}" if rate >= 1 else f"{rate:.4f}"


def render(record: dict[str, Any]) -> str:
    """The record as nccl-tests-like tables, one per collective, and the fit below each."""
    hosts = ", ".join(record["hosts"])
    lines = [f"backend {record['backend']} {record['framework_version']}: {record['ranks']} rank(s) on "
             f"{record['nodes']} node(s) ({hosts}), {record['ranks_per_node']} per node, device {record['device']}"]
    bounded = False
    for collective, rows in record["collectives"].items():
        header = ("size", "bytes", "iters", "latency (us)", "algbw (GB/s)", "busbw (GB/s)")
        table = []
        for row in rows:
            bounded = bounded or row.get("bounded", False)
            table.append((format_bytes(row["bytes"]), str(row["bytes"]),
                          f"{row['iterations']}{'*' if row.get('bounded') else ''}", f"{row['latency_s'] * 1e6:.1f}",
                          format_rate(row["algbw_bytes_per_s"]), format_rate(row["busbw_bytes_per_s"])))
        widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
        lines += ["", collective.replace("_", "-")]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [header, *table]]
        fit = record["fit"][collective]
        lines.append(f"fit: time = {fit['latency_s'] * 1e6:.1f} us + bus bytes / {format_rate(fit['busbw_bytes_per_s'])} "
                     f"GB/s" + (" (the times do not grow with the size: the median latency and the fastest busbw; "
                                "probe larger sizes for a bandwidth)" if fit.get("flat") else ""))
    if bounded:
        lines += ["", f"* fewer iterations than asked: the size's iterations were bounded by "
                      f"{record.get('seconds_per_size', SECONDS_PER_SIZE):g} s (--seconds-per-size)"]
    return "\n".join(lines)


def write_probe(record: dict[str, Any], path: str | os.PathLike, force: bool = False) -> None:
    """Write the record to `path` atomically; an existing file is refused unless `force`."""
    from aiperf_core.atomic import write_text_atomic

    try:
        write_text_atomic(path, json.dumps(record, indent=2) + "\n", exclusive=not force)
    except FileExistsError:
        raise ProbeError(f"{path}: exists (give --force to overwrite it)") from None
    except OSError as exc:
        raise ProbeError(f"{path}: cannot write: {exc.strerror or exc}") from None


# -- reading back (aiperf system describe --probe-network, the report) ------------------------------

def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def validate_probe(record: Any, source: str = "probe") -> dict[str, Any]:
    """Check a record's kind, version and the keys the readers use; ProbeError, one line naming the field."""

    def fail(field: str, what: str) -> None:
        raise ProbeError(f"{source}: {field}: {what}")

    if not isinstance(record, dict):
        raise ProbeError(f"{source}: not a JSON object")
    if record.get("kind") != KIND:
        fail("kind", f"must be {KIND!r}, got {record.get('kind')!r}")
    if record.get("version") != VERSION:
        fail("version", f"unsupported version {record.get('version')!r} (this aiperf reads version {VERSION})")
    for key in ("nodes", "ranks", "ranks_per_node"):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            fail(key, f"must be a whole number >= 1, got {value!r}")
    if not isinstance(record.get("backend"), str):
        fail("backend", "must be a string")
    collectives, fit = record.get("collectives"), record.get("fit")
    if not isinstance(collectives, dict) or not collectives:
        fail("collectives", "must be an object of collectives")
    if not isinstance(fit, dict):
        fail("fit", "must be an object of collectives")
    for name, rows in collectives.items():
        if name not in COLLECTIVES:
            fail(f"collectives.{name}", f"unknown collective (collectives: {', '.join(COLLECTIVES)})")
        if not isinstance(rows, list) or not rows:
            fail(f"collectives.{name}", "must be a list of sizes")
        for i, row in enumerate(rows):
            for key in ("bytes", "iterations", "latency_s", "algbw_bytes_per_s", "busbw_bytes_per_s"):
                if not isinstance(row, dict) or not _number(row.get(key)):
                    fail(f"collectives.{name}[{i}].{key}", "must be a number >= 0")
        params = fit.get(name)
        for key in ("latency_s", "busbw_bytes_per_s"):
            if not isinstance(params, dict) or not _number(params.get(key)):
                fail(f"fit.{name}.{key}", "must be a number >= 0")
    return record


def load_probe(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check a probe record (ProbeError, one line, naming the file)."""
    from aiperf_core.atomic import read_small_file

    data = read_small_file(path, MAX_FILE_BYTES, "a probe record", ProbeError)
    try:
        record = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProbeError(f"{path}: not JSON: {exc}") from None
    return validate_probe(record, str(path))


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What a system description and a report show of a probe: per collective the fitted latency and
    bus bandwidth, and the bus bandwidth at the largest size measured."""
    out: dict[str, Any] = {"backend": record["backend"], "device": record.get("device", "unknown"),
                           "nodes": record["nodes"], "ranks": record["ranks"]}
    for name, rows in record["collectives"].items():
        largest = max(rows, key=lambda row: row["bytes"])
        out[name] = {"latency_s": record["fit"][name]["latency_s"],
                     "busbw_bytes_per_s": record["fit"][name]["busbw_bytes_per_s"],
                     "largest_bytes": largest["bytes"], "largest_busbw_bytes_per_s": largest["busbw_bytes_per_s"]}
    return out

