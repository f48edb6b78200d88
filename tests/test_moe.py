"""The `moe` IR op: its attributes and parameters, schema version 3, its count (docs/counting.md,
"Mixture of experts"), and the NumPy reference's routing and gradients against first principles."""

import numpy as np
import pytest

from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, Node
from aiperf_core.weights import init_weights
from aiperf_opcount import count
from aiperf_opcount.rules import GELU_BP, GELU_FP

import aiperf_numpy  # noqa: E402  (installed by `make test`)

S, D, E, K, F = 5, 6, 4, 2, 7


def moe_graph(upstream: bool = False, **attrs) -> Graph:
    attrs = {"experts": E, "top_k": K, "units": F, **attrs}
    nodes = [Node("x", "input", (), {"shape": [S, D]})]
    if upstream:
        nodes.append(Node("pre", "dense", ("x",), {"units": D}))
    nodes += [Node("m", "moe", ("pre" if upstream else "x",), attrs), Node("d", "dense", ("m",), {"units": 3}),
              Node("p", "softmax", ("d",), {})]
    return Graph(nodes)


def test_attributes_parameters_and_schema():
    graph = moe_graph()
    assert graph.shapes["m"] == (S, D)
    assert graph.param_shapes("m") == {"router": (D, E), "w_in": (E, D, F), "b_in": (E, F), "w_out": (E, F, D),
                                       "b_out": (E, D)}
    assert graph.num_params() == D * E + E * (D * F + F + F * D + D) + D * 3 + 3
    assert graph.schema_version() == 3 and Graph.from_json(graph.to_json()).signature() == graph.signature()
    for attrs, message in (({"top_k": 5}, "'top_k' \\(5\\) must not exceed 'experts' \\(4\\)"),
                           ({"experts": 1}, "'experts'"), ({"units": 0}, "'units'"), ({"gate": 1}, "unknown attribute 'gate'")):
        with pytest.raises(GraphError, match=message) as info:
            moe_graph(**attrs)
        assert info.value.node == "m"
    with pytest.raises(GraphError, match="must be a sequence"):
        Graph([Node("x", "input", (), {"shape": [D]}), Node("m", "moe", ("x",), {"experts": 2, "top_k": 1, "units": 2})])


def node_count(graph):
    return next(n for n in count(graph).nodes if n.id == "m")


def test_the_count_is_the_router_and_the_chosen_experts_only():
    mac, per_expert = 2, 2 * 2 * D * F + GELU_FP * F + D
    fp = S * (mac * D * E + 13 * E + K * E + 5 * K + K * per_expert + (K - 1) * D)
    grad_data = S * (K * (3 * D + 3 * 2 * D * F + GELU_BP * F) + K * 4 + mac * D * E)
    m = node_count(moe_graph())
    update = 2 * (D * E + E * (D * F + F + F * D + D))
    assert (m.fp, m.grad, m.update, m.category) == (fp, grad_data, update, "moe")
    # With a trained layer upstream the input gradients of the experts and the router are counted too.
    up = node_count(moe_graph(upstream=True))
    assert (up.fp, up.grad) == (fp, grad_data + S * (K * mac * D * F + mac * D * E))
    # Twice the experts at the same top_k: only the router and the choice grow, not the experts' work.
    wide = count(moe_graph(experts=2 * E))
    assert wide.fp - count(moe_graph()).fp == S * (mac * D * E + 13 * E + K * E)


def weights_for(graph, seed=0):
    weights = init_weights(graph, seed, np.float64)
    rng = np.random.default_rng(seed + 1)
    for params in weights.values():
        for name in params:
            params[name] = params[name] + rng.normal(0, 0.3, params[name].shape)
    return weights


def test_the_reference_routes_each_token_to_its_top_k_with_renormalised_gates():
    graph = moe_graph()
    weights = weights_for(graph)
    x = np.random.default_rng(2).normal(0, 1, (3, S, D))
    got = aiperf_numpy.run(graph, weights, x, dtype=np.float64).outputs["m"]
    p = weights["m"]
    for n in range(3):
        for s in range(S):
            token = x[n, s]
            logits = token @ p["router"]
            probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            top = np.argsort(-probs)[:K]
            gates = probs[top] / probs[top].sum()
            want = np.zeros(D)
            for gate, e in zip(gates, top):
                h = token @ p["w_in"][e] + p["b_in"][e]
                act = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
                want += gate * (act @ p["w_out"][e] + p["b_out"][e])
            np.testing.assert_allclose(got[n, s], want, rtol=1e-12, atol=1e-12)


def test_the_reference_gradients_match_finite_differences():
    graph = moe_graph(upstream=True)
    weights = weights_for(graph, 3)
    rng = np.random.default_rng(4)
    x, y = rng.normal(0, 1, (2, S, D)), rng.integers(0, 3, (2, S))
    _, grads, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y)
    for node, name in (("m", "router"), ("m", "w_in"), ("m", "b_in"), ("m", "w_out"), ("m", "b_out"),
                       ("pre", "kernel")):  # the last: the moe's input gradient, through the layer before it
        array = weights[node][name]
        for index in list(np.ndindex(array.shape))[::max(1, array.size // 12)]:
            old = array[index]
            array[index] = old + 1e-6
            up, _, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y)
            array[index] = old - 1e-6
            down, _, _ = aiperf_numpy.loss_and_grads(graph, weights, x, y)
            array[index] = old
            assert grads[node][name][index] == pytest.approx((up - down) / 2e-6, abs=1e-7), (node, name, index)
