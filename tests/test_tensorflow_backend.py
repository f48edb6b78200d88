"""TensorFlow backend: data parallelism, SGD semantics, precisions and the native counter.

Data parallelism runs in a subprocess that splits the host CPU into 2 logical devices before any
TF op (tf.config.set_logical_device_configuration), so that devices() lists two CPUs and train()
uses MirroredStrategy. Batch norm is synchronised across the replicas (backends/tensorflow/
lowering.py), so data-parallel training is the same computation as single-device training on the
global batch up to float32 summation order: the weights must agree to ~1e-5.
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

from aiperf_core.backend import BackendError, Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5

DP_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.builders import resnet_small
    from aiperf_backends.tensorflow import TensorFlowBackend
    from aiperf_backends.tensorflow.training import Trainer, run_epochs
    from aiperf_conformance.cases import trained_looking_weights

    backend = TensorFlowBackend()
    graph = resnet_small((16, 16, 3), 5)
    weights = trained_looking_weights(graph, 3)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (40,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 40)
    data = Dataset(x, y, x[:12], y[:12], 5)
    # batch 15: global batches 15, 15, 10 -> shards 8/7, 8/7, 5/5; two epochs with a decaying rate.
    config = TrainConfig(epochs=2, batch_size=15, schedule=Schedule(initial=0.05, final_fraction=0.2),
                         momentum=0.9, label_smoothing=0.1, seed=1)

    dp_model = backend.lower(graph, weights)
    dp_reports = backend.train(dp_model, data, config)           # MirroredStrategy over 2 CPUs
    one_model = backend.lower(graph, weights)
    one_reports = run_epochs(Trainer(one_model, config), data, config)  # one device, same data

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))

    got, want = backend.export_weights(dp_model), backend.export_weights(one_model)
    start = backend.export_weights(backend.lower(graph, weights))
    errs = {f"{n}/{p}": rel(got[n][p], want[n][p]) for n in want for p in want[n]}
    moved = max(rel(want[n][p], start[n][p]) for n in want for p in want[n])
    print("RESULT " + json.dumps({
        "devices": backend.devices(), "worst": max(errs.values()), "worst_at": max(errs, key=errs.get),
        "moved": moved,
        "dp_images": [r.train_images for r in dp_reports], "one_images": [r.train_images for r in one_reports],
        "dp_loss": [r.loss for r in dp_reports], "one_loss": [r.loss for r in one_reports],
        "dp_val": [r.val_loss for r in dp_reports], "one_val": [r.val_loss for r in one_reports],
    }))
""")


def test_data_parallel_equals_single_device():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", DP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT "):])
    assert r["devices"] == ["cpu:0", "cpu:1"]
    assert r["dp_images"] == r["one_images"] == [40, 40]
    assert r["moved"] > 1e-3  # training did change the weights
    assert r["worst"] < TOL, f"data parallel vs single device: {r['worst']:.3g} at {r['worst_at']}"
    np.testing.assert_allclose(r["dp_loss"], r["one_loss"], rtol=1e-5)
    np.testing.assert_allclose(r["dp_val"], r["one_val"], rtol=1e-5)


def _dense_graph() -> Graph:
    return Graph([Node("x", "input", (), {"shape": [6]}), Node("d", "dense", ("x",), {"units": 3}),
                  Node("p", "softmax", ("d",), {})])


def test_sgd_momentum_matches_torch_semantics():
    """v = m v + g; w -= lr v, with the rate changing per epoch (Keras' SGD would differ here)."""
    import aiperf_numpy

    backend = TensorFlowBackend()
    graph = _dense_graph()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    model = backend.lower(graph)
    weights = backend.export_weights(model)
    config = TrainConfig(epochs=3, batch_size=8, schedule=Schedule(initial=0.5, final_fraction=0.1), momentum=0.9)
    reports = backend.train(model, Dataset(x, y, x, y, 3), config)
    assert [r.train_images for r in reports] == [8, 8, 8]
    w = {n: {p: v.astype(np.float64) for p, v in ps.items()} for n, ps in weights.items()}
    v = {n: {p: np.zeros_like(a) for p, a in ps.items()} for n, ps in w.items()}
    for epoch in range(3):
        lr = config.schedule.rate(epoch, 3)
        _, grads, _ = aiperf_numpy.loss_and_grads(graph, w, x, y)
        for n in w:
            for p in w[n]:
                v[n][p] = 0.9 * v[n][p] + grads[n][p]
                w[n][p] = w[n][p] - lr * v[n][p]
    got = backend.export_weights(model)
    for n in w:
        for p in w[n]:
            np.testing.assert_allclose(got[n][p], w[n][p], rtol=1e-4, atol=1e-5)


def test_last_batch_is_short_not_dropped():
    backend = TensorFlowBackend()
    graph = _dense_graph()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 6)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    reports = backend.train(backend.lower(graph), Dataset(x, y, x[:3], y[:3], 3), TrainConfig(epochs=2, batch_size=4))
    assert [r.train_images for r in reports] == [10, 10]
    assert all(r.val_images == 3 for r in reports)


def test_precisions():
    backend = TensorFlowBackend()
    declared = backend.precisions()
    assert declared[0] == "fp32"
    with pytest.raises(BackendError):
        backend.lower(_dense_graph(), precision="int8")
    for precision in ("bf16", "fp16"):
        if precision not in declared:
            with pytest.raises(BackendError):
                backend.lower(_dense_graph(), precision=precision)


def test_mixed_precision_trains_where_declared():
    from aiperf_core.builders import resnet_small

    backend = TensorFlowBackend()
    mixed = [p for p in backend.precisions() if p != "fp32"]
    graph = resnet_small((16, 16, 3), 5)
    rng = np.random.default_rng(2)
    x = rng.normal(size=(16, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 5, 16)
    for precision in mixed:
        model = backend.lower(graph, precision=precision)
        ref = backend.predict(backend.lower(graph), x)
        out = backend.predict(model, x)
        assert np.max(np.abs(out - ref)) < 0.1
        reports = backend.train(model, Dataset(x, y, x, y, 5),
                                TrainConfig(epochs=2, batch_size=8, precision=precision))
        assert all(np.isfinite(r.loss) for r in reports)


def test_native_counter_counts_conv_and_dense():
    import aiperf_opcount as opcount
    from aiperf_core.builders import resnet_small

    backend = TensorFlowBackend()
    counter = backend.native_counter()
    graph = resnet_small((16, 16, 3), 5)
    model = backend.lower(graph)
    counted = opcount.count(graph, counter.convention.padding)
    want_fwd = {c: 2 * sum(n.fp for n in counted.nodes if n.category == c) for c in ("conv", "dense")}
    got = counter.count(model, 2, backward=False)
    assert {c: got[c] for c in want_fwd} == want_fwd
    before = backend.export_weights(model)
    counter.count(model, 2, backward=True)
    after = backend.export_weights(model)  # counting never changes the model
    assert all(np.array_equal(before[n][p], after[n][p]) for n in before for p in before[n])
