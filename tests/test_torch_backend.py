"""The torch backend beyond the conformance kit: the CPU conv probe and its fallback (a planted wrong
kernel), what each precision's scope sets, the generated (compilable) lowering, uint8 pixels
normalised on the device, synthetic data made on the device, the feeds, the compile policy and the
compiled step, nvJPEG's host planning and crops (with a Pillow decoder standing in for nvJPEG),
AIPERF_CPU_DEVICES and TrainConfig.devices.

Data-parallel equality is tests/test_torch_distributed.py's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)
import torch.nn.functional as F

from aiperf_backends.torch import TorchBackend, conv_probe, feeds, lowering, nvjpeg, training
from aiperf_backends.torch.precision import float32_math, runs_tf32
from aiperf_core.backend import BackendError, Dataset, Schedule, StepClock, TrainConfig
from aiperf_core.builders import resnet50, resnet_small
from aiperf_core.data.preprocess import normalise
from aiperf_conformance.cases import trained_looking_weights

ROOT = Path(__file__).resolve().parents[1]
SIZE, CLASSES = 16, 5


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.fixture(scope="module")
def small():
    graph = resnet_small((SIZE, SIZE, 3), CLASSES)
    return graph, trained_looking_weights(graph, 3)


def _batch(graph, n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (n,) + graph.input_shape).astype(np.float32), rng.integers(0, graph.output_shape[0], n)


def _worst(got, want) -> float:
    return max(float(np.max(np.abs(got[n][p] - want[n][p])) / max(np.max(np.abs(want[n][p])), 1e-12))
               for n in want for p in want[n])


# -- the CPU conv probe (issue 18.1) -------------------------------------------------------------------


class _WrongWeightGradient(torch.autograd.Function):
    """conv2d whose weight gradient is 1.4x the true one: a wrong CPU kernel, planted."""

    @staticmethod
    def forward(ctx, x, weight, stride, padding):
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.padding = stride, padding
        return F.conv2d(x, weight, None, stride, padding)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            gx, gw = torch.autograd.grad(F.conv2d(xd, wd, None, ctx.stride, ctx.padding), (xd, wd), grad)
        return gx, gw * 1.4, None, None


def faulty_conv2d(broken_forms=("channels_last",)):
    """A conv2d that is wrong for 3x3 convs in the given forms: 'channels_last', or 'contiguous'
    (NCHW input). Strided 1x1 convs raise if ever run on channels_last input: the backend must never
    run their real kernel there (conv_probe's docstring)."""

    def conv(x, weight, bias=None, stride=1, padding=0):
        stride = (stride, stride) if isinstance(stride, int) else tuple(stride)
        form = "contiguous" if x.is_contiguous() else "channels_last"
        kernel = tuple(weight.shape[2:])
        if kernel == (1, 1) and stride != (1, 1) and form == "channels_last":
            raise AssertionError("a strided 1x1 conv ran on channels_last input")
        if kernel == (3, 3) and form in broken_forms:
            return _WrongWeightGradient.apply(x, weight, stride, padding) + (0 if bias is None else bias.view(1, -1, 1, 1))
        return F.conv2d(x, weight, bias, stride, padding)

    return conv


def _strided_1x1(graph):
    return [n.id for n in graph.nodes if n.op == "conv2d" and tuple(n.attrs["kernel"]) == (1, 1)
            and tuple(n.attrs["strides"]) != (1, 1)]


def test_probe_finds_the_right_kernels_here_and_strided_1x1_convs_run_subsampled():
    strided = conv_probe.ConvGeometry(5, 6, (1, 1), (2, 2), (0, 0))  # the reproduction
    three = conv_probe.ConvGeometry(5, 6, (3, 3), (1, 1), (1, 1))
    assert conv_probe.weight_gradient_error(F.conv2d, strided, "subsampled", torch.float32) < 1e-5
    assert conv_probe.weight_gradient_error(F.conv2d, three, "channels_last", torch.float32) < 1e-5
    assert conv_probe.conv_forms([strided, three], torch.float32) == {strided: "subsampled", three: "channels_last"}


def test_a_planted_wrong_kernel_is_detected_and_avoided(backend, small, monkeypatch, caplog):
    graph, weights = small
    x, y = _batch(graph, 6, 1)
    want = backend.loss_and_grads(backend.lower(graph, weights), x, y)[1]
    monkeypatch.setattr(lowering, "conv2d", faulty_conv2d())
    with caplog.at_level(logging.WARNING, logger="aiperf.torch"):
        model = backend.lower(graph, weights)
    three = [n.id for n in graph.nodes if n.op == "conv2d" and tuple(n.attrs["kernel"]) == (3, 3)]
    strided = _strided_1x1(graph)
    assert three and strided
    assert all(model.conv_forms[c] == "contiguous" for c in three)
    assert all(model.conv_forms[c] == "subsampled" for c in strided)
    assert all(form == "channels_last" for c, form in model.conv_forms.items() if c not in three + strided)
    lines = [r.getMessage() for r in caplog.records if r.name == "aiperf.torch"]
    assert len(lines) == 1 and "wrong fp32 weight gradients" in lines[0] and "3x3 stride 1x1" in lines[0]
    # The model trains on the right gradients although its conv2d is the planted one.
    got = backend.loss_and_grads(model, x, y)[1]
    assert _worst(got, want) < 1e-5
    # Without the probe's choice the planted kernel is visibly wrong (the test's own check).
    wrong = lowering.LoweredModel(graph, "fp32")
    wrong.load_canonical(weights)
    wrong.to(memory_format=torch.channels_last)
    monkeypatch.setattr(lowering, "conv2d", faulty_conv2d(("channels_last", "contiguous")))
    wrong._generate(torch.device("cpu"), probe=False)
    with pytest.raises(AssertionError, match="strided 1x1 conv ran on channels_last"):
        backend.loss_and_grads(wrong, x, y)


def test_no_right_kernel_is_a_one_line_error(backend, small, monkeypatch):
    monkeypatch.setattr(lowering, "conv2d", faulty_conv2d(("channels_last", "contiguous")))
    with pytest.raises(BackendError, match=r"^every CPU kernel tried for conv 3x3 stride 1x1 .* computes a wrong "
                                           r"weight gradient \(relative errors channels_last 0.4, contiguous 0.4\)$"):
        backend.lower(small[0], small[1])


_AVX2_SCRIPT = textwrap.dedent("""
    import numpy as np
    from aiperf_backends.torch import TorchBackend
    from aiperf_core.builders import resnet_small
    from aiperf_conformance.cases import trained_looking_weights
    from aiperf_core.morph.cnn import skip
    import aiperf_numpy

    graph = resnet_small((32, 32, 3), 10)
    weights = trained_looking_weights(graph, 0)
    # A morph's skip from the input image: a 1x1 stride-4 conv on 3 channels, the shape whose
    # channels_last backward kernel corrupted the heap of torch replicas.
    child = skip(graph, weights, "input", "conv2_block1_2_bn", prefix="m1")
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (8, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, 8)
    backend = TorchBackend()
    model = backend.lower(child.graph, child.weights)
    for _ in range(3):
        loss, grads = backend.loss_and_grads(model, x, y)
    ref_loss, ref_grads, _ = aiperf_numpy.loss_and_grads(child.graph, child.weights, x, y, dtype=np.float64)
    worst = max(float(np.max(np.abs(grads[n][p] - ref_grads[n][p])) / max(np.max(np.abs(ref_grads[n][p])), 1e-12))
                for n in ref_grads for p in ref_grads[n])
    print(worst)
""")


def test_oneDNN_avx2_strided_1x1_kernel_is_never_run():
    # ONEDNN_MAX_CPU_ISA=AVX2 makes oneDNN dispatch the kernels of the CPU issue 18 was found on, on
    # any AVX2 CPU; MALLOC_CHECK_=3 makes glibc abort at the first sign of heap corruption.
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "MALLOC_CHECK_": "3", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _AVX2_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-3


# -- precisions (issue 15.1) ---------------------------------------------------------------------------


@pytest.fixture
def users_tf32_on():
    """The user asked for TF32 (oneDNN: through the per-operator API; cuDNN and cuBLAS: the legacy one)."""
    b = torch.backends
    modern = [(b.cuda.matmul, "fp32_precision"), (b.cudnn.conv, "fp32_precision"), (b.cudnn.rnn, "fp32_precision"),
              (b.mkldnn.matmul, "fp32_precision"), (b.mkldnn.conv, "fp32_precision")]
    saved = [(o, a, getattr(o, a)) for o, a in modern]
    b.cuda.matmul.allow_tf32 = True
    b.cudnn.allow_tf32 = True
    b.mkldnn.matmul.fp32_precision = b.mkldnn.conv.fp32_precision = "tf32"
    yield
    for o, a, v in saved:
        setattr(o, a, v)


def test_fp32_scope_is_ieee_and_gives_back_the_users_switches(users_tf32_on):
    b = torch.backends
    for tf32 in (False, True):
        with float32_math("cuda:0", tf32=tf32):
            assert b.cuda.matmul.allow_tf32 is tf32 and b.cudnn.allow_tf32 is tf32
        assert b.cuda.matmul.allow_tf32 is True and b.cudnn.allow_tf32 is True
    with float32_math("cpu", tf32=False):
        assert (b.mkldnn.matmul.fp32_precision, b.mkldnn.conv.fp32_precision) == ("ieee", "ieee")
    assert b.mkldnn.conv.fp32_precision == "tf32"
    # A user on the per-operator API (the legacy flag no longer reads) is served through it.
    b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision = "tf32", "ieee"
    b.cuda.matmul.fp32_precision = "tf32"
    with float32_math("cuda:0", tf32=False):
        assert (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision) == ("ieee", "ieee")
    assert (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision) == (
        "tf32", "tf32", "ieee")


def test_every_model_call_runs_inside_the_scope(backend, small, monkeypatch, users_tf32_on):
    seen = []

    def recording_conv2d(*args, **kwargs):
        seen.append(torch.backends.mkldnn.conv.fp32_precision)
        return F.conv2d(*args, **kwargs)

    monkeypatch.setattr(lowering, "conv2d", recording_conv2d)
    graph, weights = small
    model = backend.lower(graph, weights)
    x, y = _batch(graph, 8, 3)
    seen.clear()
    backend.predict(model, x)
    backend.loss_and_grads(model, x, y)
    backend.train(model, Dataset(x, y, x[:3], y[:3], CLASSES), TrainConfig(epochs=1, batch_size=4))
    assert seen and set(seen) == {"ieee"}
    assert torch.backends.mkldnn.conv.fp32_precision == "tf32"


def test_tf32_is_declared_on_cuda_8_and_newer_only(monkeypatch):
    assert runs_tf32("cpu") is False
    assert "tf32" not in TorchBackend().precisions("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, declared in (((8, 0), True), ((9, 0), True), ((7, 5), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert runs_tf32("cuda:0") is declared


# -- the generated lowering (issue 17.4) -----------------------------------------------------------------


def test_generated_forward_is_straight_line_and_frees_values(backend, small):
    model = backend.lower(*small)
    source = lowering.generated_source(model)
    assert "for " not in source and "while " not in source
    forward = source.split("def forward_logits")[0]
    assert forward.count("conv2d(") == sum(n.op == "conv2d" for n in small[0].nodes)
    assert "del " in source and "torch.relu_(" in source and ".add_(" in source  # freed, in place


def test_weights_round_trip_bit_exactly(backend, small):
    graph, weights = small
    out = backend.export_weights(backend.lower(graph, weights))
    for node, params in weights.items():
        for name, array in params.items():
            assert out[node][name].dtype == np.float32 and np.array_equal(out[node][name], array)


def _no_graph_breaks_nor_recompiles(backend, graph, batch: int = 4):
    model = backend.lower(graph)
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (batch,) + graph.input_shape, dtype=np.uint8))
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.utils.counters.clear()
    loss = torch.compile(model._training_loss, backend="eager", dynamic=False)
    labels = torch.arange(batch) % graph.output_shape[0]
    for _ in range(3):  # train mode, then the same shapes again: one graph, compiled once
        loss(model, x, labels, 0.0).backward()
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1 and not torch._dynamo.utils.counters["graph_break"]


