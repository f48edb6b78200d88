"""The jax backend at the language model's accelerator scale (issue 39): gradient accumulation equal
to one step on the whole batch, activation checkpointing per block with the same gradients, a trial
on streamed text (a TokenStream), both on two host devices, and device_memory.

The two-device test runs in a subprocess: AIPERF_CPU_DEVICES must be read before jax initialises.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import jax  # noqa: E402  (`make test` installs jax: missing it is a failure, never a skip)
import jax.numpy as jnp  # noqa: E402

from aiperf_core.backend import Backend, Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import gpt, resnet_small  # noqa: E402
from aiperf_core.data.batch import TRAIN, VAL  # noqa: E402
from aiperf_core.data.text_corpus import embedded_corpus  # noqa: E402
from aiperf_core.data.text_stream import TokenStream  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402
from aiperf_backends.jax import JaxBackend  # noqa: E402
from aiperf_backends.jax import distributed, training  # noqa: E402
from aiperf_backends.jax.lowering import lower_graph  # noqa: E402
from beside import beside

ROOT = Path(__file__).resolve().parents[1]
SMALL_GPT = dict(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)


def _largest_difference(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(a[n][p], np.float64) - b[n][p]))) for n in b for p in b[n])


def _train(graph, weights, data, **config):
    backend = JaxBackend()
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, TrainConfig(**config))
    return model, reports


@pytest.mark.slow
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch():
    graph = gpt(**SMALL_GPT)
    weights = init_weights(graph, seed=1)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (20, 16)), rng.integers(0, 256, (20, 16))
    data = Dataset(x, y, x[:4], y[:4], 256)
    # batches 8, 8, 4: micro-batches 3, 3, 2 and then 3, 1 (the short last batch, its own weights);
    # the clip (on the global norm: about 11 to 20 here) binds on some steps and not on others, so both
    # the sum of the micro-batches and the clip after it are seen
    config = dict(epochs=2, batch_size=8, schedule=Schedule(initial=0.05), momentum=0.9, grad_clip=15.0)
    whole, whole_reports = _train(graph, weights, data, **config)
    micro, micro_reports = _train(graph, weights, data, micro_batch=3, **config)

    moved = _largest_difference(whole.export_canonical(), weights)
    assert moved > 1e-2  # the steps did something to compare
    assert _largest_difference(micro.export_canonical(), whole.export_canonical()) < 1e-5
    np.testing.assert_allclose([r.loss for r in micro_reports], [r.loss for r in whole_reports], rtol=1e-6)
    np.testing.assert_allclose([r.val_loss for r in micro_reports], [r.val_loss for r in whole_reports], rtol=1e-6)
    assert [r.train_images for r in micro_reports] == [20, 20]

    # One executable per (global batch, micro-batch length): (8, 3), (8, 2), (4, 3), (4, 1), traced in
    # the first epoch only; one update; the fused step never ran.
    traces = {key[0]: fn.traces for key, fn in micro.cache.items() if isinstance(fn, training.Traced)}
    assert traces == {"train": 0, "micro": 4, "update": 1, "eval": 1}, traces
    assert micro_reports[0].compile_seconds > 0.0 and micro_reports[1].compile_seconds == 0.0
    # A micro_batch as large as the batch is the fused step (compiled already): nothing accumulates.
    JaxBackend().train(whole, data, TrainConfig(micro_batch=8, **config))
    traces = {key[0]: fn.traces for key, fn in whole.cache.items() if isinstance(fn, training.Traced)}
    assert traces == {"train": 2, "eval": 1}, traces


def step_products(graph, precision: str = "fp32", checkpoint_blocks: bool = False) -> list[str]:
    """The dots of the jitted training step (forward and backward), StableHLO."""
    model = lower_graph(graph, init_weights(graph, seed=0), "fp32")
    step = training.make_train_step(graph, precision, 0.9, 0.0, checkpoint_blocks=checkpoint_blocks)
    x = jnp.zeros((2,) + graph.input_shape, jnp.int32)
    text = step.jitted.lower(model.params, model.state, model.params, x, x, np.float32(0.1), jax.random.PRNGKey(0),
                             np.int32(0)).as_text()
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line]


def assert_checkpointed_blocks_give_the_plain_gradients(graph, model, x, y):
    """The mean token loss of the lowered `model` of `graph` and its gradients on (x, y), with the graph's blocks
    checkpointed and without; returns the jaxprs of the two gradients (plain, checkpointed)."""
    def loss_and_grads(checkpoint_blocks):
        def loss(params):
            return training.summed_loss(graph, params, model.state, x, y, 0.1,
                                        checkpoint_blocks=checkpoint_blocks)[0] / y.size
        return jax.value_and_grad(loss)(model.params), jax.make_jaxpr(jax.grad(loss))(model.params)

    (plain_loss, plain), plain_jaxpr = loss_and_grads(False)
    (kept_loss, kept), kept_jaxpr = loss_and_grads(True)
    assert float(kept_loss) == float(plain_loss)
    for node, params in plain.items():
        for name, value in params.items():
            np.testing.assert_allclose(kept[node][name], value, rtol=1e-6, atol=1e-8, err_msg=f"{node}.{name}")
    return plain_jaxpr, kept_jaxpr


@pytest.mark.slow
def test_checkpointed_blocks_give_the_same_gradients_and_recompute_each_block():
    graph = gpt(layers=2, hidden=16, heads=2, seq_len=6, vocab=13)
    assert len(graph.blocks()) == 2
    weights = init_weights(graph, seed=3)
    model = lower_graph(graph, weights, "fp32")
    rng = np.random.default_rng(4)
    x, y = (jnp.asarray(rng.integers(0, 13, (3, 6)), jnp.int32) for _ in range(2))
    plain_jaxpr, kept_jaxpr = assert_checkpointed_blocks_give_the_plain_gradients(graph, model, x, y)
    # The backward pass recomputes each block (jax.checkpoint's primitive, differentiated), and
    # nothing is recomputed without the flag.
    recomputed = re.compile(r"remat\w*\[\s*differentiated=True")
    assert len(recomputed.findall(str(kept_jaxpr))) == 2 and not recomputed.findall(str(plain_jaxpr))

    # The step recomputes, per block, the forward products its backward reads: q, k, v, attention's
    # two, the projection and the first MLP layer (the second one's output is read by nothing but
    # the residual add, whose gradient does not need it), all still IEEE fp32.
    plain_products = step_products(graph)
    kept_products = step_products(graph, checkpoint_blocks=True)
    assert len(kept_products) == len(plain_products) + 2 * 7
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in kept_products)

    # train(): the same weights with and without, AdamW (what the LM trains with); one batch of 3 an epoch,
    # so one step compiled per model
    data = Dataset(np.asarray(x), np.asarray(y), np.asarray(x), np.asarray(y), 13)
    config = dict(epochs=2, batch_size=3, optimizer="adamw", schedule=Schedule(initial=1e-2))
    plain_model, plain_reports = _train(graph, weights, data, **config)
    kept_model, kept_reports = _train(graph, weights, data, checkpoint_blocks=True, **config)
    assert _largest_difference(kept_model.export_canonical(), plain_model.export_canonical()) < 1e-5
    np.testing.assert_allclose([r.loss for r in kept_reports], [r.loss for r in plain_reports], rtol=1e-6)


def test_an_image_graph_has_no_blocks_and_the_flag_changes_nothing():
    graph = resnet_small((8, 8, 3), 3)
    model = lower_graph(graph, init_weights(graph, seed=0), "fp32")
    x = jnp.asarray(np.random.default_rng(0).normal(0, 1, (2, 8, 8, 3)), jnp.float32)
    y = jnp.asarray([0, 2], jnp.int32)

    def jaxpr(checkpoint_blocks):
        return str(jax.make_jaxpr(jax.grad(lambda p: training.summed_loss(
            graph, p, model.state, x, y, 0.0, checkpoint_blocks=checkpoint_blocks)[0]))(model.params))

    assert graph.blocks() == [] and jaxpr(True) == jaxpr(False)


class RecordingStream(TokenStream):
    """A TokenStream that records what the backend asked of it and the batches it handed out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[tuple] = []
        self.loaded: list[tuple] = []

    def iterate(self, split, epoch, seed, batch_size, rank=0, world=1):
        self.asked.append((split, epoch, seed, batch_size, rank, world))
        for batch in super().iterate(split, epoch, seed, batch_size, rank, world):
            self.loaded.append((split, batch.x.shape, batch.x.dtype.name, batch.x[:, 0].tolist()))
            yield batch


