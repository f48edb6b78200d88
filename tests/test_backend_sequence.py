"""The first-party backends on the IR's sequence and model-zoo ops (issue 31): what the conformance kit
does not check, written once for torch, TensorFlow, JAX and MindSpore (issue 42).

The kit (tests/test_conformance.py runs it on every backend) already checks, at every precision a
backend declares: each op's forward and its parameters' gradients through a head against the NumPy
reference (op level, conformance/cases.py), a GPT's logits, parameters and output shape (graph/gpt),
its gradients, training step and optimizers (train/gpt_*), its native count per category (count/gpt),
the native count of a grouped and a depthwise convolution (count/conv_*) and its data-parallel
training on token ids, an uneven last batch included (parallel/gpt_*). None of that is repeated
here. What is:

* The op's own backward where the kit cannot see it. A kit case puts the op right after the input,
  so an op without parameters (lrn, avg_pool, gelu, the constants, softmax, ...) has no gradient the
  kit compares: its backward never reaches a parameter. Each case below puts a trained layer ('pre')
  before the op, so the op's input gradient is that layer's parameter gradients; and each case's
  geometry is one the kit's cases lack (a channel multiplier, unequal strides, a window wider than
  the channels, a norm over an image's channels, a batch norm over positions, ...).
* bf16 lowered directly on a CPU where a backend whose bf16 runs there does not declare it (XLA and
  TensorFlow convert bfloat16 where the CPU lacks it), so that its mixed-precision lowering is
  tested on every CI machine, not only on the ones the kit certifies it on.
* Constants (mul_const, add_const): outside what the framework trains, exported and imported.
* Dropout in training: every backend draws the reference's masks, so its loss and gradients equal
  the reference's.
* Training on token ids: the validation loss and accuracy are means over every position.
* Each native counter's declared convention.
* Per backend, its own behaviour: torch's compiled step and conv probe, JAX's product precision in
  its jitted step, TensorFlow's token ids of either width, MindSpore's fp16 lowering on a CPU.

Tolerances are the kit's (conformance/defaults.json through each backend's expectations file):
errors relative to the largest reference magnitude of each tensor (an attention key projection's
bias, whose gradient is zero in exact arithmetic, is held to the largest gradient instead).
tests/test_torch_sequence_gpu.py runs the op cases below on a GPU at every precision it declares.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.ir import ALL_OPS, Graph, Node, is_trainable
from aiperf_core.registry import load_backend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.expectations import load_expectations
from aiperf_conformance.kit import normwise_error, relative_error
from aiperf_numpy.executor import forward, loss_and_grads

# `make test` installs all four: a backend that cannot load is a failure here, never a skip.
BACKENDS = ("torch", "tensorflow", "jax", "mindspore")
BATCH = 3


@functools.cache
def _backend(name: str):
    backend = load_backend(name)  # BackendError when the framework cannot import
    availability = type(backend).availability()
    assert availability.available, f"{name}: {availability.reason}"
    return backend


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return _backend(request.param)


def _tolerance(backend, key: str, precision: str) -> float:
    return load_expectations(backend.name, backend).tolerance(key, precision)


_relative, _normwise = relative_error, normwise_error


def _assert_gradients(graph: Graph, grads, want, error, tol: float) -> None:
    """Every trainable parameter's gradient within `tol` of the reference's by `error`; but a key
    projection's bias adds q . b to every score of a query's row, which the softmax over keys ignores:
    its gradient is zero in exact arithmetic, so its rounding is measured against the largest gradient.
    A node without trainable parameters may be absent or hold an empty mapping."""
    key_biases = {n.inputs[1] for n in graph.nodes if n.op == "attention"}
    largest = max(np.max(np.abs(g)) for params in want.values() for g in params.values())
    assert {n: set(p) for n, p in grads.items() if p} == {n: set(p) for n, p in want.items() if p}
    for node_id in want:
        for pname, reference in want[node_id].items():
            if node_id in key_biases and pname == "bias":
                assert np.max(np.abs(grads[node_id][pname])) <= tol * largest, node_id
            else:
                assert error(grads[node_id][pname], reference) <= tol, (node_id, pname)


# -- the op cases: (input node, nodes after it); the op under test is 'op', the trained layer before it 'pre'


def _image(shape):
    return Node("x", "input", (), {"shape": list(shape)})


def _seq(s, d):
    return Node("x", "input", (), {"shape": [s, d]})


def _pre_conv(filters):
    return Node("pre", "conv2d", ("x",), {"filters": filters, "kernel": [1, 1], "use_bias": True})


def _pre_dense(units, bias=True):
    return Node("pre", "dense", ("x",), {"units": units, "use_bias": bias})


def _conv(groups, filters, kernel, strides, padding, bias=False):
    return Node("op", "conv2d", ("pre",), {"filters": filters, "kernel": list(kernel), "strides": list(strides),
                                            "padding": list(padding), "use_bias": bias, "groups": groups})


def _lrn(size, alpha, beta, bias):
    return Node("op", "lrn", ("pre",), {"size": size, "alpha": alpha, "beta": beta, "bias": bias})


def _avg(kernel, strides, padding, count_padding):
    return Node("op", "avg_pool", ("pre",), {"kernel": list(kernel), "strides": list(strides),
                                              "padding": list(padding), "count_padding": count_padding})


IMAGE = _image((6, 5, 4))
CASES = {
    "conv_grouped_strided": (IMAGE, (_pre_conv(6), _conv(3, 9, (3, 3), (2, 1), (1, 0, 1, 1), bias=True))),
    "conv_depthwise_multiplier2": (IMAGE, (_pre_conv(6), _conv(6, 12, (3, 3), (2, 2), (1, 1, 0, 1)))),
    # TensorFlow's depthwise gradients refuse unequal strides: its lowering splits the channels
    "conv_depthwise_unequal_strides": (IMAGE, (_pre_conv(6), _conv(6, 6, (3, 1), (1, 2), (1, 1, 0, 0)))),
    "conv_depthwise_1x1_stride2": (_image((6, 6, 4)), (_pre_conv(4), _conv(4, 4, (1, 1), (2, 2), (0, 0, 0, 0)))),
    "lrn_window_wider_than_channels": (_image((3, 3, 2)), (_pre_conv(2), _lrn(5, 1.5, 0.6, 1.0))),
    # MindSpore's CPU ops.LRN fails for 16 channels and more (multiples of 8): its lowering writes lrn out
    "lrn_16_channels": (_image((2, 2, 16)), (_pre_conv(16), _lrn(3, 1e-2, 0.75, 1.0))),
    "avg_pool_real_taps": (IMAGE, (_pre_conv(6), _avg((3, 3), (2, 1), (1, 2, 0, 1), False))),
    "avg_pool_all_taps": (IMAGE, (_pre_conv(6), _avg((3, 2), (1, 2), (2, 0, 1, 1), True))),
    "mul_add_const_image": (IMAGE, (_pre_conv(6), Node("m", "mul_const", ("pre",), {"per_channel": True}),
                                    Node("op", "add_const", ("m",), {"per_channel": False}))),
    "mul_add_const_sequence": (_seq(5, 8), (_pre_dense(8), Node("m", "mul_const", ("pre",), {"per_channel": False}),
                                            Node("op", "add_const", ("m",), {"per_channel": True}))),
    "layer_norm_image": (_image((3, 3, 4)), (_pre_conv(4), Node("op", "layer_norm", ("pre",), {"epsilon": 1e-3}))),
    "gelu_image": (_image((3, 3, 2)), (_pre_conv(2), Node("op", "gelu", ("pre",), {}))),
    "softmax_per_position": (_seq(4, 5), (_pre_dense(5), Node("op", "softmax", ("pre",), {}))),
    # a batch norm removes its input's mean over the batch's positions: a bias before it has no gradient
    "batch_norm_sequence": (_seq(4, 3), (_pre_dense(3, bias=False),
                                         Node("op", "batch_norm", ("pre",), {"epsilon": 1e-3}))),
    # in training, every backend draws the reference's masks (the executor's rule): loss and gradients agree
    "dropout_sequence": (_seq(4, 6), (_pre_dense(6), Node("op", "dropout", ("pre",), {"rate": 0.4}))),
}
# The cases whose bf16 lowering differs from fp32's beyond the dtype they pass along: bfloat16 products
# (convolutions) and the normalisations and pools computed in float32. The others move or combine values
# elementwise in whatever dtype reaches them, as at fp32; the GPT's bf16 check covers attention, the
# embeddings, layer norm over positions and GELU in a bfloat16 network.
BF16_CASES = ("avg_pool_real_taps", "conv_depthwise_multiplier2", "conv_depthwise_unequal_strides",
              "conv_grouped_strided", "layer_norm_image", "lrn_16_channels")


def _op_graph(name: str) -> Graph:
    first, nodes = CASES[name]
    return Graph((first,) + nodes, name=name)


def _with_head(graph: Graph) -> Graph:
    """A head that turns the op's output into classes: per image (flatten, dense, softmax), or per
    position of a sequence (dense over the last axis, softmax)."""
    last, tail = graph.output_id, []
    if len(graph.output_shape) != 2:
        tail.append(Node("head_flat", "flatten", (last,), {}))
        last = "head_flat"
    tail += [Node("head_dense", "dense", (last,), {"units": 3}), Node("head_probs", "softmax", ("head_dense",), {})]
    return Graph(graph.nodes + tuple(tail), name=graph.name + "_head")


def _weights(graph: Graph, seed: int) -> dict:
    """trained_looking_weights, with constants that are not the identity and embedding tables of a
    trained network's size."""
    weights = trained_looking_weights(graph, seed)
    rng = np.random.default_rng(seed + 100)
    for params in weights.values():
        for name, value in params.items():
            if name == "value":
                params[name] = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
            elif name == "table":
                params[name] = rng.normal(0, 0.5, value.shape).astype(np.float32)
    return weights


