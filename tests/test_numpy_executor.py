"""The NumPy reference executor (plugins/aiperf-numpy) against naive loops and finite differences.

It is the oracle every framework backend is compared with, so each op's
forward pass is checked against a deliberately naive implementation, and each
gradient against central finite differences in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, Node

from aiperf_numpy import Trace, backward, forward, loss_and_grads, run  # noqa: E402

TRAINABLE = ("kernel", "bias", "gamma", "beta")
FD_EPS = 1e-6
FD_RTOL = 1e-5
FD_ATOL = 1e-7


# ---------------------------------------------------------------------------
# Graphs and weights
# ---------------------------------------------------------------------------


def chain(input_shape, *layers) -> Graph:
    """input -> layers[0] -> layers[1] ...; each layer is (op, attrs). Node ids n0, n1, ..."""
    nodes = [Node("x", "input", (), {"shape": list(input_shape)})]
    prev = "x"
    for k, (op, attrs) in enumerate(layers):
        nodes.append(Node(f"n{k}", op, (prev,), dict(attrs)))
        prev = f"n{k}"
    return Graph(nodes)


def random_weights(graph: Graph, rng) -> dict:
    """Non-trivial float64 weights: random kernels, biases, BN affine and moving statistics."""
    out = {}
    for node_id, shapes in graph.all_param_shapes().items():
        params = {}
        for name, shape in shapes.items():
            if name == "kernel":
                fan_in = math.prod(shape[:-1])
                params[name] = rng.standard_normal(shape) / math.sqrt(fan_in)
            elif name == "gamma":
                params[name] = rng.uniform(0.5, 1.5, shape)
            elif name == "moving_variance":
                params[name] = rng.uniform(0.5, 2.0, shape)
            elif name == "moving_mean":
                params[name] = 0.5 * rng.standard_normal(shape)
            else:  # beta, bias
                params[name] = 0.1 * rng.standard_normal(shape)
        out[node_id] = params
    return out


def batch(rng, graph: Graph, n: int) -> np.ndarray:
    return rng.standard_normal((n,) + tuple(graph.input_shape))


# ---------------------------------------------------------------------------
# Naive references (python loops over tiny tensors)
# ---------------------------------------------------------------------------


def naive_pad(x, padding, value):
    pt, pb, pl, pr = padding
    n, h, w, c = x.shape
    out = np.full((n, h + pt + pb, w + pl + pr, c), value, dtype=np.float64)
    out[:, pt : pt + h, pl : pl + w, :] = x
    return out


def naive_conv(x, kernel, bias, strides, padding):
    kh, kw, ci, co = kernel.shape
    sh, sw = strides
    xp = naive_pad(x, padding, 0.0)
    n = x.shape[0]
    ho = (xp.shape[1] - kh) // sh + 1
    wo = (xp.shape[2] - kw) // sw + 1
    y = np.zeros((n, ho, wo, co))
    for b in range(n):
        for i in range(ho):
            for j in range(wo):
                for f in range(co):
                    s = 0.0 if bias is None else bias[f]
                    for di in range(kh):
                        for dj in range(kw):
                            for c in range(ci):
                                s += xp[b, i * sh + di, j * sw + dj, c] * kernel[di, dj, c, f]
                    y[b, i, j, f] = s
    return y


def naive_max_pool(x, kernel, strides, padding):
    """Forward value and the gradient of sum(y * g) routed to the first maximum (row-major)."""
    kh, kw = kernel
    sh, sw = strides
    pt, _, pl, _ = padding
    xp = naive_pad(x, padding, -np.inf)
    n, _, _, c = x.shape
    ho = (xp.shape[1] - kh) // sh + 1
    wo = (xp.shape[2] - kw) // sw + 1
    y = np.zeros((n, ho, wo, c))
    first = {}
    for b in range(n):
        for i in range(ho):
            for j in range(wo):
                for ch in range(c):
                    best, where = -np.inf, None
                    for di in range(kh):
                        for dj in range(kw):
                            v = xp[b, i * sh + di, j * sw + dj, ch]
                            if where is None or v > best:
                                best, where = v, (i * sh + di - pt, j * sw + dj - pl)
                    y[b, i, j, ch] = best
                    first[b, i, j, ch] = where
    return y, first


def naive_max_pool_grad(x, first, g):
    dx = np.zeros_like(x, dtype=np.float64)
    for (b, i, j, ch), (r, s) in first.items():
        dx[b, r, s, ch] += g[b, i, j, ch]
    return dx


def naive_batch_norm(x, gamma, beta, mean, var, eps):
    y = np.zeros_like(x, dtype=np.float64)
    for ch in range(x.shape[-1]):
        y[..., ch] = (x[..., ch] - mean[ch]) / math.sqrt(var[ch] + eps) * gamma[ch] + beta[ch]
    return y


def naive_batch_stats(x):
    """Per-channel mean, biased and unbiased variance over every axis but the last."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    mean = np.array([sum(flat[:, c]) / m for c in range(flat.shape[1])])
    ss = np.array([sum((flat[:, c] - mean[c]) ** 2) for c in range(flat.shape[1])])
    return mean, ss / m, ss / (m - 1)


