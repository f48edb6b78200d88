"""The LM's quality rule on enwik8 (issue #39 item 4): the figures behind the threshold.

enwik8 is not at hand (no network), so the threshold is reasoned from texts every machine of this
project holds, measured here, and from enwik8's published figures (docs/scoring.md, "The LM's
quality rule on enwik8"). Three parts, each printing its figures (and a BENCH line of JSON):

  baselines   what needs no long context, on each text: a byte model of order 0, 1, 2 (the next
              byte from the 0, 1, 2 before it; add-one smoothing, and interpolated Kneser-Ney with
              Ney's discount) and, for the trend, Kneser-Ney of order 3 and 4, trained on the first
              90% and scored on the next 5% (the corpus rule of aiperf_core.data.text_corpus); and
              gzip -9, bz2 -9, lzma -9e (xz) on the whole text, as compressed bits per byte.
  curve       a learning curve: small GPTs (aiperf_core.builders.gpt, 37 k to 1.9 M parameters,
              CURVE_MODELS) trained by the torch backend on the 'docs' text through a TokenStream,
              2-7 minutes each, validation bits per byte after every epoch against the analytic
              training operations (FP + BP, the paper's count, as `aiperf count` gives them) so far.
  extrapolate the compute frontier of the curve (the best bits per byte any size reached with at
              most that much compute) fitted as a power law bpb = a * C**-b, extrapolated from its
              last point to what the official seed trains in one trial of the HPO rounds and in one
              hour of an H100-class device, with the fitted exponent and gentler ones (half of it,
              Kaplan et al.'s 0.050, a quarter), carried over to enwik8 by the larger ratio of
              enwik8's published compressor figures to this text's; and the exponent a published
              12-layer enwik8 result implies, and the one at which the seed just reaches THRESHOLD.

Texts (each cut into 4 KiB chunks shuffled with a fixed seed, so that the held-out 5% samples every
source, then capped at CAP bytes; the embedded corpus is taken as it is):
  embedded    aiperf's embedded corpus (pydoc_data.topics: Python's help text)
  stdlib_py   the running Python's standard library *.py (no tests, no site-packages)
  prose       English manuals: vim's doc/*.txt and perl's *.pod under /usr/share
  html        Node.js's API reference as one HTML page (/usr/share/doc/nodejs/api/all.html): prose
              wrapped in markup, the nearest at hand to enwik8's XML-wrapped Wikipedia
  docs        prose and html together (the learning curve's text)
A text whose files this machine lacks is skipped with a line saying so.

Usage: python benchmarks/lm_quality_floor.py baselines|curve|extrapolate|all [--out DIR] [--minutes M]
`curve` writes DIR/curve.json (default /tmp/aiperf-lm-quality-floor), which `extrapolate` reads;
`curve --models xs,xs32` trains only those sizes (each well under 10 minutes alone: run them one at a
time on a shared machine). baselines takes about a minute; all of curve about 30 on 2 vCPUs.
"""

from __future__ import annotations

import argparse
import bz2
import glob
import gzip
import hashlib
import json
import lzma
import math
import os
import sysconfig
import time
from pathlib import Path

import numpy as np

CAP = 8_000_000
CHUNK = 4096
SHUFFLE_SEED = 20261129

# --------------------------------------------------------------------------------------------- texts


def _files_text(paths: list[str]) -> bytes:
    out = []
    for path in sorted(set(paths)):
        try:
            out.append(Path(path).read_bytes())
        except OSError:
            pass
    return b"\n".join(out)


def _shuffled(data: bytes, cap: int = CAP) -> bytes:
    chunks = [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]
    order = np.random.default_rng(SHUFFLE_SEED).permutation(len(chunks))
    return b"".join(chunks[i] for i in order)[:cap]


def _stdlib_py() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "dist-packages", "/test/", "/tests/", "idle_test")
    return [p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if not any(s in p for s in skip)]


