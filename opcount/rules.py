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
    "lrn": "norm",
    "avg_pool": "pool",
    "mul_const": "elementwise",
    "add_const": "elementwise",
    "channel_shuffle": "elementwise",
    "token_input": "input",
    "embedding": "embedding",
    "position_embedding": "embedding",
    "layer_norm": "norm",
    "attention": "attention",
    "gelu": "activation",
    "moe": "moe",
    "rms_norm": "norm",
    "rotary": "embedding",
    "silu": "activation",
    "mul": "elementwise",
}
CATEGORIES = ("conv", "dense", "attention", "moe", "embedding", "norm", "activation", "pool", "elementwise",
              "softmax", "update")

# Per element of GELU's tanh form, 0.5 x (1 + tanh(c (x + 0.044715 x^3))) (docs/counting.md derives both):
# forward x^3 (2 MUL), 0.044715 x^3 + x (MAC), times c (MUL), tanh (MUL, EXP, 2 ADD, DIV), 1 + t (ADD),
# 0.5 x (1 + t) (2 MUL); backward 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 * 0.044715 x^2), times dy.
GELU_FP = 2 * MUL + MAC + MUL + (MUL + EXP + 2 * ADD + DIV) + ADD + 2 * MUL  # 23
GELU_BP = (MUL + ADD) + MUL + MAC + MUL + MUL + 2 * MUL + (ADD + MUL) + ADD + MUL  # 13
# Per element of SiLU, x sigmoid(x) = x / (1 + exp(-x)): forward EXP, ADD, DIV, then MUL; backward
# dy s (1 + x (1 - s)): ADD, MUL, ADD, MUL, MUL.
SILU_FP = EXP + ADD + DIV + MUL  # 14
SILU_BP = ADD + MUL + ADD + MUL + MUL  # 5
# Per attention score: scale by 1/sqrt(head_dim) (MUL), the causal mask (a select, CMP), softmax as Table 1
# (EXP, ADD, DIV); backward: softmax's rowsum(dP * P) (MAC), subtract (ADD), times P (MUL), the mask's
# select (CMP) and the scale (MUL).
ATTENTION_SCORE_FP = MUL + EXP + ADD + DIV  # 14, plus CMP where a causal mask applies
ATTENTION_SCORE_BP = MAC + ADD + MUL + MUL  # 5, plus CMP where a causal mask applies


