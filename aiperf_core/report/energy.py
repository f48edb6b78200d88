"""The energy of a run, from the counters in every replica's monitor.jsonl (aiperf_core.monitoring.sampler).

Accelerators: NVML's energy counter (millijoules since the driver loaded) of each device.
Host: RAPL's CPU-package and DRAM counters (microjoules, wrapping at `max_energy_range_uj`).
A counter's energy is the sum of its increases between consecutive samples of one sampler, both
inside the scored window [start_time, end_time]; a sampler writes a counter only while it is the
node's one reader of it, so nothing is counted twice. Energy before a node's first sample and
after its last (at most one sampling interval each, 30 s by default) is not counted.

A counter that is missing is reported as missing (None, with the reason), never as zero: the
accelerators' energy is None if any accelerator seen has no energy counter, the host's if any
node could not read RAPL. The total is their sum where both are known; on a run without
accelerators the host's energy is the total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Segment:
    """The counters of one sampler's life (a 'host' record and the samples after it)."""

    host: str
    rapl_ranges: dict[str, int]  # zone -> max_energy_range_uj
    uuids: dict[Any, Any]  # NVML index -> UUID
    last: dict[tuple, tuple[float, int]] = field(default_factory=dict)  # counter -> (time, value)


@dataclass
class Energy:
    """Joules of the scored window: None where not measured, with the reasons in `missing`."""

    accelerators_j: float | None
    host_j: float | None
    total_j: float | None
    accelerators: int  # distinct accelerators sampled
    hosts: int  # distinct hosts sampled
    coverage: dict[str, float | None]  # share of the window the counters cover, per figure
    missing: list[str]  # why a figure is None, one line each

    def ops_per_joule(self, ops: float) -> dict[str, float | None]:
        """Analytic operations per joule (= OPS per watt) against each energy figure."""
        def per(joules: float | None) -> float | None:
            return ops / joules if joules else None
        return {"total": per(self.total_j), "accelerators": per(self.accelerators_j), "host": per(self.host_j)}

    def to_dict(self, ops: float) -> dict[str, Any]:
        return {"accelerators_j": self.accelerators_j, "host_j": self.host_j, "total_j": self.total_j,
                "accelerators": self.accelerators, "hosts": self.hosts, "coverage": dict(self.coverage),
                "missing": list(self.missing), "ops_per_joule": self.ops_per_joule(ops)}


