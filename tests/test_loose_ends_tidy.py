"""Tidy-ups: energy lock files go with their sampler; no import circle between the core's modules."""

from __future__ import annotations

import ast
import os
import sys
import tempfile
from pathlib import Path

from aiperf_core.monitoring.sampler import Sampler, _CounterLocks
from test_monitor import fake_powercap, wait_for_samples

ROOT = Path(__file__).resolve().parents[1]


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


PACKAGES = ("aiperf_core", "opcount", "conformance", "backends", "plugins")


def _modules() -> dict[str, Path]:
    """Every module of the code base, by dotted name (a package by its own name)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The code base's modules that `path` imports at any level of its code (lazy imports too).
    `from package import submodule` imports the submodule, not the package's own code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found.update(submodules or {base})
    return (found & modules.keys()) - {name}


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    assert {"aiperf_core.backend", "aiperf_core.registry", "aiperf_core.data.dali",
            "aiperf_core.data.stream"} <= modules.keys()
    imports = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = sorted({tuple(sorted((a, b))) for a, found in imports.items() for b in found if a in imports[b]})
    assert not circles, "modules that import each other: " + "; ".join(f"{a} <-> {b}" for a, b in circles)
