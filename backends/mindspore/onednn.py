"""MindSpore's own oneDNN (lib/libdnnl.so.3 in its wheel, oneDNN 3.10.1 in MindSpore 2.10), capped at
AVX2 on a CPU with AVX-512, before MindSpore creates its first oneDNN primitive.

Why: on any AVX-512 CPU that oneDNN runs a convolution on MindSpore's plain NCHW tensors with its
reference kernel (ONEDNN_VERBOSE names it `jit_uni_ncsp:conv+ref:any`), at 0.8 GFLOP/s on 2 cores of
the CI's Xeon for a 3x3 64-channel conv at 56 or 224 px, whichever AVX-512 level it is held to
(AVX512_CORE to AVX512_CORE_AMX). Capped at AVX2 it picks `gemm:jit`: 59 GFLOP/s on the same conv,
74 times faster, and a ResNet or VGG trains or predicts at a CPU's speed. MatMul loses some of its
AVX-512 speed (a 2048x1024x1024 product: 134 to 93 GFLOP/s), which costs far less than the convs
gain. An AVX2 CPU (AMD Zen 3) dispatches `gemm:jit` anyway: nothing changes there.

Only MindSpore's copy is capped, through its own library handle: torch and TensorFlow link their own
oneDNN, whose ISA this leaves alone (torch's bf16 needs AVX-512 or AMX). A user's ONEDNN_MAX_CPU_ISA
(or DNNL_MAX_CPU_ISA) wins: oneDNN reads it, and the cap is not set."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from aiperf_core.backend import cpu_flags

DNNL_CPU_ISA_AVX2 = 0x7  # dnnl_cpu_isa_avx2 in oneDNN's dnnl_types.h
DNNL_SUCCESS = 0
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")

capped: bool | None = None  # whether cap_on_avx512 set the cap (None: not called yet)


def library(mindspore_module) -> Path:
    return Path(mindspore_module.__file__).parent / "lib" / "libdnnl.so.3"


def cap_on_avx512(mindspore_module) -> bool:
    """Cap MindSpore's oneDNN at AVX2 where the CPU has AVX-512 and no ISA is asked for in the
    environment; once per process. Whether the cap is set: oneDNN refuses it once a primitive has
    been made (then MindSpore's convs run as they did)."""
    global capped
    if capped is None:
        capped = False
        if "avx512f" in cpu_flags() and not any(os.environ.get(name) for name in ISA_ENV):
            try:  # another MindSpore may ship no such library, or another oneDNN: its convs run as they are
                set_max_cpu_isa = ctypes.CDLL(str(library(mindspore_module))).dnnl_set_max_cpu_isa
            except (OSError, AttributeError):
                return capped
            capped = set_max_cpu_isa(DNNL_CPU_ISA_AVX2) == DNNL_SUCCESS
    return capped
