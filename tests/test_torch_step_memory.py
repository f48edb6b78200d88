"""The torch backend at the language model's scale (issue 39): streamed text, gradient accumulation,
activation checkpointing, the device's memory, fused AdamW and the compiled GPT step.

Every comparison is between two float32 computations of the same step that differ in summation
order only (micro-batches summed one after another, a block's activations recomputed, shards over
two gloo ranks): they agree to ~1e-6 normwise, so 1e-5 is the bound. The attention key biases are
left out, as the kit leaves them out: their exact gradient is zero, so that they hold rounding
alone, which AdamW (dividing a gradient by its own size) turns into steps of up to the rate.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)

from aiperf_core.backend import Dataset, Schedule, TrainConfig, cpu_share_of_ram
from aiperf_core.builders import gpt, llama
from aiperf_core.data.batch import TRAIN, VAL
from aiperf_core.data.text_corpus import embedded_corpus
from aiperf_core.data.text_stream import TokenStream
from aiperf_core.ir import Graph
from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.feeds import TOKENS, TokenFeed, feed_kind
from aiperf_backends.torch.training import Stepper, adamw_kernel, make_optimizer
from aiperf_conformance.cases import trained_looking_weights

TOL = 1e-5
SEQ, VOCAB = 16, 256


def normwise(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def worst(got: dict, want: dict) -> tuple[float, str]:
    """The largest normwise error of a tensor, and which one; attention key biases left out."""
    return max((normwise(got[n][p], want[n][p]), f"{n}/{p}") for n in want for p in want[n]
               if not (n.endswith("_k") and p == "bias"))


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.fixture(scope="module")
def small_gpt():
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    return graph, trained_looking_weights(graph, 0)


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


def stream(corpus) -> TokenStream:
    return TokenStream(corpus, seq_len=SEQ, epoch_tokens=256, val_tokens=128)


def windows(corpus, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` windows of the embedded corpus's training split: token ids and next tokens, int64."""
    text = np.asarray(corpus.train, np.int64)
    starts = np.random.default_rng(seed).integers(0, len(text) - SEQ - 1, count)
    tokens = text[starts[:, None] + np.arange(SEQ + 1)]
    return tokens[:, :-1], tokens[:, 1:]


ADAMW = dict(optimizer="adamw", weight_decay=0.1, grad_clip=0.5, schedule=Schedule(initial=3e-3), compile="never")


# -- gradient accumulation ---------------------------------------------------------------------------


def one_step(backend, graph, weights, x, y, **config):
    model = backend.lower(graph, weights)
    stepper = Stepper(model, "cpu", TrainConfig(epochs=1, batch_size=len(y), **{**ADAMW, **config}))
    loss = float(stepper.step(torch.from_numpy(x), torch.from_numpy(y), len(y)))
    return loss, model.canonical_grads(), backend.export_weights(model)


@pytest.mark.parametrize("micro_batch", [3, 1])
def test_micro_batches_of_a_step_equal_the_step_on_the_whole_batch(backend, small_gpt, corpus, micro_batch):
    graph, weights = small_gpt
    x, y = windows(corpus, 8, 1)
    whole_loss, whole_grads, whole_weights = one_step(backend, graph, weights, x, y)
    loss, grads, after = one_step(backend, graph, weights, x, y, micro_batch=micro_batch)
    assert loss == pytest.approx(whole_loss, rel=TOL)  # the shard's summed loss, every micro-batch's
    # The gradients the update took (clipped on the global norm: 0.5 is below it) and the update.
    err, where = worst(grads, whole_grads)
    assert err <= TOL, f"gradient {where} differs by {err:.3g}"
    err, where = worst(after, whole_weights)
    assert err <= TOL, f"weight {where} differs by {err:.3g}"
    moved = worst(after, weights)[0]
    assert moved > 100 * TOL  # the step did change the weights


def test_accumulated_training_equals_training_on_whole_batches(backend, small_gpt, corpus):
    """micro_batch 3 over a batch of 8 (micro-batches 3, 3, 2), and over the epoch's short last batch
    of 4 (3, 1), equals training without accumulation: AdamW, decay, an engaged clip, two epochs."""
    graph, weights = small_gpt
    x, y = windows(corpus, 24, 2)
    data = Dataset(x[:20], y[:20], x[20:], y[20:], classes=VOCAB)
    runs = {}
    for micro_batch in (None, 3):
        model = backend.lower(graph, weights)
        reports = backend.train(model, data, TrainConfig(epochs=2, batch_size=8, micro_batch=micro_batch, **ADAMW))
        runs[micro_batch] = reports, backend.export_weights(model)
    (plain, plain_weights), (accumulated, accumulated_weights) = runs[None], runs[3]
    for a, b in zip(accumulated, plain):
        assert a.train_images == b.train_images == 20
        assert a.loss == pytest.approx(b.loss, rel=TOL)
        assert a.val_loss == pytest.approx(b.val_loss, rel=TOL)
    err, where = worst(accumulated_weights, plain_weights)
    assert err <= TOL, f"weight {where} differs by {err:.3g}"


