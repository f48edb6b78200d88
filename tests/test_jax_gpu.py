"""The JAX backend on a CUDA GPU (`make test-gpu`; deselected by `make test`): what the CPU tests can
only check in part. Each test names the item of docs/backends/jax.md's "Unverified on a GPU" it
checks. Without a GPU visible to jax every test fails: the GPU tier must not pass having checked
nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax

from aiperf_backends.jax import JaxBackend, training
from aiperf_backends.jax.backend import cuda_compute_capability
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import resnet_small
from aiperf_core.ir import Graph

pytestmark = pytest.mark.gpu
SIZE, CLASSES = 32, 5


@pytest.fixture(scope="module")
def gpu():
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    assert gpus, f"no GPU visible to jax ({jax.local_devices()}): the jax GPU tests cannot run"
    return gpus[0]


def _wide_conv_error(backend, precision: str) -> float:
    """Relative error of a 1x1 conv over 512 channels against float64."""
    graph = Graph([{"id": "in", "op": "input", "attrs": {"shape": [8, 8, 512]}},
                   {"id": "c", "op": "conv2d", "inputs": ["in"], "attrs": {"filters": 512, "kernel": [1, 1]}}])
    model = backend.lower(graph, precision=precision)
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 512)).astype(np.float32)
    got = backend.predict(model, x)
    want = x.astype(np.float64) @ backend.export_weights(model)["c"]["kernel"][0, 0].astype(np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def test_fp32_is_ieee_and_tf32_runs_tf32_where_declared(gpu):
    """Items 1 and 2: fp32 within fp32 rounding of float64, even under a user's global TF32 choice;
    tf32 declared exactly on compute capability >= 8.0, and visibly coarser there."""
    backend = JaxBackend()
    capability = cuda_compute_capability(gpu)
    assert ("tf32" in backend.precisions()) == (capability is not None and capability >= 8.0), capability
    assert "bf16" in backend.precisions() and backend.fastest_precision() == "bf16"
    with jax.default_matmul_precision("tensorfloat32"):  # the user's choice, for their own code
        assert _wide_conv_error(backend, "fp32") < 1e-5  # TF32 would be ~1e-3
    if "tf32" in backend.precisions():
        assert 1e-5 < _wide_conv_error(backend, "tf32") < 1e-2  # 10-bit mantissa products


def test_counter_counts_on_a_gpu_machine(gpu):
    """Item 3: the native counter's counts, compiled on the CPU client, equal the analytic ones."""
    from aiperf_conformance.levels.count import analytic_by_category

    backend = JaxBackend()
    graph = resnet_small((16, 16, 3), 5)
    model = backend.lower(graph)
    assert jax.tree_util.tree_leaves(model.params)[0].devices() == {gpu}
    for backward in (False, True):
        native = backend.native_counter().count(model, 3, backward)
        analytic = analytic_by_category(graph, "valid", backward, False)
        assert native["conv"] == 3 * analytic["conv"] and native["dense"] == 3 * analytic["dense"]


def test_training_on_the_gpu_with_synthetic_data_on_the_device(gpu, monkeypatch):
    """Items 4 and 5: the model, its batches, its evaluation and predict on the GPU named by
    TrainConfig.devices; synthetic data made there once; the step compiled in the first epoch only."""
    from aiperf_core.data.stream import StreamingDataset
    from aiperf_core.data.synthetic import SyntheticSource

    backend = JaxBackend()
    graph = resnet_small((SIZE, SIZE, 3), CLASSES)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (70, SIZE, SIZE, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, 70)
    model = backend.lower(graph)
    config = TrainConfig(epochs=2, batch_size=16, schedule=Schedule(initial=0.05), devices=(f"gpu:{gpu.id}",))
    reports = backend.train(model, Dataset(x, y, x[:20], y[:20], CLASSES), config)
    assert [r.train_images for r in reports] == [70, 70]
    assert reports[0].compile_seconds > 0 and reports[1].compile_seconds == 0.0
    assert jax.tree_util.tree_leaves(model.params)[0].devices() == {gpu}
    assert backend.predict(model, x[:3]).shape == (3, CLASSES)

    data = StreamingDataset(SyntheticSource(classes=CLASSES, train_images=100, val_images=10), image_size=SIZE,
                            workers=0)
    for method in ("iterate", "load"):
        monkeypatch.setattr(StreamingDataset, method, lambda *a, **k: pytest.fail("host work per batch"))
    reports = backend.train(backend.lower(graph), data, config)
    assert [(r.train_images, r.val_images) for r in reports] == [(100, 10), (100, 10)]
    assert all(np.isfinite(r.loss) for r in reports)
    assert training.SLICERS  # the windows were sliced on the device
