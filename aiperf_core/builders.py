"""Model builders: ResNet-50 in the Keras layout, and a small ResNet of the same family.

Keras layout: the stride of a downsampling bottleneck sits on its first 1x1 conv
(and on the projection shortcut), not on the 3x3 conv as in torchvision's v1.5.
Convs have no bias; each is followed by batch norm.
"""

from __future__ import annotations

from typing import Callable

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, Node

RESNET50_STAGES = ((3, (64, 64, 256)), (4, (128, 128, 512)), (6, (256, 256, 1024)), (3, (512, 512, 2048)))
SMALL_STAGES = ((1, (8, 8, 32)), (1, (16, 16, 64)), (1, (32, 32, 128)))


class _Builder:
    def __init__(self):
        self.nodes: list[Node] = []

    def add(self, node_id: str, op: str, inputs=(), **attrs) -> str:
        self.nodes.append(Node(node_id, op, tuple(inputs), attrs))
        return node_id

    def conv_bn(self, name: str, x: str, filters: int, kernel: int, stride: int, pad: int, relu: bool) -> str:
        x = self.add(
            f"{name}_conv", "conv2d", [x], filters=filters, kernel=[kernel, kernel],
            strides=[stride, stride], padding=[pad] * 4, use_bias=False,
        )
        x = self.add(f"{name}_bn", "batch_norm", [x], epsilon=1.001e-5, momentum=0.99)
        if relu:
            x = self.add(f"{name}_relu", "relu", [x])
        return x

    def bottleneck(self, name: str, x: str, filters: tuple[int, int, int], stride: int, project: bool) -> str:
        f1, f2, f3 = filters
        shortcut = x
        if project:
            shortcut = self.conv_bn(f"{name}_0", x, f3, 1, stride, 0, relu=False)
        y = self.conv_bn(f"{name}_1", x, f1, 1, stride, 0, relu=True)
        y = self.conv_bn(f"{name}_2", y, f2, 3, 1, 1, relu=True)
        y = self.conv_bn(f"{name}_3", y, f3, 1, 1, 0, relu=False)
        y = self.add(f"{name}_add", "add", [shortcut, y])
        return self.add(f"{name}_out", "relu", [y])

    def stages(self, x: str, stages, first_stride: int) -> str:
        for s, (blocks, filters) in enumerate(stages):
            for b in range(blocks):
                stride = (first_stride if s == 0 else 2) if b == 0 else 1
                x = self.bottleneck(f"conv{s + 2}_block{b + 1}", x, filters, stride, project=(b == 0))
        return x

    def head(self, x: str, classes: int) -> str:
        x = self.add("avg_pool", "global_avg_pool", [x])
        x = self.add("predictions", "dense", [x], units=classes, use_bias=True)
        return self.add("probs", "softmax", [x])


def _check(input_shape, classes: int, minimum: int, model: str) -> tuple[int, int, int]:
    shape = tuple(int(d) for d in input_shape)
    if len(shape) != 3:
        raise AiperfError(f"{model}: input shape must be HxWxC, got {list(shape)}")
    h, w, c = shape
    if h < minimum or w < minimum or c < 1:
        raise AiperfError(f"{model}: input must be at least {minimum}x{minimum}x1, got {h}x{w}x{c}")
    if classes < 1:
        raise AiperfError(f"{model}: classes must be >= 1, got {classes}")
    return shape


def resnet50(input_shape=(224, 224, 3), classes: int = 1000) -> Graph:
    shape = _check(input_shape, classes, 32, "resnet50")
    b = _Builder()
    x = b.add("input", "input", shape=list(shape))
    x = b.conv_bn("conv1", x, 64, 7, 2, 3, relu=True)
    x = b.add("pool1", "max_pool", [x], kernel=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
    x = b.stages(x, RESNET50_STAGES, first_stride=1)
    b.head(x, classes)
    return Graph(b.nodes, name="resnet50")


def resnet_small(input_shape=(32, 32, 3), classes: int = 10) -> Graph:
    """Three one-block bottleneck stages behind a 3x3 stem: ResNet-50's family at toy size."""
    shape = _check(input_shape, classes, 8, "resnet_small")
    b = _Builder()
    x = b.add("input", "input", shape=list(shape))
    x = b.conv_bn("conv1", x, 16, 3, 1, 1, relu=True)
    x = b.add("pool1", "max_pool", [x], kernel=[3, 3], strides=[2, 2], padding=[1, 1, 1, 1])
    x = b.stages(x, SMALL_STAGES, first_stride=1)
    b.head(x, classes)
    return Graph(b.nodes, name="resnet_small")


BUILDERS: dict[str, Callable[..., Graph]] = {"resnet50": resnet50, "resnet_small": resnet_small}


def build(name: str, input_shape=None, classes: int | None = None) -> Graph:
    try:
        builder = BUILDERS[name]
    except KeyError:
        raise AiperfError(f"unknown model '{name}' (builders: {', '.join(sorted(BUILDERS))})") from None
    kwargs = {}
    if input_shape is not None:
        kwargs["input_shape"] = input_shape
    if classes is not None:
        kwargs["classes"] = classes
    return builder(**kwargs)
