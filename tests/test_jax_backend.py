"""The JAX backend beyond the conformance kit: lazy import, precisions, exact image counts, the
native counter's convention, and data parallelism over two (host) devices equal to one device.

The data-parallel test runs in a subprocess because XLA_FLAGS=--xla_force_host_platform_device_count=2
must be set before jax is first imported.
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


def test_import_without_using_jax():
    # Importing the package must not import jax (listing backends never fails on a missing framework).
    code = "import sys, aiperf_backends.jax; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


import jax  # noqa: E402,F401  (`make test` installs jax: missing it is a failure, never a skip)

from aiperf_core.backend import BackendError, Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import resnet_small  # noqa: E402
from aiperf_backends.jax import JaxBackend  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402


def test_availability_and_precisions():
    assert JaxBackend.availability().available
    backend = JaxBackend()
    assert "fp32" in backend.precisions()
    assert "fp16" not in backend.precisions()
    graph = resnet_small((8, 8, 3), 3)
    with pytest.raises(BackendError):
        backend.lower(graph, precision="fp16")
    with pytest.raises(BackendError):
        backend.lower(graph, precision="int8")


def test_train_counts_images_exactly_with_a_short_last_batch():
    backend = JaxBackend()
    graph = resnet_small((8, 8, 3), 3)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (23,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 3, 23)
    model = backend.lower(graph)
    reports = backend.train(model, Dataset(x, y, x[:5], y[:5], 3),
                            TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.01)))
    assert [r.train_images for r in reports] == [23, 23]
    assert [r.val_images for r in reports] == [5, 5]
    assert all(np.isfinite(r.loss) for r in reports)


def test_counter_is_valid_convention():
    import aiperf_opcount as opcount
    from aiperf_conformance.levels.count import analytic_by_category

    backend = JaxBackend()
    counter = backend.native_counter()
    assert counter.convention.padding == "valid" and counter.convention.mac_ops == 2
    graph = resnet_small((16, 16, 3), 5)
    model = backend.lower(graph)
    for backward in (False, True):
        native = counter.count(model, 3, backward)
        analytic = analytic_by_category(graph, "valid", backward, False)
        assert native["conv"] == 3 * analytic["conv"]
        assert native["dense"] == 3 * analytic["dense"]
    # and 'valid' really differs from 'paper' on this graph (padded convs), so the test means something
    assert opcount.count(graph, "paper").fp != opcount.count(graph, "valid").fp


_DP_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import jax
    from aiperf_core.backend import Dataset, Schedule, TrainConfig
    from aiperf_core.builders import resnet_small
    from aiperf_backends.jax import JaxBackend
    from aiperf_backends.jax.distributed import make_mesh, place_batch
    from aiperf_backends.jax.training import run_epochs
    from aiperf_conformance.cases import trained_looking_weights

    assert jax.device_count() == 2, jax.devices()
    backend = JaxBackend()
    assert len(backend.devices()) == 2
    graph = resnet_small((16, 16, 3), 5)
    weights = trained_looking_weights(graph, 3)
    rng = np.random.default_rng(5)
    # 41 images in batches of 16: two batches sharded 8 + 8, then a short one of 9 (replicated).
    x = rng.normal(0, 1, (41,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 41)
    data = Dataset(x, y, x[:7], y[:7], 5)
    config = TrainConfig(epochs=2, batch_size=16, schedule=Schedule(initial=0.05), momentum=0.9,
                         label_smoothing=0.1)
    results = {}
    mesh = make_mesh()
    xb, _ = place_batch(mesh, x[:16], y[:16])
    assert not xb.sharding.is_fully_replicated and len(xb.sharding.device_set) == 2, xb.sharding
    # One device: the epoch loop without a mesh. Two devices: backend.train, which shards the batch.
    model = backend.lower(graph, weights)
    results["one"] = (model, run_epochs(model, data, config, None))
    model = backend.lower(graph, weights)
    results["two"] = (model, backend.train(model, data, config))
    leaf = jax.tree_util.tree_leaves(model.params)[0]
    assert len(leaf.sharding.device_set) == 2, leaf.sharding
    one, two = results["one"][0].export_canonical(), results["two"][0].export_canonical()
    worst = 0.0
    for n in one:
        for p in one[n]:
            a, b = np.asarray(two[n][p], np.float64), np.asarray(one[n][p], np.float64)
            worst = max(worst, float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)))
    losses = [[r.loss for r in results[k][1]] for k in ("one", "two")]
    print(json.dumps({"worst": worst, "losses": losses,
                      "images": [[r.train_images for r in results[k][1]] for k in ("one", "two")]}))
""")


def test_data_parallel_two_host_devices_matches_one_device():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-c", _DP_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["images"] == [[41, 41], [41, 41]]
    # Both runs are float32; they differ only in summation order (per-device partial sums).
    assert result["worst"] < 2e-5, result
    np.testing.assert_allclose(result["losses"][0], result["losses"][1], rtol=1e-5)


def test_loss_and_grads_leaves_the_model_unchanged():
    backend = JaxBackend()
    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 1)
    model = backend.lower(graph, weights)
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (4,) + graph.input_shape).astype(np.float32)
    backend.loss_and_grads(model, x, rng.integers(0, 3, 4))
    after = backend.export_weights(model)
    assert all(np.array_equal(after[n][p], weights[n][p]) for n in weights for p in weights[n])


def test_bf16_mixed_precision_path_runs_close_to_fp32():
    # bf16 is declared only on GPUs/TPUs; its lowering is exercised here directly (XLA CPU emulates it).
    from aiperf_backends.jax.lowering import lower_graph
    from aiperf_backends.jax.training import predict

    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 2)
    x = np.random.default_rng(2).normal(0, 1, (4,) + graph.input_shape).astype(np.float32)
    full = predict(lower_graph(graph, weights, "fp32"), x)
    half = predict(lower_graph(graph, weights, "bf16"), x)
    assert half.dtype == np.float32 and np.all(np.isfinite(half))
    assert np.max(np.abs(half - full)) < 0.05
