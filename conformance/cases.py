"""The op-level cases: one small graph per case, data-driven like ONNX's node tests.

Each case is an input followed by the op under test (named 'op'); `with_head` appends a flatten,
a dense layer and a softmax so that the op's backward can be checked through the loss (over the last
axis of a sequence output: a class per position). A case's `workload` says what it certifies: `cnn`
(the CNN workload's ops), `lm` (the transformer ops of the LM workload) or `ir` (the model-zoo CNN ops,
which no workload needs); `vocab` makes its input token ids rather than real values.
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
    workload: str = "cnn"
    vocab: int | None = None  # token ids below vocab (input_shape (S,)) instead of real values
    input_mean: float = 0.0  # of the normal inputs (standard deviation 1)

    def graph(self) -> Graph:
        if self.vocab is not None:
            first = Node("x", "token_input", (), {"seq_len": self.input_shape[0], "vocab": self.vocab})
        else:
            first = Node("x", "input", (), {"shape": list(self.input_shape)})
        return Graph((first,) + self.nodes, name=self.name)

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


def _unary(name, shape, op, workload="cnn", **attrs):
    return OpCase(name, shape, (Node("op", op, ("x",), attrs),), workload=workload)


def _zoo_conv(name, size, cin, filters, kernel, strides, padding, groups, bias=False):
    return OpCase(name, (size[0], size[1], cin), (
        Node("op", "conv2d", ("x",), {"filters": filters, "kernel": list(kernel), "strides": list(strides),
                                       "padding": list(padding), "use_bias": bias, "groups": groups}),),
                  workload="ir")


def _avg_pool(name, size, c, kernel, strides, padding, count_padding):
    return OpCase(name, (size[0], size[1], c), (
        Node("op", "avg_pool", ("x",), {"kernel": list(kernel), "strides": list(strides), "padding": list(padding),
                                         "count_padding": count_padding}),), workload="ir")


def _attention(name, causal, heads=2, kv_heads=None, head_dim=3, rotary=False):
    """Three projections of one (S, D) input into `heads` query heads (and `kv_heads` key-value heads) of
    width `head_dim`, with rotary positions on the query and key if `rotary`, then the attention under test."""
    kv = heads if kv_heads is None else kv_heads
    nodes = [Node("q", "dense", ("x",), {"units": heads * head_dim}), Node("k", "dense", ("x",), {"units": kv * head_dim}),
             Node("v", "dense", ("x",), {"units": kv * head_dim})]
    q, k = "q", "k"
    if rotary:
        nodes += [Node("q_rope", "rotary", ("q",), {"head_dim": head_dim}),
                  Node("k_rope", "rotary", ("k",), {"head_dim": head_dim})]
        q, k = "q_rope", "k_rope"
    attrs = {"heads": heads, "head_dim": head_dim, "causal": causal}
    if kv_heads is not None:
        attrs["kv_heads"] = kv_heads
    return OpCase(name, (5, 4), tuple(nodes) + (Node("op", "attention", (q, k, "v"), attrs),), workload="lm")


# The model-zoo CNN ops (ONNX import): no workload needs them, every backend should lower them.
ZOO_CASES: tuple[OpCase, ...] = (
    _zoo_conv("conv_grouped", (6, 6), 4, 6, (3, 3), (1, 1), (1, 1, 1, 1), groups=2, bias=True),
    _zoo_conv("conv_depthwise_stride2_asym", (7, 7), 3, 6, (3, 3), (2, 2), (0, 1, 0, 1), groups=3),
    _unary("lrn", (4, 4, 7), "lrn", workload="ir", size=5, alpha=0.5, beta=0.75, bias=2.0),
    _avg_pool("avg_pool_real_taps_asym", (7, 6), 3, (3, 3), (2, 1), (1, 1, 0, 1), count_padding=False),
    _avg_pool("avg_pool_all_taps", (6, 6), 2, (2, 2), (1, 1), (1, 1, 1, 1), count_padding=True),
    _unary("mul_const_per_channel", (4, 4, 3), "mul_const", workload="ir", per_channel=True),
    _unary("mul_const_scalar", (4, 4, 3), "mul_const", workload="ir", per_channel=False),
    _unary("add_const_per_channel", (4, 4, 3), "add_const", workload="ir", per_channel=True),
    OpCase("add_const_scalar", (4, 4, 3), (Node("r", "relu", ("x",), {}),
                                           Node("op", "add_const", ("r",), {"per_channel": False})), workload="ir"),
    OpCase("channel_shuffle", (4, 4, 6), (Node("c", "conv2d", ("x",), {"filters": 6, "kernel": [1, 1]}),
                                          Node("op", "channel_shuffle", ("c",), {"groups": 3})), workload="ir"),
)

def _grouped_after_conv(name, filters, groups, strides, padding, bias=False):
    """A grouped convolution (3x3) of a (6, 5) input after a 1x1 convolution to 6 channels, so that its
    input gradient is computed too, not only its weight gradient."""
    return OpCase(name, (6, 5, 4), (
        Node("pre", "conv2d", ("x",), {"filters": 6, "kernel": [1, 1], "use_bias": True}),
        Node("op", "conv2d", ("pre",), {"filters": filters, "kernel": [3, 3], "strides": list(strides),
                                         "padding": list(padding), "use_bias": bias, "groups": groups})),
                  workload="ir")


# The grouped convolutions the native counters count (count level): torch 2.13's FlopCounterMode counted a
# grouped convolution's weight gradient `groups` times, and a depthwise one is each framework's own kernel.
COUNT_CONV_CASES: tuple[OpCase, ...] = (
    _grouped_after_conv("conv_grouped_strided", 9, 3, (2, 1), (1, 0, 1, 1), bias=True),
    _grouped_after_conv("conv_depthwise_multiplier2", 12, 6, (2, 2), (1, 1, 0, 1)),
)

# The transformer ops (the LM workload): a real-valued (S, D) input, or token ids for the embedding.
SEQUENCE_CASES: tuple[OpCase, ...] = (
    OpCase("embedding", (6,), (Node("op", "embedding", ("x",), {"vocab": 11, "units": 4}),), workload="lm",
           vocab=11),
    _unary("position_embedding", (5, 4), "position_embedding", workload="lm"),
    _unary("layer_norm", (5, 6), "layer_norm", workload="lm", epsilon=1e-5),
    _unary("dense_sequence", (5, 4), "dense", workload="lm", units=3),
    _unary("gelu", (5, 4), "gelu", workload="lm"),
    # Inputs around -2, where the tanh form and the erf form differ most against the output's size: 4.7e-4
    # at |x| = 2.7 where the outputs stay below 1, so that an erf GELU fails at fp32 by a factor of about 5.
    OpCase("gelu_tanh_form", (5, 4), (Node("op", "gelu", ("x",), {}),), workload="lm", input_mean=-2.0),
    _attention("attention_causal", True),
    _attention("attention_full", False),
    _unary("softmax_per_position", (5, 4), "softmax", workload="lm"),
    _unary("moe_top2", (5, 4), "moe", workload="lm", experts=3, top_k=2, units=6),
    _unary("moe_top1", (5, 4), "moe", workload="lm", experts=4, top_k=1, units=3),
    # Llama's family (schema 4).
    _unary("rms_norm", (5, 6), "rms_norm", workload="lm", epsilon=1e-5),
    _unary("rotary", (5, 8), "rotary", workload="lm", head_dim=4),
    _unary("rotary_one_head_base_100", (6, 6), "rotary", workload="lm", head_dim=6, base=100.0),
    _unary("silu", (5, 4), "silu", workload="lm"),
    OpCase("mul", (5, 4), (Node("a", "dense", ("x",), {"units": 3}), Node("b", "dense", ("x",), {"units": 3}),
                           Node("op", "mul", ("a", "b"), {})), workload="lm"),
    _attention("attention_grouped_query", True, heads=4, kv_heads=2, head_dim=2),
    _attention("attention_multi_query", True, heads=3, kv_heads=1, head_dim=2),
    _attention("attention_rotary_grouped_query", True, heads=2, kv_heads=1, head_dim=4, rotary=True),
    _unary("moe_swiglu_top2", (5, 4), "moe", workload="lm", experts=3, top_k=2, units=6, mlp="swiglu"),
)


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
) + ZOO_CASES + SEQUENCE_CASES


def case_input(graph: Graph, rng: np.random.Generator, batch: int, mean: float = 0.0) -> np.ndarray:
    """A batch for `graph`: token ids below its vocab, or normal values (standard deviation 1)."""
    if graph.takes_tokens:
        return rng.integers(0, graph.vocab, (batch,) + graph.input_shape).astype(np.int64)
    return rng.normal(mean, 1, (batch,) + graph.input_shape).astype(np.float32)


def case_labels(graph: Graph, rng: np.random.Generator, batch: int) -> np.ndarray:
    """One class index per sample, or per position of a sequence output."""
    return rng.integers(0, graph.output_shape[-1], (batch,) + graph.output_shape[:-1])


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
            elif name in ("beta", "moving_mean", "bias", "value"):
                params[name] = rng.normal(0, 0.2, shape).astype(np.float32)
            elif name == "moving_variance":
                params[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    return weights
