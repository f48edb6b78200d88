"""Native op counter: torch.utils.flop_counter.FlopCounterMode, mapped to opcount's categories.

FlopCounterMode counts 2 FLOPs per multiply-accumulate of the matrix products and convolutions it
knows, over every output position times the full kernel window, so padded taps count (the paper's
convention). It does not count bias additions, normalisation, activations, pooling or softmax, so
only 'conv', 'dense', 'attention' and 'moe' are covered:

* conv:  aten.convolution (and its variants) forward, aten.convolution_backward backward (the input
  gradient only where one is needed, the weight gradient always). torch 2.13's backward rule counts a
  grouped convolution's weight gradient as if it were not grouped (each of its MACs `groups` times:
  its formula reads the input's C, not C / groups), so the rule here counts each gradient as its
  forward: 2 FLOPs per (position the kernel slides over, kernel weight) pair;
* dense: aten.mm / addmm (a dense layer's forward is an addmm, over N*S rows of a sequence; its
  backward two mm);
* attention: the fused scaled-dot-product-attention kernels, forward and backward, and bmm /
  baddbmm, which in a lowered model only attention's products run (where torch falls back to its
  unfused attention). FlopCounterMode counts the full S x S scores of both products, causal or not
  (the paper convention). Two of its rules are changed here:
  - torch 2.13 has no rule for the CPU flash kernel (aten._scaled_dot_product_flash_attention_for_cpu
    and its backward), so it counted nothing; they get torch's rules for the CUDA kernels;
  - torch's backward rule adds the recomputation of the scores (Q K^T again) that the fused
    kernels do instead of keeping the probabilities; the model's backward is the four input
    gradients of the two products (as the analytic count, Megatron-LM's and PaLM's MFU), so the
    backward rules here are torch's less that recomputation.
* moe: the products that a moe node's module (lowering.Experts) runs, the router's and each expert's on
  its routed tokens, forward and backward, booked by module (FlopCounterMode's per-module counts), not
  as dense. torch 2.13 has no rule for torch._grouped_mm (the experts' products on CUDA in bf16); the
  rule here counts 2 FLOPs per MAC of each group's product.

Forward-only counts run in eval mode under no_grad. Forward+backward counts run a training-mode
forward and the backward of the loss, with an input that does not require grad (token ids never
do), so the first conv or dense computes no input gradient, as the analytic rule says. Batch-norm
statistics and the parameters' .grad are restored afterwards: counting never changes the model. The
weight update is not counted.
"""

from __future__ import annotations

import math

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense", "attention", "moe"),
    includes_update=False,
    notes=("torch.utils.flop_counter.FlopCounterMode: 2 FLOPs per MAC of convolutions and matrix products, "
           "padded taps and the causal mask's S x S scores included (attention's backward without the fused "
           "kernels' recomputation of the scores; a grouped convolution's weight gradient once, not groups "
           "times); a moe node's router and routed experts' products under "
           "'moe'; bias, normalisation, activation, pooling and softmax are not counted; the backward count "
           "has no weight update"),
)

_DENSE_OPS = ("mm", "addmm", "matmul", "_scaled_mm", "_grouped_mm")
_ATTENTION_OPS = ("bmm", "baddbmm")


def category_of(op) -> str:
    """opcount category of an aten op (an OpOverloadPacket or its name)."""
    name = getattr(op, "__name__", str(op)).split(".")[-1]
    if "convolution" in name or name == "_slow_conv2d_forward":
        return "conv"
    if name in _DENSE_OPS:
        return "dense"
    if name in _ATTENTION_OPS or "attention" in name:
        return "attention"
    return "other"


def attention_rules() -> dict:
    """FlopCounterMode's custom_mapping: the CPU flash kernel counted, and every fused backward
    without the recomputed scores (module docstring). Rules take the shapes of the op's arguments."""
    import torch
    from torch.utils.flop_counter import bmm_flop, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        b, heads, s_q, d = query
        recomputed_scores = bmm_flop((b * heads, s_q, d), (b * heads, d, key[2]))
        return sdpa_backward_flop_count(grad_out, query, key, value) - recomputed_scores

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
            aten._scaled_dot_product_flash_attention_backward: backward,
            aten._scaled_dot_product_efficient_attention_backward: backward,
            aten._scaled_dot_product_cudnn_attention_backward: backward}


def grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm's FLOPs from its operands' shapes: 2 per MAC, each output element a product over
    the operands' shared axis, except that a 2D x 2D product (a weight gradient) splits that axis among
    its groups, so its (groups, M, N) output sums M x N products over the whole axis once."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


def convolution_backward_flops(grad_out, x, weight, bias, stride, padding, dilation, transposed, output_padding,
                               groups, output_mask, out_shape=None, **kwargs) -> int:
    """aten.convolution_backward's FLOPs from its operands' shapes: each gradient asked for
    (output_mask: input, weight) is a convolution of its forward's size, 2 per MAC of every kernel
    weight (the weight's shape is already per group: (C_out, C_in / groups, kh, kw)) at every position
    it slides over (the output's, or a transposed convolution's input's), for each sample."""
    positions = math.prod((x if transposed else grad_out)[2:])
    forward = 2 * x[0] * positions * math.prod(weight)
    return forward * (bool(output_mask[0]) + bool(output_mask[1]))


def flop_rules() -> dict:
    """FlopCounterMode's custom_mapping: attention_rules, torch._grouped_mm's rule and the convolution's
    backward rule."""
    import torch

    aten = torch.ops.aten
    return {**attention_rules(), aten._grouped_mm: grouped_mm_flops,
            aten.convolution_backward: convolution_backward_flops}


class TorchFlopCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from aiperf_backends.torch.loss import summed_loss
        from aiperf_backends.torch.training import device_of, preserved

        graph = model.graph
        device = device_of(model)
        rng = np.random.default_rng(0)
        shape = (batch,) + tuple(graph.input_shape)
        x = rng.integers(0, graph.vocab, shape) if graph.takes_tokens else rng.standard_normal(shape).astype(np.float32)
        x = torch.from_numpy(x).to(device)
        was_training = model.training
        counter = FlopCounterMode(display=False, custom_mapping=flop_rules())
        try:
            if backward:
                if len(graph.output_shape) not in (1, 2):
                    raise ValueError("a backward count needs a class output per sample or per position")
                labels = rng.integers(0, graph.output_shape[-1], (batch,) + tuple(graph.output_shape[:-1]))
                labels = torch.from_numpy(labels).to(device)
                with preserved(model):
                    model.train()
                    with counter:
                        loss = summed_loss(model, x, labels, 0.0) / batch
                        loss.backward()
            else:
                model.eval()
                with torch.no_grad(), counter:
                    model(x)
        finally:
            model.train(was_training)
        out = {"conv": 0, "dense": 0, "attention": 0, "moe": 0, "other": 0}
        counts = counter.get_flop_counts()
        for op, flops in counts.get("Global", {}).items():
            out[category_of(op)] += int(flops)
        # A moe node's products are its own category, as opcount's, not dense: moved by module.
        from aiperf_backends.torch.lowering import Experts

        experts = {name for name, module in model.named_modules() if isinstance(module, Experts)}
        for scope, ops in counts.items():
            if scope.split(".", 1)[-1] in experts or any(scope.endswith("." + name) for name in experts):
                for op, flops in ops.items():
                    out[category_of(op)] -= int(flops)
                    out["moe"] += int(flops)
        return out
