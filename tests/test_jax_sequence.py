"""The JAX backend on the IR's sequence and model-zoo CNN ops (issue 31): each op forward and backward
(through a small trained head) against the NumPy reference in float64, at fp32 and bf16 (lowered
directly: the backend declares bf16 on GPUs and TPUs only, but XLA runs it on a CPU by conversion);
the fp32 training step of a GPT asking for HIGHEST on every product, attention's included, and tf32
for DEFAULT; a 2-layer GPT end to end (logits, loss and every gradient); training on token ids (a
step equals the reference's SGD step, training lowers the loss, the epoch's counts and per-token
means, data parallelism equal to one device); and the native counter's dense and attention
categories on a GPT against the analytic count.

fp32 tolerances: XLA computes in float32 against the reference's float64, so outputs agree to ~1e-6
relative and gradients to ~1e-5 of the gradient's own scale (a gradient that is zero in exact
arithmetic, such as the attention key's bias, comes out as float32 rounding noise: it is compared
against the scale of all gradients of its graph). bf16 keeps 8 bits of mantissa (a relative step of
2^-8 = 0.4%): products of a few dozen terms then differ from float64 by about 1%, so bf16 is held
to 5e-2 of the output's or gradient's scale.
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

import jax  # noqa: F401  (`make test` installs jax: missing it is a failure, never a skip)
import jax.numpy as jnp

import aiperf_opcount as opcount
from aiperf_backends.jax import JaxBackend, training
from aiperf_backends.jax.lowering import lower_graph
from aiperf_conformance.cases import trained_looking_weights
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.ir import ALL_OPS, VERSION_1_OPS, Graph, lowering_need
from aiperf_numpy.executor import forward, loss_and_grads

ROOT = Path(__file__).resolve().parents[1]
BACKEND = JaxBackend()
PRECISIONS = ("fp32", "bf16")  # tf32 is fp32's code path at Precision.DEFAULT: float32 on a CPU
TOLERANCES = {"fp32": (1e-5, 3e-5), "bf16": (5e-2, 5e-2)}  # (output, gradient), relative to their scale


def _weights(graph: Graph, seed: int = 0) -> dict:
    """Weights that exercise every parameter: non-trivial norms and biases, tables and constants far
    from the identity."""
    rng = np.random.default_rng(seed + 100)
    weights = trained_looking_weights(graph, seed)
    for params in weights.values():
        for name, value in params.items():
            if name == "table":
                params[name] = rng.normal(0, 0.5, value.shape).astype(np.float32)
            elif name == "value":
                params[name] = rng.uniform(0.5, 1.5, value.shape).astype(np.float32)
    return weights


def _graph(input_node: dict, nodes: list[dict], head_input: str) -> Graph:
    """input -> nodes -> a trained head (flatten for images, then dense and softmax)."""
    head = []
    if input_node["op"] == "input" and len(input_node["attrs"]["shape"]) == 3:
        head.append({"id": "flat", "op": "flatten", "inputs": [head_input]})
        head_input = "flat"
    head += [{"id": "head", "op": "dense", "inputs": [head_input], "attrs": {"units": 5}},
             {"id": "probs", "op": "softmax", "inputs": ["head"]}]
    return Graph.from_dict({"schema_version": 2, "nodes": [input_node] + nodes + head})


IMAGE = {"id": "x", "op": "input", "attrs": {"shape": [6, 5, 4]}}
# A trained 1x1 convolution first, so that each op's input gradient is part of the gradients checked.
PRE_CONV = {"id": "pre", "op": "conv2d", "inputs": ["x"], "attrs": {"filters": 6, "kernel": [1, 1], "use_bias": True}}
SEQUENCE = {"id": "x", "op": "input", "attrs": {"shape": [5, 8]}}
PRE_DENSE = {"id": "pre", "op": "dense", "inputs": ["x"], "attrs": {"units": 8}}

OP_CASES = {
    "grouped_conv": (IMAGE, [PRE_CONV, {"id": "op", "op": "conv2d", "inputs": ["pre"], "attrs": {
        "filters": 9, "kernel": [3, 3], "strides": [2, 1], "padding": [1, 0, 1, 1], "groups": 3, "use_bias": True}}]),
    "depthwise_conv": (IMAGE, [PRE_CONV, {"id": "op", "op": "conv2d", "inputs": ["pre"], "attrs": {
        "filters": 12, "kernel": [3, 3], "strides": [2, 2], "padding": [1, 1, 0, 1], "groups": 6}}]),
    "lrn": (IMAGE, [PRE_CONV, {"id": "op", "op": "lrn", "inputs": ["pre"], "attrs": {
        "size": 5, "alpha": 0.6, "beta": 0.75, "bias": 1.5}}]),
    "avg_pool_real_taps": (IMAGE, [PRE_CONV, {"id": "op", "op": "avg_pool", "inputs": ["pre"], "attrs": {
        "kernel": [3, 3], "strides": [2, 1], "padding": [1, 2, 0, 1]}}]),
    "avg_pool_all_taps": (IMAGE, [PRE_CONV, {"id": "op", "op": "avg_pool", "inputs": ["pre"], "attrs": {
        "kernel": [3, 2], "strides": [1, 2], "padding": [2, 0, 1, 1], "count_padding": True}}]),
    "mul_add_const": (IMAGE, [PRE_CONV, {"id": "m", "op": "mul_const", "inputs": ["pre"]},
                              {"id": "op", "op": "add_const", "inputs": ["m"], "attrs": {"per_channel": False}}]),
    "channel_shuffle": (IMAGE, [PRE_CONV, {"id": "op", "op": "channel_shuffle", "inputs": ["pre"],
                                           "attrs": {"groups": 3}}]),
    "embedding": ({"id": "x", "op": "token_input", "attrs": {"seq_len": 5, "vocab": 11}},
                  [{"id": "op", "op": "embedding", "inputs": ["x"], "attrs": {"vocab": 11, "units": 8}}]),
    "position_embedding": (SEQUENCE, [PRE_DENSE, {"id": "op", "op": "position_embedding", "inputs": ["pre"]}]),
    "layer_norm": (SEQUENCE, [PRE_DENSE, {"id": "op", "op": "layer_norm", "inputs": ["pre"],
                                          "attrs": {"epsilon": 1e-3}}]),
    "gelu": (SEQUENCE, [PRE_DENSE, {"id": "op", "op": "gelu", "inputs": ["pre"]}]),
    "moe": (SEQUENCE, [PRE_DENSE, {"id": "op", "op": "moe", "inputs": ["pre"], "attrs": {
        "experts": 3, "top_k": 2, "units": 5}}]),
    "causal_attention": (SEQUENCE, [
        *({"id": w, "op": "dense", "inputs": ["x"], "attrs": {"units": 8}} for w in "qkv"),
        {"id": "op", "op": "attention", "inputs": ["q", "k", "v"], "attrs": {"heads": 2, "head_dim": 4}}]),
    "full_attention": (SEQUENCE, [
        *({"id": w, "op": "dense", "inputs": ["x"], "attrs": {"units": 8}} for w in "qkv"),
        {"id": "op", "op": "attention", "inputs": ["q", "k", "v"],
         "attrs": {"heads": 4, "head_dim": 2, "causal": False}}]),
}


def _batch(graph: Graph, n: int, seed: int):
    rng = np.random.default_rng(seed)
    if graph.takes_tokens:
        x = rng.integers(0, graph.vocab, (n,) + graph.input_shape)
    else:
        x = rng.normal(0, 1, (n,) + graph.input_shape).astype(np.float32)
    return x, rng.integers(0, graph.output_shape[-1], (n,) + graph.output_shape[:-1])


def _close(got, want, tol: float, scale: float | None = None, what: str = "") -> None:
    scale = float(np.max(np.abs(want))) if scale is None else scale
    err = float(np.max(np.abs(np.asarray(got, np.float64) - want)))
    assert err <= tol * max(scale, 1e-12), f"{what}: max difference {err:.3g} > {tol:g} x scale {scale:.3g}"


def _check_against_reference(graph: Graph, precision: str, n: int = 3) -> None:
    """Inference output, training loss and every trainable gradient against the float64 reference."""
    weights = _weights(graph)
    x, labels = _batch(graph, n, 1)
    model = lower_graph(graph, weights, precision)
    out_tol, grad_tol = TOLERANCES[precision]
    _close(BACKEND.predict(model, x), forward(graph, weights, x), out_tol, what=f"{precision} output")
    loss, grads = BACKEND.loss_and_grads(model, x, labels)
    want_loss, want_grads, _ = loss_and_grads(graph, weights, x, labels)
    assert loss == pytest.approx(want_loss, rel=out_tol)
    scale = max(float(np.max(np.abs(g))) for params in want_grads.values() for g in params.values())
    assert {n: set(p) for n, p in grads.items() if p} == {n: set(p) for n, p in want_grads.items() if p}
    for node_id, params in want_grads.items():
        for name, want in params.items():
            _close(grads[node_id][name], want, grad_tol, scale, f"{precision} {node_id}/{name}")
    assert all(np.array_equal(v, weights[nid][k]) for nid, ps in BACKEND.export_weights(model).items()
               for k, v in ps.items())  # computing gradients changed nothing


def test_the_backend_declares_every_op_of_the_ir_and_the_cases_cover_the_new_ones():
    assert BACKEND.supported_ops() == ALL_OPS
    covered = {lowering_need(node) for case in OP_CASES.values() for node in _graph(*case, head_input="op").nodes}
    assert covered | VERSION_1_OPS == ALL_OPS


# The ops whose bf16 lowering differs from fp32's beyond the dtype they pass along: bfloat16 products
# (convolutions, attention) and the normalisations and pools computed in float32. The others move or
# combine values elementwise in whatever dtype reaches them, as at fp32; the GPT's bf16 check covers
# the embedding, the positions and GELU in a bfloat16 network. One case each where two differ only in
# an attribute (the pool's divisor, attention's mask).
BF16_CASES = ("avg_pool_real_taps", "causal_attention", "depthwise_conv", "grouped_conv", "layer_norm", "lrn")


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_new_op_forward_and_backward_against_the_reference(case):
    graph = _graph(*OP_CASES[case], head_input="op")
    for precision in PRECISIONS if case in BF16_CASES else ("fp32",):
        _check_against_reference(graph, precision)


def test_causal_attention_gives_masked_pairs_exactly_zero_weight():
    """Changing a later token's value leaves every earlier position's output bit for bit the same."""
    from aiperf_backends.jax.lowering import attention

    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(0, 3, (2, 6, 8)).astype(np.float32) for _ in range(3))
    later = v.copy()
    later[:, 4:] += 100.0
    attrs = {"heads": 2, "head_dim": 4, "causal": True}
    before, after = np.asarray(attention(q, k, v, attrs)), np.asarray(attention(q, k, later, attrs))
    np.testing.assert_array_equal(before[:, :4], after[:, :4])
    assert not np.allclose(before[:, 4:], after[:, 4:])


def test_a_bias_added_in_bf16_has_its_gradient_summed_in_float32():
    """The float32 sum of the bfloat16 output gradients over 1024 positions, to float32 rounding (a
    bfloat16 accumulator, autodiff's own, was 0.56% off here)."""
    from aiperf_backends.jax.lowering import add_parameter

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(0, 1, (4, 256, 8)), jnp.bfloat16)
    weight = rng.uniform(0.5, 1.5, (4, 256, 8)).astype(np.float32)
    grad = jax.grad(lambda b: jnp.sum(add_parameter(x, b).astype(jnp.float32) * weight))(jnp.zeros(8, jnp.float32))
    want = np.sum(np.asarray(jnp.asarray(weight, jnp.bfloat16), np.float64), axis=(0, 1))  # dy reaches it in bf16
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


