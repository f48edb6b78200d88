"""Training throughput of the IR-lowered ResNet-50 against a hand-written Keras ResNet-50 (TensorFlow).

Both are the Keras layout (stride on the first 1x1 conv of a downsampling bottleneck, no conv bias,
batch norm after every conv), 128x128x3 inputs, 1000 classes, batch 16, fp32, SGD with momentum
0.9, a couple of warm-up steps each. The lowered model trains through the backend's own compiled
step (training.Trainer.step: GradientTape, explicit torch-style momentum update); the hand-written
one is tf.keras layers (Conv2D, BatchNormalization, ...) with a tf.function step and Keras' SGD.
Both start from their own initialisation (weights do not change a step's time).

The timed steps come in pairs (one step of each model, in alternating order) and the ratio is the
median of the pairs' ratios, so that a pair's two steps see the same machine load.
AIPERF_BENCH_STEPS sets the number of pairs (default 10; well under 3 minutes on 2 CPU cores).

Goal: lowered / hand-written images per second >= 0.97.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from _common import compare_training_throughput, report_peak_fraction, training_ops_per_image  # noqa: E402

BATCH = 16
SIZE = 128
CLASSES = 1000
WARMUP = 2
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "10"))
LR = 0.01


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


def main() -> int:
    from aiperf_backends.tensorflow import TensorFlowBackend

    if not TensorFlowBackend.availability().available:
        print("tensorflow is not installed: skipping the tensorflow throughput benchmark")
        return 0
    from aiperf_core.backend import TrainConfig
    from aiperf_core.builders import resnet50
    from aiperf_backends.tensorflow.backend import _tf
    from aiperf_backends.tensorflow.training import Trainer

    tf = _tf()
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

    def lowered_once():
        float(trainer.step(x, labels, LR))  # float(): wait for the step

    def hand_once():
        float(hand_step(xt, yt))

    for _ in range(WARMUP):
        lowered_once()
        hand_once()
    print(f"tensorflow {tf.__version__} on {backend.devices()[0]}; ResNet-50 {SIZE}x{SIZE}, batch {BATCH}, fp32; "
          f"{STEPS} timed step pairs after {WARMUP} warm-up steps (medians)")
    lowered_rate = compare_training_throughput("tensorflow", BATCH, lowered_once, {"Keras": hand_once}, STEPS)
    a = tf.constant(rng.standard_normal((2048, 2048)).astype(np.float32))
    matmul = tf.function(lambda m: tf.reduce_sum(tf.linalg.matmul(m, m)))  # the sum forces the whole product
    report_peak_fraction("tensorflow", lowered_rate, training_ops_per_image(graph),
                         lambda: float(matmul(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
