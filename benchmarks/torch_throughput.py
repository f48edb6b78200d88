"""Training throughput of the IR-lowered ResNet-50 against a hand-written PyTorch ResNet-50.

Both are the Keras layout (stride on the first 1x1 conv of a downsampling bottleneck, no conv bias,
batch norm after every conv), 128x128x3 inputs, 1000 classes, batch 16, fp32, SGD with momentum,
same initial weights, a couple of warm-up steps each. The lowered model trains through the
backend's own step (training.Stepper), the hand-written one through a plain torch loop.

The hand-written model gets the lowered model's CPU conv workaround (issue 18.1): where the
backend's start-up probe finds this CPU's channels_last kernel wrong for a conv geometry, that conv
of the hand-written model runs in the same fallback form (conv_probe.run_conv), so like is compared
with like. The hand-written model runs in both memory formats (contiguous NCHW and channels_last)
and the lowered one is compared with the faster of the two (_common.compare_training_throughput: timed
step pairs, median of the pairs' ratios). AIPERF_BENCH_STEPS sets the number of pairs (default
24, about a minute on 2 idle CPU cores).

Goal: lowered / hand-written images per second >= 0.97.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np  # noqa: E402

from _common import (compare_training_throughput, report_peak_fraction, square_product_peak,  # noqa: E402
                     training_ops_per_image)

BATCH = 16
SIZE = 128
CLASSES = 1000
WARMUP = 2
FORMAT_STEPS = 3  # per memory format of the hand-written model, to pick the faster
STEPS = int(os.environ.get("AIPERF_BENCH_STEPS", "24"))  # timed (lowered, hand-written) pairs
LR = 0.01


def hand_written_resnet50(torch, classes: int):
    nn = torch.nn

    def conv_bn(cin, cout, k, s, p):
        return [nn.Conv2d(cin, cout, k, s, p, bias=False), nn.BatchNorm2d(cout, eps=1.001e-5, momentum=0.01)]

    class Bottleneck(nn.Module):
        def __init__(self, cin, filters, stride, project):
            super().__init__()
            f1, f2, f3 = filters
            self.shortcut = nn.Sequential(*conv_bn(cin, f3, 1, stride, 0)) if project else None
            self.conv1, self.bn1 = conv_bn(cin, f1, 1, stride, 0)
            self.conv2, self.bn2 = conv_bn(f1, f2, 3, 1, 1)
            self.conv3, self.bn3 = conv_bn(f2, f3, 1, 1, 0)

        def forward(self, x):
            shortcut = self.shortcut(x) if self.shortcut is not None else x
            y = torch.relu_(self.bn1(self.conv1(x)))
            y = torch.relu_(self.bn2(self.conv2(y)))
            y = self.bn3(self.conv3(y))
            return torch.relu_(y.add_(shortcut))

    class ResNet50(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = conv_bn(3, 64, 7, 2, 3)
            blocks, cin = [], 64
            for s, (n, filters) in enumerate(((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)),
                                              (3, (512, 512, 2048)))):
                for b in range(n):
                    stride = (1 if s == 0 else 2) if b == 0 else 1
                    blocks.append(Bottleneck(cin, filters, stride, b == 0))
                    cin = filters[2]
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(2048, classes)

        def forward(self, x):
            x = torch.relu_(self.bn1(self.conv1(x)))
            x = nn.functional.max_pool2d(x, 3, 2, 1)
            x = self.blocks(x)
            return self.fc(x.mean(dim=(2, 3)))

    return ResNet50()


def probed_convs(torch, hand, device) -> list[str]:
    """Run each conv of the hand-written model in the form the backend's CPU probe chose for its
    geometry (channels_last unless this CPU's kernel is wrong there); returns what was changed."""
    from aiperf_backends.torch import conv_probe

    if device.type != "cpu":
        return []
    convs = [m for m in hand.modules() if isinstance(m, torch.nn.Conv2d)]
    geometry = {id(m): conv_probe.ConvGeometry(m.in_channels, m.out_channels, tuple(m.kernel_size),
                                               tuple(m.stride), tuple(m.padding)) for m in convs}
    forms = conv_probe.conv_forms(geometry.values(), torch.float32)
    changed = []
    for m in convs:
        form = forms[geometry[id(m)]]
        if form != conv_probe.CHANNELS_LAST:
            m.forward = (lambda x, m=m, form=form: conv_probe.run_conv(
                torch.nn.functional.conv2d, form, x, m.weight, m.bias, m.stride, m.padding))
            changed.append(f"{geometry[id(m)].describe()}: {form}")
    return changed


def copy_weights(torch, hand, lowered) -> None:
    """Give the hand-written model the lowered model's weights (same architecture, same order)."""
    src = [m for m in lowered.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear))]
    dst = [m for m in hand.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear))]
    # The lowered model holds the shortcut conv of a block before its main path, as the IR does;
    # so does the hand-written one (self.shortcut is created first).
    assert len(src) == len(dst), (len(src), len(dst))
    with torch.no_grad():
        for s, d in zip(src, dst):
            for name, tensor in list(s.named_parameters()) + list(s.named_buffers()):
                getattr(d, name).copy_(tensor)