def test_constants_are_not_trained_and_cross_the_interface_like_moving_statistics():
    graph = _graph(*OP_CASES["mul_add_const"], head_input="op")
    weights = _weights(graph)
    model = BACKEND.lower(graph, weights)
    assert "m" not in model.params and "op" not in model.params  # outside the differentiated pytree
    exported = BACKEND.export_weights(model)
    assert np.array_equal(exported["m"]["value"], weights["m"]["value"]) and exported["op"]["value"].shape == (1,)
    _, grads = BACKEND.loss_and_grads(model, *_batch(graph, 2, 0))
    assert "m" not in grads and "op" not in grads
    x, labels = _batch(graph, 8, 3)
    BACKEND.train(model, Dataset(x, labels, x[:2], labels[:2], 5),
                  TrainConfig(epochs=1, batch_size=4, schedule=Schedule(0.1)))
    after = BACKEND.export_weights(model)
    assert np.array_equal(after["m"]["value"], weights["m"]["value"])
    assert not np.array_equal(after["pre"]["kernel"], weights["pre"]["kernel"])
    doubled = weights["m"]["value"] * 2
    BACKEND.import_weights(model, {**after, "m": {"value": doubled}})
    assert np.array_equal(BACKEND.export_weights(model)["m"]["value"], doubled)


