"""Lowering the aiperf IR to a MindSpore nn.Cell that runs the graph node by node.

Layout: the IR is NHWC with HWIO conv kernels and (in, out) dense kernels; MindSpore's CPU and
Ascend convolutions are NCHW with OIHW kernels and nn.Dense keeps (out, in). Conversions happen
at the boundaries only:

* input NHWC -> NCHW (one transpose), output NCHW -> NHWC when the graph's output is an image;
  sequences (N, S, D) and flat (N, C) values keep the IR's layout, token ids (N, S) enter as int64;
* ``flatten`` transposes to NHWC order before flattening, so a dense kernel that follows keeps its
  canonical (H, W, C)-ordered rows;
* kernels HWIO <-> OIHW and (in, out) <-> (out, in) when weights cross the interface. These are
  pure transposes, so export returns exactly (bit for bit) what was imported.

Per op:

* conv2d: the ``ops.Conv2D`` primitive nn.Conv2d uses, ``pad_mode='pad'`` with the IR's explicit
  (top, bottom, left, right) padding, so asymmetric padding needs no extra op; ``groups`` is the
  primitive's ``group`` (grouped and depthwise convolutions run forward and backward on MindSpore
  2.10's CPU kernel, measured against the reference); the kernel is (O, I/groups, kh, kw), the IR's
  block order;
* max_pool: a -inf ``ops.pad`` when there is padding, then a 'valid' ``ops.MaxPool``;
* batch_norm: the fused ``ops.BatchNorm`` primitive nn.BatchNorm2d uses, with
  ``momentum = 1 - IR momentum`` (the IR's momentum is Keras-style, the primitive's is the weight
  of the new batch statistic). Measured on MindSpore 2.10 CPU, it normalises with the biased batch
  variance and feeds the unbiased (Bessel-corrected) one to the moving average, as the NumPy
  reference does. Flat (N, C) inputs are viewed as (N, C, 1, 1). With a single value per channel
  in training the primitive's Bessel factor divides by zero (NaN moving variance); that case is
  computed as the reference does (output beta, factor taken as 1). With data parallelism
  (distributed.py) the batch statistics are those of the global batch (``SyncedBatchNorm``);
* dense: ``ops.MatMul(transpose_b=True)`` as nn.Dense; over a sequence (N, S, D) the positions are
  rows of one (N*S, D) product (MatMul and BiasAdd are 2-D);
* dropout: identity in inference; in training inverted dropout with masks the caller passes in
  (host-drawn NumPy masks: the reference's in loss_and_grads, a seeded stream in training);
* softmax in float32 over the last axis (per position of a sequence); with ``logits=True`` the
  softmax's input is returned, so that the loss can use a stable log-softmax;
* lrn: from ONNX's definition, the squares summed over the channel window as shifted slices of a
  zero-padded tensor (clipped at the edges), ``x * (bias + alpha / size * sum)^-beta``, in float32
  (MindSpore 2.10's CPU ``ops.LRN`` fails for channel counts that are multiples of 8 from 16 up);
* avg_pool: a zero ``ops.pad`` (any per-side padding), a 'valid' ``ops.AvgPool`` (the window sum
  over kh*kw), and without ``count_padding`` a constant factor kh*kw / real taps per output
  position, computed on the host when lowering;
* mul_const / add_const: ``value`` is a non-trainable Parameter (no gradient, no optimizer slot),
  exported and imported like batch norm's moving statistics; per channel it is broadcast over
  axis 1 of an NCHW image and over the last axis otherwise;
* channel_shuffle: reshape (N, G, C/G, H, W), swap the two channel axes, reshape back;
* embedding: ``ops.gather`` of the ids' rows of a ``table`` Parameter (its gradient adds each
  token's gradient into its row); position_embedding: ``x + table``;
* layer_norm: the fused ``ops.LayerNorm`` primitive over the last axis (biased variance), in
  float32; an NCHW image is moved to NHWC and back around it;
* attention: explicit ``ops.BatchMatMul`` products in the compute dtype, heads split by reshape
  (N, S, A, d) -> (N, A, S, d); the scores are scaled, masked (-inf where j > i, so their
  probability is exactly 0) and soft-maxed in float32. MindSpore's fused kernel
  (``ops.flash_attention_score``) exists on Ascend only;
* gelu: ``ops.gelu(approximate='tanh')``, the IR's form; silu: ``ops.silu``; mul: ``a * b``;
* rms_norm: written out in float32 (MindSpore 2.10's fused ``ops.rms_norm`` has no CPU kernel);
* rotary: the half-split form, cos/sin tables computed on the host once per lowering and shape;
* grouped-query attention: the key-value heads repeated (``ops.repeat_interleave``) for their query heads,
  then the multi-head products; moe with SwiGLU experts: ``(silu(x @ w_gate) * (x @ w_in)) @ w_out``.
* moe's load balance: a training-mode pass of an ``Experts`` cell keeps its routing's load balance
  (``Experts.balance``): the sum over the batch's sequences of ``E sum_e f_e P_e`` (TrainConfig.moe_aux_loss;
  P_e the mean over the sequence's tokens of the router's float32 softmax over all E experts, a tensor of
  the pass, so that its gradient reaches the router and the moe's input; f_e the share of the sequence's
  S top_k assignments that expert e received, from the choice already made on the host, a constant) and
  the assignments each expert received (host int64). ``LoweredCell.balance_loss`` and ``expert_counts``
  read them after the pass.

Input: a float32 batch is taken as already normalised (in-memory datasets); uint8 pixels (streamed
batches, synthetic data) are normalised by MindSpore ops on the device target, with exactly the
host's arithmetic (`normalised_pixels`), so a quarter of the bytes cross to the device.

Mixed precision (fp16 / bf16): conv, dense and attention's two products run in the compute dtype
on cast copies of the float32 master weights; batch norm (statistics included), lrn, layer norm, RMS
norm, the softmaxes (attention's included) and the loss stay float32.

Activation checkpointing (TrainConfig.checkpoint_blocks; ``LoweredCell.checkpointing``): in
training, each block of ``Graph.blocks()`` runs through ``mindspore.recompute(...,
use_reentrant=False)``, MindSpore's PyNative recomputation: the autograd tape keeps the block's
input instead of its activations and runs the block's forward pass again when the backward pass
reaches it. Its dropout masks are tensors passed in, so the replay is the same computation, and
the gradients are those of the plain pass (tests/test_mindspore_step_memory.py). A Cell's own
``recompute()`` is a graph-mode setting; this backend runs PyNative.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any, Mapping

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from aiperf_core.errors import GraphError
from aiperf_core.ir import INPUT_OPS, Graph, Node, is_trainable, kv_heads, moe_mlp
from aiperf_core.weights import Weights, transposed_copy, validate_weights
from aiperf_backends.mindspore.onednn import cap_on_avx512

cap_on_avx512(ms)  # before any op: MindSpore's oneDNN runs its NCHW convs 74 times faster (onednn.py)



def _settle_numpy_bridge() -> None:
    """MindSpore 2.10's extensions were built with a pybind11 that looks up NumPy 1.x's C API. Under
    NumPy 2 the first Tensor op that takes a Python scalar (``tensor * 2.0``) does that lookup,
    prints NumPy's 'compiled using NumPy 1.x' notice with a stack trace and raises SystemError;
    every later op takes pybind11's fallback and works (checked on every op this backend uses).
    So that no user operation is the first, it is done here, once, with the notice silenced."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            Tensor(np.ones(1, np.float32)) * 2.0
        except SystemError:
            pass


