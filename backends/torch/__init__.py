"""The PyTorch backend. torch itself is imported only when the backend is used.

Modules: backend (the Backend subclass), lowering (IR -> torch.nn.Module), training (loss, SGD
step, epoch loop), distributed (data parallelism over local devices), counter (native op counter).
"""

from aiperf_backends.torch.backend import TorchBackend

__all__ = ["TorchBackend"]
