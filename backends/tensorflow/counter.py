"""Native op counter: the TensorFlow v1 profiler (tf.compat.v1.profiler, float_operation) on a
frozen graph with fully static shapes, mapped to opcount's categories.

The model's forward (inference mode), or its forward plus the gradients of the mean loss with
respect to the trainable variables (training mode), is traced as a concrete function for a fixed
batch, its variables are frozen into constants (convert_variables_to_constants_v2), the graph is
pruned to what the outputs need (extract_sub_graph: e.g. the first convolution's input gradient,
which nothing reads, is dropped, as the analytic rule says) and profiled with the scope view (self flops per op, mapped to op types through the GraphDef).

The profiler's registered flop statistics (tensorflow/python/profiler/internal/flops_registry.py
and nn_ops.py) count 2 per multiply-accumulate:

* Conv2D: 2 * |output| * kh * kw * Cin, every output position times the full window, so padded
  taps count (the paper's convention);
* Conv2DBackpropInput / Conv2DBackpropFilter: 2 * |image| * kh * kw * Cout / (sh * sw), which is
  the same number as the forward's whenever the output has |image| / (sh * sw) positions (true for
  every 'same'-style padded convolution of the conformance graphs; a strided or unpadded conv whose
  output size is not the input size over the stride would differ);
* MatMul (dense forward, and both dense gradients, transpose flags honoured): 2 * m * k * n;
* DepthwiseConv2dNative (a depthwise conv2d): 2 * |output| * kh * kw. Its two gradients have no
  statistics in TensorFlow; this module registers the same rule for them (2 * |output gradient| *
  kh * kw each), which is what their kernels compute;
* BatchMatMulV2: 2 * |output| * k. The lowering uses it for attention's two products only (a dense
  layer over a sequence is reshaped to one 2-D MatMul), so the op type separates the categories:
  MatMul is 'dense', BatchMatMul* is 'attention'. The registered rule reads k from the first
  operand's last axis whatever its adjoint flag, which is right for attention's products and their
  gradients because the one operand ever adjointed first is the square (S, S) score matrix. The
  profiler counts every one of the S x S scores: the paper convention. Grouped-query attention's
  products broadcast each key-value head over its query heads (batch shapes (kv, group) against
  (kv, 1)): the output holds one (S, S) or (S, d) matrix per query head, so the count is multi-head
  attention's with `heads` query heads, opcount's rule; the gradients' sums over the broadcast
  axis are Sum ops, category 'other'.

Bias additions, normalisation, activations, pooling, softmax and the loss are counted by the
profiler with its own rules, which are not opcount's, so only 'conv', 'dense' and 'attention' are
covered. A grouped convolution is lowered as one Conv2D per group (lowering.py), each counted by the
rules above. The embedding's gather moves rows and computes nothing. Rotary positions, RMS norm,
silu and mul are elementwise and reductions ('other' here; opcount's embedding, norm, activation and
elementwise). A moe node's products are Einsums, which have no flop statistics in TensorFlow: the
category 'moe' is not covered.
Nothing assigns variables: batch-norm statistics are left as they were, and the weight update
(SGD) is not part of the counted graph.
"""

from __future__ import annotations

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense", "attention"),
    includes_update=False,
    notes=("tf.compat.v1.profiler float_operation on a frozen static-shape graph: 2 FLOPs per MAC of Conv2D, "
           "Conv2DBackpropInput/Filter, depthwise convolutions, MatMul (dense) and BatchMatMulV2 (attention's "
           "products, every score of the S x S matrix), padded taps included; other ops are not mapped; the "
           "backward count has no weight update"),
)

CATEGORIES = {
    "Conv2D": "conv", "Conv2DBackpropInput": "conv", "Conv2DBackpropFilter": "conv",
    "DepthwiseConv2dNative": "conv", "DepthwiseConv2dNativeBackpropInput": "conv",
    "DepthwiseConv2dNativeBackpropFilter": "conv",
    "MatMul": "dense", "BatchMatMul": "attention", "BatchMatMulV2": "attention", "BatchMatMulV3": "attention",
}

_registered = False


