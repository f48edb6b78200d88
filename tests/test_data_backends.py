"""Every backend trains on streamed data (an ImageFolder and a TFRecord tree built from the digits,
with a corrupt image planted): images are counted exactly, the corrupt one is skipped and counted,
and the in-memory path is untouched. numpy, jax and torch read the same batches (the shared
preprocessing), so their first-epoch losses agree; TensorFlow augments natively in tf.data."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from aiperf_core.backend import EpochReport, Schedule, TrainConfig
from aiperf_core.builders import resnet_small
from aiperf_core.data import load_dataset, tfrecord
from aiperf_core.data.samples import digits_tree
from aiperf_core.data.tools import convert
from aiperf_core.errors import AiperfError
from aiperf_core.registry import load_backend

SIZE, CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 16, 10, 6, 2
TRAIN_IMAGES = CLASSES * TRAIN_PER_CLASS  # plus one corrupt file
CONFIG = TrainConfig(epochs=2, batch_size=16, schedule=Schedule(initial=0.05), seed=3)


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIPERF_DATA_CACHE", str(tmp_path_factory.mktemp("cache")))
        root = tmp_path_factory.mktemp("streamed")
        folder = digits_tree(root / "folder", TRAIN_PER_CLASS, VAL_PER_CLASS, size=SIZE)
        (folder / "train" / "7" / "7_zz_corrupt.JPEG").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
        convert(folder, root / "shards", "tfrecord", workers=1, shard_size=25)  # the corrupt file is left out
        yield folder, root / "shards"


def streamed(path, workers=2):
    return load_dataset({"name": "imagenet", "path": str(path), "image_size": SIZE}, workers=workers)


def train(backend_name, data, config=CONFIG) -> list[EpochReport]:
    backend = load_backend(backend_name)
    model = backend.lower(resnet_small((SIZE, SIZE, 3), CLASSES))
    return backend.train(model, data, config)


def check_counts(reports, skipped, stored=TRAIN_IMAGES + 1):
    """Every epoch trained on every stored training image but the `skipped` corrupt ones."""
    assert len(reports) == CONFIG.epochs
    for r in reports:
        assert r.train_images == stored - skipped and r.val_images == CLASSES * VAL_PER_CLASS
        assert r.skipped_images == skipped
        assert math.isfinite(r.loss) and math.isfinite(r.val_loss) and 0 <= r.val_accuracy <= 1


@pytest.fixture(scope="module")
def numpy_reports(trees):
    return train("numpy", streamed(trees[0]))


def test_numpy_streams_and_counts_the_corrupt_image(numpy_reports):
    check_counts(numpy_reports, skipped=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend_name", ["jax", "torch"])
def test_backend_reads_the_same_batches_as_numpy(backend_name, trees, numpy_reports):
    reports = train(backend_name, streamed(trees[0]))
    check_counts(reports, skipped=1)
    assert reports[0].loss == pytest.approx(numpy_reports[0].loss, rel=2e-3)


def with_bad_checksum(shards, tmp_path):
    """A copy of the TFRecord tree with one byte of one record flipped."""
    copy = tmp_path / "bad_shards"
    shutil.copytree(shards, copy)
    shard = copy / "train-00001-of-00003"
    with open(shard, "rb") as fh:
        offset, data = next(tfrecord.scan(fh, str(shard)))  # the first record's data
    raw = bytearray(shard.read_bytes())
    raw[offset + len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(raw))
    return copy


@pytest.mark.parametrize("layout", ["imagefolder", "tfrecord"])
def test_tensorflow_streams_through_tf_data(layout, trees, tmp_path, monkeypatch):
    monkeypatch.setenv("AIPERF_DATA_CACHE", str(tmp_path / "cache"))
    path = trees[0] if layout == "imagefolder" else with_bad_checksum(trees[1], tmp_path)
    # The folder holds the planted corrupt file; the shards do not (the conversion left it out),
    # but one of their records has a bad checksum.
    stored = TRAIN_IMAGES + 1 if layout == "imagefolder" else TRAIN_IMAGES
    check_counts(train("tensorflow", streamed(path)), skipped=1, stored=stored)


@pytest.mark.slow
def test_torch_data_parallel_shards_streamed_batches(trees):
    """Two gloo ranks each decode their own shard of every batch; the epoch equals one process's."""
    from aiperf_backends.torch.distributed import train_data_parallel

    backend = load_backend("torch")
    graph = resnet_small((SIZE, SIZE, 3), CLASSES)
    config = TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.05), seed=3)
    single = backend.train(backend.lower(graph), streamed(trees[1], workers=0), config)
    parallel = train_data_parallel(backend.lower(graph), streamed(trees[1], workers=2), config, ["cpu", "cpu"])
    assert parallel[0].train_images == single[0].train_images == TRAIN_IMAGES
    assert parallel[0].val_images == CLASSES * VAL_PER_CLASS and parallel[0].skipped_images == 0
    assert parallel[0].loss == pytest.approx(single[0].loss, rel=1e-4)


