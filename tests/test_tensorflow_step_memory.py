"""The TensorFlow backend at the LM track's scale (issue 39): gradient accumulation
(TrainConfig.micro_batch) equals one step on the whole batch and never runs more than a micro-batch
through the model at once; batch norm's moving statistics take one update per micro-batch;
activation checkpointing (TrainConfig.checkpoint_blocks) recomputes each block's forward in the
backward pass and leaves the gradients as they were; train() on a TokenStream reads the stream's
windows for each epoch a batch at a time; two devices on a TokenStream with accumulation and
checkpointing equal one device; device_memory.

Weights are compared to ~1e-5 (float32 summation order). Under AdamW the attention key biases are
left out, as the kit leaves them out: their exact gradient is zero, and AdamW divides a gradient by
its own size, so rounding becomes steps of up to the learning rate.
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

import tensorflow as tf  # noqa: E402

from aiperf_core.backend import Dataset, Schedule, TrainConfig, cpu_share_of_ram  # noqa: E402
from aiperf_core.builders import gpt, resnet_small  # noqa: E402
from aiperf_core.data.text_corpus import embedded_corpus  # noqa: E402
from aiperf_core.data.text_stream import TRAIN, VAL, TokenStream  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402
from aiperf_backends.tensorflow import lowering  # noqa: E402
from aiperf_backends.tensorflow.backend import gpu_memory_limits, graph_function, tf_device_name  # noqa: E402
from aiperf_backends.tensorflow.training import Trainer  # noqa: E402
from beside import beside

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, environ: dict, **env_extra) -> dict:
    """Run `script` in a fresh interpreter (AIPERF_CPU_DEVICES must be set before TensorFlow's
    runtime starts) in `environ` with env_extra; its last line is JSON."""
    env = {k: v for k, v in environ.items() if k not in ("AIPERF_CPU_DEVICES", "AIPERF_TF_XLA")}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + environ.get("PYTHONPATH", ""), **env_extra)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def backend():
    return TensorFlowBackend()


def _graph() -> Graph:
    return gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)


def _tokens(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 16)), rng.integers(0, 256, (n, 16))


def _key_biases(graph: Graph) -> set:
    return {(n.inputs[1], "bias") for n in graph.nodes if n.op == "attention"}


def _worst(got, want, skip=frozenset()) -> float:
    return max(float(np.max(np.abs(got[n][p] - want[n][p]))) for n in want for p in want[n] if (n, p) not in skip)


def _config(optimizer: str, **extra) -> TrainConfig:
    if optimizer == "adamw":
        return TrainConfig(epochs=2, batch_size=8, schedule=Schedule(1e-3), optimizer="adamw", grad_clip=1.0,
                           weight_decay=0.1, seed=3, **extra)
    return TrainConfig(epochs=2, batch_size=8, schedule=Schedule(0.05), momentum=0.9, grad_clip=1.0, seed=3, **extra)


class _Shapes:
    """LoweredModel.call wrapped to record the (static batch, dtype) of every training-mode pass it
    traces or runs."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[int | None, tf.DType]] = []
        original = lowering.LoweredModel.call

        def call(model, x, training, *args, **kwargs):
            if training:
                self.seen.append((x.shape[0], x.dtype))
            return original(model, x, training, *args, **kwargs)

        monkeypatch.setattr(lowering.LoweredModel, "call", call)


@pytest.mark.parametrize("optimizer", ["sgd-momentum", "adamw"])
def test_accumulation_equals_one_step_on_the_whole_batch(backend, optimizer, monkeypatch):
    # 13 sequences in batches of 8: 8 as micro-batches of 3, 3, 2; the short last batch of 5 as 3, 2.
    graph = _graph()
    x, y = _tokens(13)
    data = Dataset(x, y, x[:5], y[:5], 256)
    whole = backend.lower(graph)
    whole_reports = backend.train(whole, data, _config(optimizer))
    shapes = _Shapes(monkeypatch)
    micro = backend.lower(graph)
    reports = backend.train(micro, data, _config(optimizer, micro_batch=3))
    skip = _key_biases(graph) if optimizer == "adamw" else set()
    assert _worst(backend.export_weights(micro), backend.export_weights(whole), skip) < TOL
    assert [r.train_images for r in reports] == [13, 13] and [r.val_images for r in reports] == [5, 5]
    np.testing.assert_allclose([r.loss for r in reports], [r.loss for r in whole_reports], rtol=1e-5)
    np.testing.assert_allclose([r.val_loss for r in reports], [r.val_loss for r in whole_reports], rtol=1e-5)
    # Traced passes: the loop's micro-batch of 3 and the remainder of 2 (batch 8), 3 and 2 again
    # (batch 5); no pass over more than 3 sequences.
    assert sorted({n for n, _ in shapes.seen}) == [2, 3]


