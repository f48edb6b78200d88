"""Scrape cost of the Prometheus endpoint (issue #24) on the scale simulation's 12-hour run
directories at 16, 256 and 4096 replicas (aiperf_core/workflow/simulation.py `simulate`, as
benchmarks/scale_simulation.py runs it, without the NAS and history charges, which do not change
what the logs hold).

Each replica also gets a 12-hour monitor.jsonl (a host record, then a sample of its 8 simulated
accelerators and the host's RAPL counters every 30 s, 1,440 samples, as aiperf_core.monitoring.sampler
writes them), since the simulation writes none: about 2 MiB a replica, 8 GiB at 4096, so the
run directories are on disk, not in /dev/shm. The run lies in the past (it ended an hour ago).

Figures, per replica count, over HTTP against a fresh `aiperf metrics RUN_DIR --port` process (so
no graph is counted before the first scrape, as on a login node):
  - first scrape: seconds and bytes (OpenMetrics, as Prometheus asks for it), starting from the
    checkpoint the primary leaves (primary/progress.json, written here as the primary writes it at
    its end), and again without it (every log read: a run whose primary never wrote one);
  - later scrape, after one more monitor sample per replica (30 s of a run): seconds and bytes;
  - the cold history read it is held to: a new SharedHistory reading the same run, in a fresh
    process (benchmarks/scale_simulation.py's "cold read by a replica");
  - the primary's cost of one checkpoint write (it writes one every five minutes), and the file's size.
Goals, at 4096 replicas: a later scrape <= 0.5 s; a first scrape <= the cold
history read.

--source synthetic writes the run directory directly instead of simulating it, with the
simulation's 12-hour shape (12 trials of 10 epochs per replica: the 4096-replica simulation has
49,152 trials and 471,040 epochs), through benchmarks/score_speed.py's writer, plus a replica_stop
per replica, the primary's launches and run_end, and the history the primary publishes
(primary/history.jsonl, which the cold history read reads). It takes a minute or two where the simulation of 4096
replicas takes about 3 minutes on an idle machine and far longer on a loaded one.

    python benchmarks/metrics_scrape.py [--replicas 16 256 4096] [--hours 12] [--source simulation|synthetic]
                                        [--keep DIR]
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import benchmark_folder, report  # noqa: E402
from aiperf_core.rundir import RunDir, sha256_bytes  # noqa: E402
from aiperf_core.search.history import HistoryPublisher  # noqa: E402
from aiperf_core.workflow.simulation import (ReplicaModel, expected_ops, resnet50_family, simulate,  # noqa: E402
                                             write_graph_pool, write_weights_stand_in)
from scale_simulation import EPOCH_S, POOL_SIZE, WEAK_SCALING_POLL_S  # noqa: E402
import score_speed  # noqa: E402

SYNTHETIC_TRIALS, SYNTHETIC_EPOCHS = 12, 10  # per replica, per trial: the 12-hour simulation's shape
GOAL_REPLICAS = 4096  # the goals hold from here up

MONITOR_INTERVAL_S = 30.0
OPENMETRICS = "application/openmetrics-text; version=1.0.0"

COLD_HISTORY = """
import sys, time
from aiperf_core.rundir import RunDir
from aiperf_core.search.history import SharedHistory
history = SharedHistory(RunDir(sys.argv[1]))
start = time.perf_counter()
history.refresh()
print(time.perf_counter() - start)
"""


# The primary's checkpoint (aiperf_core.scoring.progress.write_checkpoint): its live ledger has
# followed the run, so the first write (reading every log) is not its cost; the second is.
PRIMARY_CHECKPOINT = """
import sys, time
from aiperf_core.scoring.progress import write_checkpoint
write_checkpoint(sys.argv[1])
start = time.perf_counter()
write_checkpoint(sys.argv[1])
print(time.perf_counter() - start)
"""


def monitor_sample(t: float, k: int, devices: int) -> str:
    accelerators = [{"index": i, "utilization": 90.0 + (k + i) % 10, "memory_utilization": 40.0,
                     "memory_used": 60_000_000_000 + i, "memory_total": 85_899_345_920,
                     "power_w": 400.0 + (k + i) % 50, "energy_mj": 400_000 * k + i} for i in range(devices)]
    return json.dumps({"kind": "sample", "time": t, "cpu_percent": 35.0, "memory_percent": 40.0,
                       "memory_used": 200_000_000_000, "accelerators": accelerators,
                       "host_energy_uj": {"intel-rapl:0": (250_000_000 * k) % 262_143_328_850,
                                          "intel-rapl:1": (250_000_000 * k) % 262_143_328_850}}) + "\n"


def write_monitors(run_dir: RunDir, start: float, seconds: float, devices: int) -> int:
    """A 12-hour monitor.jsonl per replica; its samples are the same bytes on every replica (only
    the host record differs), so they are built once. Returns the bytes written."""
    samples = "".join(monitor_sample(start + k * MONITOR_INTERVAL_S, k, devices)
                      for k in range(int(seconds // MONITOR_INTERVAL_S))).encode()
    total = 0
    for replica in run_dir.replica_ids():
        host = {"kind": "host", "time": start - 1.0, "host": f"node{replica:05d}", "pid": 1, "cpus": 128,
                "accelerators": [{"index": i, "name": "Simulated GPU", "uuid": f"GPU-{replica:05d}-{i}",
                                  "memory_total": 85_899_345_920, "power": True, "energy_counter": True}
                                 for i in range(devices)], "nvml": "ok", "psutil": "ok", "rapl": "ok"}
        data = json.dumps(host).encode() + b"\n" + samples
        run_dir.monitor_log(replica).write_bytes(data)
        total += len(data)
    return total


def append_monitor_samples(run_dir: RunDir, t: float, k: int, devices: int) -> None:
    line = monitor_sample(t, k, devices)
    for replica in run_dir.replica_ids():
        with open(run_dir.monitor_log(replica), "a") as f:
            f.write(line)


def synthetic_run(root: Path, replicas: int, start: float, budget: float, pool_graph, weights_sha256: str) -> RunDir:
    """score_speed's synthetic run, shaped like the simulation's, and ended as the primary ends it;
    each trial gets a trial.json as the simulation writes it (the history reads them)."""
    score_speed.EPOCHS_PER_TRIAL = SYNTHETIC_EPOCHS
    score_speed.write_run(root, replicas, SYNTHETIC_TRIALS, POOL_SIZE)
    run_dir = RunDir(root)
    run = run_dir.read_run()
    shift = start - run["start_time"]  # its clock starts at a fixed time: move the run to `start`
    run.update(start_time=start, time_budget_s=budget, deadline=start + budget)
    run.pop("schema_version", None)
    run_dir.write_run(run)
    for path in [run_dir.primary_log, *(run_dir.replica_log(r) for r in range(replicas))]:
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        writer = score_speed.ChainWriter(path)
        graphs = {}
        for event in lines:
            event["time"] += shift
            if event["event"] == "trial_start":
                graphs[event["trial"]] = event["graph_sha256"]
            if "started" in event:
                event["started"] += shift
            if event["event"] == "trial_end":
                event["files"] = trial_files(run_dir, event, graphs[event["trial"]], pool_graph, weights_sha256)
            writer.append(event.pop("event"), **{k: v for k, v in event.items() if k not in ("seq", "prev")})
        if path == run_dir.primary_log:
            for r in range(replicas):
                writer.append("replica_launch", time=start, replica=r, attempt=1, job=f"job-{r}", log_seq=0)
            for r in range(replicas):
                writer.append("replica_exit", time=start + budget, replica=r, attempt=1, status="finished",
                              reason="deadline", job=f"job-{r}", exit="exit code 0")
            writer.append("run_end", time=start + budget + 1, reason="deadline", log_heads={})
        else:
            writer.append("replica_stop", time=start + budget, replica=int(path.parent.name), reason="deadline")
        writer.close()
    # The history the primary publishes as trials end (primary/history.jsonl), all at once here.
    publisher = HistoryPublisher(run_dir, replicas)
    publisher.open(start + budget)
    publisher.publish_all(start + budget)
    publisher.close()
    return run_dir


def trial_files(run_dir: RunDir, end: dict, graph_sha256: str, pool_graph, weights_sha256: str) -> dict:
    """Write the trial's trial.json; trial_end's `files` (its weights are not written)."""
    info = {"trial": end["trial"], "replica": end["replica"], "round": 1, "parent": None, "morph": None,
            "hyper": {"batch_size": 448, "kernel_size": 3, "epochs": SYNTHETIC_EPOCHS, "learning_rate": 0.1,
                      "patience": 3, "label_smoothing": 0.0, "precision": "fp16"},
            "hpo": "warmup", "nas": None, "status": end["status"], "reason": None, "epochs": end["epochs"],
            "val_accuracy": [end["best_val_accuracy"]] * end["epochs"], "val_loss": [0.3] * end["epochs"],
            "best_val_accuracy": end["best_val_accuracy"], "predicted_accuracy": None,
            "target": end["best_val_accuracy"], "arch": pool_graph.arch, "signature": pool_graph.signature}
    text = json.dumps(info, sort_keys=True) + "\n"
    (run_dir.trial_dir(end["trial"]) / "trial.json").write_text(text)
    return {"graph.json": graph_sha256, "trial.json": sha256_bytes(text.encode()), "weights.npz": weights_sha256}


def scrape(url: str) -> tuple[float, int]:
    request = urllib.request.Request(url, headers={"Accept": OPENMETRICS})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        body = response.read()
    return time.perf_counter() - start, len(body)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_scrape(root: Path, scrapes) -> list[tuple[float, int]]:
    """Start a fresh `aiperf metrics RUN_DIR` process (as on a login node: nothing read before its
    first scrape), then for each callable in `scrapes`: call it, scrape; (seconds, bytes) each."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "aiperf_core", "metrics", str(root), "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=HERE.parent,
                              env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    try:
        server.stdout.readline()  # "serving ...": the port is bound
        url = f"http://127.0.0.1:{port}/metrics"
        results = []
        for before in scrapes:
            before()
            results.append(scrape(url))
        return results
    finally:
        server.terminate()  # SIGTERM: a background job may ignore SIGINT
        server.wait(timeout=60)


