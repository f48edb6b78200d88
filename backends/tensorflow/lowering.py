"""Lowering the aiperf IR to a tf.Module that runs the graph node by node.

Layout: the IR's layouts are TensorFlow's own (NHWC activations, HWIO conv kernels, (in, out)
dense kernels), so weights cross the interface without any transpose and export returns exactly
(bit for bit) what was imported.

* conv2d: ``tf.nn.conv2d``. Padding is explicit per side [top, bottom, left, right]; when it equals
  what TF's 'SAME' would choose (or is zero: 'VALID') the string form is used, which takes the
  fastest kernels, else explicit padding ``[[0, 0], [t, b], [l, r], [0, 0]]``.
* max_pool: ``tf.pad`` with -inf, then ``tf.nn.max_pool2d`` with 'VALID' ('SAME' where it
  coincides, since TF's SAME max-pool also ignores the padded taps).
* flatten: a reshape, which is NHWC order already, so a following dense kernel keeps its
  canonical (H, W, C)-ordered rows.
* batch_norm: on one device, 4-D input and epsilon >= 1.001e-5, training uses TF's fused kernel
  (forward and backward in one op each, as Keras does); otherwise written out. Training
  normalises with the biased batch variance and returns, without assigning them, the
  moving-statistics updates ``momentum * old + (1 - momentum) * batch`` with the
  unbiased variance (Bessel factor count / (count - 1), taken as 1 when count == 1), as the NumPy
  reference does. Inside a tf.distribute replica context with more than one replica the batch
  statistics are those of the *global* batch: the per-replica sums (and counts) are all-reduced,
  two-pass (mean first, then the centred sum of squares), so data-parallel training is the same
  computation as single-device training on the combined batch (synchronised batch norm).
* dropout: inverted dropout. Masks come from tf.random in training, or, when the caller passes
  them (loss_and_grads), from the NumPy reference's generator, so gradients are comparable.

The model-zoo CNN ops:

* conv2d with groups: ``tf.nn.depthwise_conv2d`` when groups == channels and the two strides are
  equal (the IR's output channel g * m + j reads input channel g, depthwise_conv2d's order, so the
  HWIO kernel (kh, kw, 1, C * m) is reshaped to (kh, kw, C, m)); otherwise the groups are split along
  the channels, convolved with their blocks of filters and concatenated. ``tf.nn.conv2d`` with a
  kernel of C/groups input channels runs forward on a CPU, but TensorFlow 2.21 has no CPU kernel for
  its gradients ("Gradients for grouped convolutions are not supported on CPU"), and one way on every
  device is what is tested; the depthwise gradients refuse unequal strides ("Current implementation
  only supports equal length strides").
* lrn: ``tf.nn.local_response_normalization`` with depth_radius (size - 1) / 2 and alpha / size (TF
  sums the squares over the window without dividing by its size), in float32.
* avg_pool: zero padding (``tf.pad``), then ``tf.nn.avg_pool2d`` 'VALID', which divides every window
  by kh * kw (count_padding); without count_padding the result is rescaled per output position by
  kh * kw / (the window's real taps), a constant of the shapes.
* mul_const / add_const: ``value`` is a non-trainable variable (exported and imported like batch
  norm's moving statistics), broadcast over the channels.
* channel_shuffle: ShuffleNet's reshape (G, C/G), transpose, reshape.

The sequence ops (a ``token_input`` graph takes int64 token ids (N, S); uint8 normalisation is only
for images):

* embedding: ``tf.gather`` of the table's rows (its gradient, an IndexedSlices, is densified where
  the step reads it); position_embedding: the (S, D) table added to every sequence.
* dense over (N, S, D): reshaped to (N * S, D) for one ``tf.matmul`` (a MatMul, as for a flat input;
  the native counter tells it from attention's batched products by op type).
* layer_norm: written out in float32 over the last axis (biased variance), returning its input's
  dtype.
* attention: TensorFlow has no fused causal attention for this layout, so it is written out: the
  heads split by reshape (N, S, A, d) and transpose to (N, A, S, d), the scores ``tf.matmul(q, k,
  transpose_b=True)`` (a BatchMatMulV2), scaled by 1/sqrt(d) and masked (pairs j > i set to -inf, so
  their probability is exactly 0) and soft-maxed in float32, then ``tf.matmul(p, v)`` and the heads
  joined again. Under jit_compile (on GPUs by default) XLA fuses the scale, the mask and the softmax.
  Grouped-query attention (kv_heads < heads) is the same two products with the query split as
  (N, kv_heads, heads / kv_heads, S, d) and the key and value as (N, kv_heads, 1, S, d): BatchMatMulV2
  broadcasts the group axis of 1, so each key-value head serves its query heads without being copied,
  and the product's arithmetic is exactly multi-head attention's with the key-value heads repeated
  (multi-head attention is the case of groups of 1). Its gradients sum over the broadcast axis.
* gelu: ``tf.nn.gelu(approximate=True)`` (the IR's tanh form); softmax over the last axis of (S, classes).
* rms_norm: written out in float32 over the last axis, ``x * rsqrt(mean(x^2) + epsilon) * gamma``,
  returning its input's dtype (as layer_norm).
* rotary: the cos and sin tables, (S, 1, head_dim / 2), are computed once per lowering in float64
  (``rotary_tables``) and embedded as float32 constants; the input is viewed as (N, S, heads, 2,
  head_dim / 2), so that the two halves of every head are its [..., 0, :] and [..., 1, :], and
  rotated in float32 (x1 cos - x2 sin, x2 cos + x1 sin), returning its input's dtype.
* silu: ``tf.nn.silu``; mul: the elementwise product (float32 where the two dtypes differ, as add).
* moe, routed: the router's product and tf.math.top_k (the lower index first among equals, as the IR)
  give each token's k experts and its gates (the softmax of the k logits, float32). The T * k
  (token, expert) assignments are sorted by expert (stable tf.argsort), the chosen tokens' rows gathered
  in that order (one tf.gather) and split into one contiguous segment per expert, its size from
  tf.math.bincount: the sizes are tensors of the graph, so no host read per expert. Each expert's products
  (tf.matmul, dynamic rows) run on its segment only; the outputs, weighted by their gates in float32, are
  summed back per token by tf.math.unsorted_segment_sum. The expert parameters are unstacked once, so
  each one's gradient is one stack of the experts' gradients. SwiGLU experts (mlp: swiglu) compute
  ``silu(x w_gate) * (x w_in)`` and then ``w_out``, without biases. Under XLA (jit_compile: only where
  AIPERF_TF_XLA=1 asks for it, as use_xla leaves a moe graph uncompiled), which needs static shapes (tf.split's sizes must be compile-time constants), every expert runs
  on every token in einsums and a gate of 0 drops what a token did not choose: the same function at E/k
  times the expert work (``_every_expert``). The node's ops are under the name scope MOE_SCOPE, by which
  the native counter books them.
* moe's load balance (training only, when the caller passes ``balance``, a dict the pass fills): per moe
  node, the sum over the batch's sequences of ``E sum_e f_e P_e`` (TrainConfig.moe_aux_loss: P_e the mean
  over the sequence's tokens of the router's softmax over all E experts, differentiable; f_e the share of
  the sequence's S k assignments that expert e received, under tf.stop_gradient) and the assignments each
  expert received (float32, exact to 2^24 a batch), from the logits and choices the routing ran, routed or
  under XLA alike. Outside MOE_SCOPE: the counter books the model's products, not the loss's.

Activation checkpointing (``call(..., checkpoint=True)``, training only): each of the graph's blocks
(Graph.blocks: two residual sub-layers of a transformer) runs as one function under
``tf.recompute_grad``, whose custom gradient keeps only the block's input and runs the block's forward
again in the backward pass (the variables it reads are found by the custom gradient's variable
watcher and get their gradients from the recomputation). A dropout inside a block draws its mask
from a stateless seed drawn outside it, so that the recomputation draws the same mask.

Input: a float32 batch is taken as it is (in-memory arrays, already normalised); a uint8 batch is
pixels (streamed and synthetic data) and is normalised first, on the model's device inside the
traced step, with exactly the host's arithmetic `(float32(x) - MEAN) * INV_STD`
(aiperf_core.data.preprocess), so that a quarter of the bytes crosses to the device. A token graph's
ids (int64; int32 is widened) go to the embedding as they are.

Precision (`precision_scope`): fp32 is IEEE fp32. TensorFlow's only switch for TF32 is
process-global (`tf.config.experimental.enable_tensor_float_32_execution`, on by default: cuDNN
and cuBLAS then run fp32 convolutions and matrix products on TF32 units of CUDA 8.0+ GPUs), so
every call that traces or runs the model (train and eval steps, predict, loss_and_grads) holds
`precision_scope`, which sets the switch for the call (on for tf32, off otherwise) and restores
the caller's value after. The scope wraps tracing and compiling as well as running: non-XLA
kernels read the switch when they run, XLA when it compiles. A lock serialises the scopes of
threads that use the backend at the same time (aiperf trains on one thread).
Mixed precision (bf16/fp16) is manual: variables stay float32; conv, dense and attention's two
products cast their inputs and kernel to the compute dtype; batch norm, layer norm, lrn and the
pooling sums compute in float32 and return their input's dtype; attention's softmax, the logits /
softmax and the loss are float32. The embedding's rows and a sequence's residual stream stay
float32 (an add of a float32 and a compute-dtype value is float32). tf32 computes in float32 (the TF32
units do the rest).

XLA (`use_xla`): AIPERF_TF_XLA=1 compiles the single-device train and eval steps and predict with
jit_compile, =0 never; unset, they are compiled on GPUs and not on CPUs, nor for a graph with a moe
node (docs/backends/tensorflow.md has the measurements and the reasons).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Mapping

import numpy as np

from aiperf_core.data.preprocess import INV_STD, MEAN
from aiperf_core.errors import GraphError
from aiperf_core.ir import Graph, Node, is_trainable, kv_heads, moe_mlp
from aiperf_core.weights import Weights, validate_weights
from aiperf_backends.tensorflow.backend import framework, graph_function, xla_setting
from aiperf_backends.tensorflow.counter import MOE_SCOPE

tf = framework()  # configured before any use (backend.py): oneDNN, threads, AIPERF_CPU_DEVICES
from tensorflow.python.ops import control_flow_util  # noqa: E402 (after framework(): whether a trace is XLA's)

# tf.nn.fused_batch_norm raises a smaller epsilon to this silently; such nodes take the written-out path.
FUSED_MIN_EPSILON = 1.001e-5

COMPUTE_DTYPES = {"fp32": tf.float32, "tf32": tf.float32, "bf16": tf.bfloat16, "fp16": tf.float16}


def use_xla(device: str, graph: Graph | None = None) -> bool:
    """Whether the single-device steps and predict on `device` (a backend device name) compile with
    XLA: AIPERF_TF_XLA when set, else on GPUs only, and not for a graph with a moe node: XLA needs
    static shapes, under which a moe runs every expert on every token (E/k times the counted work),
    where the graph without XLA routes."""
    setting = xla_setting()
    if setting is not None:
        return setting
    return device.startswith("gpu") and not (graph is not None and any(n.op == "moe" for n in graph.nodes))


_tf32_lock = threading.RLock()


@contextmanager
def precision_scope(precision: str):
    """TF32 execution on for tf32 and off for every other precision while the block runs; the
    caller's setting is restored after (see the module's docstring)."""
    want = precision == "tf32"
    with _tf32_lock:
        before = tf.config.experimental.tensor_float_32_execution_enabled()
        if before != want:
            tf.config.experimental.enable_tensor_float_32_execution(want)
        try:
            yield
        finally:
            if before != want:
                tf.config.experimental.enable_tensor_float_32_execution(before)


def device_input(x):
    """What the graph's input node receives: uint8 pixels normalised `(float32(x) - MEAN) * INV_STD`
    per channel (the host pipeline's arithmetic, aiperf_core.data.preprocess), float32 as it is."""
    if x.dtype == tf.uint8:
        return (tf.cast(x, tf.float32) - tf.constant(MEAN, tf.float32)) * tf.constant(INV_STD, tf.float32)
    return x


def _same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    out = -(-size // stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return total // 2, total - total // 2


def tf_padding(in_shape, attrs) -> Any:
    """'VALID', 'SAME' or the explicit NHWC padding list for a windowed op."""
    pt, pb, pl, pr = attrs["padding"]
    if not (pt or pb or pl or pr):
        return "VALID"
    (kh, kw), (sh, sw) = attrs["kernel"], attrs["strides"]
    if (_same_padding(in_shape[0], kh, sh) == (pt, pb)) and (_same_padding(in_shape[1], kw, sw) == (pl, pr)):
        return "SAME"
    return [[0, 0], [pt, pb], [pl, pr], [0, 0]]


def make_variable(value, name: str, trainable: bool) -> tf.Variable:
    """A float32 variable. Under MirroredStrategy every replica computes the same update (gradients
    are all-reduced, batch norm is synchronised), so a replica-context assign takes the first
    replica's value (ONLY_FIRST_REPLICA) and the copies stay identical."""
    return tf.Variable(value, trainable=trainable, name=name, dtype=tf.float32,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class LoweredModel(tf.Module):
    """An IR graph as a tf.Module.

    ``call(x, training, logits=False, masks=None, ...)`` returns ``(output, updates)``: the graph's
    output (or the softmax's input with logits=True, when the output node is a softmax) and the
    list of (moving variable, new value) pairs of a training pass (empty in inference).
    ``predict_fn()`` is a tf.function of the inference forward at the model's precision, with a None
    batch dimension. ``device`` is the backend device name its variables live on.
    """

    def __init__(self, graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str = "fp32",
                 device: str = "cpu"):
        super().__init__(name="aiperf_lowered")
        validate_weights(graph, weights)
        self.graph = graph
        self.device = device
        self.precision = precision
        self.compute_dtype = COMPUTE_DTYPES[precision]
        self.params: dict[str, dict[str, tf.Variable]] = {}
        for node_id, shapes in graph.all_param_shapes().items():
            self.params[node_id] = {}
            for pname in shapes:
                value = np.asarray(weights[node_id][pname], np.float32)
                vname = f"{node_id}/{pname}".replace(":", "_")
                self.params[node_id][pname] = make_variable(value, vname, trainable=is_trainable(pname))
        self.trainables = [v for ps in self.params.values() for k, v in ps.items() if is_trainable(k)]
        self.trainable_keys = [(n, k) for n, ps in self.params.items() for k in ps if is_trainable(k)]
        out_node = graph[graph.output_id]
        self.logits_id = out_node.inputs[0] if out_node.op == "softmax" else None
        self.dropout_ids = [n.id for n in graph.nodes if n.op == "dropout"]
        self._last_reader = {}
        for i, node in enumerate(graph.nodes):
            for src in node.inputs:
                self._last_reader[src] = i
        self._order = {node.id: i for i, node in enumerate(graph.nodes)}
        # Activation checkpointing's blocks by their first node.
        self.blocks = {block.nodes[0]: block for block in graph.blocks()}
        # Moving statistics (batch norm's), which a training pass updates.
        self.moving_variables = [v for ps in self.params.values() for k, v in ps.items() if k.startswith("moving_")]
        self._predict_fns: dict[str, Any] = {}
        # Each rotary node's (cos, sin) tables, (S, 1, head_dim / 2) float32, made once here in float64.
        self.rotary_tables = {node.id: rotary_tables(graph.shapes[node.id][0], node.attrs["head_dim"],
                                                     node.attrs["base"])
                              for node in graph.nodes if node.op == "rotary"}
        # Labels per sample: one for an image, one per position of a sequence output (N, S, classes).
        self.labels_per_sample = int(np.prod(graph.output_shape[:-1], dtype=np.int64))
        self.input_dtype = tf.int64 if graph.takes_tokens else tf.float32

    def set_precision(self, precision: str) -> None:
        """Compute in `precision` in functions traced from now on (variables stay float32)."""
        self.precision = precision
        self.compute_dtype = COMPUTE_DTYPES[precision]

    def predict_fn(self):
        """The inference forward at the current precision, traced once per precision (call it
        inside precision_scope and the model's device)."""
        if self.precision not in self._predict_fns:
            spec = tf.TensorSpec([None] + list(self.graph.input_shape), self.input_dtype)
            self._predict_fns[self.precision] = graph_function(lambda x: self.call(x, False)[0], input_signature=[spec],
                                                               jit_compile=use_xla(self.device, self.graph))
        return self._predict_fns[self.precision]

    @property
    def has_logits(self) -> bool:
        return self.logits_id is not None

    # -- forward ------------------------------------------------------------
    def call(self, x, training: bool, logits: bool = False, masks: Mapping[str, Any] | None = None,
             checkpoint: bool = False, moving: Mapping[Any, Any] | None = None, synchronise: bool = True,
             balance: dict | None = None):
        """(output, moving-statistics updates) of a forward pass (see the class's docstring).

        checkpoint (training only): each of the graph's blocks (Graph.blocks) runs under
        tf.recompute_grad, so the backward pass keeps only the block's input and recomputes the
        rest. moving: the moving statistics a training pass starts from, by variable ref(), instead
        of the variables' values (gradient accumulation chains its micro-batches' updates).
        synchronise=False: batch statistics of this replica's batch alone, even under several
        replicas (a micro-batch's, which the peers' micro-batches need not line up with).
        balance (training only): filled with each moe node's (summed load-balancing loss, assignments per
        expert) by node id (``load_balance``)."""
        g = self.graph
        stop = self.logits_id if logits and self.logits_id is not None else g.output_id
        run = _Pass(training, masks, moving, synchronise, balance=balance if training else None)
        values: dict[str, Any] = {}
        blocks = self.blocks if checkpoint and training else {}
        skip_to = -1  # index of the last node computed by the checkpointed block just run
        for i, node in enumerate(g.nodes):
            if i <= skip_to:
                continue
            if node.op == "token_input":
                values[node.id] = x if x.dtype == tf.int64 else tf.cast(x, tf.int64)
                continue
            if node.op == "input":
                x = device_input(x)
                values[node.id] = tf.cast(x, self.compute_dtype) if self.compute_dtype != tf.float32 and \
                    len(g.input_shape) == 3 else x
                continue
            block = blocks.get(node.id)
            if block is not None and stop not in block.nodes:
                skip_to = self._order[block.output]
                readers = [self._order[n] for n in block.nodes]
                values.update(self._checkpointed(block, values[block.input], run))
            else:
                skip_to, readers = i, [i]
                values[node.id] = self._op(node, [values[s] for s in node.inputs], run)
            if node.id == stop:
                break
            for k in readers:  # free values after their last reader (eager mode)
                for s in g.nodes[k].inputs:
                    if self._last_reader.get(s) == k and s != stop:
                        values.pop(s, None)
        out = values[stop]
        if out.dtype != tf.float32:
            out = tf.cast(out, tf.float32)
        return out, run.updates

    def _checkpointed(self, block, x, run: "_Pass") -> dict[str, Any]:
        """The values of `block` that nodes after it read, computed under tf.recompute_grad. Its
        dropout masks come from seeds drawn here, outside it, so that the recomputation draws the
        same ones; its moving-statistics updates are the forward pass's (the recomputation's are
        the same values and are dropped). A moe's load balance leaves the block as outputs of its own, so
        that the aux loss's gradient flows through the recomputation."""
        g = self.graph
        last = self._order[block.output]
        exported = [n for n in block.nodes if n == block.output or self._last_reader.get(n, -1) > last]
        seeds = {n: tf.random.uniform([2], 0, 2 ** 31 - 1, tf.int32) for n in block.nodes
                 if g[n].op == "dropout" and g[n].attrs["rate"] > 0 and (run.masks is None or n not in run.masks)}
        balanced = [n for n in block.nodes if g[n].op == "moe"] if run.balance is not None else []
        forward_updates: list = []

        def forward(h):
            inner = _Pass(run.training, run.masks, run.moving, run.synchronise, seeds,
                          balance={} if balanced else None)
            vals = {block.input: h}
            for nid in block.nodes:
                node = g[nid]
                vals[nid] = self._op(node, [vals[s] for s in node.inputs], inner)
            if not forward_updates:
                forward_updates.append(inner.updates)
            outs = [vals[n] for n in exported] + [t for n in balanced for t in inner.balance[n]]
            return outs[0] if len(outs) == 1 else outs

        outs = tf.recompute_grad(forward)(x)
        outs = [outs] if len(exported) + 2 * len(balanced) == 1 else list(outs)
        run.updates.extend(forward_updates[0])
        for k, nid in enumerate(balanced):
            run.balance[nid] = tuple(outs[len(exported) + 2 * k:len(exported) + 2 * k + 2])
        return dict(zip(exported, outs))

    def _op(self, node: Node, ins, run: "_Pass"):
        a, op, cd = node.attrs, node.op, self.compute_dtype
        if op == "conv2d":
            return self._conv2d(node, ins[0])
        if op == "dense":
            p = self.params[node.id]
            kernel = p["kernel"] if cd == tf.float32 else tf.cast(p["kernel"], cd)
            x = tf.cast(ins[0], cd)
            if len(x.shape) == 2:
                y = tf.matmul(x, kernel)
            else:  # every position of (N, S, D) in one 2-D product
                rows = tf.reshape(x, [-1, x.shape[-1]])
                y = tf.reshape(tf.matmul(rows, kernel), _batch_shape(x, self.graph.shapes[node.id]))
            if a["use_bias"]:
                y = tf.nn.bias_add(y, tf.cast(p["bias"], cd))
            return y
        if op == "batch_norm":
            return self._batch_norm(node, ins[0], run)
        if op == "relu":
            return tf.nn.relu(ins[0])
        if op == "add":
            xs = _same_dtype(ins)
            return xs[0] + xs[1] if len(xs) == 2 else tf.add_n(xs)
        if op == "concat":
            return tf.concat(_same_dtype(ins), axis=-1)
        if op == "max_pool":
            x = ins[0]
            in_shape = self.graph.shapes[node.inputs[0]]
            pad = tf_padding(in_shape, a)
            if isinstance(pad, list):
                x = tf.pad(x, pad, constant_values=-np.inf)
                pad = "VALID"
            return tf.nn.max_pool2d(x, list(a["kernel"]), list(a["strides"]), pad)
        if op == "global_avg_pool":  # a float32 sum: bf16 would round away the small terms of a large map
            return tf.cast(tf.reduce_mean(tf.cast(ins[0], tf.float32), axis=[1, 2]), ins[0].dtype)
        if op == "flatten":
            x = ins[0]
            n = x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]  # static when known (counter)
            return tf.reshape(x, [n, -1])
        if op == "softmax":
            return tf.nn.softmax(tf.cast(ins[0], tf.float32), axis=-1)
        if op == "dropout":
            x, rate = ins[0], a["rate"]
            if not run.training or rate == 0:
                return x
            if run.masks is not None and node.id in run.masks:
                return x * tf.cast(run.masks[node.id], x.dtype)
            if node.id in run.seeds:  # inside a checkpointed block: the same mask when recomputed
                keep = tf.random.stateless_uniform(tf.shape(x), run.seeds[node.id]) >= rate
            else:
                keep = tf.random.uniform(tf.shape(x)) >= rate
            return x * tf.cast(keep, x.dtype) * tf.cast(1.0 / (1.0 - rate), x.dtype)
        if op == "lrn":
            x = ins[0]
            y = tf.nn.local_response_normalization(tf.cast(x, tf.float32), depth_radius=(a["size"] - 1) // 2,
                                                   bias=a["bias"], alpha=a["alpha"] / a["size"], beta=a["beta"])
            return tf.cast(y, x.dtype)
        if op == "avg_pool":
            return self._avg_pool(node, ins[0])
        if op == "mul_const":
            return ins[0] * tf.cast(self.params[node.id]["value"], ins[0].dtype)
        if op == "add_const":
            return ins[0] + tf.cast(self.params[node.id]["value"], ins[0].dtype)
        if op == "channel_shuffle":
            x, groups = ins[0], a["groups"]
            h, w, c = self.graph.shapes[node.id]
            n = _batch_size(x)
            grouped = tf.reshape(x, [n, h, w, groups, c // groups])
            return tf.reshape(tf.transpose(grouped, [0, 1, 2, 4, 3]), [n, h, w, c])
        if op == "embedding":
            return tf.gather(self.params[node.id]["table"], ins[0])
        if op == "position_embedding":
            return ins[0] + tf.cast(self.params[node.id]["table"], ins[0].dtype)
        if op == "layer_norm":
            p, x = self.params[node.id], ins[0]
            x32 = tf.cast(x, tf.float32)
            centred = x32 - tf.reduce_mean(x32, axis=-1, keepdims=True)
            var = tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True)  # biased
            y = centred * tf.math.rsqrt(var + a["epsilon"]) * p["gamma"] + p["beta"]
            return tf.cast(y, x.dtype)
        if op == "attention":
            return self._attention(node, ins)
        if op == "gelu":
            return tf.nn.gelu(ins[0], approximate=True)
        if op == "rms_norm":
            x = ins[0]
            x32 = tf.cast(x, tf.float32)
            mean_square = tf.reduce_mean(tf.square(x32), axis=-1, keepdims=True)
            return tf.cast(x32 * tf.math.rsqrt(mean_square + a["epsilon"]) * self.params[node.id]["gamma"], x.dtype)
        if op == "rotary":
            return self._rotary(node, ins[0])
        if op == "silu":
            return tf.nn.silu(ins[0])
        if op == "mul":
            xs = _same_dtype(ins)
            return xs[0] * xs[1]
        if op == "moe":
            return self._mixture_of_experts(node, ins[0], run.balance)
        raise GraphError(f"op '{op}' is not supported by the tensorflow backend", node.id)

    def _mixture_of_experts(self, node: Node, x, balance: dict | None = None):
        """The IR's moe on (N, S, D), routed (the module's docstring): each expert's products run on the
        rows of the tokens that chose it. Under XLA (jit_compile), which needs static shapes, every expert
        runs on every token instead (``_every_expert``). tf.math.top_k puts the lower index first among
        equals, as the IR does. The node's ops are under the name scope MOE_SCOPE, by which the native
        counter books them. `balance`: filled with the node's load_balance of this routing."""
        with tf.name_scope(MOE_SCOPE):
            if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
                y, logits, chosen = self._every_expert(node, x)
            else:
                y, logits, chosen = self._routed_experts(node, x)
        if balance is not None:
            balance[node.id] = load_balance(logits, chosen, node.attrs["experts"], self.graph.shapes[node.id][0])
        return y

    def _routing(self, node: Node, tokens):
        """The router's float32 logits (T, E) of the rows of `tokens` (T, D), each row's top_k experts and
        their gates, float32 (T, k)."""
        logits = tf.cast(tf.matmul(tokens, tf.cast(self.params[node.id]["router"], tokens.dtype)), tf.float32)
        picked, chosen = tf.math.top_k(logits, k=node.attrs["top_k"])
        return logits, chosen, tf.nn.softmax(picked, axis=-1)

    def _expert(self, node: Node, rows, e: int, weights):
        """Expert e's MLP on its rows (R, D); `weights` holds each parameter unstacked per expert."""
        cd = self.compute_dtype
        up = tf.matmul(rows, tf.cast(weights["w_in"][e], cd))
        if moe_mlp(node.attrs) == "swiglu":
            hidden = tf.nn.silu(tf.matmul(rows, tf.cast(weights["w_gate"][e], cd))) * up
            return tf.matmul(hidden, tf.cast(weights["w_out"][e], cd))
        hidden = tf.nn.gelu(up + tf.cast(weights["b_in"][e], cd), approximate=True)
        return tf.matmul(hidden, tf.cast(weights["w_out"][e], cd)) + tf.cast(weights["b_out"][e], cd)

    def _routed_experts(self, node: Node, x):
        """Sorted dispatch: the (token, expert) assignments sorted by expert (a stable argsort), the chosen
        tokens' rows gathered in that order and split into one contiguous segment per expert (sizes by
        bincount, tensors of the graph: no host read per expert), each expert's products on its segment,
        and the outputs weighted by their gates and summed back per token (unsorted_segment_sum). Returns
        (output, router logits (T, E), choices (T, k))."""
        a, cd = node.attrs, self.compute_dtype
        experts, top_k = a["experts"], a["top_k"]
        seq, width = self.graph.shapes[node.id]
        n = _batch_size(x)
        tokens = tf.reshape(tf.cast(x, cd), [-1, width])
        logits, chosen, gates = self._routing(node, tokens)
        assigned = tf.reshape(chosen, [-1])  # assignment i is token i // top_k's choice i % top_k
        order = tf.argsort(assigned, stable=True)
        sizes = tf.math.bincount(assigned, minlength=experts, maxlength=experts)
        token_of = order // top_k
        segments = tf.split(tf.gather(tokens, token_of), sizes, num=experts)
        # Unstacked once, so that each parameter's gradient is one stack of the experts' gradients.
        weights = {name: tf.unstack(value, num=experts) for name, value in self.params[node.id].items()
                   if name != "router"}
        out = tf.concat([self._expert(node, rows, e, weights) for e, rows in enumerate(segments)], axis=0)
        weighted = tf.cast(out, tf.float32) * tf.gather(tf.reshape(gates, [-1]), order)[:, None]
        summed = tf.math.unsorted_segment_sum(weighted, token_of, n * seq)
        return tf.reshape(tf.cast(summed, cd), [n, seq, width]), logits, chosen

    def _every_expert(self, node: Node, x):
        """Static shapes (XLA): every expert runs on every token in einsums, and a gate of 0 drops what the
        token did not choose (E/k times the work counted). Returns (output, router logits (N, S, E),
        choices (N, S, k))."""
        a, p, cd = node.attrs, self.params[node.id], self.compute_dtype
        x = tf.cast(x, cd)
        logits = tf.cast(tf.einsum("nsd,de->nse", x, tf.cast(p["router"], cd)), tf.float32)
        picked, chosen = tf.math.top_k(logits, k=a["top_k"])
        gates = tf.nn.softmax(picked, axis=-1)
        weight = tf.reduce_sum(tf.one_hot(chosen, a["experts"], dtype=tf.float32) * gates[..., None], axis=-2)
        up = tf.einsum("nsd,edf->nsef", x, tf.cast(p["w_in"], cd))
        if moe_mlp(a) == "swiglu":
            hidden = tf.nn.silu(tf.einsum("nsd,edf->nsef", x, tf.cast(p["w_gate"], cd))) * up
            out = tf.einsum("nsef,efd->nsed", hidden, tf.cast(p["w_out"], cd))
        else:
            hidden = tf.nn.gelu(up + tf.cast(p["b_in"], cd), approximate=True)
            out = tf.einsum("nsef,efd->nsed", hidden, tf.cast(p["w_out"], cd)) + tf.cast(p["b_out"], cd)
        return tf.einsum("nse,nsed->nsd", tf.cast(weight, cd), out), logits, chosen

    def _conv2d(self, node: Node, x):
        a, p, cd = node.attrs, self.params[node.id], self.compute_dtype
        kernel = p["kernel"] if cd == tf.float32 else tf.cast(p["kernel"], cd)
        in_shape = self.graph.shapes[node.inputs[0]]
        x = tf.cast(x, cd)
        strides, padding = [1] + list(a["strides"]) + [1], tf_padding(in_shape, a)
        if tuple(a["kernel"]) == (1, 1) and strides != [1, 1, 1, 1]:
            # A strided 1x1 conv reads every s-th pixel: take them first and convolve with stride 1, the
            # same arithmetic. oneDNN's AVX2 weight-gradient kernel for strided 1x1 convs is wrong for some
            # channel counts (relative error 0.46 for 4 -> 6 channels, exact for 64 -> 128, on an AMD EPYC
            # without AVX-512; tests/test_tensorflow_backend.py), and this form never reaches it.
            x = x[:, ::strides[1], ::strides[2], :]
            strides, padding = [1, 1, 1, 1], "VALID"
        groups, channels = a.get("groups", 1), in_shape[-1]
        if groups == 1:
            y = tf.nn.conv2d(x, kernel, strides=strides, padding=padding)
        elif groups == channels and a["strides"][0] == a["strides"][1]:
            kh, kw, _, filters = kernel.shape
            y = tf.nn.depthwise_conv2d(x, tf.reshape(kernel, [kh, kw, channels, filters // channels]), strides,
                                       padding)
        else:  # no CPU gradient kernel for a grouped tf.nn.conv2d (see the module's docstring)
            y = tf.concat([tf.nn.conv2d(xg, kg, strides=strides, padding=padding)
                           for xg, kg in zip(tf.split(x, groups, axis=-1), tf.split(kernel, groups, axis=-1))],
                          axis=-1)
        if a["use_bias"]:
            y = tf.nn.bias_add(y, tf.cast(p["bias"], cd))
        return y

    def _avg_pool(self, node: Node, x):
        a = node.attrs
        (kh, kw), (pt, pb, pl, pr) = a["kernel"], a["padding"]
        x32 = tf.cast(x, tf.float32)  # a float32 sum, as global_avg_pool
        if pt or pb or pl or pr:
            x32 = tf.pad(x32, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        y = tf.nn.avg_pool2d(x32, [kh, kw], list(a["strides"]), "VALID")
        if not a["count_padding"] and (pt or pb or pl or pr):
            y = y * tf.constant(_taps_ratio(self.graph.shapes[node.inputs[0]], a), tf.float32)
        return tf.cast(y, x.dtype)

    def _attention(self, node: Node, ins):
        a, cd = node.attrs, self.compute_dtype
        heads, kv, dim = a["heads"], kv_heads(a), a["head_dim"]
        group = heads // kv  # query heads per key-value head
        seq = self.graph.shapes[node.id][0]
        n = _batch_size(ins[0])

        def split_heads(t, width):  # (N, S, kv*width*d) -> (N, kv, width, S, d)
            return tf.transpose(tf.reshape(tf.cast(t, cd), [n, seq, kv, width, dim]), [0, 2, 3, 1, 4])

        # Query head h = g * group + j reads key-value head g: the key and value's group axis of 1
        # broadcasts in the batched products, so that they are never copied per query head.
        q, k, v = split_heads(ins[0], group), split_heads(ins[1], 1), split_heads(ins[2], 1)
        scores = tf.cast(tf.matmul(q, k, transpose_b=True), tf.float32) * (1.0 / float(np.sqrt(dim)))
        if a["causal"]:
            keep = tf.constant(np.tri(seq, dtype=bool))  # key j <= query i
            scores = tf.where(keep, scores, tf.constant(-np.inf, tf.float32))
        probs = tf.cast(tf.nn.softmax(scores, axis=-1), cd)
        out = tf.matmul(probs, v)  # (N, kv, group, S, d)
        return tf.reshape(tf.transpose(out, [0, 3, 1, 2, 4]), [n, seq, heads * dim])

    def _rotary(self, node: Node, x):
        """Half-split rotary positions in float32: each head's halves (x1, x2) become
        (x1 cos - x2 sin, x2 cos + x1 sin); returns the input's dtype."""
        seq, width = self.graph.shapes[node.id]
        half = node.attrs["head_dim"] // 2
        cos, sin = (tf.constant(t) for t in self.rotary_tables[node.id])
        halves = tf.reshape(tf.cast(x, tf.float32), [_batch_size(x), seq, width // (2 * half), 2, half])
        x1, x2 = halves[..., 0, :], halves[..., 1, :]
        rotated = tf.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-2)
        return tf.cast(tf.reshape(rotated, [_batch_size(x), seq, width]), x.dtype)

    def _batch_norm(self, node: Node, x, run: "_Pass"):
        p = self.params[node.id]
        eps = node.attrs["epsilon"]
        out_dtype = x.dtype
        x = tf.cast(x, tf.float32)
        axes = list(range(len(x.shape) - 1))
        if not run.training:
            scale = p["gamma"] * tf.math.rsqrt(p["moving_variance"] + eps)
            return tf.cast(x * scale + (p["beta"] - p["moving_mean"] * scale), out_dtype)
        momentum = node.attrs["momentum"]
        ctx = tf.distribute.get_replica_context()
        sync = run.synchronise and _in_replicas()
        if not sync and len(x.shape) == 4 and eps >= FUSED_MIN_EPSILON:
            # One kernel forward and backward, as Keras does: the written-out form below was 4-6%
            # slower on ResNet-50 (docs/performance.md). It returns the unbiased batch variance.
            y, mean, unbiased = tf.compat.v1.nn.fused_batch_norm(
                x, p["gamma"], p["beta"], epsilon=eps, data_format="NHWC", is_training=True)
            run.moving_updates(p, momentum, mean, unbiased)
            return tf.cast(y, out_dtype)
        count = tf.cast(tf.size(x) // tf.shape(x)[-1], tf.float32)
        total_x = tf.reduce_sum(x, axis=axes)
        if sync:  # global batch statistics: sum of sums and of counts over the replicas
            total_x, count = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [total_x, count])
        mean = total_x / count
        centred = x - mean
        sq = tf.reduce_sum(tf.square(centred), axis=axes)
        if sync:
            sq = ctx.all_reduce(tf.distribute.ReduceOp.SUM, sq)
        var = sq / count
        y = centred * (p["gamma"] * tf.math.rsqrt(var + eps)) + p["beta"]
        unbiased = var * (count / tf.maximum(count - 1.0, 1.0))
        run.moving_updates(p, momentum, mean, unbiased)
        return tf.cast(y, out_dtype)

    # -- weights ------------------------------------------------------------
    def load_canonical(self, weights: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        validate_weights(self.graph, weights)
        for node_id, params in weights.items():
            for pname, array in params.items():
                var = self.params.get(node_id, {}).get(pname)
                if var is None:
                    raise GraphError(f"no parameter '{pname}' in the lowered model", node_id)
                var.assign(np.asarray(array, np.float32))

    def export_canonical(self, trainable_only: bool = False) -> Weights:
        out: Weights = {}
        for node_id, params in self.params.items():
            out[node_id] = {k: np.array(v.numpy(), dtype=np.float32, copy=True) for k, v in params.items()
                            if not trainable_only or is_trainable(k)}
        return out

    def canonical_grads(self, grads) -> Weights:
        out: Weights = {n: {} for n in self.params}
        for (node_id, pname), var, g in zip(self.trainable_keys, self.trainables, grads):
            value = np.zeros(var.shape, np.float32) if g is None else np.asarray(tf.convert_to_tensor(g), np.float32)
            out[node_id][pname] = np.ascontiguousarray(value)
        return out


class _Pass:
    """One forward pass's settings (LoweredModel.call), the moving-statistics updates it makes and, when
    asked for (`balance`, a dict), each moe node's load_balance by node id."""

    def __init__(self, training: bool, masks=None, moving=None, synchronise: bool = True, seeds=None,
                 balance: dict | None = None):
        self.training, self.masks, self.moving, self.synchronise = training, masks, moving, synchronise
        self.seeds = seeds or {}  # dropout node -> stateless seed (inside a checkpointed block)
        self.updates: list[tuple[tf.Variable, Any]] = []
        self.balance = balance

    def moving_updates(self, p, momentum: float, mean, unbiased) -> None:
        for name, batch in (("moving_mean", mean), ("moving_variance", unbiased)):
            var = p[name]
            old = var if self.moving is None else self.moving.get(var.ref(), var)
            self.updates.append((var, momentum * old + (1.0 - momentum) * tf.stop_gradient(batch)))


def load_balance(logits, chosen, experts: int, seq: int):
    """(the sum over the batch's sequences of E sum_e f_e P_e, float32 assignments per expert (E,)) of a
    routing: `logits` the router's float32 logits of the batch's tokens, `chosen` their top_k experts, in
    token order (sequence by sequence, S tokens each). P_e: the mean over a sequence's tokens of the
    softmax over all E experts (its gradient reaches the router and the moe's input); f_e: the share of
    the sequence's S top_k assignments that e received, without gradient."""
    probs = tf.reshape(tf.nn.softmax(tf.reshape(logits, [-1, experts]), axis=-1), [-1, seq, experts])
    top_k = chosen.shape[-1]
    received = tf.reduce_sum(tf.one_hot(tf.reshape(chosen, [-1, seq * top_k]), experts, dtype=tf.float32), axis=1)
    share = tf.stop_gradient(received / float(seq * top_k))
    summed = float(experts) * tf.reduce_sum(share * tf.reduce_mean(probs, axis=1))
    return summed, tf.reduce_sum(received, axis=0)


def _in_replicas() -> bool:
    """Whether this code is traced for one of several replicas of a tf.distribute strategy."""
    ctx = tf.distribute.get_replica_context()
    return ctx is not None and ctx.num_replicas_in_sync > 1


def _batch_size(x):
    """The batch dimension: static where known (the counter traces a fixed batch), else dynamic."""
    return x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]


def _batch_shape(x, shape) -> list:
    return [_batch_size(x)] + list(shape)


def _taps_ratio(in_shape, attrs) -> np.ndarray:
    """(1, Ho, Wo, 1): kh * kw over the real (non-padded) taps of each output's window, which turns a
    zero-padded average over every tap into one over the real taps."""
    (h, w, _), (kh, kw), (sh, sw) = in_shape, attrs["kernel"], attrs["strides"]
    pt, pb, pl, pr = attrs["padding"]
    real = np.pad(np.ones((h, w)), ((pt, pb), (pl, pr)))
    ho, wo = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    count = np.array([[real[i * sh:i * sh + kh, j * sw:j * sw + kw].sum() for j in range(wo)] for i in range(ho)])
    return (kh * kw / count).reshape(1, ho, wo, 1).astype(np.float32)


def rotary_tables(seq: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of theta = p * base ** (-2 i / head_dim), (S, 1, head_dim / 2) float32, computed in
    float64: the angles of late positions (p up to S - 1) lose no digits before the one rounding."""
    inverse_frequency = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    theta = np.arange(seq, dtype=np.float64)[:, None, None] * inverse_frequency
    return np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)


def _same_dtype(xs):
    if any(x.dtype != xs[0].dtype for x in xs):
        return [tf.cast(x, tf.float32) for x in xs]
    return xs


def lower_graph(graph: Graph, weights: Mapping[str, Mapping[str, np.ndarray]], precision: str,
                device: str = "cpu") -> LoweredModel:
    """The model with its variables on `device` (a backend device name, e.g. 'gpu:1')."""
    from aiperf_backends.tensorflow.backend import tf_device_name

    with tf.device(tf_device_name(device)):
        return LoweredModel(graph, weights, precision, device)
