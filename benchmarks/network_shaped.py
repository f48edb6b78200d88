"""The interconnect on this machine (#48 item 5; docs/performance.md, "2026-12-07: the interconnect on
this machine"): the same LM run across the two nodes of a network-namespace cluster
(tests/netns_cluster.py, as root), its links shaped by tc to each rate given, with each backend given;
what the replica measured of the gradient all-reduce, the score and the ideal-network score
(docs/scoring.md, "The gradient all-reduce" and "What the network cost"), and the links' own byte
counters beside the analytic bytes.

    sudo .venv/bin/python benchmarks/network_shaped.py --rates 20 200 --backends torch jax [--json FILE]

The run (SHAPED_LM): seed gpt_small (0.47 M parameters: G = 1.87 MB of float32 gradients, all-reduced on
every optimiser step) over sequences of 32 bytes, 8 steps of 4 sequences, one epoch, one trial, one
device on each of 2 nodes (a ring of 2 ranks: each node sends G and receives G per step over its link).
At 20 Mbit/s a step's all-reduce takes about 0.75 s, several times what the two busy cores add to a
step's wait; at 200 Mbit/s about 0.075 s. Batches this small keep the steps' computation, whose time
the machine's load varies most, small beside the transfers. Only the network differs between the runs
of a backend.

Without root it prints one line and exits 0 (as `make bench` runs every script). Output: a table on
stdout, one BENCH line per run (the all-reduce's bytes per second over the link's rate) and per backend
(the slowest rate's ideal-network score over the fastest's), and with --json FILE a JSON list, one object per run (the schema, for the
network simulation, workflow/simulation.py, to be checked against):

    {"backend": "torch" | "jax",
     "rate_mbit": float,                  # each direction of each node's link (tc tbf)
     "nodes": int, "ranks": int,          # 2 nodes x 1 device
     "gradient_bytes_per_step": int,      # G: 4 x trainable parameters (opcount.communication.gradient_bytes)
     "steps": int,                        # optimiser steps of the run (every epoch's, summed)
     "all_reduce_bytes": int,             # analytic, per rank, summed over the epochs (epoch_end.all_reduce.bytes)
     "inter_node_bytes": int,             # of those, over the node's network link (epoch_end.all_reduce)
     "all_reduce_seconds": float | null,  # measured by the backend (torch: the steps' wait; jax: priced apart)
     "all_reduce_bytes_per_second": float | null,
     "epoch_seconds": float,              # the epochs' wall time (epoch_end.time - epoch_end.started, summed)
     "step_seconds": float,               # of which in train and eval steps (epoch_end.step_seconds, summed)
     "seconds_per_step": float,           # step_seconds / steps
     "score_ops": float,                  # the run's score (summary.json score_ops)
     "ideal_score_ops": float | null,     # the ideal-network score (communication.network.ideal_score_ops)
     "network_efficiency": float | null,  # communication.network.efficiency
     "pricing_seconds": float,            # communication outside the steps that priced their waits (jax)
     "link_sent_bytes": [int, ...],       # each node's veth counters over the run: bytes the node sent
     "link_received_bytes": [int, ...],   #   and received (heartbeats, rendezvous and all)
     "wall_seconds": float}               # `aiperf run` from start to exit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the cluster (tests/netns_cluster.py)
sys.path.insert(0, str(ROOT / "benchmarks"))  # _common, where a test imports this module

SHAPED_LM = """workload = "lm"
[policy]
initial_architecture = "gpt_small"
precision = "fp32"
seq_len = 32
epoch_tokens = 1024
val_tokens = 256
max_epochs = 1
warmup_epochs = [1]
batch_size = 4
reference_batch_size = 4
node_timeout_s = 60
"""


def run_shaped(cluster, backend: str, rate_mbit: float, folder: Path) -> dict:
    """One run of SHAPED_LM across the cluster's nodes, their links shaped to `rate_mbit`; its figures
    (the module's docstring)."""
    from aiperf_core.rundir import read_events

    folder.mkdir(parents=True, exist_ok=True)
    for node in cluster.nodes:
        cluster.shape(node, rate_mbit)
    config, hostfile, run_dir = folder / "shaped-lm.toml", folder / "hostfile", folder / "run"
    config.write_text(SHAPED_LM)
    hostfile.write_text(cluster.hostfile())
    argv = [sys.executable, "-m", "aiperf_core", "run", "--backend", backend, "--nodes-per-replica", "2",
            "--config", str(config), "--run-dir", str(run_dir), "--time-budget", "5m", "--stop-after-trials", "1",
            "--executor", "hosts", "--hostfile", str(hostfile), "--launcher", cluster.launcher_template()]
    before = [cluster.link_bytes(node) for node in cluster.nodes]
    started = time.monotonic()
    answer = subprocess.run(argv, env={**cluster.env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=600)
    wall = time.monotonic() - started
    after = [cluster.link_bytes(node) for node in cluster.nodes]
    if answer.returncode != 0:
        raise RuntimeError(f"{backend} at {rate_mbit} Mbit/s: aiperf run failed:\n{(answer.stdout + answer.stderr)[-3000:]}")
    epochs = [e for e in read_events(run_dir / "replicas/0/events.jsonl") if e["event"] == "epoch_end"]
    reduces = [e["all_reduce"] for e in epochs]
    summary = json.loads((run_dir / "summary.json").read_text())
    network = summary["communication"]["network"]
    steps = sum(r["steps"] for r in reduces)
    moved = sum(r["bytes"] for r in reduces)
    timed = [r["seconds"] for r in reduces]
    seconds = None if None in timed else sum(timed)
    step_seconds = sum(e["step_seconds"] for e in epochs)
    return {"backend": backend, "rate_mbit": float(rate_mbit), "nodes": reduces[0]["nodes"],
            "ranks": reduces[0]["ranks"],
            "gradient_bytes_per_step": _gradient_bytes(run_dir, epochs[0]["trial"]), "steps": steps,
            "all_reduce_bytes": moved, "inter_node_bytes": sum(r["inter_node_bytes"] for r in reduces),
            "all_reduce_seconds": seconds, "all_reduce_bytes_per_second": moved / seconds if seconds else None,
            "epoch_seconds": sum(e["time"] - e["started"] for e in epochs), "step_seconds": step_seconds,
            "seconds_per_step": step_seconds / steps, "score_ops": summary["score_ops"],
            "ideal_score_ops": network["ideal_score_ops"], "network_efficiency": network["efficiency"],
            "pricing_seconds": network["pricing_seconds"],
            "link_sent_bytes": [a[0] - b[0] for a, b in zip(after, before)],
            "link_received_bytes": [a[1] - b[1] for a, b in zip(after, before)], "wall_seconds": wall}


def _gradient_bytes(run_dir: Path, trial: str) -> int:
    from aiperf_core.ir import Graph
    from aiperf_opcount.communication import gradient_bytes

    return gradient_bytes(Graph.from_json((run_dir / "trials" / trial / "graph.json").read_text()))


def print_table(rows: list[dict]) -> None:
    print(f"{'backend':<7} {'Mbit/s':>7} {'G/step':>9} {'steps':>5} {'AR bytes':>10} {'AR s':>6} {'AR MB/s':>8} "
          f"{'link MB/s':>9} {'s/step':>6} {'score':>9} {'ideal':>9} {'eff':>5} {'veth sent/analytic':>20} {'wall':>5}")
    for r in rows:
        ratio = "/".join(f"{s / r['inter_node_bytes']:.3f}" for s in r["link_sent_bytes"])
        rate = r["all_reduce_bytes_per_second"]
        print(f"{r['backend']:<7} {r['rate_mbit']:>7g} {r['gradient_bytes_per_step']:>9} {r['steps']:>5} "
              f"{r['all_reduce_bytes']:>10} {r['all_reduce_seconds'] or math.nan:>6.2f} "
              f"{(rate or math.nan) / 1e6:>8.3f} {r['rate_mbit'] / 8:>9.3f} {r['seconds_per_step']:>6.3f} "
              f"{r['score_ops']:>9.3g} {r['ideal_score_ops'] or math.nan:>9.3g} "
              f"{r['network_efficiency'] or math.nan:>5.3f} {ratio:>20} {r['wall_seconds']:>5.1f}")


def report_bench(rows: list[dict]) -> None:
    """The suite's lines (benchmarks/_suite.py): no goals, the test (tests/test_network_shaped.py) has the bounds."""
    from _common import report

    for r in rows:
        if r["all_reduce_bytes_per_second"]:
            report(f"{r['backend']} all-reduce at {r['rate_mbit']:g} Mbit/s / link",
                   r["all_reduce_bytes_per_second"] / (r["rate_mbit"] * 1e6 / 8), "x")
    for backend in dict.fromkeys(r["backend"] for r in rows):
        mine = sorted((r for r in rows if r["backend"] == backend), key=lambda r: r["rate_mbit"])
        if len(mine) > 1 and mine[0]["ideal_score_ops"] and mine[-1]["ideal_score_ops"]:
            report(f"{backend} ideal score {mine[0]['rate_mbit']:g} / {mine[-1]['rate_mbit']:g} Mbit/s",
                   mine[0]["ideal_score_ops"] / mine[-1]["ideal_score_ops"], "x")


def main(argv: list[str] | None = None) -> int:
    from netns_cluster import NetnsCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[20.0, 200.0], help="link rates, Mbit/s")
    parser.add_argument("--backends", nargs="+", default=["torch", "jax"])
    parser.add_argument("--json", type=Path, help="write the runs' figures here (the module's docstring)")
    parser.add_argument("--keep", type=Path, help="keep the run directories under this folder")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("network_shaped: network namespaces need root: skipped")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="aiperf-shaped-") as temporary:
        work = args.keep or Path(temporary)
        cluster = NetnsCluster(Path(work) / "cluster").start()
        try:
            for backend in args.backends:
                for rate in args.rates:
                    rows.append(run_shaped(cluster, backend, rate, Path(work) / f"{backend}-{rate:g}"))
                    print_table(rows[-1:])
        finally:
            cluster.stop()
    print()
    print_table(rows)
    report_bench(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
