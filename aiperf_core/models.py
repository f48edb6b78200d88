"""Resolve a MODEL argument: a builder name, an IR .json file or an .onnx file."""

from __future__ import annotations

from pathlib import Path

from aiperf_core.builders import BUILDERS, build
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, load_graph
from aiperf_core.weights import Weights, load_weights


def load_model(spec: str, input_shape=None, classes: int | None = None, weights_path=None,
               **sizes) -> tuple[Graph, Weights | None]:
    """Return (graph, weights or None). input_shape and classes apply to the image builders, `sizes`
    (layers, hidden, heads, seq_len, vocab, ffn) to the gpt builder."""
    if spec in BUILDERS:
        graph = build(spec, input_shape, classes, **sizes)
        return graph, (load_weights(weights_path, graph) if weights_path is not None else None)
    if any(v is not None for v in sizes.values()):
        given = next(k for k, v in sizes.items() if v is not None)
        raise AiperfError(f"--{given.replace('_', '-')} applies to the gpt builder only; a model file fixes its own sizes")
    path = Path(spec)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".onnx"):
        if not path.exists():
            raise AiperfError(
                f"model '{spec}' is neither a builder ({', '.join(sorted(BUILDERS))}) nor a .json/.onnx file"
            )
        raise AiperfError(f"{spec}: unsupported model file type (use an IR .json or an .onnx file)")
    if input_shape is not None or classes is not None:
        raise AiperfError("--input and --classes apply to builder models only; a model file fixes its own shapes")
    if not path.is_file():
        raise AiperfError(f"{spec}: no such file")
    if suffix == ".onnx":
        from aiperf_core.onnx import import_onnx

        graph, weights = import_onnx(path)
        if weights_path is not None:
            weights = load_weights(weights_path, graph)
        return graph, weights
    graph = load_graph(path)
    weights = load_weights(weights_path, graph) if weights_path is not None else None
    return graph, weights
