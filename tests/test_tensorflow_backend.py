"""The TensorFlow backend beyond the conformance kit: how TF is configured (oneDNN, threads,
AIPERF_CPU_DEVICES), precisions (IEEE fp32 by a scoped TF32 switch, tf32/bf16/fp16 by device,
fp16 loss scaling), the XLA policy, uint8 pixels normalised on the device, synthetic data made on
the device, tf.data pixels, exact image counts and live progress, compile time, SGD semantics,
TrainConfig.devices, and data parallelism equal to one device.

The tests that need several devices or a fresh TF runtime run in a subprocess: AIPERF_CPU_DEVICES
and TF's pools are configured before the runtime starts. Batch norm is synchronised across the
replicas (backends/tensorflow/lowering.py), so data-parallel training is the same computation as
single-device training on the global batch up to float32 summation order: the weights must agree
to ~1e-5.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL = 2e-5


def _run(script: str, environ: dict | None = None, **env_extra) -> dict:
    """Run `script` in a fresh interpreter (TensorFlow not yet imported), in `environ` (os.environ by default)
    with env_extra; its last line is JSON."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if k not in ("AIPERF_CPU_DEVICES", "TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS", "AIPERF_TF_XLA")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + environ.get("PYTHONPATH", ""), **env_extra)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_without_using_tensorflow():
    # Importing the package must not import TF (listing backends never fails on a missing framework).
    code = "import sys, aiperf_backends.tensorflow; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


from aiperf_backends.tensorflow import TensorFlowBackend  # noqa: E402

# `make test` installs TensorFlow: a missing one is a failure here, never a skip.
assert TensorFlowBackend.availability().available, TensorFlowBackend.availability().reason

import tensorflow as tf  # noqa: E402

from aiperf_core.backend import BackendError, Dataset, Schedule, StepClock, TrainConfig  # noqa: E402
from aiperf_core.builders import resnet_small  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402
from aiperf_backends.tensorflow import backend as tf_backend  # noqa: E402
from aiperf_backends.tensorflow import lowering, training  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from beside import beside


def _data(graph, n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (n,) + graph.input_shape).astype(np.float32), rng.integers(0, graph.output_shape[0], n)


def _dense_graph() -> Graph:
    return Graph([Node("x", "input", (), {"shape": [6]}), Node("d", "dense", ("x",), {"units": 3}),
                  Node("p", "softmax", ("d",), {})])


# -- how TensorFlow is configured -------------------------------------------------------------------


def test_onednn_is_on_by_default_and_threads_follow_omp_num_threads():
    """TF's own default leaves oneDNN off on x86 CPUs without VNNI/BF16/AMX (Eigen kernels, ~7x
    slower here); the backend turns it on unless the user chose, and sizes TF's pools by the
    replica's OMP_NUM_THREADS."""
    script = """
        import json, os
        from aiperf_backends.tensorflow import TensorFlowBackend
        TensorFlowBackend().devices()
        import tensorflow as tf
        from tensorflow.python.util import _pywrap_util_port
        print(json.dumps({"env": os.environ.get("TF_ENABLE_ONEDNN_OPTS"), "onednn": _pywrap_util_port.IsMklEnabled(),
                          "intra": tf.config.threading.get_intra_op_parallelism_threads(),
                          "inter": tf.config.threading.get_inter_op_parallelism_threads()}))
    """
    with ThreadPoolExecutor(2) as pool:  # the two fresh interpreters side by side
        found = pool.submit(_run, script, OMP_NUM_THREADS="1")
        kept = pool.submit(_run, script, TF_ENABLE_ONEDNN_OPTS="0")
        found, kept = found.result(), kept.result()
    assert found["intra"] == 1 and found["inter"] == 1
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert found["env"] == "1" and found["onednn"] is True
    else:  # elsewhere TensorFlow's own choice stands
        assert found["env"] is None
    assert kept["env"] == "0" and kept["onednn"] is False and kept["intra"] == 0  # TF's own pool sizes


def test_cpu_devices_variable_is_read_before_the_runtime_starts():
    found = _run("""
        import json, os
        import tensorflow as tf
        tf.constant(1.0) + 1.0  # the runtime starts with one CPU device
        os.environ["AIPERF_CPU_DEVICES"] = "2"
        from aiperf_core.backend import BackendError
        from aiperf_backends.tensorflow import TensorFlowBackend
        try:
            TensorFlowBackend().devices()
            print(json.dumps({"error": None}))
        except BackendError as exc:
            print(json.dumps({"error": str(exc)}))
    """)
    assert "AIPERF_CPU_DEVICES=2, but TensorFlow's runtime already started with 1 CPU device" in found["error"]


