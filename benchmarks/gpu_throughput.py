"""Accelerator throughput (issue 17.5): does the score measure the GPU, or the host and eager overhead?

On a CUDA machine, in one script, at the run's precision (`auto`: the backend's fastest on the GPU):

1. the GPU's dense GEMM peak at that precision (8192 x 8192 products, best of ten);
2. per backend (torch, jax): the IR-lowered ResNet-50 training step against a hand-written model
   (both Keras layout, 224x224, batch 256, data already on the GPU), eager and compiled for torch
   (torch.compile of the lowered model's loss, of the hand-written model's forward), jitted for
   jax (it has no eager step); timed in blocks of STEPS_PER_TIMING steps between synchronisations,
   in pairs, median ratio (_common.compare_training_throughput; goal lowered >= 0.97 x hand-written);
3. the step rate of the backend's own train() on synthetic data (made once on the GPU), eager and
   compiled (torch), against the lowered step (goal >= 0.95);
4. the epoch wall rate of a real `aiperf run --data synthetic` per backend, and of `aiperf run` on
   an ImageFolder of JPEGs made here (photo_tree, about 500x375, decoded on the GPU by nvJPEG for
   torch), read from the replica's epoch_end events (train images / the epoch's wall seconds,
   validation included), the first epoch of a trial apart (it includes the compile);
5. every rate as analytic OPS (the paper's count of one training image, FP + BP) and as a fraction
   of the GEMM peak;
6. the LM workload at its official shape, the seed `gpt2_small` (12 blocks of 768, 12 heads of 64,
   a byte vocabulary) at seq_len 1,024 and the global batch 32, at the backend's fastest precision
   (bf16 on an H100 or H200): the GPT training step of benchmarks/transformer_step.py, lowered
   against hand-written, with its model-FLOP utilisation (goal >= 0.45 of the bf16 GEMM peak), for
   torch and jax, then torch compiled (`lm-step`); and the epoch wall rate of a real
   `aiperf run --workload lm` with the official policy on an enwik8-shaped sample made here (the
   embedded corpus zipped as enwik8.zip and prepared, never the real file: the run is unofficial
   for its data only) (`run-lm`), as sequences per second and analytic OPS;
7. a mixture of experts' step (`moe`): benchmarks/moe_step.py for torch and jax at GPT-2 small's width
   (768, 2 blocks) at 1,024 tokens, batch 8, at torch's fastest precision: every MLP upcycled to 8
   experts, 2 per token, against the dense GPT of the same active parameters (torch's grouped GEMM
   and jax's routed tiles on a GPU; goal >= 0.8).

On a machine without a CUDA device it prints one line and exits 0. `--smoke` runs every code path
on the CPU at toy sizes (fp32, 32x32, batch 4, no `aiperf run`): a check of the script, not figures.
`--parts=P,...` runs only the parts named, from PARTS (default: all): a short device lease cannot
hold every part, and a synthetic `aiperf run` epoch alone is 1.28 M images.

Environment: AIPERF_GPU_RUN_BUDGET (default 12m), the --time-budget of each `aiperf run`;
AIPERF_BENCH_STEPS (default 6), the timed pairs; AIPERF_GPU_JPEGS (default 2000), JPEGs per class
(two classes) of the ImageFolder.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import (PEAK_UNDER_MEASURED, best_of, compare_training_throughput, report,  # noqa: E402
                     report_fraction_of_peak, training_ops_per_image)

SMOKE = "--smoke" in sys.argv[1:]
KIND = "cpu-smoke" if SMOKE else "gpu"  # in every figure's name: smoke figures are no GPU's
SIZE, BATCH, CLASSES = (32, 4, 10) if SMOKE else (224, 256, 1000)
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "2" if SMOKE else "6"))  # timed pairs
STEPS_PER_TIMING = 1 if SMOKE else 10  # steps between two synchronisations
RUN_BUDGET = os.environ.get("AIPERF_GPU_RUN_BUDGET", "12m")
JPEGS_PER_CLASS = int(os.environ.get("AIPERF_GPU_JPEGS", "2000"))
LR, MOMENTUM = 0.01, 0.9
ROOT = Path(__file__).resolve().parents[1]
PARTS = ("torch-eager", "torch-compiled", "jax", "run-synthetic", "run-jpeg", "lm-step", "run-lm", "moe")
failures: list[str] = []


def chosen_parts(argv: list[str]) -> tuple[str, ...]:
    named = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--parts=")]
    if not named:
        return PARTS
    parts = tuple(part for part in named[-1].split(",") if part)
    unknown = [part for part in parts if part not in PARTS]
    if unknown or not parts:
        raise SystemExit(f"--parts: unknown part {', '.join(unknown) or '(none)'} (known: {', '.join(PARTS)})")
    return parts


SELECTED = chosen_parts(sys.argv[1:])


def rate_row(name: str, images_per_s: float, ops_per_image: int, peak: float | None, samples: str = "images") -> None:
    """A rate (of images, or of an LM's sequences), its analytic OPS and its fraction of the GEMM peak
    (above 1 a failed measurement, the peak under-measured: _common.report_fraction_of_peak)."""
    report(name, images_per_s, f"{samples}/s", None, lower_is_better=False)
    report(f"{name}, analytic OPS", images_per_s * ops_per_image / 1e12, "TOPS", None, lower_is_better=False)
    if peak and report_fraction_of_peak(f"{name} / GEMM peak", images_per_s * ops_per_image / peak).get("failed"):
        failures.append(f"{name} / GEMM peak above 1 ({PEAK_UNDER_MEASURED})")


def attempt(what: str, fn, *args):
    """Run one part; a failure is printed and makes the script exit non-zero, after the others ran."""
    try:
        return fn(*args)
    except Exception as exc:  # one broken part must not hide the figures of the rest
        failures.append(what)
        print(f"FAILED {what}: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        if os.environ.get("AIPERF_DEBUG"):
            raise
        return None


# -- torch --------------------------------------------------------------------------------------------


def torch_gemm_peak(torch, device, precision: str) -> float:
    """Dense GEMM operations per second at `precision` (TF32 only for tf32; IEEE fp32 for fp32)."""
    from aiperf_backends.torch.precision import AUTOCAST_DTYPES, float32_math

    n = 512 if SMOKE else 8192
    dtype = AUTOCAST_DTYPES.get(precision, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

    def product():
        with float32_math(device, precision == "tf32"):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    product()
    peak = 2 * n ** 3 / best_of(product, repeat=10)
    report(f"torch GEMM peak ({n}x{n} {precision})", peak / 1e12, "TOPS", None, lower_is_better=False)
    return peak


def torch_steps(torch, device, precision: str, graph, compiled: bool):
    """(lowered step, {variant: hand-written step}) callables, each running STEPS_PER_TIMING steps
    and waiting for them."""
    from torch_throughput import copy_weights, hand_written_resnet50, probed_convs

    from aiperf_backends.torch import TorchBackend
    from aiperf_backends.torch.precision import autocast, float32_math
    from aiperf_backends.torch.training import Stepper
    from aiperf_core.backend import Schedule, TrainConfig

    lowered = TorchBackend().lower(graph, precision=precision)
    config = TrainConfig(epochs=1, batch_size=BATCH, schedule=Schedule(initial=LR), momentum=MOMENTUM,
                         precision=precision)
    stepper = Stepper(lowered, device, config, compile=compiled)
    hand = hand_written_resnet50(torch, CLASSES).to(device)
    copy_weights(torch, hand, lowered)
    hand = hand.to(memory_format=torch.channels_last)
    probed_convs(torch, hand, device)
    optimizer = torch.optim.SGD(hand.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    forward = torch.compile(hand) if compiled else hand

    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (BATCH, SIZE, SIZE, 3), dtype=np.uint8)).to(device)
    labels = torch.from_numpy(rng.integers(0, CLASSES, BATCH)).to(device)
    # The hand-written model gets the same normalisation, on the device, inside its step.
    mean, inv_std = lowered.input_mean, lowered.input_inv_std

    def finish():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def lowered_steps():
        for _ in range(STEPS_PER_TIMING):
            stepper.step(pixels, labels, BATCH)
        finish()

    def hand_steps():
        for _ in range(STEPS_PER_TIMING):
            optimizer.zero_grad(set_to_none=True)
            with float32_math(device, precision == "tf32"):
                with autocast(device, precision):
                    x = ((pixels.float() - mean) * inv_std).permute(0, 3, 1, 2)
                    loss = torch.nn.functional.cross_entropy(forward(x).float(), labels)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    optimizer.step()
        finish()

    for _ in range(2):  # compile and warm up
        lowered_steps()
        hand_steps()
    return lowered_steps, {"channels_last": hand_steps}


def torch_pairs(torch, device, precision: str, graph, ops: int, peak: float | None) -> dict[str, float]:
    rates = {}
    for compiled in (False, True):
        mode = "compiled" if compiled else "eager"
        if f"torch-{mode}" not in SELECTED:
            continue
        lowered, hands = torch_steps(torch, device, precision, graph, compiled)
        print(f"torch {mode} ({precision}): {STEPS} timed pairs of {STEPS_PER_TIMING} steps", flush=True)
        rates[mode] = compare_training_throughput(f"torch {KIND} {precision} {mode}", BATCH * STEPS_PER_TIMING,
                                                  lowered, hands, STEPS)
        rate_row(f"torch {KIND} {precision} {mode} lowered step", rates[mode], ops, peak)
    return rates


def torch_train_synthetic(torch, device, precision: str, graph, ops: int, peak: float | None,
                          step_rates: dict[str, float]) -> None:
    """The backend's own training loop on synthetic data made once on the GPU, eager and compiled."""
    from aiperf_backends.torch import TorchBackend
    from aiperf_backends.torch.training import Stepper, run_epochs
    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.data.stream import StreamingDataset
    from aiperf_core.data.synthetic import SyntheticSource

    steps = 4 if SMOKE else 60
    data = StreamingDataset(SyntheticSource(classes=CLASSES, train_images=steps * BATCH, val_images=BATCH),
                            image_size=SIZE, workers=0)
    config = TrainConfig(epochs=2, batch_size=BATCH, schedule=Schedule(initial=LR), momentum=MOMENTUM,
                         precision=precision)
    for compiled, mode in ((False, "eager"), (True, "compiled")):
        if mode not in step_rates:
            continue
        model = TorchBackend().lower(graph, precision=precision)
        start = []

        def on_epoch(report, start=start):
            start.append(time.perf_counter())
            return False

        start.append(time.perf_counter())
        reports = run_epochs(model, data, config, device, on_epoch=on_epoch,
                             stepper=Stepper(model, device, config, compile=compiled))
        second = reports[1]
        wall = start[2] - start[1]
        print(f"torch train() {mode}: epoch 1 compile {reports[0].compile_seconds:.1f} s; epoch 2 "
              f"{second.train_images} images in {wall:.2f} s (steps {second.step_seconds:.2f} s)", flush=True)
        rate = second.train_images / wall
        rate_row(f"torch {KIND} {precision} train() synthetic {mode}", rate, ops, peak)
        report(f"torch train() synthetic {mode} / lowered step {mode}", rate / step_rates[mode], "ratio", 0.95,
               lower_is_better=False)


def torch_part(precision_override: str | None = None) -> None:
    import torch

    from aiperf_backends.torch import TorchBackend
    from aiperf_core.builders import resnet50

    backend = TorchBackend()
    device = torch.device("cpu" if SMOKE else "cuda:0")
    precision = precision_override or ("fp32" if SMOKE else backend.fastest_precision(backend.devices()[0]))
    name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(device)
    print(f"torch {torch.__version__} on {name}; precision {precision} (declared: "
          f"{', '.join(backend.precisions())}); ResNet-50 {SIZE}x{SIZE}, batch {BATCH}", flush=True)
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    ops = training_ops_per_image(graph)
    peak = attempt("torch GEMM peak", torch_gemm_peak, torch, device, precision)
    rates = attempt("torch lowered/hand-written pairs", torch_pairs, torch, device, precision, graph, ops, peak)
    if rates:
        attempt("torch train() on synthetic data", torch_train_synthetic, torch, device, precision, graph, ops,
                peak, rates)


# -- jax ----------------------------------------------------------------------------------------------


def jax_part() -> None:
    """The jax backend's lowered step (its own jitted make_train_step) against a hand-written Flax
    ResNet-50 (jax_throughput.py's), jitted; then the backend's train() on synthetic data."""
    import jax
    import jax.numpy as jnp
    import optax

    from aiperf_backends.jax import JaxBackend
    from aiperf_backends.jax.training import make_train_step
    from aiperf_core.builders import resnet50
    from aiperf_core.data.preprocess import INV_STD, MEAN
    from jax_throughput import hand_written_resnet50

    if jax.default_backend() == "cpu" and not SMOKE:
        print("jax sees no accelerator here: skipping the jax part", flush=True)
        return
    backend = JaxBackend()
    precision = "fp32" if SMOKE else backend.fastest_precision()
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    ops = training_ops_per_image(graph)
    print(f"jax {jax.__version__} on {jax.devices()[0]}; precision {precision}", flush=True)
    lowered = backend.lower(graph, precision=precision)
    step = make_train_step(graph, precision, MOMENTUM, 0.0)
    params = jax.tree_util.tree_map(jnp.array, lowered.params)
    velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
    rng = np.random.default_rng(0)
    pixels = jnp.asarray(rng.integers(0, 256, (BATCH, SIZE, SIZE, 3), dtype=np.uint8))
    labels = jnp.asarray(rng.integers(0, CLASSES, BATCH).astype(np.int32))
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(precision, jnp.float32)
    mean, inv_std = jnp.asarray(MEAN), jnp.asarray(INV_STD)
    net = hand_written_resnet50(CLASSES)
    variables = net.init(jax.random.PRNGKey(0), jnp.zeros((1, SIZE, SIZE, 3), jnp.float32), train=False)
    tx = optax.sgd(LR, momentum=MOMENTUM)
    carry = {"low": (params, lowered.state, velocity),
             "hand": (variables["params"], variables["batch_stats"], tx.init(variables["params"]))}

    def h_loss(p, stats, pixels_b, yb):
        xb = (pixels_b.astype(jnp.float32) - mean) * inv_std  # normalised inside the step, as the lowered one
        logits, updates = net.apply({"params": p, "batch_stats": stats}, xb.astype(dtype), train=True,
                                    mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), yb).mean(), \
            updates["batch_stats"]

    @jax.jit
    def h_step(p, stats, opt, xb, yb):
        (loss, stats), grads = jax.value_and_grad(h_loss, has_aux=True)(p, stats, xb, yb)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), stats, opt, loss

    key, lr = jax.random.PRNGKey(0), jnp.float32(LR)

    def lowered_steps():
        p, s, v = carry["low"]
        for i in range(STEPS_PER_TIMING):
            p, s, v, loss = step(p, s, v, pixels, labels, lr, key, np.int32(i))[:4]
        carry["low"] = (p, s, v)
        jax.block_until_ready(loss)

    def hand_steps():
        p, s, o = carry["hand"]
        for _ in range(STEPS_PER_TIMING):
            p, s, o, loss = h_step(p, s, o, pixels, labels)
        carry["hand"] = (p, s, o)
        jax.block_until_ready(loss)

    for _ in range(2):
        lowered_steps()
        hand_steps()
    rate = compare_training_throughput(f"jax {KIND} {precision} jitted", BATCH * STEPS_PER_TIMING, lowered_steps,
                                       {"flax": hand_steps}, STEPS)
    rate_row(f"jax {KIND} {precision} lowered step", rate, ops, None)


