"""A mixture-of-experts GPT's training step against the dense GPT of the same active parameters, per backend
(issue 40, item 5).

The MoE GPT is `builders.gpt` with every MLP upcycled (morph.transformer.upcycle_moe) to 8 experts of the
MLP's width F, 2 chosen per token; the dense GPT has MLPs of width 2F, so a token meets the same
expert-side products in both (the MoE adds its router, D x 8 per token). A backend that routes does
about the dense work; one that runs every expert on every token does 4 times the MLP's. Each backend's
own training loop (Backend.train, SGD with momentum, fp32) runs two epochs of the same token batches;
the second epoch's step seconds (EpochReport.step_seconds, so compilation is left out) give the time a
step, and the figure is dense time / MoE time, the MoE's speed as a fraction of the dense one's.

Sizes: 2 blocks of width 256, 4 heads, 128 tokens, vocabulary 256, batch 8, 4 steps an epoch, fp32;
--hidden, --layers, --seq-len, --batch and --precision set others (benchmarks/gpu_throughput.py's `moe`
part runs GPT-2 small's width at 1,024 tokens at the GPU's fastest precision). --backends=torch,jax picks
backends (default: every installed first-party one); --smoke runs toy sizes.
Goal: >= 0.8 for torch and jax on a CPU.

--parts=speed,expert_parallel (default both). The `expert_parallel` part, for each backend that declares
expert parallelism, trains the same MoE GPT in a child process that sees two devices (AIPERF_CPU_DEVICES=2
on a CPU): on one device, then on two with TrainConfig.expert_parallel (each device holds 4 of the 8
experts of every layer, tokens exchanged by all-to-all), the same global batch. It prints the step time on
2 devices over that on 1 (on a 2-core CPU the two ranks share the cores, so no speed-up is expected: the
figure shows what the exchanges cost), the all-to-all seconds of the second epoch and their share of its
step time, and the all-to-all bandwidth: the epoch's analytic bytes (opcount.communication) over the
seconds the backend measured. Reported, no goal.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import report  # noqa: E402

BACKENDS = ("torch", "jax", "tensorflow", "mindspore")
GOAL = {"torch": 0.8, "jax": 0.8}  # the goal on a CPU; the others are reported
EXPERTS, TOP_K = 8, 2


def graphs(hidden: int, layers: int, seq_len: int):
    """(the dense GPT with MLPs of 2F, the GPT with every MLP of F upcycled to EXPERTS experts, TOP_K each)."""
    from aiperf_core.builders import gpt
    from aiperf_core.morph.transformer import upcycle_moe

    sizes = dict(layers=layers, hidden=hidden, heads=4, seq_len=seq_len, vocab=256)
    moe = gpt(**sizes)
    for i in range(layers):
        moe = upcycle_moe(moe, None, f"h{i}_fc1", experts=EXPERTS, top_k=TOP_K, seed=i).graph
    return gpt(**sizes, ffn=2 * 4 * hidden), moe


def step_seconds(backend, graph, batch: int, steps: int, precision: str = "fp32") -> float:
    """Seconds a training step of `graph` takes in the backend's own loop: its second epoch's step time."""
    import numpy as np

    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.weights import init_weights

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, graph.vocab, (batch * steps, graph.input_shape[0] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    model = backend.lower(graph, init_weights(graph, seed=0))
    config = TrainConfig(epochs=2, batch_size=batch, schedule=Schedule(initial=0.01), seed=0, precision=precision)
    reports = backend.train(model, Dataset(x, y, x[:batch], y[:batch], graph.vocab), config)
    if reports[-1].step_seconds is None:
        raise SystemExit(f"{backend.name} does not measure its step seconds (EpochReport.step_seconds)")
    return reports[-1].step_seconds / steps


def expert_parallel_child(name: str, hidden: int, layers: int, seq_len: int, batch: int, steps: int,
                          precision: str) -> dict:
    """In a process that sees two devices: the MoE GPT's step on 1 device and expert-parallel on 2."""
    import numpy as np

    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.registry import load_backend
    from aiperf_core.weights import init_weights
    from aiperf_opcount.communication import all_to_all_bytes

    backend = load_backend(name)
    devices = tuple(backend.devices()[:2])
    graph = graphs(hidden, layers, seq_len)[1]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, graph.vocab, (batch * steps, graph.input_shape[0] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    data = Dataset(x, y, x[:batch], y[:batch], graph.vocab)
    out = {"devices": list(devices)}
    if len(devices) < 2:  # one accelerator: the CPU devices are hidden behind it
        return {**out, "error": f"{name} shows {len(devices)} device(s) here ({', '.join(devices)}): the "
                                f"expert-parallel step needs two"}
    for key, on, parallel in (("one", devices[:1], False), ("two", devices, True)):
        model = backend.lower(graph, init_weights(graph, seed=0))
        config = TrainConfig(epochs=2, batch_size=batch, schedule=Schedule(initial=0.01), seed=0, precision=precision,
                             devices=on, expert_parallel=parallel)
        last = backend.train(model, data, config)[-1]
        out[key] = {"epoch_seconds": last.step_seconds, "all_to_all_seconds": last.all_to_all_seconds,
                    "bytes": all_to_all_bytes(graph, precision, last.train_images, last.val_images)}
    return out


def expert_parallel_part(name: str, args, sizes: tuple) -> None:
    import json
    import os
    import subprocess

    from aiperf_core.backend import CPU_DEVICES_ENV

    env = dict(os.environ, **{CPU_DEVICES_ENV: "2"})
    hidden, layers, seq_len, batch, steps = sizes
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import moe_step; "
            f"print('EP ' + json.dumps(moe_step.expert_parallel_child({name!r}, {hidden}, {layers}, {seq_len}, "
            f"{batch}, {steps}, {args.precision!r})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("EP ")]
    if done.returncode or not lines:
        tail = " ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        print(f"{name}: expert-parallel part failed (exit {done.returncode}): {tail}")
        return
    found = json.loads(lines[-1][3:])
    if "error" in found:
        print(f"{name}: expert-parallel part not run: {found['error']}")
        return
    one, two = found["one"], found["two"]
    a2a = two["all_to_all_seconds"]
    print(f"{name}: an epoch's steps ({steps} training, 1 evaluation) on {found['devices'][0]}: "
          f"{one['epoch_seconds'] * 1e3:.0f} ms; expert-parallel on {', '.join(found['devices'])}: "
          f"{two['epoch_seconds'] * 1e3:.0f} ms, of which all-to-all {(a2a or 0) * 1e3:.0f} ms moving "
          f"{two['bytes'] / 1e6:.2f} MB (analytic)")
    label = f"{name} moe expert-parallel (E {EXPERTS}, top-{TOP_K}, H {hidden}, {args.precision})"
    report(f"{label} step time 2 devices / 1", two["epoch_seconds"] / one["epoch_seconds"], "x")
    if a2a:
        report(f"{label} all-to-all share of the step", a2a / two["epoch_seconds"], "fraction")
        report(f"{label} all-to-all bandwidth", two["bytes"] / a2a / 1e9, "GB/s", lower_is_better=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--smoke", action="store_true", help="toy sizes: every path, no meaningful figure")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each model; the median ratio is reported")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", default="fp32", help="a precision every backend run declares")
    parser.add_argument("--parts", default="speed,expert_parallel", help="speed, expert_parallel or both")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"speed", "expert_parallel"}:
        parser.error(f"--parts: {args.parts!r}: choose from speed, expert_parallel")
    from aiperf_core.registry import load_backend

    hidden, layers, seq_len, batch, steps = ((32, 1, 16, 2, 2) if args.smoke else
                                             (args.hidden, args.layers, args.seq_len, args.batch, 4))
    dense, moe = graphs(hidden, layers, seq_len)
    for name in args.backends.split(","):
        try:
            backend = load_backend(name)
        except Exception as exc:  # a backend whose framework is not installed is skipped, with its reason
            print(f"{name}: not run ({exc})")
            continue
        if "expert_parallel" in parts and backend.parallelism().expert_parallel:
            expert_parallel_part(name, args, (hidden, layers, seq_len, batch, steps))
        if "speed" not in parts:
            continue
        ratios = []
        for _ in range(args.repeat):
            dense_s, moe_s = (step_seconds(backend, g, batch, steps, args.precision) for g in (dense, moe))
            ratios.append(dense_s / moe_s)
            print(f"{name}: dense {dense_s * 1e3:.1f} ms, moe {moe_s * 1e3:.1f} ms a step")
        report(f"{name} moe step speed / dense (E {EXPERTS}, top-{TOP_K}, H {hidden}, S {seq_len}, "
               f"{args.precision})", statistics.median(ratios), "x", GOAL.get(name), lower_is_better=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