def naive_dense(x, kernel, bias):
    n, (fan_in, units) = x.shape[0], kernel.shape
    y = np.zeros((n, units))
    for b in range(n):
        for u in range(units):
            y[b, u] = sum(x[b, i] * kernel[i, u] for i in range(fan_in)) + (0.0 if bias is None else bias[u])
    return y


def naive_softmax(x):
    y = np.zeros_like(x, dtype=np.float64)
    for b in range(x.shape[0]):
        top = max(x[b])
        e = [math.exp(v - top) for v in x[b]]
        y[b] = [v / sum(e) for v in e]
    return y


# ---------------------------------------------------------------------------
# Finite differences
# ---------------------------------------------------------------------------


def numeric_grad(f, array, indices=None, eps=FD_EPS):
    """Central differences of scalar f() with respect to entries of ``array`` (perturbed in place)."""
    indices = list(np.ndindex(array.shape)) if indices is None else indices
    out = {}
    for idx in indices:
        old = array[idx]
        array[idx] = old + eps
        plus = f()
        array[idx] = old - eps
        minus = f()
        array[idx] = old
        out[idx] = (plus - minus) / (2 * eps)
    return out


def assert_grad_close(analytic, numeric, what):
    idx = list(numeric)
    a = np.array([analytic[i] for i in idx])
    n = np.array([numeric[i] for i in idx])
    np.testing.assert_allclose(a, n, rtol=FD_RTOL, atol=FD_ATOL, err_msg=what)


def check_gradients(graph, weights, x, *, training, seed=0, rng=None):
    """backward() of sum(output * R) against finite differences, for the input and every trainable param."""
    rng = rng or np.random.default_rng(123)
    trace = run(graph, weights, x, training=training, seed=seed)
    r = rng.standard_normal(trace.output.shape)
    grad_x, param_grads = backward(trace, r)

    def f():
        return float(np.sum(forward(graph, weights, x, training=training, seed=seed) * r))

    assert grad_x.shape == x.shape and grad_x.dtype == np.float64
    assert_grad_close(grad_x, numeric_grad(f, x), "input gradient")
    expected = {nid: {p for p in shapes if p in TRAINABLE} for nid, shapes in graph.all_param_shapes().items()}
    assert {nid: set(g) for nid, g in param_grads.items()} == expected
    for nid, params in param_grads.items():
        for pname, g in params.items():
            assert g.shape == weights[nid][pname].shape
            assert_grad_close(g, numeric_grad(f, weights[nid][pname]), f"{nid}/{pname}")
    return trace


# ---------------------------------------------------------------------------
# Per-op forward against the naive references, and gradients
# ---------------------------------------------------------------------------

# (input HWC, filters, kernel, strides, padding [t, b, l, r], use_bias)
CONV_CASES = [
    ((5, 5, 3), 4, (1, 1), (1, 1), (0, 0, 0, 0), False),
    ((4, 4, 3), 4, (1, 1), (2, 2), (0, 0, 0, 0), True),
    ((5, 6, 2), 3, (3, 3), (1, 1), (1, 1, 1, 1), True),
    ((6, 6, 2), 3, (3, 3), (2, 2), (0, 1, 0, 1), False),
    ((6, 6, 2), 3, (3, 3), (2, 2), (1, 2, 0, 1), True),
    ((6, 6, 2), 2, (5, 5), (1, 1), (2, 2, 2, 2), False),
    ((8, 8, 2), 3, (5, 5), (2, 2), (1, 2, 0, 1), True),
    ((5, 6, 2), 3, (2, 3), (2, 1), (1, 0, 0, 2), True),
    ((6, 5, 3), 2, (3, 1), (1, 2), (1, 2, 0, 0), False),
    ((8, 8, 3), 4, (7, 7), (2, 2), (3, 3, 3, 3), False),
]


