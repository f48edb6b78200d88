"""Utilisation, power and energy sampling on a replica node: replicas/<I>/monitor.jsonl, every 30 s
by default.

Each replica runs one `Sampler` (a daemon thread) for as long as it trains. Accelerators are read
through NVML (nvidia-ml-py, module `pynvml`) where a driver is present: utilisation, memory, power
draw and, where the device has one, its energy counter. The host's CPU-package and DRAM energy is
read from Linux powercap (RAPL: `intel-rapl:*`, which is also how the kernel exposes AMD's RAPL)
where its `energy_uj` files are readable (root only on most kernels since 5.10). CPU and memory
come from psutil. A node without NVML, RAPL or psutil still gets samples of what it can measure,
and the first line says what was unavailable and why. Only replica I writes its monitor.jsonl.

Which accelerators: those this replica may use (CUDA_VISIBLE_DEVICES, as integer NVML indices or
GPU UUIDs), else every one NVML sees. Energy counters are shared by every replica on a node, so
each counter is read by one sampler at a time: the one holding a node-local lock for that run and
counter (`flock` on a file in the temporary directory). A sample carries a counter's value only
while its sampler holds that lock, so no joule is counted twice.

Line formats (JSON, one object a line):
    {"kind": "host", "time", "host", "pid", "cpus", "cpu_model", "sockets", "cores", "memory_total", "accelerators": [{"index", "name",
     "uuid", "memory_total", "power", "energy_counter"}], "nvml": "ok" | "unavailable: why",
     "visible": "all" | "CUDA_VISIBLE_DEVICES=...", "psutil": "ok" | "unavailable: why",
     "rapl": "ok" | "unavailable: why", "rapl_zones": [{"zone", "name", "max_energy_range_uj"}]}
    {"kind": "sample", "time", "cpu_percent", "memory_percent", "memory_used",
     "accelerators": [{"index", "utilization", "memory_utilization", "memory_used", "memory_total",
                       "power_w", "energy_mj"?}],
     "host_energy_uj"?: {zone: counter}}
    {"kind": "error", "time", "error"}      a sample that failed; sampling goes on
`power` and `energy_counter` say whether the device reports them; `power_w` is null without.
`energy_mj` (NVML's millijoules since the driver loaded) and `host_energy_uj` (RAPL's raw
microjoule counters, which wrap at `max_energy_range_uj`) are present only while this sampler
reads that counter for its node (see above).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from aiperf_core.inventory import host_cpu
from aiperf_core.rundir import RunDir

DEFAULT_INTERVAL_S = 30.0
POWERCAP_ROOT = Path("/sys/class/powercap")
# Top-level RAPL zones and their sub-zones (intel-rapl:0, intel-rapl:0:1), not the MMIO interface
# (intel-rapl-mmio:0), which reads the same package counter a second time.
_RAPL_ZONE = re.compile(r"^[a-z-]*rapl:\d+(:\d+)?$")
HOST_ENERGY_COUNTER = "rapl"  # the lock name of the host's counters


class _Nvml:
    """NVML if a driver and nvidia-ml-py are present; otherwise no accelerators and the reason why."""

    def __init__(self, visible: str | None):
        self.module = None
        self.handles: list[tuple[int, Any]] = []  # (NVML index, handle) of this replica's devices
        self.power: dict[int, bool] = {}  # index -> whether the device reports its power draw
        self.energy: dict[int, bool] = {}  # index -> whether it has an energy counter
        self.counters: dict[int, str] = {}  # index -> the lock name of its energy counter
        self.visible = "all" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}"
        try:
            import pynvml
        except ImportError as exc:
            self.status = f"unavailable: {exc}"
            return
        try:
            pynvml.nvmlInit()
            every = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
            self.module = pynvml
            self.handles = self._visible(every, visible)
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound and kin: no driver on this node
            self.status = f"unavailable: {type(exc).__name__}: {exc}"
            self.module, self.handles = None, []
            return
        self.status = "ok"

    def _visible(self, every: list[tuple[int, Any]], visible: str | None) -> list[tuple[int, Any]]:
        """The devices CUDA_VISIBLE_DEVICES leaves this replica: integers are taken as NVML indices
        (CUDA's default order equals NVML's PCI order on nodes of one GPU model), GPU-... as UUIDs.
        Anything else (MIG instances) cannot be mapped to a whole device's counters: every device."""
        if visible is None:
            return every
        wanted = [v.strip() for v in visible.split(",") if v.strip()]
        if all(v.isdigit() for v in wanted):
            indices = {int(v) for v in wanted}
            return [(i, h) for i, h in every if i in indices]
        if all(v.startswith("GPU-") for v in wanted):
            uuids = {i: self._uuid(h) for i, h in every}
            return [(i, h) for i, h in every if any(uuids[i] and uuids[i].startswith(v) for v in wanted)]
        self.visible += " (not mapped to NVML devices: every device sampled)"
        return every

    def _uuid(self, handle: Any) -> str | None:
        try:
            uuid = self.module.nvmlDeviceGetUUID(handle)
        except Exception:  # an old driver or binding without it
            return None
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def _answers(self, query: str, handle: Any) -> bool:
        try:
            getattr(self.module, query)(handle)
        except Exception:  # NVMLError_NotSupported (an older GPU), or a binding without the call
            return False
        return True

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for index, handle in self.handles:
            name = self.module.nvmlDeviceGetName(handle)
            uuid = self._uuid(handle)
            self.power[index] = self._answers("nvmlDeviceGetPowerUsage", handle)
            self.energy[index] = self._answers("nvmlDeviceGetTotalEnergyConsumption", handle)
            self.counters[index] = f"gpu-{uuid or index}"
            out.append({"index": index, "name": name.decode() if isinstance(name, bytes) else str(name),
                        "uuid": uuid,
                        "memory_total": int(self.module.nvmlDeviceGetMemoryInfo(handle).total),
                        "power": self.power[index], "energy_counter": self.energy[index]})
        return out

    def sample(self, locks: "_CounterLocks") -> list[dict[str, Any]]:
        out = []
        for index, handle in self.handles:
            rates = self.module.nvmlDeviceGetUtilizationRates(handle)
            memory = self.module.nvmlDeviceGetMemoryInfo(handle)
            device = {"index": index, "utilization": float(rates.gpu), "memory_utilization": float(rates.memory),
                      "memory_used": int(memory.used), "memory_total": int(memory.total),
                      "power_w": (self.module.nvmlDeviceGetPowerUsage(handle) / 1000.0
                                  if self.power.get(index) else None)}
            if self.energy.get(index) and locks.hold(self.counters[index]):
                device["energy_mj"] = int(self.module.nvmlDeviceGetTotalEnergyConsumption(handle))
            out.append(device)
        return out

    def close(self) -> None:
        if self.module is not None:
            try:
                self.module.nvmlShutdown()
            except Exception:  # shutting down a driver that went away must not fail the replica
                pass
            self.module = None