def _prose() -> list[str]:
    return glob.glob("/usr/share/vim/vim*/doc/*.txt") + glob.glob("/usr/share/perl/*/pod/*.pod") \
        + glob.glob("/usr/share/perl/*/pod/**/*.pod", recursive=True)


def _html() -> list[str]:
    return glob.glob("/usr/share/doc/nodejs/api/all.html")


def texts(names=None) -> dict[str, bytes]:
    """{name: bytes} of the texts this machine holds (the module's docstring)."""
    from aiperf_core.data.text_corpus import embedded_bytes

    out = {}
    makers = {"embedded": lambda: embedded_bytes(),
              "stdlib_py": lambda: _shuffled(_files_text(_stdlib_py())),
              "prose": lambda: _shuffled(_files_text(_prose())),
              "html": lambda: _shuffled(_files_text(_html())),
              "docs": lambda: _shuffled(_files_text(_prose() + _html()))}
    for name, make in makers.items():
        if names is not None and name not in names:
            continue
        data = make()
        if len(data) < 100_000:
            print(f"{name}: skipped, only {len(data):,} bytes of it on this machine", flush=True)
            continue
        out[name] = data
    return out


def split(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) by the corpus rule: the first 90% and the 5% after it."""
    from aiperf_core.data.text_corpus import split_bounds

    array = np.frombuffer(data, dtype=np.uint8)
    bounds = split_bounds(len(array))
    return array[slice(*bounds["train"])], array[slice(*bounds["val"])]


# ------------------------------------------------------------------------------------- byte models


def _grams(data: np.ndarray, n: int) -> np.ndarray:
    """Every n-gram of `data` as one int64 key, oldest byte most significant."""
    data = data.astype(np.int64)
    keys = np.zeros(len(data) - n + 1, np.int64)
    for j in range(n):
        keys = keys * 256 + data[j:len(data) - n + 1 + j]
    return keys


def _lookup(table_keys: np.ndarray, table_values: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """table_values at keys (0 where a key is absent); table_keys sorted and unique."""
    if len(table_keys) == 0:
        return np.zeros(len(keys), np.float64)
    at = np.clip(np.searchsorted(table_keys, keys), 0, len(table_keys) - 1)
    return np.where(table_keys[at] == keys, table_values[at], 0).astype(np.float64)


def addone_bits(train: np.ndarray, val: np.ndarray, order: int) -> float:
    """Held-out bits per byte of an order-`order` byte model with add-one (Laplace) smoothing."""
    n = order + 1
    keys, counts = np.unique(_grams(train, n), return_counts=True)
    ctx_keys, inverse = np.unique(keys // 256, return_inverse=True)
    ctx_counts = np.bincount(inverse, weights=counts)
    full = np.concatenate([train[-order:], val]) if order else val
    vk = _grams(full, n)
    p = (_lookup(keys, counts, vk) + 1) / (_lookup(ctx_keys, ctx_counts, vk // 256) + 256)
    return float(-np.log2(p).mean())


def kneser_ney_bits(train: np.ndarray, val: np.ndarray, order: int) -> float:
    """Held-out bits per byte of interpolated Kneser-Ney of order `order` (contexts of `order` bytes),
    one discount per level, D = n1 / (n1 + 2 n2) (Ney); the lowest level interpolates with the
    uniform distribution over 256 bytes, so every byte has a probability."""
    n = order + 1
    full = np.concatenate([train[-order:], val]) if order else val
    vk = _grams(full, n)  # the val n-grams: context and next byte
    # tables[j]: counts of (j-byte context, byte) keys: raw counts at the top level, continuation
    # counts (distinct bytes before) below it.
    top_keys, top_counts = np.unique(_grams(train, n), return_counts=True)
    tables = {order: (top_keys, top_counts.astype(np.float64))}
    keys = top_keys
    for j in range(order - 1, -1, -1):
        suffix = keys % (256 ** (j + 1))  # drop the oldest byte of each distinct (j+2)-gram
        k, c = np.unique(suffix, return_counts=True)
        tables[j] = (k, c.astype(np.float64))
        keys = k
    p = np.full(len(vk), 1.0 / 256)
    for j in range(0, order + 1):
        keys_j, counts_j = tables[j]
        n1, n2 = np.sum(counts_j == 1), np.sum(counts_j == 2)
        discount = n1 / (n1 + 2 * n2) if n1 + n2 else 0.5
        ctx_of = keys_j // 256
        ctx_keys, inverse = np.unique(ctx_of, return_inverse=True)
        ctx_total = np.bincount(inverse, weights=counts_j)
        ctx_types = np.bincount(inverse)
        gram = vk % (256 ** (j + 1))
        ctx = gram // 256
        total = _lookup(ctx_keys, ctx_total, ctx)
        types = _lookup(ctx_keys, ctx_types.astype(np.float64), ctx)
        count = _lookup(keys_j, counts_j, gram)
        seen = total > 0
        safe = np.where(seen, total, 1.0)
        p = np.where(seen, np.maximum(count - discount, 0) / safe + discount * types / safe * p, p)
    return float(-np.log2(p).mean())


def compressed_bits(data: bytes) -> dict[str, float]:
    """Bits per byte of the whole text compressed by gzip -9, bz2 -9 and lzma -9e (xz)."""
    n = len(data)
    return {"gzip -9": 8 * len(gzip.compress(data, compresslevel=9, mtime=0)) / n,
            "bz2 -9": 8 * len(bz2.compress(data, compresslevel=9)) / n,
            "lzma -9e": 8 * len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)) / n}


def baselines(names=None) -> dict:
    rows = {}
    for name, data in texts(names).items():
        train, val = split(data)
        start = time.perf_counter()
        row = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()[:16],
               "order0_addone": addone_bits(train, val, 0), "order1_addone": addone_bits(train, val, 1),
               "order2_addone": addone_bits(train, val, 2)}
        for order in range(0, 5):
            row[f"order{order}_kn"] = kneser_ney_bits(train, val, order)
        row.update(compressed_bits(data))
        rows[name] = row
        print(f"{name:<10} {len(data):>10,} bytes  " + "  ".join(
            f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)) +
              f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    print("baselines " + json.dumps(rows))
    return rows



# ---------------------------------------------------------------------------------- learning curve

CURVE_TEXT = "docs"
CURVE_SEQ_LEN = 256
CURVE_BATCH = 16
CURVE_VAL_TOKENS = 32_768  # the first 8 chunks of 4 KiB of the validation split, for every model
# name: (layers, hidden, heads, AdamW rate, epoch_tokens, epochs). The rate is the embedded default's
# 0.005 at width 128 scaled by sqrt(128 / width) (not tuned); epoch_tokens are sized so that a size
# trains for 2-7 minutes on a shared 2-vCPU machine. xs16 and xs32 are xs trained 2 and 4 times as
# long (each its own schedule), to carry the frontier further.
CURVE_MODELS = {"xxs": (1, 32, 2, 0.01, 262_144, 8), "xs": (1, 64, 2, 0.007, 196_608, 8),
                "xs2": (2, 64, 2, 0.007, 196_608, 8), "xs16": (1, 64, 2, 0.007, 196_608, 16),
                "xs32": (1, 64, 2, 0.007, 196_608, 32),
                "s": (2, 128, 4, 0.005, 61_440, 8), "m": (4, 192, 6, 0.004, 40_960, 8)}
# The official seed and what it trains (aiperf_core/policy.py's lm defaults; docs/search.md).
OFFICIAL = {"layers": 12, "hidden": 768, "heads": 12, "seq_len": 1024, "epoch_tokens": 1_048_576,
            "max_epochs": 60}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM (NVIDIA's data sheet)
MFU = 0.4
# enwik8's published figures (Matt Mahoney's Large Text Compression Benchmark: the compressed size
# of the 100,000,000 bytes), recalled, not measured here.
ENWIK8_PUBLISHED = {"gzip -9": 36_445_248 * 8 / 1e8, "bz2 -9": 29_008_758 * 8 / 1e8}
# A published 12-layer result on enwik8, as an anchor (recalled, not measured here): Transformer-XL's
# 12-layer model (Dai et al. 2019; 41 M parameters) reached 1.06 bits per byte on the test split after
# 400,000 steps of 22 x 512 tokens (its published training script): 6 N D = 1.1e18 FLOP, and about
# 30% more for attention over 1,024 keys; 1.44e18 is taken (the larger: the gentler slope).
ANCHOR = {"name": "Transformer-XL 12 layers", "bpb": 1.06, "flop": 6 * 41e6 * 400_000 * 22 * 512 * 1.3}
# The compute frontier's exponent of Kaplan et al. 2020 ("Scaling laws for neural language models",
# L(C_min) ~ C^-0.050 in nats, BPE on WebText2): an exponent measured at scale, far gentler than
# what small models show.
KAPLAN_EXPONENT = 0.050
THRESHOLD = 2.0  # the recommended threshold on enwik8 (docs/scoring.md)


def _token_data(data: bytes, name: str):
    from aiperf_core.data.text_corpus import TokenData, split_bounds

    array = np.frombuffer(data, dtype=np.uint8)
    parts = {k: array[slice(*b)] for k, b in split_bounds(len(array)).items()}
    return TokenData(name, parts["train"], parts["val"], parts["test"], hashlib.sha256(data).hexdigest(),
                     official=False)


def training_ops(layers: int, hidden: int, heads: int, seq_len: int) -> int:
    """FP + BP operations of one training sequence (the paper's count, as `aiperf count gpt`)."""
    from aiperf_core.builders import gpt
    from aiperf_opcount import count

    totals = count(gpt(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=256))
    return totals.fp + totals.bp


def curve(model: str, out: Path, minutes: float) -> dict:
    """Train one CURVE_MODELS size on the curve's text; append its points to out/curve.json."""
    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.builders import gpt
    from aiperf_core.data.text_stream import TokenStream
    from aiperf_core.registry import load_backend
    from aiperf_core.weights import init_weights

    layers, hidden, heads, rate, epoch_tokens, epochs = CURVE_MODELS[model]
    data = texts([CURVE_TEXT])[CURVE_TEXT]
    corpus = _token_data(data, CURVE_TEXT)
    stream = TokenStream(corpus, CURVE_SEQ_LEN, epoch_tokens, CURVE_VAL_TOKENS)
    graph = gpt(layers=layers, hidden=hidden, heads=heads, seq_len=CURVE_SEQ_LEN, vocab=256)
    ops = training_ops(layers, hidden, heads, CURVE_SEQ_LEN)
    # The product's LM schedule and optimizer (the lm policy's: AdamW, betas (0.9, 0.95), weight
    # decay 0.1, clip 1.0, 1 warm-up epoch, cosine to 0.1 of the rate), at fp32.
    config = TrainConfig(epochs=epochs, batch_size=CURVE_BATCH,
                         schedule=Schedule(rate, 0.1, 1, "cosine"), optimizer="adamw", betas=(0.9, 0.95),
                         weight_decay=0.1, grad_clip=1.0, seed=0, precision="fp32")
    backend = load_backend("torch")
    points, start = [], time.perf_counter()

    def on_epoch(report):
        seqs = (report.epoch + 1) * stream.epoch_windows
        points.append({"epoch": report.epoch + 1, "tokens": seqs * CURVE_SEQ_LEN, "flop": seqs * ops,
                       "bpb": report.val_loss / math.log(2), "seconds": time.perf_counter() - start})
        p = points[-1]
        print(f"  {model} epoch {p['epoch']}: {p['tokens']:>9,} tokens {p['flop']:.3e} FLOP "
              f"{p['bpb']:.3f} bits per byte ({p['seconds']:.0f} s)", flush=True)
        return time.perf_counter() - start > minutes * 60

    print(f"{model}: gpt {layers} x {hidden}, {heads} heads, seq_len {CURVE_SEQ_LEN}, {graph.num_params():,} "
          f"parameters, {ops:.3e} FLOP a sequence, rate {rate}, {epochs} epochs of {epoch_tokens:,} tokens",
          flush=True)
    backend.train(backend.lower(graph, init_weights(graph, 0), "fp32"), stream, config, on_epoch)
    row = {"model": model, "layers": layers, "hidden": hidden, "heads": heads, "params": graph.num_params(),
           "seq_len": CURVE_SEQ_LEN, "ops_per_sequence": ops, "rate": rate, "epoch_tokens": epoch_tokens, "epochs": epochs,
           "points": points}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "curve.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved.setdefault("models", {})[model] = row
    if "reference" not in saved:  # the byte models on the same validation prefix, for comparison
        train = corpus.train
        val = corpus.val[:stream.val_windows * CURVE_SEQ_LEN + 1]
        saved["reference"] = {f"order{k}_kn": kneser_ney_bits(train, val, k) for k in range(5)}
        saved["reference"]["text"] = CURVE_TEXT
        saved["reference"]["val_bytes"] = int(len(val))
    path.write_text(json.dumps(saved, indent=1))
    print("curve " + json.dumps(row))
    return row


# ------------------------------------------------------------------------------------ extrapolation


def frontier(models: dict) -> list[tuple[float, float, str]]:
    """(FLOP, bpb, model) where some model first reached a bpb no model reached with less compute."""
    points = sorted((p["flop"], p["bpb"], name) for name, row in models.items() for p in row["points"])
    out, best = [], math.inf
    for flop, bpb, name in points:
        if bpb < best:
            out.append((flop, bpb, name))
            best = bpb
    return out


def fit_power_law(points) -> tuple[float, float]:
    """(a, b) of bpb = a * C**-b, least squares in log-log."""
    x = np.log([p[0] for p in points])
    y = np.log([p[1] for p in points])
    slope, intercept = np.polyfit(x, y, 1)
    return float(math.exp(intercept)), float(-slope)


def extrapolate(out: Path, baselines_rows: dict | None = None) -> dict:
    saved = json.loads((out / "curve.json").read_text())
    models = saved["models"]
    front = frontier(models)
    print(f"compute frontier on '{saved['reference']['text']}' (seq_len {CURVE_SEQ_LEN}, validation prefix of "
          f"{saved['reference']['val_bytes']:,} bytes):")
    for flop, bpb, name in front:
        print(f"  {flop:.3e} FLOP  {bpb:.3f} bits per byte  ({name})")
    ref = saved["reference"]
    print("  the same validation prefix, Kneser-Ney byte models of order 0-4: "
          + ", ".join(f"{ref[f'order{k}_kn']:.3f}" for k in range(5)))
    ends = sorted((row["points"][-1]["flop"], row["points"][-1]["bpb"], name) for name, row in models.items())
    print("  each size's last point (its schedule ended, except where cut short): "
          + ", ".join(f"{n} {b:.3f} at {f:.2e}" for f, b, n in ends))
    # Fit on the frontier after the first warm-up epoch's points (the rate still rising).
    fitted = [p for p in front if p[0] >= 2 * front[0][0]] or front
    a, b = fit_power_law(fitted)
    print(f"power law on {len(fitted)} frontier points: bpb = {a:.3f} * C^-{b:.4f}")
    ops = training_ops(OFFICIAL["layers"], OFFICIAL["hidden"], OFFICIAL["heads"], OFFICIAL["seq_len"])
    per_token = ops / OFFICIAL["seq_len"]
    trial_flop = OFFICIAL["max_epochs"] * OFFICIAL["epoch_tokens"] // OFFICIAL["seq_len"] * ops
    hour_flop = H100_BF16_PEAK * MFU * 3600
    print(f"official seed: {ops:.3e} FLOP a sequence of {OFFICIAL['seq_len']} ({per_token:.3e} a token); "
          f"one trial of {OFFICIAL['max_epochs']} epochs of {OFFICIAL['epoch_tokens']:,} tokens: {trial_flop:.3e} FLOP "
          f"({trial_flop / (H100_BF16_PEAK * MFU):.0f} s at MFU {MFU}); one hour at MFU {MFU}: {hour_flop:.3e} FLOP, "
          f"{hour_flop / per_token:.3e} tokens ({hour_flop / per_token / 90e6:.1f} passes over enwik8's 90 M training bytes)")
    last = front[-1]
    docs = (baselines_rows or {}).get(CURVE_TEXT)
    ratios = {k: ENWIK8_PUBLISHED[k] / docs[k] for k in ENWIK8_PUBLISHED} if docs else {}
    ratio = max(ratios.values()) if ratios else None
    if ratios:
        print("enwik8 over the curve's text, published / measured: "
              + ", ".join(f"{k} {ENWIK8_PUBLISHED[k]:.3f} / {docs[k]:.3f} = {v:.3f}" for k, v in ratios.items())
              + f"; carried over by the larger, {ratio:.3f}")
    table = {}
    exponents = [("fitted exponent", b), ("half the exponent", b / 2), ("Kaplan et al.'s", KAPLAN_EXPONENT),
                 ("a quarter", b / 4)]
    if ratio:
        implied = math.log(last[1] * ratio / ANCHOR["bpb"]) / math.log(ANCHOR["flop"] / last[0])
        print(f"{ANCHOR['name']} ({ANCHOR['bpb']} at {ANCHOR['flop']:.2e} FLOP) from the last frontier point, "
              f"carried over ({last[1] * ratio:.3f} at {last[0]:.2e}): exponent {implied:.4f} "
              f"({implied / b:.2f} of the fitted)")
        need = {where: math.log(last[1] * ratio / THRESHOLD) / math.log(flop / last[0])
                for where, flop in (("trial", trial_flop), ("hour", hour_flop))}
        print(f"exponent at which the seed reaches {THRESHOLD} on enwik8: one trial {need['trial']:.4f} "
              f"({need['trial'] / b:.2f} of the fitted), one hour {need['hour']:.4f} ({need['hour'] / b:.2f})")
    for label, exponent in exponents:
        row = {}
        for where, flop in (("trial", trial_flop), ("hour", hour_flop)):
            bpb = last[1] * (flop / last[0]) ** -exponent  # from the last frontier point
            row[where] = {"docs": bpb, "enwik8": bpb * ratio if ratio else None}
        table[label] = row
        print(f"  {label} ({exponent:.4f}): one trial {row['trial']['docs']:.3f} on docs"
              + (f", {row['trial']['enwik8']:.3f} on enwik8" if ratio else "")
              + f"; one hour {row['hour']['docs']:.3f} on docs"
              + (f", {row['hour']['enwik8']:.3f} on enwik8" if ratio else ""))
    result = {"frontier": front, "fit": {"a": a, "b": b, "points": len(fitted)}, "official_ops": ops,
              "trial_flop": trial_flop, "hour_flop": hour_flop, "hour_tokens": hour_flop / per_token,
              "ratios": ratios, "extrapolated": table}
    print("extrapolated " + json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", default="baselines", choices=["baselines", "curve", "extrapolate", "all"],
                        help="what to measure (default baselines: the models and compressors, minutes; `make bench` runs it)")
    parser.add_argument("--texts", default=None, help="baselines: comma-separated text names (default all)")
    parser.add_argument("--models", default=",".join(CURVE_MODELS), help="curve: comma-separated sizes")
    parser.add_argument("--minutes", type=float, default=9.0, help="curve: stop a size after this long")
    parser.add_argument("--out", type=Path, default=Path("/tmp/aiperf-lm-quality-floor"))
    args = parser.parse_args()
    rows = None
    if args.part in ("baselines", "all", "extrapolate"):
        rows = baselines(args.texts.split(",") if args.texts else
                         ([CURVE_TEXT] if args.part == "extrapolate" else None))
    if args.part in ("curve", "all"):
        for model in args.models.split(","):
            curve(model, args.out, args.minutes)
    if args.part in ("extrapolate", "all"):
        extrapolate(args.out, rows)


if __name__ == "__main__":
    main()