def _inputs(graph: Graph, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if graph.takes_tokens:
        return rng.integers(0, graph.vocab, (n,) + graph.input_shape)
    return rng.normal(0, 1, (n,) + graph.input_shape).astype(np.float32)


def _labels(graph: Graph, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, graph.output_shape[-1], (n,) + graph.output_shape[:-1])


# How each backend lowers at a precision it does not declare on this device (its lowering, without the
# contract's check): the backends whose bf16 runs on any CPU. torch's bf16 is tested on a GPU
# (tests/test_torch_sequence_gpu.py) and by the kit where a CPU declares it; MindSpore's CPU kernels
# have no bfloat16.
def _lower_jax(backend, graph, weights, precision):
    from aiperf_backends.jax.lowering import lower_graph

    return lower_graph(graph, weights, precision)


def _lower_tensorflow(backend, graph, weights, precision):
    from aiperf_backends.tensorflow.lowering import lower_graph

    return lower_graph(graph, weights, precision, backend.devices()[0])


LOWER_UNDECLARED = {"jax": _lower_jax, "tensorflow": _lower_tensorflow}


def _lower(backend, graph: Graph, weights, precision: str):
    if precision in backend.precisions(backend.devices()[0]):
        return backend.lower(graph, weights, precision=precision)
    return LOWER_UNDECLARED[backend.name](backend, graph, weights, precision)


def _check_against_reference(backend, graph: Graph, precision: str, output_key: str, gradient_key: str) -> None:
    """Inference output, training loss and every trainable gradient against the float64 reference, at
    the kit's tolerances; computing them changes no weight."""
    weights = _weights(graph, 1)
    x, labels = _inputs(graph, BATCH, 2), _labels(graph, BATCH, 3)
    model = _lower(backend, graph, weights, precision)
    out_tol, grad_tol = _tolerance(backend, output_key, precision), _tolerance(backend, gradient_key, precision)
    error = relative_error(backend.predict(model, x), forward(graph, weights, x))
    assert error <= out_tol, f"{precision} output: {error:.3g} > {out_tol:g}"
    loss, grads = backend.loss_and_grads(model, x, labels)
    want_loss, want, _ = loss_and_grads(graph, weights, x, labels)
    assert abs(loss - want_loss) <= out_tol * abs(want_loss), (loss, want_loss)
    _assert_gradients(graph, grads, want, relative_error, grad_tol)
    exported = backend.export_weights(model)
    assert all(np.array_equal(exported[n][p], weights[n][p]) for n in weights for p in weights[n])


def test_the_backend_declares_every_op(backend):
    assert backend.supported_ops() == ALL_OPS


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_op_forward_and_its_input_gradient_against_the_reference(backend, case):
    _check_against_reference(backend, _with_head(_op_graph(case)), "fp32", "op", "op_grad")


@pytest.mark.parametrize("name", sorted(LOWER_UNDECLARED))
@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_lowered_on_a_cpu_against_the_reference(name, case):
    _check_against_reference(_backend(name), _with_head(_op_graph(case)), "bf16", "op", "op_grad")


@pytest.mark.parametrize("name", sorted(LOWER_UNDECLARED))
def test_a_bf16_gpt_lowered_on_a_cpu_against_the_reference(name):
    _check_against_reference(_backend(name), gpt(1, 16, 2, 6, 13), "bf16", "graph_lm", "op_grad_lm")


# -- constants -----------------------------------------------------------------------------------------

# What the framework itself would train in a lowered model: the count of its trainable tensors.
FRAMEWORK_TRAINABLES = {
    "torch": lambda model: len(list(model.parameters())),  # constants are buffers
    "tensorflow": lambda model: len(model.trainables),  # constants are non-trainable variables
    "jax": lambda model: sum(len(params) for params in model.params.values()),  # constants are in model.state
    "mindspore": lambda model: len(model.trainable_params()),  # constants are frozen Parameters
}


def test_constants_are_exported_imported_and_never_trained(backend):
    graph = _with_head(_op_graph("mul_add_const_image"))  # 'm' per channel, 'op' a scalar
    weights = _weights(graph, 1)
    model = backend.lower(graph, weights)
    trainable = sum(is_trainable(p) for params in graph.all_param_shapes().values() for p in params)
    assert FRAMEWORK_TRAINABLES[backend.name](model) == trainable
    exported = backend.export_weights(model)
    for node_id in ("m", "op"):
        np.testing.assert_array_equal(exported[node_id]["value"], weights[node_id]["value"])
    assert exported["op"]["value"].shape == (1,)
    x, labels = _inputs(graph, 8, 1), _labels(graph, 8, 2)
    _, grads = backend.loss_and_grads(model, x, labels)
    assert not grads.get("m") and not grads.get("op")
    backend.train(model, Dataset(x, labels, x[:2], labels[:2], classes=3),
                  TrainConfig(epochs=1, batch_size=4, schedule=Schedule(initial=0.5), compile="never"))
    trained = backend.export_weights(model)
    for node_id in ("m", "op"):
        np.testing.assert_array_equal(trained[node_id]["value"], weights[node_id]["value"])
    assert not np.array_equal(trained["head_dense"]["kernel"], weights["head_dense"]["kernel"])
    doubled = weights["m"]["value"] * 2
    backend.import_weights(model, {**trained, "m": {"value": doubled}})
    np.testing.assert_array_equal(backend.export_weights(model)["m"]["value"], doubled)


# -- training on token ids -----------------------------------------------------------------------------


def _language(vocab: int, seq: int, n: int, seed: int):
    """Sequences whose next token follows from the current one (t -> 3t + 1 mod V): learnable."""
    tokens = np.empty((n, seq + 1), np.int64)
    tokens[:, 0] = np.random.default_rng(seed).integers(0, vocab, n)
    for i in range(seq):
        tokens[:, i + 1] = (3 * tokens[:, i] + 1) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def _train_a_gpt(backend, compile_mode: str = "never"):
    """A GPT trained 3 epochs on token ids (int32, as a host stream may carry them): it learns, and the
    epoch reports count sequences and take the validation loss and accuracy over every position."""
    graph = gpt(1, 16, 2, 6, 13)
    model = backend.lower(graph, _weights(graph, 0))
    x, y = _language(graph.vocab, 6, 40, 0)
    xv, yv = _language(graph.vocab, 6, 10, 1)
    before, _ = backend.loss_and_grads(model, x, y)
    reports = backend.train(model, Dataset(x.astype(np.int32), y, xv.astype(np.int32), yv, graph.vocab),
                            TrainConfig(epochs=3, batch_size=8, schedule=Schedule(initial=0.3), compile=compile_mode))
    after, _ = backend.loss_and_grads(model, x, y)
    assert after < 0.8 * before, (before, after)
    assert [(r.train_images, r.val_images) for r in reports] == [(40, 10)] * 3  # sequences, not tokens
    assert reports[-1].loss < reports[0].loss
    probs = backend.predict(model, xv)
    want_val_loss = -np.mean(np.log(np.take_along_axis(probs, yv[..., None], axis=-1)))
    assert reports[-1].val_loss == pytest.approx(want_val_loss, rel=1e-4)
    assert reports[-1].val_accuracy == pytest.approx(np.mean(probs.argmax(-1) == yv))  # a multiple of 1/60
    return model, reports


# The backends that read TrainConfig.compile: with 'never', their step compiles nothing.
COMPILES_WHEN_ASKED = ("torch",)


def test_a_gpt_trains_on_token_ids_with_per_position_means(backend):
    _, reports = _train_a_gpt(backend, "never")
    if backend.name in COMPILES_WHEN_ASKED:
        assert reports[0].compile_seconds == 0


# -- the native counter --------------------------------------------------------------------------------

# Each counter's rule (padded taps, causal attention's masked scores): XLA leaves padded taps out but
# multiplies every score (docs/counting.md, "Convention valid"); the others count both as the paper does.
COUNTER_RULES = {"torch": ("paper", "paper"), "tensorflow": ("paper", "paper"), "jax": ("valid", "paper"),
                 "mindspore": ("paper", "paper")}


def test_the_native_counter_declares_its_convention(backend):
    convention = backend.native_counter().convention
    assert (convention.padding, convention.convention_for("attention")) == COUNTER_RULES[backend.name]
    # so the kit's count level checks each; "moe" where the counter books routed experts apart (issue 40)
    assert {"conv", "dense", "attention"} <= set(convention.covers) <= {"conv", "dense", "attention", "moe"}
    assert convention.mac_ops == 2 and not convention.includes_update


# -- torch ---------------------------------------------------------------------------------------------


def test_torch_trains_a_gpt_compiled_as_one_graph(monkeypatch):
    import torch

    backend = _backend("torch")
    # Inductor's CPU code generation for a GPT's step takes about 100 s on a 2-core CI machine; aot_eager
    # traces the same step (dynamo, then AOTAutograd's forward and backward graphs) and runs the traced
    # graphs without generating code.
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, dynamic, mode: compile_(fn, backend="aot_eager", dynamic=dynamic))
    torch._dynamo.utils.counters.clear()
    model, reports = _train_a_gpt(backend, "always")
    assert model.positions == 6  # labels per sequence
    assert reports[0].compile_seconds > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the whole step, traced once
    assert not torch._dynamo.utils.counters["graph_break"]


