"""The MindSpore backend. mindspore itself is imported only when the backend is used.

Modules: backend (the Backend subclass), lowering (IR -> mindspore.nn.Cell), training (loss, SGD
step, epoch loop), distributed (data parallelism, one process per device; HCCL on Ascend),
counter (native op counter from MindSpore's own graph-mode FLOPs collection).
"""

from aiperf_backends.mindspore.backend import MindSporeBackend

__all__ = ["MindSporeBackend"]