def test_accumulation_updates_moving_statistics_once_per_micro_batch(backend):
    graph = Graph([Node("x", "input", (), {"shape": [4, 4, 2]}),
                   Node("bn", "batch_norm", ("x",), {"momentum": 0.9, "epsilon": 1e-3}),
                   Node("f", "flatten", ("bn",), {}), Node("d", "dense", ("f",), {"units": 3}),
                   Node("p", "softmax", ("d",), {})])
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 3.0, (8, 4, 4, 2)).astype(np.float32)
    y = rng.integers(0, 3, 8)
    model = backend.lower(graph)
    start = backend.export_weights(model)["bn"]
    backend.train(model, Dataset(x, y, x[:2], y[:2], 3),
                  TrainConfig(epochs=1, batch_size=8, schedule=Schedule(0.01), micro_batch=3, seed=0))
    got = backend.export_weights(model)["bn"]
    order = np.random.default_rng(0).permutation(8)  # the epoch's order: default_rng(seed + epoch)
    mean, var = start["moving_mean"].astype(np.float64), start["moving_variance"].astype(np.float64)
    for part in (order[0:3], order[3:6], order[6:8]):  # each micro-batch's statistics, in order
        values = x[part].reshape(-1, 2).astype(np.float64)
        mean = 0.9 * mean + 0.1 * values.mean(0)
        var = 0.9 * var + 0.1 * values.var(0, ddof=1)
    np.testing.assert_allclose(got["moving_mean"], mean, atol=1e-6)
    np.testing.assert_allclose(got["moving_variance"], var, rtol=1e-6)


def _step_ops(backend, graph, checkpoint: bool) -> dict[str, int]:
    """Op types and their counts in the traced training step (its nested functions included)."""
    model = backend.lower(graph)
    trainer = Trainer(model, TrainConfig(epochs=1, batch_size=4, schedule=Schedule(0.01), checkpoint_blocks=checkpoint))
    step = trainer._step_fn(tf.int64, False)
    concrete = step.get_concrete_function(*trainer._spec(tf.int64), tf.TensorSpec([], tf.float32),
                                          tf.TensorSpec([], tf.float32))
    counts: dict[str, int] = {}
    for op in concrete.graph.get_operations():
        counts[op.type] = counts.get(op.type, 0) + 1
    for function in concrete.graph._functions.values():
        for node in function.definition.node_def:
            counts[node.op] = counts.get(node.op, 0) + 1
    return counts


def test_checkpointing_recomputes_each_blocks_forward(backend):
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
    plain, checkpointed = _step_ops(backend, graph, False), _step_ops(backend, graph, True)
    attentions = sum(n.op == "attention" for n in graph.nodes)
    gelus = sum(n.op == "gelu" for n in graph.nodes)
    assert len(graph.blocks()) == 2  # one per transformer block
    # The backward pass runs every block's forward again: attention's two products, the gelu's tanh.
    assert checkpointed["BatchMatMulV2"] - plain["BatchMatMulV2"] == 2 * attentions
    assert checkpointed["Tanh"] - plain["Tanh"] == gelus


def assert_checkpointing_leaves_gradients_as_they_were(backend, graph, x, y):
    """One batch's gradients of `graph` (lowered with its default weights) with its blocks checkpointed and
    without."""
    grads = {}
    for checkpoint in (False, True):
        model = backend.lower(graph)
        trainer = Trainer(model, TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(0.01),
                                             checkpoint_blocks=checkpoint))
        _, values, _ = graph_function(lambda a, b: trainer._gradients(a, b, float(len(x)), model.trainables))(x, y)
        grads[checkpoint] = [v.numpy() for v in values]
    for plain, recomputed in zip(grads[False], grads[True]):
        np.testing.assert_allclose(recomputed, plain, rtol=0, atol=1e-7)