def main() -> int:
    try:
        import torch
    except ImportError:
        print("torch is not installed: skipping the torch throughput benchmark")
        return 0
    from aiperf_core.backend import TrainConfig
    from aiperf_core.builders import resnet50
    from aiperf_backends.torch import TorchBackend
    from aiperf_backends.torch.training import Stepper

    backend = TorchBackend()
    graph = resnet50((SIZE, SIZE, 3), CLASSES)
    lowered = backend.lower(graph)
    device = next(lowered.parameters()).device
    config = TrainConfig(epochs=1, batch_size=BATCH, momentum=0.9)
    stepper = Stepper(lowered, device, config)
    stepper.set_lr(LR)

    hands = {}
    for fmt in ("contiguous", "channels_last"):
        hand = hand_written_resnet50(torch, CLASSES).to(device)
        copy_weights(torch, hand, lowered)
        if fmt == "channels_last":
            hand = hand.to(memory_format=torch.channels_last)
            for change in probed_convs(torch, hand, device):
                print(f"hand-written (channels_last) conv {change}, as the lowered model's")
        hands[fmt] = (hand, torch.optim.SGD(hand.parameters(), lr=LR, momentum=0.9))

    rng = np.random.default_rng(0)
    x_nhwc = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    labels = torch.from_numpy(rng.integers(0, CLASSES, BATCH)).to(device)
    x_lowered = torch.from_numpy(x_nhwc).to(device)  # the IR's NHWC batch, as train() feeds it
    x_hand = {"contiguous": torch.from_numpy(np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2))).to(device)}
    x_hand["channels_last"] = x_hand["contiguous"].contiguous(memory_format=torch.channels_last)

    def finish():  # each timed call waits for its own result (timed's contract)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def lowered_step():
        stepper.step(x_lowered, labels, BATCH)
        finish()

    def hand_step(fmt):
        hand, opt = hands[fmt]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(hand(x_hand[fmt]), labels).backward()
        opt.step()
        finish()

    for _ in range(WARMUP):
        lowered_step()
        hand_step("contiguous")
        hand_step("channels_last")
    print(f"torch {torch.__version__} on {device}, {torch.get_num_threads()} threads; ResNet-50 {SIZE}x{SIZE}, "
          f"batch {BATCH}, fp32; {STEPS} timed step pairs after {WARMUP} warm-up steps (medians)")
    formats = ("contiguous", "channels_last")
    a, b = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    peak = square_product_peak(lambda: (torch.mm(a, b), finish()))  # probed between the pairs
    lowered_rate = compare_training_throughput("torch", BATCH, lowered_step,
                                               {fmt: (lambda fmt=fmt: hand_step(fmt)) for fmt in formats}, STEPS,
                                               probe_steps=FORMAT_STEPS, between=peak.probe)
    failed = report_peak_fraction("torch", lowered_rate, training_ops_per_image(graph), peak,
                                  valid_ops_per_image=training_ops_per_image(graph, "valid"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
