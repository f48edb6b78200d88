"""What `pip install aiperf` puts in site-packages: only the namespaced top-level packages
(aiperf_core, aiperf_opcount, aiperf_backends, aiperf_conformance), every subpackage of the repository
and the kit's data, and entry points that resolve to the installed code. The wheel is built from a
copy of the tree (never in it) and installed into a temporary virtual environment."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> import name (pyproject's package-dir).
FOLDERS = {"aiperf_core": "aiperf_core", "opcount": "aiperf_opcount", "backends": "aiperf_backends",
           "conformance": "aiperf_conformance"}
TOP_LEVEL = set(FOLDERS.values())


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site-packages of a fresh venv with the wheel installed, its python)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.split()
    for rel in listed:
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "--disable-pip-version-check", "-q", "-w", str(work / "dist"), str(source)], check=True)
    wheel = next((work / "dist").glob("aiperf-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "--disable-pip-version-check", "-q", str(wheel)], check=True)
    purelib = next((venv / "lib").glob("python3*/site-packages"))
    # The dependencies (numpy, stevedore...) come from this environment as plain path entries: its
    # .pth files are not run, so its editable aiperf cannot shadow the installed wheel.
    (purelib / "zz_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return purelib, python


def test_only_namespaced_top_level_packages(installed):
    purelib, _ = installed
    ours = {p.name for p in purelib.iterdir() if not p.name.endswith((".dist-info", ".pth")) and p.name != "__pycache__"}
    assert ours == TOP_LEVEL
    record = next(purelib.glob("aiperf-*.dist-info")) / "top_level.txt"
    if record.exists():
        assert set(record.read_text().split()) == TOP_LEVEL


def test_every_subpackage_and_data_file_is_in_the_wheel(installed):
    purelib, _ = installed
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            assert (purelib / name / relative / "__init__.py").is_file(), f"{folder}/{relative} is not in the wheel"
    for pattern in ("data/*.json", "defaults.json", "templates/*.tmpl"):
        for data in (ROOT / "conformance").glob(pattern):
            assert (purelib / "aiperf_conformance" / data.relative_to(ROOT / "conformance")).is_file(), data


def test_entry_points_resolve_to_the_installed_code(installed):
    purelib, python = installed
    probe = """
import json, sys, types
from importlib.metadata import distribution
out = []
for ep in distribution("aiperf").entry_points:
    obj = ep.load()
    module = obj if isinstance(obj, types.ModuleType) else sys.modules[obj.__module__]
    out.append([ep.group, ep.name, module.__file__])
print(json.dumps(out))
"""
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = {(group, name): path for group, name, path in json.loads(proc.stdout)}
    assert {("console_scripts", "aiperf"), ("pytest11", "aiperf_conformance"), ("aiperf.backends", "torch"),
            ("aiperf.backends", "tensorflow"), ("aiperf.backends", "jax"), ("aiperf.backends", "mindspore")} <= set(found)
    for key, path in found.items():
        assert path.startswith(str(purelib)), (key, path)