def test_fp16_loss_scaling_scales_every_micro_batch_and_unscales_once(backend, small_gpt, corpus):
    """fp16 (autocast, GradScaler): each micro-batch's loss is scaled, their gradients summed, then
    unscaled once for the clip and the update; the step equals the whole batch's to fp16's rounding
    of the two different matrix shapes."""
    graph, weights = small_gpt
    x, y = windows(corpus, 8, 3)
    _, whole_grads, whole_weights = one_step(backend, graph, weights, x, y, precision="fp16")
    _, grads, after = one_step(backend, graph, weights, x, y, precision="fp16", micro_batch=3)
    assert worst(grads, whole_grads)[0] <= 2e-3
    assert worst(after, whole_weights)[0] <= 2e-3
    # unscaled: the gradients are those of fp32 to fp16's rounding, not 65536 times them
    _, fp32_grads, _ = one_step(backend, graph, weights, x, y)
    assert worst(grads, fp32_grads)[0] <= 2e-2


# -- activation checkpointing --------------------------------------------------------------------------


def saved_for_backward(model, x, y, checkpoint: bool) -> int:
    """Elements autograd keeps for the backward pass of one training loss (its saved tensors)."""
    saved = []
    model.train()
    model.checkpoint_blocks = checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            model.training_loss(x, y, 0.0)
    finally:
        model.checkpoint_blocks = False
    return sum(saved)


def test_checkpointed_blocks_keep_less_and_give_the_same_gradients(backend, corpus):
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB)
    weights = trained_looking_weights(graph, 1)
    assert len(graph.blocks()) == 2
    x, y = windows(corpus, 8, 4)
    model = backend.lower(graph, weights)
    plain = saved_for_backward(model, torch.from_numpy(x), torch.from_numpy(y), False)
    checkpointed = saved_for_backward(model, torch.from_numpy(x), torch.from_numpy(y), True)
    assert checkpointed < plain / 2  # each block's input instead of its activations
    _, whole_grads, whole_weights = one_step(backend, graph, weights, x, y)
    _, grads, after = one_step(backend, graph, weights, x, y, checkpoint_blocks=True)
    assert worst(grads, whole_grads)[0] <= TOL
    assert worst(after, whole_weights)[0] <= TOL
    # with accumulation too: the kit's gpt_checkpointing check trains micro-batches of 3
    _, grads, after = one_step(backend, graph, weights, x, y, checkpoint_blocks=True, micro_batch=3)
    assert worst(grads, whole_grads)[0] <= TOL
    assert worst(after, whole_weights)[0] <= TOL
    assert model.checkpoint_blocks is False  # the step's setting does not outlive it


def gpt_with_dropout(rate: float) -> Graph:
    """A one-block GPT with dropout after the MLP's GELU: inside the checkpointed block."""
    spec = gpt(layers=1, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB).to_dict()
    nodes = spec["nodes"]
    at = next(k for k, n in enumerate(nodes) if n["id"] == "h0_gelu")
    nodes.insert(at + 1, {"id": "h0_drop", "op": "dropout", "inputs": ["h0_gelu"], "attrs": {"rate": rate}})
    next(n for n in nodes if n["id"] == "h0_fc2")["inputs"] = ["h0_drop"]
    return Graph.from_dict(spec)


