"""A mixture of experts' load balance in the NumPy reference (TrainConfig.moe_aux_loss, EpochReport.expert_load):
the sequence-wise load-balancing loss's gradient against central finite differences, its value at an even
load, its additivity over micro-batches, and the numpy backend's routing counts of a training run."""

import numpy as np
import pytest

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.ir import Graph, Node
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.weights import init_weights

import aiperf_numpy
from aiperf_numpy.backend import NumpyBackend

S, D, E, K, F, CLASSES = 5, 6, 4, 2, 7, 3
ALPHA = 0.5


def moe_graph(seq: int = S, width: int = D) -> Graph:
    """A dense layer before the moe, so that the loss's gradient to the moe's input is checked through it."""
    return Graph([Node("x", "input", (), {"shape": [seq, width]}), Node("pre", "dense", ("x",), {"units": width}),
                  Node("m", "moe", ("pre",), {"experts": E, "top_k": K, "units": F}),
                  Node("d", "dense", ("m",), {"units": CLASSES}), Node("p", "softmax", ("d",), {})])


def weights_for(graph: Graph, seed: int = 0) -> dict:
    weights = init_weights(graph, seed, np.float64)
    rng = np.random.default_rng(seed + 1)
    return {nid: {name: value + rng.normal(0, 0.3, value.shape) for name, value in params.items()}
            for nid, params in weights.items()}


def batch(n: int, seed: int = 2):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (n, S, D)), rng.integers(0, CLASSES, (n, S))


def aux_value(graph, weights, x, alpha=ALPHA) -> tuple[float, np.ndarray]:
    """The load-balancing loss of the batch and its routing (every moe's chosen experts)."""
    trace = aiperf_numpy.run(graph, weights, x, training=True, moe_aux_loss=alpha)
    return sum(trace.aux_losses.values()), trace.caches["m"]["chosen"]


def test_the_aux_loss_gradient_is_its_central_finite_difference():
    """f is piecewise constant in the weights: each perturbation is small enough to keep every token's
    routing (checked), inside which the loss is smooth and its derivative is the analytic gradient."""
    graph = moe_graph()
    weights = weights_for(graph)
    x, y = batch(3)
    _, plain, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y)
    _, with_aux, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)
    value, routing = aux_value(graph, weights, x)
    assert value > 0.0
    eps = 1e-6
    checked = 0
    for nid, params in plain.items():
        for name in params:
            analytic = with_aux[nid][name] - plain[nid][name]  # the aux term's share of the gradient
            numeric = np.zeros_like(analytic)
            for index in np.ndindex(analytic.shape):
                values = []
                for sign in (1.0, -1.0):
                    moved = {n: {p: a.copy() for p, a in ps.items()} for n, ps in weights.items()}
                    moved[nid][name][index] += sign * eps
                    moved_value, moved_routing = aux_value(graph, moved, x)
                    assert np.array_equal(moved_routing, routing), f"{nid}.{name}{index}: a routing flipped"
                    values.append(moved_value)
                numeric[index] = (values[0] - values[1]) / (2 * eps)
            np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-9, err_msg=f"{nid}.{name}")
            checked += int(np.abs(numeric).max() > 1e-6)
    # The router and the dense layer before the moe (through the moe's input) receive it; the experts
    # and the layers after the moe do not.
    assert checked == 3
    assert all(np.abs(with_aux[nid][name] - plain[nid][name]).max() > 1e-4 for nid, name in
               (("m", "router"), ("pre", "kernel"), ("pre", "bias")))
    assert all(np.array_equal(with_aux[nid][name], plain[nid][name]) for nid, name in
               (("m", "w_in"), ("m", "b_in"), ("m", "w_out"), ("m", "b_out"), ("d", "kernel"), ("d", "bias")))