def test_a_two_layer_gpt_end_to_end():
    _check_against_reference(gpt(2, 32, 4, 8, 50), "fp32", n=2)
    _check_against_reference(gpt(1, 16, 2, 6, 13), "bf16", n=2)  # the same code paths in bfloat16, smaller


def _gpt_step_products(precision: str) -> list[str]:
    """The convolutions and dots of a GPT's jitted training step (forward and backward), StableHLO."""
    graph = gpt(1, 16, 2, 6, 13)
    model = lower_graph(graph, _weights(graph), "fp32")
    step = training.make_train_step(graph, precision, 0.9, 0.0)
    x, y = jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 6), jnp.int32)
    text = step.jitted.lower(model.params, model.state, model.params, x, y, np.float32(0.1), jax.random.PRNGKey(0),
                             np.int32(0)).as_text()
    return [line for line in text.splitlines() if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]


def test_a_gpt_step_at_fp32_asks_for_highest_on_every_product_attention_included():
    fp32 = _gpt_step_products("fp32")
    # 7 dense layers (forward, input and weight gradients: the embedding below them is trained) and
    # attention (2 forward, 4 backward, batched over heads)
    assert len(fp32) == 7 * 3 + 6
    assert sum("batching_dims" in line for line in fp32) == 6
    assert all("precision = [HIGHEST, HIGHEST]" in line for line in fp32), fp32
    tf32 = _gpt_step_products("tf32")
    assert len(tf32) == len(fp32) and all("HIGHEST" not in line and "DEFAULT" in line for line in tf32), tf32
    with jax.default_matmul_precision("bfloat16"):  # a user's global choice reaches neither
        assert all("precision = [HIGHEST, HIGHEST]" in line for line in _gpt_step_products("fp32"))
    assert jax.config.jax_default_matmul_precision is None  # and the lowering left it as it was


