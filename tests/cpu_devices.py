"""A script run in a fresh Python process over AIPERF_CPU_DEVICES CPU devices, for the backends' data-parallel
tests: the variable is read when a backend first loads its framework, hence the fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def run_on_cpu_devices(script: str, count: int = 2):
    """The JSON the script prints on its last line, run from the repository's root with
    AIPERF_CPU_DEVICES=count (and tests/ on the path, as under pytest, for the helper modules)."""
    env = dict(os.environ, AIPERF_CPU_DEVICES=str(count))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
