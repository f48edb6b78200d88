"""Export of an IR graph as ONNX.

ONNX is NCHW with a batch axis; the IR is NHWC without one. Export writes a model whose input "input" is
[N, C, H, W] (N symbolic), [N, F] or [N, S, D], or for a token graph the int64 token ids [N, S].

How each IR op is written, and read back:
- conv2d: Conv (group = groups); batch_norm: BatchNormalization; relu: Relu; add: Add (Sum for 3+);
  concat: Concat over channels; max_pool: MaxPool; global_avg_pool: GlobalAveragePool + Flatten;
  flatten: (Transpose to NHWC +) Flatten; softmax: Softmax over the last axis; dropout: Dropout.
- lrn: LRN; avg_pool: AveragePool (count_include_pad = count_padding); mul_const / add_const: Mul /
  Add of an initializer, per channel of shape [1, C, 1, 1], [1, F] or [1, 1, D], a scalar of rank 0;
  channel_shuffle: Reshape [N, G, C/G, H, W] -> Transpose [0, 2, 1, 3, 4] -> Reshape [N, C, H, W].
- token_input: an int64 input [N, S]; embedding: Gather of the table (axis 0); position_embedding:
  Add of an [S, D] initializer; dense over a sequence: MatMul (+ Add of the bias); layer_norm:
  LayerNormalization (axis -1); gelu: Gelu(approximate="tanh"); attention: ONNX's Attention on the
  3-D (N, S, heads * head_dim) inputs, q_num_heads = heads, kv_num_heads = kv_heads (grouped-query
  attention when fewer), is_causal = causal and the default scale 1/sqrt(head_dim).
- rms_norm: RMSNormalization (axis -1, opset 23); rotary: RotaryEmbedding (opset 23, num_heads = width /
  head_dim, not interleaved: the half-split form) with float32 cos and sin caches (S, head_dim / 2) of
  the angles computed in float64 (rotary_tables), and position ids [0, S) expanded to the input's
  [N, S] (onnxruntime wants the input's own batch there, so a Shape and an Expand compute them); read
  back, the caches give the base (rotary_base: the shortest decimal whose tables they are, to float32
  rounding). silu: Sigmoid and a Mul by its input, at any opset (ONNX's Swish came in opset 24 and
  would lift every Llama above the 23 its other ops need; a Swish of alpha 1 reads as silu); mul: Mul
  of two activations.

Export opset: DEFAULT_OPSET (17) unless the graph holds an op that ONNX added later, then the first
opset that has all of them (23 for attention, rms_norm and rotary, 20 for gelu): a CNN keeps the opset
17 it always had (no consumer's support changes), a transformer gets ONNX's own Attention,
RMSNormalization and RotaryEmbedding ops, which onnx.reference.ReferenceEvaluator and onnxruntime 1.31
both run (grouped-query Attention included). An explicit opset below what the graph needs is refused
naming the op.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.atomic import write_bytes_atomic
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import Graph, Node, kv_heads
from aiperf_core.onnx.protos import INPUT_ID_KEY
from aiperf_core.onnx.rotary import rotary_tables
from aiperf_core.weights import init_weights, validate_weights

INPUT_NAME = "input"
DEFAULT_OPSET = 17
MIN_EXPORT_OPSET = 11  # Gemm's bias is optional from 11 on
# The first opset holding the ONNX op that an IR op is written as, where that is newer than MIN_EXPORT_OPSET.
FIRST_OPSET = {"layer_norm": 17, "gelu": 20, "attention": 23, "rms_norm": 23, "rotary": 23}

_PROTOBUF_LIMIT = 2**31 - 1

def export_onnx(graph: Graph, weights: Mapping | None = None, path=None, opset: int | None = None) -> onnx.ModelProto:
    """Return (and write atomically to `path`, if given) the graph as an NCHW ONNX model.

    Without weights, the initializers come from init_weights(graph, seed=0)
    (He-normal kernels, zero biases, identity batch norm), so the model is
    always valid and runnable. Weights are stored as float32. The opset
    defaults to the lowest one, at least DEFAULT_OPSET, that has every op of
    the graph (see the module docstring).
    """
    latest = onnx.defs.onnx_opset_version()
    needed = max(FIRST_OPSET.get(n.op, MIN_EXPORT_OPSET) for n in graph.nodes)
    if opset is None:
        opset = max(DEFAULT_OPSET, needed)
    if isinstance(opset, bool) or not isinstance(opset, int) or not MIN_EXPORT_OPSET <= opset <= latest:
        raise AiperfError(f"ONNX export supports opsets {MIN_EXPORT_OPSET} to {latest}, got {opset!r}")
    if opset < needed:
        first = next(n for n in graph.nodes if FIRST_OPSET.get(n.op, MIN_EXPORT_OPSET) > opset)
        raise AiperfError(f"ONNX export: op '{first.op}' (node '{first.id}') needs opset "
                          f"{FIRST_OPSET[first.op]} or newer, got {opset}")
    if weights is None:
        weights = init_weights(graph, seed=0)
    else:
        validate_weights(graph, weights)

    names = {n.id: _tensor_name(graph, n) for n in graph.nodes}
    nodes: list[onnx.NodeProto] = []
    inits: list[TensorProto] = []

    def param(node_id: str, pname: str, array) -> str:
        # IR ids cannot contain '/', so these names never clash with a node's tensor.
        name = f"{node_id}/{pname}"
        inits.append(numpy_helper.from_array(np.asarray(array, dtype=np.float32, order="C"), name))
        return name

    def shape_const(node_id: str, pname: str, dims) -> str:
        name = f"{node_id}/{pname}"
        inits.append(numpy_helper.from_array(np.asarray(dims, dtype=np.int64), name))
        return name

    for node in graph.nodes:
        if node.op in ("input", "token_input"):
            continue
        nid, a, out = node.id, node.attrs, names[node.id]
        x = [names[i] for i in node.inputs]
        w = weights.get(nid, {})
        in_shape = graph.shapes[node.inputs[0]]
        image_in = len(in_shape) == 3
        if node.op == "layer_norm" and image_in:
            # ONNX's last axis of an NCHW map is W, not the IR's channels.
            raise GraphError("ONNX export writes layer_norm over a flat or sequence input, not an image", nid)
        if node.op == "conv2d":
            ins = [x[0], param(nid, "kernel", np.transpose(w["kernel"], (3, 2, 0, 1)))]
            if a["use_bias"]:
                ins.append(param(nid, "bias", w["bias"]))
            group = {"group": a["groups"]} if "groups" in a else {}
            nodes.append(helper.make_node(
                "Conv", ins, [out], name=nid, kernel_shape=list(a["kernel"]),
                strides=list(a["strides"]), pads=_onnx_pads(a["padding"]), **group,
            ))
        elif node.op == "batch_norm":
            if len(in_shape) == 2:
                raise GraphError("ONNX export writes batch_norm over an image or a flat input, not a sequence "
                                 "(BatchNormalization's channels are axis 1)", nid)
            ins = [x[0]] + [param(nid, p, w[p]) for p in ("gamma", "beta", "moving_mean", "moving_variance")]
            nodes.append(helper.make_node(
                "BatchNormalization", ins, [out], name=nid, epsilon=a["epsilon"], momentum=a["momentum"],
            ))
        elif node.op == "relu":
            nodes.append(helper.make_node("Relu", x, [out], name=nid))
        elif node.op == "add":
            nodes.append(helper.make_node("Add" if len(x) == 2 else "Sum", x, [out], name=nid))
        elif node.op == "concat":
            nodes.append(helper.make_node("Concat", x, [out], name=nid, axis=1))
        elif node.op == "max_pool":
            nodes.append(helper.make_node(
                "MaxPool", x, [out], name=nid, kernel_shape=list(a["kernel"]),
                strides=list(a["strides"]), pads=_onnx_pads(a["padding"]),
            ))
        elif node.op == "avg_pool":
            nodes.append(helper.make_node(
                "AveragePool", x, [out], name=nid, kernel_shape=list(a["kernel"]), strides=list(a["strides"]),
                pads=_onnx_pads(a["padding"]), count_include_pad=int(a["count_padding"]),
            ))
        elif node.op == "global_avg_pool":
            nodes.append(helper.make_node("GlobalAveragePool", x, [f"{out}/pooled"], name=nid))
            nodes.append(helper.make_node("Flatten", [f"{out}/pooled"], [out], name=f"{nid}/flatten", axis=1))
        elif node.op == "lrn":
            nodes.append(helper.make_node(
                "LRN", x, [out], name=nid, size=a["size"], alpha=a["alpha"], beta=a["beta"], bias=a["bias"],
            ))
        elif node.op in ("mul_const", "add_const"):
            # Per channel: ones but the channel axis, over ONNX's full rank (so that a sequence's never
            # reads as a dense bias or a position table); a scalar: rank 0.
            channels = in_shape[-1]
            shape = [1, channels, 1, 1] if image_in else [1] * len(in_shape) + [channels]
            value = w["value"].reshape(shape if a["per_channel"] else ())
            op = "Mul" if node.op == "mul_const" else "Add"
            nodes.append(helper.make_node(op, [x[0], param(nid, "value", value)], [out], name=nid))
        elif node.op == "channel_shuffle":
            h, wd, c = in_shape
            g = a["groups"]
            split, swapped = f"{out}/split", f"{out}/swapped"
            nodes.append(helper.make_node(
                "Reshape", [x[0], shape_const(nid, "split_shape", [0, g, c // g, h, wd])], [split], name=split,
            ))
            nodes.append(helper.make_node("Transpose", [split], [swapped], name=swapped, perm=[0, 2, 1, 3, 4]))
            nodes.append(helper.make_node("Reshape", [swapped, shape_const(nid, "shape", [0, c, h, wd])], [out],
                                          name=nid))
        elif node.op == "flatten":
            src = x[0]
            if image_in:  # the IR flattens in NHWC order
                src = f"{out}/nhwc"
                nodes.append(helper.make_node("Transpose", x, [src], name=f"{nid}/to_nhwc", perm=[0, 2, 3, 1]))
            nodes.append(helper.make_node("Flatten", [src], [out], name=nid, axis=1))
        elif node.op == "dense" and len(in_shape) == 1:
            ins = [x[0], param(nid, "kernel", w["kernel"])]
            if a["use_bias"]:
                ins.append(param(nid, "bias", w["bias"]))
            nodes.append(helper.make_node("Gemm", ins, [out], name=nid))
        elif node.op == "dense":  # over the last axis of a sequence
            product = f"{out}/matmul" if a["use_bias"] else out
            nodes.append(helper.make_node("MatMul", [x[0], param(nid, "kernel", w["kernel"])], [product], name=nid))
            if a["use_bias"]:
                nodes.append(helper.make_node("Add", [product, param(nid, "bias", w["bias"])], [out],
                                              name=f"{nid}/bias"))
        elif node.op == "softmax":
            # Before opset 13 Softmax flattens from `axis` on: the last axis alone is the per-sample rank.
            axis = -1 if opset >= 13 else len(in_shape)
            nodes.append(helper.make_node("Softmax", x, [out], name=nid, axis=axis))
        elif node.op == "dropout":
            if opset >= 12:
                ratio = param(nid, "ratio", np.float32(a["rate"]))
                nodes.append(helper.make_node("Dropout", [x[0], ratio], [out], name=nid))
            else:
                nodes.append(helper.make_node("Dropout", x, [out], name=nid, ratio=a["rate"]))
        elif node.op == "embedding":
            nodes.append(helper.make_node("Gather", [param(nid, "table", w["table"]), x[0]], [out], name=nid, axis=0))
        elif node.op == "position_embedding":
            nodes.append(helper.make_node("Add", [x[0], param(nid, "table", w["table"])], [out], name=nid))
        elif node.op == "layer_norm":
            ins = [x[0], param(nid, "gamma", w["gamma"]), param(nid, "beta", w["beta"])]
            nodes.append(helper.make_node("LayerNormalization", ins, [out], name=nid, axis=-1,
                                          epsilon=a["epsilon"]))
        elif node.op == "attention":
            nodes.append(helper.make_node(
                "Attention", x, [out], name=nid, is_causal=int(a["causal"]),
                q_num_heads=a["heads"], kv_num_heads=kv_heads(a),
            ))
        elif node.op == "gelu":
            nodes.append(helper.make_node("Gelu", x, [out], name=nid, approximate="tanh"))
        elif node.op == "rms_norm":
            nodes.append(helper.make_node("RMSNormalization", [x[0], param(nid, "gamma", w["gamma"])], [out],
                                          name=nid, axis=-1, epsilon=a["epsilon"]))
        elif node.op == "rotary":
            seq_len, width = in_shape
            cos, sin = rotary_tables(seq_len, a["head_dim"], a["base"])
            # onnxruntime wants position ids of the input's own batch: [0, S) broadcast to [N, S].
            batch_and_seq, positions = f"{out}/batch_and_seq", f"{out}/positions"
            nodes.append(helper.make_node("Shape", x, [batch_and_seq], name=batch_and_seq, start=0, end=2))
            nodes.append(helper.make_node(
                "Expand", [shape_const(nid, "position_ids", np.arange(seq_len)[None]), batch_and_seq], [positions],
                name=positions,
            ))
            nodes.append(helper.make_node(
                "RotaryEmbedding", [x[0], param(nid, "cos", cos), param(nid, "sin", sin), positions], [out],
                name=nid, num_heads=width // a["head_dim"],
            ))
        elif node.op == "silu":
            sigmoid = f"{out}/sigmoid"
            nodes.append(helper.make_node("Sigmoid", x, [sigmoid], name=sigmoid))
            nodes.append(helper.make_node("Mul", [x[0], sigmoid], [out], name=nid))
        elif node.op == "mul":
            nodes.append(helper.make_node("Mul", x, [out], name=nid))
        else:  # pragma: no cover - every IR op is handled above
            raise GraphError(f"ONNX export does not know op '{node.op}'", nid)

    def value_info(name: str, shape, elem_type=TensorProto.FLOAT) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem_type, ["N", *_nchw(shape)])

    input_type = TensorProto.INT64 if graph.takes_tokens else TensorProto.FLOAT
    onnx_graph = helper.make_graph(
        nodes, graph.name,
        [value_info(INPUT_NAME, graph.input_shape, input_type)],
        [value_info(names[graph.output_id], graph.output_shape)],
        initializer=inits,
    )
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        onnx_graph, opset_imports=opsets, producer_name="aiperf",
        ir_version=helper.find_min_ir_version_for(opsets),
    )
    helper.set_model_props(model, {INPUT_ID_KEY: graph.input_id})
    if model.ByteSize() > _PROTOBUF_LIMIT:
        raise AiperfError("model is larger than ONNX's 2 GB protobuf limit; cannot export it as one file")
    if path is not None:
        write_bytes_atomic(path, model.SerializeToString())
    return model


def _tensor_name(graph: Graph, node: Node) -> str:
    if node.op in ("input", "token_input"):
        return INPUT_NAME
    return f"{node.id}/out" if node.id == INPUT_NAME else node.id


def _onnx_pads(padding) -> list[int]:
    top, bottom, left, right = padding
    return [top, left, bottom, right]


def _nchw(shape) -> list[int]:
    if len(shape) == 3:
        h, w, c = shape
        return [c, h, w]
    return list(shape)
