"""The TensorFlow backend's optimizers beyond the conformance kit (whose `train` level checks three
steps of each against the float64 reference): AdamW and gradient clipping against
aiperf_core.optim.HostOptimizer while the learning rate changes per epoch (decay of the kernel, not
of the bias); fp16 loss scaling with AdamW (a skipped step leaves the moments and the step count
alone). Data parallelism with clipping is the kit's parallel/gpt_matches_one_device. fp32
tolerances as in test_tensorflow_backend.py: float32 against float64.
"""

from __future__ import annotations


import numpy as np
import pytest

from aiperf_backends.tensorflow import TensorFlowBackend

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

from aiperf_core.backend import Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402
from aiperf_core.optim import HostOptimizer, grad_norm  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402
from aiperf_backends.tensorflow import lowering, training  # noqa: E402


def _dense_graph() -> Graph:
    return Graph([Node("x", "input", (), {"shape": [6]}), Node("d", "dense", ("x",), {"units": 3}),
                  Node("p", "softmax", ("d",), {})])


def _dense_data(n: int = 8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum"])
def test_clipped_steps_match_the_host_optimizer_as_the_rate_changes(optimizer):
    """Three full-batch epochs at three learning rates against HostOptimizer in float64; the clip is
    a third of the first gradient's norm, so every step is clipped."""
    import aiperf_numpy

    backend = TensorFlowBackend()
    graph = _dense_graph()
    x, y = _dense_data()
    model = backend.lower(graph)
    w = {n: {p: a.astype(np.float64) for p, a in ps.items()} for n, ps in backend.export_weights(model).items()}
    _, grads, _ = aiperf_numpy.loss_and_grads(graph, w, x, y)
    clip = grad_norm(grads) / 3.0
    config = TrainConfig(epochs=3, batch_size=8, schedule=Schedule(initial=0.05, final_fraction=0.2),
                         optimizer=optimizer, weight_decay=0.1, grad_clip=clip)
    reports = backend.train(model, Dataset(x, y, x, y, 3), config)
    assert [r.train_images for r in reports] == [8, 8, 8]
    reference = HostOptimizer(config, w)
    rates = [config.schedule.rate(epoch, 3) for epoch in range(3)]
    assert len(set(rates)) == 3
    for lr in rates:
        _, grads, _ = aiperf_numpy.loss_and_grads(graph, w, x, y)
        assert grad_norm(grads) > clip
        reference.step(w, grads, lr)
    got = backend.export_weights(model)
    for n in w:
        for p in w[n]:
            np.testing.assert_allclose(got[n][p], w[n][p], rtol=1e-4, atol=1e-5, err_msg=f"{n}.{p}")


def test_adamw_decays_the_kernel_and_not_the_bias():
    """One step from the same weights with and without decay: the gradients, hence the Adam term,
    are the same, so the difference is the decay alone: -lr * wd * w on the kernel, none on the bias
    (made non-zero here, so that decaying it would show)."""
    graph = _dense_graph()
    x, y = _dense_data()
    weights = init_weights(graph, 0)
    weights["d"]["bias"] = np.full_like(weights["d"]["bias"], 0.5)
    after = {}
    for decay in (0.0, 0.5):
        config = TrainConfig(epochs=1, batch_size=8, optimizer="adamw", weight_decay=decay)
        model = lowering.lower_graph(graph, weights, "fp32")
        trainer = training.Trainer(model, config)
        trainer.step(trainer.put(x, y), 0.1)
        after[decay] = model.export_canonical()["d"]
    np.testing.assert_array_equal(after[0.5]["bias"], after[0.0]["bias"])
    np.testing.assert_allclose(after[0.5]["kernel"] - after[0.0]["kernel"],
                               -0.1 * 0.5 * weights["d"]["kernel"], rtol=1e-5, atol=1e-7)


def test_fp16_adamw_skips_an_overflowing_step_and_unscales_before_clipping(monkeypatch):
    """fp16 is declared on GPUs only; its loss scaling is plain TF arithmetic, checked here on the
    CPU. An overflowing step changes no weight, moment or step count; a finite one equals fp32's,
    clip included (the norm is taken of the unscaled gradients: a scaled norm would clip 256x more)."""
    graph = _dense_graph()
    x, y = _dense_data()
    weights = init_weights(graph, 0)
    monkeypatch.setattr(training.LossScale, "INITIAL", 256.0)
    config = {p: TrainConfig(epochs=1, batch_size=8, optimizer="adamw", weight_decay=0.1, grad_clip=0.05,
                             precision=p) for p in ("fp16", "fp32")}
    models = {p: lowering.lower_graph(graph, weights, p) for p in config}
    trainers = {p: training.Trainer(models[p], config[p]) for p in config}
    fp16 = trainers["fp16"]
    fp16.loss_scale.scale.assign(1e38)  # the scaled gradients overflow
    fp16.step(fp16.put(x, y), 0.1)
    assert all(np.array_equal(weights[n][p], a) for n, ps in models["fp16"].export_canonical().items()
               for p, a in ps.items())
    assert all(float(np.max(np.abs(s.numpy()))) == 0.0 for s in fp16.slots + fp16.second)
    assert float(fp16.updates_applied.numpy()) == 0.0
    fp16.loss_scale.scale.assign(256.0)
    for p, trainer in trainers.items():
        for lr in (0.1, 0.05):
            trainer.step(trainer.put(x, y), lr)
        assert float(trainer.updates_applied.numpy()) == 2.0
    got, want = models["fp16"].export_canonical()["d"], models["fp32"].export_canonical()["d"]
    for p in want:
        np.testing.assert_allclose(got[p], want[p], rtol=0, atol=2e-3, err_msg=p)  # fp16 forward: ~1e-3