def test_a_token_stream_trial_trains_on_new_windows_a_batch_at_a_time():
    stream = RecordingStream(embedded_corpus(), seq_len=16, epoch_tokens=256, val_tokens=128)
    assert (stream.train_images, stream.val_images) == (16, 8)
    graph = gpt(**SMALL_GPT)
    _, reports = _train(graph, init_weights(graph, seed=0), stream, epochs=3, batch_size=5, seed=7,
                        optimizer="adamw", schedule=Schedule(initial=1e-2))
    assert [(r.train_images, r.val_images, r.skipped_images) for r in reports] == [(16, 8, 0)] * 3
    assert reports[-1].loss < reports[0].loss and reports[-1].val_loss < reports[0].val_loss
    # epoch e of the trial is the stream's epoch e under the trial's seed; validation its fixed prefix
    assert [a for a in stream.asked if a[0] == TRAIN] == [(TRAIN, e, 7, 5, 0, 1) for e in range(3)]
    assert [a for a in stream.asked if a[0] == VAL] == [(VAL, 0, 0, training.PREDICT_BATCH, 0, 1)] * 3
    # int32 ids, never more than a batch read at once (16 windows: 5, 5, 5, 1)
    train_loads = [load for load in stream.loaded if load[0] == TRAIN]
    assert [shape for _, shape, _, _ in train_loads] == [(5, 16)] * 3 + [(1, 16)] + [(5, 16)] * 3 + [(1, 16)] \
        + [(5, 16)] * 3 + [(1, 16)]
    assert {dtype for _, _, dtype, _ in stream.loaded} == {"int32"}
    first_tokens = [sum((load[3] for load in train_loads[4 * e:4 * e + 4]), []) for e in range(3)]
    assert first_tokens[0] != first_tokens[1] != first_tokens[2]  # new windows every epoch