def test_wrong_resolution_or_classes_is_refused_before_training(trees):
    backend = load_backend("numpy")
    model = backend.lower(resnet_small((32, 32, 3), CLASSES))
    with pytest.raises(AiperfError, match="shape"):
        backend.train(model, streamed(trees[0]), CONFIG)
    model = backend.lower(resnet_small((SIZE, SIZE, 3), 5))
    with pytest.raises(AiperfError, match="10 classes"):
        backend.train(model, streamed(trees[0]), CONFIG)


def test_synthetic_data_trains(trees):
    data = load_dataset({"name": "synthetic", "classes": CLASSES, "train_images": 20, "val_images": 8,
                         "image_size": SIZE}, workers=1)
    reports = train("numpy", data, TrainConfig(epochs=1, batch_size=8, seed=0))
    assert reports[0].train_images == 20 and reports[0].val_images == 8 and reports[0].skipped_images == 0
    assert np.isfinite(reports[0].loss)


TF_PARALLEL_SCRIPT = """
import json, sys
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from aiperf_core.backend import Schedule, TrainConfig
from aiperf_core.builders import resnet_one_block
from aiperf_core.data import load_dataset
from aiperf_backends.tensorflow import TensorFlowBackend
from aiperf_backends.tensorflow.training import Trainer, run_epochs

path, size, classes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = load_dataset({"name": "imagenet", "path": path, "image_size": size}, workers=2)
config = TrainConfig(epochs=1, batch_size=15, schedule=Schedule(initial=0.05), seed=3)
backend = TensorFlowBackend()
graph = resnet_one_block((size, size, 3), classes)  # the sharding is what is checked: one block is enough
parallel = backend.train(backend.lower(graph), data, config)               # MirroredStrategy, 2 CPUs
single = run_epochs(Trainer(backend.lower(graph), config), data, config)   # one device
print("RESULT " + json.dumps({"devices": backend.devices(), "parallel": [r.__dict__ for r in parallel],
                              "single": [r.__dict__ for r in single]}))
"""


def _run_tf_parallel(environ: dict, shards: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = {**environ, "AIPERF_DATA_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(root),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.run([sys.executable, "-c", TF_PARALLEL_SCRIPT, str(shards), str(SIZE), str(CLASSES)],
                          capture_output=True, text=True, env=env, cwd=root, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def tf_parallel(request, tmp_path_factory):
    """The MirroredStrategy subprocess (two logical CPUs need a fresh TensorFlow), started with the module's
    first test, once the trees are built, when its test is selected: the in-process tests run beside it (one
    more process); its test waits for it."""
    test = "test_tensorflow_mirrored_strategy_shards_tf_data_batches"
    if not any(item.module is request.module and item.originalname == test for item in request.session.items):
        yield None
        return
    tmp_path = tmp_path_factory.mktemp("tf_parallel")
    shards = with_bad_checksum(request.getfixturevalue("trees")[1], tmp_path)
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_run_tf_parallel, dict(os.environ), shards, tmp_path)


@pytest.mark.slow
def test_tensorflow_mirrored_strategy_shards_tf_data_batches(tf_parallel):
    """tf.data batches (tensors) are cut into one shard per replica; the epoch equals one device's."""
    out = tf_parallel.result()
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, out.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert len(result["devices"]) == 2
    parallel, single = result["parallel"][0], result["single"][0]
    assert parallel["train_images"] == single["train_images"] == TRAIN_IMAGES - 1
    assert parallel["skipped_images"] == single["skipped_images"] == 1
    assert parallel["loss"] == pytest.approx(single["loss"], rel=1e-4)
