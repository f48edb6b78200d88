"""ONNX interchange of the graph IR: export_onnx writes a graph as ONNX, import_onnx reads the models of
real exporters into the IR (docs/onnx.md). The rotary tables are shared by both directions.
"""

from aiperf_core.onnx.importer import rotary_base, rotary_tables
from aiperf_core.onnx.io import export_onnx, import_onnx, reference_evaluator, with_random_initializers

__all__ = ["export_onnx", "import_onnx", "reference_evaluator", "rotary_base", "rotary_tables",
           "with_random_initializers"]