class EnergyTally:
    """Fed every record of every monitor.jsonl, one file at a time (`new_file`, then `add` for each
    record in file order). `bucket_width` (s) sets the power plot's time buckets."""

    def __init__(self, start: float, end: float, bucket_width: float = 30.0):
        self.start, self.end, self.bucket_width = start, end, bucket_width
        self.joules = {"accelerators": 0.0, "host": 0.0}
        self.seconds: dict[tuple, float] = {}  # (host, device) or (host, "rapl") -> seconds measured
        self.devices: dict[tuple[str, Any], bool] = {}  # (host, uuid or index) -> has an energy counter
        self.rapl: dict[str, str] = {}  # host -> "ok" or why not (the first failure seen)
        self._segment: _Segment | None = None
        self._power: dict[str, dict[int, list[float]]] = {"accelerator": {}, "host": {}}

    def new_file(self) -> None:
        self._segment = None

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "host":
            self._host(record)
        elif kind == "sample" and self._segment is not None and _number(record.get("time")):
            self._sample(record)

    def _host(self, record: dict[str, Any]) -> None:
        host = str(record.get("host"))
        devices = record.get("accelerators") or []
        for device in devices:
            key = (host, device.get("uuid") or device.get("index"))
            self.devices[key] = self.devices.get(key, True) and bool(device.get("energy_counter"))
        rapl = record.get("rapl") or "unavailable: not sampled (a monitor older than energy sampling)"
        if self.rapl.get(host, "ok") == "ok":
            self.rapl[host] = str(rapl)
        ranges = {str(z.get("zone")): z.get("max_energy_range_uj") for z in record.get("rapl_zones") or []}
        self._segment = _Segment(host, {k: int(v) for k, v in ranges.items() if _number(v)},
                                 {d.get("index"): d.get("uuid") or d.get("index") for d in devices})

    def _sample(self, record: dict[str, Any]) -> None:
        segment, now = self._segment, float(record["time"])
        inside = self.start <= now <= self.end
        for device in record.get("accelerators") or []:
            name = segment.uuids.get(device.get("index"), device.get("index"))
            if _number(device.get("energy_mj")):
                measured = self._increase(segment, ("gpu", name), now, int(device["energy_mj"]), None)
                if measured is not None:
                    self.joules["accelerators"] += measured[0] / 1e3
                    self._add_seconds((segment.host, name), measured[1])
            if inside and _number(device.get("power_w")):
                self._bucket("accelerator", now, float(device["power_w"]))
        counters = record.get("host_energy_uj")
        if not isinstance(counters, dict):
            return
        microjoules, seconds = 0.0, None
        for zone, value in counters.items():
            if _number(value):
                measured = self._increase(segment, ("rapl", zone), now, int(value), segment.rapl_ranges.get(zone))
                if measured is not None:
                    microjoules += measured[0]
                    seconds = measured[1]
        if seconds:
            self.joules["host"] += microjoules / 1e6
            self._add_seconds((segment.host, "rapl"), seconds)
            self._bucket("host", now, microjoules / 1e6 / seconds)

    def _increase(self, segment: _Segment, key: tuple, now: float, value: int,
                  wrap: int | None) -> tuple[float, float] | None:
        """(increase, seconds) of a counter since this segment's previous sample of it, when both
        lie in the window; a counter that went back wrapped (RAPL) or was reset (a driver reload:
        that interval is unknown)."""
        previous = segment.last.get(key)
        segment.last[key] = (now, value)
        if previous is None or now > self.end or previous[0] < self.start or now <= previous[0]:
            return None
        delta = value - previous[1]
        if delta < 0:
            if wrap is None:
                return None
            delta += wrap
        return float(delta), now - previous[0]

    def _add_seconds(self, key: tuple, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def _bucket(self, label: str, now: float, watts: float) -> None:
        cell = self._power[label].setdefault(int((now - self.start) // self.bucket_width), [0.0, 0])
        cell[0] += watts
        cell[1] += 1

    def result(self) -> Energy:
        window = max(self.end - self.start, 1e-9)
        missing: list[str] = []

        counted = [key for key, has in self.devices.items() if has]
        accelerators_j: float | None = self.joules["accelerators"]
        if not self.devices:
            accelerators_j = None
            missing.append("accelerators: none sampled (no NVML on the replica nodes, or no accelerator)")
        elif len(counted) < len(self.devices):
            accelerators_j = None
            missing.append(f"accelerators: {len(self.devices) - len(counted)} of {len(self.devices)} have no "
                           "energy counter in NVML")
        elif not any(self.seconds.get(key) for key in counted):
            accelerators_j = None
            missing.append("accelerators: fewer than two samples of their energy counters in the scored window")

        readable = sorted(host for host, status in self.rapl.items() if status == "ok")
        host_j: float | None = self.joules["host"]
        if not self.rapl:
            host_j = None
            missing.append("host: no monitor samples")
        elif len(readable) < len(self.rapl):
            unread = sorted(set(self.rapl) - set(readable))
            host_j = None
            missing.append(f"host: RAPL not readable on {len(unread)} of {len(self.rapl)} nodes "
                           f"({unread[0]}: {self.rapl[unread[0]]})")
        elif not any(self.seconds.get((host, "rapl")) for host in readable):
            host_j = None
            missing.append("host: fewer than two RAPL samples in the scored window")

        if host_j is not None and accelerators_j is not None:
            total = host_j + accelerators_j
        elif host_j is not None and not self.devices:
            total = host_j  # no accelerators: the host did the work
        else:
            total = None
        coverage = {
            "accelerators": (sum(self.seconds.get(key, 0.0) for key in counted) / (len(counted) * window)
                             if accelerators_j is not None else None),
            "host": (sum(self.seconds.get((host, "rapl"), 0.0) for host in readable) / (len(readable) * window)
                     if host_j is not None else None),
        }
        return Energy(accelerators_j, host_j, total, len(self.devices), len(self.rapl), coverage, missing)

    def power(self) -> dict[str, list[tuple[float, float]]]:
        """Mean power per accelerator and per node in each time bucket: label -> [(hours, watts)]."""
        labels = {"accelerator": "accelerator (mean per device)", "host": "host CPU+DRAM (mean per node)"}
        return {labels[label]: [((b + 0.5) * self.bucket_width / 3600, s / n) for b, (s, n) in sorted(cells.items())]
                for label, cells in self._power.items() if cells}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
