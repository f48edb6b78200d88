"""`make bench`: run every benchmark script, then print one table of all figures and save it as JSON.
`make bench BENCH="torch_throughput opcount_speed"` (or `benchmarks/_suite.py NAME...`) runs only those.

Each script prints its own progress and one `BENCH {json}` line per figure (see _common.report).
A script that fails is reported in the table and makes the suite exit non-zero, after the others
have run: one broken benchmark must not hide the figures of the rest.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from aiperf_core.atomic import write_text_atomic  # noqa: E402

OUT = Path(os.environ.get("AIPERF_BENCH_OUT", "bench-results.json"))


def scripts(names: list[str]) -> list[Path]:
    """Every benchmark script, or those named (with or without .py); an unknown name is an error."""
    found = sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))
    if not names:
        return found
    by_name = {p.stem: p for p in found}
    unknown = [n for n in names if n.removesuffix(".py") not in by_name]
    if unknown:
        raise SystemExit(f"no benchmark named {', '.join(unknown)} (there are: {', '.join(by_name)})")
    return [by_name[n.removesuffix(".py")] for n in names]


def run_script(path: Path) -> tuple[list[dict], int, float]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    rows = []
    for line in proc.stdout:
        if line.startswith("BENCH "):
            rows.append(json.loads(line[len("BENCH "):]))
        else:
            sys.stdout.write(line)
    return rows, proc.wait(), time.perf_counter() - start


def format_goal(row: dict) -> str:
    if row.get("goal") is None:
        return ""
    return f"{row['goal']:g}"


def main(names: list[str]) -> int:
    results, failed = [], []
    for path in scripts(names):
        print(f"== {path.name}", flush=True)
        rows, code, seconds = run_script(path)
        for row in rows:
            results.append({"script": path.name, **row})
        if code:
            failed.append(path.name)
            results.append({"script": path.name, "name": f"exit status {code}", "value": None, "unit": "",
                            "goal": None, "met": False})
        print(f"   ({seconds:.0f} s)")
    print()
    header = f"{'script':<26} {'figure':<56} {'value':>12} {'unit':<10} {'goal':>8}  status"
    print(header)
    print("-" * len(header))
    for r in results:
        value = "" if r["value"] is None else f"{r['value']:.4g}"
        status = "FAILED: " + r["failed"] if r.get("failed") else {True: "met", False: "MISSED", None: ""}[r["met"]]
        print(f"{r['script']:<26} {r['name'][:56]:<56} {value:>12} {r['unit']:<10} {format_goal(r):>8}  {status}")
    document = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.platform(),
                "python": platform.python_version(), "cpus": os.cpu_count(), "results": results}
    write_text_atomic(OUT, json.dumps(document, indent=2) + "\n")
    print(f"\nsaved {OUT}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
