"""The MindSpore backend at LM scale (issue #39): TokenStream training, gradient accumulation, activation
checkpointing with mindspore.recompute, device memory."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mindspore")

from aiperf_core.backend import Dataset, Schedule, TrainConfig, cpu_share_of_ram  # noqa: E402
from aiperf_core.builders import gpt  # noqa: E402
from aiperf_core.data.text_corpus import embedded_corpus  # noqa: E402
from aiperf_core.data.text_stream import TokenStream  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402

SEQ, VOCAB = 16, 256


def _backend():
    from aiperf_backends.mindspore import MindSporeBackend

    return MindSporeBackend()


def _tokens(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, SEQ)), rng.integers(0, VOCAB, (n, SEQ))


def _adamw(**options) -> TrainConfig:
    return TrainConfig(epochs=1, batch_size=8, seed=4, optimizer="adamw", weight_decay=0.1, grad_clip=0.5,
                       schedule=Schedule(initial=0.01), **options)


def _close(one: dict, other: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every weight close, but the attention key biases: their exact gradient is zero, and AdamW turns
    rounding into steps of up to the learning rate (the kit leaves them out too)."""
    for node_id, params in one.items():
        for name, value in params.items():
            if node_id.endswith("_k") and name == "bias":
                continue
            np.testing.assert_allclose(other[node_id][name], value, rtol=rtol, atol=atol, err_msg=f"{node_id}.{name}")


# -- activation checkpointing -----------------------------------------------------------------------


def test_checkpointing_recomputes_each_block_and_gives_the_same_gradients():
    from mindspore import Tensor

    from aiperf_backends.mindspore.training import gradient_function, targets

    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    model = _backend().lower(graph, init_weights(graph, seed=0))
    assert len(model.block_spans) == len(graph.blocks()) == 2
    runs = []
    block = model._block

    def counting(*args):
        forward = block(*args)

        def run(x):
            runs.append(1)
            return forward(x)

        return run

    model._block = counting
    x, y = _tokens(4)
    params = [p for _, _, p in model.trainable()]
    model.set_train(True)

    def gradients(checkpoint: bool):
        with model.checkpointing(checkpoint):
            (_, total), grads = gradient_function(model, params)(model.to_cell_layout(x), targets(y, VOCAB, 0.1), None,
                                                                 Tensor(np.float32(0.25)))
        return float(total.asnumpy()), [g.asnumpy() for g in grads]

    plain_loss, plain = gradients(False)
    assert runs == []  # the plain pass runs the plan, never a block function
    loss, checkpointed = gradients(True)
    assert len(runs) == 4  # each block: its forward pass, and again in the backward pass
    assert loss == plain_loss
    for a, b in zip(plain, checkpointed):
        np.testing.assert_array_equal(b, a)
    assert model.checkpoint_blocks is False  # the context restores it


def test_backend_trains_identically_with_checkpointing():
    backend = _backend()
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    x, y = _tokens(11)
    data = Dataset(x, y, x[:4], y[:4], VOCAB)
    results = []
    for checkpoint in (False, True):
        model = backend.lower(graph, init_weights(graph, seed=1))
        reports = backend.train(model, data, _adamw(checkpoint_blocks=checkpoint))
        results.append((reports, backend.export_weights(model)))
    (plain_reports, plain), (reports, weights) = results
    _close(plain, weights, rtol=1e-6, atol=1e-7)
    assert reports[0].loss == pytest.approx(plain_reports[0].loss, rel=1e-6)


# -- gradient accumulation --------------------------------------------------------------------------


def test_accumulation_equals_one_step_on_the_whole_batch(monkeypatch):
    from aiperf_backends.mindspore import training

    backend = _backend()
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    x, y = _tokens(11)  # batches of 8 and 3: micro-batches 3, 3, 2 and then 3
    data = Dataset(x, y, x[:4], y[:4], VOCAB)
    start = init_weights(graph, seed=1)
    model = backend.lower(graph, start)
    whole_reports = backend.train(model, data, _adamw())
    whole = backend.export_weights(model)
    sizes, updates = [], []
    accumulate, apply = training.Stepper.accumulate, training.Stepper.apply
    monkeypatch.setattr(training.Stepper, "accumulate",
                        lambda self, x, *args: sizes.append(len(x)) or accumulate(self, x, *args))
    monkeypatch.setattr(training.Stepper, "apply", lambda self: updates.append(len(sizes)) or apply(self))
    model = backend.lower(graph, start)
    reports = backend.train(model, data, _adamw(micro_batch=3))
    assert sizes == [3, 3, 2, 3] and updates == [3, 4]  # one update per global batch
    assert reports[0].train_images == whole_reports[0].train_images == 11
    assert reports[0].loss == pytest.approx(whole_reports[0].loss, rel=1e-5)
    _close(whole, backend.export_weights(model))
    moved = max(float(np.abs(whole[n][p] - start[n][p]).max()) for n in whole for p in whole[n])
    assert moved > 1e-3  # the steps moved the weights: equality is not that of two no-ops


# -- streamed text, device memory -------------------------------------------------------------------


def test_token_stream_trial_reports_its_counts(monkeypatch):
    stream = TokenStream(embedded_corpus(), seq_len=16, epoch_tokens=256, val_tokens=128)
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)
    backend = _backend()
    model = backend.lower(graph, init_weights(graph, seed=0))
    from aiperf_core.data import stream as stream_module

    batches = []

    original = stream_module.train_batches

    def recording(data, *args, **kwargs):
        assert data is stream  # the stream itself, never an epoch copied into arrays
        for batch in original(data, *args, **kwargs):
            assert batch.x.dtype == np.int32 and batch.x.shape[1:] == (16,)
            batches.append(len(batch.x))
            yield batch

    monkeypatch.setattr(stream_module, "train_batches", recording)
    config = TrainConfig(epochs=3, batch_size=5, seed=2, optimizer="adamw", schedule=Schedule(initial=0.01))
    reports = backend.train(model, stream, config)
    assert batches == [5, 5, 5, 1] * 3
    for report in reports:
        assert (report.train_images, report.val_images) == (stream.train_images, stream.val_images) == (16, 8)
        assert report.skipped_images == 0 and np.isfinite(report.loss)
    assert reports[-1].val_loss < reports[0].val_loss


def test_device_memory():
    backend = _backend()
    assert backend.device_memory(backend.devices()[0]) == cpu_share_of_ram(len(backend.devices()))
    # Another NPU than this process's own: MindSpore's API answers for the current device only.
    assert backend.device_memory("Ascend:5") is None
    assert backend.device_memory("GPU:0") is None  # no GPU here: cannot tell, never an error
