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
elementwise). A moe node's ops are under the name scope MOE_SCOPE (their gradients under
gradient_tape/.../MOE_SCOPE/...): its matrix products, the router's and each expert's on the rows of the
tokens that chose it (MatMul, the rules above), and their gradients are booked under 'moe'; its gates,
activations and the scatter back are not mapped, as elsewhere. An expert's rows are known only when the
graph runs, so the profiler has no statistics for its products in the graph alone: a graph whose shapes
are not all static is run once (grappler off, software trace) on a sample input, and the profiler reads the
missing shapes from the run's step statistics (tfprof_logger._fill_missing_graph_shape). The experts'
rows sum to k per token whatever the routing, so the count does not depend on the sample.
Nothing assigns variables: batch-norm statistics are left as they were, and the weight update
(SGD) is not part of the counted graph.
"""

from __future__ import annotations

import numpy as np

from aiperf_core.backend import CounterConvention, NativeCounter

# The name scope of a moe node's ops (lowering.py), by which its products are booked under 'moe'.
MOE_SCOPE = "aiperf_moe"

CONVENTION = CounterConvention(
    mac_ops=2,
    padding="paper",
    covers=("conv", "dense", "attention", "moe"),
    includes_update=False,
    notes=("tf.compat.v1.profiler float_operation on a frozen static-shape graph: 2 FLOPs per MAC of Conv2D, "
           "Conv2DBackpropInput/Filter, depthwise convolutions, MatMul (dense) and BatchMatMulV2 (attention's "
           "products, every score of the S x S matrix), padded taps included; a moe's MatMuls (the router and "
           "each expert on its routed rows, shapes read from one traced run) as 'moe'; other ops are not mapped; "
           "the backward count has no weight update"),
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


def category_of(op_type: str, op_name: str = "") -> str:
    """The category of an op: a product under a moe node's name scope (in the forward, or its gradient
    under gradient_tape/...) is 'moe', the others by op type."""
    category = CATEGORIES.get(op_type, "other")
    if category != "other" and MOE_SCOPE in op_name.split("/"):
        return "moe"
    return category


def frozen_graph_def(concrete):
    """Variables frozen into constants, pruned to what the outputs need."""
    import tensorflow as tf
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    frozen = convert_variables_to_constants_v2(concrete)
    graph_def = frozen.graph.as_graph_def()
    outputs = [t.name.split(":")[0] for t in frozen.outputs]
    return tf.compat.v1.graph_util.extract_sub_graph(graph_def, outputs)


def _run_metadata(graph, feed: dict):
    """One traced run of every op of `graph` (fed `feed`), whose step statistics hold the shapes of its
    tensors. Grappler is off, so that every op runs under its own name (a fused op would hide its parts)."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    sinks = [op for op in graph.get_operations() if not any(t.consumers() for t in op.outputs)]
    run_meta = tf.compat.v1.RunMetadata()
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(sinks, feed,
                    options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.SOFTWARE_TRACE),
                    run_metadata=run_meta)
    return run_meta


def profile_ops(graph_def, sample=None) -> list[tuple[str, str, int]]:
    """(op name, op type, float ops) of each op of a GraphDef with any, by the v1 profiler (self flops).
    An op whose shapes are not static (a routed moe's products: rows per expert) has no statistics in
    the graph alone; given `sample` (the value of the graph's one placeholder) the graph is run once and
    the profiler reads those shapes from the run (tfprof_logger fills them from the step statistics)."""
    import tensorflow as tf
    # The flop statistics of MatMul, Conv2DBackpropInput/Filter and more are registered by this
    # module, which TF does not import by itself (Conv2D's are in nn_ops).
    from tensorflow.python.profiler.internal import flops_registry  # noqa: F401

    _register_depthwise_gradients()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.import_graph_def(graph_def, name="")
        static = all(t.shape.is_fully_defined() for op in graph.get_operations() for t in op.outputs)
        run_meta = None
        if not static and sample is not None:
            placeholder, = [op.outputs[0] for op in graph.get_operations() if op.type == "Placeholder"]
            run_meta = _run_metadata(graph, {placeholder: sample})
        builder = tf.compat.v1.profiler.ProfileOptionBuilder
        options = builder(builder.float_operation()).with_empty_output().build()
        result = tf.compat.v1.profiler.profile(graph, run_meta=run_meta, cmd="scope", options=options)
    op_type = {node.name: node.op for node in graph_def.node}
    out = []
    stack = list(result.children)
    while stack:  # the scope view: one node per op name (nested under name scopes); self flops
        node = stack.pop()
        stack.extend(node.children)
        kind = op_type.get(node.name)
        if kind is not None and node.float_ops:
            out.append((node.name, kind, int(node.float_ops)))
    return out


class TFProfilerCounter(NativeCounter):
    convention = CONVENTION

    def count(self, model, batch: int, backward: bool) -> dict[str, int]:
        import tensorflow as tf

        from aiperf_backends.tensorflow.backend import graph_function
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

        concrete = graph_function(fn).get_concrete_function(spec)
        # A sample for a graph whose shapes depend on the data (a routed moe): token 0 everywhere, or
        # normal features; every routing runs k experts per token, so the count does not depend on it.
        shape = [batch] + list(graph.input_shape)
        sample = (np.zeros(shape, np.int64) if graph.takes_tokens else
                  np.random.default_rng(0).standard_normal(shape).astype(np.float32))
        out = {"conv": 0, "dense": 0, "attention": 0, "moe": 0, "other": 0}
        for name, op_type, flops in profile_ops(frozen_graph_def(concrete), sample):
            out[category_of(op_type, name)] += flops
        return out
