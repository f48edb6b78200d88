"""ONNX export and import: numerics against onnxruntime and a float64 NumPy forward, round trips,
the real CNNs shipped in the onnx wheel, hand-built models in exporter styles, and clear errors."""

from pathlib import Path

import numpy as np
import pytest

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from numpy.lib.stride_tricks import sliding_window_view  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from aiperf_core.builders import resnet50, resnet_small  # noqa: E402
from aiperf_core.errors import AiperfError, GraphError  # noqa: E402
from aiperf_core.ir import Graph, Node  # noqa: E402
from aiperf_core.onnx import export_onnx, import_onnx, with_random_initializers  # noqa: E402
from aiperf_core.weights import init_weights  # noqa: E402

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


# ---------------------------------------------------------------------------
# Helpers: a float64 reference forward of the IR, onnxruntime, test weights
# ---------------------------------------------------------------------------


def _windows(x, attrs, fill):
    t, b, l, r = attrs["padding"]
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["strides"]
    x = np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=fill)
    return sliding_window_view(x, (kh, kw), axis=(1, 2))[:, ::sh, ::sw]  # N, Ho, Wo, C, kh, kw


def reference_forward(graph, weights, x):
    """Float64 forward of an IR graph on a batch of NHWC images (or flat vectors)."""
    values = {}
    for node in graph.nodes:
        a = node.attrs
        w = {k: np.asarray(v, np.float64) for k, v in weights.get(node.id, {}).items()}
        xs = [values[i] for i in node.inputs]
        if node.op == "input":
            y = np.asarray(x, np.float64)
        elif node.op == "conv2d":
            y = np.einsum("nhwcij,ijco->nhwo", _windows(xs[0], a, 0.0), w["kernel"], optimize=True)
            y = y + w.get("bias", 0.0)
        elif node.op == "max_pool":
            y = _windows(xs[0], a, -np.inf).max(axis=(4, 5))
        elif node.op == "batch_norm":
            scale = w["gamma"] / np.sqrt(w["moving_variance"] + a["epsilon"])
            y = (xs[0] - w["moving_mean"]) * scale + w["beta"]
        elif node.op == "relu":
            y = np.maximum(xs[0], 0.0)
        elif node.op == "add":
            y = sum(xs)
        elif node.op == "concat":
            y = np.concatenate(xs, axis=-1)
        elif node.op == "global_avg_pool":
            y = xs[0].mean(axis=(1, 2))
        elif node.op == "flatten":
            y = xs[0].reshape(len(xs[0]), -1)
        elif node.op == "dense":
            y = xs[0] @ w["kernel"] + w.get("bias", 0.0)
        elif node.op == "softmax":
            e = np.exp(xs[0] - xs[0].max(axis=-1, keepdims=True))
            y = e / e.sum(axis=-1, keepdims=True)
        elif node.op == "dropout":
            y = xs[0]
        else:
            raise AssertionError(node.op)
        values[node.id] = y
    return values[graph.output_id]


def run_ort(model, x):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def to_nchw(x_nhwc):
    return np.ascontiguousarray(x_nhwc.transpose(0, 3, 1, 2), dtype=np.float32)


def assert_close(actual, expected, rtol=1e-4):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * np.abs(expected).max())


def random_weights(graph, seed=0):
    """He-normal kernels, random biases and non-trivial batch-norm statistics."""
    rng = np.random.default_rng(seed)
    weights = init_weights(graph, seed=seed)
    for params in weights.values():
        for name, value in params.items():
            shape = value.shape
            if name == "bias":
                value = rng.normal(0.0, 0.1, shape)
            elif name == "gamma":
                value = rng.uniform(0.3, 0.8, shape)
            elif name == "beta" or name == "moving_mean":
                value = rng.normal(0.0, 0.2, shape)
            elif name == "moving_variance":
                value = rng.uniform(0.5, 2.0, shape)
            params[name] = np.asarray(value, np.float32)
    return weights