# -- aiperf run ---------------------------------------------------------------------------------------


def epoch_rates(run_dir: Path) -> tuple[list[float], list[float]]:
    """(first epochs of trials, later epochs): train images / the epoch's wall seconds, from every
    replica's epoch_end events (`started` to `time`, validation included)."""
    first, later = [], []
    for log in sorted(run_dir.glob("replicas/*/events.jsonl")):
        seen_trials = set()
        for line in log.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") != "epoch_end" or not event.get("train_images"):
                continue
            rate = event["train_images"] / max(event["time"] - event["started"], 1e-9)
            (later if event["trial"] in seen_trials else first).append(rate)
            seen_trials.add(event["trial"])
    return first, later


def moe_part() -> None:
    """benchmarks/moe_step.py at GPT-2 small's width on the GPU (docstring, 7); its BENCH lines pass through."""
    from aiperf_backends.torch import TorchBackend

    sizes = ["--smoke"] if SMOKE else ["--hidden", "768", "--seq-len", "1024", "--batch", "8",
                                        "--precision", TorchBackend().fastest_precision()]
    subprocess.run([sys.executable, str(Path(__file__).parent / "moe_step.py"), "--backends", "torch,jax",
                    "--repeat", "1" if SMOKE else "3", *sizes], check=True)


