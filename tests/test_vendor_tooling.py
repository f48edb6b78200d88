"""Vendor tooling: `aiperf new-backend`, the skeleton it writes, the pytest plugin, and the vendor
guide's walk-through (plugins/aiperf-numpy/README.md) run as written in a new directory, in a
temporary virtual environment that installs the scaffolded package with pip (the entry point must
really be installed). The guide's last command, the full certification (every level, about 4
minutes), is run by hand, not here; the walk-through certifies the op and parallel levels in full
and every level with --quick, through the CLI and through pytest."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import site
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from aiperf_core.backend import BackendError
from aiperf_core.cli import main
from aiperf_conformance.expectations import read_expectations
from aiperf_conformance.kit import Context, catalogue, catalogue_ids, collect, run_check
from aiperf_conformance.scaffold import files, names

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "plugins" / "aiperf-numpy" / "README.md"


def guide_block(marker: str) -> str:
    """The ```sh block that follows `<!-- marker...-->` in the guide."""
    match = re.search(rf"<!-- {re.escape(marker)}[^>]*-->\n```sh\n(.*?)```", GUIDE.read_text(), re.S)
    assert match, f"the guide has no block marked {marker}"
    return match.group(1)


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_names_derived_from_the_backend_name():
    assert names("my_chip") == {"name": "my_chip", "package": "aiperf_my_chip", "dist": "aiperf-my-chip",
                                "cls": "MyChipBackend"}


def test_scaffold_writes_a_plugin_package(tmp_path):
    assert main(["new-backend", "mychip", "--out", str(tmp_path / "pkg"), "--framework", "paddle"]) == 0
    pkg = tmp_path / "pkg"
    written = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    assert written == ["README.md", "aiperf_mychip/__init__.py", "aiperf_mychip/backend.py",
                       "aiperf_mychip/conformance.json", "pyproject.toml", "tests/test_backend.py"]
    project = tomllib.loads((pkg / "pyproject.toml").read_text())
    assert project["project"]["name"] == "aiperf-mychip"
    assert project["project"]["entry-points"]["aiperf.backends"] == {"mychip": "aiperf_mychip.backend:MychipBackend"}
    assert project["tool"]["setuptools"]["package-data"] == {"aiperf_mychip": ["conformance.json"]}
    # The expectations file passes the strict reader, its patterns matching real checks.
    expectations = read_expectations(pkg / "aiperf_mychip" / "conformance.json", catalogue_ids())
    assert set(expectations.xfail) == {"count/*", "morph/*/count_delta"}
    assert 'cls.import_availability("paddle")' in (pkg / "aiperf_mychip" / "backend.py").read_text()
    compile((pkg / "tests" / "test_backend.py").read_text(), "test_backend.py", "exec")


def test_skeleton_methods_raise_one_line_naming_what_to_do(tmp_path):
    (tmp_path / "skeleton.py").write_text(files("mychip")["aiperf_mychip/backend.py"])
    backend = load_module(tmp_path / "skeleton.py", "skeleton_mychip").MychipBackend()
    assert backend.availability().available  # no framework named
    for call, method in ((backend.devices, "devices"), (backend.framework_version, "framework_version")):
        with pytest.raises(BackendError) as caught:
            call()
        message = str(caught.value)
        assert f"aiperf-mychip: MychipBackend.{method}() is not implemented yet:" in message
        assert "\n" not in message
    assert backend.parallelism().data_parallel is False and backend.native_counter() is None


def test_skeleton_fails_the_kit_saying_what_is_missing(tmp_path, monkeypatch):
    (tmp_path / "skeleton2.py").write_text(files("mychip")["aiperf_mychip/backend.py"])
    cls = load_module(tmp_path / "skeleton2.py", "skeleton2_mychip").MychipBackend
    monkeypatch.setattr(cls, "devices", lambda self: ["cpu"])
    backend = cls()
    from aiperf_conformance.expectations import Expectations

    ctx = Context(backend, Expectations(), device="cpu")
    result = run_check(ctx, collect(ctx, ["op"])[0])
    assert result.status == "error"
    assert "MychipBackend.lower() is not implemented yet" in result.message


@pytest.mark.parametrize("argv, text", [
    (["new-backend", "My-Chip"], "backend name 'My-Chip'"),
    (["new-backend", "numpy"], "a backend named 'numpy' is already installed by aiperf-numpy"),
    (["new-backend", "mychip", "--framework", "not a module"], "is not a Python module name"),
])
def test_new_backend_usage_errors_are_one_line(argv, text, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_new_backend_never_overwrites(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["new-backend", "mychip", "--out", str(tmp_path)]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.fixture(scope="module")
def vendor_env(tmp_path_factory) -> dict:
    """A fresh virtual environment that sees this one's packages (aiperf, the reference, pytest,
    pip) through a .pth file, with an `aiperf` command of its own: what a vendor has after `pip
    install aiperf`. Whatever pip installs goes into it, not into .venv."""
    venv = tmp_path_factory.mktemp("vendor") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = next((venv / "lib").glob("python3*/site-packages"))
    parents = "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages())
    (purelib / "_aiperf_parent_env.pth").write_text(f"import site; {parents}\n")
    script = venv / "bin" / "aiperf"
    script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom aiperf_core.cli import main\nsys.exit(main())\n")
    script.chmod(0o755)
    env = dict(os.environ, PATH=f"{venv}/bin{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv),
               PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for name in ("PYTHONPATH", "AIPERF_BACKEND", "AIPERF_CONFIG", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    return env


@pytest.mark.slow  # the guide's walkthrough: scaffold, install, its tests and a quick kit
def test_walkthrough_certifies_a_scaffolded_backend(vendor_env, tmp_path):
    workdir = tmp_path / "new"
    workdir.mkdir()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", guide_block("walkthrough:")], cwd=workdir,
                          env=vendor_env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Successfully installed aiperf-mychip" in out
    assert re.search(r"^3 passed", out, re.M)  # the scaffold's own tests
    counted = sum(c.needs_counter for c in catalogue(precisions=("fp32",)))  # count/* and morph/*/count_delta
    assert re.search(rf"CONFORMS: \d+ passed, 0 failed, {counted} expected failures -- quick: not a certification",
                     out)
    assert re.search(rf"\d+ passed, {counted} xfailed", out) and "aiperf conformance: quick: not a certification" in out
    report = json.loads((workdir / "aiperf-mychip" / "report.json").read_text())
    assert report["ok"] and report["certifies"] and report["backend"] == "mychip"
    assert report["expectations"]["file"]["path"].endswith("aiperf_mychip/conformance.json")
    assert {c["level"] for c in report["checks"]} == {"op", "parallel"}


def test_pytest_plugin_fails_a_wrong_backend_with_the_kit_message(vendor_env, tmp_path):
    """A registered backend with a planted bug, run through `pytest --aiperf-backend`."""
    (tmp_path / "buggy_backend.py").write_text(textwrap.dedent("""
        from aiperf_numpy.backend import NumpyBackend

        class Buggy(NumpyBackend):
            name = "buggy"

            def predict_checked(self, model, x):
                return super().predict_checked(model, x) * 1.01
    """))
    dist = tmp_path / "buggy_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: buggy-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[aiperf.backends]\nbuggy = buggy_backend:Buggy\n")
    env = dict(vendor_env, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--aiperf-backend", "buggy",
                           "--aiperf-level", "op", "-k", "relu or dense"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "buggy:op/relu/forward: fail: node 'op' (relu): relative error 0.01 (tolerance 0.0001)" in out
    assert "Traceback" not in out
