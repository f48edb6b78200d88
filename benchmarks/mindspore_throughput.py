"""Training throughput of the IR-lowered ResNet-50 against a hand-written MindSpore ResNet-50.

Both are the Keras layout (stride on the first 1x1 conv of a downsampling bottleneck, no conv bias,
batch norm after every conv, epsilon 1.001e-5, momentum 0.99), 128x128x3 inputs, 1000 classes,
batch 16, fp32, SGD with momentum 0.9 (nn.Momentum), same initial weights, on MindSpore's device
(CPU here). The lowered model trains through the backend's own step (training.Stepper, which
also takes the NHWC batch, after the one-hot targets are made, as train() does); the hand-written one is
nn.Conv2d / nn.BatchNorm2d / nn.Dense cells trained by ms.value_and_grad and nn.Momentum, written
the way a MindSpore user would, on an NCHW batch prepared once.

The hand-written model runs in PyNative mode and, as a MindSpore user might also run it, with its
whole train step compiled by ``ms.jit`` (graph mode); the lowered one is compared with the faster of
the two, so an execution-mode choice cannot flatter the ratio. The timed steps come in pairs (one
step of each model, in alternating order) and the ratio is the median of the pairs' ratios, as in
torch_throughput.py: a pair's two steps see the same machine load. AIPERF_BENCH_STEPS sets the
number of pairs (default 4: on 2 CPU cores one ResNet-50 step takes about 2 s since the backend caps
MindSpore's oneDNN at AVX2 on AVX-512 CPUs, where it took a minute; the first graph-mode step compiles).

Goal: lowered / hand-written images per second >= 0.97. Item e: the lowered model's achieved
analytic OPS against MindSpore's own 2048x2048 fp32 matrix product (_common.report_peak_fraction).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import (compare_training_throughput, report_peak_fraction, square_product_peak, timed,  # noqa: E402
                     training_ops_per_image)

BATCH = 16
SIZE = 128
CLASSES = 1000
WARMUP = 0  # the untimed first steps (kernel selection, graph compilation) are the warm-up
MODE_STEPS = 1  # per execution mode of the hand-written model, to pick the faster
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "4"))  # timed (lowered, hand-written) pairs
LR = 0.01
MOMENTUM = 0.9


def hand_written_resnet50(classes: int):
    from mindspore import nn, ops

    def conv_bn(cin, cout, k, s, p):
        return nn.SequentialCell([nn.Conv2d(cin, cout, k, s, pad_mode="pad", padding=p, has_bias=False),
                                  nn.BatchNorm2d(cout, eps=1.001e-5, momentum=0.99)])

    class Bottleneck(nn.Cell):
        def __init__(self, cin, filters, stride, project):
            super().__init__()
            f1, f2, f3 = filters
            self.shortcut = conv_bn(cin, f3, 1, stride, 0) if project else None
            self.branch1 = conv_bn(cin, f1, 1, stride, 0)
            self.branch2 = conv_bn(f1, f2, 3, 1, 1)
            self.branch3 = conv_bn(f2, f3, 1, 1, 0)
            self.relu = nn.ReLU()

        def construct(self, x):
            shortcut = self.shortcut(x) if self.shortcut is not None else x
            y = self.relu(self.branch1(x))
            y = self.relu(self.branch2(y))
            return self.relu(self.branch3(y) + shortcut)

    class ResNet50(nn.Cell):
        def __init__(self):
            super().__init__()
            self.stem = conv_bn(3, 64, 7, 2, 3)
            self.relu = nn.ReLU()
            self.pool = nn.MaxPool2d(3, 2, pad_mode="pad", padding=1)
            blocks, cin = [], 64
            for s, (n, filters) in enumerate(((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)),
                                              (3, (512, 512, 2048)))):
                for b in range(n):
                    stride = (1 if s == 0 else 2) if b == 0 else 1
                    blocks.append(Bottleneck(cin, filters, stride, b == 0))
                    cin = filters[2]
            self.blocks = nn.SequentialCell(blocks)
            self.fc = nn.Dense(2048, classes)

        def construct(self, x):
            x = self.pool(self.relu(self.stem(x)))
            x = self.blocks(x)
            return self.fc(ops.mean(x, axis=(2, 3)))

    return ResNet50()


def copy_weights(hand, lowered) -> None:
    """Give the hand-written model the lowered model's weights (same architecture, same order).

    The lowered model holds a downsampling block's shortcut conv before its main path, as the IR
    does; so does the hand-written one (self.shortcut is created first)."""
    from mindspore import Tensor, nn

    from aiperf_backends.mindspore.lowering import BatchNorm, Conv, Dense

    names = {Conv: {"weight": "kernel"}, Dense: {"weight": "kernel", "bias": "bias"},
             BatchNorm: {p: p for p in ("gamma", "beta", "moving_mean", "moving_variance")}}
    src = [c for c in lowered.layers if type(c) in names]
    dst = [c for _, c in hand.cells_and_names() if isinstance(c, (nn.Conv2d, nn.BatchNorm2d, nn.Dense))]
    assert len(src) == len(dst), (len(src), len(dst))
    for s, d in zip(src, dst):
        for mine, theirs in names[type(s)].items():
            value = getattr(s, theirs).asnumpy()
            target = getattr(d, mine)
            assert tuple(target.shape) == value.shape, (target.name, target.shape, value.shape)
            target.set_data(Tensor(value))


def main() -> int:
    try:
        import mindspore as ms
        from mindspore import Tensor, nn, ops
    except ImportError:
        print("mindspore is not installed: skipping the mindspore throughput benchmark")
        return 0
    from aiperf_core.backend import TrainConfig
    from aiperf_core.builders import resnet50
    from aiperf_backends.mindspore import MindSporeBackend
    from aiperf_backends.mindspore.training import Stepper, targets

    backend = MindSporeBackend()
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    lowered = backend.lower(graph)
    lowered.set_train(True)
    stepper = Stepper(lowered, TrainConfig(epochs=1, batch_size=BATCH, momentum=MOMENTUM))
    stepper.set_lr(LR)

    hand = hand_written_resnet50(CLASSES)
    copy_weights(hand, lowered)
    hand.set_train(True)
    optimizer = nn.Momentum(hand.trainable_params(), learning_rate=LR, momentum=MOMENTUM)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def forward(x, y):
        return loss_fn(hand(x), y)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        return loss

    steps = {"pynative": train_step, "graph (ms.jit)": ms.jit(train_step)}

    rng = np.random.default_rng(0)
    x_nhwc = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH)
    x_hand = Tensor(np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2)))
    y_hand = Tensor(labels.astype(np.int32))

    def lowered_step():
        stepper.step(x_nhwc, targets(labels, CLASSES, 0.0), BATCH)

    def hand_step(mode):
        steps[mode](x_hand, y_hand).asnumpy()  # asnumpy waits for the step to finish

    first = {"lowered": timed(lowered_step)}
    print(f"first lowered step {first['lowered']:.1f} s", flush=True)
    for mode in steps:
        first[mode] = timed(lambda: hand_step(mode))  # includes graph compilation for ms.jit
        print(f"first hand-written {mode} step {first[mode]:.1f} s", flush=True)
    for _ in range(WARMUP):
        lowered_step()
        for mode in steps:
            hand_step(mode)
    print(f"mindspore {ms.__version__} on {backend.devices()[0]}; ResNet-50 {SIZE}x{SIZE}, batch {BATCH}, fp32; "
          f"{STEPS} timed step pairs after {WARMUP} warm-up steps (medians)", flush=True)
    a = Tensor(np.random.default_rng(1).standard_normal((2048, 2048), dtype=np.float32))
    peak = square_product_peak(lambda: ops.matmul(a, a).asnumpy())  # asnumpy waits; probed between the pairs
    lowered_rate = compare_training_throughput(
        "mindspore", BATCH, lowered_step, {mode: (lambda mode=mode: hand_step(mode)) for mode in steps}, STEPS,
        probe_steps=MODE_STEPS, between=peak.probe)
    failed = report_peak_fraction("mindspore", lowered_rate, training_ops_per_image(graph), peak,
                                  valid_ops_per_image=training_ops_per_image(graph, "valid"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