def conv_graph(case):
    shape, filters, kernel, strides, padding, use_bias = case
    return chain(shape, ("conv2d", dict(filters=filters, kernel=list(kernel), strides=list(strides),
                                        padding=list(padding), use_bias=use_bias)))


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_forward_matches_naive(case):
    rng = np.random.default_rng(1)
    g = conv_graph(case)
    w = random_weights(g, rng)
    x = batch(rng, g, 2)
    y = forward(g, w, x)
    _, _, _, strides, padding, use_bias = case
    ref = naive_conv(x, w["n0"]["kernel"], w["n0"].get("bias"), strides, padding)
    assert y.shape == (2,) + g.shapes["n0"]
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv2d_gradients(case):
    rng = np.random.default_rng(2)
    g = conv_graph(case)
    check_gradients(g, random_weights(g, rng), batch(rng, g, 2), training=False)


# (input HWC, kernel, strides, padding)
POOL_CASES = [
    ((4, 4, 2), (2, 2), (2, 2), (0, 0, 0, 0)),
    ((7, 7, 2), (3, 3), (2, 2), (1, 1, 1, 1)),
    ((6, 6, 3), (3, 3), (2, 2), (0, 1, 0, 1)),
    ((5, 6, 2), (3, 3), (1, 1), (1, 2, 0, 1)),
    ((5, 6, 2), (2, 3), (1, 2), (1, 0, 0, 2)),
    ((6, 6, 1), (5, 5), (1, 1), (2, 2, 2, 2)),
]


def pool_graph(case):
    shape, kernel, strides, padding = case
    return chain(shape, ("max_pool", dict(kernel=list(kernel), strides=list(strides), padding=list(padding))))


@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_max_pool_forward_and_tie_breaking_match_naive(case):
    rng = np.random.default_rng(3)
    g = pool_graph(case)
    _, kernel, strides, padding = case
    # Small integers: many ties, so the first-maximum rule is exercised.
    x = rng.integers(-2, 3, size=(2,) + tuple(g.input_shape)).astype(np.float64)
    trace = run(g, {}, x)
    ref, first = naive_max_pool(x, kernel, strides, padding)
    np.testing.assert_array_equal(trace.output, ref)
    np.testing.assert_array_equal(forward(g, {}, x), ref)
    gy = rng.standard_normal(ref.shape)
    grad_x, params = backward(trace, gy)
    np.testing.assert_allclose(grad_x, naive_max_pool_grad(x, first, gy), rtol=1e-12, atol=1e-12)
    assert params == {}


def test_max_pool_padding_is_minus_infinity():
    g = chain((2, 2, 1), ("max_pool", dict(kernel=[2, 2], strides=[1, 1], padding=[1, 0, 1, 0])))
    x = -np.arange(1.0, 5.0).reshape(1, 2, 2, 1)  # all negative: zero padding would win
    y = forward(g, {}, x)
    np.testing.assert_array_equal(y[0, :, :, 0], [[-1, -1], [-1, -1]])


@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_max_pool_gradients(case):
    rng = np.random.default_rng(4)
    g = pool_graph(case)
    check_gradients(g, {}, batch(rng, g, 2), training=False)


