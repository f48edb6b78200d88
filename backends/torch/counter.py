"""Native op counter: torch.utils.flop_counter.FlopCounterMode, mapped to opcount's categories.

FlopCounterMode counts 2 FLOPs per multiply-accumulate of the matrix products and convolutions it
knows, over every output position times the full kernel window, so padded taps count (the paper's
convention). It does not count bias additions, normalisation, activations, pooling or softmax, so
only 'conv' and 'dense' are covered:

* conv:  aten.convolution (and its variants) forward, aten.convolution_backward backward (the input
  gradient only where one is needed, the weight gradient always);
* dense: aten.mm / addmm / bmm / baddbmm (a dense layer's forward is an addmm, its backward two mm).

Forward-only counts run in eval mode under no_grad. Forward+backward counts run a training-mode
forward and the backward of the loss, with an input that does not require grad, so the first conv
computes no input gradient, as the analytic rule says. Batch-norm statistics and the parameters'
.grad are restored afterwards: counting never changes the model. The weight update is not counted.
"""

from __future__ import annotations

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense"),
    includes_update=False,
    notes=("torch.utils.flop_counter.FlopCounterMode: 2 FLOPs per MAC of convolutions and matrix products, "
           "padded taps included; bias, normalisation, activation, pooling and softmax are not counted; "
           "the backward count has no weight update"),
)

_DENSE_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm")


def category_of(op) -> str:
    """opcount category of an aten op (an OpOverloadPacket or its name)."""
    name = getattr(op, "__name__", str(op)).split(".")[-1]
    if "convolution" in name or name == "_slow_conv2d_forward":
        return "conv"
    if name in _DENSE_OPS:
        return "dense"
    return "other"


class TorchFlopCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        import torch
        from torch.utils.flop_counter import FlopCounterMode

        from aiperf_backends.torch.loss import summed_loss
        from aiperf_backends.torch.training import preserved

        graph = model.graph
        device = next(model.parameters()).device
        rng = np.random.default_rng(0)
        x = torch.from_numpy(rng.standard_normal((batch,) + tuple(graph.input_shape)).astype(np.float32)).to(device)
        was_training = model.training
        counter = FlopCounterMode(display=False)
        try:
            if backward:
                classes = graph.output_shape[-1] if len(graph.output_shape) == 1 else None
                if classes is None:
                    raise ValueError("a backward count needs a flat class output")
                labels = torch.from_numpy(rng.integers(0, classes, batch)).to(device)
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
        out = {"conv": 0, "dense": 0, "other": 0}
        for op, flops in counter.get_flop_counts().get("Global", {}).items():
            out[category_of(op)] += int(flops)
        return out
