"""Training throughput of the IR-lowered ResNet-50 against a hand-written Flax ResNet-50 (JAX backend).

Both are the Keras layout (stride on the first 1x1 conv of a downsampling bottleneck, no conv bias,
batch norm after every conv, epsilon 1.001e-5, momentum 0.99), 128x128x3 inputs, 1000 classes,
batch 16, fp32, SGD with momentum 0.9, on the default JAX device. The lowered model trains
through the backend's own jitted step (training.make_train_step); the hand-written one is a
flax.linen module trained by a jitted optax.sgd step, written the way a Flax user would. Each is
compiled and warmed up first (compile time is not timed).

The timed steps come in pairs (one step of each model, in alternating order) and the ratio is the
median of the pairs' ratios, as in torch_throughput.py: a pair's two steps see the same machine
load. AIPERF_BENCH_STEPS sets the number of pairs (default 8, under 3 minutes on 2 CPU cores).

Goal: lowered / hand-written images per second >= 0.97.

Then the backend's own train() on synthetic data (uint8 pixels made once on the device, sliced per
step, normalised inside the step): the wall rate of a second one-epoch train() call (the first
compiles), AIPERF_BENCH_STEPS batches and one validation image, against the lowered step's rate
from the pairs (issue 17's goal for a run on synthetic data: >= 0.95).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import (compare_training_throughput, report, report_peak_fraction, square_product_peak,  # noqa: E402
                     timed, training_ops_per_image)

BATCH = 16
SIZE = 128
CLASSES = 1000
WARMUP = 1
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "8"))  # timed (lowered, hand-written) pairs
LR = 0.01
MOMENTUM = 0.9


def hand_written_resnet50(classes: int):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class ConvBN(nn.Module):
        filters: int
        kernel: int
        stride: int
        pad: int

        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.Conv(self.filters, (self.kernel, self.kernel), (self.stride, self.stride),
                        padding=((self.pad, self.pad), (self.pad, self.pad)), use_bias=False)(x)
            return nn.BatchNorm(use_running_average=not train, momentum=0.99, epsilon=1.001e-5)(x)

    class Bottleneck(nn.Module):
        filters: tuple
        stride: int
        project: bool

        @nn.compact
        def __call__(self, x, train: bool):
            f1, f2, f3 = self.filters
            shortcut = ConvBN(f3, 1, self.stride, 0)(x, train) if self.project else x
            y = jax.nn.relu(ConvBN(f1, 1, self.stride, 0)(x, train))
            y = jax.nn.relu(ConvBN(f2, 3, 1, 1)(y, train))
            y = ConvBN(f3, 1, 1, 0)(y, train)
            return jax.nn.relu(y + shortcut)

    class ResNet50(nn.Module):
        classes: int

        @nn.compact
        def __call__(self, x, train: bool = True):
            x = jax.nn.relu(ConvBN(64, 7, 2, 3)(x, train))
            x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for s, (n, filters) in enumerate(((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)),
                                              (3, (512, 512, 2048)))):
                for b in range(n):
                    stride = (1 if s == 0 else 2) if b == 0 else 1
                    x = Bottleneck(filters, stride, b == 0)(x, train)
            x = jnp.mean(x, axis=(1, 2))
            return nn.Dense(self.classes)(x)

    return ResNet50(classes)


def train_on_device_synthetic(backend, graph, step_rate: float) -> None:
    """train()'s epoch wall rate on device-resident synthetic data, and its ratio to the bare step."""
    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.data.stream import StreamingDataset
    from aiperf_core.data.synthetic import SyntheticSource

    data = StreamingDataset(SyntheticSource(classes=CLASSES, train_images=STEPS * BATCH, val_images=1),
                            image_size=SIZE, workers=0)
    config = TrainConfig(epochs=1, batch_size=BATCH, schedule=Schedule(initial=LR), momentum=MOMENTUM)
    model = backend.lower(graph)
    first = backend.train(model, data, config)[0]  # compiles the step and the evaluation
    start = time.perf_counter()
    (epoch,) = backend.train(model, data, config)
    wall = time.perf_counter() - start
    print(f"train() on synthetic data: first epoch compiled for {first.compile_seconds:.1f} s; the second "
          f"{epoch.train_images} images in {wall:.1f} s (compile {epoch.compile_seconds:.1f} s)")
    rate = epoch.train_images / wall
    report("jax train() on device synthetic data, epoch wall rate", rate, "images/s", None, lower_is_better=False)
    report("jax train() synthetic epoch rate / lowered step rate", rate / step_rate, "ratio", 0.95,
           lower_is_better=False)