@pytest.mark.parametrize("shape", [(4, 5, 3), (6,)], ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_batch_norm_forward_matches_naive(shape, training):
    rng = np.random.default_rng(5)
    g = chain(shape, ("batch_norm", dict(epsilon=1e-3, momentum=0.9)))
    w = random_weights(g, rng)
    x = 2.0 + 3.0 * batch(rng, g, 3 if len(shape) == 3 else 7)
    p = w["n0"]
    trace = run(g, w, x, training=training)
    if training:
        mean, var_biased, var_unbiased = naive_batch_stats(x)
        ref = naive_batch_norm(x, p["gamma"], p["beta"], mean, var_biased, 1e-3)
        upd = trace.moving_updates["n0"]
        np.testing.assert_allclose(upd["moving_mean"], 0.9 * p["moving_mean"] + 0.1 * mean, rtol=1e-12)
        np.testing.assert_allclose(upd["moving_variance"], 0.9 * p["moving_variance"] + 0.1 * var_unbiased,
                                   rtol=1e-12)
        assert set(trace.moving_updates) == {"n0"}
    else:
        ref = naive_batch_norm(x, p["gamma"], p["beta"], p["moving_mean"], p["moving_variance"], 1e-3)
        assert trace.moving_updates == {}
    np.testing.assert_allclose(trace.output, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(forward(g, w, x, training=training), ref, rtol=1e-12, atol=1e-12)


def test_batch_norm_training_ignores_moving_stats_and_inference_uses_them():
    rng = np.random.default_rng(6)
    g = chain((3, 3, 4), ("batch_norm", dict(epsilon=1e-5, momentum=0.99)))
    w = random_weights(g, rng)
    x = batch(rng, g, 4)
    other = {"n0": dict(w["n0"], moving_mean=w["n0"]["moving_mean"] + 5.0,
                        moving_variance=w["n0"]["moving_variance"] * 3.0)}
    np.testing.assert_array_equal(forward(g, w, x, training=True), forward(g, other, x, training=True))
    assert not np.allclose(forward(g, w, x), forward(g, other, x))
    # Training output is normalised per channel: mean beta, std gamma (up to epsilon).
    y = forward(g, w, x, training=True)
    np.testing.assert_allclose(y.mean(axis=(0, 1, 2)), w["n0"]["beta"], atol=1e-12)
    np.testing.assert_allclose(y.std(axis=(0, 1, 2)), w["n0"]["gamma"], rtol=1e-4)


@pytest.mark.parametrize("shape", [(3, 4, 3), (5,)], ids=str)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_batch_norm_gradients(shape, training):
    rng = np.random.default_rng(7)
    g = chain(shape, ("batch_norm", dict(epsilon=1e-3, momentum=0.9)))
    x = 1.0 + batch(rng, g, 3 if len(shape) == 3 else 6)
    check_gradients(g, random_weights(g, rng), x, training=training)


def test_relu_forward_and_gradient():
    rng = np.random.default_rng(8)
    g = chain((3, 4, 2), ("relu", {}))
    x = batch(rng, g, 2)
    y = forward(g, {}, x)
    ref = np.array([v if v > 0 else 0.0 for v in x.ravel()]).reshape(x.shape)
    np.testing.assert_array_equal(y, ref)
    check_gradients(g, {}, x, training=False)
    # The gradient at exactly zero is zero.
    zero = np.zeros((1, 3, 4, 2))
    gx, _ = backward(run(g, {}, zero), np.ones((1, 3, 4, 2)))
    assert not gx.any()


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_forward_and_gradients(use_bias):
    rng = np.random.default_rng(9)
    g = chain((7,), ("dense", dict(units=4, use_bias=use_bias)))
    w = random_weights(g, rng)
    x = batch(rng, g, 3)
    np.testing.assert_allclose(forward(g, w, x), naive_dense(x, w["n0"]["kernel"], w["n0"].get("bias")),
                               rtol=1e-12, atol=1e-12)
    check_gradients(g, w, x, training=False)


def test_softmax_forward_and_gradients():
    rng = np.random.default_rng(10)
    g = chain((6,), ("softmax", {}))
    x = 3.0 * batch(rng, g, 4)
    y = forward(g, {}, x)
    np.testing.assert_allclose(y, naive_softmax(x), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-12)
    # Stable for huge logits.
    big = forward(g, {}, np.array([[1000.0, 0, 0, 0, 0, 1000.0]]))
    np.testing.assert_allclose(big, [[0.5, 0, 0, 0, 0, 0.5]], atol=1e-300)
    check_gradients(g, {}, x, training=False)


def test_global_avg_pool_forward_and_gradients():
    rng = np.random.default_rng(11)
    g = chain((3, 4, 5), ("global_avg_pool", {}))
    x = batch(rng, g, 2)
    y = forward(g, {}, x)
    ref = np.array([[sum(x[b, i, j, c] for i in range(3) for j in range(4)) / 12 for c in range(5)]
                    for b in range(2)])
    assert y.shape == (2, 5)
    np.testing.assert_allclose(y, ref, rtol=1e-12)
    check_gradients(g, {}, x, training=False)


def test_flatten_is_nhwc_order_and_gradients():
    rng = np.random.default_rng(12)
    g = chain((3, 4, 2), ("flatten", {}))
    x = batch(rng, g, 2)
    y = forward(g, {}, x)
    assert y.shape == (2, 24)
    for b in range(2):
        for i in range(3):
            for j in range(4):
                for c in range(2):
                    assert y[b, (i * 4 + j) * 2 + c] == x[b, i, j, c]
    check_gradients(g, {}, x, training=False)


def multi_input_graph(op: str) -> Graph:
    """x -> conv 1x1 (a), x -> relu (b); op(b, x, a): three inputs, one of them the graph input."""
    return Graph([
        Node("x", "input", (), {"shape": [4, 4, 2]}),
        Node("a", "conv2d", ("x",), {"filters": 2 if op == "add" else 3, "kernel": [1, 1], "use_bias": True}),
        Node("b", "relu", ("x",), {}),
        Node("y", op, ("b", "x", "a"), {}),
    ])


@pytest.mark.parametrize("op", ["add", "concat"])
def test_add_and_concat_forward_and_gradients(op):
    rng = np.random.default_rng(13)
    g = multi_input_graph(op)
    w = random_weights(g, rng)
    x = batch(rng, g, 2)
    trace = run(g, w, x)
    parts = [trace.outputs[i] for i in ("b", "x", "a")]
    if op == "add":
        ref = parts[0] + parts[1] + parts[2]
    else:
        ref = np.zeros((2, 4, 4, 7))
        ref[..., 0:2], ref[..., 2:4], ref[..., 4:7] = parts
    np.testing.assert_allclose(trace.output, ref, rtol=1e-15)
    check_gradients(g, w, x, training=False)


def test_dropout_inference_is_identity_and_training_is_deterministic_inverted_dropout():
    rng = np.random.default_rng(14)
    g = chain((8, 8, 4), ("dropout", dict(rate=0.25)))
    x = batch(rng, g, 8)
    np.testing.assert_array_equal(forward(g, {}, x), x)
    a = forward(g, {}, x, training=True, seed=7)
    np.testing.assert_array_equal(a, forward(g, {}, x, training=True, seed=7))
    assert not np.array_equal(a, forward(g, {}, x, training=True, seed=8))
    keep = np.random.default_rng(7).random(x.shape) >= 0.25  # the documented mask
    np.testing.assert_allclose(a, np.where(keep, x / 0.75, 0.0), rtol=1e-15)
    assert abs((a == 0).mean() - 0.25) < 0.03
    # Same mask in float32.
    a32 = forward(g, {}, x, training=True, seed=7, dtype=np.float32)
    np.testing.assert_array_equal(a32 == 0, a == 0)
    # Backward applies the same mask and scale.
    trace = run(g, {}, x, training=True, seed=7)
    gy = rng.standard_normal(x.shape)
    np.testing.assert_allclose(backward(trace, gy)[0], np.where(keep, gy / 0.75, 0.0), rtol=1e-15)


def test_dropout_gradients_in_training():
    rng = np.random.default_rng(15)
    g = chain((3, 3, 2), ("dropout", dict(rate=0.5)))
    check_gradients(g, {}, batch(rng, g, 2), training=True, seed=3)


def test_small_cnn_gradients_in_training_mode():
    """Every op type chained, with dropout and batch-stat batch norm, in training mode."""
    rng = np.random.default_rng(16)
    g = chain(
        (6, 6, 2),
        ("conv2d", dict(filters=3, kernel=[3, 3], strides=[2, 2], padding=[1, 2, 0, 1], use_bias=True)),
        ("batch_norm", dict(epsilon=1e-3, momentum=0.9)),
        ("relu", {}),
        ("max_pool", dict(kernel=[2, 2], strides=[1, 1], padding=[0, 1, 0, 1])),
        ("flatten", {}),
        ("dropout", dict(rate=0.3)),
        ("dense", dict(units=4)),
        ("batch_norm", dict(epsilon=1e-3, momentum=0.9)),
        ("softmax", {}),
    )
    check_gradients(g, random_weights(g, rng), batch(rng, g, 3), training=True, seed=5)


# ---------------------------------------------------------------------------
# Whole network: resnet_small through loss_and_grads
# ---------------------------------------------------------------------------


def _targets(labels, classes, ls):
    y = np.full((len(labels), classes), ls / classes)
    y[np.arange(len(labels)), labels] += 1 - ls
    return y


def test_resnet_small_loss_and_gradients_in_training_mode():
    rng = np.random.default_rng(17)
    g = resnet_small((16, 16, 3), 5)
    w = random_weights(g, rng)
    x = batch(rng, g, 3)
    labels = np.array([0, 3, 4])
    ls = 0.1
    loss, grads, moving = loss_and_grads(g, w, x, labels, label_smoothing=ls)

    # The loss is the mean smoothed cross-entropy of the training-mode output.
    p = forward(g, w, x, training=True)
    y = _targets(labels, 5, ls)
    assert loss == pytest.approx(-np.mean(np.sum(y * np.log(p), axis=1)), rel=1e-12)

    def f():
        return loss_and_grads(g, w, x, labels, label_smoothing=ls)[0]

    expected = {nid: {p for p in shapes if p in TRAINABLE} for nid, shapes in g.all_param_shapes().items()}
    assert {nid: set(v) for nid, v in grads.items()} == expected
    for nid, params in grads.items():
        for pname, grad in params.items():
            arr = w[nid][pname]
            flat = rng.choice(arr.size, size=min(5, arr.size), replace=False)
            picks = [np.unravel_index(k, arr.shape) for k in flat]
            assert_grad_close(grad, numeric_grad(f, arr, picks), f"{nid}/{pname}")

    # Input gradient: backward() of dL/dp through the softmax equals the stable path.
    trace = run(g, w, x, training=True)
    grad_x, grads_via_p = backward(trace, -y / (trace.output * len(labels)))
    picks = [tuple(rng.integers(0, d) for d in x.shape) for _ in range(12)]
    assert_grad_close(grad_x, numeric_grad(f, x, picks), "input")
    for nid, params in grads.items():
        for pname, grad in params.items():
            np.testing.assert_allclose(grads_via_p[nid][pname], grad, rtol=1e-7, atol=1e-10)

    # Moving updates for every BN node, and the formula.
    bn_nodes = [n for n in g.nodes if n.op == "batch_norm"]
    assert set(moving) == {n.id for n in bn_nodes}
    node = bn_nodes[0]
    z = trace.outputs[node.inputs[0]]
    m = z.size // z.shape[-1]
    mom = node.attrs["momentum"]
    np.testing.assert_allclose(moving[node.id]["moving_mean"],
                               mom * w[node.id]["moving_mean"] + (1 - mom) * z.mean(axis=(0, 1, 2)), rtol=1e-12)
    np.testing.assert_allclose(moving[node.id]["moving_variance"],
                               mom * w[node.id]["moving_variance"] + (1 - mom) * z.var(axis=(0, 1, 2), ddof=1),
                               rtol=1e-12)
    assert m > 1


def test_resnet_small_inference_mode_gradients_sampled():
    rng = np.random.default_rng(18)
    g = resnet_small((8, 8, 3), 4)
    w = random_weights(g, rng)
    x = batch(rng, g, 2)
    labels = np.array([1, 2])
    loss, grads, moving = loss_and_grads(g, w, x, labels, training=False)
    assert moving == {}

    def f():
        return loss_and_grads(g, w, x, labels, training=False)[0]

    for nid in ("conv1_conv", "conv1_bn", "conv3_block1_2_conv", "conv4_block1_0_bn", "predictions"):
        for pname, grad in grads[nid].items():
            arr = w[nid][pname]
            picks = [np.unravel_index(k, arr.shape) for k in rng.choice(arr.size, size=3, replace=False)]
            assert_grad_close(grad, numeric_grad(f, arr, picks), f"{nid}/{pname}")


def test_loss_without_final_softmax_uses_clipped_probabilities():
    rng = np.random.default_rng(19)
    layers = [("dense", dict(units=4)), ("softmax", {})]
    with_softmax = chain((6,), *layers)
    no_softmax = chain((6,), *layers, ("dropout", dict(rate=0.0)))  # output op is not a softmax
    w = random_weights(with_softmax, rng)
    x = batch(rng, with_softmax, 5)
    labels = np.array([0, 1, 2, 3, 0])
    a = loss_and_grads(with_softmax, w, x, labels, label_smoothing=0.2)
    b = loss_and_grads(no_softmax, w, x, labels, label_smoothing=0.2)
    assert a[0] == pytest.approx(b[0], rel=1e-12)
    for pname in ("kernel", "bias"):
        np.testing.assert_allclose(a[1]["n0"][pname], b[1]["n0"][pname], rtol=1e-9, atol=1e-12)
    # Clip: a probability of exactly 0 for the true class gives -log(1e-7), and no gradient through it.
    g = Graph([Node("x", "input", (), {"shape": [2]}), Node("r", "relu", ("x",), {})])
    probs = np.array([[0.0, 1.0]])
    loss, _, _ = loss_and_grads(g, {}, probs, np.array([0]))
    assert loss == pytest.approx(-math.log(1e-7))


# ---------------------------------------------------------------------------
# Precision, API and errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_float32_close_to_float64(training):
    rng = np.random.default_rng(20)
    g = resnet_small((16, 16, 3), 5)
    w = random_weights(g, rng)
    x = batch(rng, g, 4)
    y64 = forward(g, w, x, training=training)
    y32 = forward(g, w, x, training=training, dtype=np.float32)
    assert y64.dtype == np.float64 and y32.dtype == np.float32
    np.testing.assert_allclose(y32, y64, rtol=1e-3, atol=1e-5)
    labels = np.array([0, 1, 2, 3])
    l64, g64, _ = loss_and_grads(g, w, x, labels, training=training)
    l32, g32, m32 = loss_and_grads(g, w, x, labels, training=training, dtype=np.float32)
    assert l32 == pytest.approx(l64, rel=1e-4)
    k32, k64 = g32["predictions"]["kernel"], g64["predictions"]["kernel"]
    assert k32.dtype == np.float32
    np.testing.assert_allclose(k32, k64, rtol=1e-3, atol=1e-4 * np.abs(k64).max())
    assert all(a.dtype == np.float32 for upd in m32.values() for a in upd.values())


def test_run_keeps_every_output_and_forward_matches():
    rng = np.random.default_rng(21)
    g = resnet_small((8, 8, 3), 3)
    w = random_weights(g, rng)
    x = batch(rng, g, 2)
    trace = run(g, w, x, training=True, seed=4)
    assert isinstance(trace, Trace)
    assert set(trace.outputs) == {n.id for n in g.nodes}
    for node in g.nodes:
        assert trace.outputs[node.id].shape == (2,) + g.shapes[node.id], node.id
    np.testing.assert_array_equal(trace.output, trace.outputs[g.output_id])
    np.testing.assert_array_equal(forward(g, w, x, training=True, seed=4), trace.output)
    np.testing.assert_array_equal(forward(g, w, x), run(g, w, x).output)


def test_wrong_input_shape_names_the_input_node():
    g = resnet_small((16, 16, 3), 5)
    w = random_weights(g, np.random.default_rng(22))
    for bad in (np.zeros((2, 16, 15, 3)), np.zeros((16, 16, 3)), np.zeros((2, 16, 16, 3, 1)), np.zeros((0, 16, 16, 3))):
        with pytest.raises(GraphError) as err:
            forward(g, w, bad)
        assert err.value.node == "input" and "'input'" in str(err.value)
    with pytest.raises(GraphError, match="'input'"):
        run(g, w, np.zeros((2, 3)))


def test_weights_are_validated():
    g = resnet_small((16, 16, 3), 5)
    w = random_weights(g, np.random.default_rng(23))
    x = np.zeros((1, 16, 16, 3))
    missing = {k: v for k, v in w.items() if k != "conv1_conv"}
    with pytest.raises(GraphError) as err:
        forward(g, missing, x)
    assert err.value.node == "conv1_conv"
    bad = dict(w, predictions=dict(w["predictions"], kernel=np.zeros((3, 5))))
    with pytest.raises(GraphError) as err:
        run(g, bad, x)
    assert err.value.node == "predictions"


def test_bad_grad_output_labels_and_dtype():
    g = chain((4,), ("dense", dict(units=3)), ("softmax", {}))
    w = random_weights(g, np.random.default_rng(24))
    x = np.ones((2, 4))
    with pytest.raises(GraphError):
        backward(run(g, w, x), np.ones((2, 4)))
    with pytest.raises(GraphError, match="labels"):
        loss_and_grads(g, w, x, np.array([0, 3]))
    with pytest.raises(GraphError, match="labels"):
        loss_and_grads(g, w, x, np.array([0]))
    with pytest.raises(ValueError):
        forward(g, w, x, dtype=np.float16)
