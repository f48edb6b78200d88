"""The utilisation sampler: it writes samples, power and energy counters (fake NVML, a fake
powercap tree), survives a node without NVML or RAPL, and its energy lock files go with it."""

import os
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from aiperf_core.monitoring.sampler import Sampler, _CounterLocks, read_monitor
from aiperf_core.rundir import RunDir


def wait_for_samples(sampler, n, limit_s=20.0):
    deadline = time.monotonic() + limit_s
    while sampler.samples_written < n and time.monotonic() < deadline:
        time.sleep(0.01)


def fake_nvml(fail_init: bool, gpus: int = 1, energy: bool = True):
    """A stand-in pynvml: `gpus` 'GPUs' with power draw and, with `energy`, an energy counter that
    grows by 1000 mJ a call; or a library that is not there (the NVMLError_LibraryNotFound case)."""
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
    class NVMLError_NotSupported(NVMLError):
        pass

    counters = {}

    def total_energy(handle):
        if not energy:
            raise NVMLError_NotSupported("Not Supported")
        counters[handle] = counters.get(handle, 5_000_000) + 1000
        return counters[handle]

    module.nvmlDeviceGetCount = lambda: gpus
    module.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    module.nvmlDeviceGetName = lambda h: b"Fake GPU"
    module.nvmlDeviceGetUUID = lambda h: f"GPU-0000-{h}"
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=1000, used=250, free=750)
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=30)
    module.nvmlDeviceGetPowerUsage = lambda h: 312_500  # milliwatts
    module.nvmlDeviceGetTotalEnergyConsumption = total_energy
    return module


def fake_powercap(root, readable=True):
    """A powercap tree as Linux lays it out: package and DRAM zones (counted), core and psys zones
    and the MMIO duplicate of the package (not counted)."""
    zones = {"intel-rapl:0": ("package-0", 1000), "intel-rapl:0:0": ("core", 400),
             "intel-rapl:0:1": ("dram", 200), "intel-rapl:1": ("psys", 5000),
             "intel-rapl-mmio:0": ("package-0", 1000)}
    for zone, (name, energy) in zones.items():
        folder = root / zone
        folder.mkdir(parents=True)
        (folder / "name").write_text(name + "\n")
        (folder / "max_energy_range_uj").write_text("262143328850\n")
        if readable or name != "dram":
            (folder / "energy_uj").write_text(f"{energy}\n")
        else:
            (folder / "energy_uj").mkdir()  # reading it fails, as a root-only file does for a user
    return root


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
    assert records[0]["accelerators"] == [{"index": 0, "name": "Fake GPU", "uuid": "GPU-0000-gpu0",
                                           "memory_total": 1000, "power": True, "energy_counter": True}]
    samples = [r for r in records if r["kind"] == "sample"]
    assert samples[0]["accelerators"] == [{"index": 0, "utilization": 87.0, "memory_utilization": 30.0,
                                           "memory_used": 250, "memory_total": 1000, "power_w": 312.5,
                                           "energy_mj": samples[0]["accelerators"][0]["energy_mj"]}]
    energies = [s["accelerators"][0]["energy_mj"] for s in samples]
    assert energies == sorted(energies) and energies[1] - energies[0] == 1000
    assert nvml.shutdowns == 1


def test_a_device_without_counters_says_so_and_records_no_energy(tmp_path, monkeypatch):
    nvml = fake_nvml(fail_init=False, energy=False)
    del nvml.nvmlDeviceGetPowerUsage  # an old binding without the call
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with Sampler(tmp_path, 0, interval_s=0.01) as sampler:
        wait_for_samples(sampler, 2)
    records = read_monitor(RunDir(tmp_path).monitor_log(0))
    assert records[0]["accelerators"][0]["power"] is False and records[0]["accelerators"][0]["energy_counter"] is False
    sample = next(r for r in records if r["kind"] == "sample")
    assert sample["accelerators"][0]["power_w"] is None and "energy_mj" not in sample["accelerators"][0]


@pytest.mark.parametrize("visible, indices", [(None, [0, 1, 2]), ("2,0", [0, 2]), ("GPU-0000-gpu1", [1]),
                                              ("", []), ("MIG-5c1f", [0, 1, 2])])
def test_only_the_replicas_own_accelerators_are_sampled(tmp_path, monkeypatch, visible, indices):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init=False, gpus=3))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with Sampler(tmp_path, 0, interval_s=0.01) as sampler:
        wait_for_samples(sampler, 1)
    records = read_monitor(RunDir(tmp_path).monitor_log(0))
    assert [a["index"] for a in records[0]["accelerators"]] == indices
    assert [a["index"] for a in records[1]["accelerators"]] == indices
    assert records[0]["visible"].startswith("all" if visible is None else f"CUDA_VISIBLE_DEVICES={visible}")