@dataclass(frozen=True)
class NodeOps:
    """fp: forward ops; grad: backward ops without the update; update: the weight update.
    split: ((category, fp, grad), ...), the parts of fp and grad that belong to another category than
    the node's own (attention's scores softmax sits in 'softmax', its two products in 'attention')."""

    fp: int
    grad: int = 0
    update: int = 0
    split: tuple[tuple[str, int, int], ...] = ()

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
        ci, co = ins[0][2] // a.get("groups", 1), a["filters"]  # ci: input channels each filter reads
        macs = window_taps(ins[0], a, valid) * ci * co
        params = a["kernel"][0] * a["kernel"][1] * ci * co + (co if a["use_bias"] else 0)
        # Weight gradient always; input gradient (a full convolution) unless only data is upstream.
        grad = MAC * macs * (1 if reads_data else 2)
        return NodeOps(fp=MAC * macs, grad=grad, update=MAC * params)
    if op == "dense":
        rows, ci, co = math.prod(ins[0][:-1]), ins[0][-1], a["units"]  # rows: 1, or S over a sequence
        params = ci * co + (co if a["use_bias"] else 0)
        grad = MAC * rows * ci * co * (1 if reads_data else 2)
        return NodeOps(fp=MAC * rows * ci * co, grad=grad, update=MAC * params)
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
    if op == "lrn":
        # Per element: the window's sum of squares (size MACs), alpha/size (MUL), + bias (ADD), the power
        # beta as exp(beta ln s) (LOG, MUL, EXP), x / s^beta (DIV). Backward: dy y / s (MUL, DIV), its window
        # sum (size ADDs), times x and 2 alpha beta / size (2 MUL), dy / s^beta (DIV), the difference (ADD).
        fp = (MAC * a["size"] + MUL + ADD + LOG + MUL + EXP + DIV) * size
        grad = 0 if reads_data else (MUL + DIV + ADD * a["size"] + 2 * MUL + DIV + ADD) * size
        return NodeOps(fp=fp, grad=grad)
    if op == "avg_pool":
        # (taps - 1) adds and one multiply by the reciprocal of the count per output, as global_avg_pool.
        taps = window_taps(ins[0], a, valid) * out[2]
        return NodeOps(fp=ADD * (taps - size) + MUL * size)
    if op == "mul_const":
        return NodeOps(fp=MUL * size, grad=0 if reads_data else MUL * size)
    if op == "add_const":
        return NodeOps(fp=ADD * size)
    if op == "embedding":
        # A lookup moves rows (no arithmetic); its backward adds each token's gradient into its row.
        params = a["vocab"] * a["units"]
        return NodeOps(fp=0, grad=ADD * size, update=MAC * params)
    if op == "position_embedding":
        return NodeOps(fp=ADD * size, grad=ADD * size, update=MAC * size)
    if op == "layer_norm":
        rows, d = size // out[-1], out[-1]
        # Per row: sum for the mean (ADD), centre (ADD), sum of squares (MAC), times 1/sigma (MUL), the
        # affine (MAC) per element; 1/D twice (MUL), + epsilon (ADD), SQRT, the reciprocal (DIV).
        fp = rows * (d * (ADD + ADD + MAC + MUL + MAC) + 2 * MUL + ADD + SQRT + DIV)
        # Backward per row: dbeta (ADD) and dgamma (MAC) per element; the input gradient
        # rstd (dxh - mean(dxh) - xh mean(dxh xh)) with dxh = dy gamma: MUL, ADD, MAC, then MUL, 2 ADD,
        # MUL per element, and the two means' 1/D (2 MUL).
        param_grads = d * (ADD + MAC)
        input_grad = d * (MUL + ADD + MAC + MUL + 2 * ADD + MUL) + 2 * MUL
        grad = rows * (param_grads + (0 if reads_data else input_grad))
        return NodeOps(fp=fp, grad=grad, update=MAC * 2 * d)
    if op == "rms_norm":
        rows, d = size // out[-1], out[-1]
        # Per row: sum of squares (MAC), 1/D (MUL), + epsilon (ADD), SQRT, the reciprocal (DIV); per element
        # x times 1/rms (MUL) and times gamma (MUL). Backward: dgamma (MAC) per element; the input gradient
        # rstd (dxh - xh mean(dxh xh)) with dxh = dy gamma: MUL, MAC, MUL, ADD, MUL per element, 1/D per row.
        fp = rows * (d * (MAC + MUL + MUL) + MUL + ADD + SQRT + DIV)
        input_grad = d * (MUL + MAC + MUL + ADD + MUL) + MUL
        grad = rows * (d * MAC + (0 if reads_data else input_grad))
        return NodeOps(fp=fp, grad=grad, update=MAC * d)
    if op == "rotary":
        # x cos + rotate_half(x) sin per element (the half's sign lives in the sine table, which is a constant
        # of the positions, as the position embedding's table is); its backward is the inverse rotation.
        return NodeOps(fp=(MUL + MUL + ADD) * size, grad=0 if reads_data else (MUL + MUL + ADD) * size)
    if op == "silu":
        return NodeOps(fp=SILU_FP * size, grad=0 if reads_data else SILU_BP * size)
    if op == "mul":
        # Each input's gradient is the other input times dy.
        return NodeOps(fp=MUL * size, grad=0 if reads_data else 2 * MUL * size)
    if op == "attention":
        return _attention_ops(ins[0][0], a, valid, reads_data)
    if op == "gelu":
        return NodeOps(fp=GELU_FP * size, grad=0 if reads_data else GELU_BP * size)
    if op == "moe":
        return _moe_ops(ins[0], a, reads_data)
    # input, token_input, concat, flatten, dropout, channel_shuffle move data but compute nothing.
    return NodeOps(fp=0)