def test_checkpointing_leaves_gradients_and_training_as_they_were(backend):
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
    x, y = _tokens(8, 1)
    x, y = x % 64, y % 64
    assert_checkpointing_leaves_gradients_as_they_were(backend, graph, x, y)
    data = Dataset(x, y, x[:4], y[:4], 64)
    trained = {}
    for checkpoint in (False, True):
        model = backend.lower(graph)
        backend.train(model, data, _config("sgd-momentum", checkpoint_blocks=checkpoint))
        trained[checkpoint] = backend.export_weights(model)
    assert _worst(trained[True], trained[False]) < TOL


def test_checkpointed_dropout_recomputes_the_same_mask(backend):
    # A dropout inside a block: the gradient from the recomputation must be that of the forward
    # pass's loss, which a central difference of the same (seeded) forward measures.
    base = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    nodes = []
    for node in base.nodes:
        if node.id == "h0_res1":
            nodes.append(Node("h0_drop", "dropout", ("h0_proj",), {"rate": 0.5}))
            node = Node(node.id, node.op, (node.inputs[0], "h0_drop"), node.attrs)
        nodes.append(node)
    graph = Graph(nodes)
    assert any("h0_drop" in block.nodes for block in graph.blocks())
    model = backend.lower(graph)
    rng = np.random.default_rng(2)
    x, y = tf.constant(rng.integers(0, 32, (4, 8))), rng.integers(0, 32, (4, 8))
    table = model.params["embed"]["table"]

    def loss():
        tf.random.set_seed(7)  # the same seeds, so the same masks, every call
        out, _ = model.call(x, True, logits=True, checkpoint=True)
        return float(tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out)))

    tf.random.set_seed(7)
    with tf.GradientTape() as tape:
        out, _ = model.call(x, True, logits=True, checkpoint=True)
        total = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(y, out))
    grad = tf.convert_to_tensor(tape.gradient(total, table)).numpy()
    direction = grad / np.linalg.norm(grad)
    start, eps = table.numpy(), 1e-3
    table.assign(start + eps * direction)
    up = loss()
    table.assign(start - eps * direction)
    down = loss()
    table.assign(start)
    np.testing.assert_allclose((up - down) / (2 * eps), np.linalg.norm(grad), rtol=2e-3)


def test_checkpointing_changes_nothing_for_an_image_graph(backend):
    graph = resnet_small((8, 8, 3), 3)
    assert graph.blocks() == []
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 3, 6)
    trained = []
    for checkpoint in (False, True):
        model = backend.lower(graph)
        config = TrainConfig(epochs=1, batch_size=4, schedule=Schedule(0.01), checkpoint_blocks=checkpoint)
        backend.train(model, Dataset(x, y, x[:2], y[:2], 3), config)
        trained.append(backend.export_weights(model))
    assert _worst(trained[1], trained[0]) == 0.0