def test_torch_a_model_of_buffers_alone_runs_where_its_buffers_are():
    # a graph of constants and pooling has no parameter to say where the model lives
    import torch

    from aiperf_backends.torch.training import device_of

    model = _backend("torch").lower(Graph((IMAGE, Node("op", "mul_const", ("x",), {"per_channel": True}))))
    assert not list(model.parameters())
    assert device_of(model.to("meta")) == torch.device("meta")


def test_torch_grouped_convs_go_through_the_cpu_conv_probe():
    import torch

    from aiperf_backends.torch import conv_probe, lowering

    graph = _op_graph("conv_grouped_strided")
    model = _backend("torch").lower(graph, _weights(graph, 1))
    geometry = lowering.conv_geometry(graph, graph["op"])
    assert geometry.groups == 3
    assert model.conv_forms["op"] in conv_probe.FORMS
    # the probe's im2col reference is right for a grouped conv: torch's own (contiguous) kernel agrees with it
    for form in (conv_probe.CHANNELS_LAST, conv_probe.CONTIGUOUS):
        assert conv_probe.weight_gradient_error(torch.nn.functional.conv2d, geometry, form, torch.float32) < 1e-5


# -- TensorFlow ----------------------------------------------------------------------------------------


def test_tensorflow_token_ids_of_either_integer_width_give_the_same_logits():
    """A host stream may carry int32 ids: the token input widens them."""
    import tensorflow as tf

    backend = _backend("tensorflow")
    graph = gpt(1, 16, 2, 6, 20)
    model = backend.lower(graph, _weights(graph, 0))
    x = _inputs(graph, 2, 0)
    narrow, _ = model.call(tf.constant(x.astype(np.int32)), False)
    wide, _ = model.call(tf.constant(x), False)
    np.testing.assert_array_equal(narrow.numpy(), wide.numpy())


