"""TensorFlowBackend: the aiperf Backend contract on TensorFlow 2.

tensorflow is imported lazily, inside methods, so that `import aiperf_backends.tensorflow` and listing
backends work where it is not installed. TF's C++ logging is quieted to warnings and errors
(TF_CPP_MIN_LOG_LEVEL=1 unless set; errors are never hidden), TF's Python logger to errors.

* devices: every logical GPU ('gpu:0', ...) when there is one, else every logical CPU ('cpu' when
  there is one, 'cpu:0', 'cpu:1', ... when the process configured several logical CPUs).
* precisions: fp32, plus mixed bf16 / fp16 (fp32 variables, manual casts, see lowering.py) only
  where the first device runs them natively and a small probe trains finitely: on a GPU, bf16
  where the device is Ampere or newer and fp16 never (no loss scaling is implemented); on a CPU,
  bf16 where it has AVX512-BF16 or AMX-BF16 (without them TF emulates bf16, slower than fp32) and
  fp16 never.
* train: one device trains directly; several train data parallel with MirroredStrategy and
  synchronised batch norm (see distributed.py).
* XLA: set AIPERF_TF_XLA=1 to compile the forward and the single-device train step with
  jit_compile. Off by default: on CPU (TF 2.21, 2 cores) it made ResNet-50 training 0.65x as fast
  as the hand-written Keras model, against 1.00x without it (benchmarks/tensorflow_throughput.py).
* Logging: TF_CPP_MIN_LOG_LEVEL defaults to 1 (INFO dropped; warnings and errors kept). A few lines
  TF's C++ core prints before absl logging is initialised (oneDNN and CPU-feature notices at
  import) ignore it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from aiperf_core.backend import (Availability, Backend, Dataset, EpochCallback, EpochReport, NativeCounter,
                                 Parallelism, TrainConfig, cpu_flags)
from aiperf_core.ir import Graph
from aiperf_core.weights import Weights, init_weights



def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # drop INFO lines, keep warnings and errors
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    return tf


def tf_device_name(device: str) -> str:
    """'cpu' -> '/device:CPU:0', 'gpu:1' -> '/device:GPU:1'."""
    kind, _, index = device.partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


def _native(device: str, precision: str) -> bool:
    tf = _tf()
    if device.startswith("gpu"):
        if precision != "bf16":
            return False
        try:
            details = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])
            return tuple(details.get("compute_capability", (0, 0))) >= (8, 0)
        except Exception:
            return False
    if precision == "bf16":
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    return False


def _probe_precision(device: str, precision: str) -> bool:
    """Whether mixed `precision` trains a tiny conv/BN/dense net on `device`, with finite results."""
    if not _native(device, precision):
        return False
    try:
        from aiperf_core.builders import resnet_small
        from aiperf_core.backend import Schedule
        from aiperf_backends.tensorflow.lowering import lower_graph
        from aiperf_backends.tensorflow.training import Trainer

        graph = resnet_small((8, 8, 3), 3)
        model = lower_graph(graph, init_weights(graph, 0), precision)
        trainer = Trainer(model, TrainConfig(epochs=1, batch_size=2, schedule=Schedule(0.01), precision=precision))
        rng = np.random.default_rng(0)
        loss = float(trainer.step(rng.normal(size=(2, 8, 8, 3)).astype(np.float32), np.array([0, 2]), 0.01))
        return bool(np.isfinite(loss)) and all(np.all(np.isfinite(v.numpy())) for v in model.trainables)
    except Exception:  # an unsupported dtype raises in many ways; it just is not declared
        return False


class TensorFlowBackend(Backend):
    name = "tensorflow"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # as _tf(): the probe imports TF first
        return cls.import_availability("tensorflow", "tensorflow")

    def framework_version(self) -> str:
        return _tf().__version__

    def devices(self) -> list[str]:
        tf = _tf()
        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            return [f"gpu:{i}" for i in range(len(gpus))]
        cpus = tf.config.list_logical_devices("CPU")
        return ["cpu"] if len(cpus) <= 1 else [f"cpu:{i}" for i in range(len(cpus))]

    def runs_precision(self, device: str, precision: str) -> bool:
        return _probe_precision(device, precision)

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True,
                           notes="MirroredStrategy with synchronised batch norm")

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.tensorflow.counter import TFProfilerCounter

        return TFProfilerCounter()

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        weights = self.starting_weights(graph, weights, precision)
        tf = _tf()
        from aiperf_backends.tensorflow.lowering import lower_graph

        with tf.device(tf_device_name(self.devices()[0])):
            return lower_graph(graph, weights, precision)

    def model_type(self) -> type:
        from aiperf_backends.tensorflow.lowering import LoweredModel

        return LoweredModel

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        self.check_model(model).load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        from aiperf_backends.tensorflow.training import PREDICT_BATCH

        outputs = [model.predict_fn(x[s:s + PREDICT_BATCH]).numpy() for s in range(0, len(x), PREDICT_BATCH)]
        return np.ascontiguousarray(np.concatenate(outputs), dtype=np.float32)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        tf = _tf()
        from aiperf_backends.tensorflow.training import summed_loss

        # Training mode (batch statistics) but the moving statistics are returned, not assigned:
        # computing gradients never changes the model. Dropout masks are the NumPy reference's
        # for seed 0 (float64 draws in graph order), so the result is comparable.
        masks = _reference_masks(model.graph, len(x))
        with tf.GradientTape() as tape:
            total, _, _ = summed_loss(model, tf.constant(x), tf.constant(labels), label_smoothing, True, masks)
            loss = total / len(x)
        grads = tape.gradient(loss, model.trainables) if model.trainables else []
        return float(loss), model.canonical_grads(grads)

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        devices = self.devices()
        # Train in the config's precision (the model's variables are float32 either way).
        saved = model.precision
        model.set_precision(config.precision)
        try:
            if len(devices) > 1:
                from aiperf_backends.tensorflow.distributed import train_data_parallel

                return train_data_parallel(model, data, config, devices, on_epoch)
            from aiperf_backends.tensorflow.training import Trainer, run_epochs

            with _tf().device(tf_device_name(devices[0])):
                return run_epochs(Trainer(model, config), data, config, on_epoch)
        finally:
            model.set_precision(saved)


def _reference_masks(graph: Graph, n: int) -> dict[str, np.ndarray] | None:
    ids = [node for node in graph.nodes if node.op == "dropout" and node.attrs["rate"] > 0]
    if not ids:
        return None
    rng = np.random.default_rng(0)
    masks = {}
    for node in ids:
        rate = node.attrs["rate"]
        shape = (n,) + tuple(graph.shapes[node.inputs[0]])
        masks[node.id] = np.where(rng.random(shape) >= rate, 1.0 / (1.0 - rate), 0.0).astype(np.float32)
    return masks
