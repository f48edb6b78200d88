"""Counting rules on small hand-made graphs, checked against figures worked out by hand."""

import pytest

import aiperf_opcount as opcount
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph


def graph(*nodes):
    return Graph([{"id": i, "op": op, "inputs": list(ins), "attrs": attrs} for i, op, ins, attrs in nodes])


def conv_net(padding, strides=(1, 1), size=5, kernel=3):
    return graph(
        ("x", "input", [], {"shape": [size, size, 2]}),
        ("c1", "conv2d", ["x"], {"filters": 3, "kernel": [kernel, kernel], "strides": list(strides), "padding": padding}),
        ("c2", "conv2d", ["c1"], {"filters": 4, "kernel": [1, 1]}),
        ("g", "global_avg_pool", ["c2"], {}),
        ("d", "dense", ["g"], {"units": 2}),
        ("s", "softmax", ["d"], {}),
    )


def test_conv_dense_by_hand():
    c = opcount.count(conv_net([1, 1, 1, 1]))
    n = {x.id: x for x in c.nodes}
    # c1 reads the data: 5x5 out, 3x3x2 taps, 3 filters -> 1350 MACs; no input gradient.
    assert n["c1"].fp == 2 * 1350
    assert n["c1"].grad == 2 * 1350 and n["c1"].update == 2 * 54
    # c2: 25 positions x 3 x 4 = 300 MACs; weight and input gradients.
    assert n["c2"].fp == 600 and n["c2"].grad == 1200 and n["c2"].update == 24
    assert n["g"].fp == 24 * 4 + 4
    assert n["d"].fp == 16 and n["d"].grad == 32 and n["d"].update == 2 * 10
    assert n["s"].fp == 21 * 2


def test_valid_convention_skips_padded_taps():
    g = conv_net([1, 1, 1, 1])
    paper = {x.id: x for x in opcount.count(g, "paper").nodes}
    valid = {x.id: x for x in opcount.count(g, "valid").nodes}
    # Along one axis of size 5 with pad 1, k 3: taps 2+3+3+3+2 = 13 (paper: 15).
    assert valid["c1"].fp == 2 * 13 * 13 * 2 * 3
    assert paper["c1"].fp == 2 * 15 * 15 * 2 * 3
    assert valid["c2"].fp == paper["c2"].fp  # 1x1, no padding


def test_valid_equals_paper_without_padding():
    g = conv_net([0, 0, 0, 0], strides=(2, 2))
    assert opcount.count(g, "valid").total == opcount.count(g, "paper").total


def test_asymmetric_padding_valid_taps():
    g = conv_net([0, 1, 2, 0], strides=(2, 2), size=6, kernel=3)
    v = {x.id: x for x in opcount.count(g, "valid").nodes}
    # rows: size 6, pad (0,1), k 3, s 2 -> out 3; windows start 0,2,4 -> taps 3,3,2 = 8
    # cols: size 6, pad (2,0), k 3, s 2 -> out 3; windows start -2,0,2 -> taps 1,3,3 = 7
    assert v["c1"].fp == 2 * 8 * 7 * 2 * 3


def test_epoch_and_bad_convention():
    c = opcount.count(conv_net([1, 1, 1, 1]))
    e = c.epoch(10, 3)
    assert e.fp_train == 10 * c.fp and e.bp_train == 10 * c.bp and e.fp_val == 3 * c.fp
    assert e.total == 10 * c.total + 3 * c.fp
    with pytest.raises(AiperfError, match="convention"):
        opcount.count(conv_net([1, 1, 1, 1]), "xla")
    with pytest.raises(AiperfError, match="train_images"):
        c.epoch(-1, 0)


def test_add_with_three_inputs_and_bn():
    g = graph(
        ("x", "input", [], {"shape": [4, 4, 2]}),
        ("a", "relu", ["x"], {}),
        ("b", "batch_norm", ["x"], {}),
        ("s", "add", ["x", "a", "b"], {}),
        ("g", "global_avg_pool", ["s"], {}),
    )
    n = {x.id: x for x in opcount.count(g).nodes}
    assert n["s"].fp == 2 * 32
    assert n["b"].fp == 7 * 32 and n["b"].bp == 36