def _attention_ops(seq: int, a, valid: bool, reads_data: bool) -> NodeOps:
    """Scaled dot-product attention over `heads` heads: the products QK^T and PV (category
    'attention'; each backward computes both input gradients), and the scores' scale, mask and softmax
    (category 'softmax'). 'paper' counts the full S x S scores, as the Megatron-LM paper and PaLM do;
    'valid' only the S(S+1)/2 pairs a causal mask keeps, and no mask."""
    heads, dim, causal = a["heads"], a["head_dim"], a["causal"]
    pairs = heads * (seq * (seq + 1) // 2 if causal and valid else seq * seq)
    masked = causal and not valid
    products = MAC * 2 * pairs * dim
    score_fp = pairs * (ATTENTION_SCORE_FP + (CMP if masked else 0))
    score_bp = pairs * (ATTENTION_SCORE_BP + (CMP if masked else 0))
    grads = 0 if reads_data else 1
    return NodeOps(fp=products + score_fp, grad=grads * (2 * products + score_bp),
                   split=(("softmax", score_fp, grads * score_bp),))


def _moe_ops(in_shape, a, reads_data: bool) -> NodeOps:
    """A mixture of experts per token (docs/counting.md, "Mixture of experts"): the router over every
    expert, and only the top_k experts that run. Forward: the router's product (MAC D E), its softmax
    (EXP, ADD, DIV per expert), the top-k choice (k passes of E compares), the gates' renormalisation
    (ADD, DIV per chosen expert); per chosen expert its MLP, as dense, gelu, dense count them (MAC D F,
    GELU_FP F, MAC F D), times its gate (MUL D), and the sum of the k outputs (ADD (k - 1) D). Backward:
    per chosen expert the gate's gradient (MAC D) and the output's (MUL D), the output layer's weight and
    input gradients (2 MAC F D), gelu's (GELU_BP F) and the input layer's weight gradient (MAC D F); the
    gates' softmax over the chosen (MAC, ADD, MUL each, as attention's scores); the router's weight
    gradient (MAC D E); and, unless only data lies upstream, the input gradients of the experts' first
    layer (MAC D F each) and of the router (MAC D E). The update covers every expert's parameters.

    SwiGLU experts (mlp 'swiglu', no biases) count as their dense, silu, mul, dense nodes would: two
    input projections (2 MAC D F), silu on the gate (SILU_FP F), the product (MUL F) and the down
    projection (MAC F D); backward the product's two gradients (2 MUL F), silu's (SILU_BP F), both input
    projections' weight gradients (2 MAC D F) and, unless only data lies upstream, their input gradients."""
    seq, d = in_shape
    e, k, f = a["experts"], a["top_k"], a["units"]
    swiglu = a.get("mlp", "gelu") == "swiglu"
    projections = 2 if swiglu else 1  # the (D -> F) products per expert
    hidden_fp = SILU_FP * f + MUL * f if swiglu else GELU_FP * f
    hidden_bp = SILU_BP * f + 2 * MUL * f if swiglu else GELU_BP * f
    expert_fp = projections * MAC * d * f + hidden_fp + MAC * f * d + MUL * d
    fp = MAC * d * e + (EXP + ADD + DIV) * e + CMP * k * e + (ADD + DIV) * k + k * expert_fp + ADD * (k - 1) * d
    expert_grad = MAC * d + MUL * d + 2 * MAC * f * d + hidden_bp + projections * MAC * d * f
    grad = k * expert_grad + k * (MAC + ADD + MUL) + MAC * d * e
    if not reads_data:
        grad += k * projections * MAC * d * f + MAC * d * e
    expert_params = 3 * d * f if swiglu else d * f + f + f * d + d
    params = d * e + e * expert_params
    return NodeOps(fp=seq * fp, grad=seq * grad, update=MAC * params)
