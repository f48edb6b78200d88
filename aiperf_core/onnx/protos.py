"""Reading ONNX's protobufs: a model file, a node's attributes, a float attribute as it was written, and
the tensor types aiperf reads; an error from either in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from aiperf_core.errors import GraphError

# Metadata key keeping the IR input node's id, since the ONNX input is always "input".
INPUT_ID_KEY = "aiperf.input_id"
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
INDEX_TYPES = (TensorProto.INT64, TensorProto.INT32)


def read_model(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise GraphError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
    except Exception as exc:  # protobuf decode errors, missing external data, ...
        raise GraphError(f"{path}: not a readable ONNX model ({one_line(exc)})") from None
    if not model.graph.node or not model.opset_import:
        raise GraphError(f"{path}: not an ONNX model (no graph or no opset)")
    return model


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def clean_float(value) -> float:
    """A float32 attribute as the shortest decimal that rounds to it (1.001e-05, not 1.0009999e-05)."""
    return float(str(np.float32(value)))


def node_attrs(node: onnx.NodeProto) -> dict:
    out = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        out[attr.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out
