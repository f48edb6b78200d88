"""The NumPy reference backend at LM scale (issue #39): gradient accumulation, activation
checkpointing in the executor, and training on a TokenStream."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt, resnet_small
from aiperf_core.data.text_corpus import embedded_corpus
from aiperf_core.data.text_stream import TokenStream
from aiperf_core.ir import Graph, Node
from aiperf_core.weights import init_weights
from aiperf_numpy.backend import NumpyBackend
from aiperf_numpy.executor import backward, loss_and_grads, run

SEQ, VOCAB = 16, 256


def _tokens(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, SEQ)), rng.integers(0, VOCAB, (n, SEQ))


def _with_dropout(graph: Graph, rate: float = 0.3) -> Graph:
    """`graph` with a dropout after every gelu, inside the blocks that checkpointing recomputes."""
    nodes = []
    for node in graph.nodes:
        nodes.append(Node(node.id, node.op, tuple(f"{i}_drop" if graph[i].op == "gelu" else i for i in node.inputs),
                          node.attrs))
        if node.op == "gelu":
            nodes.append(Node(f"{node.id}_drop", "dropout", (node.id,), {"rate": rate}))
    return Graph(nodes, name=graph.name)


def _assert_same(one: dict, other: dict) -> None:
    assert one.keys() == other.keys()
    for node_id, params in one.items():
        assert params.keys() == other[node_id].keys()
        for name, value in params.items():
            np.testing.assert_array_equal(other[node_id][name], value, err_msg=f"{node_id}.{name}")


def _train(graph: Graph, data: Dataset, **options):
    backend = NumpyBackend()
    model = backend.lower(graph, init_weights(graph, seed=1))
    config = TrainConfig(epochs=1, batch_size=8, seed=4, optimizer="adamw", weight_decay=0.1, grad_clip=0.5,
                         schedule=Schedule(initial=0.01), **options)
    reports = backend.train(model, data, config)
    return reports, backend.export_weights(model)


# -- activation checkpointing -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_checkpointing_gives_identical_gradients(dtype):
    graph = _with_dropout(gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB))
    weights = init_weights(graph, seed=0)
    x, y = _tokens(4)
    plain = loss_and_grads(graph, weights, x, y, label_smoothing=0.1, dtype=dtype, seed=7)
    checkpointed = loss_and_grads(graph, weights, x, y, label_smoothing=0.1, dtype=dtype, seed=7,
                                  checkpoint_blocks=True)
    assert checkpointed[0] == plain[0]
    _assert_same(plain[1], checkpointed[1])


def test_checkpointed_trace_keeps_block_inputs_and_recomputes_in_backward():
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    weights = init_weights(graph, seed=0)
    x, _ = _tokens(2)
    plain = run(graph, weights, x, training=True)
    trace = run(graph, weights, x, training=True, checkpoint_blocks=True)
    blocks = graph.blocks()
    assert len(blocks) == 2 and set(trace.replays) == {b.output for b in blocks}
    inner = {nid for b in blocks for nid in b.nodes[:-1]}
    kept = set(trace.outputs)
    assert kept == set(plain.outputs) - inner
    assert {b.input for b in blocks} <= kept
    grad_output = np.random.default_rng(1).standard_normal(plain.output.shape)
    dx_plain, grads_plain = backward(plain, grad_output)
    for _ in range(2):  # a checkpointed trace can be backpropagated again: its replays start afresh
        dx, grads = backward(trace, grad_output)
        np.testing.assert_array_equal(dx, dx_plain)
        _assert_same(grads_plain, grads)
        assert set(trace.outputs) == kept and not set(trace.caches) & inner  # recomputed, then dropped


def test_checkpointing_lowers_the_peak_memory_of_a_step():
    graph = gpt(layers=4, hidden=64, heads=4, seq_len=32, vocab=VOCAB)
    weights = init_weights(graph, seed=0)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, VOCAB, (8, 32)), rng.integers(0, VOCAB, (8, 32))

    def peak(checkpoint_blocks: bool) -> int:
        tracemalloc.start()
        try:
            loss_and_grads(graph, weights, x, y, dtype=np.float32, checkpoint_blocks=checkpoint_blocks)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    plain, checkpointed = peak(False), peak(True)
    # Four blocks' activations against one block's: measured 20.8 MB against 11.0 MB.
    assert checkpointed < 0.7 * plain, (checkpointed, plain)


def test_checkpointing_changes_nothing_for_an_image_graph():
    graph = resnet_small((8, 8, 3), 3)
    assert graph.blocks() == []
    weights = init_weights(graph, seed=0)
    x = np.random.default_rng(0).standard_normal((4, 8, 8, 3))
    y = np.array([0, 1, 2, 0])
    trace = run(graph, weights, x, training=True, checkpoint_blocks=True)
    assert trace.replays == {} and set(trace.outputs) == {n.id for n in graph.nodes}
    plain = loss_and_grads(graph, weights, x, y)
    checkpointed = loss_and_grads(graph, weights, x, y, checkpoint_blocks=True)
    assert plain[0] == checkpointed[0]
    _assert_same(plain[1], checkpointed[1])


def test_backend_trains_identically_with_checkpointing():
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    x, y = _tokens(11)
    data = Dataset(x, y, x[:4], y[:4], VOCAB)
    plain_reports, plain = _train(graph, data)
    reports, weights = _train(graph, data, checkpoint_blocks=True)
    _assert_same(plain, weights)
    assert [r.loss for r in reports] == [r.loss for r in plain_reports]


# -- gradient accumulation --------------------------------------------------------------------------


def test_accumulation_equals_one_step_on_the_whole_batch(monkeypatch):
    import aiperf_numpy.backend as numpy_backend

    graph = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    x, y = _tokens(11)  # batches of 8 and 3: micro-batches 3, 3, 2 and then 3
    data = Dataset(x, y, x[:4], y[:4], VOCAB)
    whole_reports, whole = _train(graph, data)
    sizes = []
    real = numpy_backend.loss_and_grads

    def recording(graph, weights, x, labels, **kwargs):
        sizes.append(len(x))
        return real(graph, weights, x, labels, **kwargs)

    monkeypatch.setattr(numpy_backend, "loss_and_grads", recording)
    reports, accumulated = _train(graph, data, micro_batch=3)
    assert sizes == [3, 3, 2, 3]
    assert reports[0].train_images == whole_reports[0].train_images == 11
    assert reports[0].loss == pytest.approx(whole_reports[0].loss, rel=1e-6)
    for node_id, params in whole.items():
        for name, value in params.items():
            np.testing.assert_allclose(accumulated[node_id][name], value, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{node_id}.{name}")
    changed = max(float(np.abs(whole[n][p] - init_weights(graph, seed=1)[n][p]).max()) for n in whole for p in whole[n])
    assert changed > 1e-3  # the steps moved the weights: equality is not that of two no-ops


def test_accumulated_gradients_are_the_whole_batch_gradients():
    from aiperf_numpy.backend import _batch_gradients

    graph = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    model = NumpyBackend().lower(graph, init_weights(graph, seed=0))
    x, y = _tokens(8)
    whole_loss, whole = _batch_gradients(model, x, y, TrainConfig(epochs=1, batch_size=8), seed=0)
    loss, accumulated = _batch_gradients(model, x, y, TrainConfig(epochs=1, batch_size=8, micro_batch=3), seed=0)
    assert loss == pytest.approx(whole_loss, rel=1e-6)
    for node_id, params in whole.items():
        for name, value in params.items():
            np.testing.assert_allclose(accumulated[node_id][name], value, rtol=1e-4, atol=1e-7,
                                       err_msg=f"{node_id}.{name}")


# -- streamed text ----------------------------------------------------------------------------------


def test_token_stream_trial_reports_its_counts():
    stream = TokenStream(embedded_corpus(), seq_len=16, epoch_tokens=256, val_tokens=128)
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)
    backend = NumpyBackend()
    model = backend.lower(graph, init_weights(graph, seed=0))
    config = TrainConfig(epochs=3, batch_size=5, seed=2, optimizer="adamw", schedule=Schedule(initial=0.01),
                         micro_batch=2, checkpoint_blocks=True)
    reports = backend.train(model, stream, config)
    assert [r.epoch for r in reports] == [0, 1, 2]
    for report in reports:
        assert (report.train_images, report.val_images) == (stream.train_images, stream.val_images) == (16, 8)
        assert report.skipped_images == 0 and np.isfinite(report.loss) and np.isfinite(report.val_loss)
    assert reports[-1].val_loss < reports[0].val_loss