# -- JAX -----------------------------------------------------------------------------------------------


def test_jax_causal_attention_gives_masked_pairs_exactly_zero_weight():
    """Changing a later token's value leaves every earlier position's output bit for bit the same."""
    _backend("jax")
    from aiperf_backends.jax.lowering import attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(0, 3, (2, 6, 8)).astype(np.float32) for _ in range(3))
    later = v.copy()
    later[:, 4:] += 100.0
    attrs = {"heads": 2, "head_dim": 4, "causal": True}
    before, after = np.asarray(attention(q, k, v, attrs)), np.asarray(attention(q, k, later, attrs))
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_jax_a_bias_added_in_bf16_has_its_gradient_summed_in_float32():
    """The float32 sum of the bfloat16 output gradients over 1024 positions, to float32 rounding (a
    bfloat16 accumulator, autodiff's own, was 0.56% off here)."""
    _backend("jax")
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import add_parameter

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (4, 256, 8)), jnp.bfloat16)
    weight = rng.uniform(0.5, 1.5, (4, 256, 8)).astype(np.float32)
    grad = jax.grad(lambda b: jnp.sum(add_parameter(x, b).astype(jnp.float32) * weight))(jnp.zeros(8, jnp.float32))
    want = np.sum(np.asarray(jnp.asarray(weight, jnp.bfloat16), np.float64), axis=(0, 1))  # dy reaches it in bf16
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


