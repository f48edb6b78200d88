"""The TensorFlow backend. tensorflow itself is imported only when the backend is used.

Modules: backend (the Backend subclass; framework(), which configures TF once a process), lowering
(IR -> tf.Module, the precision scope, the XLA policy), training (loss, SGD step, the feeds that put
batches on the device, epoch loop, tf.data), distributed (MirroredStrategy data parallelism),
counter (native op counter: the TF v1 profiler on a frozen graph). docs/backends/tensorflow.md
describes them.
"""

from aiperf_backends.tensorflow.backend import TensorFlowBackend

__all__ = ["TensorFlowBackend"]
