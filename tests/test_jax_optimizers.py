"""The JAX backend's optimizers beyond the conformance kit (which checks them against the float64
reference in train/gpt_adamw_matches_reference and train/gpt_sgd_clip_matches_reference, and over
two devices in parallel/gpt_matches_one_device): the compiled step cached per update rule and
never retraced for a new learning rate.
"""

from __future__ import annotations

import numpy as np

import jax  # noqa: F401  (`make test` installs jax: missing it is a failure, never a skip)

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_backends.jax import JaxBackend
from aiperf_conformance.cases import trained_looking_weights


def _tokens(graph, n: int, seed: int):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_the_step_is_cached_per_update_rule_and_a_new_rate_never_retraces():
    from aiperf_backends.jax.training import step_key

    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    x, y = _tokens(graph, 4, 2)
    data = Dataset(x, y, x, y, graph.vocab)
    backend = JaxBackend()
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    adamw = TrainConfig(epochs=2, batch_size=4, optimizer="adamw", weight_decay=0.1, grad_clip=1.0,
                        schedule=Schedule(initial=0.01))
    backend.train(model, data, adamw)
    step = model.cache[step_key(adamw)]
    assert step.traces == 1
    again = backend.train(model, data, TrainConfig(**{**adamw.__dict__, "schedule": Schedule(initial=0.002)}))
    assert step.traces == 1 and again[0].compile_seconds == 0.0
    # every field baked into the traced code keys its own step; SGD without a clip keeps its old key
    variants = [TrainConfig(**{**adamw.__dict__, **change}) for change in
                ({"grad_clip": None}, {"grad_clip": 2.0}, {"weight_decay": 0.0}, {"betas": (0.9, 0.999)},
                 {"adam_epsilon": 1e-6}, {"optimizer": "sgd-momentum"})]
    keys = {step_key(c) for c in variants + [adamw]}
    assert len(keys) == len(variants) + 1
    assert step_key(TrainConfig(epochs=1, batch_size=4)) == ("train", "fp32", 0.9, 0.0)


