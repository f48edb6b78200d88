"""Scale simulation (issue #10, item 2): the real primary, executor protocol, shared history and
scoring with 1, 16, 256 and 4096 simulated replicas over a 12-hour virtual budget.

A simulated replica is an in-process fake whose epochs take their analytic operations divided by
a fixed device rate (a ResNet-50 ImageNet epoch in EPOCH_S seconds, about what an 8-GPU node
does), on a virtual clock; it writes the real run directory. Each trial is charged, in virtual
time, the replica-side work that grows with the run: catching up with the shared history
(measured by a real SharedHistory on the growing run directory) and NAS selection at the
history's size (measured at a few sizes, interpolated). See aiperf_core/workflow/simulation.py
and docs/performance.md.

Figures: the primary's own wall time per trial (goal <= 1 ms); the filesystem calls on the run
directory (issue #23, item 3), counted by the simulation's FsCalls wrapper of os/io/builtins in
this process, in a run of the largest replica count at the primary's 5 s poll: per replica
history refresh (goal <= 4) and for the whole run per virtual second (goal <= 1,000/s); the
history's size and the time for a replica to read it cold (goal <= 2 s); the time to score the
12-hour 4096-replica run in a fresh process (goal <= 30 s); total OPS per replica count and the
weak-scaling efficiency OPS(N) / (N * OPS(1)) (goal >= 0.95 at 4096), plotted in
docs/img/weak-scaling.svg.

    python benchmarks/scale_simulation.py [--replicas 1 16 256 4096] [--hours 12] [--keep DIR]
                                          [--parts primary metadata scaling] [--metadata-hours H]
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from _common import benchmark_folder, report  # noqa: E402
from aiperf_core.atomic import write_text_atomic  # noqa: E402
from aiperf_core.rundir import replica_cadence  # noqa: E402
from aiperf_core.search.history import SharedHistory  # noqa: E402
from aiperf_core.workflow.simulation import (FsCalls, NasCostModel, ReplicaModel, expected_ops,  # noqa: E402
                                             resnet50_family, run_dir_bytes, simulate,
                                             write_graph_pool, write_weights_stand_in)

EPOCH_S = 360.0  # a ResNet-50 ImageNet epoch, validation included, on one simulated replica (8 devices)
POOL_SIZE = 8  # distinct architectures: ResNet-50 and 7 morph descendants
WEAK_SCALING_POLL_S = 60.0  # the primary's poll interval in the weak-scaling runs (see PRIMARY_POLL_S)
PRIMARY_POLL_S = 5.0  # the SLURM executor's poll interval: the primary's per-trial figure is taken at it
PRIMARY_RUN = (256, 2 * 3600.0)  # replicas, virtual seconds of the runs that time the primary at PRIMARY_POLL_S
NAS_SIZES = (100, 1000, 10000, 50000)
NAS_ARCHITECTURES = 120  # distinct architectures in the NAS calibration's histories, as benchmarks/nas_selection.py
START_TIME = 1.8e9
SVG_PATH = HERE.parent / "docs" / "img" / "weak-scaling.svg"

SCORE_IN_FRESH_PROCESS = """
import json, sys, time
from aiperf_core.scoring import score_run
start = time.perf_counter()
result = score_run(sys.argv[1], now=float(sys.argv[2]))
print(json.dumps({"seconds": time.perf_counter() - start, "score_ops": result.score_ops,
                  "epochs": result.epochs_counted, "valid": result.valid, "reasons": result.reasons}))