def same_weights(a, b):
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(np.array_equal(a[k][p], b[k][p]) for p in a[k]) for k in a
    )


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("builder", [resnet_small, resnet50])
def test_export_matches_reference_and_round_trips(builder):
    graph = builder((64, 64, 3))
    weights = random_weights(graph)
    model = export_onnx(graph, weights)
    onnx.checker.check_model(model)
    assert model.graph.input[0].name == "input"
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["N", 3, 64, 64]

    x = np.random.default_rng(1).standard_normal((2, 64, 64, 3))
    expected = reference_forward(graph, weights, x)
    assert 1e-4 < expected.max() < 0.9  # the softmax is neither uniform nor saturated
    assert_close(run_ort(model, to_nchw(x)), expected)

    back, back_weights = import_onnx(model)
    assert back == graph
    assert same_weights(back_weights, weights)


def _all_ops_graph():
    """Every IR op, an input id other than "input", and a non-input node called "input"."""
    nodes = [
        Node("data", "input", (), {"shape": [9, 9, 3]}),
        Node("c1", "conv2d", ("data",), {"filters": 4, "kernel": [3, 3], "strides": [2, 2],
                                         "padding": [1, 0, 0, 1], "use_bias": True}),
        Node("input", "batch_norm", ("c1",), {"epsilon": 1e-3}),
        Node("r1", "relu", ("input",)),
        Node("c2", "conv2d", ("r1",), {"filters": 4, "kernel": [1, 1]}),
        Node("c3", "conv2d", ("r1",), {"filters": 4, "kernel": [3, 3], "padding": [1, 1, 1, 1]}),
        Node("sum3", "add", ("r1", "c2", "c3")),
        Node("cat", "concat", ("sum3", "c2")),
        Node("mp", "max_pool", ("cat",), {"kernel": [2, 2], "strides": [1, 2], "padding": [1, 0, 1, 0]}),
        Node("fl", "flatten", ("mp",)),
        Node("d1", "dense", ("fl",), {"units": 6}),
        Node("drop", "dropout", ("d1",), {"rate": 0.3}),
        Node("bn2", "batch_norm", ("drop",)),
        Node("d2", "dense", ("bn2",), {"units": 3, "use_bias": False}),
        Node("sm", "softmax", ("d2",)),
    ]
    return Graph(nodes, name="all_ops")


@pytest.mark.parametrize("opset", [11, 13, 17])
def test_export_every_op_and_file(tmp_path, opset):
    graph = _all_ops_graph()
    weights = random_weights(graph, seed=3)
    path = tmp_path / "m.onnx"
    model = export_onnx(graph, weights, path=path, opset=opset)
    assert path.read_bytes() == model.SerializeToString()
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    x = np.random.default_rng(2).standard_normal((3, 9, 9, 3))
    assert_close(run_ort(model, to_nchw(x)), reference_forward(graph, weights, x))
    back, back_weights = import_onnx(path)
    assert back == graph
    assert same_weights(back_weights, weights)
    assert import_onnx(path.read_bytes())[0] == graph


def test_export_without_weights_uses_init_weights():
    graph = resnet_small((32, 32, 3))
    model = export_onnx(graph)
    onnx.checker.check_model(model)
    assert model.SerializeToString() == export_onnx(graph, init_weights(graph, seed=0)).SerializeToString()
    assert run_ort(model, np.ones((1, 3, 32, 32), np.float32)).shape == (1, 10)


def test_export_rejects_bad_weights_and_opset():
    graph = resnet_small((32, 32, 3))
    weights = init_weights(graph)
    weights["conv1_conv"]["kernel"] = weights["conv1_conv"]["kernel"][:, :, :2]
    with pytest.raises(GraphError, match="conv1_conv"):
        export_onnx(graph, weights)
    with pytest.raises(AiperfError, match="opset"):
        export_onnx(graph, opset=7)


# ---------------------------------------------------------------------------
# Real models shipped in the onnx wheel (Caffe2 exports, opset 9; the "light"
# variants build their weights with ConstantOfShape nodes). Their import and
# count are in test_onnx_zoo.py; here, that import and export keep what they compute.
# ---------------------------------------------------------------------------