@pytest.mark.parametrize("bad, message", [("two", "whole number"), ("0", ">= 1"), ("-3", ">= 1")])
def test_cpu_devices_variable_is_checked(monkeypatch, bad, message):
    monkeypatch.setenv("AIPERF_CPU_DEVICES", bad)
    with pytest.raises(BackendError, match=f"AIPERF_CPU_DEVICES must be .*{message}"):
        tf_backend.requested_cpu_devices()


def test_onednn_reduced_fpmath_mode_is_refused(monkeypatch):
    monkeypatch.setattr(tf_backend, "_configured", False)
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    with pytest.raises(BackendError, match="ONEDNN_DEFAULT_FPMATH_MODE=BF16 .* would not be IEEE fp32"):
        TensorFlowBackend().devices()


# -- precisions -------------------------------------------------------------------------------------


def test_precisions_on_this_cpu():
    backend = TensorFlowBackend()
    declared = backend.precisions()
    assert declared[0] == "fp32" and "tf32" not in declared and "fp16" not in declared
    assert ("bf16" in declared) == bool(tf_backend.cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert backend.fastest_precision() == ("bf16" if "amx_bf16" in tf_backend.cpu_flags() else "fp32")
    with pytest.raises(BackendError, match="unknown precision"):
        backend.lower(_dense_graph(), precision="int8")
    for precision in ("tf32", "bf16", "fp16"):
        if precision not in declared:
            with pytest.raises(BackendError, match=f"cannot run precision '{precision}'"):
                backend.lower(_dense_graph(), precision=precision)


def test_precisions_a_gpu_runs_by_compute_capability(monkeypatch):
    expected = {(9, 0): {"tf32", "bf16", "fp16"}, (8, 0): {"tf32", "bf16", "fp16"},
                (7, 5): {"fp16"}, (7, 0): {"fp16"}, (6, 1): set(), (0, 0): set()}
    for capability, native in expected.items():
        monkeypatch.setattr(tf_backend, "_compute_capability", lambda device, c=capability: c)
        assert {p for p in ("tf32", "bf16", "fp16") if tf_backend.runs_natively("gpu:0", p)} == native, capability
    # Whether a CPU has the instructions is the contract's rule (tests/test_precision_native.py); of
    # what it allows, TensorFlow offers bf16 only.
    assert [p for p in ("tf32", "bf16", "fp16") if tf_backend.runs_natively("cpu", p)] == ["bf16"]


def test_fp32_calls_run_with_tf32_off_and_restore_the_users_setting(monkeypatch):
    """TF's TF32 switch is process-global: each call holds it off for fp32 (on for tf32) while it
    traces and runs, and gives the user's value back after."""
    backend = TensorFlowBackend()
    graph = resnet_small((8, 8, 3), 3)
    model = backend.lower(graph)
    seen = []
    call = model.call

    def recording_call(*args, **kwargs):  # Python runs while TF traces and in eager calls
        seen.append(tf.config.experimental.tensor_float_32_execution_enabled())
        return call(*args, **kwargs)

    monkeypatch.setattr(model, "call", recording_call)
    user = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(True)
    try:
        x, y = _data(graph, 6, 0)
        backend.predict(model, x)
        backend.loss_and_grads(model, x, y)
        backend.train(model, Dataset(x, y, x, y, 3), TrainConfig(epochs=1, batch_size=4))
        assert seen and not any(seen)
        assert tf.config.experimental.tensor_float_32_execution_enabled()  # the user's value is back
        with lowering.precision_scope("tf32"):
            assert tf.config.experimental.tensor_float_32_execution_enabled()
        tf.config.experimental.enable_tensor_float_32_execution(False)
        with lowering.precision_scope("tf32"):
            assert tf.config.experimental.tensor_float_32_execution_enabled()
        assert not tf.config.experimental.tensor_float_32_execution_enabled()
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(user)


def test_mixed_precision_trains_where_declared():
    backend = TensorFlowBackend()
    mixed = [p for p in backend.precisions() if p != "fp32"]
    graph = resnet_small((16, 16, 3), 5)
    x, y = _data(graph, 16, 2)
    for precision in mixed:
        model = backend.lower(graph, precision=precision)
        ref = backend.predict(backend.lower(graph), x)
        out = backend.predict(model, x)
        assert np.max(np.abs(out - ref)) < 0.1
        reports = backend.train(model, Dataset(x, y, x, y, 5),
                                TrainConfig(epochs=2, batch_size=8, precision=precision))
        assert all(np.isfinite(r.loss) for r in reports)


def test_fp16_loss_scaling_skips_an_overflowing_step_and_trains_like_fp32(monkeypatch):
    """fp16 is declared on GPUs only; its loss scaling is plain TF arithmetic, checked here on the
    CPU's (slow, Eigen) float16 kernels."""
    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 1)
    x, y = _data(graph, 16, 3)
    data = Dataset(x, y, x[:4], y[:4], 3)
    # A scale that never overflows here, so that every step counts, as at fp32.
    monkeypatch.setattr(training.LossScale, "INITIAL", 256.0)
    losses = {}
    for precision in ("fp16", "fp32"):
        config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.005), precision=precision)
        trainer = training.Trainer(lowering.lower_graph(graph, weights, precision), config)
        losses[precision] = [r.loss for r in training.run_epochs(trainer, data, config)]
        if precision == "fp16":
            assert float(trainer.loss_scale.good_steps.numpy()) == 4.0  # no step skipped
    np.testing.assert_allclose(losses["fp16"], losses["fp32"], rtol=0.02)

    monkeypatch.setattr(training.LossScale, "GROWTH_INTERVAL", 2)
    config = TrainConfig(epochs=1, batch_size=8, precision="fp16")
    model = lowering.lower_graph(graph, weights, "fp16")
    trainer = training.Trainer(model, config)
    assert float(trainer.loss_scale.scale.numpy()) == 256.0
    trainer.loss_scale.scale.assign(1e38)  # the scaled gradients overflow
    before = model.export_canonical()
    loss = float(trainer.step(trainer.put(x[:8], y[:8]), 0.1))
    after = model.export_canonical()
    assert np.isfinite(loss)
    assert all(np.array_equal(before[n][p], after[n][p]) for n in before for p in before[n])  # moving stats too
    assert float(trainer.loss_scale.scale.numpy()) == pytest.approx(0.5e38)
    assert all(float(tf.reduce_max(tf.abs(s))) == 0.0 for s in trainer.slots)  # momentum untouched
    trainer.loss_scale.scale.assign(64.0)
    trainer.step(trainer.put(x[:8], y[:8]), 0.1)
    assert float(trainer.loss_scale.good_steps.numpy()) == 1.0 and float(trainer.loss_scale.scale.numpy()) == 64.0
    trainer.step(trainer.put(x[8:], y[8:]), 0.1)  # the second finite step in a row: the scale grows
    assert float(trainer.loss_scale.good_steps.numpy()) == 0.0 and float(trainer.loss_scale.scale.numpy()) == 128.0
    first_kernel = graph.nodes[1].id
    assert not np.array_equal(before[first_kernel]["kernel"], model.export_canonical()[first_kernel]["kernel"])


