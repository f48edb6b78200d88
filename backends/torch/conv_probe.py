"""A start-up check of the CPU convolution kernels a lowered model will use (issue 18.1).

torch 2.13 on some AMD EPYC CPUs computes a wrong weight gradient for a 1x1, stride-2 conv2d on a
channels_last fp32 input (relative error 0.40; contiguous input and float64 are right). ResNet-50's
v1 layout has that conv on every downsampling block, so on such a CPU the backend would train on
wrong gradients. Which kernel oneDNN picks depends on the CPU, so the backend does not assume: once
per process and conv geometry, it runs the conv on a small batch and compares the weight gradient
with an independent one (im2col by `F.unfold` and a matrix product).

A geometry is the conv as the model runs it: input and output channels, kernel, stride, the
symmetric padding passed to the conv (asymmetric padding is an explicit F.pad before a conv with
padding 0) and the groups (grouped and depthwise convs run other oneDNN kernels than dense ones,
so they are probed like any other: the reference is the same im2col, group by group), at the
model's compute dtype (fp32, or the autocast dtype of a mixed precision). The
probe batch is 2 images of at most a few pixels more than the kernel's reach, which keeps the
whole probe of ResNet-50 to tens of milliseconds.

Where channels_last is wrong, the conv runs in the first of these forms that is right:
  * 'subsampled' (1x1 kernels with stride > 1, no padding): the conv of the input's strided view
    with stride 1, the same numbers, still channels_last;
  * 'contiguous': input and kernel made contiguous (NCHW) for this conv, the output back to
    channels_last.
If none is right, lowering fails: a benchmark must not train on wrong gradients.

Strided 1x1 convs are not probed: they always run 'subsampled' on a CPU. oneDNN's channels_last
backward-weights kernels for them write past the end of the gradient buffer (valgrind:
jit_avx2_1x1_convolution_bwd_weights_t, "12 bytes after a block of size 448"), which corrupts the
heap: "double free or corruption" aborts and segfaults of torch replicas (issue 18.2), with a
gradient that may even be right. It happens at the AVX2 dispatch (ONEDNN_MAX_CPU_ISA=AVX2
reproduces it on any AVX2 CPU) and, with 3 input channels at 224x224 (a morph's skip from the
input image), at the AVX-512 one too. A probe cannot see such a write, and running the kernel to
look would do the damage, so the probe never runs it. The subsampled form costs 10-30% more on
those few convs (6 of ResNet-50's 53) on an AVX-512 CPU, about 1% of a step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from aiperf_backends.torch.precision import float32_math
from aiperf_core.backend import BackendError

log = logging.getLogger("aiperf.torch")

CHANNELS_LAST, SUBSAMPLED, CONTIGUOUS = "channels_last", "subsampled", "contiguous"
FORMS = (CHANNELS_LAST, SUBSAMPLED, CONTIGUOUS)
# Relative error (max abs difference / max abs reference) above which a weight gradient is wrong.
# The reference is fp32 im2col of the same (rounded) inputs: ~1e-6 from a right fp32 kernel; a
# 16-bit kernel rounds its inputs to 8 (bf16) or 11 (fp16) significant bits, ~1e-2 worst case
# over a probe's sums. The known bug is 0.4.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
PROBE_BATCH = 2
PROBE_MARGIN = 3  # probe input size: kernel reach + this, in each dimension

Conv2d = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ConvGeometry:
    in_channels: int
    out_channels: int
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]  # symmetric padding given to the conv itself
    groups: int = 1

    def describe(self) -> str:
        grouped = f", {self.groups} groups" if self.groups > 1 else ""
        return (f"{self.kernel[0]}x{self.kernel[1]} stride {self.stride[0]}x{self.stride[1]} padding "
                f"{self.padding[0]}x{self.padding[1]} ({self.in_channels}->{self.out_channels} channels{grouped})")

    @property
    def can_subsample(self) -> bool:
        return self.kernel == (1, 1) and self.padding == (0, 0) and self.stride != (1, 1)


# (geometry, dtype, id of the conv function) -> form, for the life of the process
_FORMS: dict[tuple[ConvGeometry, torch.dtype, int], str] = {}


def run_conv(conv2d: Conv2d, form: str, x: torch.Tensor, weight: torch.Tensor, bias, stride, padding,
             groups: int = 1):
    """conv2d(x, weight) in `form` (see the module docstring); NCHW logical layout in and out. The
    groups are passed only where there are several, as the lowered model's code does."""
    grouped = (1, groups) if groups > 1 else ()
    if form == CHANNELS_LAST:
        return conv2d(x, weight, bias, stride, padding, *grouped)
    if form == SUBSAMPLED:
        return conv2d(x[:, :, ::stride[0], ::stride[1]], weight, bias, 1, 0, *grouped)
    y = conv2d(x.contiguous(), weight.contiguous(), bias, stride, padding, *grouped)
    return y.contiguous(memory_format=torch.channels_last)


