"""What the importer knows of each ONNX tensor: the IR node computing it and the ONNX layout it stands
for (Act), so that layout changes (transposes, flattening, pooling to 1x1, a transformer's head reshapes)
cost no IR node; and which layouts only the handlers of their own pattern may read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# How an IR tensor is laid out in ONNX (after the batch axis):
#   nchw    C, H, W   of an IR image H x W x C
#   nhwc    H, W, C   of an IR image (after a Transpose, as tf2onnx writes)
#   pooled  C, 1, 1   of an IR vector C (GlobalAveragePool keeps the 1x1)
#   flat    F         of an IR vector F
#   seq     S, D      of an IR sequence S x D
#   tokens  S         of the IR token input (integer ids)
#   split   G, C/G, H, W  and  swapped  C/G, G, H, W: the two halves of a channel shuffle of an IR
#           image H x W x C, which only the shuffle's Transpose and last Reshape may read
# and the layouts of a transformer's inner tensors, each private to the handlers of the pattern it belongs
# to (ops/: a norm's statistics in normalization.py, attention heads and scores in attention.py).
LAYOUT_TEXT = {
    "nchw": "an NCHW feature map",
    "nhwc": "an NHWC feature map",
    "pooled": "a pooled [N, C, 1, 1] tensor",
    "flat": "a flat [N, F] tensor",
    "seq": "a sequence [N, S, D]",
    "tokens": "token ids [N, S]",
    "split": "a channel split [N, G, C/G, H, W]",
    "swapped": "a transposed channel split [N, C/G, G, H, W]",
    "rows": "the rows [N * S, D] of a sequence",
    "pointwise": "an elementwise function of a tensor",
    "centered": "a tensor less its mean",
    "stat": "a statistic over the last axis",
    "split_heads": "attention heads [N, S, H, d]",
    "heads": "attention heads [N, H, S, d]",
    "heads_t": "transposed attention heads [N, H, d, S]",
    "heads_rows": "attention heads [N * H, S, d]",
    "heads_rows_t": "transposed attention heads [N * H, d, S]",
    "heads_unsq": "key-value heads [N, KV, 1, S, d]",
    "heads_rep": "repeated key-value heads [N, KV, G, S, d]",
    "half": "half of each attention head",
    "rotated": "attention heads with their halves swapped and one negated",
    "rot_cos": "attention heads times a cosine table",
    "rot_sin": "rotated attention heads times a sine table",
    "scores": "attention scores [N, H, S, S]",
    "probs": "attention probabilities [N, H, S, S]",
    "probs_nan": "where attention probabilities are NaN",
}
_ATTENTION_ONLY = ("the inside of an attention, which aiperf reads only as its written-out form (heads reshaped and "
                   "transposed, an optional rotary embedding, MatMul, scale, causal mask, Softmax, MatMul) or as "
                   "ONNX's Attention")
# Layouts that only the handler expecting them may read.
PRIVATE_LAYOUTS = {
    "tokens": "token ids, which aiperf reads only as the indices of a Gather (an embedding)",
    "split": "half of a channel shuffle; aiperf reads only Reshape [N, G, C/G, H, W] -> Transpose "
             "[0, 2, 1, 3, 4] -> Reshape [N, C, H, W]",
    "swapped": "half of a channel shuffle; aiperf reads only Reshape [N, G, C/G, H, W] -> Transpose "
               "[0, 2, 1, 3, 4] -> Reshape [N, C, H, W]",
    "rows": "the rows of a sequence, which aiperf reads only in a projection (Gemm or MatMul and its bias) and the "
            "Reshape back to [N, S, D]",
    "centered": "a tensor less its mean, which aiperf reads only inside a layer norm's decomposition",
    "stat": "a statistic over the last axis, which aiperf reads only inside a layer norm's or an RMS norm's "
            "decomposition",
    **{layout: _ATTENTION_ONLY for layout in ("split_heads", "heads", "heads_t", "heads_rows", "heads_rows_t",
                                              "heads_unsq", "heads_rep", "half", "rotated", "rot_cos", "rot_sin",
                                              "scores", "probs", "probs_nan")},
}

# What a pending elementwise function may start from (pointwise.py).
BASE_LAYOUTS = ("seq", "flat", "nchw", "nhwc", "pooled")
HEADS_LAYOUTS = ("split_heads", "heads", "heads_t", "heads_rows", "heads_rows_t", "heads_unsq", "heads_rep")


@dataclass(frozen=True, eq=False)
class Act:
    """An ONNX activation tensor: the IR node computing it and its ONNX layout."""

    node: str
    layout: str
    # flat only: for each IR feature, the index of the same feature in ONNX's
    # order (a flattened NCHW map is CHW in ONNX but HWC in the IR); None = same.
    order: np.ndarray | None = None
    # nchw only: zero padding (top, bottom, left, right) of a Pad not yet applied,
    # to be folded into the Conv (or MaxPool) that reads it.
    pad: tuple[int, int, int, int] | None = None
    # split and swapped only: the channel shuffle's groups G.
    groups: int | None = None
    # The heads layouts: the ONNX tensor's heads H, of width d = the IR node's width * group / H.
    heads: int | None = None
    # The heads layouts: query heads per key-value head; ONNX head h is the IR node's head h // group.
    group: int = 1
    # The heads and scores layouts: a scalar factor not applied yet (attention's scale).
    scale: float = 1.0
    # What the other private layouts carry: a pending elementwise function (pointwise.py), a rotary table,
    # the query and key of attention scores (ops/attention.py).
    info: Any = None