def _jax_gpt_step_products(precision: str) -> list[str]:
    """The convolutions and dots of a GPT's jitted training step (forward and backward), StableHLO."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax import training
    from aiperf_backends.jax.lowering import lower_graph

    graph = gpt(1, 16, 2, 6, 13)
    model = lower_graph(graph, _weights(graph, 0), "fp32")
    step = training.make_train_step(graph, precision, 0.9, 0.0)
    x, y = jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 6), jnp.int32)
    text = step.jitted.lower(model.params, model.state, model.params, x, y, np.float32(0.1), jax.random.PRNGKey(0),
                             np.int32(0)).as_text()
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]


def test_jax_a_gpt_step_at_fp32_asks_for_highest_on_every_product_attention_included():
    _backend("jax")
    import jax

    fp32 = _jax_gpt_step_products("fp32")
    # 7 dense layers (forward, input and weight gradients: the embedding below them is trained) and
    # attention (2 forward, 4 backward, batched over heads)
    assert len(fp32) == 7 * 3 + 6
    assert sum("batching_dims" in line for line in fp32) == 6
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in fp32), fp32
    tf32 = _jax_gpt_step_products("tf32")
    assert len(tf32) == len(fp32) and all("HIGHEST" not in line and "DEFAULT" in line for line in tf32), tf32
    with jax.default_matmul_precision("bfloat16"):  # a user's global choice reaches neither
        assert all("precision = [HIGHEST, HIGHEST]" in line for line in _jax_gpt_step_products("fp32"))
    assert jax.config.jax_default_matmul_precision is None  # and the lowering left it as it was


def test_jax_the_native_counter_never_returns_a_product_counted_as_minus_one(monkeypatch):
    """What XLA's GPU cost analysis gives a custom call (cuDNN's fused attention would be one)."""
    from aiperf_core.backend import BackendError

    backend = _backend("jax")
    from aiperf_backends.jax import counter

    monkeypatch.setattr(counter, "_CACHE", {})
    monkeypatch.setattr(counter, "_flops_typed", lambda fn, *operands: -1)  # attention's products only
    graph = _with_head(Graph((_seq(5, 8), *(Node(w, "dense", ("x",), {"units": 8}) for w in "qkv"),
                              Node("op", "attention", ("q", "k", "v"), {"heads": 2, "head_dim": 4}))))
    with pytest.raises(BackendError, match="-1 FLOPs for a product of node 'op'"):
        backend.native_counter().count(backend.lower(graph), 2, False)


# -- MindSpore -----------------------------------------------------------------------------------------


def test_mindspore_half_precision_gpt_runs_close_to_fp32():
    # fp16 is not declared on this CPU (emulated); its lowering is exercised directly. bf16 cannot be:
    # MindSpore 2.10's CPU MatMul, like its Conv2D, has no bfloat16 kernel.
    _backend("mindspore")
    import mindspore as ms

    from aiperf_backends.mindspore.lowering import lower_graph
    from aiperf_backends.mindspore.training import gradient_function, predict, targets

    graph = gpt(2, 32, 4, 8, 50)
    weights = trained_looking_weights(graph, 0)
    x, labels = _inputs(graph, BATCH, 1), _labels(graph, BATCH, 2)
    full = predict(lower_graph(graph, weights, "fp32"), x)
    model = lower_graph(graph, weights, "fp16")
    half = predict(model, x)
    assert half.dtype == np.float32 and np.max(np.abs(half - full)) < 0.01
    model.set_train(True)
    params = [p for _, _, p in model.trainable()]
    (_, total), grads = gradient_function(model, params)(model.to_cell_layout(x), targets(labels, graph.vocab, 0.0),
                                                         None, ms.Tensor(np.float32(1.0 / BATCH)))
    want_loss, _, _ = loss_and_grads(graph, weights, x, labels)
    assert float(total.asnumpy()) / BATCH == pytest.approx(want_loss, rel=1e-2)
    assert all(g.dtype == ms.float32 and np.all(np.isfinite(g.asnumpy())) for g in grads)  # float32 masters