_settle_numpy_bridge()

STATE = ("moving_mean", "moving_variance")  # updated by their own rule: loss_and_grads restores them
COMPUTE_DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}


def _zeros(shape, name: str, trainable: bool = True) -> Parameter:
    return Parameter(Tensor(np.zeros(shape, np.float32)), name=name, requires_grad=trainable)


class _Linear(nn.Cell):
    """A kernel (and optional bias) applied by `self.kernel_op`, in the compute dtype when one is set."""

    def __init__(self, kernel_shape: tuple, units: int, use_bias: bool, kernel_op, compute_dtype=None):
        super().__init__()
        self.kernel = _zeros(kernel_shape, "kernel")
        self.bias = _zeros((units,), "bias") if use_bias else None
        self.kernel_op = kernel_op
        self.bias_add = ops.BiasAdd()
        self.compute_dtype = compute_dtype

    def construct(self, x):
        return self.apply(x)

    def apply(self, x):
        kernel = self.kernel
        if self.compute_dtype is not None:
            x, kernel = x.astype(self.compute_dtype), kernel.astype(self.compute_dtype)
        y = self.kernel_op(x, kernel)
        if self.bias is not None:
            y = self.bias_add(y, self.bias.astype(y.dtype))
        return y


class Conv(_Linear):
    """conv2d with explicit per-side padding; kernel (O, I/groups, kh, kw), optional bias (O,)."""

    def __init__(self, in_channels: int, attrs: Mapping[str, Any], compute_dtype=None):
        kh, kw = attrs["kernel"]
        filters = attrs["filters"]
        groups = attrs.get("groups", 1)
        conv = ops.Conv2D(out_channel=filters, kernel_size=(kh, kw), mode=1, pad_mode="pad",
                          pad=tuple(attrs["padding"]), stride=tuple(attrs["strides"]), group=groups)
        super().__init__((filters, in_channels // groups, kh, kw), filters, attrs["use_bias"], conv, compute_dtype)


class Dense(_Linear):
    """dense; kernel (out, in) as nn.Dense, optional bias (out,); over the last axis of a sequence."""

    def __init__(self, in_features: int, attrs: Mapping[str, Any], compute_dtype=None):
        super().__init__((attrs["units"], in_features), attrs["units"], attrs["use_bias"],
                         ops.MatMul(transpose_b=True), compute_dtype)

    def construct(self, x):
        if x.ndim == 2:
            return self.apply(x)
        lead = x.shape[:-1]
        return self.apply(x.reshape(-1, x.shape[-1])).reshape(lead + (-1,))


class BatchNorm(nn.Cell):
    """batch_norm over every axis but channels (axis 1 here), statistics in float32."""

    def __init__(self, channels: int, attrs: Mapping[str, Any]):
        super().__init__()
        self.gamma = _zeros((channels,), "gamma")
        self.beta = _zeros((channels,), "beta")
        self.moving_mean = _zeros((channels,), "moving_mean", trainable=False)
        self.moving_variance = _zeros((channels,), "moving_variance", trainable=False)
        self.epsilon = float(attrs["epsilon"])
        self.momentum = float(attrs["momentum"])  # IR (Keras) convention: weight of the old value
        self.bn_train = ops.BatchNorm(is_training=True, epsilon=self.epsilon, momentum=1.0 - self.momentum)
        self.bn_infer = ops.BatchNorm(is_training=False, epsilon=self.epsilon)
        self.sync = None  # an all-reduce (sum over ranks) while distributed.synchronise_batch_norm is on

    def construct(self, x):
        shape = x.shape
        dtype = x.dtype
        if len(shape) == 2:
            x = x.reshape(shape[0], shape[1], 1, 1)
        elif len(shape) == 3:  # a sequence (N, S, D): channels are D, statistics over N and S
            x = x.transpose(0, 2, 1).reshape(shape[0], shape[2], shape[1], 1)
        if dtype != ms.float32:
            x = x.astype(ms.float32)
        if not self.training:
            y = self.bn_infer(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]
        elif self.sync is not None:
            from aiperf_backends.mindspore.distributed import synced_batch_norm

            y = synced_batch_norm(self, x)
        elif x.size == x.shape[1]:
            y = self._single_value(x)
        else:
            y = self.bn_train(x, self.gamma, self.beta, self.moving_mean, self.moving_variance)[0]
        if len(shape) == 2:
            y = y.reshape(shape)
        elif len(shape) == 3:
            y = y.reshape(shape[0], shape[2], shape[1]).transpose(0, 2, 1)
        return y if dtype == ms.float32 else y.astype(dtype)

    def _single_value(self, x):
        # mean = x and biased var = 0, so y = beta; the moving variance decays towards 0 (factor 1).
        mean = x.reshape(-1)
        self.update_moving(mean, ops.zeros_like(mean))
        # + 0 * x keeps x in the graph with a zero gradient, as the reference's
        return ops.broadcast_to(self.beta.reshape(1, -1, 1, 1), x.shape) + 0.0 * x

    def update_moving(self, mean, unbiased_var) -> None:
        m = self.momentum
        ops.assign(self.moving_mean, m * self.moving_mean + (1.0 - m) * ops.stop_gradient(mean))
        ops.assign(self.moving_variance, m * self.moving_variance + (1.0 - m) * ops.stop_gradient(unbiased_var))


class MaxPool(nn.Cell):
    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        pt, pb, pl, pr = attrs["padding"]
        self.pad = (pl, pr, pt, pb) if any(attrs["padding"]) else None  # ops.pad: last axis first
        self.pool = ops.MaxPool(kernel_size=tuple(attrs["kernel"]), strides=tuple(attrs["strides"]),
                                pad_mode="VALID")

    def construct(self, x):
        if self.pad is not None:
            x = ops.pad(x, self.pad, value=-math.inf)
        return self.pool(x)


class LRN(nn.Cell):
    """ONNX's LRN over the channels (axis 1), in float32, from its definition: the squares' sum over
    the window [c - (size-1)/2, c + (size-1)/2] (zero channels padded on both sides clip it at the
    edges) as `size` shifted slices, s = bias + alpha / size * sum, y = x * s^-beta.

    Not ops.LRN: that primitive is TensorFlow's LRN and maps exactly (depth_radius = (size - 1) / 2,
    alpha = ONNX alpha / size; measured against the reference), but MindSpore 2.10's CPU kernel fails
    ("Unknown Error!") for every channel count that is a multiple of 8 from 16 up (64 and 192 in
    Inception v1, 96 and 256 in AlexNet): measured for 1 to 99 channels."""

    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        self.size = attrs["size"]
        half = (self.size - 1) // 2
        self.pad = (0, 0, 0, 0, half, half)  # ops.pad: last axis first; the channels of NCHW
        self.scale = float(attrs["alpha"]) / self.size
        self.bias = float(attrs["bias"])
        self.beta = float(attrs["beta"])

    def construct(self, x):
        dtype = x.dtype
        if dtype != ms.float32:
            x = x.astype(ms.float32)
        channels = x.shape[1]
        squares = ops.pad(x * x, self.pad)
        window = squares[:, 0:channels]
        for offset in range(1, self.size):
            window = window + squares[:, offset:offset + channels]
        y = x * ops.pow(self.bias + self.scale * window, -self.beta)
        return y if dtype == ms.float32 else y.astype(dtype)


class AvgPool(nn.Cell):
    """avg_pool: zero padding (any per side), the 'valid' window mean over kh*kw taps, and without
    count_padding a factor kh*kw / (real taps) per output position (a constant of the shapes)."""

    def __init__(self, in_shape: tuple, attrs: Mapping[str, Any]):
        super().__init__()
        pt, pb, pl, pr = attrs["padding"]
        kh, kw = attrs["kernel"]
        self.pad = (pl, pr, pt, pb) if any(attrs["padding"]) else None  # ops.pad: last axis first
        self.pool = ops.AvgPool(kernel_size=(kh, kw), strides=tuple(attrs["strides"]), pad_mode="VALID")
        self.factor = None
        if self.pad is not None and not attrs["count_padding"]:
            h, w = in_shape[0], in_shape[1]
            real = np.pad(np.ones((h, w), np.float64), ((pt, pb), (pl, pr)))
            sh, sw = attrs["strides"]
            windows = np.lib.stride_tricks.sliding_window_view(real, (kh, kw))[::sh, ::sw]
            self.factor = Tensor((kh * kw / windows.sum(axis=(2, 3)))[None, None].astype(np.float32))

    def construct(self, x):
        if self.pad is not None:
            x = ops.pad(x, self.pad)
        y = self.pool(x)
        if self.factor is not None:
            y = y * (self.factor if y.dtype == ms.float32 else self.factor.astype(y.dtype))
        return y


class Constant(nn.Cell):
    """mul_const / add_const: a non-trainable `value`, per channel (axis 1 of an NCHW image, the last
    axis otherwise) or one scalar."""

    def __init__(self, shape: tuple, attrs: Mapping[str, Any], multiply: bool):
        super().__init__()
        self.value = _zeros(shape, "value", trainable=False)
        self.multiply = multiply
        self.per_channel = attrs["per_channel"]

    def construct(self, x):
        value = self.value if x.dtype == ms.float32 else self.value.astype(x.dtype)
        if self.per_channel and x.ndim == 4:
            value = value.reshape(1, -1, 1, 1)
        return x * value if self.multiply else x + value


class ChannelShuffle(nn.Cell):
    """ShuffleNet's shuffle of NCHW channels: (N, G, C/G, H, W) -> (N, C/G, G, H, W)."""

    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        self.groups = attrs["groups"]

    def construct(self, x):
        n, c, h, w = x.shape
        return x.reshape(n, self.groups, c // self.groups, h, w).swapaxes(1, 2).reshape(n, c, h, w)


class Embedding(nn.Cell):
    """embedding: the rows of `table` (vocab, units) for int64 token ids (N, S); float32."""

    def __init__(self, attrs: Mapping[str, Any]):
        super().__init__()
        self.table = _zeros((attrs["vocab"], attrs["units"]), "table")

    def construct(self, ids):
        return ops.gather(self.table, ids, 0)


class PositionEmbedding(nn.Cell):
    """position_embedding: x + table (S, D), the table broadcast over the batch."""

    def __init__(self, shape: tuple):
        super().__init__()
        self.table = _zeros(shape, "table")

    def construct(self, x):
        return x + (self.table if x.dtype == ms.float32 else self.table.astype(x.dtype))


class LayerNorm(nn.Cell):
    """layer_norm over the IR's last axis (biased variance), the fused primitive in float32; an NCHW
    image's last IR axis is its channels (axis 1), moved last and back."""

    def __init__(self, width: int, attrs: Mapping[str, Any]):
        super().__init__()
        self.gamma = _zeros((width,), "gamma")
        self.beta = _zeros((width,), "beta")
        self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=float(attrs["epsilon"]))

    def construct(self, x):
        if x.dtype != ms.float32:
            x = x.astype(ms.float32)
        if x.ndim == 4:
            return self.norm(x.transpose(0, 2, 3, 1), self.gamma, self.beta)[0].transpose(0, 3, 1, 2)
        return self.norm(x, self.gamma, self.beta)[0]


class Attention(nn.Cell):
    """Multi-head scaled dot-product attention over (N, S, heads * head_dim) q, and k, v of (N, S,
    kv_heads * head_dim): explicit BatchMatMul products in the compute dtype, the scores scaled, causally
    masked (-inf, so a masked pair's probability is exactly 0) and soft-maxed in float32. BatchMatMul, not
    ops.matmul, so that flops_collection counts both products (counter.py). Grouped-query attention
    repeats each key-value head for the heads / kv_heads query heads that read it (query head h reads
    key-value head h // group), so that both products are the multi-head ones, as the count rule says."""

    def __init__(self, seq_len: int, attrs: Mapping[str, Any], compute_dtype=None):
        super().__init__()
        self.heads, self.head_dim = attrs["heads"], attrs["head_dim"]
        self.kv_heads = kv_heads(attrs)
        self.group = self.heads // self.kv_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # j > i: the keys after each query
        self.masked = Tensor(np.triu(np.ones((seq_len, seq_len), np.bool_), 1)) if attrs["causal"] else None
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.mix = ops.BatchMatMul()
        self.compute_dtype = compute_dtype

    def _heads(self, t, heads: int):
        n, s, _ = t.shape
        if self.compute_dtype is not None:
            t = t.astype(self.compute_dtype)
        t = t.reshape(n, s, heads, self.head_dim).transpose(0, 2, 1, 3)
        return t if heads == self.heads else ops.repeat_interleave(t, self.group, 1)

    def construct(self, q, k, v):
        n, s, width = q.shape
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        scores = self.scores(q, k)
        if self.compute_dtype is not None:
            scores = scores.astype(ms.float32)
        scores = scores * self.scale
        if self.masked is not None:
            scores = ops.masked_fill(scores, self.masked, -math.inf)
        p = ops.softmax(scores, axis=-1)
        out = self.mix(p if self.compute_dtype is None else p.astype(self.compute_dtype), v)
        return out.transpose(0, 2, 1, 3).reshape(n, s, width)


class Experts(nn.Cell):
    """moe over (N, S, D), routed: the router's top_k experts per token, gated by the softmax over their logits
    (in float32); each expert's MLP (GELU with biases, or SwiGLU without: (silu(x @ w_gate) * (x @ w_in)) @
    w_out) in the compute dtype on the rows of the tokens that chose it only. The logits are read on the host
    once per call (PyNative: a slice's size is a host integer), where each token's top_k are chosen (the lower
    index first among equals) and the assignments sorted by expert (a stable sort); the chosen
    tokens' rows gathered in that order, so that each expert's rows are one contiguous slice; the outputs,
    weighted by their gates, are summed back per token (ops.unsorted_segment_sum). The parameters keep the IR's
    names and layout and are unstacked once per call, so that each one's gradient is one stack of the experts'
    gradients."""

    def __init__(self, width: int, attrs: Mapping[str, Any], compute_dtype=None):
        super().__init__()
        e, f = attrs["experts"], attrs["units"]
        self.experts, self.top_k = e, attrs["top_k"]
        self.swiglu = moe_mlp(attrs) == "swiglu"
        self.router = _zeros((width, e), "router")
        self.w_in, self.w_out = _zeros((e, width, f), "w_in"), _zeros((e, f, width), "w_out")
        if self.swiglu:
            self.w_gate = _zeros((e, width, f), "w_gate")
        else:
            self.b_in, self.b_out = _zeros((e, f), "b_in"), _zeros((e, width), "b_out")
        self.compute_dtype = compute_dtype
        self.balance = None  # (summed load-balancing loss, assignments per expert) of the last training pass

    def _cast(self, t):
        return t if self.compute_dtype is None else t.astype(self.compute_dtype)

    def _unstacked(self) -> dict[str, tuple]:
        names = ("w_gate", "w_in", "w_out") if self.swiglu else ("w_in", "b_in", "w_out", "b_out")
        return {name: ops.unstack(self._cast(getattr(self, name)), axis=0) for name in names}

    def _expert(self, rows, e: int, weights: Mapping[str, tuple]):
        """Expert e's MLP on its rows (R, D)."""
        if self.swiglu:
            hidden = ops.silu(ops.matmul(rows, weights["w_gate"][e])) * ops.matmul(rows, weights["w_in"][e])
            return ops.matmul(hidden, weights["w_out"][e])
        hidden = ops.gelu(ops.matmul(rows, weights["w_in"][e]) + weights["b_in"][e], approximate="tanh")
        return ops.matmul(hidden, weights["w_out"][e]) + weights["b_out"][e]

    def construct(self, x):
        n, s, d = x.shape
        rows = self._cast(x.reshape(n * s, d))
        logits = ops.matmul(rows, self._cast(self.router)).astype(ms.float32)
        # The layer's one host read: the choice, by a stable sort, puts the lower index first among equals, as
        # the IR does (ops.topk does not: measured on MindSpore 2.10's CPU kernel, [3, 3, 3] gives [1, 2]).
        chosen = np.argsort(-logits.asnumpy(), axis=-1, kind="stable")[:, :self.top_k]
        gates = ops.softmax(ops.gather_elements(logits, 1, Tensor(chosen.astype(np.int32))), axis=-1)
        assigned = chosen.reshape(-1)  # assignment i is token i // top_k's choice i % top_k
        order = np.argsort(assigned, kind="stable")
        ends = np.cumsum(np.bincount(assigned, minlength=self.experts)).tolist()
        token_of = Tensor((order // self.top_k).astype(np.int32))
        dispatched = ops.gather(rows, token_of, 0)
        weights = self._unstacked()
        outputs = [self._expert(dispatched[start:end], e, weights)
                   for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start]
        weighted = ops.cat(outputs, 0).astype(ms.float32) * ops.gather(gates.reshape(-1), Tensor(order), 0)[:, None]
        summed = ops.unsorted_segment_sum(weighted, token_of, n * s)
        if self.training:
            self.balance = self._load_balance(logits, chosen, n, s)
        return summed.astype(rows.dtype).reshape(n, s, d)

    def _load_balance(self, logits, chosen: np.ndarray, n: int, s: int) -> tuple[Tensor, np.ndarray]:
        """(the sum over the n sequences of E sum_e f_e P_e, the assignments per expert) of a routing: P from the
        float32 logits (n s, E), differentiable; f from the host's choices (n s, top_k), a constant."""
        e, k = self.experts, self.top_k
        received = np.zeros((n, e), np.int64)
        np.add.at(received, (np.repeat(np.arange(n), s * k), chosen.reshape(-1)), 1)
        share = Tensor((received / float(s * k)).astype(np.float32))
        probs = ops.softmax(logits, axis=-1).reshape(n, s, e).mean(axis=1)
        return (share * probs).sum() * float(e), received.sum(axis=0)


class RMSNorm(nn.Cell):
    """rms_norm over the IR's last axis, written out in float32: x * rsqrt(mean(x^2) + epsilon) * gamma.
    MindSpore's fused ops.rms_norm has no CPU kernel in 2.10 ("The kernel RmsNorm unregistered", reported
    by the op after it). An NCHW image's last IR axis is its channels (axis 1), moved last and back."""

    def __init__(self, width: int, attrs: Mapping[str, Any]):
        super().__init__()
        self.gamma = _zeros((width,), "gamma")
        self.epsilon = float(attrs["epsilon"])

    def construct(self, x):
        if x.dtype != ms.float32:
            x = x.astype(ms.float32)
        if x.ndim == 4:
            return self._normalised(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        return self._normalised(x)

    def _normalised(self, x):
        return x * ops.rsqrt(ops.mean(x * x, axis=-1, keep_dims=True) + self.epsilon) * self.gamma


class Rotary(nn.Cell):
    """rotary over (N, S, heads * head_dim), the half-split form: each head viewed as (2, head_dim/2) halves
    (x1, x2), y = (x1, x2) * cos + (x2, x1) * (-sin, sin). The tables, cos and signed sin of
    position * base^(-2i/head_dim), are constants computed in float64 on the host once per lowering and
    shape (`rotary_tables`: a Llama's query and key rotations of every layer share them); the product runs
    in the input's dtype."""

    def __init__(self, tables: tuple[Tensor, Tensor], head_dim: int):
        super().__init__()
        self.cos, self.sin = tables
        self.head_dim = head_dim

    def construct(self, x):
        n, s, width = x.shape
        halves = x.reshape(n, s, width // self.head_dim, 2, self.head_dim // 2)
        swapped = ops.concat((halves[:, :, :, 1:], halves[:, :, :, :1]), axis=3)
        cos, sin = (self.cos, self.sin) if x.dtype == ms.float32 else (self.cos.astype(x.dtype),
                                                                       self.sin.astype(x.dtype))
        return (halves * cos + swapped * sin).reshape(n, s, width)


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """Rotary's (S, 1, 2, head_dim/2) float32 tables, broadcast over the batch and the heads: cos twice, and
    (-sin, sin), of theta = position * base^(-2i/head_dim), computed in float64."""
    half = head_dim // 2
    theta = np.arange(seq_len, dtype=np.float64)[:, None] * base ** (-2.0 * np.arange(half, dtype=np.float64)
                                                                     / head_dim)
    cos = np.stack([np.cos(theta)] * 2, axis=1)[:, None]
    sin = np.stack([-np.sin(theta), np.sin(theta)], axis=1)[:, None]
    return Tensor(cos.astype(np.float32)), Tensor(sin.astype(np.float32))


def _add(xs):
    dtype = xs[0].dtype
    if any(x.dtype != dtype for x in xs):  # mixed precision can meet float32 and half branches
        xs = [x.astype(ms.float32) for x in xs]
    y = xs[0]
    for other in xs[1:]:
        y = y + other
    return y


def _mul(xs):
    a, b = xs
    if a.dtype != b.dtype:
        a, b = a.astype(ms.float32), b.astype(ms.float32)
    return a * b


def _concat(xs):
    if any(x.dtype != xs[0].dtype for x in xs):
        xs = [x.astype(ms.float32) for x in xs]
    return ops.concat(xs, axis=1)


def _flatten(xs):
    x = xs[0]
    if x.ndim == 4:  # NCHW -> NHWC order, so that dense kernels keep the canonical layout
        x = x.transpose(0, 2, 3, 1)
    return x.reshape(x.shape[0], -1)


_FUNCTIONS = {
    "relu": lambda xs: ops.relu(xs[0]),
    "add": _add,
    "concat": _concat,
    "global_avg_pool": lambda xs: ops.mean(xs[0], axis=(2, 3)),
    "flatten": _flatten,
    "softmax": lambda xs: ops.softmax(xs[0].astype(ms.float32), axis=-1),
    "gelu": lambda xs: ops.gelu(xs[0], approximate="tanh"),
    "silu": lambda xs: ops.silu(xs[0]),
    "mul": _mul,
}


class LoweredCell(nn.Cell):
    """An IR graph as a MindSpore cell (PyNative execution, node by node).

    ``construct(x, logits=False, masks=None)`` takes an NCHW batch (or (N, C) for a flat input,
    (N, S, D) for a sequence, int64 ids (N, S) for tokens; the backend transposes the NHWC input) and
    returns the graph's output, NCHW for an image. With
    ``logits=True`` and a softmax output it returns the softmax's input. ``masks`` maps dropout
    node ids to keep / (1 - rate) tensors in this cell's layout; training-mode dropout needs them.
    """

    def __init__(self, graph: Graph, precision: str = "fp32"):
        super().__init__()
        self.graph = graph
        self.precision = precision
        compute = None if precision == "fp32" else COMPUTE_DTYPES[precision]
        self.layers = nn.CellList()
        self.layer_of: dict[str, int] = {}  # node id -> index in self.layers
        tables: dict[tuple, tuple[Tensor, Tensor]] = {}  # rotary's, by (seq_len, head_dim, base)
        for node in graph.nodes:
            cell = self._make_cell(graph, node, compute, tables)
            if cell is not None:
                self.layer_of[node.id] = len(self.layers)
                self.layers.append(cell)
        self.checkpoint_blocks = False  # set by `checkpointing`
        self._build_plan()

    @staticmethod
    def _make_cell(graph: Graph, node: Node, compute_dtype, tables: dict):
        a = node.attrs
        in_shape = graph.shapes[node.inputs[0]] if node.inputs else None
        if node.op == "conv2d":
            return Conv(in_shape[-1], a, compute_dtype)
        if node.op == "dense":
            return Dense(in_shape[-1], a, compute_dtype)
        if node.op == "batch_norm":
            return BatchNorm(in_shape[-1], a)
        if node.op == "max_pool":
            return MaxPool(a)
        if node.op == "lrn":
            return LRN(a)
        if node.op == "avg_pool":
            return AvgPool(in_shape, a)
        if node.op in ("mul_const", "add_const"):
            return Constant(graph.param_shapes(node.id)["value"], a, multiply=node.op == "mul_const")
        if node.op == "channel_shuffle":
            return ChannelShuffle(a)
        if node.op == "embedding":
            return Embedding(a)
        if node.op == "position_embedding":
            return PositionEmbedding(in_shape)
        if node.op == "layer_norm":
            return LayerNorm(in_shape[-1], a)
        if node.op == "attention":
            return Attention(in_shape[0], a, compute_dtype)
        if node.op == "moe":
            return Experts(in_shape[-1], a, compute_dtype)
        if node.op == "rms_norm":
            return RMSNorm(in_shape[-1], a)
        if node.op == "rotary":
            key = (in_shape[0], a["head_dim"], a["base"])
            if key not in tables:
                tables[key] = rotary_tables(*key)
            return Rotary(tables[key], a["head_dim"])
        return None

    def _build_plan(self) -> None:
        g = self.graph
        index = {n.id: i for i, n in enumerate(g.nodes)}
        last_reader: dict[str, int] = {}
        for i, node in enumerate(g.nodes):
            for src in node.inputs:
                last_reader[src] = i
        plan = []
        for i, node in enumerate(g.nodes):
            if node.op in INPUT_OPS:
                continue
            inputs = tuple(index[s] for s in node.inputs)
            free = tuple(index[s] for s in node.inputs if last_reader[s] == i)
            layer = self.layer_of.get(node.id, -1)
            rate = float(node.attrs["rate"]) if node.op == "dropout" else 0.0
            plan.append((i, node.id, node.op, inputs, free, layer, rate))
        self.plan = tuple(plan)
        self.input_index = index[g.input_id]
        self.output_index = index[g.output_id]
        out_node = g[g.output_id]
        self.logits_index = index[out_node.inputs[0]] if out_node.op == "softmax" else None
        self.n_values = len(g.nodes)
        # Checkpointed blocks, by the plan position of their first node: (that of their last, the
        # value index of their input). A block whose inner values something outside it reads (or
        # that holds the output or the logits) is run plainly.
        at = {node_id: k for k, (_, node_id, *_rest) in enumerate(self.plan)}
        self.block_spans: dict[int, tuple[int, int]] = {}
        for block in g.blocks():
            inside = set(block.nodes)
            inner = [n for n in block.nodes if n != block.output]
            read_outside = any(reader.id not in inside for n in inner for reader in g.consumers(n))
            ends = {self.output_index, self.logits_index} & {index[n] for n in inner}
            first, last = at[block.nodes[0]], at[block.output]
            if not read_outside and not ends and last - first + 1 == len(block.nodes):
                self.block_spans[first] = (last, index[block.input])

    @property
    def has_logits(self) -> bool:
        return self.logits_index is not None

    def construct(self, x, logits=False, masks=None):
        stop = self.logits_index if logits and self.logits_index is not None else self.output_index
        values: list[Any] = [None] * self.n_values
        values[self.input_index] = x
        spans = self.block_spans if self.checkpoint_blocks and self.training else {}
        k = 0
        while k < len(self.plan):
            if k in spans:  # a checkpointed block: only its input is kept for the backward pass
                last, block_input = spans[k]
                entries = self.plan[k:last + 1]
                values[entries[-1][0]] = ms.recompute(self._block(entries, block_input, masks), values[block_input],
                                                      use_reentrant=False)
                if any(block_input in free for *_head, free, _layer, _rate in entries):
                    values[block_input] = None
                k = last + 1
                continue
            entry = self.plan[k]
            i, free = entry[0], entry[4]
            values[i] = self._node(entry, [values[j] for j in entry[3]], masks)
            if i == stop:
                break
            for j in free:
                values[j] = None
            k += 1
        out = values[stop]
        return out if out.dtype == ms.float32 else out.astype(ms.float32)

    def _node(self, entry, args: list, masks):
        """One plan entry's output from its inputs' values."""
        _, node_id, op, _, _, layer, rate = entry
        if layer >= 0:
            return self.layers[layer](*args)
        if op == "dropout":
            y = args[0]
            if self.training and rate > 0.0:
                if masks is None or node_id not in masks:
                    raise GraphError("training-mode dropout needs a mask", node_id)
                y = y * masks[node_id].astype(y.dtype)
            return y
        return _FUNCTIONS[op](args)

    def _block(self, entries: tuple, block_input: int, masks):
        """A block's forward pass as a function of its input (what mindspore.recompute replays)."""

        def forward(x):
            values = {block_input: x}
            for entry in entries:
                values[entry[0]] = self._node(entry, [values[j] for j in entry[3]], masks)
            return values[entries[-1][0]]

        return forward

    def checkpointing(self, enabled: bool):
        """Context manager: activation checkpointing of the graph's blocks in training-mode passes
        inside it (TrainConfig.checkpoint_blocks), restored on exit."""
        from contextlib import contextmanager

        @contextmanager
        def scope():
            saved = self.checkpoint_blocks
            self.checkpoint_blocks = bool(enabled)
            try:
                yield
            finally:
                self.checkpoint_blocks = saved

        return scope()

    def computing_in(self, precision: str):
        """Context manager: conv, dense, attention and experts compute in `precision` inside the block (training
        at a precision other than the lowering's), restored on exit."""
        from contextlib import contextmanager

        @contextmanager
        def scope():
            saved = self.precision
            self._set_compute(precision)
            try:
                yield
            finally:
                self._set_compute(saved)

        return scope()

    def _set_compute(self, precision: str) -> None:
        self.precision = precision
        compute = None if precision == "fp32" else COMPUTE_DTYPES[precision]
        for cell in self.layers:
            if isinstance(cell, (Conv, Dense, Attention, Experts)):
                cell.compute_dtype = compute

    # -- layouts at the boundary -------------------------------------------------
    def to_cell_layout(self, x) -> Tensor:
        """An NHWC batch as this cell's NCHW float32 input. A float batch (in-memory data, already
        normalised) is transposed on the host. uint8 pixels (streamed batches; a NumPy array, or a
        Tensor sliced from synthetic data already on the device) cross as they are, a quarter of
        the bytes, and are normalised and transposed on the device (`normalised_pixels`). Token ids
        become an int64 Tensor; a real-valued sequence or flat batch float32, as it is."""
        if self.graph.takes_tokens:
            return x if isinstance(x, Tensor) else Tensor(np.ascontiguousarray(x, dtype=np.int64))
        if isinstance(x, Tensor):
            if x.dtype != ms.uint8:
                raise GraphError(f"a device batch must hold uint8 pixels, got {x.dtype}", self.graph.input_id)
            return normalised_pixels(x)
        if np.asarray(x).dtype == np.uint8 and np.ndim(x) == 4:
            return normalised_pixels(Tensor(np.ascontiguousarray(x)))
        x = np.asarray(x)
        if x.ndim == 4:
            x = x.transpose(0, 3, 1, 2)
        return Tensor(np.ascontiguousarray(x, dtype=np.float32))

    @staticmethod
    def to_canonical_output(y: np.ndarray) -> np.ndarray:
        if y.ndim == 4:
            y = y.transpose(0, 2, 3, 1)
        return np.ascontiguousarray(y, dtype=np.float32)

    def moe_ids(self) -> list[str]:
        return [node.id for node in self.graph.nodes if node.op == "moe"]

    def balance_loss(self):
        """The sum of every moe's summed load-balancing loss (Experts.balance) in the last training pass, a
        tensor of it (its gradient reaches the routers and the moes' inputs); None without a moe."""
        losses = [self.layers[self.layer_of[n]].balance[0] for n in self.moe_ids()]
        return sum(losses[1:], losses[0]) if losses else None

    def expert_counts(self) -> list[np.ndarray]:
        """Each moe's assignments per expert (int64 (E,)) in the last training pass, in moe_ids' order."""
        return [self.layers[self.layer_of[n]].balance[1] for n in self.moe_ids()]

    def dropout_nodes(self) -> list[Node]:
        return [n for n in self.graph.nodes if n.op == "dropout" and n.attrs["rate"] > 0.0]

    def masks_from(self, rng: np.random.Generator, batch: int) -> dict[str, Tensor]:
        """Dropout masks drawn as the NumPy reference draws them (float64 draws over the NHWC
        shape, in graph order), in this cell's layout."""
        masks = {}
        for node in self.dropout_nodes():
            rate = node.attrs["rate"]
            shape = (batch,) + tuple(self.graph.shapes[node.id])
            keep = np.where(rng.random(shape) >= rate, 1.0 / (1.0 - rate), 0.0).astype(np.float32)
            if keep.ndim == 4:
                keep = keep.transpose(0, 3, 1, 2)
            masks[node.id] = Tensor(np.ascontiguousarray(keep))
        return masks

    # -- weights -------------------------------------------------------------
    def parameter(self, node_id: str, pname: str) -> Parameter:
        cell = self.layers[self.layer_of[node_id]]
        param = getattr(cell, pname, None)
        if not isinstance(param, Parameter):
            raise GraphError(f"no parameter '{pname}' in a lowered {type(cell).__name__}", node_id)
        return param

    def load_canonical(self, weights: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        validate_weights(self.graph, weights, complete=False)
        for node_id, params in weights.items():
            for pname, array in params.items():
                value = np.asarray(array, dtype=np.float32)
                if pname == "kernel" and value.ndim == 2:  # (in, out) -> (out, in)
                    value = transposed_copy(value)
                elif pname == "kernel":  # HWIO -> OIHW
                    value = value.transpose(3, 2, 0, 1)
                self.parameter(node_id, pname).set_data(Tensor(np.ascontiguousarray(value)))

    def export_canonical(self) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            out[node_id] = {pname: to_canonical(pname, self.parameter(node_id, pname).asnumpy()) for pname in shapes}
        return out

    def trainable(self) -> list[tuple[str, str, Parameter]]:
        """(node id, canonical name, parameter) of every trainable parameter, in graph order."""
        out = []
        for node_id, shapes in self.graph.all_param_shapes().items():
            out.extend((node_id, p, self.parameter(node_id, p)) for p in shapes if is_trainable(p))
        return out

    def moving_statistics(self) -> list[Parameter]:
        out = []
        for node_id, shapes in self.graph.all_param_shapes().items():
            out.extend(self.parameter(node_id, p) for p in shapes if p in STATE)
        return out


_NORMALISATION: list = []  # (MEAN, INV_STD) as float32 Tensors, made on first use


def normalised_pixels(pixels: Tensor) -> Tensor:
    """uint8 NHWC pixels -> NCHW float32 `(float32(x) - MEAN) * INV_STD` per channel, computed by
    MindSpore ops on the device target: the arithmetic of aiperf_core.data.preprocess.normalise,
    operation for operation (the transpose moves values, it computes nothing)."""
    if not _NORMALISATION:
        from aiperf_core.data.preprocess import INV_STD, MEAN

        _NORMALISATION.extend([Tensor(MEAN), Tensor(INV_STD)])
    mean, inv_std = _NORMALISATION
    return ((pixels.astype(ms.float32) - mean) * inv_std).transpose(0, 3, 1, 2)


def to_canonical(pname: str, array: np.ndarray) -> np.ndarray:
    """A MindSpore-layout parameter (or gradient) as a canonical float32 array of its own."""
    # A copy: asnumpy() shares a Parameter's memory, which the next optimizer step overwrites in place.
    if pname == "kernel" and np.ndim(array) == 2:  # (out, in) -> (in, out)
        return transposed_copy(array)
    array = np.array(array, dtype=np.float32)
    if pname == "kernel":  # OIHW -> HWIO
        array = array.transpose(2, 3, 1, 0)
    return np.ascontiguousarray(array)


def lower_graph(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str) -> LoweredCell:
    model = LoweredCell(graph, precision)
    validate_weights(graph, weights)
    model.load_canonical(weights)
    model.set_train(False)
    return model