def _language_data(graph: Graph, n: int, seed: int):
    """Sequences whose next token follows from the current one (t -> 3t + 1 mod V): learnable."""
    rng = np.random.default_rng(seed)
    vocab, seq = graph.vocab, graph.input_shape[0]
    tokens = np.empty((n, seq + 1), np.int64)
    tokens[:, 0] = rng.integers(0, vocab, n)
    for i in range(seq):
        tokens[:, i + 1] = (3 * tokens[:, i] + 1) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def _cross_entropy(probs: np.ndarray, labels: np.ndarray) -> float:
    """The mean over every position of every sequence."""
    return float(-np.mean(np.log(np.take_along_axis(probs, labels[..., None], axis=-1))))


def test_a_gpt_step_equals_the_reference_sgd_step_and_training_lowers_the_loss():
    """One step of plain SGD (momentum 0) moves every weight by -lr times the reference gradient of
    the mean loss over every token; three more epochs (the same compiled step) lower the loss, with
    sequences counted and the validation loss and accuracy taken over every position."""
    graph = gpt(1, 16, 2, 6, 13)
    weights = _weights(graph)
    model = BACKEND.lower(graph, weights)
    x, y = _language_data(graph, 40, 0)
    xv, yv = _language_data(graph, 10, 1)
    config = TrainConfig(epochs=1, batch_size=4, momentum=0.0, schedule=Schedule(0.5))
    _, want_grads, _ = loss_and_grads(graph, weights, x[:4], y[:4])
    BACKEND.train(model, Dataset(x[:4], y[:4], xv, yv, graph.vocab), config)
    stepped = BACKEND.export_weights(model)
    for node_id, params in want_grads.items():
        for name, grad in params.items():
            np.testing.assert_allclose(stepped[node_id][name], weights[node_id][name] - 0.5 * grad, atol=2e-6,
                                       err_msg=f"{node_id}/{name}")

    before = _cross_entropy(BACKEND.predict(model, xv), yv)
    data = Dataset(x.astype(np.int32), y, xv, yv, graph.vocab)  # a host stream's ids may be int32
    reports = BACKEND.train(model, data, TrainConfig(epochs=3, batch_size=4, momentum=0.0, schedule=Schedule(0.5)))
    assert [(r.train_images, r.val_images) for r in reports] == [(40, 10)] * 3
    assert reports[-1].loss < reports[0].loss
    probs = BACKEND.predict(model, xv)
    assert reports[-1].val_loss == pytest.approx(_cross_entropy(probs, yv), rel=1e-4)
    assert reports[-1].val_loss < 0.8 * before
    assert reports[-1].val_accuracy == pytest.approx(np.mean(probs.argmax(-1) == yv))


