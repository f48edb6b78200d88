"""The JAX backend's optimizers beyond the conformance kit (which checks adamw and sgd-clip apart,
on one device, and both over two devices in parallel/gpt_matches_one_device): AdamW and a gradient
clip together against the float64 reference, and the compiled step cached per update rule and
never retraced for a new learning rate.
"""

from __future__ import annotations


import numpy as np

import jax  # noqa: F401  (`make test` installs jax: missing it is a failure, never a skip)

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.ir import is_trainable
from aiperf_core.optim import HostOptimizer, grad_norm
from aiperf_backends.jax import JaxBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import normwise_error, reference
from aiperf_conformance.levels.op import key_biases


def _tokens(graph, n: int, seed: int):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_adamw_with_a_clip_matches_the_float64_reference():
    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    weights = trained_looking_weights(graph, 0)
    x, y = _tokens(graph, 6, 1)
    ref = reference()
    exact = {n: {p: np.asarray(a, np.float64) for p, a in ps.items()} for n, ps in weights.items()}
    _, first, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64)
    # a clip at half the first step's norm engages on every step
    config = TrainConfig(epochs=3, batch_size=len(x), optimizer="adamw", weight_decay=0.1,
                         grad_clip=0.5 * grad_norm(first),
                         schedule=Schedule(initial=0.01, final_fraction=0.1, warmup_epochs=1, shape="cosine"))
    stepper = HostOptimizer(config, exact, is_trainable)
    for epoch in range(config.epochs):
        _, grads, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64)
        stepper.step(exact, grads, config.schedule.rate(epoch, config.epochs))
    backend = JaxBackend()
    model = backend.lower(graph, weights)
    backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    trained = backend.export_weights(model)
    skipped = key_biases(graph)  # exact gradient zero: AdamW turns its rounding into steps of lr
    for node_id, params in exact.items():
        for name, value in params.items():
            if not is_trainable(name) or (node_id, name) in skipped:
                continue
            start = np.asarray(weights[node_id][name], np.float64)
            error = normwise_error(np.asarray(trained[node_id][name], np.float64) - start, value - start)
            assert error < 1e-3, (node_id, name, error)


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