def _logits(model):
    """The model without its final Softmax, which random weights would saturate."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    last = out.graph.node[-1]
    if last.op_type == "Softmax":
        out.graph.output[0].name = last.input[0]
        del out.graph.node[-1]
    return out


# The cheap ones (no 100-million-weight classifier), covering every op the zoo needs: LRN and a padded
# AveragePool (inception_v1), Mul and Add of Unsqueeze'd constants and a 1x1 Conv after the global pool
# (densenet121), grouped and depthwise Conv and the channel shuffle (shufflenet).
@pytest.mark.parametrize("name", ["resnet50", "squeezenet", "inception_v1", "inception_v2", "densenet121",
                                  "shufflenet"])
def test_real_model_runs_the_same_after_import_and_export(name):
    original = _logits(with_random_initializers(onnx.load(str(LIGHT / f"light_{name}.onnx")), seed=4))
    onnx.checker.check_model(original)
    graph, weights = import_onnx(original)
    exported = export_onnx(graph, weights)
    x = np.random.default_rng(5).uniform(0, 1, (1, 3, 224, 224)).astype(np.float32)
    expected = run_ort(original, x).reshape(1, -1)
    assert np.isfinite(expected).all() and expected.std() > 1e-3 * np.abs(expected).max()
    assert_close(run_ort(exported, x).reshape(1, -1), expected, rtol=1e-4)


@pytest.mark.slow
def test_with_random_initializers_replaces_only_the_constant_of_shape_weights():
    model = onnx.load(str(LIGHT / "light_bvlc_alexnet.onnx"))
    filled = {n.output[0] for n in model.graph.node if n.op_type == "ConstantOfShape"}
    randomized = with_random_initializers(model, seed=1)
    onnx.checker.check_model(randomized)
    assert not any(n.op_type == "ConstantOfShape" for n in randomized.graph.node)
    values = {t.name: numpy_helper.to_array(t) for t in randomized.graph.initializer}
    assert filled <= set(values) and all(values[name].std() > 0 for name in filled)
    again = {t.name: numpy_helper.to_array(t) for t in with_random_initializers(model, seed=1).graph.initializer}
    other = {t.name: numpy_helper.to_array(t) for t in with_random_initializers(model, seed=2).graph.initializer}
    assert all(np.array_equal(values[name], again[name]) and not np.array_equal(values[name], other[name])
               for name in filled)
    graph, weights = import_onnx(randomized)
    assert graph == import_onnx(model)[0]
    conv = weights[graph.nodes[1].id]["kernel"]  # HWIO of the first Conv's OIHW initializer
    first_conv = next(n for n in randomized.graph.node if n.op_type == "Conv")
    assert np.array_equal(conv, values[first_conv.input[1]].transpose(2, 3, 1, 0))


# ---------------------------------------------------------------------------
# Hand-built models in the styles of real exporters
# ---------------------------------------------------------------------------


def _model(nodes, x_shape, output, out_shape, inits=None, opset=13):
    rng = np.random.default_rng(11)
    initializers = []
    for name, value in (inits or {}).items():
        if isinstance(value, tuple):  # a shape: random weights
            value = rng.standard_normal(value) * (np.sqrt(2.0 / np.prod(value[1:])) if len(value) > 1 else 0.3)
            value = value.astype(np.float32)
        initializers.append(numpy_helper.from_array(np.asarray(value), name))
    graph = helper.make_graph(
        nodes, "hand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, out_shape)],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def _const(name, value):
    return helper.make_node("Constant", [], [name], name=f"{name}_const", value=numpy_helper.from_array(value))


def opset9_with_constant_weights():
    rng = np.random.default_rng(7)
    f32 = np.float32
    nodes = [
        _const("w1", (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(f32)),
        _const("b1", rng.standard_normal(8).astype(f32)),
        _const("scale", rng.uniform(0.5, 1.5, 8).astype(f32)),
        _const("shift", rng.standard_normal(8).astype(f32)),
        _const("mean", rng.standard_normal(8).astype(f32)),
        _const("var", rng.uniform(0.5, 2.0, 8).astype(f32)),
        _const("fc_w_raw", (rng.standard_normal((5, 8)) * 0.5).astype(f32)),
        helper.make_node("Identity", ["fc_w_raw"], ["fc_w"], name="fc_w_identity"),
        _const("fc_b", rng.standard_normal(5).astype(f32)),
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["bn"], name="bn",
                         epsilon=1e-3, momentum=0.9),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc", transB=1),
        helper.make_node("Dropout", ["logits"], ["d"], name="drop", ratio=0.25),
        helper.make_node("Softmax", ["d"], ["prob"], name="softmax"),
    ]
    return _model(nodes, ["batch", 3, 12, 12], "prob", ["batch", 5], opset=9), (12, 12, 3)


def torch_style_spatial_flatten():
    """Conv, then a Flatten of the feature map: the dense rows must move from CHW to HWC order."""
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c"], name="/features/0/Conv", strides=[2, 2],
                         pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c"], ["r"], name="/features/1/Relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="/Flatten", axis=1),
        helper.make_node("Gemm", ["f", "fc1_w", "fc1_b"], ["h"], name="/classifier/Gemm", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="_classifier/Gemm"),  # same id once sanitised
        helper.make_node("Gemm", ["hr", "fc2_w"], ["y"], name="", alpha=0.5),
    ]
    inits = {"w1": (6, 3, 3, 3), "b1": (6,), "fc1_w": (7, 6 * 5 * 4), "fc1_b": (7,), "fc2_w": (7, 4)}
    return _model(nodes, ["N", 3, 9, 8], "y", ["N", 4], inits), (9, 8, 3)


def torch_style_view_with_shape_subgraph():
    """x.view(x.size(0), -1) as older torch exports write it, after a ceil-mode MaxPool."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], name="conv", pads=[0, 0, 0, 0]),
        helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1),
        helper.make_node("Shape", ["p"], ["s"], name="shape"),
        _const("zero", np.array(0, np.int64)),
        helper.make_node("Gather", ["s", "zero"], ["n"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["n"], ["n1"], name="unsqueeze", axes=[0]),
        _const("minus1", np.array([-1], np.int64)),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["p", "target"], ["f"], name="view"),
        helper.make_node("MatMul", ["f", "fc_w"], ["m"], name="matmul"),
        helper.make_node("Add", ["fc_b", "m"], ["y"], name="add_bias"),
    ]
    inits = {"w1": (4, 3, 3, 3), "fc_w": (4 * 4 * 4, 5), "fc_b": (5,)}
    return _model(nodes, ["N", 3, 10, 10], "y", ["N", 5], inits, opset=11), (10, 10, 3)


