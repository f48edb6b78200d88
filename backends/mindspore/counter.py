"""Native op counter: MindSpore's own FLOPs collection (``mindspore.flops_collection``).

MindSpore counts, for a network compiled in graph mode, the FLOPs of its Conv2D and MatMul nodes
(forward and, in a gradient graph, their backward nodes): 2 FLOPs per multiply-accumulate over
every kernel tap, padding included (the paper's convention; checked against opcount on strided,
asymmetric and 7x7 cases). It reports one total per compiled graph, so to attribute by category
the counter compiles the very cells the lowering runs (lowering.Conv, lowering.Dense), one node
at a time, with the node's shapes at the requested batch:

* forward: the node alone;
* backward: the gradient graph of (output * dy).sum() with respect to the input and the weights,
  minus the forward; for a node with only parameter-free nodes upstream (the conv that reads the
  input data) the input gradient is not needed, as the analytic rule says, so its backward is
  that graph minus the gradient graph with respect to the input alone. Both are measured:
  MindSpore 2.10 fails ("Can not find the forward node") on a graph that takes the weight gradient
  alone.

Bias additions, normalisation, activations, pooling and softmax are not counted, so only 'conv'
and 'dense' are covered; the weight update is not counted. Compiled counts are cached per (op,
shapes, attributes). flops_collection needs graph mode, which is MindSpore's process-wide
execution mode: the counter switches to it under a lock and back to PyNative afterwards, so it
must not run while another thread trains with this backend (the conformance kit counts alone).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense"),
    includes_update=False,
    notes=("mindspore.flops_collection of graph-mode compiled Conv2D/MatMul, per conv/dense node: 2 FLOPs per "
           "MAC over every kernel tap (padding included); backward from gradient graphs (input gradient left out "
           "for the conv that reads the data); bias, normalisation, activation, pooling and softmax are not "
           "counted; the backward count has no weight update"),
)

_CACHE: dict[tuple, int] = {}
_MODE_LOCK = threading.Lock()


@contextmanager
def _graph_mode():
    import mindspore as ms

    with _MODE_LOCK:
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


def _node_flops(op: str, in_shape: tuple, out_shape: tuple, attrs: Any, backward: bool, input_grad: bool) -> int:
    """FLOPs of one conv2d (NCHW shapes) or dense node, forward or forward + backward."""
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in dict(attrs).items()))
    key = (op, in_shape, out_shape, frozen, backward, input_grad)
    if key in _CACHE:
        return _CACHE[key]
    from mindspore import Tensor

    from aiperf_backends.mindspore.lowering import Conv, Dense

    def make():
        return Conv(in_shape[1], attrs) if op == "conv2d" else Dense(in_shape[1], attrs)

    x = Tensor(np.zeros(in_shape, np.float32))
    dy = Tensor(np.zeros(out_shape, np.float32))
    with _graph_mode():
        forward = _collected(make(), x)
        total = forward
        if backward:
            everything = _collected(_gradient_cells(make(), with_weights=True), x, dy)
            without = forward if input_grad else _collected(_gradient_cells(make(), with_weights=False), x, dy)
            total += everything - without
    _CACHE[key] = total
    return total


def _nchw(batch: int, shape: tuple) -> tuple:
    return (batch, shape[2], shape[0], shape[1]) if len(shape) == 3 else (batch,) + tuple(shape)


class MindSporeFlopsCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        graph = model.graph
        out = {"conv": 0, "dense": 0, "other": 0}
        for node, up in self.counted_nodes(graph, backward):
            flops = _node_flops(node.op, _nchw(batch, graph.shapes[node.inputs[0]]), _nchw(batch, graph.shapes[node.id]),
                                node.attrs, backward, input_grad=up)
            out["conv" if node.op == "conv2d" else "dense"] += flops
        return out