class _Rapl:
    """The host's RAPL energy counters under powercap: every CPU package (`package-N`) and DRAM
    zone (`dram`). `psys` (the whole platform, packages included) and the core and uncore
    sub-zones (parts of a package) are left out, so nothing is counted twice."""

    def __init__(self, root: Path = POWERCAP_ROOT):
        self.zones: list[tuple[str, Path]] = []  # (zone, energy_uj file)
        self.described: list[dict[str, Any]] = []
        try:
            entries = sorted(p for p in root.iterdir() if _RAPL_ZONE.match(p.name))
        except OSError as exc:
            self.status = f"unavailable: {root}: {exc.strerror or exc}"
            return
        problem = None
        for zone in entries:
            try:
                name = (zone / "name").read_text().strip()
                if not (name.startswith("package") or name == "dram"):
                    continue
                energy = zone / "energy_uj"
                int(energy.read_text())
                max_range = int((zone / "max_energy_range_uj").read_text())
            except (OSError, ValueError) as exc:
                problem = problem or f"{zone / 'energy_uj'}: {getattr(exc, 'strerror', None) or exc}"
                continue
            self.zones.append((zone.name, energy))
            self.described.append({"zone": zone.name, "name": name, "max_energy_range_uj": max_range})
        if problem is not None:  # a partial host would be reported as the whole host: none instead
            self.zones, self.described = [], []
            self.status = f"unavailable: {problem}"
        elif not self.zones:
            self.status = f"unavailable: no RAPL package zone under {root}"
        else:
            self.status = "ok"

    def read(self) -> dict[str, int]:
        return {zone: int(path.read_text()) for zone, path in self.zones}


