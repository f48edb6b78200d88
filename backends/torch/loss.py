"""The training loss, shared by the eager and the compiled step (and by the native counter).

A lowered model's generated code calls `summed_loss` from a small per-model function
(`LoweredModel.training_loss`), so that torch.compile caches the step per model: one shared Python
function compiled for every trial's model would be recompiled per trial until dynamo's recompile
limit, and then silently run eager.

A sequence graph has a class per position, labels (N, S): a sample's loss is the mean over its S
positions, so that the summed loss divided by the samples is the mean over every position, the NumPy
reference's loss, and the training loop's per-sample arithmetic (shards, all-reduces) holds as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax


def summed_loss(model, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
    """Summed (not mean) over the samples of a batch of their categorical cross-entropy against
    smoothed one-hot targets (a sequence's: the mean over its positions).

    With a softmax output the loss comes from its logits (F.cross_entropy, a stable log-softmax);
    otherwise the output is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does.
    `model` is a LoweredModel or a DistributedDataParallel around one.
    """
    base = getattr(model, "module", model)
    if base.has_logits:
        return _summed_cross_entropy(model(x, logits=True), labels, label_smoothing, logits=True)
    return _summed_cross_entropy(model(x), labels, label_smoothing, logits=False)


def summed_eval(model, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
    """(summed loss as summed_loss's, correct predictions: images, or positions of the sequences) of a
    batch in the model's current mode, as tensors (no host synchronisation)."""
    out = model(x, logits=True)  # logits where the output is a softmax: the argmax is the same
    return (_summed_cross_entropy(out, labels, label_smoothing, logits=model.has_logits),
            (out.argmax(dim=-1) == labels).sum())


def _summed_cross_entropy(out: torch.Tensor, labels: torch.Tensor, label_smoothing: float, logits: bool):
    """The summed per-sample loss of outputs (N, classes) or (N, S, classes), in fp32."""
    out = out.float()
    classes = out.shape[-1]
    positions = math.prod(labels.shape[1:])  # 1 for images; an empty shard has a shape too
    out, labels = out.reshape(-1, classes), labels.reshape(-1)
    if logits:
        total = F.cross_entropy(out, labels, reduction="sum", label_smoothing=label_smoothing)
    else:
        target = F.one_hot(labels, classes).to(out.dtype) * (1.0 - label_smoothing) + label_smoothing / classes
        total = -(target * out.clamp(PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP).log()).sum()
    return total / positions if positions > 1 else total


def normalise_pixels(x: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC pixels -> float32 `(float32(x) - MEAN) * INV_STD` per channel: the arithmetic of
    aiperf_core.data.preprocess.normalise, on the pixels' device."""
    return (x.float() - mean) * inv_std