_TWO_DEVICES = """
    import json, re
    import jax
    import numpy as np
    from aiperf_backends.jax import JaxBackend
    from aiperf_backends.jax.distributed import Placement
    from aiperf_backends.jax.training import zero_accumulator
    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.builders import gpt
    from aiperf_core.data.text_corpus import embedded_corpus
    from aiperf_core.data.text_stream import TokenStream
    from aiperf_core.weights import init_weights

    backend = JaxBackend()
    graph = gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)
    weights = init_weights(graph, seed=1)
    # 17 windows in batches of 6: 6 and 6 split 3 + 3 (micro-batches of 1 on each device), then 5,
    # which does not split and is replicated (5 micro-batches of 1 on every device)
    stream = TokenStream(embedded_corpus(), seq_len=16, epoch_tokens=17 * 16, val_tokens=128)
    runs = {}
    for name, devices, micro in (("one", ("cpu:0",), None), ("two", ("cpu:0", "cpu:1"), 1)):
        model = backend.lower(graph, weights)
        reports = backend.train(model, stream, TrainConfig(epochs=2, batch_size=6, schedule=Schedule(0.1),
                                                           grad_clip=1.0, devices=devices, micro_batch=micro))
        runs[name] = {"weights": backend.export_weights(model), "loss": [r.loss for r in reports],
                      "val": [r.val_loss for r in reports], "seqs": [[r.train_images, r.val_images] for r in reports],
                      "sharded": sorted(k[-1] for k in model.cache if k[0] == "update"), "model": model}
    one, two = runs["one"]["weights"], runs["two"]["weights"]
    worst = max(float(np.max(np.abs(one[n][p] - two[n][p]))) for n in one for p in one[n])

    # what crosses between devices: nothing in a micro step, one all-reduce in the update. The split
    # batches' micro step and update that the two-device training ran, read back from jax's cache (the
    # same arguments' layouts lower to the same computation: nothing traced or compiled again).
    trained = runs["two"].pop("model").cache
    (micro_step,) = [fn for key, fn in trained.items() if key[0] == "micro" and key[-1] is not None]
    (update_step,) = [fn for key, fn in trained.items() if key[0] == "update" and key[-1] is True]
    traces = micro_step.traces + update_step.traces
    placement = Placement.named(["cpu:0", "cpu:1"])
    model = backend.lower(graph, weights)
    params, state = placement.replicate((model.params, model.state))
    acc = zero_accumulator(placement, params, True)
    x, y = placement.put_batch(np.zeros((6, 16), np.int32), np.zeros((6, 16), np.int32))
    micro = micro_step.jitted.lower(
        params, state, acc, x, y, np.int32(0), 1, np.float32(96), placement.replicate(jax.random.PRNGKey(0)),
        np.int32(0), np.int32(0), np.bool_(True)).compile().as_text()
    update = update_step.jitted.lower(params, params, acc, np.float32(0.1), np.int32(0)).compile().as_text()
    collectives = r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)\\("
    print(json.dumps({"devices": backend.devices(), "worst": worst, "loss": [runs[k]["loss"] for k in runs],
                      "val": [runs[k]["val"] for k in runs], "seqs": [runs[k]["seqs"] for k in runs],
                      "sharded": runs["two"]["sharded"], "micro": re.findall(collectives, micro),
                      "update": re.findall(collectives, update),
                      "retraced": micro_step.traces + update_step.traces - traces}))
"""