def tf2onnx_style_nhwc():
    """NHWC input transposed to NCHW, SAME padding, Pad before Conv and MaxPool, NHWC flatten."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], name="to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["xt", "w1", "b1"], ["c1"], name="conv1", strides=[2, 2], auto_pad="SAME_UPPER"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Pad", ["r1", "pads"], ["p1"], name="zero_pad1"),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2", kernel_shape=[3, 3]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Pad", ["r2", "pads"], ["p2"], name="zero_pad2"),
        helper.make_node("MaxPool", ["p2"], ["mp"], name="pool", kernel_shape=[3, 3], strides=[1, 1]),
        helper.make_node("Transpose", ["mp"], ["nhwc"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("Reshape", ["nhwc", "flat_shape"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "fc_w"], ["m"], name="dense/MatMul"),
        helper.make_node("Add", ["m", "fc_b"], ["logits"], name="dense/BiasAdd"),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1),
    ]
    inits = {
        "w1": (5, 3, 3, 3), "b1": (5,), "w2": (6, 5, 3, 3), "fc_w": (5 * 5 * 6, 4), "fc_b": (1, 4),
        "pads": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "flat_shape": np.array([-1, 150], np.int64),
    }
    return _model(nodes, ["unk__0", 10, 10, 3], "y", ["unk__0", 4], inits), (10, 10, 3)


def opset18_pooling_and_heads():
    """ReduceMean and Squeeze with axes inputs, global AveragePool, Sum, Concat, BN on a flat tensor."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["bn"], name="bn"),
        helper.make_node("Relu", ["bn"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["c2"], name="conv2"),
        helper.make_node("Sum", ["r", "c2", "c1"], ["s3"], name="sum"),
        helper.make_node("Concat", ["s3", "r"], ["cat"], name="cat", axis=-3),
        helper.make_node("ReduceMean", ["cat", "axes"], ["mean"], name="mean", keepdims=1),
        helper.make_node("Squeeze", ["mean", "axes"], ["sq"], name="squeeze"),
        helper.make_node("AveragePool", ["cat"], ["ap"], name="avgpool", kernel_shape=[6, 6]),
        helper.make_node("Flatten", ["ap"], ["apf"], name="flat"),
        helper.make_node("Add", ["sq", "apf"], ["both"], name="add"),
        helper.make_node("Gemm", ["both", "fc_w", "fc_b"], ["h"], name="fc", beta=2.0),
        helper.make_node("BatchNormalization", ["h", "s5", "b5", "m5", "v5"], ["hb"], name="bn_flat"),
        helper.make_node("Dropout", ["hb", "ratio"], ["y"], name="drop"),
    ]
    rng = np.random.default_rng(3)
    inits = {
        "w1": (4, 3, 3, 3), "w2": (4, 4, 1, 1), "fc_w": (8, 5), "fc_b": (1, 5),
        "axes": np.array([2, 3], np.int64), "ratio": np.array(0.2, np.float32),
        "s": rng.uniform(0.5, 1.5, 4).astype(np.float32), "b": (4,), "m": (4,),
        "v": rng.uniform(0.5, 1.5, 4).astype(np.float32),
        "s5": rng.uniform(0.5, 1.5, 5).astype(np.float32), "b5": (5,), "m5": (5,),
        "v5": rng.uniform(0.5, 1.5, 5).astype(np.float32),
    }
    return _model(nodes, [2, 3, 6, 6], "y", [2, 5], inits, opset=18), (6, 6, 3)