def test_xla_policy(monkeypatch):
    from aiperf_core.builders import gpt
    from aiperf_core.morph.transformer import upcycle_moe

    dense = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    moe = upcycle_moe(dense, None, "h0_fc1", seed=5).graph
    monkeypatch.delenv("AIPERF_TF_XLA", raising=False)
    assert lowering.use_xla("gpu:0") and not lowering.use_xla("cpu") and not lowering.use_xla("cpu:1")
    # A mixture of experts routes only without XLA (static shapes would run every expert on every token).
    assert lowering.use_xla("gpu:0", dense) and not lowering.use_xla("gpu:0", moe)
    monkeypatch.setenv("AIPERF_TF_XLA", "1")
    assert lowering.use_xla("cpu") and lowering.use_xla("gpu:0") and lowering.use_xla("gpu:0", moe)
    monkeypatch.setenv("AIPERF_TF_XLA", "0")
    assert not lowering.use_xla("gpu:0")
    monkeypatch.setenv("AIPERF_TF_XLA", "sometimes")
    with pytest.raises(BackendError, match="AIPERF_TF_XLA must be 1 or 0"):
        lowering.use_xla("cpu")
    monkeypatch.setattr(tf_backend, "_configured", False)  # refused when the backend starts, too
    with pytest.raises(BackendError, match="AIPERF_TF_XLA must be 1 or 0"):
        TensorFlowBackend().devices()


# -- feeding the device -----------------------------------------------------------------------------