def test_resnet50_compiles_without_graph_breaks_or_recompiles(backend):
    _no_graph_breaks_nor_recompiles(backend, resnet50((32, 32, 3), 10))


def test_a_morphed_child_compiles_without_graph_breaks_or_recompiles(backend):
    from aiperf_core.morph import cnn as morph

    graph, weights, rng = resnet50((32, 32, 3), 10), None, np.random.default_rng(1)
    ops = set()
    while len(ops) < 3:
        result = morph.random_morph(graph, weights, rng)
        graph, weights = result.graph, result.weights
        ops.add(result.record["op"])
    _no_graph_breaks_nor_recompiles(backend, graph)


# -- uint8 pixels, feeds, device placement ---------------------------------------------------------------


def test_uint8_pixels_are_normalised_on_the_device_as_on_the_host(backend, small):
    graph, weights = small
    model = backend.lower(graph, weights)
    pixels = np.random.default_rng(4).integers(0, 256, (6,) + graph.input_shape, dtype=np.uint8)
    host = torch.from_numpy(normalise(pixels))
    device = lowering.normalise_pixels(torch.from_numpy(pixels), model.input_mean, model.input_inv_std)
    assert torch.equal(device, host)  # the same float32 arithmetic, bit for bit
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(torch.from_numpy(pixels)), model(host))


