"""What each precision means in torch, as a scope around every forward, backward and update.

* fp32: IEEE fp32 arithmetic. On CUDA, cuDNN convolutions and cuBLAS matrix products would run in
  TF32 on compute capability 8.0+ (cuDNN's default), and on CPUs oneDNN may be told to use bf16 or
  TF32 for fp32 work; the scope asks every one of them for IEEE fp32.
* tf32: fp32 storage, convolutions and matrix products on TF32 tensor cores (CUDA 8.0+ only).
* bf16, fp16: torch.autocast to that dtype, fp32 master weights (fp16 adds a GradScaler in the
  step), with the convolutions and matrix products that stay fp32 held to IEEE fp32 as above.

The switches are process-global in torch, so `float32_math` sets them on entry and restores the
caller's values on exit: a user who set TF32 on for their own code keeps it, and the lowered model
computes what its precision says. torch has two APIs for them, the legacy `allow_tf32` booleans
and (2.9+) per-operator `fp32_precision` values, and refuses to read the legacy flag once they
disagree; so each switch is driven through the API its current state was set with: the legacy
setter while the legacy flag reads (a fresh process), the per-operator values otherwise. CPUs
(oneDNN) have the per-operator values only. A scope costs a few microseconds.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device | str, precision: str):
    """torch.autocast for a mixed precision, a null context for fp32 and tf32."""
    if precision not in AUTOCAST_DTYPES:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=AUTOCAST_DTYPES[precision])


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the convolutions of a model at `precision` compute in."""
    return AUTOCAST_DTYPES.get(precision, torch.float32)


class _Switch:
    """One of torch's fp32 switches: the legacy boolean (`allow_tf32`) or the newer per-operator
    `fp32_precision` values ('ieee', 'tf32', 'none')."""

    def __init__(self, legacy: tuple[object, str] | None, modern: list[object]):
        self.legacy, self.modern = legacy, modern

    def _legacy_readable(self) -> bool:
        # torch refuses to read the legacy flag once the two APIs disagree (it raises): then the
        # caller is on the new API, and so are we.
        if self.legacy is None:
            return False
        try:
            getattr(*self.legacy)
        except RuntimeError:
            return False
        return True

    def save(self):
        if self._legacy_readable():
            return ("legacy", getattr(*self.legacy))
        return ("modern", [getattr(m, "fp32_precision") for m in self.modern])

    def set(self, how: str, tf32: bool) -> None:
        if how == "legacy":
            setattr(*self.legacy, tf32)
        else:
            for m in self.modern:
                setattr(m, "fp32_precision", "tf32" if tf32 else "ieee")

    def restore(self, saved) -> None:
        how, value = saved
        if how == "legacy":
            setattr(*self.legacy, value)
        else:
            for m, v in zip(self.modern, value):
                setattr(m, "fp32_precision", v)


def _switches(device_type: str) -> list[_Switch]:
    """The fp32 switches that apply on a device type. Each is driven through the API its current
    state was set with (torch refuses to read the legacy flag after a mix of the two)."""
    b = torch.backends
    modern = hasattr(b.cuda.matmul, "fp32_precision") and hasattr(b.cudnn, "conv")
    if device_type == "cuda":
        return [_Switch((b.cuda.matmul, "allow_tf32"), [b.cuda.matmul] if modern else []),
                _Switch((b.cudnn, "allow_tf32"), [b.cudnn.conv, b.cudnn.rnn] if modern else [])]
    if device_type == "cpu" and modern and hasattr(getattr(b.mkldnn, "conv", None), "fp32_precision"):
        return [_Switch(None, [b.mkldnn.matmul, b.mkldnn.conv])]
    return []


@contextmanager
def float32_math(device: torch.device | str, tf32: bool):
    """Inside: fp32 convolutions and matrix products on `device` run as IEEE fp32 (tf32=False) or
    on TF32 units (tf32=True); on exit the caller's switches are back."""
    switches = _switches(torch.device(device).type)
    saved = [switch.save() for switch in switches]
    try:
        for switch, state in zip(switches, saved):
            switch.set(state[0], tf32)
        yield
    finally:
        for switch, state in zip(reversed(switches), reversed(saved)):
            switch.restore(state)


def math_scope(device: torch.device | str, precision: str):
    """The whole scope of a step at `precision`: autocast (mixed precisions) and the fp32 switches."""
    stack = ExitStack()
    stack.enter_context(float32_math(device, tf32=precision == "tf32"))
    stack.enter_context(autocast(device, precision))
    return stack


def runs_tf32(device: torch.device | str) -> bool:
    """Whether `device` has TF32 units: CUDA compute capability 8.0 or newer."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)