def in_fresh_process(code: str, root: Path) -> list[str]:
    return subprocess.run([sys.executable, "-c", code, str(root)], check=True, capture_output=True, text=True,
                          cwd=HERE.parent, env={**os.environ, "PYTHONPATH": str(HERE.parent)}
                          ).stdout.strip().splitlines()


def measure(root: Path, replicas: int, model: ReplicaModel, run_end: float, largest: bool) -> None:
    run_dir = RunDir(root)
    checkpoint_s = float(in_fresh_process(PRIMARY_CHECKPOINT, root)[-1])
    checkpoint_bytes = run_dir.progress_checkpoint.stat().st_size
    samples = int((run_end - run_dir.read_run()["start_time"]) // MONITOR_INTERVAL_S)
    nothing = lambda: None  # noqa: E731
    (first_s, first_bytes), (later_s, later_bytes), (quiet_s, _) = serve_and_scrape(
        root, [nothing, lambda: append_monitor_samples(run_dir, run_end, samples, model.devices), nothing])
    away = run_dir.progress_checkpoint.with_name("progress.json.away")
    run_dir.progress_checkpoint.rename(away)
    try:
        [(logs_s, _)] = serve_and_scrape(root, [nothing])
    finally:
        away.rename(run_dir.progress_checkpoint)
    cold = float(in_fresh_process(COLD_HISTORY, root)[-1])
    report(f"{replicas} replicas: first scrape (from primary/progress.json)", first_s, "s",
           goal=cold if largest else None)
    report(f"{replicas} replicas: first scrape size", first_bytes / 2**10, "KiB")
    report(f"{replicas} replicas: first scrape without primary/progress.json (every log read)", logs_s, "s")
    report(f"{replicas} replicas: later scrape (+1 monitor sample each)", later_s, "s",
           goal=0.5 if largest else None)
    report(f"{replicas} replicas: later scrape, nothing new", quiet_s, "s")
    report(f"{replicas} replicas: later scrape size", later_bytes / 2**10, "KiB")
    report(f"{replicas} replicas: cold history read (fresh process)", cold, "s")
    report(f"{replicas} replicas: the primary's checkpoint write (one every 5 minutes)", checkpoint_s, "s")
    report(f"{replicas} replicas: primary/progress.json size", checkpoint_bytes / 2**20, "MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[16, 256, 4096])
    parser.add_argument("--hours", type=float, default=12.0)
    parser.add_argument("--source", choices=("simulation", "synthetic"), default="simulation")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories under this folder")
    args = parser.parse_args()
    # On disk, not /dev/shm: 4096 12-hour monitor logs are about 8 GiB.
    with benchmark_folder(args.keep, "aiperf-scrape-") as work:
        pool = write_graph_pool(resnet50_family(POOL_SIZE), work / "pool")
        weights = work / "pool" / "weights.npz"
        weights_sha256 = write_weights_stand_in(weights)
        model = ReplicaModel(device_ops_per_s=expected_ops(pool[0], ReplicaModel(1.0)) / EPOCH_S)
        budget = args.hours * 3600.0
        start = time.time() - budget - 3600.0  # the run ended an hour ago
        for replicas in args.replicas:
            t = time.perf_counter()
            if args.source == "simulation":
                run_dir = simulate(work / f"run-{replicas}", replicas, budget, model, pool, weights, start_time=start,
                                   poll_interval_s=WEAK_SCALING_POLL_S).run_dir
            else:
                run_dir = synthetic_run(work / f"run-{replicas}", replicas, start, budget, pool[0], weights_sha256)
            trials = sum(1 for _ in (run_dir.root / "trials").iterdir())
            written = write_monitors(run_dir, start, budget, model.devices)
            print(f"{replicas} replicas ({args.source}): {trials:,} trials, {written / 2**20:,.0f} MiB of monitor logs "
                  f"written, in {time.perf_counter() - t:.0f} s")
            os.sync()  # the 8 GiB just written goes to disk now, not during the figures
            measure(run_dir.root, replicas, model, start + budget, replicas >= GOAL_REPLICAS)
            if args.keep is None:
                shutil.rmtree(run_dir.root)


if __name__ == "__main__":
    main()
