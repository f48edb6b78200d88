"""Wall time of the whole conformance kit per backend (goal for torch: at most 5 minutes)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import report  # noqa: E402
from aiperf_core.registry import list_backends, load_backend  # noqa: E402
from aiperf_conformance.kit import run_conformance  # noqa: E402

if __name__ == "__main__":
    names = sys.argv[1:] or [i.name for i in list_backends() if i.available]
    for name in names:
        start = time.perf_counter()
        result = run_conformance(load_backend(name))
        seconds = time.perf_counter() - start
        verdict = "conforms" if result.ok else "DOES NOT CONFORM"
        report(f"conformance kit, all levels: {name} ({verdict})", seconds, "s", goal=300)
