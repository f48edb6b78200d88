"""The MindSpore backend's optimizers beyond the kit's checks (gpt_adamw_matches_reference,
gpt_sgd_clip_matches_reference, and over two workers parallel/gpt_matches_one_device): the clip
sees fp16's unscaled gradients, a clip that never engages leaves SGD bit for bit as without one, AdamW follows the
learning rate set between steps, and exported weights are a snapshot, not a view of the live ones.
"""

from __future__ import annotations


import numpy as np
import pytest

import mindspore  # noqa: E402,F401  (`make test` installs mindspore: missing it is a failure, never a skip)

from aiperf_core.backend import Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import gpt  # noqa: E402
from aiperf_core.optim import grad_norm  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.op import key_biases  # noqa: E402


def _tokens(graph, n: int, seed: int):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_model(precision: str = "fp32"):
    from aiperf_backends.mindspore.lowering import lower_graph

    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    model = lower_graph(graph, trained_looking_weights(graph, 1), precision)
    model.set_train(True)
    return graph, model


def _step(model, config, x, y, steps: int = 1, lr: float | None = None):
    from aiperf_backends.mindspore.training import Stepper, targets

    stepper = Stepper(model, config)
    if lr is not None:
        stepper.set_lr(lr)
    for _ in range(steps):
        stepper.step(x, targets(y, model.graph.output_shape[-1], 0.0), len(x))
    return model.export_canonical()


def test_fp16_clips_the_unscaled_gradients():
    # fp16 is not declared on this CPU (emulated); its Stepper is exercised directly. Clipped on the
    # loss-scaled gradients (2^16 times too large), the fp16 step would be ~2^16 times too small.
    from aiperf_backends.mindspore.backend import MindSporeBackend

    graph, model = _gpt_model()
    x, y = _tokens(graph, 4, 2)
    start = model.export_canonical()
    _, grads = MindSporeBackend().loss_and_grads(model, x, y)
    config = TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.05), grad_clip=0.5 * grad_norm(grads))
    full = _step(model, config, x, y)
    _, half_model = _gpt_model("fp16")
    half = _step(half_model, config, x, y)
    skipped = key_biases(graph)  # a zero gradient in exact arithmetic: fp16 and fp32 round it differently
    for node_id, params in full.items():
        for name, value in params.items():
            if (node_id, name) in skipped:
                continue
            want, got = value - start[node_id][name], half[node_id][name] - start[node_id][name]
            assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(want) + 1e-7, f"{node_id}.{name}"


def test_a_clip_that_never_engages_leaves_sgd_bit_for_bit():
    graph, model = _gpt_model()
    x, y = _tokens(graph, 4, 3)
    config = TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.05))
    plain = _step(model, config, x, y, steps=2)
    _, model = _gpt_model()
    clipped = _step(model, TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.05), grad_clip=1e9),
                    x, y, steps=2)
    assert all(np.array_equal(clipped[n][p], plain[n][p]) for n in plain for p in plain[n])


def test_adamw_follows_the_learning_rate_set_between_steps():
    # lr 0 is no step at all, decay included (w *= 1 - 0 * weight_decay).
    graph, model = _gpt_model()
    x, y = _tokens(graph, 4, 4)
    start = model.export_canonical()
    config = TrainConfig(epochs=1, batch_size=4, optimizer="adamw", weight_decay=0.1, schedule=Schedule(initial=0.01))
    frozen = _step(model, config, x, y, lr=0.0)
    assert all(np.array_equal(frozen[n][p], start[n][p]) for n in start for p in start[n])
    moved = _step(model, config, x, y, lr=0.01)
    # AdamW's first step moves a weight by lr * g / (|g| + epsilon): about lr for a bias (not decayed).
    assert np.max(np.abs(moved["h0_fc1"]["bias"] - start["h0_fc1"]["bias"])) == pytest.approx(0.01, rel=1e-4)


def test_exported_weights_are_a_snapshot():
    # asnumpy() shares a Parameter's memory: an export that kept it would change with the next step.
    graph, model = _gpt_model()
    x, y = _tokens(graph, 4, 5)
    before = model.export_canonical()
    saved = {n: {p: a.copy() for p, a in ps.items()} for n, ps in before.items()}
    _step(model, TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.05)), x, y)
    assert all(np.array_equal(before[n][p], saved[n][p]) for n in saved for p in saved[n])