def test_recomputed_dropout_draws_the_forward_masks(backend, corpus):
    """Dropout drawing from the step's own generator (run_epochs seeds one per rank): the block's
    recomputation in the backward pass draws the same masks, so the gradients are plain training's."""
    graph = gpt_with_dropout(0.5)
    assert [b.nodes[-3:] for b in graph.blocks()] == [("h0_drop", "h0_fc2", "h0_res2")]
    weights = trained_looking_weights(graph, 2)
    x, y = (torch.from_numpy(a) for a in windows(corpus, 4, 5))
    grads = {}
    for checkpoint in (False, True):
        model = backend.lower(graph, weights)
        model.train()
        model.checkpoint_blocks = checkpoint
        with model.dropout_masks(torch.Generator().manual_seed(7)):
            model.training_loss(x, y, 0.0).backward()
        grads[checkpoint] = model.canonical_grads()
    assert worst(grads[True], grads[False])[0] <= TOL
    # and the masks are not all ones: a different generator gives other gradients
    model = backend.lower(graph, weights)
    with model.dropout_masks(torch.Generator().manual_seed(8)):
        model.training_loss(x, y, 0.0).backward()
    assert worst(model.canonical_grads(), grads[False])[0] > 1e-3


def test_an_image_graph_has_no_blocks_and_trains_alike_with_the_flag(backend):
    from aiperf_core.builders import resnet_small

    graph = resnet_small((8, 8, 3), 3)
    weights = trained_looking_weights(graph, 0)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (6,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 3, 6)
    assert "run_block" not in backend.lower(graph, weights).source
    _, plain, _ = one_step(backend, graph, weights, x, y)
    _, flagged, _ = one_step(backend, graph, weights, x, y, checkpoint_blocks=True)
    assert worst(flagged, plain)[0] == 0.0


# -- the compiled step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_the_dense_step_compiles_to_one_graph_without_a_break(backend, small_gpt, corpus, family, checkpoint):
    """torch._dynamo.explain of the step's loss (what Stepper compiles): dynamo only, no code
    generated (inductor's CPU build of a GPT step takes minutes here, docs/backends/torch.md). The Llama
    has grouped-query attention, rotary tables read from buffers, RMS norm and SwiGLU."""
    if family == "gpt":
        graph, weights = small_gpt
    else:
        graph = llama(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=SEQ, vocab=VOCAB)
        weights = trained_looking_weights(graph, 0)
    model = backend.lower(graph, weights)
    x, y = (torch.from_numpy(a) for a in windows(corpus, 4, 6))
    model.train()
    model.checkpoint_blocks = checkpoint
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model._training_loss)(model, x, y, 0.0)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


# -- streamed text -------------------------------------------------------------------------------------


def test_a_token_stream_is_fed_a_batch_at_a_time_as_int64_ids(corpus):
    data = stream(corpus)
    assert feed_kind(data, torch.device("cpu")) == TOKENS
    feed = TokenFeed(data, TRAIN, 3, 5, torch.device("cpu"), rank=1, world=2)
    got = list(feed.epoch(1))
    want = list(data.iterate(TRAIN, 1, 3, 5, rank=1, world=2))
    assert [b.size for b in got] == [b.size for b in want] == [5, 5, 5, 1]
    for g, w in zip(got, want):
        assert g.x.dtype == g.y.dtype == torch.int64
        assert np.array_equal(g.x.numpy(), w.x) and np.array_equal(g.y.numpy(), w.y)


def test_training_on_a_token_stream_reads_new_windows_a_batch_at_a_time(backend, small_gpt, corpus):
    graph, weights = small_gpt
    data = stream(corpus)
    assert (data.train_images, data.val_images) == (16, 8)
    loads = []
    load = data.load

    def counted(split, offsets, *args):
        loads.append((split, np.asarray(offsets).copy()))
        return load(split, offsets, *args)

    data.load = counted
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, TrainConfig(epochs=3, batch_size=4, seed=5, **ADAMW))
    assert [r.train_images for r in reports] == [16] * 3  # sequences an epoch, not tokens or the split
    assert [r.val_images for r in reports] == [8] * 3
    assert reports[-1].val_loss < reports[0].val_loss
    train = [offsets for split, offsets in loads if split == TRAIN]
    assert len(train) == 12 and max(len(o) for o in train) == 4  # a batch in memory, never the epoch
    epochs = [np.concatenate(train[4 * e:4 * e + 4]) for e in range(3)]
    assert len(set(np.concatenate(epochs).tolist())) == 48  # every epoch new windows
    assert all(np.array_equal(np.sort(e), np.sort(np.concatenate(list(data.plan(TRAIN, k, 5, 4)))))
               for k, e in enumerate(epochs))
    val = [offsets for split, offsets in loads if split == VAL]
    assert all(np.array_equal(v, val[0]) for v in val[1:len(val)]) and len(val) == 3  # the fixed prefix, per epoch


