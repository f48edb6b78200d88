import numpy as np
import pytest

from aiperf_core.builders import resnet_small
from aiperf_core.morph import cnn as morph
from aiperf_core.search.arch import ArchCode, _layer_cost, _skip_cost, distance_matrix, distances, encode


def naive_edit(a, b, cost):
    n, m = len(a), len(b)
    d = np.zeros((n + 1, m + 1))
    d[:, 0] = np.arange(n + 1)
    d[0, :] = np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            sub = cost(a[i - 1][None, :], b[j - 1][None, None, :])[0, 0]
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + sub)
    return d[n, m]


def random_code(rng):
    n, s = rng.integers(0, 9), rng.integers(0, 5)
    layers = np.stack([rng.integers(0, 2, n), rng.choice([8, 16, 32, 64], n), rng.choice([1, 3, 5, 7], n)], axis=1)
    skips = np.stack([rng.integers(1, 10, s), rng.integers(0, 5, s)], axis=1)
    return ArchCode(layers.astype(float).reshape(-1, 3), skips.astype(float).reshape(-1, 2))


def test_batched_distance_equals_the_plain_dynamic_programme():
    rng = np.random.default_rng(0)
    left = [random_code(rng) for _ in range(60)]
    right = [random_code(rng) for _ in range(60)]
    got = distances(left, right)
    for a, b, d in zip(left, right, got):
        want = naive_edit(a.layers, b.layers, _layer_cost) + naive_edit(a.skips, b.skips, _skip_cost)
        assert d == pytest.approx(want)


def test_distance_is_a_symmetric_dissimilarity():
    rng = np.random.default_rng(1)
    codes = [random_code(rng) for _ in range(12)]
    d = distance_matrix(codes)
    assert np.allclose(d, d.T) and np.all(np.diag(d) == 0) and np.all(d >= 0)
    assert np.allclose(distance_matrix(codes, codes), d)


def test_morphs_move_the_architecture_by_what_they_change():
    graph = resnet_small((32, 32, 3), 10)
    base = encode(graph)
    relu = next(n.id for n in graph.nodes if n.op == "relu")
    deeper = morph.deeper(graph, None, relu).graph
    # One inserted layer costs 1; the skips after it move by one rank, which costs a little more.
    assert 1.0 < distances([base], [encode(deeper)])[0] < 2.0
    grown = morph.kernel(deeper, None, morph.morph_convs(deeper)[0], 5).graph
    assert distances([encode(deeper)], [encode(grown)])[0] == pytest.approx(2 / 10)  # |3 - 5| / (2 * 5)
    skipped = morph.skip(graph, None, "pool1", "conv2_block1_1_relu").graph
    assert len(encode(skipped).skips) == len(base.skips) + 1
    assert encode(skipped).to_json() == ArchCode.from_json(encode(skipped).to_json()).to_json()


def test_transformer_codes_see_every_morph_and_rank_them_by_what_they_change():
    from aiperf_core.builders import gpt
    from aiperf_core.morph import transformer as T
    from aiperf_core.search.arch import ATTENTION, DENSE, MOE

    graph = gpt(layers=2, hidden=32, heads=2, seq_len=8, vocab=16)
    code = encode(graph)
    # Per block: q, k, v, attention, projection, fc1, fc2; then the LM head. Two residual adds a block.
    assert code.layers[:7, 0].tolist() == [DENSE] * 3 + [ATTENTION] + [DENSE] * 3
    assert code.layers[3].tolist() == [ATTENTION, 32, 2] and len(code.layers) == 15 and len(code.skips) == 4
    children = {op: T.random_morph(graph, None, np.random.default_rng(1), ops=(op,)).graph for op in T.OPERATORS}
    moved = {op: float(distance_matrix([code], [encode(child)])[0, 0]) for op, child in children.items()}
    assert all(value > 0 for value in moved.values()), moved
    assert MOE in encode(children["upcycle_moe"]).layers[:, 0]
    # A new block (7 layers, 2 skips) moves it most; one more head or wider MLP units, least.
    assert moved["deeper"] > moved["double_width"] > max(moved["more_heads"], moved["wider_mlp"]), moved
    assert moved["more_heads"] < 2 and moved["wider_mlp"] < 1, moved
