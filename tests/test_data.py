"""Datasets: TFRecord framing and Example encoding, the two ImageNet layouts built from real packaged
images (scikit-learn's digits and sample photos), preprocessing, sharding, bad data and the CLI."""

import json
import os
import random
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from aiperf_core.backend import Dataset
from aiperf_core.cli import main
from aiperf_core.data import describe, load_dataset
from aiperf_core.data import tfrecord
from aiperf_core.data.crc32c import NATIVE_CRC32C, TABLE, crc32c, masked_crc32c, numpy_crc32c
from aiperf_core.data.imagenet import open_imagenet
from aiperf_core.data.preprocess import (INV_STD, MEAN, CorruptImage, augmentation_rng, model_input, normalise,
                                        random_crop_box, train_image, val_image)
from aiperf_core.data.samples import digits_tree, photo_tree
from aiperf_core.data.stream import shard
from aiperf_core.data.tools import check, convert
from aiperf_core.errors import AiperfError

TRAIN_PER_CLASS, VAL_PER_CLASS, CLASSES = 8, 2, 10


@pytest.fixture(scope="module", autouse=True)
def index_cache(tmp_path_factory):
    """TFRecord indexes go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIPERF_DATA_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The digits as an ImageFolder tree and, converted, as TFRecord shards."""
    root = tmp_path_factory.mktemp("trees")
    folder = digits_tree(root / "folder", TRAIN_PER_CLASS, VAL_PER_CLASS)
    convert(folder, root / "tfrecord", "tfrecord", workers=2, shard_size=30)
    return folder, root / "tfrecord"


def copy_tree(src, dst):
    shutil.copytree(src, dst)
    return dst


def slow_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = int(TABLE[(crc ^ byte) & 0xFF]) ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# -- TFRecord ---------------------------------------------------------------------------------


def test_crc32c_known_value_and_every_length_shape():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0
    rng = random.Random(0)
    for n in (1, 2, 31, 32, 33, 64, 65, 1000, 4097, 70001):
        data = rng.randbytes(n)
        assert crc32c(data) == numpy_crc32c(data) == slow_crc32c(data), n
    assert numpy_crc32c(b"123456789") == 0xE3069283 and numpy_crc32c(b"") == 0


def test_the_native_crc32c_is_installed():
    # make test installs google-crc32c, whose C code keeps TFRecord checksums off the GIL's hot path.
    assert NATIVE_CRC32C is not None


def test_record_framing_round_trip_and_checksums(tmp_path):
    path = tmp_path / "records"
    payloads = [b"", b"a", os.urandom(5000)]
    path.write_bytes(b"".join(tfrecord.frame(p) for p in payloads))
    with open(path, "rb") as fh:
        assert [data for _, data in tfrecord.scan(fh, "x")] == payloads
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF  # inside the last record's data
    path.write_bytes(bytes(raw))
    with open(path, "rb") as fh, pytest.raises(tfrecord.CorruptRecord, match="bad data checksum"):
        list(tfrecord.scan(fh, "x"))
    head = tfrecord.frame(b"abc")
    assert int.from_bytes(head[8:12], "little") == masked_crc32c(head[:8])


def test_example_round_trip_and_negative_ints():
    features = {"image/encoded": [b"\xff\xd8jpeg"], "image/class/label": [1, 1000, -2],
                "image/class/synset": [b"n01440764"], "score": [0.5, -1.25]}
    assert tfrecord.decode_example(tfrecord.encode_example(features)) == features


# -- layouts ----------------------------------------------------------------------------------


def test_both_layouts_describe_the_same_dataset(trees):
    folder, shards = trees
    a = describe({"name": "imagenet", "path": str(folder), "image_size": 32})
    b = describe({"name": "imagenet", "path": str(shards), "image_size": 32})
    assert a["layout"] == "imagefolder" and b["layout"] == "tfrecord"
    for d in (a, b):
        assert d["name"] == "imagenet" and d["classes"] == CLASSES
        assert d["train_images"] == CLASSES * TRAIN_PER_CLASS and d["val_images"] == CLASSES * VAL_PER_CLASS
    assert sorted(os.listdir(shards)) == ["train-00000-of-00003", "train-00001-of-00003", "train-00002-of-00003",
                                          "validation-00000-of-00001"]


