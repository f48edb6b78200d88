"""Speed of scoring a big run (issue: score, rules, report, monitoring).

Writes a synthetic run directory shaped like a 12-hour run on 4096 replicas (about 20 trials of
6 epochs each per replica, hash-chained logs, ResNet-50-family graphs shared between trials through
hard links), then times `score_run` from a cold start and the live display's `snapshot` before and
after the logs grow. Graph files and their hashes are real, so the op counts are real; only the
clock and the training outcomes are made up.

    python benchmarks/score_speed.py [--replicas N] [--trials N] [--graphs N] [--keep DIR]

--graphs sets how many distinct graphs the trials share (default 16). A run of all-distinct morphs
pays loading and counting each graph once (in parallel over AIPERF_SCORE_WORKERS processes).
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import report  # noqa: E402
from aiperf_core.builders import resnet50  # noqa: E402
from aiperf_core.policy import Policy  # noqa: E402
from aiperf_core.rundir import GENESIS, RunDir, trial_id  # noqa: E402

HOURS = 12
EPOCHS_PER_TRIAL = 6


class ChainWriter:
    """Writes a hash-chained log as EventLog does, without an fsync per line (this is a fixture)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "wb")
        self.seq, self.prev = 0, GENESIS

    def append(self, event: str, **fields) -> None:
        record = {"event": event, **fields, "seq": self.seq, "prev": self.prev}
        line = json.dumps(record, sort_keys=True).encode()
        self.file.write(line + b"\n")
        self.seq += 1
        self.prev = hashlib.sha256(line).hexdigest()

    def close(self) -> None:
        self.file.close()


def write_run(root: Path, replicas: int, trials: int, distinct_graphs: int) -> int:
    """The synthetic run; returns the number of event lines written."""
    run = RunDir(root)
    start, budget = 1.7e9, HOURS * 3600.0
    run.write_run({"run_id": "bench", "start_time": start, "time_budget_s": budget, "deadline": start + budget,
                   "backend": "tensorflow", "executor": "slurm", "replicas": replicas, "devices_per_replica": 8,
                   "seed": 0, "model": "resnet50", "dataset": {"name": "imagenet"},
                   "policy": Policy().to_json(), "policy_overridden_fixed": []})
    shared = root / "graphs"
    shared.mkdir()
    graphs = []
    for g in range(distinct_graphs):
        path = shared / f"g{g}.json"
        path.write_text(resnet50(classes=1000 + g).to_json())
        graphs.append((path, hashlib.sha256(path.read_bytes()).hexdigest()))
    rng = random.Random(0)
    lines = 0
    trial_s = budget / trials
    epoch_s = trial_s / EPOCHS_PER_TRIAL
    for r in range(replicas):
        log = ChainWriter(run.replica_log(r))
        t = start + rng.uniform(0, 60)
        log.append("replica_start", time=t, replica=r, pid=1000 + r, host=f"node{r // 8:04d}", backend="tensorflow",
                   framework_version="2.16.1", devices=8, attempt=1)
        for s in range(trials):
            tid = trial_id(r, s)
            graph_path, sha = graphs[rng.randrange(distinct_graphs)]
            folder = run.trial_dir(tid)
            folder.mkdir(parents=True)
            os.link(graph_path, folder / "graph.json")
            hyper = {"batch_size": 448, "kernel_size": 3, "epochs": EPOCHS_PER_TRIAL, "learning_rate": 0.1,
                     "patience": 3, "label_smoothing": 0.0, "precision": "fp16"}
            log.append("trial_start", time=t, replica=r, trial=tid, round=s + 1, parent=None, morph=None,
                       hyper=hyper, graph_sha256=sha)
            accuracy = 0.3
            for e in range(EPOCHS_PER_TRIAL):
                started, t = t, t + epoch_s * rng.uniform(0.9, 1.1)
                accuracy = min(accuracy + rng.uniform(0, 0.08), 0.78)
                log.append("epoch_end", time=t, replica=r, trial=tid, epoch=e, started=started,
                           train_images=1281167, val_images=50000, loss=2.0 - accuracy, val_loss=2.1 - accuracy,
                           val_accuracy=round(accuracy, 5))
            log.append("trial_end", time=t, replica=r, trial=tid, status="ok", reason=None,
                       epochs=EPOCHS_PER_TRIAL, best_val_accuracy=round(accuracy, 5), predicted_accuracy=None,
                       files={})
            lines += EPOCHS_PER_TRIAL + 2
        log.close()
    primary = ChainWriter(run.primary_log)
    primary.append("run_start", time=start, resume=False)
    primary.close()
    return lines + replicas + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=20, help="trials per replica")
    parser.add_argument("--graphs", type=int, default=16, help="distinct graphs shared by the trials")
    parser.add_argument("--keep", type=Path, default=None, help="write the run here and keep it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="aiperf-score-bench-")) / "run"
    try:
        t = time.perf_counter()
        lines = write_run(root, args.replicas, args.trials, args.graphs)
        print(f"wrote {lines:,} event lines for {args.replicas} replicas x {args.trials} trials, "
              f"{args.graphs} distinct graphs "
              f"in {time.perf_counter() - t:.1f} s ({root})")

        from aiperf_core.scoring import score_run, snapshot

        t = time.perf_counter()
        result = score_run(root)
        seconds = time.perf_counter() - t
        print(f"score {result.to_dict()['score']}, {result.epochs_counted:,} epochs counted")
        report(f"score: {args.replicas} replicas x {args.trials} trials, {args.graphs} graphs, 12 h", seconds, "s",
               goal=30)

        now = result.end_time
        t = time.perf_counter()
        snapshot(root, now=now)
        report("live snapshot: first call (reads every log)", time.perf_counter() - t, "s")
        t = time.perf_counter()
        snapshot(root, now=now)
        report("live snapshot: next call, nothing new", (time.perf_counter() - t) * 1e3, "ms", goal=1000)
    finally:
        if args.keep is None:
            shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
