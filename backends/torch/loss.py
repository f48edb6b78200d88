"""The training loss, shared by the eager and the compiled step (and by the native counter).

A lowered model's generated code calls `summed_loss` from a small per-model function
(`LoweredModel.training_loss`), so that torch.compile caches the step per model: one shared Python
function compiled for every trial's model would be recompiled per trial until dynamo's recompile
limit, and then silently run eager.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax


def summed_loss(model, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
    """Summed (not mean) categorical cross-entropy of a batch, against smoothed one-hot targets.

    With a softmax output the loss comes from its logits (F.cross_entropy, a stable log-softmax);
    otherwise the output is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does.
    `model` is a LoweredModel or a DistributedDataParallel around one.
    """
    base = getattr(model, "module", model)
    if base.has_logits:
        logits = model(x, logits=True).float()
        return F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)
    probs = model(x).float()
    classes = probs.shape[-1]
    target = F.one_hot(labels, classes).to(probs.dtype) * (1.0 - label_smoothing) + label_smoothing / classes
    clipped = probs.clamp(PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP)
    return -(target * clipped.log()).sum()


def summed_eval(model, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
    """(summed loss, correct predictions) of a batch in the model's current mode, as tensors (no
    host synchronisation)."""
    out = model(x, logits=True).float()
    if model.has_logits:  # out holds logits; argmax is the same as the softmax's
        total = F.cross_entropy(out, labels, reduction="sum", label_smoothing=label_smoothing)
    else:
        classes = out.shape[-1]
        target = F.one_hot(labels, classes).float() * (1.0 - label_smoothing) + label_smoothing / classes
        total = -(target * out.clamp(PROBABILITY_CLIP, 1 - PROBABILITY_CLIP).log()).sum()
    return total, (out.argmax(dim=-1) == labels).sum()


def normalise_pixels(x: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC pixels -> float32 `(float32(x) - MEAN) * INV_STD` per channel: the arithmetic of
    aiperf_core.data.preprocess.normalise, on the pixels' device."""
    return (x.float() - mean) * inv_std
