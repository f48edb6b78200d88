"""`make test-container`: build the NumPy image with `make image` (the build inside a network
namespace without interfaces), then run replicas in it under Charliecloud, on this machine and on
the test SLURM cluster (tests/slurm_cluster.py), verify the runs, and refuse a backend the image
lacks. It takes minutes (about 2.5 for the build with Debian's mirror), so `make test` leaves it out
(marker `container`); the wrapping and the refusals have fast tests in tests/test_container.py.

As root it apt-installs what it needs (Charliecloud, python3-lark for ch-image, mmdebstrap), as
the SLURM fixture does. build/image/base.tar, where a `make image` left one, is reused."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aiperf_core.rundir import read_events
from aiperf_core.workflow.container import tree_digest
from apt_packages import apt_install
from slurm_cluster import SlurmCluster
from test_workflow import TINY_POLICY

pytestmark = pytest.mark.container
REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("charliecloud", "python3-lark", "mmdebstrap")
TOOLS = ("ch-image", "ch-run", "ch-convert", "mmdebstrap")


def _install() -> None:
    if all(shutil.which(tool) for tool in TOOLS):
        return
    if os.geteuid() != 0:
        pytest.skip(f"needs {', '.join(TOOLS)}; as root this test installs them: apt-get install {' '.join(PACKAGES)}")
    error = apt_install(PACKAGES)
    assert error is None, f"apt-get install failed: {error}"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """(the image folder, the digest `make image` printed)."""
    _install()
    out = tmp_path_factory.mktemp("image")
    env = {**os.environ}
    base = REPO / "build/image/base.tar"
    if base.is_file():
        env["BASE_TAR"] = str(base)
    build = subprocess.run(["make", "-C", str(REPO), "image", f"IMAGE_OUT={out}"], env=env, capture_output=True,
                           text=True, timeout=1200)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    if os.geteuid() == 0:  # unshare --net needs root, or user namespaces, which this machine has as root
        assert "in a network namespace without interfaces (unshare --net)" in build.stdout, build.stdout[-3000:]
    digest = re.search(r"^digest  (sha256:[0-9a-f]{64})$", build.stdout, re.MULTILINE)
    assert digest is not None, build.stdout[-3000:]
    return out / "aiperf", digest.group(1)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "aiperf.toml"
    path.write_text(TINY_POLICY)
    return path


def _aiperf(args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiperf_core", *args], capture_output=True, text=True,
                          env=env or os.environ, timeout=timeout)


def _run_args(image_path, config, run_dir) -> list[str]:
    return ["run", "--container", str(image_path), "--container-runtime", "charliecloud", "--backend", "numpy",
            "--data", "digits", "--config", str(config), "--time-budget", "5m", "--stop-after-trials", "1",
            "--run-dir", str(run_dir)]


def _assert_ran_in(run_dir: Path, image_path: Path, digest: str, replicas: int) -> None:
    expected = {"image": str(image_path), "digest": digest, "runtime": "charliecloud"}
    assert json.loads((run_dir / "run.json").read_text())["container"] == expected
    for replica in range(replicas):
        starts = [e for e in read_events(run_dir / f"replicas/{replica}/events.jsonl") if e["event"] == "replica_start"]
        assert starts and all(start["container"] == expected for start in starts), starts
    verify = _aiperf(["score", str(run_dir), "--verify"])
    assert verify.returncode == 0 and "verify: intact" in verify.stdout, verify.stdout + verify.stderr


def test_the_digest_is_the_images_own(image):
    image_path, digest = image
    stamp = json.loads((image_path / "etc/aiperf/image.json").read_text())
    assert stamp["digest"] == digest == tree_digest(image_path)
    assert stamp["extras"] == "search" and stamp["name"] == "aiperf"


def test_replicas_run_in_the_image(image, config, tmp_path):
    image_path, digest = image
    run = _aiperf(_run_args(image_path, config, tmp_path / "run"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_ran_in(tmp_path / "run", image_path, digest, replicas=1)


def test_an_image_without_the_backend_is_refused(image, config, tmp_path):
    image_path, _ = image
    args = _run_args(image_path, config, tmp_path / "run")
    refused = _aiperf([*args[:args.index("numpy")], "torch", *args[args.index("numpy") + 1:]])
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [
        f"aiperf: error: --container {image_path}: the image cannot run --backend torch: backend 'torch' is "
        "unavailable: torch is not installed: ModuleNotFoundError: No module named 'torch' (pip install "
        "'aiperf[torch]') (built with extras 'search')"]
    assert not (tmp_path / "run").exists()


def test_slurm_replicas_run_in_the_image(image, config, tmp_path):
    image_path, digest = image
    cluster = SlurmCluster(tmp_path / "slurm").start()
    try:
        env = {**cluster.env, "OMP_NUM_THREADS": "1"}
        run = _aiperf([*_run_args(image_path, config, tmp_path / "run"), "--executor", "slurm", "--replicas", "2",
                       "--slurm-cpus-per-task", "1"], env)
    finally:
        cluster.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    _assert_ran_in(tmp_path / "run", image_path, digest, replicas=2)