def test_both_layouts_give_identical_batches(trees):
    folder, shards = trees
    a = load_dataset({"name": "imagenet", "path": str(folder), "image_size": 32}, workers=2)
    b = load_dataset({"name": "imagenet", "path": str(shards), "image_size": 32}, workers=0)
    for split in ("train", "val"):
        for x, y in zip(a.iterate(split, 1, 5, 16), b.iterate(split, 1, 5, 16)):
            np.testing.assert_array_equal(x.x, y.x)
            np.testing.assert_array_equal(x.y, y.y)
            assert x.x.shape[1:] == (32, 32, 3)


def test_tfrecord_labels_are_one_based_with_synsets_and_convert_back(trees, tmp_path):
    folder, shards = trees
    with open(shards / "train-00000-of-00003", "rb") as fh:
        first = tfrecord.decode_example(next(tfrecord.scan(fh, "x"))[1])
    assert first["image/class/label"] == [1] and first["image/class/synset"] == [b"0"]
    back = convert(shards, tmp_path / "back", "imagefolder", workers=1)
    assert back["train"]["written"] == CLASSES * TRAIN_PER_CLASS
    assert sorted(os.listdir(tmp_path / "back" / "val" / "3")) == sorted(os.listdir(folder / "val" / "3"))


def test_tfrecord_with_label_only_orders_classes_numerically(tmp_path):
    images = [(int(label), tfrecord.encode_example({"image/encoded": [data], "image/class/label": [label]}))
              for label, data in [(10, b"x"), (2, b"y"), (1, b"z")]]
    for name in ("train-00000-of-00001", "validation-00000-of-00001"):
        (tmp_path / name).write_bytes(b"".join(tfrecord.frame(e) for _, e in images))
    source = open_imagenet(tmp_path)
    assert source.class_names == ("1", "2", "10")
    assert list(source.labels("train")) == [2, 1, 0]


def test_missing_empty_and_mismatched_splits_are_named(trees, tmp_path):
    folder, _ = trees
    no_val = copy_tree(folder, tmp_path / "no_val")
    shutil.rmtree(no_val / "val")
    with pytest.raises(AiperfError, match="split 'val' is missing"):
        describe({"name": "imagenet", "path": str(no_val)})
    empty = tmp_path / "empty"
    (empty / "train" / "a").mkdir(parents=True)
    (empty / "val" / "a").mkdir(parents=True)
    with pytest.raises(AiperfError, match="split 'train' is empty"):
        describe({"name": "imagenet", "path": str(empty)})
    odd = copy_tree(folder, tmp_path / "odd")
    (odd / "val" / "3").rename(odd / "val" / "three")
    with pytest.raises(AiperfError, match=r"only in train \(3\).*only in val \(three\)"):
        describe({"name": "imagenet", "path": str(odd)})
    with pytest.raises(AiperfError, match="no such dataset folder"):
        describe({"name": "imagenet", "path": str(tmp_path / "nowhere")})
    with pytest.raises(AiperfError, match="dataset.name"):
        load_dataset({"name": "cifar"})


def test_digits_stays_in_memory_float32_and_synthetic_is_imagenet_shaped():
    digits = load_dataset({"name": "digits"})
    assert isinstance(digits, Dataset) and digits.x_train.dtype == np.float32
    assert abs(float(digits.x_train.mean())) < 0.1  # normalised
    assert describe({"name": "digits"})["train_images"] + describe({"name": "digits"})["val_images"] == 1797
    synthetic = load_dataset({"name": "synthetic", "train_images": 10, "val_images": 4})
    assert synthetic.describe()["classes"] == 1000 and synthetic.image_shape == (224, 224, 3)
    batch = next(synthetic.iterate("train", 0, 0, 4))
    assert batch.x.shape == (4, 224, 224, 3) and batch.x.dtype == np.uint8 and batch.skipped == 0
    assert describe({"name": "synthetic"})["train_images"] == 1_281_167


# -- preprocessing ----------------------------------------------------------------------------


