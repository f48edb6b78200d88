"""Per-node FP/BP operation rules: the paper's Tables 1 and 2 (docs/counting.md).

Op weights (the paper's convention, after its Ref. [57]): MAC 2; add, sub, mul
and compare 1; div and sqrt 4; exp and log 8. Everything here is per image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aiperf_core.ir import Graph, Node

MAC, ADD, MUL, CMP, DIV, SQRT, EXP, LOG = 2, 1, 1, 1, 4, 4, 8, 8

CONVENTIONS = ("paper", "valid")

# Each BN layer's backward costs a small constant in the original implementation
# (29 per image plus 7 per step, at batch size 1); Table 3 prints 53 x 36 = 1.91e3.
BN_BACKWARD_CONSTANT = 36

CATEGORY_OF_OP = {
    "input": "input",
    "conv2d": "conv",
    "dense": "dense",
    "batch_norm": "norm",
    "relu": "activation",
    "max_pool": "pool",
    "global_avg_pool": "pool",
    "add": "elementwise",
    "concat": "elementwise",
    "flatten": "elementwise",
    "dropout": "elementwise",
    "softmax": "softmax",
}
CATEGORIES = ("conv", "dense", "norm", "activation", "pool", "elementwise", "softmax", "update")


@dataclass(frozen=True)
class NodeOps:
    """fp: forward ops; grad: backward ops without the update; update: the weight update."""

    fp: int
    grad: int = 0
    update: int = 0

    @property
    def bp(self) -> int:
        return self.grad + self.update


def _taps(size: int, kernel: int, stride: int, pad_lo: int, pad_hi: int, valid: bool) -> int:
    """Kernel taps summed over the output positions of one axis."""
    out = (size + pad_lo + pad_hi - kernel) // stride + 1
    if not valid:
        return out * kernel
    total = 0
    for o in range(out):
        start = o * stride - pad_lo
        total += min(start + kernel, size) - max(start, 0)
    return total


def window_taps(in_shape, attrs, valid: bool) -> int:
    """Taps of a 2-D window over all output positions (one channel): paper counts padded taps too."""
    h, w, _ = in_shape
    kh, kw = attrs["kernel"]
    sh, sw = attrs["strides"]
    pt, pb, pl, pr = attrs["padding"]
    return _taps(h, kh, sh, pt, pb, valid) * _taps(w, kw, sw, pl, pr, valid)


def node_ops(graph: Graph, node: Node, convention: str, reads_data: bool) -> NodeOps:
    """Operations of one node. reads_data: no input gradient is needed (only data lies upstream)."""
    valid = convention == "valid"
    ins = [graph.shapes[i] for i in node.inputs]
    out = graph.shapes[node.id]
    size = math.prod(out)
    op = node.op
    a = node.attrs
    if op == "conv2d":
        ci, co = ins[0][2], a["filters"]
        macs = window_taps(ins[0], a, valid) * ci * co
        params = a["kernel"][0] * a["kernel"][1] * ci * co + (co if a["use_bias"] else 0)
        # Weight gradient always; input gradient (a full convolution) unless only data is upstream.
        grad = MAC * macs * (1 if reads_data else 2)
        return NodeOps(fp=MAC * macs, grad=grad, update=MAC * params)
    if op == "dense":
        ci, co = ins[0][0], a["units"]
        params = ci * co + (co if a["use_bias"] else 0)
        grad = MAC * ci * co * (1 if reads_data else 2)
        return NodeOps(fp=MAC * ci * co, grad=grad, update=MAC * params)
    if op == "batch_norm":
        return NodeOps(fp=(MAC + ADD + DIV) * math.prod(ins[0]), grad=BN_BACKWARD_CONSTANT)
    if op == "relu":
        return NodeOps(fp=CMP * size)
    if op == "add":
        return NodeOps(fp=ADD * size * (len(ins) - 1))
    if op == "max_pool":
        return NodeOps(fp=CMP * window_taps(ins[0], a, valid) * out[2])
    if op == "global_avg_pool":
        # (HW - 1) adds and one multiply by 1/HW per channel: Table 3's 1.00e5.
        h, w, c = ins[0]
        return NodeOps(fp=ADD * (h * w - 1) * c + MUL * c)
    if op == "softmax":
        # exp, add and div per class (Table 1) plus the cross-entropy's log per class: Table 3's 2.10e4.
        return NodeOps(fp=(EXP + ADD + DIV + LOG) * size)
    # input, concat, flatten, dropout move data but compute nothing.
    return NodeOps(fp=0)