class _Recorded(TokenStream):
    """A TokenStream that records every load: (split, offsets)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.loads: list[tuple[str, np.ndarray]] = []

    def load(self, split, offsets, epoch=0, seed=0):
        self.loads.append((split, np.asarray(offsets).copy()))
        return super().load(split, offsets, epoch, seed)


def test_token_stream_trial_reads_each_epochs_windows_a_batch_at_a_time(backend, monkeypatch):
    stream = _Recorded(embedded_corpus(), 16, 256, 128)
    assert (stream.train_images, stream.val_images) == (16, 8)
    shapes = _Shapes(monkeypatch)
    config = TrainConfig(epochs=2, batch_size=6, schedule=Schedule(1e-3), optimizer="adamw", seed=5, micro_batch=3)
    reports = backend.train(backend.lower(_graph()), stream, config)
    assert [(r.train_images, r.val_images, r.skipped_images) for r in reports] == [(16, 8, 0)] * 2
    assert all(np.isfinite(r.loss) and np.isfinite(r.val_loss) for r in reports)
    train = [offsets for split, offsets in stream.loads if split == TRAIN]
    val = [offsets for split, offsets in stream.loads if split == VAL]
    # Every training load is one global batch of the epoch's plan (epoch e, the trial's seed): new
    # windows each epoch, never an epoch's arrays at once.
    want = [b for epoch in range(2) for b in stream.plan(TRAIN, epoch, config.seed, config.batch_size)]
    assert [len(b) for b in want] == [6, 6, 4] * 2 and len(train) == len(want)
    assert all(np.array_equal(got, expected) for got, expected in zip(train, want))
    assert not set(np.concatenate(want[:3])) & set(np.concatenate(want[3:]))
    # Validation: the fixed prefix each epoch, in batches no larger than a micro-batch (3, 3, 2).
    assert [len(v) for v in val] == [3, 3, 2] * 2
    assert np.array_equal(np.concatenate(val[:3]), np.arange(8) * 16)
    # Token ids reach the model as integers (int32 windows; token_input widens them), a micro-batch
    # at a time: 6 as 3 + 3, the last 4 as 3 + 1.
    assert {dtype for _, dtype in shapes.seen} == {tf.int32}
    assert sorted({n for n, _ in shapes.seen}) == [1, 3]


TWO_DEVICES_SCRIPT = """
    import json
    import numpy as np

    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.builders import gpt
    from aiperf_core.data.text_corpus import embedded_corpus
    from aiperf_core.data.text_stream import TokenStream
    from aiperf_backends.tensorflow import TensorFlowBackend

    backend = TensorFlowBackend()
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)
    weights = backend.export_weights(backend.lower(graph))
    # 23 windows an epoch in batches of 8: 8, 8, 7, sharded 4/4, 4/4, 4/3; micro-batches of 3 make
    # 3+1 on each replica, and 3+1 beside 3 for the last batch.
    stream = TokenStream(embedded_corpus(), 16, 23 * 16, 128)
    runs = {}
    for name, devices, extra in (("one", ("cpu:0",), {}),
                                 ("two", None, {"micro_batch": 3, "checkpoint_blocks": True})):
        model = backend.lower(graph, weights)
        config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(0.05), momentum=0.9, grad_clip=1.0, seed=2,
                             devices=devices, **extra)
        reports = backend.train(model, stream, config)
        runs[name] = (reports, backend.export_weights(model))
    (one, want), (two, got) = runs["one"], runs["two"]
    print(json.dumps({"devices": backend.devices(),
                      "worst": max(float(np.max(np.abs(got[n][p] - want[n][p]))) for n in want for p in want[n]),
                      "counts": [[r.train_images, r.val_images] for r in two],
                      "loss": [[r.loss for r in one], [r.loss for r in two]],
                      "val_loss": [[r.val_loss for r in one], [r.val_loss for r in two]]}))
"""


@pytest.fixture(scope="module", autouse=True)
def two_devices(request):
    """The two-device subprocess (AIPERF_CPU_DEVICES is read when TensorFlow's runtime starts),
    started with the module's first test when its test is selected, so that the in-process tests run beside it
    (one more process, mostly on one core); its test waits for it."""
    yield from beside(request, "test_two_devices_on_a_token_stream_with_accumulation_equal_one_device",
                      _run, TWO_DEVICES_SCRIPT, dict(os.environ), AIPERF_CPU_DEVICES="2")


@pytest.mark.slow
def test_two_devices_on_a_token_stream_with_accumulation_equal_one_device(two_devices):
    r = two_devices.result()
    assert r["devices"] == ["cpu:0", "cpu:1"]
    assert r["counts"] == [[23, 8], [23, 8]]
    assert r["worst"] < TOL
    np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=1e-5)
    np.testing.assert_allclose(r["val_loss"][1], r["val_loss"][0], rtol=1e-5)


def test_device_memory(backend):
    devices = backend.devices()
    gpus = [d for d in devices if d.startswith("gpu")]
    # Every GPU the backend lists has a size; a machine without one has none to report.
    assert set(gpu_memory_limits()) == {tf_device_name(d) for d in gpus}
    assert all(backend.device_memory(d) > 0 for d in gpus)
    if not gpus:
        assert backend.device_memory(devices[0]) == cpu_share_of_ram(len(devices))
        assert backend.device_memory("gpu:0") is None
