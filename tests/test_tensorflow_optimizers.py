"""The TensorFlow backend's optimizers beyond the conformance kit (whose `train` level checks three
steps of each against the float64 reference): AdamW and gradient clipping against
aiperf_core.optim.HostOptimizer while the learning rate changes per epoch (decay of the kernel, not
of the bias); fp16 loss scaling with AdamW (a skipped step leaves the moments and the step count
alone); and data parallelism with clipping equal to one device on the combined batch.

Two logical CPU devices need AIPERF_CPU_DEVICES before TensorFlow's runtime starts: that test runs in
a fresh interpreter. fp32 tolerances as in test_tensorflow_backend.py: float32 against float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[1]


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


def test_data_parallel_adamw_with_clipping_equals_one_device():
    """Two logical CPU devices (a fresh process: AIPERF_CPU_DEVICES is read before TF starts) train a
    tiny GPT with AdamW, decay and a clip that engages as one device does on the combined batch: 17
    sequences in batches of 8, 8 and 1 (the last too small to shard: it trains whole in the
    strategy's cross-replica context), over two epochs at two learning rates. Clipping each
    replica's own gradients would not agree.

    The key projection's bias is left out of the comparison: attention's softmax is invariant to it,
    so its gradient is zero in exact arithmetic and float32 rounding noise in practice, which Adam
    normalises into steps of about +-lr whose sign depends on the summation order (it differs by
    ~1e-2 between one and two devices with or without clipping)."""
    script = """
        import json
        import numpy as np
        from aiperf_backends.tensorflow import TensorFlowBackend
        from aiperf_core.backend import Dataset, Schedule, TrainConfig
        from aiperf_core.builders import gpt
        from aiperf_core.optim import grad_norm

        backend = TensorFlowBackend()
        graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 32, (17, 8)), rng.integers(0, 32, (17, 8))
        data = Dataset(x, y, x[:5], y[:5], 32)
        _, grads = backend.loss_and_grads(backend.lower(graph), x[:8], y[:8])
        out = {}
        for devices in (("cpu:0",), ("cpu:0", "cpu:1")):
            model = backend.lower(graph)
            config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(0.005, final_fraction=0.5),
                                 optimizer="adamw", weight_decay=0.1, grad_clip=0.2, devices=devices)
            reports = backend.train(model, data, config)
            out[len(devices)] = {"weights": backend.export_weights(model), "loss": [r.loss for r in reports],
                                 "seqs": [r.train_images for r in reports]}
        one, two = out[1]["weights"], out[2]["weights"]
        worst = {f"{n}.{p}": float(np.max(np.abs(one[n][p] - two[n][p]) / (1.0 + np.abs(one[n][p]))))
                 for n in one for p in one[n]}
        print(json.dumps({"devices": backend.devices(), "norm": grad_norm(grads), "worst": worst,
                          "loss": [out[1]["loss"], out[2]["loss"]], "seqs": out[2]["seqs"]}))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS", "AIPERF_TF_XLA")}
    env.update(AIPERF_CPU_DEVICES="2", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == ["cpu:0", "cpu:1"] and r["seqs"] == [17, 17]
    assert r["norm"] > 2 * 0.2  # the clip engages (on the first step at least)
    worst = {name: err for name, err in r["worst"].items() if name != "h0_k.bias"}
    assert len(worst) == len(r["worst"]) - 1
    assert max(worst.values()) < 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=1e-5)
