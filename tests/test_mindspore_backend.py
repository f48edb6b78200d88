"""The MindSpore backend beyond the conformance kit: lazy import, precisions, exact image counts
and live progress, early stopping, an unchanged model after loss_and_grads, the mixed-precision
path, uint8 pixels normalised on the device, synthetic data made on the device, and data
parallelism over two CPU workers (MindSpore's MCCL, AIPERF_CPU_DEVICES=2) equal to one process, and
MindSpore's oneDNN never running a convolution with its reference kernel (onednn.py's cap on AVX-512).
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

ROOT = Path(__file__).resolve().parents[1]


def test_import_without_using_mindspore():
    # Importing the package must not import mindspore (listing backends never fails on a missing framework).
    code = "import sys, aiperf_backends.mindspore; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


import mindspore  # noqa: E402,F401  (`make test` installs mindspore: missing it is a failure, never a skip)

from aiperf_core.backend import BackendError, Dataset, Schedule, StepClock, TrainConfig  # noqa: E402
from aiperf_core.builders import resnet_small  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402
from aiperf_backends.mindspore import MindSporeBackend  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from beside import beside


def _data(graph, n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n,) + graph.input_shape).astype(np.float32)
    return x, rng.integers(0, graph.output_shape[0], n)


def test_availability_and_precisions_on_cpu():
    assert MindSporeBackend.availability().available
    from aiperf_core.backend import cpu_runs_natively

    backend = MindSporeBackend()
    assert backend.devices() == ["cpu"]
    # MindSpore 2.10's CPU Conv2D has no bfloat16 kernel; fp16 only where the CPU computes in it natively.
    native_fp16 = cpu_runs_natively("fp16")
    assert backend.precisions() == (("fp32", "fp16") if native_fp16 else ("fp32",))
    graph = resnet_small((8, 8, 3), 3)
    for precision in {"fp16", "bf16"} - set(backend.precisions()):
        with pytest.raises(BackendError, match=f"cannot run precision '{precision}'"):
            backend.lower(graph, precision=precision)
    with pytest.raises(BackendError, match="unknown precision"):
        backend.lower(graph, precision="int8")


def test_train_counts_images_exactly_with_a_short_last_batch(monkeypatch):
    counted, real_count = [], StepClock.count
    monkeypatch.setattr(StepClock, "count", lambda self, images: (counted.append(images), real_count(self, images)))
    backend = MindSporeBackend()
    graph = resnet_small((8, 8, 3), 3)
    x, y = _data(graph, 23, 0)
    model = backend.lower(graph)
    reports = backend.train(model, Dataset(x, y, x[:5], y[:5], 3),
                            TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.01)))
    assert [r.train_images for r in reports] == [23, 23]
    assert [r.val_images for r in reports] == [5, 5]
    assert all(np.isfinite(r.loss) and np.isfinite(r.val_loss) for r in reports)
    assert counted == [8, 8, 7, 8, 8, 7]  # live progress: each step's images
    assert [r.compile_seconds for r in reports] == [0.0, 0.0]  # PyNative on a CPU compiles no step


def test_on_epoch_returning_true_stops_training():
    backend = MindSporeBackend()
    graph = resnet_small((8, 8, 3), 3)
    x, y = _data(graph, 12, 1)
    seen = []
    reports = backend.train(backend.lower(graph), Dataset(x, y, x, y, 3),
                            TrainConfig(epochs=5, batch_size=4, schedule=Schedule(initial=0.01)),
                            on_epoch=lambda r: seen.append(r.epoch) or r.epoch == 1)
    assert seen == [0, 1] and len(reports) == 2


def test_learning_rate_changes_take_effect_between_steps():
    # The schedule sets a new rate each epoch; the optimizer must use it, not the rate it first ran with.
    from aiperf_backends.mindspore.training import Stepper

    backend = MindSporeBackend()
    graph = resnet_small((8, 8, 3), 3)
    model = backend.lower(graph)
    model.set_train(True)
    stepper = Stepper(model, TrainConfig(epochs=2, batch_size=2, schedule=Schedule(initial=0.1)))
    from aiperf_backends.mindspore.training import targets

    x, y = _data(graph, 2, 3)
    stepper.step(x, targets(y, 3, 0.0), 2)
    before = backend.export_weights(model)
    stepper.set_lr(0.0)
    stepper.step(x, targets(y, 3, 0.0), 2)
    after = backend.export_weights(model)
    assert all(np.array_equal(after[n]["kernel"], before[n]["kernel"]) for n in before if "kernel" in before[n])


def test_loss_and_grads_leaves_the_model_unchanged():
    backend = MindSporeBackend()
    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 1)
    model = backend.lower(graph, weights)
    x, y = _data(graph, 4, 1)
    backend.loss_and_grads(model, x, y)
    after = backend.export_weights(model)
    assert all(np.array_equal(after[n][p], weights[n][p]) for n in weights for p in weights[n])


def test_single_value_batch_norm_trains_as_the_reference():
    # One image of a flat input: one value per channel, where MindSpore's fused kernel divides by zero.
    import aiperf_numpy

    graph = Graph([Node("x", "input", (), {"shape": [4]}), Node("bn", "batch_norm", ("x",), {"epsilon": 1e-3}),
                   Node("d", "dense", ("bn",), {"units": 3}), Node("p", "softmax", ("d",), {})])
    weights = trained_looking_weights(graph, 2)
    x = np.random.default_rng(2).normal(0, 1, (1, 4)).astype(np.float32)
    loss, grads = MindSporeBackend().loss_and_grads(MindSporeBackend().lower(graph, weights), x, np.array([1]))
    ref_loss, ref_grads, moving = aiperf_numpy.loss_and_grads(graph, weights, x, np.array([1]))
    assert abs(loss - ref_loss) < 1e-5
    np.testing.assert_allclose(grads["d"]["kernel"], ref_grads["d"]["kernel"], atol=1e-5)
    model = MindSporeBackend().lower(graph, weights)
    MindSporeBackend().train(model, Dataset(x, np.array([1]), x, np.array([1]), 3),
                             TrainConfig(epochs=1, batch_size=1, schedule=Schedule(initial=0.0)))
    trained = MindSporeBackend().export_weights(model)["bn"]
    np.testing.assert_allclose(trained["moving_variance"], moving["bn"]["moving_variance"], rtol=1e-6)
    np.testing.assert_allclose(trained["moving_mean"], moving["bn"]["moving_mean"], rtol=1e-6, atol=1e-7)


def test_half_precision_path_runs_close_to_fp32():
    # fp16 is not declared on this CPU (emulated); its lowering is exercised directly.
    from aiperf_backends.mindspore.lowering import lower_graph
    from aiperf_backends.mindspore.training import predict

    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 2)
    x, _ = _data(graph, 4, 2)
    full = predict(lower_graph(graph, weights, "fp32"), x)
    half = predict(lower_graph(graph, weights, "fp16"), x)
    assert half.dtype == np.float32 and np.all(np.isfinite(half))
    assert np.max(np.abs(half - full)) < 0.05


def test_uint8_pixels_are_normalised_on_the_device_as_on_the_host():
    from aiperf_core.data.preprocess import normalise
    from aiperf_backends.mindspore.training import Stepper, targets

    backend = MindSporeBackend()
    graph = resnet_small((8, 8, 3), 3)
    model = backend.lower(graph, trained_looking_weights(graph, 4))
    pixels = np.random.default_rng(4).integers(0, 256, (3, 8, 8, 3), dtype=np.uint8)
    host = normalise(pixels)
    on_device = model.to_cell_layout(pixels).asnumpy()
    np.testing.assert_allclose(on_device, model.to_cell_layout(host).asnumpy(), rtol=1e-6, atol=1e-6)
    # a training step on the pixels is the step on the host-normalised floats
    losses = []
    for x in (pixels, host):
        model = backend.lower(graph, trained_looking_weights(graph, 4))
        model.set_train(True)
        losses.append(Stepper(model, TrainConfig(epochs=1, batch_size=3)).step(x, targets(np.array([0, 1, 2]), 3, 0.0), 3))
        model.set_train(False)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_synthetic_data_is_made_on_the_device(monkeypatch):
    from aiperf_core.data.stream import StreamingDataset, train_batches, val_batches
    from aiperf_core.data.synthetic import SyntheticSource
    from aiperf_backends.mindspore.training import PREDICT_BATCH, DeviceSynthetic

    data = StreamingDataset(SyntheticSource(classes=3, train_images=75, val_images=5, seed=2), image_size=8,
                            workers=0)
    feed = DeviceSynthetic(data, 3, 0.1, 16)
    device = list(feed.train(16))
    host = list(train_batches(data, 0, 0, 16))
    assert [len(x) for x, _ in device] == [len(b.y) for b in host] == [16] * 4 + [11]
    for (pixels, target), batch in zip(device, host):
        assert np.array_equal(pixels.asnumpy(), batch.x)
        np.testing.assert_array_equal(target.asnumpy().argmax(axis=1), batch.y)
    ((pixels, labels, skipped),) = feed.val()
    (batch,) = val_batches(data, PREDICT_BATCH)
    assert np.array_equal(pixels.asnumpy(), batch.x) and np.array_equal(labels, batch.y) and skipped == 0
    # Training never reads the host stream: the pool went to the device once.
    for method in ("iterate", "load"):
        monkeypatch.setattr(StreamingDataset, method, lambda *a, **k: pytest.fail("host work per batch"))
    backend = MindSporeBackend()
    reports = backend.train(backend.lower(resnet_small((8, 8, 3), 3)), data,
                            TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.01)))
    assert [(r.train_images, r.val_images, r.skipped_images) for r in reports] == [(75, 5, 0)]
    assert np.isfinite(reports[0].loss)


def test_cpu_devices_variable_is_checked(monkeypatch):
    from aiperf_backends.mindspore.backend import requested_cpu_devices

    for bad, message in (("two", "whole number"), ("-1", ">= 1")):
        monkeypatch.setenv("AIPERF_CPU_DEVICES", bad)
        with pytest.raises(BackendError, match=f"AIPERF_CPU_DEVICES must be .*{message}"):
            requested_cpu_devices()
    monkeypatch.setenv("AIPERF_CPU_DEVICES", "3")
    assert requested_cpu_devices() == 3


_DP_SCRIPT = """
    import json
    import numpy as np
    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.builders import resnet_small
    from aiperf_backends.mindspore import MindSporeBackend
    from aiperf_conformance.cases import trained_looking_weights

    backend = MindSporeBackend()
    devices = backend.devices()
    graph = resnet_small((8, 8, 3), 5)
    weights = trained_looking_weights(graph, 3)
    # 17 images in batches of 8: two batches split 4 + 4, then a short one of 1, which each worker
    # computes whole.
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (17,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 17)
    data = Dataset(x, y, x[:7], y[:7], 5)
    runs = {}
    for name, chosen in (("one", ("cpu:1",)), ("two", None)):  # None: every device
        config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.05), label_smoothing=0.1,
                             devices=chosen)
        model = backend.lower(graph, weights)
        runs[name] = (backend.export_weights(model), backend.train(model, data, config), backend.export_weights(model))
    a, b = runs["two"][2], runs["one"][2]
    worst = max(float(np.max(np.abs(a[n][p] - b[n][p])) / max(np.max(np.abs(b[n][p])), 1e-12)) for n in b for p in b[n])
    print(json.dumps({"devices": devices, "worst": worst,
                      **{f"{k}_{f}": [getattr(r, f) for r in v[1]] for k, v in runs.items()
                         for f in ("train_images", "loss", "val_accuracy")}}))
