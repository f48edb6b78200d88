"""Training throughput of the IR-lowered ResNet-50 against a hand-written Keras ResNet-50 (TensorFlow).

Both are the Keras layout (stride on the first 1x1 conv of a downsampling bottleneck, no conv bias,
batch norm after every conv), 128x128x3 inputs, 1000 classes, batch 16, fp32, SGD with momentum
0.9, a couple of warm-up steps each. The lowered model trains through the backend's own compiled
step (training.Trainer.step: GradientTape, explicit torch-style momentum update, TF32 held off
by lowering.precision_scope, which costs nothing on a CPU); the hand-written
one is tf.keras layers (Conv2D, BatchNormalization, ...) with a tf.function step and Keras' SGD.
Both start from their own initialisation (weights do not change a step's time).

The timed steps come in pairs (one step of each model, in alternating order) and the ratio is the
median of the pairs' ratios, so that a pair's two steps see the same machine load.
AIPERF_BENCH_STEPS sets the number of pairs (default 10; well under 3 minutes on 2 CPU cores).

Goal: lowered / hand-written images per second >= 0.97.

Then the quick run's first round as `make run` trains it: ResNet-50 at 32x32 on digits (1,438
training and 359 validation images), batch 32, fp32, through the backend's own train(): one
epoch to trace and warm up, then AIPERF_BENCH_EPOCHS timed epochs (default 2). It reports the
median epoch's training images per wall second (training and evaluation included), the same
over the epoch's step time (StepClock), the first epoch's compile seconds, and whether TF's
oneDNN kernels are on (the backend turns them on on x86-64: docs/backends/tensorflow.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from _common import (compare_training_throughput, report, report_peak_fraction, square_product_peak,  # noqa: E402
                     training_ops_per_image)

BATCH = 16
SIZE = 128
CLASSES = 1000
WARMUP = 2
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "10"))
LR = 0.01
QUICK_SIZE = 32
QUICK_BATCH = 32  # examples/quick.toml's batch_size: the first round's
QUICK_EPOCHS = int(os.environ.get("AIPERF_BENCH_EPOCHS", "2"))


def keras_resnet50(tf, classes: int):
    layers = tf.keras.layers

    def conv_bn(x, filters, kernel, stride, padding="same"):
        x = layers.Conv2D(filters, kernel, strides=stride, padding=padding, use_bias=False)(x)
        return layers.BatchNormalization(epsilon=1.001e-5, momentum=0.99)(x)

    def block(x, filters, stride, project):
        f1, f2, f3 = filters
        shortcut = conv_bn(x, f3, 1, stride) if project else x
        y = layers.ReLU()(conv_bn(x, f1, 1, stride))
        y = layers.ReLU()(conv_bn(y, f2, 3, 1))
        y = conv_bn(y, f3, 1, 1)
        return layers.ReLU()(layers.Add()([y, shortcut]))

    inputs = tf.keras.Input((SIZE, SIZE, 3))
    x = layers.ZeroPadding2D(3)(inputs)
    x = layers.ReLU()(conv_bn(x, 64, 7, 2, padding="valid"))
    x = layers.ZeroPadding2D(1)(x)  # after a ReLU, zero padding is -inf padding for the max
    x = layers.MaxPooling2D(3, 2)(x)
    for s, (n, filters) in enumerate(((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)),
                                      (3, (512, 512, 2048)))):
        for b in range(n):
            stride = (1 if s == 0 else 2) if b == 0 else 1
            x = block(x, filters, stride, b == 0)
    x = layers.GlobalAveragePooling2D()(x)
    return tf.keras.Model(inputs, layers.Dense(classes)(x))


def quick_run_epochs(backend) -> None:
    """Epoch rates of the quick run's first round (see the module's docstring)."""
    import time

    from tensorflow.python.util import _pywrap_util_port

    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.builders import resnet50
    from aiperf_core.data.digits import load_digits

    data = load_digits(QUICK_SIZE)
    model = backend.lower(resnet50((QUICK_SIZE, QUICK_SIZE, 3), data.classes))
    walls, marks = [], [time.perf_counter()]

    def on_epoch(report):
        marks.append(time.perf_counter())
        walls.append((report, marks[-1] - marks[-2]))

    backend.train(model, data, TrainConfig(epochs=1 + QUICK_EPOCHS, batch_size=QUICK_BATCH,
                                           schedule=Schedule(initial=0.01)), on_epoch)
    first = walls[0][0]
    timed = sorted(walls[1:], key=lambda rw: rw[1])
    report_row, wall = timed[len(timed) // 2]
    print(f"quick run's first round: ResNet-50 {QUICK_SIZE}x{QUICK_SIZE} on digits, batch {QUICK_BATCH}, fp32; "
          f"oneDNN {'on' if _pywrap_util_port.IsMklEnabled() else 'OFF'}; median of {QUICK_EPOCHS} epochs after one")
    report("tensorflow quick-run epoch, wall", report_row.train_images / wall, "images/s", None, lower_is_better=False)
    report("tensorflow quick-run epoch, steps", report_row.train_images / report_row.step_seconds, "images/s", None,
           lower_is_better=False)
    report("tensorflow quick-run first epoch compile", first.compile_seconds, "s", None)


def main() -> int:
    from aiperf_backends.tensorflow import TensorFlowBackend

    if not TensorFlowBackend.availability().available:
        print("tensorflow is not installed: skipping the tensorflow throughput benchmark")
        return 0
    from aiperf_core.backend import TrainConfig
    from aiperf_core.builders import resnet50
    from aiperf_backends.tensorflow.backend import framework
    from aiperf_backends.tensorflow.training import Trainer

    tf = framework()
    backend = TensorFlowBackend()
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    lowered = backend.lower(graph)
    trainer = Trainer(lowered, TrainConfig(epochs=1, batch_size=BATCH, momentum=0.9))

    hand = keras_resnet50(tf, CLASSES)
    assert hand.count_params() == graph.num_params(trainable_only=False), (hand.count_params(), graph.num_params(False))
    optimizer = tf.keras.optimizers.SGD(LR, momentum=0.9)

    @tf.function
    def hand_step(x, y):
        with tf.GradientTape() as tape:
            logits = hand(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        optimizer.apply_gradients(zip(tape.gradient(loss, hand.trainable_variables), hand.trainable_variables))
        return loss

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH).astype(np.int64)
    xt, yt = tf.constant(x), tf.constant(labels)
    batch = trainer.put(x, labels)

    def lowered_once():
        float(trainer.step(batch, LR))  # float(): wait for the step

    def hand_once():
        float(hand_step(xt, yt))

    for _ in range(WARMUP):
        lowered_once()
        hand_once()
    print(f"tensorflow {tf.__version__} on {backend.devices()[0]}; ResNet-50 {SIZE}x{SIZE}, batch {BATCH}, fp32; "
          f"{STEPS} timed step pairs after {WARMUP} warm-up steps (medians)")
    a = tf.constant(rng.standard_normal((2048, 2048)).astype(np.float32))
    matmul = tf.function(lambda m: tf.reduce_sum(tf.linalg.matmul(m, m)))  # the sum forces the whole product
    peak = square_product_peak(lambda: float(matmul(a)))  # probed between the pairs
    lowered_rate = compare_training_throughput("tensorflow", BATCH, lowered_once, {"Keras": hand_once}, STEPS,
                                               between=peak.probe)
    failed = report_peak_fraction("tensorflow", lowered_rate, training_ops_per_image(graph), peak,
                                  valid_ops_per_image=training_ops_per_image(graph, "valid"))
    quick_run_epochs(backend)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
