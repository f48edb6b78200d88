"""The TensorFlow backend. tensorflow itself is imported only when the backend is used.

Modules: backend (the Backend subclass), lowering (IR -> tf.Module), training (loss, SGD step,
epoch loop), distributed (MirroredStrategy data parallelism), counter (native op counter: the TF
v1 profiler on a frozen graph).
"""

from aiperf_backends.tensorflow.backend import TensorFlowBackend

__all__ = ["TensorFlowBackend"]
