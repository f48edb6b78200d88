"""The op-level cases: one small graph per case, data-driven like ONNX's node tests.

Each case is an input followed by the op under test (named 'op'); `with_head` appends a flatten,
a dense layer and a softmax so that the op's backward can be checked through the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aiperf_core.ir import Graph, Node


@dataclass(frozen=True)
class OpCase:
    name: str
    input_shape: tuple[int, ...]
    nodes: tuple[Node, ...]  # between the input 'x' and the sink; the op under test is 'op'
    # Training-mode dropout draws a random mask, which no two frameworks draw alike, so a stochastic
    # op's backward cannot be compared element by element with the reference.
    stochastic: bool = False

    def graph(self) -> Graph:
        return Graph((Node("x", "input", (), {"shape": list(self.input_shape)}),) + self.nodes, name=self.name)

    def with_head(self, classes: int = 3) -> Graph:
        g = self.graph()
        last = g.output_id
        tail: list[Node] = []
        if len(g.output_shape) == 3:
            tail.append(Node("head_flat", "flatten", (last,), {}))
            last = "head_flat"
        tail += [Node("head_dense", "dense", (last,), {"units": classes}),
                 Node("head_probs", "softmax", ("head_dense",), {})]
        return Graph(g.nodes + tuple(tail), name=f"{self.name}_head")


def _conv(name, size, cin, filters, kernel, strides, padding, bias=False):
    return OpCase(name, (size[0], size[1], cin), (
        Node("op", "conv2d", ("x",), {"filters": filters, "kernel": list(kernel), "strides": list(strides),
                                       "padding": list(padding), "use_bias": bias}),))


def _pool(name, size, c, kernel, strides, padding):
    return OpCase(name, (size[0], size[1], c), (
        Node("op", "max_pool", ("x",), {"kernel": list(kernel), "strides": list(strides), "padding": list(padding)}),))


def _unary(name, shape, op, **attrs):
    return OpCase(name, shape, (Node("op", op, ("x",), attrs),))


OP_CASES: tuple[OpCase, ...] = (
    _conv("conv_1x1", (6, 6), 3, 4, (1, 1), (1, 1), (0, 0, 0, 0)),
    _conv("conv_3x3_same", (7, 7), 3, 5, (3, 3), (1, 1), (1, 1, 1, 1), bias=True),
    _conv("conv_3x3_stride2_even", (8, 8), 2, 4, (3, 3), (2, 2), (1, 1, 1, 1)),
    _conv("conv_3x3_stride2_asym", (8, 8), 2, 4, (3, 3), (2, 2), (0, 1, 0, 1)),
    _conv("conv_5x5_asym", (9, 7), 3, 3, (5, 5), (1, 1), (1, 2, 0, 1)),
    _conv("conv_7x7_stride2", (16, 16), 3, 4, (7, 7), (2, 2), (3, 3, 3, 3)),
    _conv("conv_3x1_nonsquare", (6, 5), 2, 3, (3, 1), (1, 2), (1, 1, 0, 0), bias=True),
    _conv("conv_1x1_stride2", (8, 8), 4, 6, (1, 1), (2, 2), (0, 0, 0, 0)),
    _unary("batch_norm", (5, 5, 4), "batch_norm", epsilon=1e-3),
    _unary("batch_norm_flat", (6,), "batch_norm", epsilon=1e-5),
    _unary("relu", (5, 5, 3), "relu"),
    _pool("max_pool_3x3_stride2_even", (8, 8), 3, (3, 3), (2, 2), (1, 1, 1, 1)),
    _pool("max_pool_2x2", (6, 6), 2, (2, 2), (2, 2), (0, 0, 0, 0)),
    _pool("max_pool_3x3_asym", (7, 6), 2, (3, 3), (2, 1), (0, 1, 1, 0)),
    _unary("global_avg_pool", (5, 4, 3), "global_avg_pool"),
    _unary("flatten", (3, 4, 2), "flatten"),
    _unary("dense", (7,), "dense", units=5),
    _unary("softmax", (6,), "softmax"),
    OpCase("dropout_inference", (4, 4, 2), (Node("op", "dropout", ("x",), {"rate": 0.3}),), stochastic=True),
    OpCase("add_two", (5, 5, 3), (Node("r", "relu", ("x",), {}), Node("op", "add", ("x", "r"), {}))),
    OpCase("add_three", (4, 4, 2), (Node("r", "relu", ("x",), {}), Node("m", "max_pool", ("x",), {
        "kernel": [3, 3], "strides": [1, 1], "padding": [1, 1, 1, 1]}), Node("op", "add", ("x", "r", "m"), {}))),
    OpCase("concat", (4, 4, 2), (Node("c", "conv2d", ("x",), {"filters": 3, "kernel": [1, 1]}),
                                 Node("op", "concat", ("x", "c"), {}))),
)


def trained_looking_weights(graph: Graph, seed: int) -> dict:
    """Random weights with non-trivial BN statistics, as a trained network has."""
    from aiperf_core.weights import init_weights

    rng = np.random.default_rng(seed)
    weights = init_weights(graph, seed=seed)
    for node_id, params in weights.items():
        for name, value in params.items():
            shape = value.shape
            if name == "gamma":
                params[name] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
            elif name in ("beta", "moving_mean", "bias"):
                params[name] = rng.normal(0, 0.2, shape).astype(np.float32)
            elif name == "moving_variance":
                params[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    return weights
