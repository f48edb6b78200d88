"""Lowering the aiperf IR to torch: parameters in standard modules, a forward generated as code.

`LoweredModel` keeps each parametric node's tensors in a standard module (nn.Conv2d, a batch norm,
nn.Linear; one per node, in graph order, under `layers`), which is what optimisers,
DistributedDataParallel, the synchronised batch norm of distributed.py and state dicts expect. Its
forward is Python source generated from the IR: one line per node, every stride, padding and
kernel written as a literal, values deleted after their last reader. torch.compile therefore sees
one straight-line frame with no graph breaks and nothing to specialise per conv configuration
(interpreting the nodes through one generic conv module made dynamo recompile that module's forward
for every configuration until it hit its recompile limit). `generated_source(model)` shows the code.

Layout: the IR is NHWC with HWIO conv kernels and (in, out) dense kernels. Inside the model
activations are logically NCHW (what torch's ops expect) but, because the NHWC input is only
permuted, they live in memory as channels_last, which is also what oneDNN and cuDNN prefer; conv
kernels are kept channels_last too. Conversions happen at the boundaries only:

* input  NHWC -> NCHW view (``permute(0, 3, 1, 2)``, no copy);
* output NCHW -> NHWC when the graph's output is an image;
* ``flatten`` permutes to NHWC order before flattening, so a dense kernel that follows keeps its
  canonical (H, W, C)-ordered rows;
* kernels HWIO <-> OIHW and (in, out) <-> (out, in) when weights cross the interface. These are
  pure transposes, so export returns exactly (bit for bit) what was imported.

On a CPU each conv runs in the form conv_probe chose for its geometry: channels_last unless this
CPU's kernel computes a wrong weight gradient there (issue 18.1). `place(model, device)` moves a
model and generates its forward again for the new device.

Sequences (a `token_input` graph, or an `input` of shape (S, D)) keep the IR's layout, (N, S, D),
with the ops over the last axis: no permutes.

Padding is explicit per side [top, bottom, left, right]. Symmetric padding is passed to the conv
or pool itself (so the fast oneDNN/cuDNN paths apply); asymmetric padding is an ``F.pad`` (zeros
for conv and avg-pool, -inf for max-pool) followed by the op with padding 0.

The ops of the IR's second version:

* ``conv2d`` with ``groups``: F.conv2d's ``groups`` (the IR's HWIO kernel with I = C/groups is
  torch's OIHW kernel transposed, filter block g reading input channel block g in both);
* ``lrn``: F.local_response_norm, which is ONNX's LRN: it sums the squares over the window
  [c - size//2, c + (size-1)//2] of zero-padded channels and scales the sum by alpha/size;
* ``avg_pool``: F.avg_pool2d, ``count_include_pad = count_padding``, where torch's own padding
  can hold the IR's (symmetric, at most half the window); otherwise the window sums of the
  zero-padded input (``divisor_override=1``) divided by kh*kw, or by each window's real taps (a
  buffer computed when lowering) when padding is not counted;
* ``mul_const``/``add_const``: the constant is a buffer (`Constant`), exported and imported with the
  weights like batch norm's moving statistics, never trained;
* ``channel_shuffle``: the (G, C/G) -> (C/G, G) transpose of the channel axis, done on the
  channels_last memory (NHWC view), so that it is one copy;
* ``embedding``: F.embedding of the ids with the table (``nn.Embedding``'s weight, (vocab, units),
  the IR's layout); ``position_embedding``: the input plus its table (`PositionTable`);
* ``layer_norm``: F.layer_norm over the last axis (biased variance, as the IR; an image's channels
  through its NHWC view), in fp32 under mixed precision (autocast keeps it in fp32 on CUDA but not
  on a CPU: the cast makes both alike);
* ``attention``: F.scaled_dot_product_attention(is_causal=causal) on (N, A, S, d) views of the
  (N, S, A*d) inputs (`attention` below), so that torch picks its fused kernel (flash,
  memory-efficient or cuDNN attention on CUDA, the flash kernel for CPUs);
* ``gelu``: F.gelu(approximate="tanh"); ``softmax`` over the last axis, per position of a
  sequence.

The ops of the IR's fourth version (Llama's family):

* ``rms_norm``: F.rms_norm (torch's fused kernel), as layer_norm: an image's channels through its
  NHWC view, in fp32 under mixed precision; the gamma is an nn.RMSNorm's weight;
* ``rotary``: `rotary` below, half-split, with the cos/sin tables of a `Rotary` module's buffers;
* ``silu``: F.silu; ``mul``: ``a * b``;
* ``attention`` with ``kv_heads``: F.scaled_dot_product_attention(enable_gqa=True);
* ``moe`` with ``mlp: swiglu``: `Experts` with w_gate and no biases.

An attention's query, key and value projections, and a SwiGLU's gate and up projections, run as one
product where that is valid (`fused_projections`).

Batch norm is ``nn.BatchNorm2d``/``nn.BatchNorm1d`` with ``eps = epsilon`` and
``momentum = 1 - IR momentum`` (the IR's momentum is Keras-style, torch's is its complement). Like
the NumPy reference, training normalises with the biased batch variance and feeds the unbiased one
to the moving average. The one case torch refuses, a single value per channel in training, is
handled as the reference does (output beta, Bessel factor taken as 1).

Values are freed after their last reader, and ops whose input has no other reader and whose
producer did not save its output for backward (conv, batch norm, add) run in place, as a
hand-written torchvision-style ResNet does.
"""

from __future__ import annotations

import itertools
import linecache
import math
import re
from typing import Any, Mapping, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from aiperf_backends.torch import conv_probe
from aiperf_backends.torch.loss import normalise_pixels, summed_loss
from aiperf_backends.torch.precision import AUTOCAST_DTYPES, compute_dtype
from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, is_trainable, kv_heads, moe_mlp
from aiperf_core.weights import Weights, transposed_copy, validate_weights

# Producers whose output autograd does not keep (their backward needs only their input),
# so a sole reader may overwrite that output in place.
_INPLACE_SAFE_PRODUCERS = frozenset({"conv2d", "batch_norm", "add"})

# The conv kernel the generated forward calls (and the CPU probe checks): a module attribute so
# that a test can plant a faulty one before lowering.
conv2d = F.conv2d


class _SingleValueSafeBN:
    """Mixin: training with one value per channel, which torch refuses, done as the reference does."""

    def forward(self, x):  # type: ignore[override]
        if self.training and x.numel() == x.shape[1]:
            return _bn_single_value(self, x)
        return super().forward(x)


