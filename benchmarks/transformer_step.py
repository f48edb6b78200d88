"""A GPT training step per backend: the IR-lowered model against a hand-written one of the same shape.

For each backend (torch, jax, tensorflow, mindspore, those installed), the GPT that
aiperf_core.builders.gpt describes is lowered from the IR and trained one step at a time through the
backend's own training step (torch: training.Stepper; jax: training.make_train_step; TensorFlow:
training.Trainer.step; MindSpore: training.Stepper), against a model of the same shape written by
hand in that framework the way its users write one, with one fused QKV product, a causal softmax
attention, tanh GELU, layer norm and an untied LM head:

* torch: a nanoGPT-style nn.Module with F.scaled_dot_product_attention(is_causal=True), autocast;
* jax: a Flax linen module with jax.nn.dot_product_attention(is_causal=True), its jitted step an SGD
  with momentum written out (torch's rule, as the backend's), the products at the backend's
  lax precision;
* TensorFlow: Keras layers (Dense, LayerNormalization, Embedding) with the attention written out
  in tf.matmul (Keras has no fused causal kernel), a tf.function step with Keras' SGD, compiled
  with XLA where the backend compiles its own step (GPUs), Keras' mixed-precision policy;
* MindSpore: nn.Cell (nn.Dense, nn.LayerNorm, nn.Embedding, ops.BatchMatMul) with nn.Momentum, in
  PyNative mode as the backend trains, ms.amp's O1 for the mixed precisions.

Same batch of token ids, SGD with momentum, the same precision, warm-up steps first; timed in pairs,
median of the pairs' ratios (_common.compare_training_throughput). Each backend is one `<name>_pair`
in PAIRS returning a `Pair`; the hand-written model's parameter count must equal the IR's.

Then model-FLOP utilisation: the analytic operations of one training sequence (FP + BP) times the
lowered step's sequences per second, over the backend's dense GEMM peak at the same precision, in
two conventions: `paper` (as scored: causal attention's full S x S) and `valid` (only the S(S+1)/2
pairs a causal mask keeps, as a fused causal kernel computes; docs/counting.md). The peak is
measured where it is used (issue 51): after each warm-up round and each timed pair, one product of
each shape (gemm_shapes: a square GEMM_SIZE product and the model's own GEMMs: the fused QKV, the
MLP's two products and the MLP's weight gradient, at the step's tokens), timed by
Backend.matmul_seconds as `aiperf peak` times its products; the peak is the best of them all
(_common.InterleavedPeak). A utilisation above 1 is no utilisation: the peak was under-measured.
It is printed as a failed measurement, never a met goal, and the script exits 1.

Sizes: on a CPU a small GPT (4 layers, width 256, 4 heads, 128 tokens, vocabulary 256, batch 8, fp32);
on a CUDA device the LM track's official seed (aiperf_core.workloads.lm.SEEDS["gpt2_small"]: 12 layers,
width 768, 12 heads, vocabulary 256 bytes) at the official seq_len (1,024) and global batch (32), at
the backend's fastest declared precision: the step an official run trains on one device.
--official runs that shape on a CPU too, with the batch reduced to fit (--batch=N, default 1; one
sequence is about 6.4e11 operations, seconds on a CPU core) and fewer pairs. AIPERF_BENCH_STEPS sets
the timed pairs (default 12 on a CPU, 4 with --official, 20 on a GPU); --backends=torch,jax picks
backends; --precision=bf16 runs a precision the backend declares instead; --compile compiles torch's
two steps (the Stepper's compiled loss, CUDA graphs on CUDA; torch.compile of the hand-written
model, as nanoGPT does); --cpu-time times every step and the GEMM peak in the process's CPU seconds
instead of wall seconds (torch and jax): on a CPU shared with other work, wall time measures the
load, CPU time the work (run it on one core, `taskset -c 1`, so that no thread waits for a
descheduled partner); --smoke runs every path at toy sizes.

Goals: lowered / hand-written sequences per second >= 0.97 on every backend; model-FLOP utilisation
of the official shape >= 0.5 of the fp32 GEMM peak for torch on a CPU (--official), >= 0.45 of the
bf16 peak on a GPU (issue 39, item 5).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import InterleavedPeak, compare_training_throughput, report_utilisation, timed  # noqa: E402

SMOKE = "--smoke" in sys.argv[1:]
OFFICIAL = "--official" in sys.argv[1:]
COMPILE = "--compile" in sys.argv[1:]
CPU_TIME = "--cpu-time" in sys.argv[1:]
CPU_MFU_GOAL, GPU_MFU_GOAL = 0.5, 0.45  # the official shape's, issue 39 item 5 (CPU: torch's)
CPU_SIZES = dict(layers=4, hidden=256, heads=4, seq_len=128, vocab=256)
SMOKE_SIZES = dict(layers=1, hidden=32, heads=2, seq_len=16, vocab=64)
CPU_BATCH, SMOKE_BATCH, OFFICIAL_CPU_BATCH = 8, 2, 1
WARMUP = 1 if SMOKE else 3
OFFICIAL_CPU_WARMUP = 2  # the first step allocates and (jax) compiles; the second settles the allocator
LR = 1e-3
MOMENTUM = 0.9


@dataclass
class Pair:
    """What a backend's `<name>_pair` sets up: the lowered and hand-written steps (each runs one
    training step to completion) and what the report says about them."""

    backend: Any  # the aiperf Backend (its matmul_seconds measures the GEMM peak)
    device: str  # the backend's device name
    precision: str
    describe: str  # framework version, device, threads or execution mode
    lowered_step: Callable[[], None]
    hand_steps: dict[str, Callable[[], None]]  # variant -> step; the fastest is the reference
    hand_parameters: Callable[[], int]  # the hand-written model's parameters (after its first step)
    # shape (m, k, n) -> one (m x k) @ (k x n) product at the precision, waited for (the peak under
    # --cpu-time, where Backend.matmul_seconds' wall seconds would measure the load).
    product: Callable[[tuple[int, int, int]], Callable[[], None]] | None = None


def official_shape() -> tuple[dict, int]:
    """(sizes, global batch) of the LM track's official step: its seed at its seq_len, a byte
    vocabulary, the default global batch (aiperf_core.policy)."""
    from aiperf_core.policy import Policy
    from aiperf_core.workloads.lm import BITS_PER_BYTE, OFFICIAL_SEED, SEEDS

    policy = Policy({"workload": "lm"})
    sizes = dict(SEEDS[OFFICIAL_SEED], seq_len=policy["seq_len"], vocab=2 ** BITS_PER_BYTE)
    return sizes, policy["batch_size"]


def bench_shape(on_gpu: bool) -> tuple[dict, int, int, int]:
    """(GPT sizes, batch, warm-up steps, timed pairs) of this invocation (the module's docstring)."""
    if SMOKE:
        sizes, batch, warmup, pairs = SMOKE_SIZES, SMOKE_BATCH, WARMUP, 2
    elif on_gpu:
        (sizes, batch), warmup, pairs = official_shape(), WARMUP, 20
    elif OFFICIAL:
        sizes, batch, warmup, pairs = official_shape()[0], OFFICIAL_CPU_BATCH, OFFICIAL_CPU_WARMUP, 4
    else:
        sizes, batch, warmup, pairs = CPU_SIZES, CPU_BATCH, WARMUP, 12
    asked = option("batch")
    return sizes, int(asked) if asked else batch, warmup, int(os.environ.get("AIPERF_BENCH_STEPS", pairs))


def mfu_goal(backend: str, on_gpu: bool) -> float | None:
    """Issue 39's model-FLOP utilisation goal for the official shape: on a GPU every backend's, on a
    CPU torch's (--official); none for the other sizes."""
    if SMOKE:
        return None
    if on_gpu:
        return GPU_MFU_GOAL
    return CPU_MFU_GOAL if OFFICIAL and backend == "torch" else None


def chosen_backends() -> list[str]:
    names = option("backends")
    return list(PAIRS) if names is None else [b for b in names.split(",") if b]


CONVENTIONS = ("paper", "valid")  # the utilisation's counts: as scored; causal pairs only (docs/counting.md)


def training_ops_per_sequence(graph, convention: str = "paper") -> int:
    from aiperf_opcount import count

    totals = count(graph, convention)
    return totals.fp + totals.bp


def gemm_size(device: str) -> int:
    """The side of the peak's square product: on an accelerator gpu_throughput.py's, whose peak the
    GPU goal is stated against."""
    from aiperf_core.inventory import is_cpu_device

    return 256 if SMOKE else 2048 if is_cpu_device(device) else 8192


def gemm_shapes(device: str, sizes: dict, batch: int) -> dict[str, tuple[int, int, int]]:
    """The products the peak is measured on, name -> (m, k, n): the square one of gemm_size, and
    the GPT's own GEMMs at the step's tokens T = batch x seq_len and width h: the fused QKV
    (T x h by h x 3h), the MLP's up (T x h by h x 4h) and down (T x 4h by 4h x h) products, and the
    up product's weight gradient (h x T by T x 4h). Together they are most of the step's counted
    operations, so the peak is what the step's own products can do."""
    side, tokens, hidden = gemm_size(device), batch * sizes["seq_len"], sizes["hidden"]
    return {f"{side}x{side}": (side, side, side),
            "qkv T.h.3h": (tokens, hidden, 3 * hidden),
            "mlp-up T.h.4h": (tokens, hidden, 4 * hidden),
            "mlp-down T.4h.h": (tokens, 4 * hidden, hidden),
            "mlp-up grad h.T.4h": (hidden, tokens, 4 * hidden)}


def interleaved_peak(pair: Pair, shapes: dict[str, tuple[int, int, int]]) -> InterleavedPeak:
    """The pair's dense GEMM peak, probed between its steps: each probe times one product of each
    shape with Backend.matmul_seconds (as `aiperf peak`: inputs made and one product run untimed,
    then one timed), or under --cpu-time the pair's own product in CPU seconds."""
    if not CPU_TIME:
        def one(shape):
            return lambda: pair.backend.matmul_seconds(pair.device, pair.precision, shape, 1)[0]
    elif pair.product is None:
        raise ValueError(f"--cpu-time: the {pair.backend.name} pair has no product to time")
    else:
        def one(shape):
            product = pair.product(shape)
            product()  # warm-up: compilation, first-touch pages
            return lambda: cpu_seconds(product)
    return InterleavedPeak({name: (2 * m * k * n, one((m, k, n))) for name, (m, k, n) in shapes.items()})


def cpu_seconds(fn: Callable[[], Any]) -> float:
    """The process's CPU seconds (every thread's, user and system) during one call."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def option(name: str) -> str | None:
    """The value of --name=VALUE on the command line, None when absent."""
    return next((arg.split("=", 1)[1] for arg in sys.argv[1:] if arg.startswith(f"--{name}=")), None)


def bench_precision(backend, device: str) -> str:
    """--precision when given (it must be one the backend declares on `device`); else fp32 on a CPU
    (and in --smoke), where the mixed precisions are emulated or slower, and the backend's fastest
    declared precision on an accelerator."""
    from aiperf_core.inventory import is_cpu_device

    asked = option("precision")
    if asked is not None:
        declared = backend.precisions(device)
        if asked not in declared:
            raise ValueError(f"--precision {asked}: backend {backend.name} declares {', '.join(declared)} on {device}")
        return asked
    return "fp32" if SMOKE or is_cpu_device(device) else backend.fastest_precision(device)


# -- torch ----------------------------------------------------------------------------------------


def torch_gpt(torch, layers, hidden, heads, seq_len, vocab):
    """nanoGPT's model.py, reduced to what the IR's gpt has: pre-LN blocks, fused QKV, causal SDPA,
    tanh GELU, learned positions, an LM head without bias (untied, as the IR's)."""
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.c_attn, self.c_proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
            self.c_fc, self.mlp_proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(hidden, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(seq_len, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def torch_pair(graph, sizes, tokens, labels):
    import torch

    from aiperf_backends.torch import TorchBackend
    from aiperf_backends.torch.precision import autocast, compute_dtype, float32_math
    from aiperf_backends.torch.training import Stepper
    from aiperf_core.backend import TrainConfig

    batch = len(tokens)
    backend = TorchBackend()
    device_name = backend.devices()[0]
    precision = bench_precision(backend, device_name)
    model = backend.lower(graph, precision=precision)
    device = next(model.parameters()).device
    stepper = Stepper(model, device, TrainConfig(epochs=1, batch_size=batch, momentum=MOMENTUM, precision=precision),
                      compile=COMPILE)
    stepper.set_lr(LR)
    hand = torch_gpt(torch, **sizes).to(device)
    forward = torch.compile(hand) if COMPILE else hand
    # torch's default update (its per-tensor loop on a CPU) and the multi-tensor one the lowered step
    # uses: the faster is the reference, so the lowering does not win on its optimizer alone.
    optimizers = {"nanoGPT-style": torch.optim.SGD(hand.parameters(), lr=LR, momentum=MOMENTUM),
                  "nanoGPT-style, SGD(foreach=True)": torch.optim.SGD(hand.parameters(), lr=LR, momentum=MOMENTUM,
                                                                      foreach=True)}
    x, y = torch.from_numpy(tokens).to(device), torch.from_numpy(labels).to(device)

    def finish():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def lowered_step():
        stepper.step(x, y, batch)
        finish()

    def hand_step(optimizer):
        optimizer.zero_grad(set_to_none=True)
        with float32_math(device, precision == "tf32"), autocast(device, precision):
            logits = forward(x)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        finish()

    def product(shape):
        m, k, n = shape
        a, b = (torch.randn(*dims, device=device).to(compute_dtype(precision)) for dims in ((m, k), (k, n)))

        def one():
            with torch.no_grad(), float32_math(device, precision == "tf32"):
                torch.mm(a, b)
            finish()
        return one

    describe = (f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads"
                + (", both steps compiled" if COMPILE else ""))
    return Pair(backend, device_name, precision, describe, lowered_step,
                {name: partial(hand_step, opt) for name, opt in optimizers.items()},
                lambda: sum(p.numel() for p in hand.parameters()), product)


# -- jax ------------------------------------------------------------------------------------------


def flax_gpt(layers, hidden, heads, seq_len, vocab, dtype):
    """The same GPT as a Flax linen module, the way a Flax user writes one: a fused QKV Dense,
    jax.nn.dot_product_attention (is_causal) on its (B, T, N, H) layout, tanh GELU, LayerNorm, an
    untied LM head without bias. `dtype`: the compute dtype (None: float32); parameters float32."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            b, t, _ = x.shape
            q, k, v = jnp.split(nn.Dense(3 * hidden, dtype=dtype, name="c_attn")(nn.LayerNorm(1e-5)(x)), 3, axis=-1)
            y = jax.nn.dot_product_attention(*(z.reshape(b, t, heads, hidden // heads) for z in (q, k, v)),
                                             is_causal=True)
            x = x + nn.Dense(hidden, dtype=dtype, name="c_proj")(y.reshape(b, t, hidden))
            h = jax.nn.gelu(nn.Dense(4 * hidden, dtype=dtype, name="c_fc")(nn.LayerNorm(1e-5)(x)), approximate=True)
            return x + nn.Dense(hidden, dtype=dtype, name="mlp_proj")(h)

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, idx):
            x = nn.Embed(vocab, hidden, name="wte")(idx) + self.param(
                "wpe", nn.initializers.normal(0.02), (seq_len, hidden))
            for i in range(layers):
                x = Block(name=f"h{i}")(x)
            return nn.Dense(vocab, use_bias=False, dtype=dtype, name="lm_head")(nn.LayerNorm(1e-5)(x))

    return GPT()


def jax_pair(graph, sizes, tokens, labels):
    import jax
    import jax.numpy as jnp
    import optax

    from aiperf_backends.jax import JaxBackend
    from aiperf_backends.jax.lowering import compute_dtype, host_input, lax_precision
    from aiperf_backends.jax.training import make_train_step

    backend = JaxBackend()
    device_name = backend.devices()[0]
    precision = bench_precision(backend, device_name)
    model = backend.lower(graph, precision=precision)
    step = make_train_step(graph, precision, MOMENTUM, 0.0)
    params = jax.tree_util.tree_map(jnp.array, model.params)
    lowered = {"params": params, "velocity": jax.tree_util.tree_map(jnp.zeros_like, params), "state": model.state}
    x = jnp.asarray(host_input(graph, tokens))
    y = jnp.asarray(labels.astype(np.int32))
    lr, key, index = jnp.float32(LR), jax.random.PRNGKey(0), np.int32(0)

    net = flax_gpt(**sizes, dtype=compute_dtype(precision))
    hand = {"params": net.init(jax.random.PRNGKey(0), x[:1])["params"]}
    hand["velocity"] = jax.tree_util.tree_map(jnp.zeros_like, hand["params"])

    def hand_train(p, velocity, xb, yb):
        def loss_fn(p):
            logits = net.apply({"params": p}, xb).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        # The products at the backend's lax precision (IEEE float32 at fp32, as the lowered model's).
        with jax.default_matmul_precision(lax_precision(precision).name.lower()):
            loss, grads = jax.value_and_grad(loss_fn)(p)
        velocity = jax.tree_util.tree_map(lambda v, g: MOMENTUM * v + g, velocity, grads)
        return jax.tree_util.tree_map(lambda w, v: w - LR * v, p, velocity), velocity, loss

    hand_train = jax.jit(hand_train, donate_argnums=(0, 1))

    def lowered_step():
        lowered["params"], lowered["state"], lowered["velocity"], total = step(
            lowered["params"], lowered["state"], lowered["velocity"], x, y, lr, key, index)[:4]
        total.block_until_ready()

    def hand_step():
        hand["params"], hand["velocity"], loss = hand_train(hand["params"], hand["velocity"], x, y)
        loss.block_until_ready()

    dot = jax.jit(lambda a, b: jnp.matmul(a, b, precision=lax_precision(precision)))

    def product(shape):
        m, k, n = shape
        rng = np.random.default_rng(0)
        a, b = (jnp.asarray(rng.standard_normal(dims, dtype=np.float32)).astype(compute_dtype(precision) or jnp.float32)
                for dims in ((m, k), (k, n)))
        return lambda: dot(a, b).block_until_ready()

    describe = f"jax {jax.__version__} on {jax.local_devices()[0]}, jitted steps"
    return Pair(backend, device_name, precision, describe, lowered_step, {"flax": hand_step},
                lambda: sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(hand["params"])), product)


# -- tensorflow -----------------------------------------------------------------------------------


def keras_gpt(tf, layers, hidden, heads, seq_len, vocab, policy):
    """The same GPT as Keras layers, the way a Keras user writes one: a fused QKV Dense, the causal
    softmax attention written out with tf.matmul (Keras has no fused causal kernel for it), tanh
    GELU, LayerNormalization, an untied LM head without bias. `policy`: Keras' dtype policy
    ("float32", "mixed_bfloat16", "mixed_float16"); the attention scores are soft-maxed in float32."""
    keras = tf.keras
    head_dim = hidden // heads
    causal = tf.constant(np.tri(seq_len, dtype=bool))  # key j <= query i

    class CausalSelfAttention(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.c_attn = keras.layers.Dense(3 * hidden, dtype=policy)
            self.c_proj = keras.layers.Dense(hidden, dtype=policy)

        def call(self, x):
            n = tf.shape(x)[0]
            q, k, v = (tf.transpose(tf.reshape(t, [n, seq_len, heads, head_dim]), [0, 2, 1, 3])
                       for t in tf.split(self.c_attn(x), 3, axis=-1))
            scores = tf.cast(tf.matmul(q, k, transpose_b=True), tf.float32) * (head_dim ** -0.5)
            probs = tf.nn.softmax(tf.where(causal, scores, float("-inf")), axis=-1)
            y = tf.matmul(tf.cast(probs, v.dtype), v)
            return self.c_proj(tf.reshape(tf.transpose(y, [0, 2, 1, 3]), [n, seq_len, hidden]))

    class Block(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.ln_1 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy)
            self.ln_2 = keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy)
            self.attn = CausalSelfAttention(dtype=policy)
            self.c_fc = keras.layers.Dense(4 * hidden, dtype=policy)
            self.mlp_proj = keras.layers.Dense(hidden, dtype=policy)

        def call(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp_proj(tf.nn.gelu(self.c_fc(self.ln_2(x)), approximate=True))

    class GPT(keras.Model):
        def __init__(self):
            super().__init__()
            self.wte = keras.layers.Embedding(vocab, hidden, dtype=policy)
            self.wpe = keras.layers.Embedding(seq_len, hidden, dtype=policy)
            self.blocks = [Block(dtype=policy) for _ in range(layers)]
            self.ln_f = keras.layers.LayerNormalization(epsilon=1e-5, dtype=policy)
            self.lm_head = keras.layers.Dense(vocab, use_bias=False, dtype=policy)

        def call(self, idx):
            x = self.wte(idx) + self.wpe(tf.range(seq_len))
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


KERAS_POLICIES = {"fp32": "float32", "tf32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def tensorflow_pair(graph, sizes, tokens, labels):
    from aiperf_backends.tensorflow import TensorFlowBackend
    from aiperf_backends.tensorflow.backend import framework
    from aiperf_core.backend import TrainConfig

    if not TensorFlowBackend.availability().available:
        raise ImportError("tensorflow")
    tf = framework()  # configured as the backend runs it: oneDNN, threads
    from aiperf_backends.tensorflow.lowering import precision_scope, use_xla
    from aiperf_backends.tensorflow.training import Trainer

    backend = TensorFlowBackend()
    device_name = backend.devices()[0]
    precision = bench_precision(backend, device_name)
    model = backend.lower(graph, precision=precision)
    trainer = Trainer(model, TrainConfig(epochs=1, batch_size=len(tokens), momentum=MOMENTUM, precision=precision))
    batch = trainer.put(tokens, labels)

    with tf.device(trainer.device):
        hand = keras_gpt(tf, **sizes, policy=KERAS_POLICIES[precision])
        optimizer = tf.keras.optimizers.SGD(LR, momentum=MOMENTUM)
        if precision == "fp16":
            optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
        x, y = tf.identity(tokens), tf.identity(labels)

    # Compiled as the backend compiles its own step (XLA on GPUs, not on CPUs: lowering.use_xla).
    @tf.function(jit_compile=use_xla(device_name))
    def hand_train(x, y):
        with tf.GradientTape() as tape:
            logits = tf.cast(hand(x), tf.float32)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            scaled = optimizer.scale_loss(loss) if precision == "fp16" else loss
        optimizer.apply_gradients(zip(tape.gradient(scaled, hand.trainable_variables), hand.trainable_variables))
        return loss

    def lowered_step():
        float(trainer.step(batch, LR))  # float(): wait for the step

    def hand_step():
        with precision_scope(precision), tf.device(trainer.device):
            float(hand_train(x, y))

    describe = f"tensorflow {tf.__version__} on {trainer.device}, XLA {'on' if trainer.xla else 'off'}"
    return Pair(backend, device_name, precision, describe, lowered_step, {"Keras": hand_step}, hand.count_params)


# -- mindspore ------------------------------------------------------------------------------------


def mindspore_gpt(layers, hidden, heads, seq_len, vocab):
    """The same GPT as MindSpore cells, the way a MindSpore user writes one: a fused QKV nn.Dense, the
    causal softmax attention with ops.BatchMatMul (MindSpore's fused kernel, flash_attention_score, is
    Ascend-only), tanh GELU, nn.LayerNorm, an untied LM head without bias."""
    import math

    from mindspore import Parameter, Tensor, nn, ops
    from mindspore.common.initializer import Normal, initializer

    head_dim = hidden // heads

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm((hidden,), epsilon=1e-5), nn.LayerNorm((hidden,), epsilon=1e-5)
            self.c_attn, self.c_proj = nn.Dense(hidden, 3 * hidden), nn.Dense(hidden, hidden)
            self.c_fc, self.mlp_proj = nn.Dense(hidden, 4 * hidden), nn.Dense(4 * hidden, hidden)
            self.scores, self.mix = ops.BatchMatMul(transpose_b=True), ops.BatchMatMul()
            self.future = Tensor(np.triu(np.ones((seq_len, seq_len), np.bool_), 1))  # key j > query i

        def construct(self, x):
            n, t, c = x.shape
            q, k, v = (z.reshape(n, t, heads, head_dim).transpose(0, 2, 1, 3)
                       for z in ops.split(self.c_attn(self.ln_1(x)), hidden, axis=-1))
            scores = ops.masked_fill(self.scores(q, k) * (1.0 / math.sqrt(head_dim)), self.future, -math.inf)
            y = self.mix(ops.softmax(scores, axis=-1), v).transpose(0, 2, 1, 3).reshape(n, t, c)
            x = x + self.c_proj(y)
            return x + self.mlp_proj(ops.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Cell):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = Parameter(initializer(Normal(0.02), (seq_len, hidden)), name="wpe")
            self.blocks = nn.CellList([Block() for _ in range(layers)])
            self.ln_f = nn.LayerNorm((hidden,), epsilon=1e-5)
            self.lm_head = nn.Dense(hidden, vocab, has_bias=False)

        def construct(self, idx):
            x = self.wte(idx) + self.wpe
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def mindspore_pair(graph, sizes, tokens, labels):
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from aiperf_backends.mindspore import MindSporeBackend
    from aiperf_backends.mindspore.lowering import COMPUTE_DTYPES
    from aiperf_backends.mindspore.training import Stepper, targets
    from aiperf_core.backend import TrainConfig

    backend = MindSporeBackend()
    device_name = backend.devices()[0]
    precision = bench_precision(backend, device_name)
    model = backend.lower(graph, precision=precision)
    model.set_train(True)
    batch = len(tokens)
    stepper = Stepper(model, TrainConfig(epochs=1, batch_size=batch, momentum=MOMENTUM, precision=precision))
    stepper.set_lr(LR)
    x_lowered, y_lowered = model.to_cell_layout(tokens), targets(labels, sizes["vocab"], 0.0)

    hand = mindspore_gpt(**sizes)
    if precision != "fp32":  # O1: the products (MatMul, BatchMatMul) in the compute dtype, the rest float32
        hand = ms.amp.auto_mixed_precision(hand, "O1", dtype=COMPUTE_DTYPES[precision])
    hand.set_train(True)
    optimizer = nn.Momentum(hand.trainable_params(), learning_rate=LR, momentum=MOMENTUM)
    scaler = ms.amp.DynamicLossScaler(2.0 ** 16, 2, 1000) if precision == "fp16" else None
    x, y = Tensor(tokens.astype(np.int32)), Tensor(labels.reshape(-1).astype(np.int32))

    def forward(xb, yb):
        loss = ops.cross_entropy(hand(xb).astype(ms.float32).reshape(-1, sizes["vocab"]), yb)
        return scaler.scale(loss) if scaler is not None else loss

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    def lowered_step():
        stepper.step(x_lowered, y_lowered, batch)  # returns the loss as a float: waits for the step

    def hand_step():
        loss, grads = grad_fn(x, y)
        if scaler is not None:
            grads = scaler.unscale(grads)
            finite = ms.amp.all_finite(grads)
            scaler.adjust(finite)
            if not bool(finite):
                return
        optimizer(grads)
        loss.asnumpy()  # waits for the step

    describe = f"mindspore {ms.__version__} on {device_name}, PyNative (the backend's mode)"
    return Pair(backend, device_name, precision, describe, lowered_step, {"nn.Cell": hand_step},
                lambda: sum(int(np.prod(p.shape)) for p in hand.trainable_params()))


PAIRS = {"torch": torch_pair, "jax": jax_pair, "tensorflow": tensorflow_pair, "mindspore": mindspore_pair}


def bench_pair(name: str, pair: Pair, ops: dict[str, int], batch: int, warmup: int, steps: int,
               shapes: dict[str, tuple[int, int, int]], goal: float | None, parameters: int) -> list[str]:
    """Warm up, time the pairs with the peak probed between them, and report the ratio, the
    interleaved peak and the utilisation in each convention of `ops` (convention -> analytic
    operations of one training sequence). Returns the failures: a parameter count that differs
    from the IR's (`parameters`), a utilisation above 1 (the peak under-measured)."""
    peak = interleaved_peak(pair, shapes)
    for _ in range(warmup):
        pair.lowered_step()
        for step in pair.hand_steps.values():
            step()
        peak.probe()
    if pair.hand_parameters() != parameters:  # "of the same shape", checked
        return [f"{name}: the hand-written model has {pair.hand_parameters():,} parameters, the IR's {parameters:,}"]
    print(f"{pair.describe}; precision {pair.precision}; {steps} timed step pairs after {warmup} warm-up steps"
          f"{', timed in CPU seconds' if CPU_TIME else ''}; one product of each of {len(shapes)} GEMM shapes "
          f"between pairs; load average {os.getloadavg()[0]:.2f}", flush=True)
    label = f"{name} compiled" if COMPILE and name == "torch" else name
    rate = compare_training_throughput(label, batch, pair.lowered_step, pair.hand_steps, steps, model="gpt",
                                       unit=f"sequences/{'CPU-' if CPU_TIME else ''}s",
                                       timer=cpu_seconds if CPU_TIME else timed, between=peak.probe)
    best = peak.report(f"{label} dense GEMM peak, {pair.precision}, interleaved")
    return report_utilisation(label, rate, ops, best, goal, model="gpt")


def main() -> int:
    from aiperf_core.builders import gpt

    on_gpu = False
    try:
        import torch

        on_gpu = torch.cuda.is_available() and not SMOKE
    except ImportError:
        pass
    sizes, batch, warmup, steps = bench_shape(on_gpu)
    graph = gpt(**sizes)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, sizes["vocab"], (batch, sizes["seq_len"]))
    labels = rng.integers(0, sizes["vocab"], (batch, sizes["seq_len"]))
    ops = {convention: training_ops_per_sequence(graph, convention) for convention in CONVENTIONS}
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"GPT {sizes}, batch {batch}; analytic operations per training sequence (FP + BP): "
          + ", ".join(f"{count:,} ({convention})" for convention, count in ops.items()))
    failed = []
    for name in chosen_backends():
        if name not in PAIRS:
            failed.append(f"{name}: unknown backend (this script knows {', '.join(PAIRS)})")
            continue
        try:
            pair = PAIRS[name](graph, sizes, tokens, labels)
        except ImportError as exc:
            print(f"{name}: not installed ({exc}): skipped")
            continue
        except Exception as exc:  # one backend's failure must not hide the others' figures
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            continue
        try:
            failed += bench_pair(name, pair, ops, batch, warmup, steps, gemm_shapes(pair.device, sizes, batch),
                                 mfu_goal(name, on_gpu), graph.num_params())
        except Exception as exc:
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for line in failed:
        print(f"FAILED {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