def test_an_exactly_even_load_gives_one_and_a_concentrated_load_more():
    """Token v of E one-hot tokens has logits 2 at expert v and 1 at expert v + 1 (mod E): its top 2 are v
    and v + 1, so that a sequence of the E tokens, in any order, sends each expert 2 of its 2 E assignments."""
    seq = width = E
    graph = Graph([Node("x", "input", (), {"shape": [seq, width]}),
                   Node("m", "moe", ("x",), {"experts": E, "top_k": K, "units": F}),
                   Node("d", "dense", ("m",), {"units": CLASSES}), Node("p", "softmax", ("d",), {})])
    weights = weights_for(graph)
    router = 2.0 * np.eye(E) + np.roll(np.eye(E), 1, axis=1)
    weights["m"]["router"] = router
    even = np.eye(E)[[[0, 1, 2, 3], [2, 0, 3, 1]]]  # two sequences, each holding every token once
    assert aiperf_numpy.expert_load(graph, weights, even) == {"m": (4, 4, 4, 4)}
    value, _ = aux_value(graph, weights, even, alpha=1.0)
    assert value == pytest.approx(1.0, rel=1e-12)
    # Each token of a sequence of token 0 alone chooses experts 0 and 1: f = (1/2, 1/2, 0, 0) and
    # E sum_e f_e P_e = 2 (P_0 + P_1), more than 1 since those are every token's two largest probabilities.
    concentrated = np.eye(E)[[[0, 0, 0, 0]]]
    assert aiperf_numpy.expert_load(graph, weights, concentrated) == {"m": (4, 4, 0, 0)}
    value, _ = aux_value(graph, weights, concentrated, alpha=1.0)
    logits = concentrated[0, 0] @ router
    probs = np.exp(logits) / np.exp(logits).sum()
    assert value == pytest.approx(2.0 * (probs[0] + probs[1]), rel=1e-12) and value > 1.0


def test_micro_batches_weighted_by_their_sequences_add_up_to_the_whole_batch():
    graph = moe_graph()
    weights = weights_for(graph)
    x, y = batch(5)
    whole_value, _ = aux_value(graph, weights, x)
    _, whole, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)
    summed_value, summed = 0.0, None
    for start, stop in ((0, 3), (3, 5)):
        share = (stop - start) / len(x)
        summed_value += share * aux_value(graph, weights, x[start:stop])[0]
        _, part, _ = aiperf_numpy.loss_and_grads(graph, weights, x[start:stop], y[start:stop], moe_aux_loss=ALPHA)
        scaled = {n: {p: share * g for p, g in ps.items()} for n, ps in part.items()}
        summed = scaled if summed is None else {n: {p: summed[n][p] + g for p, g in ps.items()}
                                                for n, ps in scaled.items()}
    assert summed_value == pytest.approx(whole_value, rel=1e-12)
    for nid, params in whole.items():
        for name, value in params.items():
            np.testing.assert_allclose(summed[nid][name], value, rtol=1e-10, atol=1e-14, err_msg=f"{nid}.{name}")


def test_the_loss_reported_and_returned_is_the_cross_entropy_alone():
    graph = moe_graph()
    weights = weights_for(graph)
    x, y = batch(3)
    assert aiperf_numpy.loss_and_grads(graph, weights, x, y, moe_aux_loss=ALPHA)[0] == \
        aiperf_numpy.loss_and_grads(graph, weights, x, y)[0]


def upcycled_gpt():
    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    return upcycle_moe(graph, None, "h0_fc1", seed=5).graph


def test_the_numpy_backend_reports_the_routing_its_training_steps_ran():
    """At a learning rate of 0 the weights stay put, so that each epoch's counts, over batches of 3, 3 and
    2 sequences and micro-batches of 2, are the reference's routing of all 8 sequences; at a real rate
    each epoch's counts still add up to its tokens times top_k, and the aux loss moves the router."""
    graph = upcycled_gpt()
    moe = next(node for node in graph.nodes if node.op == "moe")
    weights = init_weights(graph, seed=3)
    tokens = np.random.default_rng(4).integers(0, graph.vocab, (8, graph.input_shape[0] + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    data = Dataset(x, y, x, y, graph.vocab)
    backend = NumpyBackend()
    want = aiperf_numpy.expert_load(graph, weights, x)
    assert set(want) == {moe.id} and sum(want[moe.id]) == x.size * moe.attrs["top_k"]
    still = TrainConfig(epochs=2, batch_size=3, micro_batch=2, schedule=Schedule(initial=0.0), moe_aux_loss=0.1)
    reports = backend.train(backend.lower(graph, weights), data, still)
    assert [report.expert_load for report in reports] == [want, want]
    plain = backend.train(backend.lower(graph, weights), data, TrainConfig(epochs=1, batch_size=3, micro_batch=2,
                                                                           schedule=Schedule(initial=0.0)))
    assert plain[0].loss == reports[0].loss  # the aux term is not in EpochReport.loss

    moving = {}
    for alpha in (0.0, 0.1):
        model = backend.lower(graph, weights)
        config = TrainConfig(epochs=2, batch_size=3, schedule=Schedule(initial=0.05), moe_aux_loss=alpha)
        for report in backend.train(model, data, config):
            assert sum(report.expert_load[moe.id]) == x.size * moe.attrs["top_k"]
        moving[alpha] = backend.export_weights(model)[moe.id]["router"]
    assert not np.allclose(moving[0.0], moving[0.1])

    dense = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    reports = backend.train(backend.lower(dense), data, TrainConfig(epochs=1, batch_size=8))
    assert reports[0].expert_load is None