def _bn_single_value(bn, x):
    # mean = x and biased var = 0, so y = beta; the moving variance decays towards 0 (Bessel factor 1).
    dims = [0] + list(range(2, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    centred = x - mean
    var = (centred * centred).mean(dim=dims, keepdim=True)
    shape = [1, -1] + [1] * (x.dim() - 2)
    y = centred * torch.rsqrt(var + bn.eps) * bn.weight.view(shape) + bn.bias.view(shape)
    with torch.no_grad():
        m = bn.momentum
        bn.running_mean.mul_(1 - m).add_(mean.reshape(-1).to(bn.running_mean.dtype), alpha=m)
        bn.running_var.mul_(1 - m).add_(var.reshape(-1).to(bn.running_var.dtype), alpha=m)
        bn.num_batches_tracked.add_(1)
    return y


class BatchNorm2d(_SingleValueSafeBN, nn.BatchNorm2d):
    pass


class BatchNorm1d(_SingleValueSafeBN, nn.BatchNorm1d):
    pass


class Dropout(nn.Module):
    """Inverted dropout. Where the masks come from is set by LoweredModel.dropout_masks():

    * None (default): torch's global generator (F.dropout);
    * a torch.Generator: ``keep = rand(shape) >= rate`` drawn from it, on the value's device;
    * a numpy Generator: the NumPy reference's masks exactly (``keep = rng.random(NHWC shape) >= rate``,
      float64 draws in graph order), so that loss_and_grads matches the reference even with dropout.

    A compiled step draws from torch's global generator: dynamo cannot trace an explicit Generator.
    """

    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate
        self.source = None

    def forward(self, x):
        if not self.training or self.rate == 0:
            return x
        scale = 1.0 / (1.0 - self.rate)
        if self.source is None or torch.compiler.is_compiling():
            return F.dropout(x, self.rate, True)
        if isinstance(self.source, np.random.Generator):
            shape = (x.shape[0],) + tuple(x.shape[2:]) + (x.shape[1],) if x.dim() == 4 else tuple(x.shape)
            mask = np.where(self.source.random(shape) >= self.rate, scale, 0.0).astype(np.float32)
            m = torch.from_numpy(mask).to(x.device)
            if x.dim() == 4:
                m = m.permute(0, 3, 1, 2)
            return x * m.to(x.dtype)
        keep = torch.rand(x.shape, generator=self.source, device=x.device) >= self.rate
        return x * (keep.to(x.dtype) * scale)


# -- helpers the generated code calls where dtypes are known only at run time (mixed precision) --


def add_mixed(*xs, inplace: int):
    """Sum of the inputs under autocast (branches may differ in dtype); `inplace` is the index of an
    input that may be overwritten, or -1."""
    if inplace >= 0:
        acc = xs[inplace]
        rest = xs[:inplace] + xs[inplace + 1:]
        if all(torch.promote_types(acc.dtype, r.dtype) == acc.dtype for r in rest):
            for r in rest:
                acc = acc.add_(r)
            return acc
    y = xs[0] + xs[1]
    for r in xs[2:]:
        y = y.add_(r) if torch.promote_types(y.dtype, r.dtype) == y.dtype else y + r
    return y


def concat_mixed(*xs):
    if any(x.dtype != xs[0].dtype for x in xs):  # mixed precision can mix bf16 and fp32 branches
        xs = [x.float() for x in xs]
    return torch.cat(xs, dim=1)


def attention(q, k, v, heads: int, causal: bool, kv_heads: int):
    """The IR's attention on an (N, S, heads * d) query and (N, S, kv_heads * d) key and value: heads split
    to (N, A, S, d), the fused kernel (its scale is 1/sqrt(d), its causal mask the pairs j > i; with fewer
    key-value heads, enable_gqa: query head h reads key-value head h // (heads / kv_heads), as the IR says,
    without a repeated copy of the keys and values where the kernel takes the groups itself), heads joined
    again."""
    n, s, width = q.shape
    d = width // heads
    q = q.view(n, s, heads, d).transpose(1, 2)
    k, v = (t.view(n, s, kv_heads, d).transpose(1, 2) for t in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    return y.transpose(1, 2).reshape(n, s, width)


def rotary(x, cos, sin):
    """The IR's rotary on (N, S, heads * d), half-split form: in each head, out1 = x1 cos - x2 sin and
    out2 = x2 cos + x1 sin, x1 and x2 its first and second halves; `cos` and `sin` are the (S, 1, d/2)
    tables of a `Rotary` module, taken in x's dtype (a bf16 projection is rotated in bf16, as Hugging Face's
    Llama does). unflatten and unbind are views, so that a split of the fused projection is read in place."""
    halves = x.unflatten(-1, (-1, 2, cos.shape[-1]))  # (N, S, heads, 2, d/2)
    x1, x2 = halves.unbind(-2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-2).flatten(-3)


def run_block(model, block, x):
    """`block(model, x)` (a function generated for one of the graph's blocks). With the model's
    `checkpoint_blocks` set, while it trains with gradients on: through torch.utils.checkpoint
    (use_reentrant=False), which keeps `x` alone for the backward pass and runs the block again
    there. torch restores its own random state for that second run (CPU and device generators);
    dropout drawing from a generator of its own (Dropout.source) gets that generator's state back
    here, so that the recomputed masks are the forward's."""
    if not (model.checkpoint_blocks and model.training and torch.is_grad_enabled()):
        return block(model, x)
    if torch.compiler.is_compiling():  # a compiled step's dropout draws from torch's generator
        return checkpoint(block, model, x, use_reentrant=False)
    sources = _dropout_sources(model)
    if not sources:
        return checkpoint(block, model, x, use_reentrant=False)
    start = [_generator_state(s) for s in sources]
    runs = []

    def replayed(model, x):
        if runs:  # a recomputation: the forward's masks, and the generators left as they are now
            now = [_generator_state(s) for s in sources]
            for s, state in zip(sources, start):
                _set_generator_state(s, state)
            try:
                return block(model, x)
            finally:
                for s, state in zip(sources, now):
                    _set_generator_state(s, state)
        runs.append(True)
        return block(model, x)

    return checkpoint(replayed, model, x, use_reentrant=False)


def _dropout_sources(model) -> list:
    """The distinct explicit generators the model's dropout draws from (Dropout.source)."""
    found = []
    for m in model.dropouts:
        if m.source is not None and m.rate > 0 and all(m.source is not s for s in found):
            found.append(m.source)
    return found


def _generator_state(source):
    if isinstance(source, np.random.Generator):
        return source.bit_generator.state
    return source.get_state()


def _set_generator_state(source, state) -> None:
    if isinstance(source, np.random.Generator):
        source.bit_generator.state = state
    else:
        source.set_state(state)


def channel_shuffle(x, groups: int):
    """ShuffleNet's shuffle of NCHW `x`: channel g * (C/G) + j moves to j * G + g. Done on the NHWC
    view, which is the memory order of a channels_last tensor, and returned channels_last."""
    nhwc = x.permute(0, 2, 3, 1)
    shuffled = nhwc.unflatten(3, (groups, nhwc.shape[3] // groups)).transpose(3, 4).flatten(3)
    return shuffled.permute(0, 3, 1, 2)


class Constant(nn.Module):
    """The constant of a mul_const or add_const node: a buffer (exported and imported with the
    weights, never trained), of shape (C,) or (1,)."""

    def __init__(self, size: int):
        super().__init__()
        self.register_buffer("value", torch.zeros(size))


class PositionTable(nn.Module):
    """A position_embedding's learned table, (S, D)."""

    def __init__(self, seq_len: int, units: int):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(seq_len, units))


def expert_segments(chosen, experts: int):
    """The sorted dispatch of a moe: `chosen` (T, k) holds each token's experts. Returns `order`, the
    flattened (token, choice) assignments (index t * k + slot) sorted by expert, stably (so a segment keeps
    its tokens in order), and `offsets`, int32 (experts,), the cumulative segment sizes: expert e's
    assignments are order[offsets[e-1]:offsets[e]] (torch._grouped_mm's `offs`). Both stay on the device
    and have shapes fixed by (T, k, experts)."""
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    bounds = torch.arange(experts, device=chosen.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], bounds, right=True, out_int32=True)


def grouped_mm_fits(device, dtype, width: int, units: int) -> bool:
    """Whether a moe runs its experts as torch._grouped_mm: on CUDA in bf16 (the dtype its kernel and its
    meta function, which torch.compile traces, take), with rows of 16 bytes' multiples (its alignment)."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and width % 8 == 0 and units % 8 == 0)


class Routing(NamedTuple):
    """What one training forward of a moe routed. `balance`: the load-balancing loss summed over the
    batch's sequences, sum_b E sum_e f_{b,e} P_{b,e} (f_{b,e}: the share of sequence b's S k assignments
    that went to expert e, no gradient; P_{b,e}: the mean over b's tokens of the router's softmax over all E
    experts), float32, differentiable. Summed, not averaged, as the step's cross-entropy is (loss.py), so that
    micro-batches and ranks add up. `load`: the assignments each expert received, int64 (E,)."""

    balance: torch.Tensor
    load: torch.Tensor


class SegmentProducts(torch.autograd.Function):
    """The experts' products over the contiguous segments of tokens sorted by expert, as one autograd node:
    apply(tokens (N, D), sizes (the E segments' row counts), swiglu, dtype, *weights), weights as
    Experts holds them (GELU: w_in, b_in, w_out, b_out; SwiGLU: w_gate, w_in, w_out), outputs (N, D).

    Why one node: indexing an expert's slice of a stack (w_in[e]) per expert made autograd build, for each
    of E experts and each stack, a zero-filled gradient of the whole stack and add them up (E stack-sized
    fills and adds per parameter and step: more time than the products). Here the forward writes the
    products into preallocated (N, F) and (N, D) buffers (`out=`, no cat), the activation runs once over
    the whole buffer, and the backward writes each expert's weight gradient straight into its slice of the
    stack's gradient (zeros only for experts that got no token).

    The block (`_Layout`): when every expert has m >= BLOCK_MIN_ROWS rows, the first m rows of each are
    one (E, m) block whose products are one batched product over the stacks (torch.bmm / baddbmm), and
    only each expert's remaining rows run as per-expert products. A batched product parallelises over the
    experts, which E products of a few hundred rows each on a few threads do not. The (N, F) buffers
    live in that order; only the (N, D) tokens and outputs (and their gradients) are permuted. Either
    way the products are exactly the routed ones (FlopCounterMode books mm/addmm/bmm/baddbmm with out=
    like the plain ones, and addmm with out= its input, unlike addmm_).

    `dtype` is the products' dtype (autocast's where it is on, as Experts.products decides): the tokens
    and weights are cast to it explicitly and autocast is off inside, since out= variants are not
    autocast's to cast; the gradients come back in each input's own dtype."""

    @staticmethod
    def forward(ctx, tokens, sizes, swiglu, dtype, *weights):
        layout = _Layout(sizes, tokens.device)
        with torch.autocast(tokens.device.type, enabled=False):
            x = layout.permute(tokens.to(dtype))
            cast = [w.to(dtype) for w in weights]  # no copy unless autocast changes the dtype
            rows, width = x.shape
            if swiglu:
                w_gate, w_in, w_out = cast
                gate = layout.products(x, w_gate, x.new_empty(rows, w_in.shape[-1]))
                up = layout.products(x, w_in, x.new_empty(rows, w_in.shape[-1]))
                hidden = F.silu(gate) * up
                out = layout.products(hidden, w_out, x.new_empty(rows, width))
                ctx.save_for_backward(x, gate, up, hidden, w_gate, w_in, w_out)
            else:
                w_in, b_in, w_out, b_out = cast
                before = layout.products(x, w_in, x.new_empty(rows, w_in.shape[-1]), b_in)
                hidden = F.gelu(before, approximate="tanh")
                out = layout.products(hidden, w_out, x.new_empty(rows, width), b_out)
                ctx.save_for_backward(x, before, hidden, w_in, w_out)
            out = layout.restore(out)
        ctx.layout, ctx.swiglu = layout, swiglu
        ctx.dtypes = (tokens.dtype,) + tuple(w.dtype for w in weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # Inputs: 0 tokens, 1 sizes, 2 swiglu, 3 dtype, 4... the weights (GELU: w_in 4, b_in 5, w_out 6,
        # b_out 7; SwiGLU: w_gate 4, w_in 5, w_out 6).
        layout, needs = ctx.layout, ctx.needs_input_grad
        grads: dict[int, torch.Tensor] = {}
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.swiglu:
                x, gate, up, hidden, w_gate, w_in, w_out = ctx.saved_tensors
            else:
                x, before, hidden, w_in, w_out = ctx.saved_tensors
            grad_out = layout.permute(grad_out.to(x.dtype).contiguous())
            grad_hidden = layout.products(grad_out, w_out, hidden.new_empty(hidden.shape), transposed=True)
            if ctx.swiglu:
                # hidden = silu(gate) * up: the gradients of the two (N, F) products' outputs.
                firsts = {4: (w_gate, torch.ops.aten.silu_backward(grad_hidden * up, gate)),
                          5: (w_in, grad_hidden * F.silu(gate))}
            else:
                # In place: grad_hidden is not read again (an elementwise op may write its own input).
                grad_before = torch.ops.aten.gelu_backward.grad_input(grad_hidden, before, approximate="tanh",
                                                                     grad_input=grad_hidden)
                firsts = {4: (w_in, grad_before)}
                if needs[5]:
                    grads[5] = layout.row_sums(grad_before)
                if needs[7]:
                    grads[7] = layout.row_sums(grad_out)
            for index, (weight, grad) in firsts.items():
                if needs[index]:
                    grads[index] = layout.weight_grad(x, grad)
            if needs[6]:
                grads[6] = layout.weight_grad(hidden, grad_out)
            grad_tokens = None
            if needs[0]:
                (weight, grad), *others = firsts.values()
                grad_tokens = layout.products(grad, weight, x.new_empty(x.shape), transposed=True)
                for other, other_grad in others:
                    layout.products(other_grad, other, grad_tokens, transposed=True, accumulate=True)
                grad_tokens = layout.restore(grad_tokens).to(ctx.dtypes[0])
        weights = [grads[i].to(ctx.dtypes[i - 3]) if i in grads else None for i in range(4, 4 + len(ctx.dtypes) - 1)]
        return (grad_tokens, None, None, None, *weights)


# The fewest rows every expert must have for SegmentProducts to batch them (_Layout): below it the products
# are small and each runs alone, so that small models (and the tests comparing a one-device run with an
# expert-parallel one, whose AdamW steps amplify any change of summation order) keep per-expert products.
BLOCK_MIN_ROWS = 128


class _Layout:
    """The row order of SegmentProducts' buffers for segments of `sizes` rows (sorted by expert). `block`:
    the rows every expert has (the smallest size; 0 when an expert has none or fewer than BLOCK_MIN_ROWS);
    the buffers hold the first `block` rows of each expert as an (E, block) block, then each expert's
    remaining rows, whose spans are `segments`: (expert, first row, end row). With no block the order is
    the sorted one."""

    def __init__(self, sizes, device):
        self.experts = len(sizes)
        self.block = min(sizes) if sizes else 0
        if self.block < BLOCK_MIN_ROWS:
            self.block = 0
        starts = [sum(sizes[:e]) for e in range(self.experts)]
        self.segments, row = [], self.block * self.experts
        for e, size in enumerate(sizes):
            if size > self.block:
                self.segments.append((e, row, row + size - self.block))
                row += size - self.block
        self.order = self.inverse = None
        if self.block:  # buffer row i holds sorted row order[i]
            first = torch.arange(self.block, device=device)
            spans = [start + first for start in starts]
            spans += [torch.arange(start + self.block, start + size, device=device)
                      for start, size in zip(starts, sizes)]
            self.order = torch.cat(spans)
            positions = torch.arange(len(self.order), device=device)
            self.inverse = torch.empty_like(self.order).scatter_(0, self.order, positions)

    def permute(self, rows):
        """Sorted rows (N, ...) in the buffers' order."""
        return rows if self.order is None else rows.index_select(0, self.order)

    def restore(self, rows):
        """Rows in the buffers' order back in the sorted order."""
        return rows if self.inverse is None else rows.index_select(0, self.inverse)

    def _blocked(self, rows):
        return rows[:self.block * self.experts].view(self.experts, self.block, rows.shape[-1])

    def products(self, rows, stack, out, bias=None, transposed=False, accumulate=False):
        """out = rows @ stack[e] (stack[e].T when `transposed`) + bias[e] for each row's expert e; added to
        `out` when `accumulate`. Returns out."""
        weights = stack.transpose(1, 2) if transposed else stack
        if self.block:
            block = self._blocked(out)
            if accumulate:
                torch.baddbmm(block, self._blocked(rows), weights, out=block)
            elif bias is not None:
                torch.baddbmm(bias.unsqueeze(1), self._blocked(rows), weights, out=block)
            else:
                torch.bmm(self._blocked(rows), weights, out=block)
        for e, a, b in self.segments:
            if accumulate:
                torch.addmm(out[a:b], rows[a:b], weights[e], out=out[a:b])
            elif bias is not None:
                torch.addmm(bias[e], rows[a:b], weights[e], out=out[a:b])
            else:
                torch.mm(rows[a:b], weights[e], out=out[a:b])
        return out

    def weight_grad(self, inputs, grad):
        """The gradient of a stack used as inputs @ stack[e]: inputs[rows of e].T @ grad[rows of e] per
        expert, (E, inputs' width, grad's width); zeros for an expert without rows."""
        shape = (self.experts, inputs.shape[-1], grad.shape[-1])
        if self.block:
            out = torch.bmm(self._blocked(inputs).transpose(1, 2), self._blocked(grad),
                            out=inputs.new_empty(shape))
            for e, a, b in self.segments:
                torch.addmm(out[e], inputs[a:b].t(), grad[a:b], out=out[e])
            return out
        out = inputs.new_empty(shape)
        for e, a, b in self.segments:
            torch.mm(inputs[a:b].t(), grad[a:b], out=out[e])
        self._zero_idle(out)
        return out

    def row_sums(self, grad):
        """Each expert's sum of its rows of `grad`, (E, grad's width): a bias's gradient."""
        if self.block:
            out = self._blocked(grad).sum(dim=1)
            for e, a, b in self.segments:
                out[e] += grad[a:b].sum(dim=0)
            return out
        out = grad.new_empty(self.experts, grad.shape[-1])
        for e, a, b in self.segments:
            torch.sum(grad[a:b], 0, out=out[e])
        self._zero_idle(out)
        return out

    def _zero_idle(self, out) -> None:
        busy = {e for e, _, _ in self.segments}
        for e in range(self.experts):
            if e not in busy:
                out[e].zero_()


class Experts(nn.Module):
    """A moe node: its router (D, E) and expert stacks in the IR's layout: GELU experts w_in (E, D, F),
    b_in (E, F), w_out (E, F, D), b_out (E, D); SwiGLU experts w_gate and w_in (E, D, F), w_out (E, F, D).

    Sorted dispatch: the (token, choice) assignments are sorted by expert (`expert_segments`), the tokens
    gathered in that order, each expert's products run on its contiguous segment, and the outputs, weighted
    by the gates, added back to their tokens (index_add_). Each expert sees only the tokens routed to it,
    so the work done is the work counted. Where `grouped_mm_fits` (CUDA, bf16) the segments are one
    torch._grouped_mm per product with the offsets on the device: no host synchronisation. Otherwise
    `segment_products` reads the segment sizes once per moe layer (one host read, not one per expert) and
    runs one product per non-empty segment, outside torch.compile's graph (its sizes are data).

    In training mode each forward leaves its `Routing` in `routing` (`balance`): what the load-balancing
    loss (TrainConfig.moe_aux_loss) and the expert load (EpochReport.expert_load) need, computed on the
    device from the routing the forward ran. The training step takes it (training.Stepper); an attribute,
    not an output, so that the forward's signature, and a compiled dense model, stay as they are."""

    def __init__(self, width: int, attrs):
        super().__init__()
        e, f = attrs["experts"], attrs["units"]
        self.top_k = attrs["top_k"]
        self.swiglu = moe_mlp(attrs) == "swiglu"
        self.router = nn.Parameter(torch.zeros(width, e))
        self.w_in, self.w_out = nn.Parameter(torch.zeros(e, width, f)), nn.Parameter(torch.zeros(e, f, width))
        if self.swiglu:
            self.w_gate = nn.Parameter(torch.zeros(e, width, f))
        else:
            self.b_in, self.b_out = nn.Parameter(torch.zeros(e, f)), nn.Parameter(torch.zeros(e, width))
        self.routing: Routing | None = None

    def expert(self, e: int, tokens):
        """Expert e's output for `tokens` (T, D)."""
        if self.swiglu:
            return (F.silu(tokens @ self.w_gate[e]) * (tokens @ self.w_in[e])) @ self.w_out[e]
        return F.gelu(tokens @ self.w_in[e] + self.b_in[e], approximate="tanh") @ self.w_out[e] + self.b_out[e]

    @torch.compiler.disable
    def segment_products(self, tokens, offsets, sizes: list[int] | None = None, dtype=None):
        """The experts' outputs for `tokens` sorted by expert, one product per non-empty segment, in `dtype`
        (default: the tokens'); `sizes`, the segments' sizes where the caller has read them already. One
        autograd node for the whole block (`SegmentProducts`). No token at all (a data-parallel rank's empty
        micro-batch, an expert-parallel rank that received none) is no product, and the experts' parameters
        still get their (zero) gradient."""
        if sizes is None:
            sizes = torch.diff(offsets, prepend=offsets.new_zeros(1)).tolist()  # the layer's one host read
        weights = ((self.w_gate, self.w_in, self.w_out) if self.swiglu else
                   (self.w_in, self.b_in, self.w_out, self.b_out))
        return SegmentProducts.apply(tokens, tuple(sizes), self.swiglu, dtype or tokens.dtype, *weights)

    def grouped_products(self, tokens, offsets, expert_of, dtype):
        """The experts' outputs for `tokens` sorted by expert, as torch._grouped_mm over the segments that
        `offsets` bounds, in `dtype`; `expert_of` is each row's expert (for the biases)."""
        tokens = tokens.to(dtype)
        up = torch._grouped_mm(tokens, self.w_in.to(dtype), offsets)
        if self.swiglu:
            hidden = F.silu(torch._grouped_mm(tokens, self.w_gate.to(dtype), offsets)) * up
            return torch._grouped_mm(hidden, self.w_out.to(dtype), offsets)
        hidden = F.gelu(up + self.b_in.to(dtype)[expert_of], approximate="tanh")
        return torch._grouped_mm(hidden, self.w_out.to(dtype), offsets) + self.b_out.to(dtype)[expert_of]

    def balance(self, x, logits, chosen) -> Routing:
        """The Routing of a forward of `x` (N, ..., D) whose router gave `logits` (T, E) and chose `chosen`
        (T, k). A sequence is what x holds per sample (S positions; S is 1 for a vector). Static shapes and
        no host read: the load is a scatter_add of the choices, not a bincount."""
        sequences, experts = x.shape[0], self.router.shape[1]
        positions = math.prod(x.shape[1:-1])
        per_sequence = chosen.reshape(sequences, positions * self.top_k)
        counts = torch.zeros(sequences, experts, dtype=torch.int64, device=x.device).scatter_add_(
            1, per_sequence, torch.ones_like(per_sequence))
        share = counts.float() / (positions * self.top_k)  # f: a count, so no gradient reaches it
        probability = logits.float().softmax(dim=-1).reshape(sequences, positions, experts).mean(dim=1)
        return Routing(experts * (share * probability).sum(), counts.sum(dim=0))

    def route(self, x, flat):
        """(chosen (T, k), gates (T, k)) of the tokens `flat` (T, D) of `x`; in training mode it leaves the
        forward's Routing in `routing`."""
        logits = flat @ self.router.to(flat.dtype)
        # A stable descending sort puts the lower expert index first among equals, as the IR does.
        chosen = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        gates = torch.gather(logits.float(), 1, chosen).softmax(dim=-1).to(flat.dtype)
        if self.training:
            self.routing = self.balance(x, logits, chosen)
        return chosen, gates

    def products(self, tokens, offsets, expert_of, device, sizes: list[int] | None = None):
        """This module's experts' outputs for `tokens` sorted by expert into the segments that `offsets`
        bounds (`expert_of`: each row's expert): torch._grouped_mm where it fits, else segment_products."""
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else tokens.dtype
        if grouped_mm_fits(device, dtype, tokens.shape[-1], self.w_in.shape[-1]):
            return self.grouped_products(tokens, offsets, expert_of, dtype)
        return self.segment_products(tokens, offsets, sizes, dtype)

    @staticmethod
    def combine(flat, outputs, gates, order, token_of):
        """The moe's output (T, D): each assignment's output, in `order`, weighted by its gate and added to
        its token."""
        weighted = outputs * gates.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros(flat.shape, dtype=weighted.dtype, device=flat.device).index_add_(0, token_of, weighted)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        chosen, gates = self.route(x, flat)
        order, offsets = expert_segments(chosen, self.router.shape[1])
        token_of = order // self.top_k
        tokens = flat.index_select(0, token_of)
        outputs = self.products(tokens, offsets, chosen.reshape(-1)[order], x.device)
        return self.combine(flat, outputs, gates, order, token_of).reshape(x.shape)


class Rotary(nn.Module):
    """A rotary node's cos and sin of theta = p * base^(-2i / head_dim), (S, 1, head_dim / 2), computed once
    in float64 and kept as float32 buffers (not persistent: they are the attributes' function, not
    weights), so that a step reads them instead of computing them."""

    def __init__(self, seq_len: int, attrs):
        super().__init__()
        half = attrs["head_dim"] // 2
        inverse_frequency = float(attrs["base"]) ** (-2.0 * np.arange(half) / attrs["head_dim"])
        theta = np.arange(seq_len, dtype=np.float64)[:, None] * inverse_frequency[None, :]
        for name, table in (("cos", np.cos(theta)), ("sin", np.sin(theta))):
            self.register_buffer(name, torch.from_numpy(table[:, None, :].astype(np.float32)), persistent=False)


class RealTaps(nn.Module):
    """The number of real (not padded) taps of each window of an avg_pool whose padding torch's own
    pooling cannot hold, (1, 1, Ho, Wo): the divisor when padding is not counted."""

    def __init__(self, height: int, width: int, attrs):
        super().__init__()
        pt, pb, pl, pr = attrs["padding"]
        ones = F.pad(torch.ones(1, 1, height, width), (pl, pr, pt, pb))
        taps = F.avg_pool2d(ones, tuple(attrs["kernel"]), tuple(attrs["strides"]), 0, divisor_override=1)
        self.register_buffer("taps", taps, persistent=False)


def _split_padding(padding) -> tuple[tuple[int, int] | None, tuple[int, int, int, int] | None]:
    """(symmetric padding for the op, or None) and (F.pad argument, or None)."""
    pt, pb, pl, pr = padding
    if pt == pb and pl == pr:
        return (pt, pl), None
    return None, (pl, pr, pt, pb)  # F.pad order: last dim first


def conv_geometry(graph: Graph, node) -> conv_probe.ConvGeometry:
    """The conv as the model runs it (asymmetric padding is an F.pad before a conv with padding 0)."""
    a = node.attrs
    sym, _ = _split_padding(a["padding"])
    return conv_probe.ConvGeometry(graph.shapes[node.inputs[0]][-1], a["filters"], tuple(a["kernel"]),
                                   tuple(a["strides"]), sym if sym is not None else (0, 0), a.get("groups", 1))


def _torch_pads_pool(kernel, padding) -> tuple[int, int] | None:
    """The padding to give torch's own pooling, or None where it cannot hold the IR's: asymmetric, or
    more than half the window (torch's limit)."""
    sym, _ = _split_padding(padding)
    if sym is not None and 2 * sym[0] <= kernel[0] and 2 * sym[1] <= kernel[1]:
        return sym
    return None


class LoweredModel(nn.Module):
    """An IR graph as a torch module.

    ``forward(x)`` takes an NHWC batch (or (N, C) for a flat input, (N, S, D) for a sequence, int64
    token ids (N, S) for a token input) and returns the graph's output in the IR's layout. The batch is float32, normalised, or (an RGB image input) uint8 pixels,
    which the forward normalises first on the model's device (loss.normalise_pixels). ``forward(x, logits=True)`` returns the softmax's input instead when the
    output node is a softmax, so that the loss can use a stable log-softmax.
    """

    def __init__(self, graph: Graph, precision: str = "fp32"):
        super().__init__()
        self.graph = graph
        self.precision = precision
        self.layers = nn.ModuleDict()
        self.module_names: dict[str, str] = {}  # node id -> key in self.layers (a Python identifier)
        used: set[str] = set()
        for node in graph.nodes:
            module = _make_module(graph, node)
            if module is None:
                continue
            base = "n_" + re.sub(r"\W", "_", node.id)
            key = next(k for k in itertools.chain([base], (f"{base}_{i}" for i in itertools.count(1)))
                       if k not in used)
            used.add(key)
            self.layers[key] = module
            self.module_names[node.id] = key
        out_node = graph[graph.output_id]
        self._logits_id = out_node.inputs[0] if out_node.op == "softmax" else None
        self.takes_pixels = tuple(graph.input_shape[-1:]) == (3,) and len(graph.input_shape) == 3
        if self.takes_pixels:  # uint8 RGB pixels are normalised here, on the model's device
            from aiperf_core.data.preprocess import INV_STD, MEAN

            self.register_buffer("input_mean", torch.from_numpy(MEAN.copy()), persistent=False)
            self.register_buffer("input_inv_std", torch.from_numpy(INV_STD.copy()), persistent=False)
        self.conv_forms: dict[str, str] = {}
        # Activation checkpointing of the graph's blocks (run_block); the training step sets it from
        # TrainConfig.checkpoint_blocks for its own duration.
        self.checkpoint_blocks = False
        # Expert parallelism (expert_parallel.shard_experts) sets the rank's ExpertParallel here.
        self.expert_parallel = None
        self._generate(torch.device("cpu"), probe=False)

    @property
    def dropouts(self) -> list:
        return [m for m in self.layers.values() if isinstance(m, Dropout)]

    @property
    def experts(self) -> dict[str, Experts]:
        """The moe nodes' modules by node id, in graph order."""
        return {node_id: self.layers[key] for node_id, key in self.module_names.items()
                if isinstance(self.layers[key], Experts)}

    @property
    def has_logits(self) -> bool:
        return self._logits_id is not None

    @property
    def positions(self) -> int:
        """Labels per sample: 1 for a class per image, S for a class per position of a sequence."""
        return math.prod(self.graph.output_shape[:-1])

    def training_loss(self, x, labels, label_smoothing: float):
        """loss.summed_loss of a batch, through a function generated for this model alone (what
        the compiled step compiles: dynamo caches compiled code per code object)."""
        return self._training_loss(self, x, labels, label_smoothing)

    def forward(self, x, logits: bool = False):
        # The generated functions are stored unbound: a bound method would be a reference cycle
        # that keeps a trial's model (and its device memory) alive until the cyclic GC runs.
        if logits and self._forward_logits is not None:
            return self._forward_logits(self, x)
        return self._forward_output(self, x)

    # -- the generated forward ------------------------------------------------------------------
    def _generate(self, device: torch.device, probe: bool = True) -> None:
        """(Re)generate the forward for `device`: on a CPU, conv forms by conv_probe."""
        convs = [n for n in self.graph.nodes if n.op == "conv2d"]
        if probe and device.type == "cpu" and convs:
            forms = conv_probe.conv_forms([conv_geometry(self.graph, n) for n in convs],
                                          compute_dtype(self.precision), conv2d)
            self.conv_forms = {n.id: forms[conv_geometry(self.graph, n)] for n in convs}
        else:
            self.conv_forms = {n.id: conv_probe.CHANNELS_LAST for n in convs}
        self.source = generate_source(self.graph, self.module_names, self.conv_forms,
                                      mixed=self.precision in AUTOCAST_DTYPES)
        namespace = _namespace()
        filename = f"<aiperf lowered {self.graph.name} {id(self):x}>"
        code = compile(self.source, filename, "exec")
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        exec(code, namespace)
        self._forward_output = namespace["forward_output"]
        self._forward_logits = namespace["forward_logits"] if self.has_logits else None
        self._training_loss = namespace["training_loss"]

    def dropout_masks(self, source):
        """Context manager: draw dropout masks from `source` (see Dropout) inside the block."""
        from contextlib import contextmanager

        @contextmanager
        def scope():
            modules = [m for m in self.modules() if isinstance(m, Dropout)]
            saved = [m.source for m in modules]
            for m in modules:
                m.source = source
            try:
                yield
            finally:
                for m, old in zip(modules, saved):
                    m.source = old

        return scope()

    # -- weights ------------------------------------------------------------
    def load_canonical(self, weights: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        validate_weights(self.graph, weights)
        with torch.no_grad():
            for node_id, params in weights.items():
                module = self.layers[self.module_names[node_id]]
                for pname, array in params.items():
                    target, value = _torch_param(module, pname, np.asarray(array, dtype=np.float32))
                    target.copy_(torch.from_numpy(value))

    def export_canonical(self, trainable_only: bool = False) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            module = self.layers[self.module_names[node_id]]
            out[node_id] = {}
            for pname in shapes:
                if trainable_only and not is_trainable(pname):
                    continue
                tensor, _ = _torch_param(module, pname, None)
                out[node_id][pname] = to_canonical(module, pname, tensor.detach())
        return out

    def canonical_grads(self) -> Weights:
        out: Weights = {}
        for node_id, shapes in self.graph.all_param_shapes().items():
            module = self.layers[self.module_names[node_id]]
            out[node_id] = {}
            for pname in shapes:
                if not is_trainable(pname):
                    continue
                tensor, _ = _torch_param(module, pname, None)
                grad = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                out[node_id][pname] = to_canonical(module, pname, grad)
        return out


def _make_module(graph: Graph, node):
    a = node.attrs
    in_shape = graph.shapes[node.inputs[0]] if node.inputs else None
    if node.op == "conv2d":
        kh, kw = a["kernel"]
        return nn.Conv2d(in_shape[-1], a["filters"], (kh, kw), stride=tuple(a["strides"]), bias=a["use_bias"],
                         groups=a.get("groups", 1))
    if node.op == "batch_norm":
        cls = BatchNorm2d if len(in_shape) == 3 else BatchNorm1d
        return cls(in_shape[-1], eps=a["epsilon"], momentum=1.0 - a["momentum"])
    if node.op == "dense":
        return nn.Linear(in_shape[-1], a["units"], bias=a["use_bias"])
    if node.op == "dropout":
        return Dropout(a["rate"])
    if node.op in ("mul_const", "add_const"):
        return Constant(graph.param_shapes(node.id)["value"][0])
    if node.op == "embedding":
        return nn.Embedding(a["vocab"], a["units"])
    if node.op == "position_embedding":
        return PositionTable(*in_shape)
    if node.op == "layer_norm":
        return nn.LayerNorm(in_shape[-1], eps=a["epsilon"])
    if node.op == "rms_norm":
        return nn.RMSNorm(in_shape[-1], eps=a["epsilon"])
    if node.op == "rotary":
        return Rotary(in_shape[0], a)
    if node.op == "moe":
        return Experts(in_shape[-1], a)
    if node.op == "avg_pool" and not a["count_padding"] and _torch_pads_pool(a["kernel"], a["padding"]) is None:
        return RealTaps(in_shape[0], in_shape[1], a)
    return None


def _namespace() -> dict[str, Any]:
    """The globals of the generated code (read when it is generated: a planted kernel must be in
    place before lowering)."""
    return {"torch": torch, "F": F, "inf": math.inf, "conv2d": conv2d, "add_mixed": add_mixed,
            "concat_mixed": concat_mixed, "attention": attention, "rotary": rotary,
            "channel_shuffle": channel_shuffle, "normalise_pixels": normalise_pixels, "summed_loss": summed_loss,
            "run_block": run_block}


def generate_source(graph: Graph, module_names: Mapping[str, str], conv_forms: Mapping[str, str],
                    mixed: bool) -> str:
    """Python source of `forward_output(self, x)` (and `forward_logits(self, x)` when the output is
    a softmax): straight-line code, one statement per node, except that each of the graph's blocks
    (Graph.blocks, `checkpointed_blocks`) is a function `block_k(self, x)` of its own, which the
    forward calls through `run_block` (activation checkpointing when the model's
    `checkpoint_blocks` is set); and of `training_loss`."""
    out_node = graph[graph.output_id]
    blocks = checkpointed_blocks(graph)
    parts = [_block_source(f"block_{k}", graph, block, module_names, conv_forms, mixed)
             for k, block in enumerate(blocks)]
    parts.append(_function_source("forward_output", graph, graph.output_id, module_names, conv_forms, mixed, blocks))
    if out_node.op == "softmax":
        parts.append(_function_source("forward_logits", graph, out_node.inputs[0], module_names, conv_forms, mixed,
                                      blocks))
    parts.append("def training_loss(self, x, labels, label_smoothing):\n"
                 "    return summed_loss(self, x, labels, label_smoothing)")
    return "\n\n".join(parts) + "\n"


def checkpointed_blocks(graph: Graph) -> list:
    """The graph's blocks (Graph.blocks) that the forward runs as functions of their input: those
    whose inner nodes (all but the output) nothing after the block reads, and that hold neither the
    graph's output nor the softmax's input unless as their own output."""
    order = {n.id: k for k, n in enumerate(graph.nodes)}
    ends = {graph.output_id}
    if graph[graph.output_id].op == "softmax":
        ends.add(graph[graph.output_id].inputs[0])
    usable = []
    for block in graph.blocks():
        inner = set(block.nodes[:-1])
        last = order[block.output]
        if inner & ends:
            continue
        if any(src in inner for n in graph.nodes[last + 1:] for src in n.inputs):
            continue
        usable.append(block)
    return usable


def _block_source(name: str, graph: Graph, block, module_names: Mapping[str, str], conv_forms: Mapping[str, str],
                  mixed: bool) -> str:
    nodes = [graph[n] for n in block.nodes]
    var = {block.input: "v_in", **{n.id: f"v{i}" for i, n in enumerate(nodes)}}
    # The block's input is what checkpointing keeps for the backward pass: never overwritten.
    lines = [f"def {name}(self, v_in):", "    L = self.layers"]
    lines += _statements(graph, nodes, var, module_names, conv_forms, mixed, stop=block.output,
                         frozen={block.input})
    lines.append(f"    return {var[block.output]}")
    return "\n".join(lines)


def _function_source(name: str, graph: Graph, stop: str, module_names: Mapping[str, str],
                     conv_forms: Mapping[str, str], mixed: bool, blocks=()) -> str:
    nodes = graph.nodes[:[n.id for n in graph.nodes].index(stop) + 1]
    present = {n.id for n in nodes}
    # A block runs as one call where all of it is in this function (forward_logits stops earlier).
    calls = {b.nodes[0]: (k, b) for k, b in enumerate(blocks) if all(n in present for n in b.nodes)}
    inside = {n for _, b in calls.values() for n in b.nodes}
    items = []
    for node in nodes:
        if node.id in calls:
            items.append(calls[node.id])
        elif node.id not in inside:
            items.append(node)
    var = {n.id: f"v{i}" for i, n in enumerate(nodes)}
    lines = [f"def {name}(self, x):", "    L = self.layers"]
    if tuple(graph.input_shape[-1:]) == (3,) and len(graph.input_shape) == 3:
        lines += ["    if x.dtype == torch.uint8:", "        x = normalise_pixels(x, self.input_mean, self.input_inv_std)"]
    lines += _statements(graph, items, var, module_names, conv_forms, mixed, stop=stop, frozen=set())
    out = var[stop]
    shape = graph.shapes[stop]
    lines.append(f"    return {out}.permute(0, 2, 3, 1)" if len(shape) == 3 else f"    return {out}")
    return "\n".join(lines)


def _statements(graph: Graph, items, var: Mapping[str, str], module_names: Mapping[str, str],
                conv_forms: Mapping[str, str], mixed: bool, stop: str, frozen: set) -> list[str]:
    """One statement per item (a node, or (k, block): a call of block_k), each value deleted after
    its last reader among the items; relu and add in place where that is safe and the value is not
    in `frozen`."""

    def reads(item):
        return (item[1].input,) if isinstance(item, tuple) else item.inputs

    readers: dict[str, int] = {n.id: 0 for n in graph.nodes}
    for node in graph.nodes:  # readers over the whole graph: in-place must stay safe
        for src in node.inputs:
            readers[src] += 1
    last_reader: dict[str, int] = {}
    for i, item in enumerate(items):
        for src in reads(item):
            last_reader[src] = i
    fused = fused_projections(graph, [item for item in items if not isinstance(item, tuple)])
    emitted: set[tuple[str, ...]] = set()
    lines = []
    for i, item in enumerate(items):
        if isinstance(item, tuple):
            k, block = item
            lines.append(f"    {var[block.output]} = run_block(self, block_{k}, {var[block.input]})"
                         f"  # block {block.nodes[0]} .. {block.output}")
            dead = [var[block.input]] if last_reader[block.input] == i else []
            if dead:
                lines.append(f"    del {', '.join(dead)}")
            continue
        node = item
        if node.id in fused:
            group = fused[node.id]
            if group not in emitted:  # at the group's first member: a rotary may follow any of them
                emitted.add(group)
                lines.append(f"    {', '.join(var[g] for g in group)} = "
                             f"{_fused_linear(graph, group, var, module_names)}  # dense {', '.join(group)}")
            dead = [var[s] for s in dict.fromkeys(node.inputs) if last_reader[s] == i]
            if dead:
                lines.append(f"    del {', '.join(dead)}")
            continue
        args = [var[s] for s in node.inputs]
        inplace = -1
        if node.op in ("relu", "add"):
            for k, src in enumerate(node.inputs):
                if (readers[src] == 1 and graph[src].op in _INPLACE_SAFE_PRODUCERS and src != graph.output_id
                        and src not in frozen):
                    inplace = k
                    break
        layer = f"L.{module_names[node.id]}" if node.id in module_names else None
        lines.append(f"    {var[node.id]} = {_expression(graph, node, args, layer, inplace, conv_forms, mixed)}"
                     f"  # {node.op} {node.id}")
        dead = [var[s] for s in dict.fromkeys(node.inputs) if last_reader[s] == i]
        if dead and node.id != stop:
            lines.append(f"    del {', '.join(dead)}")
    return lines


# Ops that may sit between a fused projection and the node that reads the group (fused_projections):
# rotary on a query or key, silu on a SwiGLU gate.
_AFTER_PROJECTION = frozenset({"rotary", "silu"})


def fused_projections(graph: Graph, nodes) -> dict[str, tuple[str, ...]]:
    """{dense node id: its group} for the projections one node reads, an attention's query, key and value
    or a mul's two operands (a SwiGLU's gate and up), each directly or through a rotary or silu of its
    own: when they are distinct, read one tensor, have the same bias setting and feed nothing else, the
    generated forward runs them as one product with the kernels side by side (one GEMM of the summed width,
    as a hand-written GPT's fused QKV or Llama's fused gate-up does), then splits it at their own widths
    (grouped-query attention's key and value are narrower than its query). Their parameters stay
    nn.Linear modules, one per node, so weights, gradients and state dicts are the IR's per node."""
    present = {n.id for n in nodes}

    def sole_reader(node_id: str) -> bool:
        return node_id in present and node_id != graph.output_id and len(graph.consumers(node_id)) == 1

    def projection(node_id: str) -> str | None:
        while graph[node_id].op in _AFTER_PROJECTION:
            if not sole_reader(node_id):
                return None
            node_id = graph[node_id].inputs[0]
        return node_id if graph[node_id].op == "dense" and sole_reader(node_id) else None

    out: dict[str, tuple[str, ...]] = {}
    for node in nodes:
        if node.op not in ("attention", "mul"):
            continue
        group = tuple(projection(src) for src in node.inputs)
        if None in group or len(set(group)) != len(group):
            continue
        sources = [graph[g] for g in group]
        if len({n.inputs[0] for n in sources}) == 1 and len({n.attrs["use_bias"] for n in sources}) == 1:
            for g in group:
                out[g] = group
    return out


def _fused_linear(graph: Graph, group, var, module_names) -> str:
    layers = [f"L.{module_names[g]}" for g in group]
    source = var[graph[group[0]].inputs[0]]
    weight = f"torch.cat([{', '.join(f'{m}.weight' for m in layers)}])"
    bias = f"torch.cat([{', '.join(f'{m}.bias' for m in layers)}])" if graph[group[0]].attrs["use_bias"] else "None"
    widths = [graph.shapes[g][-1] for g in group]
    return f"F.linear({source}, {weight}, {bias}).split({widths}, dim=-1)"


def _expression(graph: Graph, node, args: list[str], layer: str | None, inplace: int,
                conv_forms: Mapping[str, str], mixed: bool) -> str:
    a, op = node.attrs, node.op
    if op == "input":
        return "x.permute(0, 3, 1, 2)" if len(a["shape"]) == 3 else "x"
    if op == "token_input":
        return "x"
    if op == "conv2d":
        sym, pad = _split_padding(a["padding"])
        src = args[0] if pad is None else f"F.pad({args[0]}, {pad})"
        bias = f"{layer}.bias" if a["use_bias"] else "None"
        stride, padding = tuple(a["strides"]), sym if sym is not None else (0, 0)
        # groups only where there are several: a conv function planted by a test may not take it
        groups = f", 1, {a['groups']}" if a.get("groups", 1) > 1 else ""
        form = conv_forms[node.id]
        if form == conv_probe.SUBSAMPLED:
            return f"conv2d({src}[:, :, ::{stride[0]}, ::{stride[1]}], {layer}.weight, {bias}, 1, 0{groups})"
        if form == conv_probe.CONTIGUOUS:
            return (f"conv2d({src}.contiguous(), {layer}.weight.contiguous(), {bias}, {stride}, {padding}{groups})"
                    f".contiguous(memory_format=torch.channels_last)")
        return f"conv2d({src}, {layer}.weight, {bias}, {stride}, {padding}{groups})"
    if op == "batch_norm" and len(graph.shapes[node.inputs[0]]) == 2:  # (N, S, D): torch's channels are axis 1
        return f"{layer}({args[0]}.transpose(1, 2)).transpose(1, 2)"
    if op in ("batch_norm", "dropout"):
        return f"{layer}({args[0]})"
    if op == "dense":
        bias = f"{layer}.bias" if a["use_bias"] else "None"
        return f"F.linear({args[0]}, {layer}.weight, {bias})"
    if op == "relu":
        return f"torch.relu_({args[0]})" if inplace >= 0 else f"torch.relu({args[0]})"
    if op == "add":
        if mixed:
            return f"add_mixed({', '.join(args)}, inplace={inplace})"
        if inplace >= 0:
            first, rest = args[inplace], args[:inplace] + args[inplace + 1:]
            return first + "".join(f".add_({r})" for r in rest)
        return " + ".join(args)
    if op == "concat":
        return f"concat_mixed({', '.join(args)})" if mixed else f"torch.cat([{', '.join(args)}], 1)"
    if op == "max_pool":
        kernel = tuple(a["kernel"])
        own = _torch_pads_pool(kernel, a["padding"])  # torch's own padding is implicitly -inf
        if own is not None:
            return f"F.max_pool2d({args[0]}, {kernel}, {tuple(a['strides'])}, {own})"
        pt, pb, pl, pr = a["padding"]
        return f"F.max_pool2d(F.pad({args[0]}, {(pl, pr, pt, pb)}, value=-inf), {kernel}, {tuple(a['strides'])}, 0)"
    if op == "global_avg_pool":
        return f"{args[0]}.mean(dim=(2, 3))"
    if op == "flatten":
        if len(graph.shapes[node.inputs[0]]) == 3:  # NCHW -> NHWC order: dense kernels keep the canonical rows
            return f"{args[0]}.permute(0, 2, 3, 1).reshape({args[0]}.shape[0], -1)"
        return f"{args[0]}.reshape({args[0]}.shape[0], -1)"
    if op == "softmax":
        return f"torch.softmax({args[0]}.float(), dim=-1)"
    if op == "lrn":
        return f"F.local_response_norm({args[0]}, {a['size']}, {a['alpha']!r}, {a['beta']!r}, {a['bias']!r})"
    if op == "avg_pool":
        kernel, strides = tuple(a["kernel"]), tuple(a["strides"])
        own = _torch_pads_pool(kernel, a["padding"])
        if own is not None:
            return f"F.avg_pool2d({args[0]}, {kernel}, {strides}, {own}, count_include_pad={a['count_padding']})"
        pt, pb, pl, pr = a["padding"]
        sums = f"F.avg_pool2d(F.pad({args[0]}, {(pl, pr, pt, pb)}), {kernel}, {strides}, 0, divisor_override=1)"
        return f"{sums} / {kernel[0] * kernel[1]}" if a["count_padding"] else f"{sums} / {layer}.taps"
    if op in ("mul_const", "add_const"):
        value = f"{layer}.value"
        if len(graph.shapes[node.inputs[0]]) == 3 and a["per_channel"]:  # NCHW: channels on axis 1
            value += ".view(-1, 1, 1)"
        return f"{args[0]} {'*' if op == 'mul_const' else '+'} {value}"
    if op == "channel_shuffle":
        return f"channel_shuffle({args[0]}, {a['groups']})"
    if op == "embedding":
        return f"F.embedding({args[0]}, {layer}.weight)"
    if op == "position_embedding":
        return f"{args[0]} + {layer}.table"
    if op in ("layer_norm", "rms_norm"):  # in fp32 under mixed precision: the fused kernels want one dtype
        image = len(graph.shapes[node.id]) == 3  # over the channels: the last axis of the NHWC view
        src = f"{args[0]}.permute(0, 2, 3, 1)" if image else args[0]
        src = f"{src}.float()" if mixed else src
        affine = f"{layer}.weight, {layer}.bias" if op == "layer_norm" else f"{layer}.weight"
        y = f"F.{op}({src}, {tuple(graph.shapes[node.id][-1:])}, {affine}, {a['epsilon']!r})"
        return f"{y}.permute(0, 3, 1, 2)" if image else y
    if op == "attention":
        return f"attention({', '.join(args)}, {a['heads']}, {a['causal']}, {kv_heads(a)})"
    if op == "gelu":
        return f"F.gelu({args[0]}, approximate='tanh')"
    if op == "rotary":
        return f"rotary({args[0]}, {layer}.cos, {layer}.sin)"
    if op == "silu":
        return f"F.silu({args[0]})"
    if op == "mul":
        return f"{args[0]} * {args[1]}"
    if op == "moe":
        return f"{layer}({args[0]})"
    raise GraphError(f"the torch backend cannot lower op '{op}'", node.id)


def _torch_param(module: nn.Module, pname: str, canonical: np.ndarray | None):
    """The torch tensor that holds canonical parameter `pname`, and `canonical` in torch layout."""
    if isinstance(module, nn.Conv2d):
        if pname == "kernel":  # HWIO -> OIHW
            return module.weight, (None if canonical is None else np.ascontiguousarray(canonical.transpose(3, 2, 0, 1)))
        if pname == "bias":
            return module.bias, canonical
    elif isinstance(module, nn.Linear):
        if pname == "kernel":  # (in, out) -> (out, in)
            return module.weight, (None if canonical is None else transposed_copy(canonical))
        if pname == "bias":
            return module.bias, canonical
    elif isinstance(module, nn.modules.batchnorm._BatchNorm):
        attr = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}[pname]
        return getattr(module, attr), canonical
    elif isinstance(module, nn.LayerNorm) and pname in ("gamma", "beta"):
        return (module.weight if pname == "gamma" else module.bias), canonical
    elif isinstance(module, nn.Embedding) and pname == "table":  # (vocab, units) in both
        return module.weight, canonical
    elif isinstance(module, PositionTable) and pname == "table":
        return module.table, canonical
    elif isinstance(module, Constant) and pname == "value":
        return module.value, canonical
    elif isinstance(module, Experts) and isinstance(getattr(module, pname, None), nn.Parameter):
        return getattr(module, pname), canonical
    elif isinstance(module, nn.RMSNorm) and pname == "gamma":
        return module.weight, canonical
    raise GraphError(f"no parameter '{pname}' in a lowered {type(module).__name__}")


def to_canonical(module: nn.Module, pname: str, tensor) -> np.ndarray:
    array = tensor.detach().to("cpu", torch.float32).numpy()
    if pname == "kernel" and not isinstance(module, nn.Conv2d):  # (out, in) -> (in, out)
        return transposed_copy(array)
    if pname == "kernel":  # OIHW -> HWIO
        array = array.transpose(2, 3, 1, 0)
    return np.ascontiguousarray(array, dtype=np.float32)


def torch_device(name: str | torch.device) -> torch.device:
    """The torch device of a backend device name: 'cpu:N' (AIPERF_CPU_DEVICES) is the CPU."""
    device = torch.device(name)
    return torch.device("cpu") if device.type == "cpu" else device


def place(model: LoweredModel, device: str | torch.device) -> LoweredModel:
    """Move `model` to `device` (channels_last kernels) and generate its forward for that device."""
    device = torch_device(device)
    model.to(device)
    model.to(memory_format=torch.channels_last)
    model._generate(device)
    return model


def lower_graph(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str,
                device: str | torch.device = "cpu") -> LoweredModel:
    model = LoweredModel(graph, precision)
    model.load_canonical(weights)
    return place(model, device)


def generated_source(model: LoweredModel) -> str:
    """The forward generated for `model` (for reading and debugging)."""
    return model.source
