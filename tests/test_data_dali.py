"""NVIDIA DALI as the decoder (aiperf[dali]): its CPU operators run here. Both layouts, the host
pipeline's order, labels and sharding, corrupt images skipped and counted exactly, validation
pixels close to Pillow's, a backend training on it, and the one-line errors when it is asked for
where it cannot serve."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest

from aiperf_core.data import load_dataset, tfrecord
from aiperf_core.data.samples import digits_tree, photo_tree
from aiperf_core.data.tools import convert
from aiperf_core.errors import AiperfError

SIZE, CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 16, 10, 4, 2
TRAIN_IMAGES = CLASSES * TRAIN_PER_CLASS


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AIPERF_DATA_CACHE", str(tmp_path_factory.mktemp("cache")))
        root = tmp_path_factory.mktemp("dali")
        folder = digits_tree(root / "folder", TRAIN_PER_CLASS, VAL_PER_CLASS, size=SIZE)
        convert(folder, root / "shards", "tfrecord", workers=0, shard_size=16)
        yield folder, root / "shards"


def opened(path, workers=1, size=SIZE):
    return load_dataset({"name": "imagenet", "path": str(path), "image_size": size, "data_loader": "dali"},
                        workers=workers)


def test_missing_extra_is_one_line_naming_it(trees, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed
    with pytest.raises(AiperfError, match=r"pip install 'aiperf\[dali\]'") as info:
        load_dataset({"name": "imagenet", "path": str(trees[0]), "data_loader": "dali"})
    assert "\n" not in str(info.value)
    from aiperf_core.policy import Policy

    hint = r"data_loader: 'dali' needs NVIDIA DALI, the extra aiperf\[dali\]: pip install 'aiperf\[dali\]'$"
    with pytest.raises(AiperfError, match=hint):
        Policy({"data_loader": "dali"}, source="policy")


def test_dali_is_refused_where_there_is_nothing_to_decode(trees):
    with pytest.raises(AiperfError, match="digits dataset is in memory"):
        load_dataset({"name": "digits", "data_loader": "dali"})
    with pytest.raises(AiperfError, match="synthetic dataset has none"):
        load_dataset({"name": "synthetic", "data_loader": "dali", "train_images": 4, "val_images": 4})
    with pytest.raises(AiperfError, match="data_loader: must be one of native, dali"):
        load_dataset({"name": "imagenet", "path": str(trees[0]), "data_loader": "pillow"})


@pytest.mark.parametrize("layout", [0, 1], ids=["imagefolder", "tfrecord"])
def test_dali_batches_follow_the_host_plan(trees, layout):
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    host = load_dataset({"name": "imagenet", "path": str(trees[layout]), "image_size": SIZE}, workers=0)
    data = opened(trees[layout])
    assert data.describe()["data_loader"] == "dali"
    for split, epoch in (("train", 2), ("val", 0)):
        for world in (1, 2):
            for rank in range(world):
                ours = list(data.iterate(split, epoch, 5, 12, rank, world))
                theirs = list(host.iterate(split, epoch, 5, 12, rank, world))
                assert len(ours) == len(theirs)
                for a, b in zip(ours, theirs):
                    assert a.x.dtype == np.uint8 and a.x.shape == b.x.shape
                    np.testing.assert_array_equal(a.y, b.y)
                    assert a.size == b.size and a.skipped == 0
    val = np.concatenate([b.x for b in data.iterate("val", 0, 0, 8)]).astype(np.float32)
    pillow = np.concatenate([b.x for b in host.iterate("val", 0, 0, 8)]).astype(np.float32)
    assert np.abs(val - pillow).mean() < 8.0  # the same recipe; resamplers differ by a few levels


def test_dali_photos_at_imagenet_size_match_pillow_validation(tmp_path):
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    folder = photo_tree(tmp_path / "photos", 2, 3)
    data, host = opened(folder, size=64), load_dataset({"name": "imagenet", "path": str(folder), "image_size": 64},
                                                         workers=0)
    ours = np.concatenate([b.x for b in data.iterate("val", 0, 0, 4)]).astype(np.float32)
    theirs = np.concatenate([b.x for b in host.iterate("val", 0, 0, 4)]).astype(np.float32)
    assert ours.shape == theirs.shape == (6, 64, 64, 3)
    assert np.abs(ours - theirs).mean() < 6.0
    train = np.concatenate([b.x for b in data.iterate("train", 0, 0, 4)])
    assert train.shape == (4, 64, 64, 3) and train.std() > 10  # real crops, not blank frames


def test_dali_skips_and_counts_corrupt_images_exactly(trees, tmp_path, monkeypatch):
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    monkeypatch.setenv("AIPERF_DATA_CACHE", str(tmp_path / "cache"))
    folder, shards = trees
    bad = shutil.copytree(folder, tmp_path / "bad")
    (bad / "train" / "3" / "3_zz_garbage.JPEG").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    whole = (bad / "train" / "5" / "5_00001.JPEG").read_bytes()
    (bad / "train" / "5" / "5_00001.JPEG").write_bytes(whole[:len(whole) // 3])
    data = opened(bad, workers=2)
    for epoch in (0, 1):
        batches = list(data.iterate("train", epoch, 0, 8))
        assert sum(b.skipped for b in batches) == 2
        assert sum(len(b.y) for b in batches) == TRAIN_IMAGES - 1  # 41 stored, two corrupt
        assert sum(b.size for b in batches) == TRAIN_IMAGES + 1
        assert all(len(b.x) == len(b.y) for b in batches)
        names = [c for b in batches for c in b.corrupt]
        assert any("3_zz_garbage" in c for c in names) and any("5_00001" in c for c in names)
    # A TFRecord record with a bad checksum never reaches DALI: the reader rejects it.
    bad_shards = shutil.copytree(shards, tmp_path / "bad_shards")
    shard = bad_shards / "train-00001-of-00003"
    with open(shard, "rb") as fh:
        offset, record = next(tfrecord.scan(fh, str(shard)))
    raw = bytearray(shard.read_bytes())
    raw[offset + len(record) // 2] ^= 0x55
    shard.write_bytes(bytes(raw))
    batches = list(opened(bad_shards).iterate("train", 0, 0, 8))
    assert sum(b.skipped for b in batches) == 1 and sum(len(b.y) for b in batches) == TRAIN_IMAGES - 1


def test_a_backend_trains_on_dali_batches(trees):
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    from aiperf_core.backend import TrainConfig
    from aiperf_core.builders import resnet_small
    from aiperf_core.registry import load_backend

    backend = load_backend("numpy")
    model = backend.lower(resnet_small((SIZE, SIZE, 3), CLASSES))
    data = load_dataset({"name": "imagenet", "path": str(trees[1]), "image_size": SIZE, "data_loader": "dali"},
                        workers=1)
    reports = backend.train(model, data, TrainConfig(epochs=1, batch_size=16, seed=0))
    assert reports[0].train_images == TRAIN_IMAGES and reports[0].val_images == CLASSES * VAL_PER_CLASS
    assert reports[0].skipped_images == 0 and np.isfinite(reports[0].loss)


@pytest.mark.parametrize("framework", ["torch", "jax", "tensorflow"])
def test_dali_tensors_reach_each_framework_through_dlpack(trees, framework):
    """The GPU path hands DALI's output over by DLPack; the same protocol on DALI's CPU tensors
    checks here that each framework takes it as it is (pixels, shape, dtype)."""
    pytest.importorskip("nvidia.dali", reason="make test installs aiperf[dali]")
    data = opened(trees[0])
    decoder = data.dali_decoder("val", 8, 0, None, 0)
    x, y, corrupt = decoder.decode(np.arange(8))
    expected = np.array(x)
    assert expected.shape == (8, SIZE, SIZE, 3) and expected.dtype == np.uint8 and not corrupt
    if framework == "torch":
        torch = pytest.importorskip("torch")
        got = torch.from_dlpack(x).numpy()
    elif framework == "jax":
        jax = pytest.importorskip("jax")
        got = np.asarray(jax.dlpack.from_dlpack(x))
    else:
        tf = pytest.importorskip("tensorflow")
        got = tf.experimental.dlpack.from_dlpack(x.__dlpack__()).numpy()
    np.testing.assert_array_equal(got, expected)
