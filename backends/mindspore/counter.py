"""Native op counter: MindSpore's own FLOPs collection (``mindspore.flops_collection``).

MindSpore counts, for a network compiled in graph mode, the FLOPs of its Conv2D, MatMul and
BatchMatMul nodes (forward and, in a gradient graph, their backward nodes): 2 FLOPs per
multiply-accumulate over every kernel tap, padding included (the paper's convention; checked
against opcount on strided, asymmetric and 7x7 cases), and for attention every one of the S x S
scores, masked ones included (the paper's convention again). It reports one total per compiled
graph, so to attribute by category the counter compiles the very cells the lowering runs
(lowering.Conv, lowering.Dense, lowering.Attention), one node at a time, with the node's shapes at
the requested batch:

* forward: the node alone;
* backward: the gradient graph of (output * dy).sum() with respect to the input and the weights,
  minus the forward; for a node with only parameter-free nodes upstream (the conv that reads the
  input data) the input gradient is not needed, as the analytic rule says, so its backward is
  that graph minus the gradient graph with respect to the input alone. Both are measured:
  MindSpore 2.10 fails ("Can not find the forward node") on a graph that takes the weight gradient
  alone. Attention has no weights: its backward is the gradient graph with respect to q, k and v
  (four BatchMatMuls, both inputs of both products) minus the forward, and nothing when only data
  lies upstream (opcount's rule).

A grouped convolution is the one exception to "the very cell": MindSpore 2.10's flops_collection
counts a Conv2D with group=G as if every filter read all the input channels, G times its work
(measured, forward and backward, grouped and depthwise). Its G groups are G identical convolutions
of C/G input channels and F/G filters, so the counter compiles one of them and counts it G times.

A routed moe (lowering.Experts) runs MatMuls whose rows depend on the routing: the router's on the T
tokens, and each expert's on the rows of the tokens that chose it, which sum to T * top_k whatever the
routing (FLOPs are linear in the rows). Its host read and row slicing cannot be compiled in graph mode, so
the counter compiles its products as lowering.Dense cells of the same shapes: the router (T, D) x (D, E),
and each expert projection on all T * top_k routed rows (D -> F, twice for SwiGLU, and F -> D), with their
gradients as above (the router's and the first projections' input gradients only when a trained node lies
upstream), all booked under 'moe'. Its gates, top-k, activations and the scatter back are not counted.

Bias additions, normalisation, activations, pooling and softmax (attention's included) are not
counted, so only 'conv', 'dense', 'attention' and 'moe' (its products) are covered; the weight update is
not counted. Compiled counts are cached per (op, shapes, attributes). flops_collection needs graph mode,
which is MindSpore's process-wide execution mode: the counter switches to it under a lock and back to
PyNative afterwards, so it must not run while another thread trains with this backend (the conformance
kit counts alone).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter
from aiperf_core.gcpause import gc_frozen

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense", "attention", "moe"),
    includes_update=False,
    notes=("mindspore.flops_collection of graph-mode compiled Conv2D/MatMul/BatchMatMul, per conv, dense and "
           "attention node: 2 FLOPs per MAC over every kernel tap (padding included) and every attention score "
           "(masked ones included), a routed moe's products (router, experts on k rows per token); backward from "
           "gradient graphs (input gradient left out for the node that reads the data); bias, normalisation, "
           "activation, pooling and softmax are not counted; the backward count has no weight update"),
)

_CACHE: dict[tuple, int] = {}
_MODE_LOCK = threading.Lock()


@contextmanager
def _graph_mode():
    import mindspore as ms

    with _MODE_LOCK, gc_frozen():  # MindSpore collects before each compile: only what the count makes
        saved = ms.get_context("mode")
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            yield
        finally:
            ms.set_context(mode=saved)


def _collected(cell, *args) -> int:
    from mindspore.graph.api import flops_collection

    cell(*args)
    return int(round(float(flops_collection(cell.current_phase)[0])))


def _gradient_cells(node_cell, with_weights: bool):
    """A cell computing the gradients of (node_cell(x) * dy).sum(): w.r.t. x, and the weights if asked."""
    from mindspore import ParameterTuple, nn, ops

    class Projected(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def construct(self, x, dy):
            return (self.inner(x) * dy).sum()

    class Gradients(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.net = Projected(inner)
            self.weights = ParameterTuple(inner.trainable_params())
            self.grad = ops.GradOperation(get_all=True, get_by_list=with_weights)

        def construct(self, x, dy):
            if with_weights:
                return self.grad(self.net, self.weights)(x, dy)
            return self.grad(self.net)(x, dy)

    return Gradients(node_cell)


def _stacked_attention(attrs: Any, seq_len: int):
    """lowering.Attention taking q, k and v stacked on a first axis of 3, each of the query's width (k and v
    are their first kv_heads * head_dim columns: indexing computes nothing), so that the one-input forward
    and gradient cells above count it."""
    from mindspore import nn

    from aiperf_core.ir import kv_heads
    from aiperf_backends.mindspore.lowering import Attention

    kv_width = kv_heads(attrs) * attrs["head_dim"]

    class Stacked(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attention = Attention(seq_len, attrs)

        def construct(self, qkv):
            return self.attention(qkv[0], qkv[1][..., :kv_width], qkv[2][..., :kv_width])

    return Stacked()


def _node_flops(op: str, in_shape: tuple, out_shape: tuple, attrs: Any, backward: bool, input_grad: bool) -> int:
    """FLOPs of one conv2d (NCHW shapes), dense or attention node (in_shape: one of q, k, v), forward
    or forward + backward."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(attrs).items()))
    key = (op, in_shape, out_shape, frozen, backward, input_grad)
    if key in _CACHE:
        return _CACHE[key]
    from mindspore import Tensor

    from aiperf_backends.mindspore.lowering import Conv, Dense

    groups = dict(attrs).get("groups", 1) if op == "conv2d" else 1
    if groups > 1:  # one group's convolution, G times (flops_collection ignores Conv2D's group: above)
        one = {k: v for k, v in dict(attrs).items() if k != "groups"}
        one["filters"] = attrs["filters"] // groups
        n, c, h, w = in_shape
        total = groups * _node_flops(op, (n, c // groups, h, w), (out_shape[0], out_shape[1] // groups) + out_shape[2:],
                                     one, backward, input_grad)
        _CACHE[key] = total
        return total

    def make():
        if op == "attention":
            return _stacked_attention(attrs, in_shape[1])
        return Conv(in_shape[1], attrs) if op == "conv2d" else Dense(in_shape[-1], attrs)

    x = Tensor(np.zeros(((3,) if op == "attention" else ()) + in_shape, np.float32))
    dy = Tensor(np.zeros(out_shape, np.float32))
    with _graph_mode():
        forward = _collected(make(), x)
        total = forward
        if backward and op == "attention":  # no weights: its backward is its input gradient, or nothing
            total += _collected(_gradient_cells(make(), with_weights=False), x, dy) - forward if input_grad else 0
        elif backward:
            everything = _collected(_gradient_cells(make(), with_weights=True), x, dy)
            without = forward if input_grad else _collected(_gradient_cells(make(), with_weights=False), x, dy)
            total += everything - without
    _CACHE[key] = total
    return total


def _nchw(batch: int, shape: tuple) -> tuple:
    """A batch's shape in the lowering's layout: images NCHW, flat values and sequences as they are."""
    return (batch, shape[2], shape[0], shape[1]) if len(shape) == 3 else (batch,) + tuple(shape)


def _moe_flops(rows: int, width: int, attrs: Any, backward: bool, input_grad: bool) -> int:
    """FLOPs of a routed moe's products on `rows` tokens (module docstring): the router's on every row, and
    the experts' on rows * top_k rows, all their routed rows together."""
    from aiperf_core.ir import moe_mlp

    e, k, f = attrs["experts"], attrs["top_k"], attrs["units"]
    swiglu = moe_mlp(attrs) == "swiglu"
    routed = rows * k

    def product(n: int, d_in: int, d_out: int, bias: bool, grad_in: bool) -> int:
        return _node_flops("dense", (n, d_in), (n, d_out), {"units": d_out, "use_bias": bias}, backward, grad_in)

    router = product(rows, width, e, False, input_grad)
    inputs = (2 if swiglu else 1) * product(routed, width, f, not swiglu, input_grad)
    return router + inputs + product(routed, f, width, not swiglu, True)


class MindSporeFlopsCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        graph = model.graph
        out = {"conv": 0, "dense": 0, "attention": 0, "moe": 0, "other": 0}
        for node, up in self.counted_nodes(graph, backward, ops=("conv2d", "dense", "attention", "moe")):
            in_shape = graph.shapes[node.inputs[0]]
            if node.op == "moe":
                seq, width = in_shape
                out["moe"] += _moe_flops(batch * seq, width, node.attrs, backward, input_grad=up)
                continue
            flops = _node_flops(node.op, _nchw(batch, in_shape), _nchw(batch, graph.shapes[node.id]), node.attrs,
                                backward, input_grad=up)
            out[_CATEGORY[node.op]] += flops
        return out


_CATEGORY = {"conv2d": "conv", "dense": "dense", "attention": "attention"}