def lm_step_part() -> None:
    """benchmarks/transformer_step.py (on a CUDA device: the official seed, seq_len and global batch at
    the fastest precision) for torch and jax eager, then torch compiled, its figures printed as they
    come. --smoke: toy sizes on the CPU, eager only (inductor's CPU compile takes minutes)."""
    script = str(ROOT / "benchmarks" / "transformer_step.py")
    runs = [["--backends=torch,jax", "--smoke"]] if SMOKE else [["--backends=torch,jax"],
                                                                 ["--backends=torch", "--compile"]]
    for options in runs:
        command = [sys.executable, script, *options]
        print(f"$ {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, cwd=ROOT, text=True)
        if done.returncode:
            raise RuntimeError(f"transformer_step.py {' '.join(options)} exited {done.returncode}")


def enwik8_shaped_sample(folder: Path) -> Path:
    """An enwik8-shaped prepared folder made from the embedded corpus (zipped as enwik8.zip, then
    `aiperf data prepare`), as tests/test_lm_official_shape.py makes one: the official LM track's
    data layout without the real file, which a lent GPU machine cannot download."""
    import zipfile

    from aiperf_core.data.text_corpus import embedded_bytes

    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "enwik8.zip", "w") as archive:
        archive.writestr("enwik8", embedded_bytes())
    done = subprocess.run([sys.executable, "-m", "aiperf_core", "data", "prepare", str(folder / "enwik8.zip"),
                           str(folder / "prepared")], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"aiperf data prepare exited {done.returncode}: {done.stderr.strip()[-500:]}")
    print(f"enwik8-shaped sample prepared in {folder / 'prepared'}", flush=True)
    return folder / "prepared"