def test_uint8_pixels_are_normalised_on_the_device_as_on_the_host():
    from aiperf_core.data.preprocess import normalise

    pixels = np.random.default_rng(4).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    host = normalise(pixels)
    device = tf.function(lowering.device_input)(tf.constant(pixels)).numpy()
    assert np.array_equal(device, host)  # the same float32 operations: bit for bit

    # A training step on uint8 pixels is the step on the host-normalised floats.
    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 4)
    labels = np.array([0, 1, 2])
    config = TrainConfig(epochs=1, batch_size=3)
    results = []
    for x in (pixels, host):
        model = lowering.lower_graph(graph, weights, "fp32")
        trainer = training.Trainer(model, config)
        results.append((float(trainer.step(trainer.put(x, labels), 0.1)), model.export_canonical()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for n, params in results[1][1].items():
        for p, value in params.items():
            np.testing.assert_allclose(results[0][1][n][p], value, rtol=1e-6, atol=1e-6)


def _synthetic(train_images=21, val_images=5, classes=3, size=8):
    from aiperf_core.data.stream import StreamingDataset
    from aiperf_core.data.synthetic import SyntheticSource

    return StreamingDataset(SyntheticSource(classes=classes, train_images=train_images, val_images=val_images, seed=2),
                            image_size=size, workers=0)


def test_synthetic_batches_are_made_on_the_device_and_equal_the_streamed_ones(monkeypatch):
    from aiperf_core.data.stream import StreamingDataset, train_batches, val_batches

    data = _synthetic(train_images=150)  # more than the pool: the windows wrap around it
    graph = resnet_small((8, 8, 3), 3)
    config = TrainConfig(epochs=1, batch_size=16)
    feed = training.open_feed(training.Trainer(TensorFlowBackend().lower(graph), config), data, config)
    assert isinstance(feed, training.SyntheticFeed)
    for epoch in (0, 1):
        device = list(feed.train(epoch))
        host = list(train_batches(data, epoch, 0, 16))
        assert [b.n for b in device] == [len(b.y) for b in host] == [16] * 9 + [6]
        for placed, batch in zip(device, host):
            assert isinstance(placed.x, tf.Tensor) and placed.x.dtype == tf.uint8 and batch.x.dtype == np.uint8
            assert np.array_equal(placed.x.numpy(), batch.x) and np.array_equal(placed.y.numpy(), batch.y)
    (placed,), (batch,) = list(feed.val()), list(val_batches(data, training.PREDICT_BATCH))
    assert placed.n == 5 and np.array_equal(placed.x.numpy(), batch.x) and np.array_equal(placed.y.numpy(), batch.y)

    # Training never reads the host stream: the pool went to the device once.
    for method in ("iterate", "load"):
        monkeypatch.setattr(StreamingDataset, method, lambda *a, **k: pytest.fail("host work per batch"))
    backend = TensorFlowBackend()
    reports = backend.train(backend.lower(graph), data, TrainConfig(epochs=2, batch_size=16))
    assert [(r.train_images, r.val_images, r.skipped_images) for r in reports] == [(150, 5, 0), (150, 5, 0)]
    assert all(np.isfinite(r.loss) for r in reports)


def test_tf_data_delivers_uint8_pixels(tmp_path):
    from aiperf_core.data import load_dataset
    from aiperf_core.data.preprocess import CROP_RATIO, CROP_SCALE, VAL_CROP_FRACTION
    from aiperf_core.data.samples import digits_tree

    assert (training.CROP_AREA, training.CROP_RATIO, training.VAL_CROP_FRACTION) == (CROP_SCALE, CROP_RATIO,
                                                                                       VAL_CROP_FRACTION)
    data = load_dataset({"name": "imagenet", "path": str(digits_tree(tmp_path / "tree")), "image_size": 16},
                        workers=2)
    for split in ("train", "val"):
        batches = list(training.tf_input(data, split, 0, 0, 8))
        assert all(x.dtype == tf.uint8 and tuple(x.shape[1:]) == (16, 16, 3) and y.dtype == tf.int64
                   for x, y in batches)
        assert sum(len(y) for _, y in batches) == data.source.count(split)
    backend = TensorFlowBackend()
    graph = resnet_small((16, 16, 3), data.classes)
    config = TrainConfig(epochs=1, batch_size=8)
    assert isinstance(training.open_feed(training.Trainer(backend.lower(graph), config), data, config),
                      training.TFDataFeed)
    (report,) = backend.train(backend.lower(graph), data, config)
    assert (report.train_images, report.val_images, report.skipped_images) == (data.train_images, data.val_images, 0)


# -- the epoch loop ---------------------------------------------------------------------------------


def test_exact_counts_live_progress_and_compile_time(monkeypatch):
    counted, real_count = [], StepClock.count
    monkeypatch.setattr(StepClock, "count", lambda self, images: (counted.append(images), real_count(self, images)))
    backend = TensorFlowBackend()
    graph = resnet_small((8, 8, 3), 3)
    x, y = _data(graph, 23, 0)
    model = backend.lower(graph)
    backend.precisions(model.device)  # the first call in a process probes with a Trainer of its own
    traced = []
    real_step_fn = training.Trainer._step_fn

    def recording_step_fn(self, dtype, sharded):
        fn = real_step_fn(self, dtype, sharded)
        traced.append(fn)
        return fn

    monkeypatch.setattr(training.Trainer, "_step_fn", recording_step_fn)
    reports = backend.train(model, Dataset(x, y, x[:5], y[:5], 3),
                            TrainConfig(epochs=3, batch_size=8, schedule=Schedule(initial=0.01)))
    assert [r.train_images for r in reports] == [23, 23, 23]
    assert [r.val_images for r in reports] == [5, 5, 5]
    assert counted == [8, 8, 7] * 3  # one count per step: the images of its batch
    # one trace for every batch, epoch and learning rate (the batch dimension is None)
    assert {id(fn) for fn in traced} == {id(traced[0])} and traced[0].experimental_get_tracing_count() == 1
    assert reports[0].compile_seconds > 0 and [r.compile_seconds for r in reports[1:]] == [0.0, 0.0]
    assert all(r.compile_seconds <= r.step_seconds for r in reports)


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


def test_no_function_the_backend_traces_goes_through_autograph(monkeypatch, tmp_path):
    # AutoGraph rewrote the source of each Python function a trace called (about 130 for a step): seconds
    # of a process's first trace for nothing, the traced code being graph TensorFlow (graph_function).
    from tensorflow.python.autograph.impl import api as autograph

    from aiperf_core.data import load_dataset
    from aiperf_core.data.samples import digits_tree

    converted, real_convert = [], autograph._convert_actual
    monkeypatch.setattr(autograph, "_convert_actual",
                        lambda entity, program_ctx: (converted.append(entity), real_convert(entity, program_ctx))[1])
    data = load_dataset({"name": "imagenet", "path": str(digits_tree(tmp_path / "tree")), "image_size": 8},
                        workers=1)  # streamed through tf.data
    backend = TensorFlowBackend()
    graph = resnet_small((8, 8, 3), data.classes)
    model = backend.lower(graph)
    backend.train(model, data, TrainConfig(epochs=1, batch_size=64))
    backend.predict(model, np.zeros((2, 8, 8, 3), np.float32))
    backend.native_counter().count(model, 2, backward=True)
    assert converted == []
    tf.function(lambda t: t + 1 if t.shape[0] else t)(tf.ones(2))  # the patch does see a conversion
    assert len(converted) == 1


# -- devices ----------------------------------------------------------------------------------------

DEVICES_SCRIPT = """
    import json
    import numpy as np

    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.builders import resnet_one_block
    from aiperf_backends.tensorflow import TensorFlowBackend
    from aiperf_backends.tensorflow.distributed import make_strategy
    from aiperf_conformance.cases import trained_looking_weights

    backend = TensorFlowBackend()  # AIPERF_CPU_DEVICES=3: three logical CPUs
    graph = resnet_one_block((16, 16, 3), 5)  # each strategy traces its step anew, per shard shape
    weights = trained_looking_weights(graph, 3)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (40,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 40)
    data = Dataset(x, y, x[:12], y[:12], 5)
    start = backend.export_weights(backend.lower(graph, weights))

    def rel(a, b):
        return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))

    runs = {}
    # batch 15: global batches 15, 15, 10 -> shards 8/7, 8/7, 5/5 (5/5/5, 5/5/5, 4/3/3 on three); two
    # epochs with a decaying rate. One device with no strategy (cpu:1: a copy of the model trained
    # there), two of the three devices, and all three (devices=None).
    for devices in (("cpu:0",), ("cpu:1",), ("cpu:0", "cpu:2"), None):
        model = backend.lower(graph, weights)
        config = TrainConfig(epochs=2, batch_size=15, schedule=Schedule(initial=0.05, final_fraction=0.2),
                             momentum=0.9, label_smoothing=0.1, seed=1, devices=devices)
        reports = backend.train(model, data, config)
        runs[str(devices)] = (reports, backend.export_weights(model), model.device)
    one_reports, want, _ = runs["('cpu:0',)"]

    # A last global batch of 1 on three replicas: it trains whole in the cross-replica context, and
    # every replica's copy of every variable stays the same.
    from aiperf_backends.tensorflow.distributed import mirrored_copy
    from aiperf_backends.tensorflow.training import Trainer, run_epochs

    tiny = Dataset(x[:16], y[:16], x[:2], y[:2], 5)
    tiny_config = TrainConfig(epochs=2, batch_size=15, schedule=Schedule(initial=0.05), seed=1)
    strategy = make_strategy(backend.devices())
    replica = mirrored_copy(backend.lower(graph, weights), strategy, "cpu:0")
    tiny_reports = run_epochs(Trainer(replica, tiny_config, strategy), tiny, tiny_config)
    copies_differ = max(float(np.max(np.abs(c.numpy() - strategy.experimental_local_results(v)[0].numpy())))
                        for ps in replica.params.values() for v in ps.values()
                        for c in strategy.experimental_local_results(v))
    alone = backend.lower(graph, weights)
    alone_reports = backend.train(alone, tiny, TrainConfig(epochs=2, batch_size=15, schedule=Schedule(initial=0.05),
                                                           seed=1, devices=("cpu:0",)))
    tiny_want, tiny_got = backend.export_weights(alone), replica.export_canonical()
    out = {"devices": backend.devices(), "moved": max(rel(want[n][p], start[n][p]) for n in want for p in want[n]),
           "strategy": [d.rsplit("/", 1)[-1] for d in make_strategy(["cpu:0", "cpu:2"]).extended.worker_devices],
           "tiny": {"copies_differ": copies_differ, "images": [r.train_images for r in tiny_reports],
                    "worst": max(rel(tiny_got[n][p], tiny_want[n][p]) for n in tiny_want for p in tiny_want[n]),
                    "loss": [r.loss for r in tiny_reports], "one_loss": [r.loss for r in alone_reports]}}
    for key, (reports, got, device) in runs.items():
        errs = {f"{n}/{p}": rel(got[n][p], want[n][p]) for n in want for p in want[n]}
        out[key] = {"worst": max(errs.values()), "worst_at": max(errs, key=errs.get), "model_device": device,
                    "images": [r.train_images for r in reports], "val_images": [r.val_images for r in reports],
                    "loss": [r.loss for r in reports], "val_loss": [r.val_loss for r in reports],
                    "one_loss": [r.loss for r in one_reports], "one_val": [r.val_loss for r in one_reports]}
    print(json.dumps(out))
"""


@pytest.fixture(scope="module", autouse=True)
def three_devices(request):
    """The three-device subprocess (AIPERF_CPU_DEVICES is read when TensorFlow's runtime starts), started with
    the module's first test when its test is selected, so that the in-process tests run beside it (one more
    process); its test waits for it."""
    yield from beside(request, "test_devices_subsets_and_data_parallel_equal_one_device",
                      _run, DEVICES_SCRIPT, dict(os.environ), AIPERF_CPU_DEVICES="3")


@pytest.mark.slow
def test_devices_subsets_and_data_parallel_equal_one_device(three_devices):
    r = three_devices.result()
    assert r["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert r["strategy"] == ["device:CPU:0", "device:CPU:2"]  # MirroredStrategy over exactly those
    assert r["moved"] > 1e-3  # training did change the weights
    assert r["('cpu:1',)"]["worst"] == 0.0  # the same single-device computation on another logical CPU
    tiny = r["tiny"]  # 16 images in batches of 15 on three replicas: the last batch has one image
    assert tiny["images"] == [16, 16] and tiny["copies_differ"] == 0.0 and tiny["worst"] < TOL
    np.testing.assert_allclose(tiny["loss"], tiny["one_loss"], rtol=1e-5)
    for key in ("('cpu:0',)", "('cpu:1',)", "('cpu:0', 'cpu:2')", "None"):
        run = r[key]
        assert run["model_device"] == "cpu:0"  # the caller's model stays where it was lowered
        assert run["images"] == [40, 40] and run["val_images"] == [12, 12]
        assert run["worst"] < TOL, f"{key} vs one device: {run['worst']:.3g} at {run['worst_at']}"
        np.testing.assert_allclose(run["loss"], run["one_loss"], rtol=1e-5)
        np.testing.assert_allclose(run["val_loss"], run["one_val"], rtol=1e-5)


def test_native_counter_counts_conv_and_dense():
    import aiperf_opcount as opcount

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
