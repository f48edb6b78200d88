"""ONNX export and import for the graph IR.

Export (export.py) writes any IR graph as an NCHW ONNX model. Import (importer.py) reads the CNNs that
real exporters (torch.onnx, tf2onnx, Keras, Caffe2) write, opset 9 and newer, the transformers that export
writes, and those of torch.onnx's TorchScript and dynamo exporters and Hugging Face's models
(docs/onnx.md). It folds every node computed from constants and fixed shapes (fold.py), then maps each
ONNX tensor to an IR node plus the ONNX layout it stands for (layouts.py), so that layout changes
(transposes, flattening, pooling to 1x1, a transformer's head reshapes) cost no IR node. Each ONNX op
type has one handler, in the module of its op family under ops/; pending elementwise functions are
pointwise.py's. rotary.py holds the rotary tables both directions share, protos.py the reading of ONNX's
protobufs, reference.py the ONNX runtimes' side of a comparison (random weights for the model zoo,
ReferenceEvaluator with two ops fixed).

Anything the IR cannot express raises GraphError naming the ONNX node and op.
"""

from aiperf_core.onnx.export import export_onnx
from aiperf_core.onnx.importer import import_onnx
from aiperf_core.onnx.reference import reference_evaluator, with_random_initializers
from aiperf_core.onnx.rotary import rotary_base, rotary_tables

__all__ = ["export_onnx", "import_onnx", "reference_evaluator", "rotary_base", "rotary_tables",
           "with_random_initializers"]