def test_in_memory_feed_is_the_shuffled_order_sharded(small):
    x, y = _batch(small[0], 11, 5)
    order = np.random.default_rng(7 + 2).permutation(11)
    for world in (1, 2, 3):
        seen = []
        for rank in range(world):
            feed = feeds.ArrayFeed(x, y, torch.device("cpu"), 4, seed=7, rank=rank, world=world)
            seen.append([(b.y.numpy().tolist(), b.size) for b in feed.epoch(2)])
        for k, start in enumerate(range(0, 11, 4)):
            want = y[order[start:start + 4]].tolist()
            assert sum((s[k][0] for s in seen), []) == want and {s[k][1] for s in seen} == {len(want)}


def test_step_moves_its_batch_to_the_models_device_and_refuses_another_device(small):
    model = lowering.lower_graph(small[0], small[1], "fp32", "cpu")
    config = TrainConfig(epochs=1, batch_size=4)
    with pytest.raises(BackendError, match="the model is on cpu, the step was asked to run on cuda:0"):
        training.Stepper(model, "cuda:0", config)
    x, y = _batch(small[0], 4, 6)
    total = training.Stepper(model, "cpu", config).step(torch.from_numpy(x), torch.from_numpy(y), 4)
    assert total.device == torch.device("cpu") and torch.isfinite(total)


