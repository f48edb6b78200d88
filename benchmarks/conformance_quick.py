"""`aiperf conformance --quick` on the NumPy reference: every level on reduced sizes (goal: under 60 s
here), with the CPU seconds of the process beside the wall time, since a busy machine stretches the
wall time of the same work."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import report  # noqa: E402
from aiperf_core.registry import load_backend  # noqa: E402
from aiperf_conformance.kit import run_conformance  # noqa: E402

if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "numpy"
    backend = load_backend(name)
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_conformance(backend, quick=True)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    verdict = "nothing failed" if result.ok else "FAILED"
    report(f"conformance --quick, all levels: {name} ({verdict})", wall, "s", goal=60)
    report(f"conformance --quick, all levels: {name}, CPU seconds", cpu, "s")