def same_lower_and_ceil_mode_edge():
    """SAME_LOWER with stride 2 on odd sizes, and a ceil-mode MaxPool whose last window would start in padding."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", auto_pad="SAME_LOWER", strides=[2, 2]),
        helper.make_node("MaxPool", ["c"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2],
                         pads=[1, 1, 1, 1], ceil_mode=1),
        # Not Flatten + Gemm: onnx shape inference ignores that rule and would expect 4x4.
        helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["y"], name="flat"),
    ]
    return _model(nodes, ["N", 3, 10, 9], "y", ["N", 4], {"w": (4, 3, 4, 4)}), (10, 9, 3)


def keras_global_pool_nhwc():
    """A Keras GlobalAveragePooling2D as tf2onnx writes it: ReduceMean over NHWC axes [1, 2]."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["t", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["c"], ["c_nhwc"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("ReduceMean", ["c_nhwc"], ["m"], name="gap", axes=[1, 2], keepdims=0),
        helper.make_node("Gemm", ["m", "fc_w"], ["y"], name="fc"),
    ]
    return _model(nodes, ["N", 7, 7, 3], "y", ["N", 2], {"w": (4, 3, 3, 3), "fc_w": (4, 2)}), (7, 7, 3)


HAND_BUILT = [
    opset9_with_constant_weights,
    torch_style_spatial_flatten,
    torch_style_view_with_shape_subgraph,
    tf2onnx_style_nhwc,
    opset18_pooling_and_heads,
    same_lower_and_ceil_mode_edge,
    keras_global_pool_nhwc,
]


@pytest.mark.parametrize("make", HAND_BUILT, ids=lambda f: f.__name__)
def test_hand_built_models_import_and_match_onnxruntime(make):
    model, image = make()
    graph, weights = import_onnx(model)
    assert graph.input_shape == image
    batch, *per_image = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    x = np.random.default_rng(6).standard_normal((batch or 3, *image)).astype(np.float32)
    nhwc_input = tuple(per_image) == image  # the tf2onnx-style model
    original = run_ort(model, x if nhwc_input else to_nchw(x)).reshape(len(x), -1)
    assert_close(reference_forward(graph, weights, x), original, rtol=1e-4)
    assert_close(run_ort(export_onnx(graph, weights), to_nchw(x)), original, rtol=1e-4)


def test_hand_built_details():
    graph, weights = import_onnx(opset9_with_constant_weights()[0])
    assert [n.op for n in graph.nodes] == [
        "input", "conv2d", "batch_norm", "relu", "max_pool", "global_avg_pool", "dense", "dropout", "softmax",
    ]
    assert graph["bn"].attrs == {"epsilon": 1e-3, "momentum": 0.9}
    assert graph["drop"].attrs == {"rate": 0.25}

    graph, weights = import_onnx(torch_style_spatial_flatten()[0])
    ids = [n.id for n in graph.nodes]
    assert ids == ["x", "_features_0_Conv", "_features_1_Relu", "_Flatten", "_classifier_Gemm",
                   "_classifier_Gemm_2", "y"]
    assert graph["y"].attrs == {"units": 4, "use_bias": False}

    graph, weights = import_onnx(torch_style_view_with_shape_subgraph()[0])
    assert graph.shapes["pool"] == (4, 4, 4)  # ceil mode: 8x8 -> 4x4 (floor would give 3x3)
    assert graph["matmul"].attrs["use_bias"] and "add_bias" not in graph

    graph, _ = import_onnx(tf2onnx_style_nhwc()[0])
    assert graph["conv1"].attrs["padding"] == (0, 1, 0, 1)
    assert graph["conv2"].attrs["padding"] == (1, 1, 1, 1)
    assert graph["pool"].attrs["padding"] == (1, 1, 1, 1)

    graph, _ = import_onnx(same_lower_and_ceil_mode_edge()[0])
    assert graph["conv"].attrs["padding"] == (1, 1, 2, 1)
    assert graph.shapes["pool"] == (3, 3, 4)  # not 4x4: the last window would start in the padding


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def _conv_then(node, opset=13, inits=None):
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), node]
    inits = {"w": (4, 3, 1, 1), **(inits or {})}
    return _model(nodes, ["N", 3, 8, 8], node.output[0], ["N", 4, 8, 8], inits, opset=opset)