def main() -> int:
    try:
        import jax
        import jax.numpy as jnp
        import optax
    except ImportError:
        print("jax/flax are not installed: skipping the jax throughput benchmark")
        return 0
    from aiperf_core.builders import resnet50
    from aiperf_backends.jax import JaxBackend
    from aiperf_backends.jax.training import make_train_step

    backend = JaxBackend()
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    lowered = backend.lower(graph)
    step = make_train_step(graph, "fp32", MOMENTUM, 0.0)
    params = jax.tree_util.tree_map(jnp.array, lowered.params)
    state = lowered.state
    velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
    lr = jnp.float32(LR)
    key = jax.random.PRNGKey(0)
    index = np.int32(0)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, CLASSES, BATCH).astype(np.int32))

    net = hand_written_resnet50(CLASSES)
    variables = net.init(jax.random.PRNGKey(0), x[:1], train=False)
    h_params, h_stats = variables["params"], variables["batch_stats"]
    tx = optax.sgd(LR, momentum=MOMENTUM)
    h_opt = tx.init(h_params)

    def h_loss(p, stats, xb, yb):
        logits, updates = net.apply({"params": p, "batch_stats": stats}, xb, train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
        return loss, updates["batch_stats"]

    def h_step(p, stats, opt, xb, yb):
        (loss, stats), grads = jax.value_and_grad(h_loss, has_aux=True)(p, stats, xb, yb)
        updates, opt = tx.update(grads, opt, p)
        return optax.apply_updates(p, updates), stats, opt, loss

    h_step = jax.jit(h_step, donate_argnums=(0, 2))
    carry = {"low": (params, state, velocity), "hand": (h_params, h_stats, h_opt)}

    def lowered_step():
        p, s, v = carry["low"]
        p, s, v, total = step(p, s, v, x, labels, lr, key, index)[:4]
        total.block_until_ready()
        carry["low"] = (p, s, v)

    def hand_step():
        p, s, o = carry["hand"]
        p, s, o, loss = h_step(p, s, o, x, labels)
        loss.block_until_ready()
        carry["hand"] = (p, s, o)

    compile_low = timed(lowered_step)
    compile_hand = timed(hand_step)
    for _ in range(WARMUP):
        lowered_step()
        hand_step()
    device = jax.local_devices()[0]
    print(f"jax {jax.__version__} on {device.platform} ({jax.device_count()} device(s)); ResNet-50 {SIZE}x{SIZE}, "
          f"batch {BATCH}, fp32; first step (compile) {compile_low:.1f} s lowered, {compile_hand:.1f} s hand-written; "
          f"{STEPS} timed step pairs after {WARMUP} warm-up steps (medians)")
    a = jnp.asarray(np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32))
    matmul = jax.jit(jnp.matmul)
    peak = square_product_peak(lambda: matmul(a, a).block_until_ready())  # probed between the pairs
    lowered_rate = compare_training_throughput("jax", BATCH, lowered_step, {"flax": hand_step}, STEPS,
                                               between=peak.probe)
    train_on_device_synthetic(backend, graph, lowered_rate)
    failed = report_peak_fraction("jax", lowered_rate, training_ops_per_image(graph), peak,
                                  valid_ops_per_image=training_ops_per_image(graph, "valid"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