"""


def score_fresh(run_root: Path, now: float) -> dict:
    """score_run in a new process: no graph counted before, as `aiperf score` after a run."""
    out = subprocess.run([sys.executable, "-c", SCORE_IN_FRESH_PROCESS, str(run_root), repr(now)], check=True,
                         capture_output=True, text=True, cwd=HERE.parent,
                         env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def weak_scaling_svg(points: list[tuple[int, float]]) -> str:
    """Total OPS against replicas, log-log, with the ideal line N * OPS(1); self-contained SVG."""
    width, height, left, right, top, bottom = 640, 400, 90, 30, 40, 60
    xs = [n for n, _ in points]
    ys = [ops for _, ops in points]
    ideal = [(n, points[0][1] * n / points[0][0]) for n in xs]
    x_lo, x_hi = math.log10(min(xs)), math.log10(max(xs))
    y_lo = math.floor(math.log10(min(ys + [o for _, o in ideal])))
    y_hi = math.ceil(math.log10(max(ys + [o for _, o in ideal])))
    x_hi = max(x_hi, x_lo + 1)

    def px(n):
        return left + (math.log10(n) - x_lo) / (x_hi - x_lo) * (width - left - right)

    def py(v):
        return top + (y_hi - math.log10(v)) / (y_hi - y_lo) * (height - top - bottom)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
             f'height="{height}" font-family="sans-serif" font-size="12">',
             '<title>Weak scaling of the scale simulation: total OPS against replicas</title>',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="24" font-size="14">Weak scaling, 12 h virtual budget: total OPS vs replicas '
             '(log-log)</text>']
    for e in range(y_lo, y_hi + 1):
        y = py(10 ** e)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">1e{e}</text>')
    for n in xs:
        x = px(n)
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" stroke="#eee"/>'
                     f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">{n}</text>')
    parts.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
                 'fill="none" stroke="#333"/>')
    parts.append(f'<text x="{(left + width - right) / 2}" y="{height - 18}" text-anchor="middle">replicas '
                 '(8 simulated accelerators each)</text>')
    parts.append(f'<text transform="translate(20 {(top + height - bottom) / 2}) rotate(-90)" '
                 'text-anchor="middle">total OPS (score)</text>')
    ideal_line = " ".join(f"{px(n):.1f},{py(v):.1f}" for n, v in ideal)
    parts.append(f'<polyline points="{ideal_line}" fill="none" stroke="#999" stroke-dasharray="5,4" '
                 'stroke-width="1.5"/>')
    measured = " ".join(f"{px(n):.1f},{py(v):.1f}" for n, v in points)
    parts.append(f'<polyline points="{measured}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for k, (n, v) in enumerate(points):
        efficiency = v / (n * points[0][1] / points[0][0])
        last = k == len(points) - 1  # its label goes left of the point, inside the frame
        parts.append(f'<circle cx="{px(n):.1f}" cy="{py(v):.1f}" r="4" fill="#1f77b4">'
                     f'<title>{n} replicas: {v:.4g} OPS, efficiency {efficiency:.4f}</title></circle>'
                     f'<text x="{px(n) + (-8 if last else 8):.1f}" y="{py(v) + 16:.1f}" fill="#1f77b4" '
                     f'text-anchor="{"end" if last else "start"}">{efficiency:.4f}</text>')
    parts.append(f'<line x1="{left + 12}" x2="{left + 36}" y1="{top + 16}" y2="{top + 16}" stroke="#1f77b4" '
                 f'stroke-width="2"/><text x="{left + 42}" y="{top + 20}">measured (label: efficiency)</text>'
                 f'<line x1="{left + 12}" x2="{left + 36}" y1="{top + 34}" y2="{top + 34}" stroke="#999" '
                 f'stroke-dasharray="5,4"/><text x="{left + 42}" y="{top + 38}">ideal: N x OPS(1)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def report_fs_calls(result, hours: float) -> None:
    """The metadata figures of issue #23 item 3 from a run with count_fs_calls. Simulated replicas
    do not read the history; the probe refreshes like one replica once per virtual hour, so every
    replica's refreshes are counted as trials started x the probe's calls per refresh (a replica
    refreshes once before each trial)."""
    calls, replicas = result.fs_calls, result.replicas
    seconds = result.time_budget_s
    later = result.probe_calls[1:] or result.probe_calls  # the first refresh, at the start, finds nothing
    per_refresh = sum(later) / len(later)
    report(f"{replicas} replicas: filesystem calls per replica history refresh (mean)", per_refresh, "calls",
           goal=4.0)
    report(f"{replicas} replicas: filesystem calls per replica history refresh (max)", max(later), "calls")
    history_calls = result.trials_started * per_refresh
    # Simulated replicas beat once a virtual minute and hold no lease; real ones beat and renew at
    # rundir.replica_cadence's pace, whose calls are added here at their full rate (the simulated
    # beats stay counted in the replicas' writes too: the sum errs high).
    cadence = replica_cadence(replicas)
    beats = replicas * cadence.calls_per_s * seconds
    print(f"  real replicas at {replicas}: heartbeat every {cadence.heartbeat_s:.1f} s, lease renewed every "
          f"{cadence.lease_renew_s:.1f} s (stale after {cadence.lease_stale_s:.0f} s)")
    parts = {"primary": calls.total("primary"), "replicas' writes and checks": calls.total("replicas"),
             "replicas' history refreshes": history_calls,
             "real replicas' heartbeats and lease renewals (rundir.replica_cadence)": beats}
    for name, count in parts.items():
        report(f"{replicas} replicas, poll {PRIMARY_POLL_S:g} s: {name}, per second", count / seconds, "calls/s")
    changes = calls.total(kinds=("change",)) - calls.total("history probe", kinds=("change",))
    report(f"{replicas} replicas, poll {PRIMARY_POLL_S:g} s: mkdir/rename/link/unlink per second",
           changes / seconds, "calls/s")
    report(f"{replicas} replicas, poll {PRIMARY_POLL_S:g} s, {hours:g} h: open/stat/list on the run "
           "directory per second", sum(parts.values()) / seconds, "calls/s", goal=1000.0)
    for who, row in sorted(calls.counts.items()):
        print(f"  {who}: " + ", ".join(f"{kind} {row.get(kind, 0):,}" for kind in FsCalls.KINDS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 16, 256, 4096])
    parser.add_argument("--hours", type=float, default=12.0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories under this folder")
    parser.add_argument("--svg", type=Path, default=SVG_PATH)
    parser.add_argument("--parts", nargs="+", choices=("primary", "metadata", "scaling"),
                        default=["primary", "metadata", "scaling"])
    parser.add_argument("--metadata-hours", type=float, default=None,
                        help="virtual hours of the counted run (default: --hours)")
    args = parser.parse_args()
    shm = Path("/dev/shm")
    with benchmark_folder(args.keep, "aiperf-scale-", shm if shm.is_dir() else None) as work:
        t = time.perf_counter()
        pool = write_graph_pool(resnet50_family(POOL_SIZE), work / "pool")
        weights = work / "pool" / "weights.npz"
        write_weights_stand_in(weights)
        model = ReplicaModel(device_ops_per_s=expected_ops(pool[0], ReplicaModel(1.0)) / EPOCH_S)
        nas_cost = NasCostModel.measure(resnet50_family(NAS_ARCHITECTURES, seed=1), NAS_SIZES)
        print(f"graph pool and NAS calibration in {time.perf_counter() - t:.1f} s; NAS selection: "
              + ", ".join(f"{n:,} trials {s:.3f} s" for n, s in zip(nas_cost.sizes, nas_cost.seconds)))
        budget = args.hours * 3600.0
        deadline = START_TIME + budget

        # The primary at the SLURM poll interval.
        if "primary" in args.parts:
            replicas, seconds = PRIMARY_RUN
            result = simulate(work / "primary", replicas, seconds, model, pool, weights,
                              start_time=START_TIME, poll_interval_s=PRIMARY_POLL_S)
            print(f"primary: {result.trials_started} trials, primary {result.primary_s:.1f} s of "
                  f"{result.wall_s:.1f} s wall")
            report(f"primary per trial, {replicas} replicas, poll {PRIMARY_POLL_S:g} s",
                   result.primary_s_per_trial * 1e3, "ms", goal=1.0)
            if args.keep is None:
                shutil.rmtree(result.run_dir.root)

        # The filesystem calls of the largest run at the SLURM poll interval (issue #23, item 3).
        if "metadata" in args.parts:
            replicas, hours = max(args.replicas), args.metadata_hours or args.hours
            t = time.perf_counter()
            result = simulate(work / "metadata", replicas, hours * 3600.0, model, pool, weights,
                              start_time=START_TIME, poll_interval_s=PRIMARY_POLL_S, nas_cost=nas_cost,
                              probe_interval_s=3600.0, count_fs_calls=True)
            print(f"counted run: {replicas} replicas, {hours:g} h, {result.trials_started:,} trials in "
                  f"{time.perf_counter() - t:.0f} s (primary {result.primary_s:.1f} s, counting included); "
                  f"load {os.getloadavg()[0]:.2f}")
            report_fs_calls(result, hours)
            if args.keep is None:
                shutil.rmtree(result.run_dir.root)

        # Weak scaling.
        points = []
        for replicas in (args.replicas if "scaling" in args.parts else []):
            t = time.perf_counter()
            result = simulate(work / f"run-{replicas}", replicas, budget, model, pool, weights, start_time=START_TIME,
                              poll_interval_s=WEAK_SCALING_POLL_S, nas_cost=nas_cost, probe_interval_s=3600.0)
            scored = score_fresh(result.run_dir.root, deadline)
            points.append((replicas, scored["score_ops"]))
            later_trials = max(result.trials_started - replicas, 1)  # round 1 is charged nothing
            print(f"{replicas} replicas: {result.trials_started:,} trials in {time.perf_counter() - t:.0f} s "
                  f"(primary {result.primary_s:.1f} s); scored {scored['epochs']:,} epochs in "
                  f"{scored['seconds']:.1f} s, {'official' if scored['valid'] else scored['reasons']}; "
                  f"charged {result.charged_s / later_trials:.3f} s per trial for history and NAS")
            report(f"{replicas} replicas: total OPS", scored["score_ops"], "OPS", lower_is_better=False)
            report(f"{replicas} replicas: primary per trial, poll {WEAK_SCALING_POLL_S:g} s",
                   result.primary_s_per_trial * 1e3, "ms")
            # The score moves only when a delay pushes an epoch past the deadline; this is the
            # replicas' time lost to the charged history reads and NAS, without that rounding.
            report(f"{replicas} replicas: time charged to history + NAS / budget",
                   result.charged_s / (replicas * budget), "fraction")
            if replicas == max(args.replicas):
                report(f"score {args.hours:g}-h {replicas}-replica logs, fresh process", scored["seconds"], "s",
                       goal=30.0)
                history = SharedHistory(result.run_dir, replica=0)  # replica 0 restarted at the end
                with FsCalls(result.run_dir.root) as calls:
                    t = time.perf_counter()
                    history.refresh()
                    cold = time.perf_counter() - t
                report(f"history at {args.hours:g} h, {replicas} replicas: trials", len(history.records), "trials")
                report(f"history at {args.hours:g} h, {replicas} replicas: size", run_dir_bytes(result.run_dir) / 2**20,
                       "MiB")
                report(f"history at {args.hours:g} h, {replicas} replicas: cold read by a replica", cold, "s",
                       goal=2.0)
                report(f"history at {args.hours:g} h, {replicas} replicas: cold read, filesystem calls",
                       calls.total(), "calls")
                if result.probe_refreshes:
                    report(f"history at {args.hours:g} h, {replicas} replicas: catch-up read per trial",
                           result.probe_refreshes[-1][2], "s")
                report(f"nas selection at {len(history.records):,} trials (interpolated)",
                       nas_cost(len(history.records)), "s", goal=None)
                report(f"{replicas} replicas: history + NAS charged per trial", result.charged_s / later_trials, "s")
            if args.keep is None:
                shutil.rmtree(result.run_dir.root)
        if points:
            one = points[0][1] / points[0][0]
            for replicas, ops in points[1:]:
                efficiency = ops / (replicas * one)
                goal = 0.95 if replicas == max(args.replicas) else None
                report(f"weak-scaling efficiency at {replicas} replicas", efficiency, "fraction", goal=goal,
                       lower_is_better=False)
            args.svg.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.svg, weak_scaling_svg(points))
            print(f"wrote {args.svg}")


if __name__ == "__main__":
    main()