@pytest.mark.parametrize(
    "node, inits, expected",
    [
        (helper.make_node("Sigmoid", ["c"], ["y"], name="gate7"), None,
         "ONNX node 'gate7' (op Sigmoid): unsupported op (an elementwise function the IR has no op for"),
        (helper.make_node("Sigmoid", ["c"], ["y"]), None,
         "ONNX node '#1' (op Sigmoid): unsupported op (an elementwise function the IR has no op for"),
        (helper.make_node("Tile", ["c", "reps"], ["y"], name="tile"), {"reps": np.array([1, 1, 2, 2], np.int64)},
         "ONNX node 'tile' (op Tile): unsupported op"),
        (helper.make_node("LRN", ["c"], ["y"], name="norm", size=4), None,
         "ONNX node 'norm' (op LRN): attribute 'size' must be odd"),
        (helper.make_node("Conv", ["c", "w2"], ["y"], name="gconv", group=3), {"w2": (6, 2, 1, 1)},
         "ONNX node 'gconv' (op Conv): weight reads 2 channels per group in 3 group(s), the input has 4"),
        (helper.make_node("AveragePool", ["c"], ["y"], name="avg", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1,
                          count_include_pad=1), None,
         "ONNX node 'avg' (op AveragePool): ceil_mode with count_include_pad is not supported"),
        (helper.make_node("Reshape", ["c", "shape"], ["y"], name="rs"), {"shape": np.array([0, 4, 64], np.int64)},
         "ONNX node 'rs' (op Reshape): only a reshape to [N, 256]"),
        (helper.make_node("Reshape", ["c", "shape"], ["y"], name="rs5"),
         {"shape": np.array([0, 2, 2, 4, 16], np.int64)},
         "ONNX node 'rs5' (op Reshape): only ShuffleNet's channel split [N, G, 4 / G, 8, 8]"),
        (helper.make_node("Add", ["c", "k"], ["y"], name="plus"), {"k": (4, 8, 8)},
         "ONNX node 'plus' (op Add): adds a constant of shape [4, 8, 8] on an NCHW feature map; only a per-channel"),
        (helper.make_node("Mul", ["k", "c"], ["y"], name="times"), {"k": (1, 1, 8)},
         "ONNX node 'times' (op Mul): multiplies by a constant of shape [1, 1, 8]"),
        (helper.make_node("Mul", ["c", "c"], ["y"], name="square"), None,
         "ONNX node 'square' (op Mul): unsupported op (an elementwise function the IR has no op for"),
        (helper.make_node("Softmax", ["c"], ["y"], name="sm"), None,
         "ONNX node 'sm' (op Softmax): expects a flat [N, F] tensor or a pooled"),
        (helper.make_node("Gelu", ["c"], ["y"], name="erf_gelu"), None,
         "ONNX node 'erf_gelu' (op Gelu): only the tanh GELU"),
    ],
)
def test_unsupported_nodes_name_op_and_node(node, inits, expected):
    opset = 20 if node.op_type == "Gelu" else 13
    with pytest.raises(GraphError) as info:
        import_onnx(_conv_then(node, opset=opset, inits=inits))
    assert expected in str(info.value) and "\n" not in str(info.value)