def _run_two_devices(environ: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in environ.items() if k not in ("XLA_FLAGS", "AIPERF_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", AIPERF_CPU_DEVICES="2")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_TWO_DEVICES)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def two_devices(request):
    """The two-device subprocess (AIPERF_CPU_DEVICES is read when jax initialises), started with the module's
    first test when its test is selected, so that the in-process tests run beside it (it is one more process,
    mostly on one core); its test waits for it."""
    yield from beside(request, "test_two_host_devices_accumulating_on_a_token_stream_equal_one_device",
                      _run_two_devices, dict(os.environ))


@pytest.mark.slow
def test_two_host_devices_accumulating_on_a_token_stream_equal_one_device(two_devices):
    out = two_devices.result()
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == ["cpu:0", "cpu:1"]
    assert r["seqs"] == [[[17, 8], [17, 8]]] * 2
    assert r["sharded"] == [False, True]  # both layouts accumulated: split batches and the replicated short one
    assert r["worst"] < 2e-5, r
    np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=1e-5)
    np.testing.assert_allclose(r["val"][1], r["val"][0], rtol=1e-5)
    assert r["micro"] == [] and r["update"] == ["all-reduce"], r
    assert r["retraced"] == 0  # the steps the training ran, read back


# -- device memory -------------------------------------------------------------------------------


def test_device_memory_is_the_share_of_ram_on_a_cpu_and_bytes_limit_on_an_accelerator(monkeypatch):
    backend = JaxBackend()
    assert backend.device_memory("cpu:0") == Backend.device_memory(backend, "cpu:0") > 0

    def report(stats):
        def memory_stats():
            if isinstance(stats, Exception):
                raise stats
            return stats
        return SimpleNamespace(memory_stats=memory_stats)

    devices = {"gpu:0": report({"bytes_limit": 80 * 2**30, "bytes_in_use": 0}), "gpu:1": report(None),
               "gpu:2": report({"bytes_in_use": 0}), "tpu:0": report(NotImplementedError("no stats"))}
    monkeypatch.setattr(distributed, "local_device", devices.__getitem__)
    assert backend.device_memory("gpu:0") == 80 * 2**30
    assert [backend.device_memory(d) for d in ("gpu:1", "gpu:2", "tpu:0")] == [None, None, None]


@pytest.mark.parametrize("micro_batch", [0, -2])
def test_a_micro_batch_below_one_is_refused(micro_batch):
    from aiperf_core.backend import BackendError

    graph = gpt(layers=1, hidden=8, heads=2, seq_len=4, vocab=8)
    x = np.zeros((2, 4), np.int64)
    with pytest.raises(BackendError, match="micro_batch must be >= 1"):
        _train(graph, None, Dataset(x, x, x, x, 8), epochs=1, batch_size=2, micro_batch=micro_batch)
