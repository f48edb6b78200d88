"""The torch kit's parallel level after other levels, in one `aiperf conformance` invocation.

The parallel level's child process once aborted a rank now and then, but only when the whole kit
had run before it in the same invocation (docs/backends/torch.md, "Data-parallel teardown"): the
level alone never did. This runs it the way that failed, as cheaply as the kit allows (--quick,
fp32, the count level before it, which loads torch and its counter in the kit's own process). The
ranks' teardown is checked on every run: a rank whose process group outlives its teardown fails
its training (backends/torch/distributed.py, end_process_group), so the check below fails every
time the fault is there, not one time in five.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aiperf_conformance.levels.parallel import DATA_PARALLEL_CHECKS


@pytest.mark.slow
def test_parallel_level_after_other_levels_in_one_kit_run(tmp_path):
    report_path = tmp_path / "R.json"
    done = subprocess.run([sys.executable, "-m", "aiperf_core", "conformance", "--backend", "torch",
                           "--level", "count,parallel", "--quick", "--precision", "fp32",
                           "--report", str(report_path)], capture_output=True, text=True, timeout=1800)
    report = json.loads(report_path.read_text())
    checks = {c["id"]: c for c in report["checks"]}
    assert report["levels"] == ["count", "parallel"]
    ran = [c["level"] for c in report["checks"]]
    assert ran.index("parallel") > max(i for i, level in enumerate(ran) if level == "count")
    for name in DATA_PARALLEL_CHECKS:
        check = checks[f"parallel/{name}"]
        assert check["status"] == "pass", check["message"]
        assert check["device"] == "child process with AIPERF_CPU_DEVICES=2: cpu:0, cpu:1"
    assert done.returncode == 0 and report["ok"], done.stdout[-3000:]
