"""Speed of the submission pipeline (issue: rank machines): `aiperf submit` and `aiperf check` on the
run directory of the 12-hour, 4096-replica scale simulation, and `aiperf rank` of 50 submissions of
ordinary size. Each command runs in a fresh process, as a site and a reviewer run it.

Goals: submit <= 60 s and check <= 60 s at 4096 replicas; rank of 50 ordinary submissions <= 30 s.

The simulated replicas all record one host name ("simulated") and write no monitor file; this
script gives each replica a monitor host record of 8 simulated accelerators on that host, so that
the check's inventory cross-check has what a real run records, and the description declares one
node of 8 such devices. The 50 ordinary submissions are 4-replica, 12-hour simulated runs.

    python benchmarks/submission_speed.py [--replicas 4096] [--hours 12] [--ordinary 50] [--keep DIR]
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import benchmark_folder, report  # noqa: E402
from aiperf_core.inventory import host_cpu  # noqa: E402
from aiperf_core.submission.system import to_toml, validate_system  # noqa: E402
from aiperf_core.workflow.simulation import (ReplicaModel, expected_ops, resnet50_family, simulate,  # noqa: E402
                                             write_graph_pool, write_weights_stand_in)

EPOCH_S = 360.0  # as benchmarks/scale_simulation.py: a ResNet-50 ImageNet epoch on one 8-device replica
START_TIME = 1.8e9
LEVELS = ["op", "graph", "morph", "train", "count", "parallel"]


def description(name: str) -> dict:
    cpu = host_cpu()
    return validate_system({
        "schema_version": 1, "submitter": "bench", "site": "bench site", "country": "DE", "system_name": name,
        "availability": "research", "interconnect": "none", "shared_storage": "none", "cooling": "air",
        "notes": "the scale simulation: one host name for every replica",
        "nodes": {"count": 1, "cpu_model": cpu["model"] or "unknown", "sockets": 1, "cores": 2, "threads": 2,
                  "memory_bytes": 1 << 34, "os": "Linux"},
        "accelerators": {"kind": "other", "model": "simulated", "per_node": 8, "memory_bytes": 1 << 30,
                         "driver": "none", "peak_ops": {"fp32": 1e18, "bf16": 1e18}},
        "software": {"python": "3.11", "aiperf": "0.1.0", "frameworks": {}}})


def kit_report() -> dict:
    checks = [{"level": level, "name": "x", "status": "pass", "precision": "bf16"} for level in LEVELS]
    return {"backend": "simulated", "framework_version": "simulated", "levels": LEVELS, "device": "sim:0",
            "device_model": "simulated", "precisions": ["bf16"], "quick": False, "checks": checks}


def write_host_records(run_root: Path) -> None:
    """What each replica's monitor would have recorded: the host, its CPU, 8 accelerators."""
    cpu = host_cpu()
    record = {"kind": "host", "time": START_TIME, "host": "simulated", "pid": 1, "cpus": 2, "cpu_model": cpu["model"],
              "sockets": 1, "cores": 2, "memory_total": 1 << 34, "nvml": "ok", "visible": "all", "psutil": "ok",
              "rapl": "unavailable: simulated", "rapl_zones": [],
              "accelerators": [{"index": i, "name": "simulated", "uuid": f"GPU-sim-{i}", "memory_total": 1 << 30,
                                "power": False, "energy_counter": False} for i in range(8)]}
    line = json.dumps(record) + "\n"
    for folder in (run_root / "replicas").iterdir():
        (folder / "monitor.jsonl").write_text(line)


def aiperf(*args) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "aiperf_core", *map(str, args)], capture_output=True, text=True)
    return time.perf_counter() - start, result


def package(run_root: Path, folder: Path, name: str) -> Path:
    (folder / f"{name}.toml").write_text(to_toml(description(name)))
    (folder / "kit.json").write_text(json.dumps(kit_report()))
    out = folder / f"{name}.tar.gz"
    seconds, result = aiperf("submit", run_root, "--system", folder / f"{name}.toml", "--conformance",
                             folder / "kit.json", "--out", out, "--force")
    if result.returncode != 0:
        raise SystemExit(f"aiperf submit failed: {result.stderr.strip()}")
    return out, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4096)
    parser.add_argument("--hours", type=float, default=12.0)
    parser.add_argument("--ordinary", type=int, default=50, help="submissions ranked together")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories and packages here")
    args = parser.parse_args()
    with benchmark_folder(args.keep, "aiperf-submission-") as work:
        pool = write_graph_pool(resnet50_family(8), work / "pool")
        weights = work / "pool" / "weights.npz"
        write_weights_stand_in(weights)
        model = ReplicaModel(device_ops_per_s=expected_ops(pool[0], ReplicaModel(1.0)) / EPOCH_S)
        budget = args.hours * 3600.0

        t = time.perf_counter()
        big = work / f"run-{args.replicas}"
        if not (big / "run.json").exists():
            simulate(big, args.replicas, budget, model, pool, weights, start_time=START_TIME, poll_interval_s=60.0)
            write_host_records(big)
        print(f"{args.replicas}-replica {args.hours:g}-h run directory ready in {time.perf_counter() - t:.0f} s")
        out, seconds = package(big, work, f"sim-{args.replicas}")
        report(f"submit {args.hours:g}-h {args.replicas}-replica run", seconds, "s", goal=60.0)
        report(f"package size, {args.replicas} replicas", out.stat().st_size / 2**20, "MiB")
        seconds, result = aiperf("check", "--json", out)
        if result.returncode == 2:
            raise SystemExit(f"aiperf check could not read the package: {result.stderr.strip()}")
        verdict = json.loads(result.stdout)
        print(f"verdict {verdict['verdict']}: {'; '.join(verdict['reasons'][:3])}")
        report(f"check {args.hours:g}-h {args.replicas}-replica package", seconds, "s", goal=60.0)

        t = time.perf_counter()
        packages = []
        for k in range(args.ordinary):
            run_root = work / f"ordinary-{k}"
            if not (run_root / "run.json").exists():
                simulate(run_root, 4, budget, model, pool, weights, start_time=START_TIME + k, poll_interval_s=60.0)
                write_host_records(run_root)
            packages.append(package(run_root, work, f"ordinary-{k}")[0])
        sizes = [p.stat().st_size for p in packages]
        print(f"{len(packages)} ordinary submissions ({min(sizes) / 1024:.0f}-{max(sizes) / 1024:.0f} KiB) made in "
              f"{time.perf_counter() - t:.0f} s")
        seconds, result = aiperf("rank", *packages, "--json")
        if result.returncode == 2:
            raise SystemExit(f"aiperf rank failed: {result.stderr.strip()}")
        ranking = json.loads(result.stdout)
        print(f"ranked {len(ranking['entries'])}, rejected {len(ranking['rejected'])}")
        report(f"rank {len(packages)} ordinary submissions", seconds, "s", goal=30.0)


if __name__ == "__main__":
    main()
