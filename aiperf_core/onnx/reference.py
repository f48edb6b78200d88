"""The ONNX runtimes' side of a comparison: a model-zoo CNN given random weights (with_random_initializers)
and onnx.reference's evaluator with two of onnx 1.23's ops made to follow the specification
(reference_evaluator). The conformance kit's graph level and the tests compare backends with them."""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.onnx.protos import FLOAT_TYPES


def with_random_initializers(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """A copy of the model whose ConstantOfShape weights are random float32 initializers of the same shapes.

    The model-zoo CNNs in the onnx wheel (onnx/backend/test/data/light/light_*.onnx) build most weights
    with ConstantOfShape nodes that fill a shape with 0.02, so they compute nothing worth comparing. Here
    each such node whose shape is a constant becomes an initializer: He-normal (standard deviation
    sqrt(2 / fan-in), fan-in = the product of all dims but the first, as Conv's and Gemm's weights are
    laid out) for two or more dims, uniform in [0.5, 1.5] for one dim (positive, so also fine as a
    variance or a scale). The other initializers are kept; the shape tensors only those nodes read are
    dropped. The copy runs in onnx.reference.ReferenceEvaluator and onnxruntime as the original does,
    and import_onnx(copy) gives the same graph as the original with these weights, so a backend running
    that graph can be compared with the ONNX runtimes on the copy.
    """
    rng = np.random.default_rng(seed)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    consts = {t.name: t for t in g.initializer}
    replaced: list[TensorProto] = []
    shape_names: set[str] = set()
    kept: list[onnx.NodeProto] = []
    for node in g.node:
        shape_name = node.input[0] if node.op_type == "ConstantOfShape" and node.input else ""
        if shape_name not in consts:
            kept.append(node)
            continue
        value_attr = next((a for a in node.attribute if a.name == "value"), None)
        if value_attr is not None and value_attr.t.data_type not in FLOAT_TYPES:
            kept.append(node)  # integer or boolean fills are index tensors, not weights
            continue
        shape = tuple(int(d) for d in numpy_helper.to_array(consts[shape_name]).reshape(-1))
        if len(shape) >= 2:
            std = math.sqrt(2.0 / max(math.prod(shape[1:]), 1))
            value = rng.standard_normal(shape, dtype=np.float32)
            value *= np.float32(std)  # in place: vgg19's largest is 411 MB, and a fresh one costs its page faults
        else:
            value = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        replaced.append(numpy_helper.from_array(value, node.output[0]))
        shape_names.add(shape_name)
    orphans = shape_names - {name for node in kept for name in node.input} - {o.name for o in g.output}
    del g.node[:]
    g.node.extend(kept)
    initializers = [t for t in consts.values() if t.name not in orphans] + replaced
    del g.initializer[:]
    g.initializer.extend(initializers)
    inputs = [v for v in g.input if v.name not in orphans]
    if out.ir_version < 4:  # before IR 4 every initializer is also a graph input
        inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in replaced]
    del g.input[:]
    g.input.extend(inputs)
    return out


def reference_evaluator(model: onnx.ModelProto):
    """onnx.reference.ReferenceEvaluator for the model, with two ops of onnx 1.23's made to follow the
    ONNX specification, for inference (what import_onnx reads); every other op is ONNX's own.

    - LRN sums its window for the first N channels only, N being the batch (it loops over axis 0, not
      1: onnx/onnx#7805, fixed upstream by onnx/onnx#8331 after 1.23), so it is wrong whenever the
      batch differs from the channels: on AlexNet, ZFNet-512 and Inception v1 of the model zoo.
    - BatchNormalization of opsets 9 to 13 normalises a one-output (inference) node with its running
      statistics blended with the batch's (onnx/onnx#8442): on every model-zoo CNN with batch norm.
      Here a node with one output and no training_mode is inference, as the specification says; a
      training-mode node is refused.
    """
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    class LRN(OpRun):
        op_domain = ""

        def _run(self, x, alpha=None, beta=None, bias=None, size=None):
            # The window [c - floor((size-1)/2), c + ceil((size-1)/2)] over the channels (axis 1), clipped.
            before, after = (size - 1) // 2, -(-(size - 1) // 2)
            squares = np.square(x)
            square_sum = np.zeros_like(x)
            channels = x.shape[1]
            for c in range(channels):
                square_sum[:, c] = squares[:, max(0, c - before): min(channels, c + after + 1)].sum(axis=1)
            return ((x / (bias + (alpha / size) * square_sum) ** beta).astype(x.dtype),)

    class BatchNormalization(OpRun):
        op_domain = ""

        def _run(self, x, scale, bias, mean, var, epsilon=1e-5, training_mode=0, **_):
            if training_mode or len([name for name in self.onnx_node.output if name]) > 1:
                raise RuntimeError("this evaluator runs BatchNormalization in inference mode only")
            per_channel = (-1,) + (1,) * (x.ndim - 2)
            scale, bias, mean, var = (np.reshape(v, per_channel) for v in (scale, bias, mean, var))
            return ((scale * (x - mean) / np.sqrt(var + epsilon) + bias).astype(x.dtype),)

    return ReferenceEvaluator(model, new_ops=[LRN, BatchNormalization])