class _CounterLocks:
    """Node-local locks, one per run and energy counter: the holder is the one sampler on this node
    that reads that counter (several replicas of a run may share a node). A lock is kept until the
    sampler stops, which removes its file; when its replica dies the kernel releases the lock and
    another sampler takes over (and removes the file when it stops).

    The file is removed while its lock is held, so a sampler that locked it just before checks
    that the lock it got is on the file the path still names; else it tries again on the new one."""

    ATTEMPTS = 3  # a lock lost to a removal is taken again at once; each removal ends one holder

    def __init__(self, run_root: Path):
        self.key = hashlib.sha256(str(run_root.resolve()).encode()).hexdigest()[:16]
        self.held: dict[str, tuple[int, Path]] = {}

    def path(self, counter: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", counter)
        return Path(tempfile.gettempdir()) / f"aiperf-energy-{self.key}-{safe}.lock"

    def hold(self, counter: str) -> bool:
        if counter in self.held:
            return True
        try:
            import fcntl
        except ImportError:  # not a POSIX system: no other sampler can be told apart
            return True
        path = self.path(counter)
        for _ in range(self.ATTEMPTS):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:  # no writable temporary directory: read it (one replica per node is usual)
                return True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            try:
                named = os.stat(path)
            except OSError:
                named = None
            locked = os.fstat(fd)
            if named is not None and (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino):
                self.held[counter] = (fd, path)
                return True
            os.close(fd)  # its holder removed the file after we opened it: the lock means nothing
        return False

    def release(self) -> None:
        for fd, path in self.held.values():
            try:
                os.unlink(path)
            except OSError:
                pass
            os.close(fd)
        self.held = {}


class Sampler:
    """Samples this node every `interval_s` seconds into replicas/<replica>/monitor.jsonl.

        with Sampler(run_dir, replica):
            train()
    """

    def __init__(self, run_dir: str | os.PathLike | RunDir, replica: int, interval_s: float = DEFAULT_INTERVAL_S,
                 powercap_root: str | os.PathLike = POWERCAP_ROOT, node: int = 0):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.path: Path = run.monitor_log(replica, node)  # every node of a replica samples itself
        self.interval_s = float(interval_s)
        self.powercap_root = Path(powercap_root)
        self._locks = _CounterLocks(run.root)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = None
        self._nvml: _Nvml | None = None
        self._rapl: _Rapl | None = None
        self._psutil = None
        self.samples_written = 0

    def start(self) -> "Sampler":
        if self._thread is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"aiperf-monitor-{self.path.parent.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._file.close()
        self._file = None

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        # NVML, RAPL and psutil are set up in the thread so that a slow driver never delays the replica.
        self._nvml = _Nvml(os.environ.get("CUDA_VISIBLE_DEVICES"))
        self._rapl = _Rapl(self.powercap_root)
        psutil_status = "ok"
        try:
            import psutil

            self._psutil = psutil
            psutil.cpu_percent(interval=None)  # the first call only sets the reference point
        except ImportError as exc:
            psutil_status = f"unavailable: {exc}"
        try:
            self._write(self._host_record(psutil_status))
            while True:
                self._write(self.sample())
                if self._stop.wait(self.interval_s):
                    break
        finally:
            self._nvml.close()
            self._locks.release()

    def _host_record(self, psutil_status: str) -> dict[str, Any]:
        try:
            accelerators = self._nvml.describe()
        except Exception as exc:  # a driver that answers init but not queries
            accelerators, self._nvml.status = [], f"unavailable: {type(exc).__name__}: {exc}"
            self._nvml.handles = []
        cpu = host_cpu()
        return {"kind": "host", "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "cpus": os.cpu_count(), "cpu_model": cpu["model"], "sockets": cpu["sockets"], "cores": cpu["cores"],
                "memory_total": self._psutil.virtual_memory().total if self._psutil else None,
                "accelerators": accelerators, "nvml": self._nvml.status, "visible": self._nvml.visible,
                "psutil": psutil_status, "rapl": self._rapl.status, "rapl_zones": self._rapl.described}

    def sample(self) -> dict[str, Any]:
        """One sample of the node now; a failure becomes an 'error' record, never an exception."""
        try:
            record: dict[str, Any] = {"kind": "sample", "time": time.time()}
            if self._psutil is not None:
                memory = self._psutil.virtual_memory()
                record.update(cpu_percent=self._psutil.cpu_percent(interval=None),
                              memory_percent=memory.percent, memory_used=memory.used)
            record["accelerators"] = self._nvml.sample(self._locks) if self._nvml is not None else []
            if self._rapl is not None and self._rapl.zones and self._locks.hold(HOST_ENERGY_COUNTER):
                record["host_energy_uj"] = self._rapl.read()
            return record
        except Exception as exc:  # a lost GPU or a /proc hiccup must not stop the sampling
            return {"kind": "error", "time": time.time(), "error": f"{type(exc).__name__}: {exc}"}

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # readable by the report and the live display right away
        if record["kind"] == "sample":
            self.samples_written += 1


def read_monitor(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record of a monitor.jsonl; a torn last line (a killed replica) is ignored."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    records = []
    for line in text.split("\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