def weight_gradient_error(conv2d: Conv2d, geometry: ConvGeometry, form: str, dtype: torch.dtype) -> float:
    """Relative error of the weight gradient of `conv2d` in `form` on a seeded probe batch (CPU)."""
    g = geometry
    gen = torch.Generator().manual_seed(0)
    size = [k + s * PROBE_MARGIN for k, s in zip(g.kernel, g.stride)]  # PROBE_MARGIN + 1 outputs or more
    x = torch.randn(PROBE_BATCH, g.in_channels, *size, generator=gen)
    w = torch.randn(g.out_channels, g.in_channels // g.groups, *g.kernel, generator=gen)
    if dtype != torch.float32:  # the reference sees the same rounded values as the 16-bit kernel
        x, w = x.to(dtype).float(), w.to(dtype).float()
    x = x.contiguous(memory_format=torch.channels_last)
    weight = w.contiguous(memory_format=torch.channels_last).requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        y = run_conv(conv2d, form, x, weight, None, g.stride, g.padding, g.groups)
    grad_out = torch.randn(y.shape, generator=gen)
    if dtype != torch.float32:
        grad_out = grad_out.to(dtype).float()
    (y.float() * grad_out).sum().backward()
    # im2col reference: grad_w[o, c*kh*kw] = sum over images and positions of g[o, l] * cols[c*kh*kw, l],
    # where filter o of group j reads the input channels of group j only
    cols = F.unfold(x.contiguous(), g.kernel, padding=g.padding, stride=g.stride)  # (N, C*kh*kw, L)
    ref = torch.einsum("njol,njkl->jok", grad_out.reshape(PROBE_BATCH, g.groups, g.out_channels // g.groups, -1),
                       cols.reshape(PROBE_BATCH, g.groups, -1, cols.shape[-1])).reshape(g.out_channels, -1)
    got = weight.grad.float().reshape(g.out_channels, -1)
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def conv_forms(geometries: Iterable[ConvGeometry], dtype: torch.dtype, conv2d: Conv2d = F.conv2d) -> dict[ConvGeometry, str]:
    """The form each CPU conv runs in: channels_last where its weight gradient is right, else the
    first right fallback. Probed once per process, geometry and dtype; one log line when any conv
    avoids channels_last. Raises BackendError when no form is right."""
    tolerance = TOLERANCE[dtype]
    forms: dict[ConvGeometry, str] = {}
    avoided: list[str] = []
    for geometry in dict.fromkeys(geometries):
        key = (geometry, dtype, id(conv2d))
        if geometry.can_subsample:  # never run: its kernel corrupts the heap (module docstring)
            _FORMS[key] = SUBSAMPLED
        if key not in _FORMS:
            errors = {}
            for form in FORMS:
                if form == SUBSAMPLED and not geometry.can_subsample:
                    continue
                with float32_math("cpu", tf32=False):  # as the model runs it (precision.py)
                    errors[form] = weight_gradient_error(conv2d, geometry, form, dtype)
                if errors[form] <= tolerance:
                    break
            right = [form for form, err in errors.items() if err <= tolerance]
            if not right:
                raise BackendError(
                    f"every CPU kernel tried for conv {geometry.describe()} at {_dtype_name(dtype)} computes a wrong "
                    f"weight gradient (relative errors {', '.join(f'{f} {e:.3g}' for f, e in errors.items())})")
            _FORMS[key] = right[0]
            if right[0] != CHANNELS_LAST:
                avoided.append(f"{geometry.describe()}: channels_last relative error {errors[CHANNELS_LAST]:.3g}, "
                               f"runs {right[0]}")
        forms[geometry] = _FORMS[key]
    if avoided:
        log.warning("torch %s: this CPU's channels_last conv kernel computes wrong %s weight gradients; avoiding "
                    "it for %s", torch.__version__, _dtype_name(dtype), "; ".join(avoided))
    return forms


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