def test_host_energy_from_powercap_packages_and_dram_only(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    powercap = fake_powercap(tmp_path / "powercap")
    with Sampler(tmp_path / "run", 0, interval_s=0.01, powercap_root=powercap) as sampler:
        wait_for_samples(sampler, 2)
    records = read_monitor(RunDir(tmp_path / "run").monitor_log(0))
    assert records[0]["rapl"] == "ok"
    assert records[0]["rapl_zones"] == [
        {"zone": "intel-rapl:0", "name": "package-0", "max_energy_range_uj": 262143328850},
        {"zone": "intel-rapl:0:1", "name": "dram", "max_energy_range_uj": 262143328850}]
    sample = next(r for r in records if r["kind"] == "sample")
    assert sample["host_energy_uj"] == {"intel-rapl:0": 1000, "intel-rapl:0:1": 200}


@pytest.mark.parametrize("make, reason", [(lambda root: fake_powercap(root, readable=False), "energy_uj"),
                                          (lambda root: root, "no RAPL package zone"),
                                          (lambda root: root / "absent", "absent")])
def test_unreadable_or_absent_rapl_is_unavailable_never_partial(tmp_path, monkeypatch, make, reason):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    (tmp_path / "powercap").mkdir()
    with Sampler(tmp_path / "run", 0, interval_s=0.01, powercap_root=make(tmp_path / "powercap")) as sampler:
        wait_for_samples(sampler, 2)
    records = read_monitor(RunDir(tmp_path / "run").monitor_log(0))
    assert records[0]["rapl"].startswith("unavailable: ") and reason in records[0]["rapl"]
    assert records[0]["rapl_zones"] == []
    assert not any("host_energy_uj" in r for r in records[1:])


def test_one_sampler_per_node_reads_a_shared_counter(tmp_path, monkeypatch):
    """Two replicas of one run on one node: the host's counters go into one monitor at a time, and
    the other replica takes over when the first stops (its replica died)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    powercap = fake_powercap(tmp_path / "powercap")
    first = Sampler(tmp_path / "run", 0, interval_s=0.01, powercap_root=powercap).start()
    wait_for_samples(first, 2)
    second = Sampler(tmp_path / "run", 1, interval_s=0.01, powercap_root=powercap).start()
    wait_for_samples(second, 3)
    first.stop()
    count = second.samples_written
    wait_for_samples(second, count + 3)
    second.stop()
    run = RunDir(tmp_path / "run")
    one = [r for r in read_monitor(run.monitor_log(0)) if r["kind"] == "sample"]
    two = [r for r in read_monitor(run.monitor_log(1)) if r["kind"] == "sample"]
    assert all("host_energy_uj" in r for r in one)
    assert not any("host_energy_uj" in r for r in two[:3]) and "host_energy_uj" in two[-1]
    # Another run on the same node reads its own copy of the counters.
    with Sampler(tmp_path / "other-run", 0, interval_s=0.01, powercap_root=powercap) as other:
        wait_for_samples(other, 1)
    assert "host_energy_uj" in read_monitor(RunDir(tmp_path / "other-run").monitor_log(0))[1]


def lock_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("aiperf-energy-"))


def test_a_run_leaves_no_energy_lock_file_behind(tmp_path, monkeypatch):
    """Two replicas of a run on one node share the host's counters: the first holds the lock, the
    second takes over when the first stops; when both have stopped no lock file is left."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    powercap = fake_powercap(tmp_path / "powercap")
    first = Sampler(tmp_path / "run", 0, interval_s=0.01, powercap_root=powercap).start()
    wait_for_samples(first, 2)
    assert len(lock_files(temporary)) == 1  # the host's energy counter, held by the first
    second = Sampler(tmp_path / "run", 1, interval_s=0.01, powercap_root=powercap).start()
    wait_for_samples(second, 2)
    first.stop()
    wait_for_samples(second, second.samples_written + 3)
    assert len(lock_files(temporary)) == 1  # taken over by the second
    second.stop()
    assert lock_files(temporary) == []


def test_a_lock_whose_file_was_removed_meanwhile_is_taken_on_the_new_file(tmp_path, monkeypatch):
    """A sampler that opened the file just before its holder removed it must not count the lock
    it then gets on the removed file: a third sampler would lock a new file, and two would read
    the counter."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    holder, late, third = (_CounterLocks(tmp_path / "run") for _ in range(3))
    assert holder.hold("host")
    opened = []
    real_open = os.open

    def open_then_the_holder_stops(path, flags, mode=0o777):
        fd = real_open(path, flags, mode)
        opened.append(os.fstat(fd).st_ino)
        if holder.held:
            holder.release()  # removes the file `late` has just opened
        return fd

    monkeypatch.setattr(os, "open", open_then_the_holder_stops)
    assert late.hold("host")
    assert len(opened) == 2  # the removed file, then a new one (closed first: its inode may come back)
    assert os.fstat(late.held["host"][0]).st_ino == os.stat(late.path("host")).st_ino == opened[1]
    assert not third.hold("host")
    late.release()
    assert lock_files(tmp_path) == []


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