def run_lm_part(peak: float | None) -> None:
    """`aiperf run --workload lm` with the official policy (seed, seq_len 1,024, global batch 32, the
    1,048,576-token epoch, precision auto) on the enwik8-shaped sample."""
    from aiperf_core.builders import gpt
    from aiperf_core.policy import Policy
    from aiperf_core.workloads.lm import BITS_PER_BYTE, OFFICIAL_SEED, SEEDS

    policy = Policy({"workload": "lm"})
    ops = training_ops_per_image(gpt(**SEEDS[OFFICIAL_SEED], seq_len=policy["seq_len"], vocab=2 ** BITS_PER_BYTE))
    with tempfile.TemporaryDirectory() as tmp:
        sample = enwik8_shaped_sample(Path(tmp) / "enwik8")
        label = f"lm ({OFFICIAL_SEED}, seq_len {policy['seq_len']}, batch {policy['batch_size']}, enwik8-shaped sample)"
        attempt("torch aiperf run --workload lm", aiperf_run, "torch", str(sample), label, ops, peak,
                ["--workload", "lm"], "sequences")


def aiperf_run(backend: str, data: str, label: str, ops_for_size: int, peak: float | None, extra: list[str],
               samples: str = "images") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [sys.executable, "-m", "aiperf_core", "run", "--backend", backend, "--data", data,
                   "--time-budget", RUN_BUDGET, "--run-dir", str(run_dir), "--replicas", "1", *extra]
        print(f"$ aiperf {' '.join(command[3:])}", flush=True)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        print(f"  ({time.perf_counter() - start:.0f} s, exit {done.returncode})", flush=True)
        # The epochs that ended were measured even when the run failed (a trial that diverged on
        # this toy tree still ran its epochs at full speed): print them, then report the failure.
        first, later = epoch_rates(run_dir)
        if later:
            rate_row(f"{backend} aiperf run {label}, epoch wall rate", statistics.median(later), ops_for_size, peak,
                     samples)
        if first:
            rate_row(f"{backend} aiperf run {label}, first epoch of a trial (compile included)",
                     statistics.median(first), ops_for_size, peak, samples)
        if done.returncode:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "aiperf run failed")
        if not first:
            raise RuntimeError(f"no epoch ended within {RUN_BUDGET}")


