"""The table of ONNX op handlers, one per ONNX op type (onnx2torch's converter registry is the model).

A handler is `handler(importer, node)`: it reads the node's inputs through the importer (act, raw, const),
emits IR nodes (emit) and sets what its output stands for (set), or refuses in one line naming the ONNX
node and op (fail). An op that serves several patterns (Mul: a constant scale, a norm's gamma, an
attention scale, a pending elementwise function) has one handler, which asks each pattern in turn.
"""

from __future__ import annotations

from typing import Callable

HANDLERS: dict[str, Callable] = {}


def converter(*op_types: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as the handler of each ONNX op type (default domain)."""

    def register(handler: Callable) -> Callable:
        for op_type in op_types:
            if op_type in HANDLERS:
                raise RuntimeError(f"ONNX op {op_type} has two handlers: {HANDLERS[op_type].__module__}."
                                   f"{HANDLERS[op_type].__name__} and {handler.__module__}.{handler.__name__}")
            HANDLERS[op_type] = handler
        return handler

    return register
