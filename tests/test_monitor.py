"""The utilisation sampler: it writes samples, and survives a node without NVML."""

import sys
import time
import types

import pytest

from aiperf_core.monitor import Sampler, read_monitor
from aiperf_core.rundir import RunDir


def wait_for_samples(sampler, n, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while sampler.samples_written < n and time.monotonic() < deadline:
        time.sleep(0.01)


def fake_nvml(fail_init: bool):
    """A stand-in pynvml: one 'GPU', or a library that is not there (the NVMLError_LibraryNotFound case)."""
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    module.NVMLError = NVMLError
    module.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    module.shutdowns = 0

    def init():
        if fail_init:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    def shutdown():
        module.shutdowns += 1

    module.nvmlInit = init
    module.nvmlShutdown = shutdown
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    module.nvmlDeviceGetName = lambda h: b"Fake GPU"
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=1000, used=250, free=750)
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=30)
    return module


def test_sampler_writes_samples_without_nvml(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with Sampler(tmp_path, 3, interval_s=0.01) as sampler:
        wait_for_samples(sampler, 3)
    records = read_monitor(RunDir(tmp_path).monitor_log(3))
    assert records[0]["kind"] == "host" and records[0]["nvml"].startswith("unavailable")
    assert records[0]["accelerators"] == [] and records[0]["cpus"] >= 1
    samples = [r for r in records if r["kind"] == "sample"]
    assert len(samples) >= 3
    assert all(0 <= s["cpu_percent"] <= 100 and s["memory_used"] > 0 and s["accelerators"] == [] for s in samples)
    assert [s["time"] for s in samples] == sorted(s["time"] for s in samples)


def test_sampler_survives_nvml_library_not_found(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init=True))
    with Sampler(tmp_path, 0, interval_s=0.01) as sampler:
        wait_for_samples(sampler, 2)
    records = read_monitor(RunDir(tmp_path).monitor_log(0))
    assert "NVMLError_LibraryNotFound" in records[0]["nvml"]
    assert sum(r["kind"] == "sample" for r in records) >= 2


def test_sampler_reads_accelerators_through_nvml(tmp_path, monkeypatch):
    nvml = fake_nvml(fail_init=False)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    sampler = Sampler(tmp_path, 1, interval_s=0.01).start()
    assert sampler._thread.daemon  # never keeps a finished replica process alive
    wait_for_samples(sampler, 2)
    sampler.stop()
    sampler.stop()  # stopping twice is harmless
    records = read_monitor(RunDir(tmp_path).monitor_log(1))
    assert records[0]["nvml"] == "ok"
    assert records[0]["accelerators"] == [{"index": 0, "name": "Fake GPU", "memory_total": 1000}]
    sample = next(r for r in records if r["kind"] == "sample")
    assert sample["accelerators"] == [{"index": 0, "utilization": 87.0, "memory_utilization": 30.0,
                                       "memory_used": 250, "memory_total": 1000}]
    assert nvml.shutdowns == 1


def test_a_failing_sample_is_recorded_and_sampling_goes_on(tmp_path, monkeypatch):
    nvml = fake_nvml(fail_init=False)
    calls = {"n": 0}

    def flaky(handle):
        calls["n"] += 1
        if calls["n"] == 1:
            raise nvml.NVMLError("GPU is lost")
        return types.SimpleNamespace(gpu=10, memory=5)

    nvml.nvmlDeviceGetUtilizationRates = flaky
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with Sampler(tmp_path, 2, interval_s=0.01) as sampler:
        wait_for_samples(sampler, 2)
    records = read_monitor(RunDir(tmp_path).monitor_log(2))
    assert any(r["kind"] == "error" and "GPU is lost" in r["error"] for r in records)
    assert sum(r["kind"] == "sample" for r in records) >= 2


def test_default_interval_and_bad_interval(tmp_path):
    assert Sampler(tmp_path, 0).interval_s == 30.0
    with pytest.raises(ValueError):
        Sampler(tmp_path, 0, interval_s=0)
