"""A scale simulation that knows the network (issue #48 item 6; docs/performance.md, "2026-12-07: a
simulation that knows the network"): the official LM seed with experts, its replicas of 1 or 2 nodes on
three interconnects, at 64, 512 and 4,096 nodes.

The workload: GPT-2 small's shape (gpt2_small: 12 blocks of 768, 12 heads, 1,024 bytes a sequence) with
every MLP upcycled to EXPERTS experts, TOP_K chosen per token (the most the lm policy allows,
max_experts, so that the experts shard over both nodes' 16 devices), trained expert-parallel at the
official sizes: batches of 32 sequences, epochs of 1,048,576 tokens, 131,072 validation tokens. Its
operations, gradient bytes and all-to-all payload come from the IR (aiperf_opcount,
opcount.communication).

The machine: nodes of 8 H100s, each at DEVICE_OPS_PER_S in the paper's count (0.45, the LM step's MFU
goal in docs/backends/gpu.md, of the 748 TOPS bf16 GEMM peak measured on the project's H100), NVLink
inside a node (network.model.NVLINK_*), and the network of each column (network.model.Network).

Parts:
- `figures`: the score per node, ops of an epoch over the replica's epoch time (ReplicaModel.epoch_time:
  compute, exposed all-reduce, all-to-all) over its nodes, for every cell of the table. Replicas never
  wait on each other, so this is the score per node of the primary-driven simulation up to the epochs
  cut by the deadline; `full` checks that.
- `full`: the real primary over simulated replicas (workflow.simulation.simulate) at 64 nodes for
  FULL_BUDGET_S virtual seconds, per interconnect and replica size; its score per node (score_run's)
  against the figure's.
- `probe` (as root): `aiperf probe network` (torch, 2 nodes of one rank, up to PROBE_MAX_BYTES) across the
  two nodes of a network-namespace cluster (tests/netns_cluster.py), both links shaped by tbf to each of
  --rates; each record is written to --probes DIR as probe-<rate>mbit.json.
- `validate`: the model against the emulated 2-node runs of benchmarks/network_shaped.py (its --json
  output, --shaped FILE). The model's network for a run is Network.from_probe of the probe at the run's
  rate where --probes DIR holds one (calibrated), and Network.link(rate) with --latency otherwise (the
  link's nominal rate). Per run: the all-reduce seconds the model gives a ring of 2 ranks, against the
  backend's measured seconds; and the score of each run predicted from the other rate's run of the same
  backend (its time outside the all-reduce, plus the model's all-reduce at this rate), against the
  measured score.

    python benchmarks/network_simulation.py [--parts figures full probe validate] [--shaped runs.json]
                                            [--probes DIR] [--rates 20 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import benchmark_folder, report  # noqa: E402
from aiperf_core.network.model import Network  # noqa: E402
from aiperf_core.workflow.simulation import ReplicaModel, write_graph_pool, write_weights_stand_in  # noqa: E402

EXPERTS, TOP_K = 16, 2
SEQ_LEN, BATCH, EPOCH_TOKENS, VAL_TOKENS = 1024, 32, 1_048_576, 131_072
DEVICES_PER_NODE = 8
H100_BF16_GEMM_PEAK = 748e12  # docs/backends/gpu.md, section 7 (the second GPU run)
LM_MFU = 0.45  # the LM step's goal on a GPU (docs/backends/gpu.md)
DEVICE_OPS_PER_S = LM_MFU * H100_BF16_GEMM_PEAK
MACHINES = (64, 512, 4096)  # nodes
REPLICA_NODES = (1, 2)
PROBE_MAX_BYTES = 4 << 20  # 1.7 s an all-reduce at 20 Mbit/s: the fit's bandwidth is set by the large sizes
FULL_MACHINE, FULL_BUDGET_S = 64, 300.0
POLL_S = 5.0
INTERCONNECTS = {
    "400 Gb/s, non-blocking": Network.link(400, name="400 Gb/s"),
    "100 Gb/s, non-blocking": Network.link(100, name="100 Gb/s"),
    "100 Gb/s, 4:1, packed": Network.link(100, oversubscription=4, name="100 Gb/s 4:1 packed"),
    "100 Gb/s, 4:1, scattered": Network.link(100, oversubscription=4, placement="scattered",
                                             name="100 Gb/s 4:1 scattered"),
}


def official_moe_seed():
    """gpt2_small with every MLP upcycled to EXPERTS experts, TOP_K per token."""
    from aiperf_core.morph.transformer import upcycle_moe
    from aiperf_core.workloads.lm import OFFICIAL_SEED, seed_graph

    graph = seed_graph(OFFICIAL_SEED, SEQ_LEN, 256)
    for block in range(12):
        graph = upcycle_moe(graph, None, f"h{block}_fc1", experts=EXPERTS, top_k=TOP_K, seed=block).graph
    return graph


def replica_model(nodes: int, network: Network | None, expert_parallel: bool = True) -> ReplicaModel:
    # Expert parallelism over every device of the replica needs the devices to divide the experts.
    assert not expert_parallel or EXPERTS % (nodes * DEVICES_PER_NODE) == 0, "the experts do not shard"
    return ReplicaModel(device_ops_per_s=DEVICE_OPS_PER_S * DEVICES_PER_NODE, devices=DEVICES_PER_NODE,
                        train_images=EPOCH_TOKENS // SEQ_LEN, val_images=VAL_TOKENS // SEQ_LEN, batch_size=BATCH,
                        nodes=nodes, network=network, expert_parallel=expert_parallel)


def score_per_node(graph, model: ReplicaModel, machine: int) -> tuple[float, object]:
    epoch = model.epoch_time(graph, machine)
    return graph.epoch_ops(model.train_images, model.val_images) / epoch.seconds / model.nodes, epoch


def figures(graph, dense) -> dict:
    print(f"device: {DEVICE_OPS_PER_S:.4g} ops/s ({LM_MFU} x {H100_BF16_GEMM_PEAK:.3g}), {DEVICES_PER_NODE} a node; "
          f"graph: {graph.fp + graph.bp:.4g} ops a sequence (FP + BP), gradients all-reduced "
          f"{(graph.gradient_bytes - graph.expert_gradient_bytes) / 1e6:.1f} MB a step (experts out), all-to-all "
          f"{graph.all_to_all_train_bytes * BATCH / 1e9:.2f} GB a step, {graph.moe_nodes} moe nodes")
    table = {}
    for replica_nodes in REPLICA_NODES:
        ideal, _ = score_per_node(graph, replica_model(replica_nodes, None), MACHINES[0])
        print(f"\nreplicas of {replica_nodes} node(s): free network {ideal:.4g} ops/s per node")
        for name, network in INTERCONNECTS.items():
            for machine in MACHINES:
                model = replica_model(replica_nodes, network)
                rate, epoch = score_per_node(graph, model, machine)
                table[(replica_nodes, name, machine)] = rate
                print(f"  {name:<26} {machine:>5} nodes: {rate:.4g} ops/s per node ({rate / ideal:.3f} of a free "
                      f"network); an epoch {epoch.seconds:.3f} s = compute {epoch.compute_s:.3f} + all-reduce "
                      f"{epoch.all_reduce_s:.3f} + all-to-all {epoch.all_to_all_s:.3f}")
                report(f"score per node, {replica_nodes}-node replicas, {name}, {machine} nodes", rate / 1e12,
                       "Tera-OPS", lower_is_better=False)
    print("\n| replica | nodes | " + " | ".join(INTERCONNECTS) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in INTERCONNECTS) + " |")
    for replica_nodes in REPLICA_NODES:
        for machine in MACHINES:
            cells = " | ".join(f"{table[(replica_nodes, name, machine)] / 1e12:.0f}" for name in INTERCONNECTS)
            print(f"| {replica_nodes} | {machine:,} | {cells} |")
    # For comparison: the seed without experts (gpt2_small, every gradient all-reduced, no all-to-all).
    print(f"\nthe dense seed (gradients {dense.gradient_bytes / 1e6:.1f} MB a step), per node, Tera-OPS:")
    for replica_nodes in REPLICA_NODES:
        cells = []
        for name, network in INTERCONNECTS.items():
            rate, epoch = score_per_node(dense, replica_model(replica_nodes, network, False), MACHINES[-1])
            cells.append(f"{name} {rate / 1e12:.0f} (all-reduce {epoch.all_reduce_s / epoch.seconds:.0%})")
        print(f"  {replica_nodes}-node replicas at {MACHINES[-1]} nodes: " + "; ".join(cells))
    return table


def full(graph, work: Path, weights: Path, table: dict) -> None:
    from aiperf_core.scoring import score_run
    from aiperf_core.workflow.simulation import simulate

    for replica_nodes in REPLICA_NODES:
        for name, network in INTERCONNECTS.items():
            model = replica_model(replica_nodes, network)
            replicas = FULL_MACHINE // replica_nodes
            started = time.perf_counter()
            result = simulate(work / "full", replicas, FULL_BUDGET_S, model, [graph], weights, start_time=1.8e9,
                              poll_interval_s=POLL_S)
            scored = score_run(result.run_dir, now=1.8e9 + FULL_BUDGET_S)
            per_node = scored.score_ops / FULL_MACHINE
            expected = table[(replica_nodes, name, FULL_MACHINE)]
            print(f"{replica_nodes}-node replicas, {name}: {replicas} replicas, {result.trials_started} trials, "
                  f"{scored.epochs_counted} epochs in {time.perf_counter() - started:.1f} s (primary "
                  f"{result.primary_s:.1f} s): {per_node:.4g} ops/s per node, {per_node / expected:.4f} of the figure")
            report(f"full simulation / figure, {replica_nodes}-node replicas, {name}, {FULL_MACHINE} nodes",
                   per_node / expected, "ratio", lower_is_better=False)
            shutil.rmtree(result.run_dir.root)


def shaped_run_ops() -> int:
    """The operations of one run of benchmarks/network_shaped.py (its SHAPED_LM: one epoch of one trial of
    its seed), from the IR: the same in every run, whatever the rate."""
    import tomllib

    from aiperf_core.workloads.lm import seed_graph
    from aiperf_opcount import count
    from network_shaped import SHAPED_LM

    policy = tomllib.loads(SHAPED_LM)["policy"]
    seq_len = policy["seq_len"]
    totals = count(seed_graph(policy["initial_architecture"], seq_len, 256))
    return (policy["epoch_tokens"] // seq_len * (totals.fp + totals.bp) + policy["val_tokens"] // seq_len * totals.fp
            ) * policy["max_epochs"]


def run_probes(rates: list[float], folder: Path) -> None:
    """The module's docstring, part `probe`."""
    import subprocess

    sys.path.insert(0, str(HERE.parent / "tests"))
    from netns_cluster import NetnsCluster

    folder.mkdir(parents=True, exist_ok=True)
    with benchmark_folder(None, "aiperf-netsim-probe-") as work:
        cluster = NetnsCluster(work / "cluster").start()
        try:
            for rate in rates:
                out = folder / f"probe-{rate:g}mbit.json"
                out.unlink(missing_ok=True)
                for node in cluster.nodes:
                    cluster.shape(node, rate)
                coordinator = f"{cluster.address(cluster.nodes[0])}:29517"
                started = time.perf_counter()
                processes = [cluster.run_on(node, [
                    sys.executable, "-m", "aiperf_core", "probe", "network", "--backend", "torch", "--nodes", "2",
                    "--node-rank", str(rank), "--coordinator", coordinator, "--max-bytes", str(PROBE_MAX_BYTES),
                    "--seconds-per-size", "2", "--timeout", "60", "--out", str(out)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    for rank, node in enumerate(cluster.nodes)]
                outputs = [process.communicate(timeout=600)[0] for process in processes]
                if any(process.returncode for process in processes):
                    raise RuntimeError(f"probe at {rate:g} Mbit/s failed:\n" + "\n".join(outputs))
                print(outputs[0])
                print(f"probe at {rate:g} Mbit/s in {time.perf_counter() - started:.0f} s: {out}")
        finally:
            cluster.stop()


def validate(path: Path, latency_s: float, probes: Path | None = None) -> None:
    """The module's docstring, part `validate`. A run's score is its operations over its time T (from the
    run's start), so T = ops / score; the prediction for a run at rate A from the run at rate B of the same
    backend is T_A = T_B - model(B) + model(A), score_A = ops / T_A."""
    runs = json.loads(path.read_text())
    ops = shaped_run_ops()
    by_backend: dict[str, list[dict]] = {}
    for run in runs:
        by_backend.setdefault(run["backend"], []).append(run)

    def network_for(run: dict) -> Network:
        probe = None if probes is None else probes / f"probe-{run['rate_mbit']:g}mbit.json"
        if probe is not None and probe.exists():
            return Network.from_probe(probe)
        return Network.link(run["rate_mbit"] / 1e3, latency_s=latency_s, name="nominal")

    def modelled_all_reduce(run: dict) -> float:
        network = network_for(run)
        per_node = run["ranks"] // run["nodes"]
        return run["steps"] * network.all_reduce_seconds(run["gradient_bytes_per_step"], run["nodes"], per_node)

    print(f"operations of a run: {ops:,}")
    for rate in sorted({run["rate_mbit"] for run in runs}):
        print(f"  at {rate:g} Mbit/s: {network_for({'rate_mbit': rate}).describe()}")
    print(f"{'backend':<7} {'Mbit/s':>7} {'AR s measured':>13} {'AR s model':>10} {'error':>7} {'T s':>6} "
          f"{'score measured':>14} {'score predicted':>15} {'error':>7}")
    for backend, rows in sorted(by_backend.items()):
        for run in rows:
            model_ar, measured_ar = modelled_all_reduce(run), run["all_reduce_seconds"]
            ar_error = model_ar / measured_ar - 1 if measured_ar else None
            others = [o for o in rows if o["rate_mbit"] != run["rate_mbit"]]
            predicted = score_error = None
            if others:
                other = others[0]
                predicted = ops / (ops / other["score_ops"] - modelled_all_reduce(other) + model_ar)
                score_error = predicted / run["score_ops"] - 1
            print(f"{backend:<7} {run['rate_mbit']:>7g} {measured_ar or float('nan'):>13.3f} {model_ar:>10.3f} "
                  f"{_percent(ar_error):>7} {ops / run['score_ops']:>6.2f} {run['score_ops']:>14.4g} "
                  f"{predicted or float('nan'):>15.4g} {_percent(score_error):>7}"
                  + (f"  (from the {others[0]['rate_mbit']:g} Mbit/s run)" if others else ""))
            if ar_error is not None:
                report(f"model / measured all-reduce seconds - 1, {backend}, {run['rate_mbit']:g} Mbit/s", ar_error,
                       "fraction")
            if score_error is not None:
                report(f"predicted / measured score - 1, {backend}, {run['rate_mbit']:g} Mbit/s", score_error,
                       "fraction")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=("figures", "full", "probe", "validate"),
                        default=["figures", "full"])
    parser.add_argument("--shaped", type=Path, help="benchmarks/network_shaped.py --json output, for `validate`")
    parser.add_argument("--probes", type=Path,
                        help="the folder of the probes' records (`probe` writes, `validate` reads)")
    parser.add_argument("--rates", type=float, nargs="+", default=[20.0, 200.0], help="the probes' link rates, Mbit/s")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="alpha of one ring step on a link no probe measured, seconds (validate; default 0)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories under this folder")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    with benchmark_folder(args.keep, "aiperf-netsim-", shm if shm.is_dir() else None) as work:
        from aiperf_core.workloads.lm import OFFICIAL_SEED, seed_graph

        graph, dense = write_graph_pool([official_moe_seed(), seed_graph(OFFICIAL_SEED, SEQ_LEN, 256)], work / "pool")
        weights = work / "pool" / "weights.npz"
        write_weights_stand_in(weights)
        table = figures(graph, dense) if {"figures", "full"} & set(args.parts) else {}
        if "full" in args.parts:
            full(graph, work, weights, table)
        if "probe" in args.parts:
            if args.probes is None:
                parser.error("probe needs --probes DIR")
            run_probes(args.rates, args.probes)
        if "validate" in args.parts:
            if args.shaped is None:
                parser.error("validate needs --shaped FILE (benchmarks/network_shaped.py --json)")
            validate(args.shaped, args.latency, args.probes)


if __name__ == "__main__":
    main()