def _register_depthwise_gradients() -> None:
    """Flop statistics for the depthwise convolution's gradients, which TensorFlow registers for the
    forward only: every output gradient element meets kh * kw taps, 2 FLOPs each."""
    global _registered
    if _registered:
        return
    from tensorflow.python.framework import graph_util, ops

    def flops(graph, node, filter_shape):
        grad_shape = graph_util.tensor_shape_from_node_def_name(graph, node.input[2])
        grad_shape.assert_is_fully_defined()
        return ops.OpStats("flops", 2 * int(np.prod(grad_shape.as_list(), dtype=np.int64)) *
                           int(filter_shape[0]) * int(filter_shape[1]))

    def backprop_input(graph, node):  # inputs: input sizes, filter, output gradient
        return flops(graph, node, graph_util.tensor_shape_from_node_def_name(graph, node.input[1]))

    def backprop_filter(graph, node):  # inputs: input, filter sizes, output gradient; output: the filter's shape
        return flops(graph, node, graph_util.tensor_shape_from_node_def_name(graph, node.name))

    for op_type, rule in (("DepthwiseConv2dNativeBackpropInput", backprop_input),
                          ("DepthwiseConv2dNativeBackpropFilter", backprop_filter)):
        try:
            ops.RegisterStatistics(op_type, "flops")(rule)
        except KeyError:  # a TensorFlow that registers it itself
            pass
    _registered = True


def category_of(op_type: str) -> str:
    return CATEGORIES.get(op_type, "other")


def frozen_graph_def(concrete):
    """Variables frozen into constants, pruned to what the outputs need."""
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    frozen = convert_variables_to_constants_v2(concrete)
    graph_def = frozen.graph.as_graph_def()
    outputs = [t.name.split(":")[0] for t in frozen.outputs]
    return tf.compat.v1.graph_util.extract_sub_graph(graph_def, outputs)


def profile_op_types(graph_def) -> dict[str, int]:
    """Float ops per op type of a GraphDef, by the v1 profiler (self flops of each op type)."""
    import tensorflow as tf
    # The flop statistics of MatMul, Conv2DBackpropInput/Filter and more are registered by this
    # module, which TF does not import by itself (Conv2D's are in nn_ops).
    from tensorflow.python.profiler.internal import flops_registry  # noqa: F401

    _register_depthwise_gradients()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
        builder = tf.compat.v1.profiler.ProfileOptionBuilder
        options = builder(builder.float_operation()).with_empty_output().build()
        result = tf.compat.v1.profiler.profile(graph, cmd="scope", options=options)
    op_type = {node.name: node.op for node in graph_def.node}
    out: dict[str, int] = {}
    stack = list(result.children)
    while stack:  # the scope view: one node per op name (nested under name scopes); self flops
        node = stack.pop()
        stack.extend(node.children)
        kind = op_type.get(node.name)
        if kind is not None and node.float_ops:
            out[kind] = out.get(kind, 0) + int(node.float_ops)
    return out


class TFProfilerCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        import tensorflow as tf

        from aiperf_backends.tensorflow.training import summed_loss

        graph = model.graph
        spec = tf.TensorSpec([batch] + list(graph.input_shape), model.input_dtype)
        if backward:
            if len(graph.output_shape) not in (1, 2):
                raise ValueError("a backward count needs a class output per sample or per position")
            labels = tf.constant(np.random.default_rng(0).integers(0, graph.output_shape[-1], (batch,) +
                                                                   tuple(graph.output_shape[:-1])), tf.int64)

            def fn(x):
                with tf.GradientTape() as tape:
                    total, _, _ = summed_loss(model, x, labels, 0.0, True)
                    loss = total / (batch * model.labels_per_sample)
                grads = tape.gradient(loss, model.trainables)
                return [loss] + [tf.convert_to_tensor(g) for g in grads if g is not None]  # an embedding's: dense
        else:
            def fn(x):
                return model.call(x, False)[0]

        concrete = tf.function(fn).get_concrete_function(spec)
        by_type = profile_op_types(frozen_graph_def(concrete))
        out = {"conv": 0, "dense": 0, "attention": 0, "other": 0}
        for op_type, flops in by_type.items():
            out[category_of(op_type)] += flops
        return out