def test_the_native_counter_on_a_gpt_matches_the_analytic_dense_and_attention():
    graph = gpt(2, 32, 4, 8, 50)
    counter = BACKEND.native_counter()
    convention = counter.convention
    assert convention.padding == "valid" and convention.attention == "paper"
    assert "attention" in convention.covers  # so the kit's count level checks it
    model = BACKEND.lower(graph, _weights(graph))
    # dense under the counter's padding convention, attention under its own (every S x S score)
    analytic = {c: opcount.count(graph, convention.convention_for(c)).by_category()[c]
                for c in ("dense", "attention")}
    assert analytic["attention"] != opcount.count(graph, "valid").by_category()["attention"]  # causal: it matters
    batch = 2
    for backward in (False, True):
        got = counter.count(model, batch, backward)
        for category, want in analytic.items():
            want = batch * (want["fp"] + (want["bp"] if backward else 0))
            assert got[category] == want, f"{category} backward={backward}: {got[category]:,} vs {want:,}"
    # the standard formula on the matrix products: per sequence 2 S (12 L H^2 + H V) + 4 S^2 H L
    s, h, layers, v = 8, 32, 2, 50
    assert got["dense"] + got["attention"] == 3 * batch * (2 * s * (12 * layers * h * h + h * v)
                                                          + 4 * s * s * h * layers)


def test_the_native_counter_never_returns_a_product_counted_as_minus_one(monkeypatch):
    """What XLA's GPU cost analysis gives a custom call (cuDNN's fused attention would be one)."""
    from aiperf_backends.jax import counter
    from aiperf_core.backend import BackendError

    monkeypatch.setattr(counter, "_CACHE", {})
    monkeypatch.setattr(counter, "_flops_typed", lambda fn, *operands: -1)  # attention's products only
    graph = _graph(*OP_CASES["causal_attention"], head_input="op")
    with pytest.raises(BackendError, match="-1 FLOPs for a product of node 'op'"):
        BACKEND.native_counter().count(BACKEND.lower(graph), 2, False)


def test_the_native_counter_counts_grouped_and_depthwise_convolutions():
    for case in ("grouped_conv", "depthwise_conv"):
        graph = _graph(*OP_CASES[case], head_input="op")
        model = BACKEND.lower(graph, _weights(graph))
        counted = opcount.count(graph, "valid")
        for backward in (False, True):
            want = 2 * sum(n.fp + (n.grad if backward else 0) for n in counted.nodes if n.category == "conv")
            assert BACKEND.native_counter().count(model, 2, backward)["conv"] == want, (case, backward)


def test_data_parallel_training_on_tokens_equals_one_device():
    """Two host devices (a fresh process: AIPERF_CPU_DEVICES is read before jax starts) train a GPT on
    token ids as one device does on the combined batch (16 sequences: batches of 8, each split 4 and
    4; a short batch's replicated path is the image graphs', tests/test_jax_backend.py)."""
    script = """
        import json
        import numpy as np
        from aiperf_backends.jax import JaxBackend
        from aiperf_core.backend import Dataset, Schedule, TrainConfig
        from aiperf_core.builders import gpt

        backend = JaxBackend()
        graph = gpt(1, 16, 2, 6, 13)
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 13, (16, 6)), rng.integers(0, 13, (16, 6))
        data = Dataset(x, y, x[:5], y[:5], 13)
        out = {}
        for devices in (("cpu:0",), ("cpu:0", "cpu:1")):
            model = backend.lower(graph)
            reports = backend.train(model, data, TrainConfig(epochs=2, batch_size=8, schedule=Schedule(0.2),
                                                             devices=devices))
            out[len(devices)] = {"weights": backend.export_weights(model), "loss": [r.loss for r in reports],
                                 "val": [r.val_loss for r in reports], "seqs": [r.train_images for r in reports]}
        one, two = out[1], out[2]
        worst = max(float(np.max(np.abs(one["weights"][n][p] - two["weights"][n][p])))
                    for n in one["weights"] for p in one["weights"][n])
        print(json.dumps({"devices": backend.devices(), "worst": worst, "loss": [one["loss"], two["loss"]],
                          "val": [one["val"], two["val"]], "seqs": two["seqs"]}))
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "AIPERF_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", AIPERF_CPU_DEVICES="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == ["cpu:0", "cpu:1"] and r["seqs"] == [16, 16]
    assert r["worst"] < 2e-5
    np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=1e-5)
    np.testing.assert_allclose(r["val"][1], r["val"][0], rtol=1e-5)
