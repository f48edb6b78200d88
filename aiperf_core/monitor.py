"""Utilisation sampling on a replica node: replicas/<I>/monitor.jsonl, every 30 s by default.

Each replica runs one `Sampler` (a daemon thread) for as long as it trains. Accelerators are read
through NVML (nvidia-ml-py, module `pynvml`) where a driver is present; CPU and memory through
psutil. A node without NVML, or without psutil, still gets samples of what it can measure, and the
first line says what was unavailable and why. Only replica I writes its monitor.jsonl.

Line formats (JSON, one object a line):
    {"kind": "host", "time", "host", "pid", "cpus", "memory_total", "accelerators": [{"index", "name",
     "memory_total"}], "nvml": "ok" | "unavailable: why", "psutil": "ok" | "unavailable: why"}
    {"kind": "sample", "time", "cpu_percent", "memory_percent", "memory_used",
     "accelerators": [{"index", "utilization", "memory_utilization", "memory_used", "memory_total"}]}
    {"kind": "error", "time", "error"}      a sample that failed; sampling goes on
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from aiperf_core.rundir import RunDir

DEFAULT_INTERVAL_S = 30.0


class _Nvml:
    """NVML if a driver and nvidia-ml-py are present; otherwise no accelerators and the reason why."""

    def __init__(self):
        self.module = None
        self.handles: list[Any] = []
        try:
            import pynvml
        except ImportError as exc:
            self.status = f"unavailable: {exc}"
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound and kin: no driver on this node
            self.status = f"unavailable: {type(exc).__name__}: {exc}"
            return
        self.module = pynvml
        self.status = "ok"

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for index, handle in enumerate(self.handles):
            name = self.module.nvmlDeviceGetName(handle)
            out.append({"index": index, "name": name.decode() if isinstance(name, bytes) else str(name),
                        "memory_total": int(self.module.nvmlDeviceGetMemoryInfo(handle).total)})
        return out

    def sample(self) -> list[dict[str, Any]]:
        out = []
        for index, handle in enumerate(self.handles):
            rates = self.module.nvmlDeviceGetUtilizationRates(handle)
            memory = self.module.nvmlDeviceGetMemoryInfo(handle)
            out.append({"index": index, "utilization": float(rates.gpu), "memory_utilization": float(rates.memory),
                        "memory_used": int(memory.used), "memory_total": int(memory.total)})
        return out

    def close(self) -> None:
        if self.module is not None:
            try:
                self.module.nvmlShutdown()
            except Exception:  # shutting down a driver that went away must not fail the replica
                pass
            self.module = None


class Sampler:
    """Samples this node every `interval_s` seconds into replicas/<replica>/monitor.jsonl.

        with Sampler(run_dir, replica):
            train()
    """

    def __init__(self, run_dir: str | os.PathLike | RunDir, replica: int, interval_s: float = DEFAULT_INTERVAL_S):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.path: Path = run.monitor_log(replica)
        self.interval_s = float(interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file = None
        self._nvml: _Nvml | None = None
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
        # NVML and psutil are set up in the thread so that a slow driver never delays the replica.
        self._nvml = _Nvml()
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

    def _host_record(self, psutil_status: str) -> dict[str, Any]:
        try:
            accelerators = self._nvml.describe()
        except Exception as exc:  # a driver that answers init but not queries
            accelerators, self._nvml.status = [], f"unavailable: {type(exc).__name__}: {exc}"
            self._nvml.handles = []
        return {"kind": "host", "time": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
                "cpus": os.cpu_count(),
                "memory_total": self._psutil.virtual_memory().total if self._psutil else None,
                "accelerators": accelerators, "nvml": self._nvml.status, "psutil": psutil_status}

    def sample(self) -> dict[str, Any]:
        """One sample of the node now; a failure becomes an 'error' record, never an exception."""
        try:
            record: dict[str, Any] = {"kind": "sample", "time": time.time()}
            if self._psutil is not None:
                memory = self._psutil.virtual_memory()
                record.update(cpu_percent=self._psutil.cpu_percent(interval=None),
                              memory_percent=memory.percent, memory_used=memory.used)
            record["accelerators"] = self._nvml.sample() if self._nvml is not None else []
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