def test_every_training_step_counts_its_global_batch(backend, small, monkeypatch):
    counted = []
    monkeypatch.setattr(StepClock, "count", lambda self, images: counted.append(images))
    x, y = _batch(small[0], 10, 8)
    reports = backend.train(backend.lower(*small), Dataset(x, y, x[:2], y[:2], CLASSES),
                            TrainConfig(epochs=2, batch_size=4))
    assert counted == [4, 4, 2] * 2 and all(r.train_images == 10 for r in reports)


def _synthetic(train=20, val=6):
    from aiperf_core.data import load_dataset

    return load_dataset({"name": "synthetic", "classes": CLASSES, "train_images": train, "val_images": val,
                         "image_size": SIZE}, workers=0)


def test_synthetic_data_is_made_on_the_device_once(backend, small, monkeypatch):
    data = _synthetic()
    config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.05), seed=1)
    assert feeds.feed_kind(data, torch.device("cpu")) == feeds.SYNTHETIC
    with monkeypatch.context() as patch:  # the reference: the same data through the host pipeline
        patch.setattr(feeds, "feed_kind", lambda data, device: feeds.LOADER)
        host = backend.train(backend.lower(*small), data, config)

    def no_host_work(*args, **kwargs):
        raise AssertionError("a synthetic batch was made on the host")

    for name in ("load", "iterate"):  # every way of making a batch on the host
        monkeypatch.setattr(data, name, no_host_work)
    monkeypatch.setattr(data.source, "example", no_host_work)
    on_device = backend.train(backend.lower(*small), data, config)
    for a, b in zip(on_device, host):
        assert a.train_images == b.train_images == 20 and a.val_images == b.val_images == 6
        assert a.skipped_images == 0
        assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.val_loss == pytest.approx(b.val_loss, rel=1e-6)


