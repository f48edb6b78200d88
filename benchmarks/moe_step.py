"""A mixture-of-experts GPT's training step against the dense GPT of the same active parameters, per backend
(issue 40, item 5).

The MoE GPT is `builders.gpt` with every MLP upcycled (transformer_morph.upcycle_moe) to 8 experts of the
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

Not here yet (issue 40): the expert-parallel step on 2 devices against 1, and all-to-all bytes a second.
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
    from aiperf_core.transformer_morph import upcycle_moe

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
    args = parser.parse_args()
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
