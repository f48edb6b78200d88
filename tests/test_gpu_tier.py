"""The GPU tier's driver (`make test-gpu`, tests/gpu_tier.py), on the CPU: what it collects, that its
steps run at once and each is reported whole, and that it refuses to pass having checked nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import gpu_tier  # noqa: E402


def test_the_tier_collects_every_module_that_uses_the_gpu_marker_and_no_other():
    """A module outside the list would never run on a GPU; one inside that the CPU suite needs
    (TensorFlow, MindSpore) would stop the collection on a CUDA image that lacks them."""
    marked = sorted(str(path) for path in TESTS.glob("test_*.py")
                    if path.name != Path(__file__).name and re.search(r"mark\.gpu\b", path.read_text()))
    assert gpu_tier.gpu_test_files() == marked
    assert [Path(path).name for path in marked] == ["test_jax_gpu.py", "test_lm_gpu.py", "test_torch_gpu.py",
                                                    "test_torch_sequence_gpu.py"]


def test_steps_run_at_once_and_each_log_is_printed_whole(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    flag = tmp_path / "second-started"
    # The first step can only finish once the second has started: run one after the other, it
    # would wait out its 60 s and fail.
    waits = ("import os, pathlib, sys, time\n"
             f"flag = pathlib.Path({str(flag)!r})\n"
             "deadline = time.monotonic() + 60\n"
             "while not flag.exists() and time.monotonic() < deadline: time.sleep(0.05)\n"
             "print('first saw the second:', flag.exists())\n"
             "sys.exit(0 if flag.exists() else 5)\n")
    signals = ("import os, pathlib, sys\n"
               f"pathlib.Path({str(flag)!r}).touch()\n"
               "print('preallocate', os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))\n"
               "print('line two', file=sys.stderr)\n"
               "sys.exit(3)\n")
    results = gpu_tier.run_steps({"first step": [sys.executable, "-c", waits],
                                  "second": [sys.executable, "-c", signals]}, tmp_path)
    assert results == {"first step": 0, "second": 3}
    out = capsys.readouterr().out
    assert "first saw the second: True" in out
    assert "== second: exit 3 after" in out and "== first step: exit 0 after" in out
    assert "preallocate false" in out and "line two" in out  # stdout and stderr, whole
    assert (tmp_path / "first-step.log").read_text() == "first saw the second: True\n"


def test_a_caller_s_preallocation_setting_is_kept(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    gpu_tier.run_steps({"env": [sys.executable, "-c", "import os; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"]},
                       tmp_path)
    assert "true" in capsys.readouterr().out


def test_without_an_accelerator_the_tier_fails_and_says_so():
    done = subprocess.run([sys.executable, str(TESTS / "gpu_tier.py")], capture_output=True, text=True, timeout=300)
    if "gpu tier: accelerators:" in done.stdout:
        pytest.skip("this machine has an accelerator: the tier ran for real")
    assert done.returncode == 1
    assert "no accelerator is visible" in done.stderr