def _shuffle_then(tail, opset=13):
    """A Conv, the first Reshape of a 2-group channel shuffle, then `tail` nodes."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Reshape", ["c", "split_shape"], ["split"], name="split"),
        *tail,
    ]
    inits = {"w": (4, 3, 1, 1), "split_shape": np.array([0, 2, 2, 8, 8], np.int64),
             "shape": np.array([0, 4, 8, 8], np.int64), "flat": np.array([0, 256], np.int64)}
    return _model(nodes, ["N", 3, 8, 8], tail[-1].output[0], [], inits, opset=opset)


@pytest.mark.parametrize(
    "tail, expected",
    [
        ([helper.make_node("Relu", ["split"], ["y"], name="act")],
         "ONNX node 'act' (op Relu): reads half of a channel shuffle"),
        ([helper.make_node("Transpose", ["split"], ["t"], name="swap", perm=[0, 1, 2, 4, 3]),
          helper.make_node("Reshape", ["t", "shape"], ["y"], name="back")],
         "ONNX node 'swap' (op Transpose): only NCHW<->NHWC transposes and a channel shuffle's [0, 2, 1, 3, 4]"),
        ([helper.make_node("Transpose", ["split"], ["t"], name="swap", perm=[0, 2, 1, 3, 4]),
          helper.make_node("Relu", ["t"], ["y"], name="act")],
         "ONNX node 'act' (op Relu): reads half of a channel shuffle"),
        ([helper.make_node("Transpose", ["split"], ["t"], name="swap", perm=[0, 2, 1, 3, 4]),
          helper.make_node("Reshape", ["t", "flat"], ["y"], name="back")],
         "ONNX node 'back' (op Reshape): only a reshape back to [N, 4, 8, 8] ends a channel shuffle"),
        ([helper.make_node("Transpose", ["split"], ["y"], name="swap", perm=[0, 2, 1, 3, 4])],
         "ONNX output 'y' is half of a channel shuffle"),
    ],
)
def test_only_the_whole_channel_shuffle_pattern_is_read(tail, expected):
    model = _shuffle_then(tail)
    with pytest.raises(GraphError) as info:
        import_onnx(model)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_lstm_is_rejected_with_its_name():
    nodes = [
        helper.make_node("Flatten", ["x"], ["f"], name="flat"),
        helper.make_node("LSTM", ["f", "W", "R"], ["y"], name="rnn_1", hidden_size=2),
    ]
    model = _model(nodes, ["N", 3, 2, 2], "y", ["N", 1, 1, 2], {"W": (1, 8, 12), "R": (1, 8, 2)})
    with pytest.raises(GraphError, match=r"^ONNX node 'rnn_1' \(op LSTM\): unsupported op$"):
        import_onnx(model)


def test_bad_files(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x0fnot an onnx model at all\xff\xfe" * 50)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    text = tmp_path / "text.onnx"
    text.write_text("hello world\n")
    for path in (garbage, empty, text, tmp_path / "missing.onnx"):
        with pytest.raises(GraphError, match=str(path.name)):
            import_onnx(path)


def test_inputs_and_opsets_outside_the_supported_range_are_rejected():
    model = _conv_then(helper.make_node("Relu", ["c"], ["y"], name="r"))
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "H"
    with pytest.raises(GraphError, match=r"symbolic size in \[N, 3, H, 8\]"):
        import_onnx(model)

    model = _conv_then(helper.make_node("Relu", ["c"], ["y"], name="r"))
    model.graph.input.append(helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["N", 4, 8, 8]))
    model.graph.node[1].CopyFrom(helper.make_node("Add", ["c", "x2"], ["y"], name="plus"))
    with pytest.raises(GraphError, match="2 non-constant inputs"):
        import_onnx(model)

    model = _conv_then(helper.make_node("Relu", ["c"], ["y"], name="r"))
    model.opset_import[0].version = 8
    with pytest.raises(GraphError, match="opset 8"):
        import_onnx(model)


def test_each_onnx_op_has_one_handler_in_the_module_of_its_family():
    """The table in aiperf_core/onnx/ops/__init__.py says where a newcomer finds (and adds) an op's handler."""
    import re

    from aiperf_core.onnx import ops
    from aiperf_core.onnx.ops import HANDLERS

    listed = {}
    for module, op_types in re.findall(r"^    (\w+)\.py +(.+)$", ops.__doc__, re.M):
        for op_type in re.sub(r"\(.*\)", "", op_types).replace(",", " ").split():
            listed[op_type] = f"aiperf_core.onnx.ops.{module}"
    assert listed == {op_type: handler.__module__ for op_type, handler in HANDLERS.items()}
