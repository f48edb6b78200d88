"""The handlers of ONNX ops, one module per op family, each registered for its ONNX op types with
registry.converter; HANDLERS is the whole table once every family is imported. Adding an op is adding its
handler to its family's module (a test holds every op type to one handler):

    conv.py           Conv, Pad
    pooling.py        MaxPool, AveragePool, GlobalAveragePool, ReduceMean
    normalization.py  BatchNormalization, LRN, LayerNormalization, RMSNormalization (and decomposed norms)
    activations.py    Relu, Gelu, Swish, Softmax, Dropout
    elementwise.py    Add, Sum, Sub, Mul, Div, Pow, Neg, Tanh, Sigmoid, Erf, Exp, Sqrt, Reciprocal, Cast, Identity
    matmul.py         Gemm, MatMul, Split, Slice
    embedding.py      Gather
    attention.py      Attention, RotaryEmbedding, IsNaN, Where (and attention written out)
    shape.py          Shape, Flatten, Squeeze, Reshape, Transpose, Concat, Unsqueeze, Expand
"""

from aiperf_core.onnx.ops import (activations, attention, conv, elementwise, embedding, matmul,  # noqa: F401
                                  normalization, pooling, shape)
from aiperf_core.onnx.ops.registry import HANDLERS

__all__ = ["HANDLERS"]
