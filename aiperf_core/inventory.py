"""What a node shows about itself: host CPU model and topology, memory, OS, and the NVIDIA
accelerators NVML sees. No deep-learning framework is imported here.

One source for three readers, so that they cannot disagree: the monitor's host record (what a run
records about every node it ran on), `aiperf system describe` (what a site declares), and the
conformance report (the device model a backend was certified on). `aiperf check` compares the
first two, and the run's accelerator model against the third.
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
MEMINFO = Path("/proc/meminfo")
OS_RELEASE = Path("/etc/os-release")


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks = []
    for chunk in text.strip().split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        if fields:
            blocks.append(fields)
    return blocks


@lru_cache(maxsize=1)
def host_cpu() -> dict[str, Any]:
    """{"model", "sockets", "cores", "threads"}: cores are physical cores over all sockets, threads
    the logical CPUs. A field the node does not show is None."""
    threads = os.cpu_count()
    try:
        blocks = _cpuinfo_blocks(CPUINFO.read_text())
    except OSError:
        blocks = []
    model = next((b[k] for b in blocks for k in ("model name", "Model", "Hardware", "cpu model") if b.get(k)), None)
    sockets = cores = None
    if blocks and all("physical id" in b for b in blocks):
        sockets = len({b["physical id"] for b in blocks})
        if all("core id" in b for b in blocks):
            cores = len({(b["physical id"], b["core id"]) for b in blocks})
    if model is None:
        model = platform.processor() or platform.machine() or None
    return {"model": model, "sockets": sockets, "cores": cores, "threads": threads}


def memory_bytes() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def os_description() -> str:
    """'Debian GNU/Linux 12 (bookworm), Linux 6.1.0-18-amd64 x86_64' or the nearest the node shows."""
    name = None
    try:
        for line in OS_RELEASE.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                name = line.partition("=")[2].strip().strip('"')
    except OSError:
        pass
    kernel = f"{platform.system()} {platform.release()} {platform.machine()}".strip()
    return f"{name}, {kernel}" if name else kernel


def nvml_accelerators() -> tuple[list[dict[str, Any]], str | None, str]:
    """([{"index", "name", "uuid", "memory_total"}], driver version, "ok" | "unavailable: why")."""
    try:
        import pynvml
    except ImportError as exc:
        return [], None, f"unavailable: {exc}"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound and kin: no driver on this node
        return [], None, f"unavailable: {type(exc).__name__}: {exc}"
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name, uuid = pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetUUID(handle)
            out.append({"index": index, "name": _text(name), "uuid": _text(uuid),
                        "memory_total": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        return out, _text(driver), "ok"
    except Exception as exc:  # a driver that answers init but not queries
        return [], None, f"unavailable: {type(exc).__name__}: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def device_type(device: str) -> str:
    """The type of a backend's device string, lower case: 'cpu' for 'cpu', 'cpu:1' and the NumPy
    reference's 'cpu (x86_64)'; 'cuda' for 'cuda:0'; 'ascend' for 'Ascend:0'."""
    return device.split(":")[0].split(" ")[0].lower()


def is_cpu_device(device: str) -> bool:
    return device_type(device) == "cpu"


def device_model(device: str, accelerator_name: str | None = None) -> str | None:
    """The model of a backend's device string: the host CPU's model for CPU devices, else the
    name the framework or NVML gave (`accelerator_name`)."""
    if is_cpu_device(device):
        return host_cpu()["model"]
    return accelerator_name