@pytest.mark.slow
def test_two_devices_on_a_token_stream_with_micro_batches_equal_one_device(backend, small_gpt, corpus):
    """Two gloo ranks, micro_batch 3, batches of 7 over 16 windows (7, 7, 2): rank 0's shards of
    4 run as micro-batches 3 and 1, rank 1's of 3 as one and an empty one; equal to one device."""
    from aiperf_backends.torch.distributed import train_data_parallel

    graph, weights = small_gpt
    config = dict(epochs=2, batch_size=7, seed=1, **ADAMW)
    one, two = backend.lower(graph, weights), backend.lower(graph, weights)
    single = backend.train(one, stream(corpus), TrainConfig(**config))
    parallel = train_data_parallel(two, stream(corpus), TrainConfig(micro_batch=3, **config), ["cpu:0", "cpu:1"])
    for a, b in zip(parallel, single):
        assert a.train_images == b.train_images == 16
        assert a.val_images == b.val_images == 8
        assert a.loss == pytest.approx(b.loss, rel=TOL)
        assert a.val_loss == pytest.approx(b.val_loss, rel=TOL)
    err, where = worst(backend.export_weights(two), backend.export_weights(one))
    assert err <= TOL, f"weight {where} differs by {err:.3g}"


# -- the device ----------------------------------------------------------------------------------------


def test_device_memory_is_a_cuda_devices_total_and_a_cpus_share_of_ram(backend, monkeypatch):
    assert backend.device_memory("cpu") == cpu_share_of_ram(len(backend.devices()))
    asked = []

    def properties(device):
        asked.append(device)
        return SimpleNamespace(total_memory=141 << 30)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert backend.device_memory("cuda:1") == 141 << 30
    assert asked == [torch.device("cuda", 1)]


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere(small_gpt, backend):
    graph, weights = small_gpt
    params = list(backend.lower(graph, weights).parameters())
    optimizer = make_optimizer(params, TrainConfig(epochs=1, batch_size=1, optimizer="adamw"))
    assert all(g["foreach"] and not g["fused"] for g in optimizer.param_groups)
    on_cuda = [SimpleNamespace(device=torch.device("cuda", 0), is_floating_point=lambda: True)] * 2
    assert adamw_kernel(on_cuda) == {"fused": True}
    assert adamw_kernel(on_cuda + params[:1]) == {"foreach": True}  # one CPU tensor: no fused kernel


def test_a_compiled_step_of_micro_batches_and_checkpointed_blocks_trains_as_eager(backend, small_gpt, corpus,
                                                                                 monkeypatch):
    """The compiled loss (dynamo and AOTAutograd's graphs, run by aot_eager: inductor's CPU build
    takes minutes here) under accumulation and checkpointing: micro-batches of 3 compiled, the
    short one of 2 eager, one graph traced once, no break, the same weights as eager."""
    graph, weights = small_gpt
    config = dict(epochs=1, batch_size=8, micro_batch=3, checkpoint_blocks=True, seed=2, **ADAMW)
    eager = backend.lower(graph, weights)
    backend.train(eager, stream(corpus), TrainConfig(**config))
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, mode: compile_(fn, backend="aot_eager", dynamic=dynamic))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = backend.lower(graph, weights)
    reports = backend.train(compiled, stream(corpus), TrainConfig(**{**config, "compile": "always"}))
    assert reports[0].compile_seconds > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    err, where = worst(backend.export_weights(compiled), backend.export_weights(eager))
    assert err <= TOL, f"weight {where} differs by {err:.3g}"


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_fused_adamw_step_equals_the_foreach_one(backend, small_gpt, corpus, monkeypatch, precision):
    """The step as CUDA runs it, with fused AdamW (torch's fused kernel has a CPU build too): under
    accumulation and the clip, and for fp16 with GradScaler handing the fused kernel its scale and
    overflow flag, the update equals the foreach one's."""
    from aiperf_backends.torch import training

    graph, weights = small_gpt
    x, y = windows(corpus, 8, 7)
    _, _, foreach = one_step(backend, graph, weights, x, y, precision=precision, micro_batch=3)
    monkeypatch.setattr(training, "adamw_kernel", lambda params: {"fused": True})
    model = backend.lower(graph, weights)
    stepper = Stepper(model, "cpu", TrainConfig(epochs=1, batch_size=8, precision=precision, micro_batch=3, **ADAMW))
    assert all(g["fused"] for g in stepper.optimizer.param_groups)
    stepper.step(torch.from_numpy(x), torch.from_numpy(y), 8)
    err, where = worst(backend.export_weights(model), foreach)
    assert err <= TOL, f"weight {where} differs by {err:.3g}"
