"""The TensorFlow backend on the IR's sequence and model-zoo CNN ops (issue 31): each op forward and
backward (through a small trained head) against the NumPy reference in float64, at fp32 and bf16
(lowered directly: the contract declares bf16 only on CPUs with AVX512-BF16 or AMX and on GPUs, but
TensorFlow runs it anywhere, by conversion where the CPU lacks it); a 2-layer GPT end to end
(logits, loss and every gradient); training on token ids (a step equals the reference's SGD step,
training lowers the loss, the epoch's counts and per-token means, data parallelism equal to one
device); and the native counter's dense and attention categories on a GPT against the analytic
count.

fp32 tolerances: TensorFlow computes in float32 against the reference's float64, so outputs agree
to ~1e-6 relative and gradients to ~1e-5 of the gradient's own scale (a gradient that is zero in
exact arithmetic, such as the attention key's bias, comes out as float32 rounding noise: it is
compared against the scale of all gradients of its graph). bf16 keeps 8 bits of mantissa (a
relative step of 2^-8 = 0.4%): products of a few dozen terms then differ from float64 by about 1%,
so bf16 is held to 5e-2 of the output's or gradient's scale.
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

import aiperf_opcount as opcount  # noqa: E402
from aiperf_core.backend import Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import gpt  # noqa: E402
from aiperf_core.ir import ALL_OPS, OPS, Graph  # noqa: E402
from aiperf_numpy.executor import forward, loss_and_grads  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_backends.tensorflow.lowering import lower_graph  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BACKEND = TensorFlowBackend()
PRECISIONS = ("fp32", "bf16")  # fp16 (GPUs only) is bf16's code path in another dtype
TOLERANCES = {"fp32": (1e-5, 3e-5), "bf16": (5e-2, 5e-2)}  # (output, gradient), relative to their scale


def _weights(graph: Graph, seed: int = 0) -> dict:
    """Weights that exercise every parameter: non-trivial norms and biases, tables and constants far
    from the identity."""
    rng = np.random.default_rng(seed + 100)
    weights = trained_looking_weights(graph, seed)
    for node_id, params in weights.items():
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
    # TF's depthwise gradients refuse unequal strides: this one takes the split path
    "depthwise_conv_unequal_strides": (IMAGE, [PRE_CONV, {"id": "op", "op": "conv2d", "inputs": ["pre"], "attrs": {
        "filters": 6, "kernel": [3, 1], "strides": [1, 2], "padding": [1, 1, 0, 0], "groups": 6}}]),
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
    model = lower_graph(graph, weights, precision, BACKEND.devices()[0])
    out_tol, grad_tol = TOLERANCES[precision]
    _close(BACKEND.predict(model, x), forward(graph, weights, x), out_tol, what="output")
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


def test_the_backend_declares_every_op_of_the_ir():
    assert BACKEND.supported_ops() == ALL_OPS
    assert {op for inp, nodes in OP_CASES.values() for op in [inp["op"]] + [n["op"] for n in nodes]} | {
        "dense", "softmax", "flatten", "conv2d", "add", "batch_norm", "relu", "max_pool", "global_avg_pool",
        "concat", "dropout"} == set(OPS)  # ALL_OPS adds grouped_conv2d, a capability


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_each_new_op_forward_and_backward_against_the_reference(case):
    graph = _graph(*OP_CASES[case], head_input="op")
    for precision in PRECISIONS:
        _check_against_reference(graph, precision)


def test_constants_are_not_trained_and_cross_the_interface_like_moving_statistics():
    graph = _graph(*OP_CASES["mul_add_const"], head_input="op")
    weights = _weights(graph)
    model = BACKEND.lower(graph, weights)
    assert [v.name for v in model.trainables if "value" in v.name] == []
    exported = BACKEND.export_weights(model)
    assert np.array_equal(exported["m"]["value"], weights["m"]["value"]) and exported["op"]["value"].shape == (1,)
    _, grads = BACKEND.loss_and_grads(model, *_batch(graph, 2, 0))
    assert "value" not in grads["m"] and "value" not in grads["op"]
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
    graph = gpt(2, 32, 4, 8, 50)
    for precision in PRECISIONS:
        _check_against_reference(graph, precision, n=2)


def test_token_ids_of_either_integer_width_give_the_same_logits():
    """A host stream may carry int32 ids: the token input widens them."""
    import tensorflow as tf

    graph = gpt(1, 16, 2, 6, 20)
    model = BACKEND.lower(graph, _weights(graph))
    x, _ = _batch(graph, 2, 0)
    narrow, _ = model.call(tf.constant(x.astype(np.int32)), False)
    wide, _ = model.call(tf.constant(x), False)
    np.testing.assert_array_equal(narrow.numpy(), wide.numpy())


def _language_data(graph: Graph, n: int, seed: int):
    """Sequences whose next token follows from the current one (t -> 3t + 1 mod V): learnable."""
    rng = np.random.default_rng(seed)
    vocab, seq = graph.vocab, graph.input_shape[0]
    tokens = np.empty((n, seq + 1), np.int64)
    tokens[:, 0] = rng.integers(0, vocab, n)
    for i in range(seq):
        tokens[:, i + 1] = (3 * tokens[:, i] + 1) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def test_training_a_gpt_lowers_the_loss_and_counts_sequences_and_tokens():
    graph = gpt(1, 16, 2, 6, 13)
    model = BACKEND.lower(graph, _weights(graph))
    x, y = _language_data(graph, 40, 0)
    xv, yv = _language_data(graph, 10, 1)
    data = Dataset(x.astype(np.int32), y, xv, yv, graph.vocab)
    before, _ = BACKEND.loss_and_grads(model, x, y)
    reports = BACKEND.train(model, data, TrainConfig(epochs=3, batch_size=8, schedule=Schedule(0.3)))
    after, _ = BACKEND.loss_and_grads(model, x, y)
    assert after < 0.8 * before
    assert [(r.train_images, r.val_images) for r in reports] == [(40, 10)] * 3
    assert reports[-1].loss < reports[0].loss
    probs = BACKEND.predict(model, xv)
    # per token: the mean cross-entropy over every position, the accuracy over every position
    want_val_loss = -np.mean(np.log(np.take_along_axis(probs, yv[..., None], axis=-1)))
    assert reports[-1].val_loss == pytest.approx(want_val_loss, rel=1e-4)
    assert reports[-1].val_accuracy == pytest.approx(np.mean(probs.argmax(-1) == yv))


def test_a_gpt_training_step_matches_the_reference_sgd_step():
    """One step of plain SGD (momentum 0) moves every weight by -lr times the reference gradient of
    the mean loss over every token."""
    graph = gpt(1, 16, 2, 6, 13)
    weights = _weights(graph)
    model = BACKEND.lower(graph, weights)
    x, y = _language_data(graph, 4, 2)
    _, want_grads, _ = loss_and_grads(graph, weights, x, y)
    BACKEND.train(model, Dataset(x, y, x[:1], y[:1], graph.vocab),
                  TrainConfig(epochs=1, batch_size=4, momentum=0.0, schedule=Schedule(0.5)))
    after = BACKEND.export_weights(model)
    for node_id, params in want_grads.items():
        for name, grad in params.items():
            np.testing.assert_allclose(after[node_id][name], weights[node_id][name] - 0.5 * grad, atol=2e-6,
                                       err_msg=f"{node_id}/{name}")


def test_the_native_counter_on_a_gpt_matches_the_analytic_dense_and_attention():
    graph = gpt(2, 32, 4, 8, 50)
    counter = BACKEND.native_counter()
    assert {"dense", "attention"} <= set(counter.convention.covers) and counter.convention.padding == "paper"
    model = BACKEND.lower(graph, _weights(graph))
    analytic = opcount.count(graph, counter.convention.padding).by_category()  # bp: gradients, no update
    batch = 2
    for backward in (False, True):
        got = counter.count(model, batch, backward)
        for category in ("dense", "attention"):
            want = batch * (analytic[category]["fp"] + (analytic[category]["bp"] if backward else 0))
            assert got[category] == want, f"{category} backward={backward}: {got[category]:,} vs {want:,}"
    # the standard formula on the matrix products: per sequence 2 S (12 L H^2 + H V) + 4 S^2 H L
    s, h, layers, v = 8, 32, 2, 50
    assert got["dense"] + got["attention"] == 3 * batch * (2 * s * (12 * layers * h * h + h * v)
                                                          + 4 * s * s * h * layers)


def test_the_native_counter_counts_grouped_and_depthwise_convolutions():
    for case in ("grouped_conv", "depthwise_conv"):
        graph = _graph(*OP_CASES[case], head_input="op")
        model = BACKEND.lower(graph, _weights(graph))
        counted = opcount.count(graph, "paper")
        for backward in (False, True):
            want = 2 * sum(n.fp + (n.grad if backward else 0) for n in counted.nodes if n.category == "conv")
            assert BACKEND.native_counter().count(model, 2, backward)["conv"] == want, (case, backward)


def test_data_parallel_training_on_tokens_equals_one_device():
    """Two logical CPU devices (a fresh process: AIPERF_CPU_DEVICES is read before TF starts) train a
    GPT on token ids as one device does on the combined batch (22 sequences: batches of 8, 8 and 6,
    the last shared 3 and 3)."""
    script = """
        import json
        import numpy as np
        from aiperf_backends.tensorflow import TensorFlowBackend
        from aiperf_core.backend import Dataset, Schedule, TrainConfig
        from aiperf_core.builders import gpt

        backend = TensorFlowBackend()
        graph = gpt(1, 16, 2, 6, 13)
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 13, (22, 6)), rng.integers(0, 13, (22, 6))
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
    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "OMP_NUM_THREADS")}
    env.update(AIPERF_CPU_DEVICES="2", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["devices"] == ["cpu:0", "cpu:1"] and r["seqs"] == [22, 22]
    assert r["worst"] < 2e-5
    np.testing.assert_allclose(r["loss"][1], r["loss"][0], rtol=1e-5)
    np.testing.assert_allclose(r["val"][1], r["val"][0], rtol=1e-5)
