"""Fresh text every epoch (issue #39 item 2): one 10-epoch trial of the embedded LM default, twice.

The trial is what `aiperf run --workload lm` on the embedded corpus trains first: `gpt_small`
(aiperf_core.builders.gpt, 2 blocks of width 128, 4 heads, seq_len 128, vocabulary 256) from the
initial weights, with the TrainConfig that aiperf_core.replica.train_config builds from the lm policy
at the embedded defaults (aiperf_core.workflow.plan.EMBEDDED_LM_DEFAULTS: epoch_tokens 16,384,
val_tokens 16,384, batch 16, AdamW at 0.005, weight decay 0.1, betas (0.9, 0.95), grad clip 1.0,
cosine schedule with 1 warm-up epoch to 0.1 of the rate), on the torch backend at fp32.

- `stream`: the trial's TokenStream, new windows every epoch (what a trial reads now);
- `fixed`: the windows of the stream's epoch 0 as an in-memory Dataset, re-read every epoch (what a
  trial read before the stream: one draw of epoch_tokens), with the same validation prefix.

Both print validation bits per byte (val_loss / ln 2) per epoch. Goal: the stream's keep falling
past epoch 3. Usage: python benchmarks/lm_learning_curve.py [--epochs 10] [--seed 0] [--backend torch]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _common import report  # noqa: E402


def policy():
    from aiperf_core.policy import Policy
    from aiperf_core.workflow.plan import EMBEDDED_LM_DEFAULTS

    return Policy({"workload": "lm", "dataset": "embedded", **EMBEDDED_LM_DEFAULTS}, source="policy")


def fixed_draw(stream, seed: int, batch: int):
    """The old trial's data: the windows of the stream's epoch 0, kept in memory and re-read."""
    from aiperf_core.backend import Dataset

    offsets = np.concatenate(list(stream.plan("train", 0, seed, batch)))
    x_train, y_train, _, _ = stream.load("train", offsets)
    x_val, y_val, _, _ = stream.load("val", np.arange(stream.val_windows, dtype=np.int64) * stream.seq_len)
    return Dataset(x_train, y_train, x_val, y_val, stream.vocab)


def curve(backend, graph, weights, data, config) -> list[float]:
    model = backend.lower(graph, weights, config.precision)
    reports = backend.train(model, data, config)
    return [r.val_loss / math.log(2) for r in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="the trial seed (initial weights and the stream)")
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args()

    from aiperf_core.data.text_corpus import embedded_corpus
    from aiperf_core.data.text_stream import TokenStream
    from aiperf_core.registry import load_backend
    from aiperf_core.replica import train_config
    from aiperf_core.weights import init_weights
    from aiperf_core.workloads.lm import LM, seed_graph

    pol = policy()
    corpus = embedded_corpus()
    graph = seed_graph(pol["initial_architecture"], pol["seq_len"], corpus.vocab)
    hyper = {"batch_size": pol["batch_size"], "epochs": args.epochs, "label_smoothing": pol["label_smoothing"],
             "precision": "fp32", "learning_rate": pol["learning_rate"]}
    config = train_config(pol, hyper, args.seed)
    backend = load_backend(args.backend)
    stream = LM.data.trial_data(corpus, pol, args.seed)
    assert isinstance(stream, TokenStream)
    print(f"gpt_small on the embedded corpus ({len(corpus.train):,} training bytes), {args.backend}, "
          f"{stream.epoch_windows} windows of {stream.seq_len} an epoch, {stream.val_windows} validation windows; "
          f"{config.optimizer} lr {config.schedule.initial} wd {config.weight_decay} betas {config.betas} "
          f"clip {config.grad_clip}, {config.schedule.shape} warm-up {config.schedule.warmup_epochs} "
          f"final {config.schedule.final_fraction}", flush=True)
    results = {}
    for name, data in (("stream", stream), ("fixed", fixed_draw(stream, args.seed, pol["batch_size"]))):
        start = time.perf_counter()
        results[name] = curve(backend, graph, init_weights(graph, args.seed), data, config)
        print(f"{name:>6} ({time.perf_counter() - start:5.1f} s): "
              + ", ".join(f"{b:.3f}" for b in results[name]), flush=True)
    falling = all(b < a for a, b in zip(results["stream"][2:], results["stream"][3:]))
    print(f"stream falls every epoch past epoch 3: {falling}; best stream {min(results['stream']):.3f} "
          f"(epoch {int(np.argmin(results['stream'])) + 1}), best fixed {min(results['fixed']):.3f} "
          f"(epoch {int(np.argmin(results['fixed'])) + 1})")
    print("curves " + json.dumps({"backend": args.backend, "seed": args.seed, "stream_bpb": results["stream"],
                                  "fixed_bpb": results["fixed"]}))
    report(f"lm 10-epoch trial ({args.backend}): stream, last epoch", results["stream"][-1], "bits/byte", None)
    report(f"lm 10-epoch trial ({args.backend}): fixed draw, last epoch", results["fixed"][-1], "bits/byte", None)
    report(f"lm 10-epoch trial ({args.backend}): stream falls every epoch past 3", float(falling), "bool", None,
           lower_is_better=False)


if __name__ == "__main__":
    main()
