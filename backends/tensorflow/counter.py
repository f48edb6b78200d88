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
* MatMul (dense forward, and both dense gradients, transpose flags honoured): 2 * m * k * n.

Bias additions, normalisation, activations, pooling, softmax and the loss are counted by the
profiler with its own rules, which are not opcount's, so only 'conv' and 'dense' are covered.
Nothing assigns variables: batch-norm statistics are left as they were, and the weight update
(SGD) is not part of the counted graph.
"""

from __future__ import annotations

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense"),
    includes_update=False,
    notes=("tf.compat.v1.profiler float_operation on a frozen static-shape graph: 2 FLOPs per MAC of Conv2D, "
           "Conv2DBackpropInput/Filter and MatMul, padded taps included; other ops are not mapped; the backward "
           "count has no weight update"),
)

CATEGORIES = {
    "Conv2D": "conv", "Conv2DBackpropInput": "conv", "Conv2DBackpropFilter": "conv",
    "MatMul": "dense", "BatchMatMul": "dense", "BatchMatMulV2": "dense", "BatchMatMulV3": "dense",
}


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
        spec = tf.TensorSpec([batch] + list(graph.input_shape), tf.float32)
        if backward:
            if len(graph.output_shape) != 1:
                raise ValueError("a backward count needs a flat class output")
            labels = tf.constant(np.random.default_rng(0).integers(0, graph.output_shape[0], batch), tf.int64)

            def fn(x):
                with tf.GradientTape() as tape:
                    total, _, _ = summed_loss(model, x, labels, 0.0, True)
                    loss = total / batch
                grads = tape.gradient(loss, model.trainables)
                return [loss] + [g for g in grads if g is not None]
        else:
            def fn(x):
                return model.call(x, False)[0]

        concrete = tf.function(fn).get_concrete_function(spec)
        by_type = profile_op_types(frozen_graph_def(concrete))
        out = {"conv": 0, "dense": 0, "other": 0}
        for op_type, flops in by_type.items():
            out[category_of(op_type)] += flops
        return out
