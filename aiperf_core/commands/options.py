"""Argument types shared by several subcommands."""

from __future__ import annotations

import argparse
import re


def image_shape(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not HxWxC (for example 224x224x3)")
    shape = tuple(int(g) for g in m.groups())
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': every size must be at least 1")
    return shape


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"'{text}' must not be negative")
    return value


def add_model_arguments(p, what: str = "builder name (resnet50, resnet_small), IR .json or .onnx file") -> None:
    """MODEL plus the builder-only shape options, shared by every command that takes a model."""
    p.add_argument("model", metavar="MODEL", help=what)
    p.add_argument("--input", type=image_shape, default=None, metavar="HxWxC",
                   help="input shape for builder models (default: the builder's, 224x224x3 for resnet50)")
    p.add_argument("--classes", type=positive_int, default=None, metavar="N",
                   help="number of classes for builder models (default: the builder's, 1000 for resnet50)")
