"""The optimizers of TrainConfig, written out in NumPy: the NumPy backend trains with them and the
kit's reference applies them in float64. Their update rules are stated once, beside
aiperf_core.backend.OPTIMIZERS; every backend implements the same arithmetic in its framework.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from aiperf_core.backend import TrainConfig

CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grad_norm_'s: norm + 1e-6 in the denominator


def is_decayed(value) -> bool:
    """Whether AdamW's weight decay applies to a parameter: matrices (kernels, embeddings, experts,
    routers), not vectors (biases, layer-norm scales and shifts), as in GPT-2 and nanoGPT: decaying
    a norm's scale or a bias toward zero only fights the normalisation it serves."""
    return np.ndim(value) >= 2


def grad_norm(grads: Mapping[str, Mapping[str, np.ndarray]]) -> float:
    """The 2-norm of every gradient together."""
    return float(np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for ps in grads.values()
                             for g in ps.values())))


def clip_factor(grads: Mapping[str, Mapping[str, np.ndarray]], grad_clip: float | None) -> float:
    """The factor every gradient is scaled by before the update (1.0 without clipping)."""
    if grad_clip is None:
        return 1.0
    return min(1.0, grad_clip / (grad_norm(grads) + CLIP_EPSILON))


class HostOptimizer:
    """config.optimizer over nested {node: {param: array}} weights, updated in place; the state
    takes the dtype of the weights."""

    def __init__(self, config: TrainConfig, weights: Mapping[str, Mapping[str, np.ndarray]],
                 trainable=lambda name: True):
        self.config = config
        self.steps = 0
        self.first = {n: {p: np.zeros_like(a) for p, a in ps.items() if trainable(p)} for n, ps in weights.items()}
        self.second = ({n: {p: np.zeros_like(a) for p, a in ps.items()} for n, ps in self.first.items()}
                       if config.optimizer == "adamw" else None)

    def step(self, weights: Mapping[str, dict], grads: Mapping[str, Mapping[str, np.ndarray]], lr: float) -> None:
        config = self.config
        scale = clip_factor(grads, config.grad_clip)
        self.steps += 1
        if config.optimizer == "adamw":
            b1, b2 = config.betas
            first_fix, second_fix = 1.0 - b1 ** self.steps, 1.0 - b2 ** self.steps
        for node_id, params in grads.items():
            for name, g in params.items():
                if scale != 1.0:
                    g = g * np.asarray(scale, g.dtype)
                w, m = weights[node_id][name], self.first[node_id][name]
                if config.optimizer == "sgd-momentum":
                    m *= config.momentum
                    m += g
                    w -= lr * m
                    continue
                v = self.second[node_id][name]
                if config.weight_decay and is_decayed(w):
                    w *= 1.0 - lr * config.weight_decay
                m *= b1
                m += (1.0 - b1) * g
                v *= b2
                v += (1.0 - b2) * np.square(g)
                w -= lr * (m / first_fix) / (np.sqrt(v / second_fix) + config.adam_epsilon)
