"""The PyTorch backend. torch itself is imported only when the backend is used.

Modules: backend (the Backend subclass), lowering (IR -> a torch module with a generated forward),
conv_probe (the start-up check of the CPU conv kernels), precision (what each precision sets),
loss (the loss, on-device normalisation), feeds (batches to the device), nvjpeg (JPEG decoding on
the GPU), training (the step, evaluation, the epoch loop, the compile policy), distributed (data
parallelism over local devices), counter (native op counter). docs/backends/torch.md describes them.
"""

from aiperf_backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