def test_feed_choice(tmp_path, monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    x = np.zeros((2, SIZE, SIZE, 3), np.float32)
    assert feeds.feed_kind(Dataset(x, np.zeros(2, np.int64), x, np.zeros(2, np.int64), 2), gpu) == feeds.ARRAYS
    assert feeds.feed_kind(_synthetic(), gpu) == feeds.SYNTHETIC
    from aiperf_core.data import load_dataset
    from aiperf_core.data.samples import digits_tree

    monkeypatch.setenv("AIPERF_DATA_CACHE", str(tmp_path / "cache"))
    tree = load_dataset({"name": "imagenet", "path": str(digits_tree(tmp_path / "t", 2, 1, size=SIZE)),
                         "image_size": SIZE}, workers=0)
    assert feeds.feed_kind(tree, cpu) == feeds.LOADER
    monkeypatch.setattr(nvjpeg, "available", lambda: True)
    assert feeds.feed_kind(tree, gpu) == feeds.NVJPEG and feeds.feed_kind(tree, cpu) == feeds.LOADER
    monkeypatch.setattr(nvjpeg, "available", lambda: False)
    assert feeds.feed_kind(tree, gpu) == feeds.LOADER
    monkeypatch.setattr(tree, "loader", "dali")
    assert feeds.feed_kind(tree, gpu) == feeds.DALI_FEED


# -- the compile policy and the compiled step -------------------------------------------------------------


def test_compile_policy():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    big, small_trial = training.AUTO_COMPILE_MIN_STEPS, training.AUTO_COMPILE_MIN_STEPS - 1
    assert training.compiles("auto", gpu, big, 1) and not training.compiles("auto", gpu, small_trial, 1)
    assert not training.compiles("auto", cpu, 10 ** 9, 1)  # never on a CPU (docs/backends/torch.md)
    assert training.compiles("always", cpu, 1, 1) and not training.compiles("never", gpu, 10 ** 9, 1)
    assert not training.compiles("always", gpu, 10 ** 9, 2)  # data-parallel ranks run eager
    backend, graph = TorchBackend(), resnet_small((8, 8, 3), 3)
    data = Dataset(np.zeros((2, 8, 8, 3), np.float32), np.zeros(2, np.int64), np.zeros((1, 8, 8, 3), np.float32),
                   np.zeros(1, np.int64), 3)
    with pytest.raises(BackendError, match="compile must be one of auto, always, never, got 'sometimes'"):
        backend.train(backend.lower(graph), data, TrainConfig(epochs=1, batch_size=2, compile="sometimes"))


@pytest.mark.slow
def test_the_compiled_step_trains_as_the_eager_one_and_reports_its_compile_time():
    from aiperf_core.ir import Graph

    graph = Graph([
        {"id": "in", "op": "input", "attrs": {"shape": [8, 8, 3]}},
        {"id": "c", "op": "conv2d", "inputs": ["in"], "attrs": {"filters": 4, "kernel": [3, 3], "padding": [1, 1, 1, 1]}},
        {"id": "bn", "op": "batch_norm", "inputs": ["c"]},
        {"id": "r", "op": "relu", "inputs": ["bn"]},
        {"id": "p", "op": "global_avg_pool", "inputs": ["r"]},
        {"id": "d", "op": "dense", "inputs": ["p"], "attrs": {"units": 3}},
        {"id": "s", "op": "softmax", "inputs": ["d"]},
    ], name="tiny")
    weights = trained_looking_weights(graph, 1)
    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 256, (10, 8, 8, 3), dtype=np.uint8), rng.integers(0, 3, 10)
    config = TrainConfig(epochs=2, batch_size=4, schedule=Schedule(initial=0.05))
    reports = {}
    for compiled in (False, True):
        model = lowering.lower_graph(graph, weights, "fp32", "cpu")
        stepper = training.Stepper(model, "cpu", config, compile=compiled)
        reports[compiled] = (training.run_epochs(model, Dataset(x, y, x[:4], y[:4], 3), config, "cpu",
                                                 stepper=stepper), model.export_canonical())
    (eager, w_eager), (comp, w_comp) = reports[False], reports[True]
    assert [r.compile_seconds for r in eager] == [0.0, 0.0]
    assert comp[0].compile_seconds > 0 and comp[1].compile_seconds == 0.0
    for a, b in zip(comp, eager):
        assert a.loss == pytest.approx(b.loss, rel=1e-4) and a.val_loss == pytest.approx(b.val_loss, rel=1e-4)
    assert _worst(w_comp, w_eager) < 1e-4


# -- nvJPEG: the host planning and the GPU crops, with Pillow standing in for nvJPEG ---------------------


def _pil_decode(encoded, device):
    import io

    from PIL import Image

    out = []
    for data in encoded:
        image = Image.open(io.BytesIO(data.numpy().tobytes()))
        out.append(torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous().to(device))
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    from aiperf_core.data import load_dataset
    from aiperf_core.data.samples import photo_tree

    with pytest.MonkeyPatch.context() as patch:
        root = tmp_path_factory.mktemp("photos")
        patch.setenv("AIPERF_DATA_CACHE", str(root / "cache"))
        tree = photo_tree(root / "tree", 3, 2, size=(60, 80))
        (tree / "train" / sorted(p.name for p in (tree / "train").iterdir())[0] / "zz_corrupt.JPEG").write_bytes(
            b"\xff\xd8\xff\xe0 not a jpeg")
        yield load_dataset({"name": "imagenet", "path": str(tree), "image_size": 24}, workers=0)