def run_part(peak: float | None) -> None:
    from aiperf_core.builders import resnet50
    from aiperf_core.data.samples import photo_tree

    ops = training_ops_per_image(resnet50((224, 224, 3), 1000))
    ops_two_classes = training_ops_per_image(resnet50((224, 224, 3), 2))
    backends = ["torch"]
    try:
        import jax

        if jax.default_backend() != "cpu":
            backends.append("jax")
    except ImportError:
        pass
    for backend in backends if "run-synthetic" in SELECTED else ():
        attempt(f"{backend} aiperf run --data synthetic", aiperf_run, backend, "synthetic", "synthetic", ops, peak, [])
    if "run-jpeg" not in SELECTED:
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = photo_tree(Path(tmp) / "jpegs", JPEGS_PER_CLASS, max(JPEGS_PER_CLASS // 20, 1))
        for backend in backends:
            attempt(f"{backend} aiperf run on JPEGs", aiperf_run, backend, str(tree), "ImageFolder JPEGs",
                    ops_two_classes, peak, ["--data-workers", str(max(len(os.sched_getaffinity(0)) - 2, 1))])


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu_throughput: torch is not installed: nothing to measure")
        return 0
    if not SMOKE and not torch.cuda.is_available():
        print("gpu_throughput: no CUDA accelerator here: nothing to measure (run it on a CUDA machine; docs/backends/gpu.md says how)")
        return 0
    if SMOKE:  # the code paths only: dynamo without inductor's (minutes-long) CPU compile
        plain_compile = torch.compile
        torch.compile = lambda fn, **options: plain_compile(fn, backend="eager", dynamic=options.get("dynamic"))
    if {"torch-eager", "torch-compiled"} & set(SELECTED):
        torch_part()
    peak = None
    try:
        import jax  # noqa: F401

        if "jax" in SELECTED:
            attempt("jax lowered/hand-written pairs", jax_part)
    except ImportError:
        print("jax is not installed: skipping the jax part")
    if "lm-step" in SELECTED:
        attempt("GPT step, lowered/hand-written, MFU", lm_step_part)
    if "moe" in SELECTED:
        attempt("mixture-of-experts step against dense", moe_part)
    if SMOKE and "run-lm" in SELECTED:  # no aiperf run in a smoke; its data is made all the same
        with tempfile.TemporaryDirectory() as tmp:
            attempt("enwik8-shaped sample", enwik8_shaped_sample, Path(tmp) / "enwik8")
    if not SMOKE and {"run-synthetic", "run-jpeg", "run-lm"} & set(SELECTED):
        from aiperf_backends.torch import TorchBackend

        backend = TorchBackend()
        peak = attempt("GEMM peak for the runs", torch_gemm_peak, torch, torch.device("cuda:0"),
                       backend.fastest_precision())
        run_part(peak)
        if "run-lm" in SELECTED:
            run_lm_part(peak)
    if failures:
        print(f"failed: {', '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