"""


def _run_data_parallel(environ: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in environ.items() if k != "AIPERF_CPU_DEVICES"}
    env["AIPERF_CPU_DEVICES"] = "2"  # read once, when the backend first loads MindSpore: a fresh process
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_DP_SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.fixture(scope="module", autouse=True)
def data_parallel(request):
    """The data-parallel subprocess, started with the module's first test when its test is selected, so that
    the in-process tests run beside it (its cluster's processes mostly wait); its test waits for it."""
    yield from beside(request, "test_data_parallel_two_cpu_workers_matches_one_process",
                      _run_data_parallel, dict(os.environ))


@pytest.mark.slow
def test_data_parallel_two_cpu_workers_matches_one_process(data_parallel):
    out = data_parallel.result()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == ["cpu:0", "cpu:1"]
    assert result["two_train_images"] == result["one_train_images"] == [17, 17]
    # Both runs are float32; they differ only in summation order (per-rank partial sums).
    assert result["worst"] < 1e-4, result["worst"]
    np.testing.assert_allclose(result["two_loss"], result["one_loss"], rtol=1e-5)
    np.testing.assert_allclose(result["two_val_accuracy"], result["one_val_accuracy"])


_ONEDNN_SCRIPT = """
import numpy as np
from aiperf_core.builders import resnet_small
from aiperf_backends.mindspore import MindSporeBackend
from aiperf_backends.mindspore import onednn

backend = MindSporeBackend()
graph = resnet_small((16, 16, 3), 3)
model = backend.lower(graph)
x = np.random.default_rng(0).normal(0, 1, (2, 16, 16, 3)).astype(np.float32)
backend.predict(model, x)
backend.loss_and_grads(model, x, np.array([0, 2]), 0.0)
print("capped", onednn.capped, flush=True)
"""


def _onednn_run(**environ) -> tuple[bool, list[str]]:
    """(whether the backend capped MindSpore's oneDNN, the convolutions oneDNN ran) for a forward and a
    backward of a small ResNet in a fresh process with ONEDNN_VERBOSE on."""
    env = {**os.environ, "ONEDNN_VERBOSE": "1", **environ}
    out = subprocess.run([sys.executable, "-c", _ONEDNN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    convs = [line for line in out.stdout.splitlines() if line.startswith("onednn_verbose") and ",exec," in line
             and ",convolution," in line]
    (capped,) = [line.split()[1] == "True" for line in out.stdout.splitlines() if line.startswith("capped ")]
    return capped, convs


def test_mindspore_convolutions_never_run_onednn_reference_kernel():
    # MindSpore 2.10's oneDNN runs an NCHW conv with its reference kernel on any AVX-512 CPU, 74 times
    # slower than the gemm kernel it picks at AVX2 (backends/mindspore/onednn.py).
    from aiperf_core.backend import cpu_flags

    capped, convs = _onednn_run()
    assert capped == ("avx512f" in cpu_flags())
    directions = {line.split(",")[7] for line in convs}
    assert directions == {"forward_training", "backward_data", "backward_weights"}, directions
    assert convs and not [line for line in convs if "ref:" in line], convs[:3]


def test_a_users_onednn_isa_is_left_to_onednn():
    capped, convs = _onednn_run(ONEDNN_MAX_CPU_ISA="AVX2")
    assert not capped and convs and not [line for line in convs if "ref:" in line]