def test_preprocessing_shapes_determinism_and_normalisation(tmp_path):
    photos = photo_tree(tmp_path / "photos", 1, 1)
    data = (photos / "train" / "china" / "china_00000.JPEG").read_bytes()
    a = train_image(data, 64, augmentation_rng(0, 0, 7))
    b = train_image(data, 64, augmentation_rng(0, 0, 7))
    c = train_image(data, 64, augmentation_rng(0, 1, 7))
    assert a.shape == (64, 64, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    v = val_image(data, 224)
    assert v.shape == (224, 224, 3) and v.dtype == np.uint8
    assert np.all(np.abs(normalise(v).reshape(-1, 3).mean(0)) < 2.5)  # normalised per channel
    rng = np.random.default_rng(0)
    for _ in range(200):
        left, top, w, h = random_crop_box(500, 375, rng)
        assert 0 <= left and left + w <= 500 and 0 <= top and top + h <= 375
        assert 3 / 4 - 0.02 <= w / h <= 4 / 3 + 0.02 or (w, h) == (500, 375)


def test_validation_crop_is_central(tmp_path):
    from PIL import Image

    pixels = np.zeros((100, 200, 3), np.uint8)
    pixels[:, 100:] = 255  # left half black, right half white
    path = tmp_path / "halves.png"
    Image.fromarray(pixels).save(path)
    out = val_image(path.read_bytes(), 32)
    assert out[:, :15].max() < 128 and out[:, 17:].min() > 128  # the centre column splits the halves


def reference_normalise(pixels: np.ndarray) -> np.ndarray:
    """The textbook ImageNet normalisation in float64, with the constants written out."""
    mean = np.array([0.485, 0.456, 0.406]) * 255.0
    std = np.array([0.229, 0.224, 0.225]) * 255.0
    return (pixels.astype(np.float64) - mean) / std


def test_normalise_is_the_float32_arithmetic_every_backend_runs():
    rng = np.random.default_rng(1)
    batch = rng.integers(0, 256, (5, 7, 9, 3), dtype=np.uint8)
    expected = (batch.astype(np.float32) - MEAN) * INV_STD  # what a backend's step computes on its device
    got = normalise(batch)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(normalise(batch[2]), expected[2])
    np.testing.assert_allclose(got, reference_normalise(batch), rtol=0, atol=1e-6)
    out = np.empty(batch.shape, np.float32)
    assert normalise(batch, out) is out
    np.testing.assert_array_equal(model_input(batch), expected)
    arrays = expected.copy()
    assert model_input(arrays) is arrays  # in-memory float32 arrays are already normalised
    with pytest.raises(AiperfError, match="expected uint8"):
        normalise(expected)
    with pytest.raises(AiperfError, match="float64"):
        model_input(expected.astype(np.float64))


def float32_delivery(image: np.ndarray) -> np.ndarray:
    """How the pipeline delivered an image before batches became uint8: preprocess.normalise as it
    was, flat arithmetic against tiled float32 constants, on the host."""
    flat = np.subtract(image.reshape(-1), np.tile(MEAN, image.size // 3))
    flat *= np.tile(INV_STD, image.size // 3)
    return flat.reshape(image.shape)


def test_uint8_batches_normalised_equal_the_float32_delivery(trees):
    """The uint8 path, normalised (on any device: the same float32 arithmetic), gives the numbers of
    the float32 delivery it replaced, to 1e-6, for training and validation batches of both layouts."""
    for path in trees:
        data = load_dataset({"name": "imagenet", "path": str(path), "image_size": 32}, workers=2)
        for split, epoch in (("train", 3), ("val", 0)):
            batches = list(data.iterate(split, epoch, 5, 16))
            assert batches
            for batch in batches:
                assert batch.x.dtype == np.uint8 and batch.x.shape[1:] == (32, 32, 3)
                before = np.stack([float32_delivery(image) for image in batch.x])
                on_device = (batch.x.astype(np.float32) - MEAN) * INV_STD  # what each backend's step runs
                np.testing.assert_allclose(on_device, before, rtol=0, atol=1e-6)
                np.testing.assert_allclose(normalise(batch.x), before, rtol=0, atol=1e-6)
                np.testing.assert_allclose(reference_normalise(batch.x), before, rtol=0, atol=1e-6)
        data.close()


def test_corrupt_bytes_raise_corrupt_image():
    with pytest.raises(CorruptImage, match="not a readable image"):
        train_image(b"not an image", 32, augmentation_rng(0, 0, 0), "x.JPEG")


# -- epochs and sharding ----------------------------------------------------------------------


def test_epoch_covers_every_image_once_and_shards_partition_batches(trees):
    folder, _ = trees
    data = load_dataset({"name": "imagenet", "path": str(folder), "image_size": 16}, workers=0)
    plan = data.plan("train", 2, 9, 24)
    assert sorted(np.concatenate(plan).tolist()) == list(range(data.train_images))
    assert [len(b) for b in plan] == [24, 24, 24, 8]
    assert not np.array_equal(np.concatenate(plan), np.concatenate(data.plan("train", 3, 9, 24)))
    for world in (2, 3):
        seen = []
        for batch in data.iterate("train", 2, 9, 24, rank=0, world=world):
            assert batch.size in (24, 8)
        for rank in range(world):
            seen += [int(i) for b in plan for i in shard(b, rank, world)]
        assert sorted(seen) == list(range(data.train_images))
        ranks = [list(data.iterate("train", 2, 9, 24, rank=r, world=world)) for r in range(world)]
        whole = list(data.iterate("train", 2, 9, 24))
        for k, batch in enumerate(whole):
            np.testing.assert_array_equal(np.concatenate([r[k].x for r in ranks]), batch.x)


def test_corrupt_and_truncated_images_are_skipped_and_counted(trees, tmp_path):
    folder, _ = trees
    bad = copy_tree(folder, tmp_path / "bad")
    (bad / "train" / "3" / "zz_garbage.JPEG").write_bytes(b"this is not a jpeg")
    whole = (bad / "train" / "4" / "4_00000.JPEG").read_bytes()
    (bad / "train" / "4" / "4_00000.JPEG").write_bytes(whole[:len(whole) // 2])
    data = load_dataset({"name": "imagenet", "path": str(bad), "image_size": 32}, workers=2)
    assert data.train_images == CLASSES * TRAIN_PER_CLASS + 1
    batches = list(data.iterate("train", 0, 0, 16))
    assert sum(b.skipped for b in batches) == 2
    assert sum(len(b.y) for b in batches) == CLASSES * TRAIN_PER_CLASS - 1
    assert sum(b.size for b in batches) == data.train_images
    report = check(bad, workers=2)
    assert len(report.splits["train"].corrupt) == 2 and not report.ok
    assert any("zz_garbage.JPEG" in e for e in report.splits["train"].corrupt)


def test_tfrecord_checksum_error_skips_that_image(trees, tmp_path):
    _, shards = trees
    bad = copy_tree(shards, tmp_path / "bad")
    shard_path = bad / "train-00001-of-00003"
    with open(shard_path, "rb") as fh:
        offset, record = next(tfrecord.scan(fh, "x"))
    raw = bytearray(shard_path.read_bytes())
    raw[offset + len(record) // 2] ^= 0x55  # inside the first record's data
    shard_path.write_bytes(bytes(raw))
    data = load_dataset({"name": "imagenet", "path": str(bad), "image_size": 32}, workers=0)
    batches = list(data.iterate("train", 0, 0, 32))
    assert sum(b.skipped for b in batches) == 1
    assert sum(len(b.y) for b in batches) == CLASSES * TRAIN_PER_CLASS - 1


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_check_and_convert(trees, tmp_path, capsys):
    folder, _ = trees
    assert main(["data", "check", str(folder), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["splits"]["train"]["images"] == 80 and out["classes"] == CLASSES
    bad = copy_tree(folder, tmp_path / "bad")
    (bad / "val" / "2" / "broken.JPEG").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    (bad / "val" / "extra").mkdir()
    (bad / "val" / "extra" / "x.JPEG").write_bytes((folder / "val" / "0" / "0_00000.JPEG").read_bytes())
    assert main(["data", "check", str(bad), "--quiet"]) == 1
    text = capsys.readouterr().out
    assert "corrupt: " in text and "broken.JPEG" in text and "only in val (extra)" in text
    assert main(["data", "convert", str(folder), str(tmp_path / "shards"), "--to", "tfrecord",
                 "--shard-size", "50"]) == 0
    captured = capsys.readouterr()
    assert "train: 80 images written, 0 skipped" in captured.out and "100%" in captured.err
    assert main(["data", "convert", str(folder), str(tmp_path / "shards"), "--to", "tfrecord"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["data", "check", str(tmp_path / "missing")]) == 2


# -- synthetic data on the device -------------------------------------------------------------


def test_synthetic_pool_is_deterministic_uint8_with_labels():
    from aiperf_core.data import synthetic

    a = synthetic.SyntheticSource(classes=7, train_images=200, val_images=10)
    b = synthetic.SyntheticSource(classes=7, train_images=200, val_images=10)
    assert a.pool(16).dtype == np.uint8 and a.pool(16).shape == (synthetic.POOL, 16, 16, 3)
    np.testing.assert_array_equal(a.pool(16), b.pool(16))
    np.testing.assert_array_equal(a.pool_labels, b.pool_labels)
    assert a.pool_labels.min() >= 0 and a.pool_labels.max() < 7 and len(set(a.pool_labels.tolist())) > 1
    assert not np.array_equal(a.pool(16), synthetic.SyntheticSource(7, 100, 10, seed=1).pool(16))
    np.testing.assert_array_equal(a.labels("train")[:3 * synthetic.POOL].reshape(3, -1), np.tile(a.pool_labels, (3, 1)))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_synthetic_device_windows_give_the_host_batches(world):
    """A backend that uploads device_pool once and slices its windows trains on exactly the batches
    the host pipeline delivers, rank by rank, the short last batch included."""
    from aiperf_core.data import synthetic

    data = load_dataset({"name": "synthetic", "classes": 10, "train_images": 150, "val_images": 41,
                         "image_size": 8}, workers=0)
    pool = synthetic.device_pool(data, 32)
    assert pool.pixels.shape == (synthetic.POOL + 31, 8, 8, 3) and pool.labels.shape == (synthetic.POOL + 31,)
    for split, batch in (("train", 32), ("val", 13)):
        for rank in range(world):
            for epoch in (0, 1):
                host = list(data.iterate(split, epoch, 7, batch, rank, world))
                device = list(synthetic.windows(data, split, batch, rank, world))
                assert len(host) == len(device) == -(-data.source.count(split) // batch)
                for h, w in zip(host, device):
                    assert w.offset + w.length <= len(pool.labels) and w.size == h.size
                    np.testing.assert_array_equal(pool.pixels[w.offset:w.offset + w.length], h.x)
                    np.testing.assert_array_equal(pool.labels[w.offset:w.offset + w.length], h.y)
    with pytest.raises(AiperfError, match="not synthetic"):
        synthetic.device_pool(load_dataset({"name": "digits"}), 8)


# -- the host pipeline's worker processes -------------------------------------------------------


def test_workers_fork_unless_a_framework_is_loaded(monkeypatch):
    from aiperf_core.data import stream

    for name in stream.FORK_UNSAFE:
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert stream.start_method() == "fork"
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    assert stream.start_method() == "forkserver"


def _pool_gives_the_inline_batches_and_persists(folder) -> None:
    import pickle

    spec = {"name": "imagenet", "path": str(folder), "image_size": 16}
    inline, pooled = load_dataset(spec, workers=0), load_dataset(spec, workers=2)
    try:
        for epoch in (0, 1):
            a, b = list(inline.iterate("train", epoch, 3, 12)), list(pooled.iterate("train", epoch, 3, 12))
            assert len(a) == len(b) == 7
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x.x, y.x)
                np.testing.assert_array_equal(x.y, y.y)
            if epoch == 0:
                pool = pooled._pool
            assert pooled._pool is pool  # made once, kept across epochs
        assert pickle.loads(pickle.dumps(pooled))._pool is None
        partial = pooled.iterate("val", 0, 0, 4)
        next(partial)
        partial.close()  # a consumer that stops early cancels the rest
        assert len(list(pooled.iterate("val", 0, 0, 4))) == 5
    finally:
        pooled.close()
    assert pooled._pool is None


def test_forked_worker_processes_give_the_inline_batches_and_persist(trees):
    # Forked workers are what a process without a framework gets. This test process has loaded
    # several (JAX warns that forking it may deadlock), so the case runs in a fresh interpreter.
    import subprocess

    code = ("import sys; sys.path.insert(0, sys.argv[2]); import test_data; from aiperf_core.data import stream; "
            "assert stream.start_method() == 'fork', 'a framework got imported'; "
            "test_data._pool_gives_the_inline_batches_and_persists(sys.argv[1])")
    out = subprocess.run([sys.executable, "-c", code, str(trees[0]), os.path.dirname(__file__)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_forkserver_worker_processes_give_the_inline_batches_and_persist(trees, monkeypatch):
    from aiperf_core.data import stream

    monkeypatch.setattr(stream, "start_method", lambda: "forkserver")
    _pool_gives_the_inline_batches_and_persists(trees[0])


ORPHAN_SCRIPT = """
import sys, time
from aiperf_core.data import load_dataset
data = load_dataset({"name": "imagenet", "path": sys.argv[1], "image_size": 16}, workers=2)
next(iter(data.iterate("train", 0, 0, 8)))
print(" ".join(str(p) for p in data._pool._executor._processes), flush=True)
time.sleep(600)
"""


# A pool whose workers are still starting (their state takes a second to unpickle) when its process is
# killed: the fork server starts them after the owner is gone.
STARTING_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from aiperf_core.data import stream
import test_data
stream.start_method = lambda: "forkserver"
pool = stream.WorkerPool(test_data.SlowToStart(), 2)
pool._executor.submit(time.sleep, 0), pool._executor.submit(time.sleep, 0)
print(" ".join(str(p) for p in pool._executor._processes), flush=True)
time.sleep(600)
"""
# How long the processes of a killed pool may take to leave: they look for their owner every
# orphans.CHECK_S, so this only bounds a failure's wait on a loaded machine.
WORKERS_LEAVE_BOUND_S = 120


class SlowToStart:
    """A worker pool's state that takes a second to unpickle, so that its workers are still starting a
    second after the pool spawned them."""

    def __reduce__(self):
        return _slow_to_start, ()


def _slow_to_start():
    import time

    time.sleep(1.0)
    return SlowToStart()


@pytest.mark.parametrize("framework_loaded", [False, True], ids=["fork", "forkserver"])
def test_workers_leave_when_their_process_is_killed(trees, framework_loaded):
    """A replica killed with SIGKILL leaves no decoding processes behind."""
    script = ("import torch\n" if framework_loaded else "") + ORPHAN_SCRIPT
    _assert_workers_leave_when_killed([sys.executable, "-c", script, str(trees[0])])


def test_workers_still_starting_leave_when_their_process_is_killed():
    """Nor does one killed while its workers are still starting (before they know their owner)."""
    _assert_workers_leave_when_killed([sys.executable, "-c", STARTING_SCRIPT, os.path.dirname(__file__)])


def _assert_workers_leave_when_killed(command: list[str]) -> None:
    """Runs `command`, which prints the pids of its two data workers, kills it with SIGKILL, and waits
    for the workers to end."""
    import signal
    import subprocess

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        started = {pid: _start_time(pid) for pid in pids}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    alive = _wait_until_gone(pids, started, WORKERS_LEAVE_BOUND_S)
    assert not alive, f"data workers {alive} outlived their process: " + "; ".join(
        f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()!r}" for pid in alive)


def _wait_until_gone(pids: list[int], started: dict, bound_s: float) -> list[int]:
    """Waits for the processes to end, each on its pidfd (readable once the process has exited), at most
    bound_s in all; returns those still running."""
    import select
    import time

    waiting = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        if _running(pid, started[pid]):  # the pidfd is the worker's, not a later process's given its pid
            waiting[fd] = pid
        else:
            os.close(fd)
    deadline = time.monotonic() + bound_s
    try:
        while waiting and time.monotonic() < deadline:
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                del waiting[fd]
                os.close(fd)
    finally:
        for fd in waiting:
            os.close(fd)
    return [pid for pid in pids if _running(pid, started[pid])]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces): field 3 (state) is [0]."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return None if fields is None else fields[19]  # field 22, starttime


def _running(pid: int, start_time: str | None) -> bool:
    """The same process (not a later one given the reused PID, as a long test run wraps PIDs), not a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z" and fields[19] == start_time