def test_nvjpeg_plans_the_host_pipelines_boxes_and_flips(photos):
    from PIL import Image

    from aiperf_core.data.preprocess import augmentation_rng, random_crop_box

    source = photos.source
    for index in range(source.count("train")):
        try:
            kind, payload, box, flip = nvjpeg.plan_image(source, "train", index, 24, seed=3, epoch=1)
        except Exception:
            assert "corrupt" in source.where("train", index)
            continue
        width, height = Image.open(source.files("train")[index]).size
        rng = augmentation_rng(3, 1, index)
        assert kind == nvjpeg.JPEG and box == random_crop_box(width, height, rng) and flip == (rng.random() < 0.5)


def test_nvjpeg_batches_match_the_host_pipeline(photos):
    from aiperf_core.data.preprocess import CorruptImage
    from aiperf_core.data.stream import TRAIN, VAL

    # Mean absolute difference in uint8 levels. Training crops are whole-pixel boxes on both sides
    # (measured 0.16); validation boxes are fractional in Pillow and rounded here, which on these
    # 80x60 images is a tenth of the crop (measured 3.2; on 500x375 images, a 650th).
    for split, tolerance in ((TRAIN, 0.5), (VAL, 5.0)):
        item = nvjpeg.EncodedShards(photos, split, 3, 64, 0, 1)[(0, 0)]
        x, y, skipped = nvjpeg.decode_batch(item, 24, torch.device("cpu"), decode=_pil_decode)
        want, labels, corrupt = [], [], 0
        for index in photos.plan(split, 0, 3, 64)[0]:  # the host pipeline, image by image
            try:
                want.append(photos.source.example(split, int(index), 24, 3, 0))
                labels.append(photos.source.labels(split)[index])
            except CorruptImage:
                corrupt += 1
        want = np.stack(want)
        assert skipped == corrupt == (1 if split == TRAIN else 0)
        assert np.array_equal(y.numpy(), labels) and x.dtype == torch.uint8 and x.shape == want.shape
        # Same crops, flips and sizes; the resize of a box at whole pixels against Pillow's.
        diff = np.abs(x.numpy().astype(np.int16) - want.astype(np.int16))
        assert diff.mean() < tolerance, (split, diff.mean())


def test_nvjpeg_val_box_is_the_central_crop():
    assert nvjpeg.val_box(256, 256, 224) == (16, 16, 224, 224)  # 224 / 0.875 = 256: no resize, a central crop
    # 500x375 -> 341x256, whose central 224x224 is source pixels 85.8..414.2 by 23.4..351.6
    assert nvjpeg.val_box(500, 375, 224) == (86, 23, 328, 328)


# -- devices: AIPERF_CPU_DEVICES and TrainConfig.devices -------------------------------------------------


def _run(script: str, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "AIPERF_CPU_DEVICES"}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_devices_variable():
    script = """
        import json
        from aiperf_core.backend import BackendError
        from aiperf_backends.torch import TorchBackend
        try:
            print(json.dumps({"devices": TorchBackend().devices()}))
        except BackendError as exc:
            print(json.dumps({"error": str(exc)}))
    """
    assert _run(script)["devices"] == ["cpu"]
    assert _run(script, AIPERF_CPU_DEVICES="3")["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert _run(script, AIPERF_CPU_DEVICES="two")["error"] == "AIPERF_CPU_DEVICES must be a whole number of devices, got 'two'"
    assert _run(script, AIPERF_CPU_DEVICES="0")["error"] == "AIPERF_CPU_DEVICES must be >= 1, got 0"


def test_train_devices_must_be_local(backend, small):
    x, y = _batch(small[0], 4, 9)
    data = Dataset(x, y, x, y, CLASSES)
    with pytest.raises(BackendError, match="not a subset"):
        backend.train(backend.lower(*small), data, TrainConfig(epochs=1, batch_size=4, devices=("cuda:3",)))
    reports = backend.train(backend.lower(*small), data, TrainConfig(epochs=1, batch_size=4, devices=("cpu",)))
    assert reports[0].train_images == 4
