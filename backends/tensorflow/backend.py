"""TensorFlowBackend: the aiperf Backend contract on TensorFlow 2.

tensorflow is imported lazily, inside methods, so that `import aiperf_backends.tensorflow` and listing
backends work where it is not installed. `framework()` imports and configures it, once a process
(docs/backends/tensorflow.md has the measurements behind each setting):

* oneDNN: TF_ENABLE_ONEDNN_OPTS defaults to 1 on x86-64. TensorFlow's own default turns its oneDNN
  kernels on only for CPUs with AVX512-VNNI, AVX512-BF16, AVX-VNNI or AMX, and otherwise runs
  Eigen's convolutions, which trained ResNet-50 at 32x32 about 7x slower on a 2-core AMD EPYC
  (11 against 78 images/s). A user's own TF_ENABLE_ONEDNN_OPTS is kept.
* ONEDNN_DEFAULT_FPMATH_MODE other than STRICT would let oneDNN compute fp32 convolutions in bf16
  or TF32, so fp32 would not be IEEE fp32: the backend refuses to start with it (one line).
* threads: where OMP_NUM_THREADS is set (the local executor puts each CPU replica's share of the
  cores there), TensorFlow's intra-op and inter-op pools take that many threads, as TF itself
  would size them on a machine of that many cores; TF ignores the variable otherwise, and two
  replicas on one host would each start a pool as large as the host.
* AIPERF_CPU_DEVICES=N (the contract's CPU_DEVICES_ENV) with no GPU visible: the host CPU is split
  into N logical devices before TF's runtime starts, so that devices() lists 'cpu:0' ... 'cpu:N-1'
  and the data-parallel path can be certified on a CPU machine. A process whose TF runtime had
  already started gets a one-line error instead of a silently different device count.
* TF's C++ logging is quieted to warnings and errors (TF_CPP_MIN_LOG_LEVEL=1 unless set, or 0 under
  `aiperf --debug`: aiperf_core.registry.set_framework_logging), its Python logger to errors. The
  lines TF's C++ core logs through absl before absl logging is initialised ignore that variable;
  the first import drops those below it from its stderr (`_loading_tensorflow`).

The contract:

* devices: every logical GPU ('gpu:0', ...) when there is one, else every logical CPU ('cpu' when
  there is one, 'cpu:0', 'cpu:1', ... when there are several).
* precisions (probed per device: the hardware must run it natively and a small probe must train
  finitely): fp32 everywhere (TF32 execution off around every call, lowering.precision_scope);
  tf32 on CUDA GPUs of compute capability 8.0+; bf16 on GPUs of compute capability 8.0+ and on
  CPUs with AVX512-BF16 or AMX-BF16 (without them TF emulates bf16, slower than fp32); fp16 with
  dynamic loss scaling (training.LossScale) on GPUs of compute capability 7.0+, never on a CPU.
* train: TrainConfig.devices (default: every local device). One device trains directly, without a
  strategy (a model whose variables live on another device is trained as a copy there); several
  train data parallel with MirroredStrategy over exactly those devices and synchronised batch norm
  (distributed.py). Predict, evaluation and every batch run on the model's (or the first) device.
* TrainConfig.micro_batch (gradient accumulation) and checkpoint_blocks (tf.recompute_grad per
  block): training.py. Streamed text (a TokenStream) trains through the host feed, a global batch at
  a time.
* device_memory: a GPU's memory as TF's runtime sizes it (gpu_memory_limits; not yet run on a GPU),
  a CPU's share of RAM as the base class says.
* XLA: see lowering.use_xla (AIPERF_TF_XLA; unset: on GPUs, off on CPUs; a bad value is refused
  when the backend starts).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
import tempfile
from typing import Any

import numpy as np

from aiperf_core.backend import (CPU_DEVICES_ENV, Availability, Backend, BackendError, Dataset, EpochCallback,
                                 EpochReport, NativeCounter, Parallelism, TrainConfig, cpu_flags,
                                 requested_cpu_devices)
from aiperf_core.ir import ALL_OPS, Graph
from aiperf_core.registry import set_framework_logging
from aiperf_core.weights import Weights, init_weights

FPMATH_ENV = "ONEDNN_DEFAULT_FPMATH_MODE"
XLA_ENV = "AIPERF_TF_XLA"  # 1: jit_compile on every device; 0: never; unset: on GPUs only (lowering.use_xla)
_XLA_VALUES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False,
               "off": False}
_configured = False  # framework() has configured TensorFlow in this process


def xla_setting() -> bool | None:
    """AIPERF_TF_XLA as a choice (None when unset); a bad value is a one-line error."""
    raw = os.environ.get(XLA_ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in _XLA_VALUES:
        raise BackendError(f"{XLA_ENV} must be 1 or 0 (or unset: XLA on GPUs only), got '{raw}'")
    return _XLA_VALUES[raw]



def _environment_defaults() -> None:
    """What must be in the environment before TensorFlow's C++ core loads."""
    set_framework_logging()
    if platform.machine().lower() in ("x86_64", "amd64"):
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


# An absl log line: severity, MMDD, time (seconds since the epoch before absl is initialised), thread, file:line].
_ABSL_LINE = re.compile(rb"([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^\s\]]+:\d+\] ")
_ABSL_SEVERITIES = b"IWEF"  # TF_CPP_MIN_LOG_LEVEL's 0, 1, 2, 3
_ABSL_PREINIT_BANNER = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def kept_import_lines(captured: bytes, min_log_level: int) -> bytes:
    """What the import's stderr keeps: every line but absl's below `min_log_level`, and (from 1 up)
    absl's banner saying that it logs to stderr until initialised, a note on logging itself."""
    kept = []
    for line in captured.splitlines(keepends=True):
        found = _ABSL_LINE.match(line)
        if found and _ABSL_SEVERITIES.index(found.group(1)) < min_log_level:
            continue
        if min_log_level >= 1 and line.rstrip() == _ABSL_PREINIT_BANNER:
            continue
        kept.append(line)
    return b"".join(kept)


def _min_log_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0


@contextlib.contextmanager
def _loading_tensorflow():
    """Around a process's first `import tensorflow`: the environment TF's C++ core reads as it loads,
    and the import's stderr without the log lines TF_CPP_MIN_LOG_LEVEL is meant to drop.

    TensorFlow 2.21 logs the oneDNN notice ("oneDNN custom operations are on...", at INFO, from
    tensorflow/core/util/port.cc, once per library linking it: twice an import) through absl before
    absl logging is initialised, preceded each time by absl's banner. absl prints everything to
    stderr until then; TF_CPP_MIN_LOG_LEVEL does not reach it, and no other environment variable
    does. Turning oneDNN off would drop the notice and the speed it is there for (docs/backends/
    tensorflow.md), so instead the import's fd 2 (where C++ writes) goes to a temporary file and is
    written back less those lines: warnings, errors, Python warnings and tracebacks stay, only
    delayed until the import ends. A crash inside the import would lose what it wrote; at
    TF_CPP_MIN_LOG_LEVEL=0 (`aiperf --debug`) nothing is captured."""
    _environment_defaults()
    min_log_level = _min_log_level()
    saved = None
    if "tensorflow" not in sys.modules and min_log_level > 0:
        sys.stderr.flush()
        with contextlib.suppress(OSError):  # no stderr: nothing to filter
            saved = os.dup(2)
    if saved is None:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = memoryview(kept_import_lines(capture.read(), min_log_level))
            while kept:
                kept = kept[os.write(2, kept):]


def _omp_threads() -> int:
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        return max(int(raw), 0)
    except ValueError:
        return 0


def framework():
    """tensorflow, configured once a process (see the module's docstring)."""
    global _configured
    if not _configured:
        mode = os.environ.get(FPMATH_ENV, "").strip()
        if mode and mode.lower() != "strict":
            raise BackendError(f"{FPMATH_ENV}={mode} lets oneDNN compute fp32 convolutions in lower precision, so "
                               f"the tensorflow backend's fp32 would not be IEEE fp32: unset it (ask for precision "
                               f"bf16 instead)")
        xla_setting()  # a bad value fails here, before anything trains
        with _loading_tensorflow():
            import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        wanted = requested_cpu_devices()
        threads = _omp_threads()
        if threads:
            try:
                tf.config.threading.set_intra_op_parallelism_threads(threads)
                tf.config.threading.set_inter_op_parallelism_threads(threads)
            except RuntimeError:  # the runtime started before this backend did: its pools stay as they are
                pass
        if wanted > 1 and not tf.config.list_physical_devices("GPU"):
            cpu = tf.config.list_physical_devices("CPU")[0]
            try:
                tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * wanted)
            except RuntimeError:
                found = len(tf.config.list_logical_devices("CPU"))
                if found != wanted:
                    raise BackendError(f"{CPU_DEVICES_ENV}={wanted}, but TensorFlow's runtime already started with "
                                       f"{found} CPU device(s) (set the variable before the process first uses "
                                       f"TensorFlow)") from None
        _configured = True
    import tensorflow as tf

    return tf


def graph_function(fn=None, **options):
    """tf.function without AutoGraph (as a decorator when `fn` is None). The backend writes its traced
    code as graph TensorFlow already (tf.while_loop, tf.cond, tf.where; its Python branches and loops
    depend only on Python values), so AutoGraph would only rewrite the source of every Python function
    a trace calls, about 130 for a training step: seconds of every process's first traces (on 2 cores,
    `aiperf backends`, whose bf16 probe traces one, took 35.6 s with it and 20 to 25 s without)."""
    return framework().function(fn, autograph=False, **options)


def tf_device_name(device: str) -> str:
    """'cpu' -> '/device:CPU:0', 'gpu:1' -> '/device:GPU:1'."""
    kind, _, index = device.partition(":")
    return f"/device:{kind.upper()}:{index or 0}"


_gpu_memory: dict[str, int] | None = None


def gpu_memory_limits() -> dict[str, int]:
    """Bytes one process may use on each GPU ('/device:GPU:i'), read once a process: the device's
    total memory, times per_process_gpu_memory_fraction where the process set one, or a logical
    GPU's configured memory_limit.

    TensorFlow has no public call for it: tf.config.experimental.get_memory_info gives the bytes in
    use and their peak, get_device_details the name and compute capability. The runtime's device
    factory knows it, and device_lib.list_local_devices asks that factory again under a given
    config. Left at its default fraction (0) the factory would size a device by the memory free at
    the time of asking, which is next to nothing once TensorFlow's allocator has taken the device's
    memory; a fraction of 1 makes it the device's total instead. The factory reuses the process's
    allocators, so asking allocates no device memory. Not yet run on a GPU (docs/backends/
    tensorflow.md): an error reading it gives no figures (nothing is filtered), never a guess."""
    global _gpu_memory
    if _gpu_memory is None:
        framework()
        try:
            from tensorflow.python.client import device_lib
            from tensorflow.python.eager import context

            config = context.context().config  # a copy, with the process's logical devices
            if not config.gpu_options.per_process_gpu_memory_fraction:
                config.gpu_options.per_process_gpu_memory_fraction = 1.0
            _gpu_memory = {d.name: int(d.memory_limit) for d in device_lib.list_local_devices(config)
                           if d.device_type == "GPU" and d.memory_limit > 0}
        except Exception:  # private modules that may move
            _gpu_memory = {}
    return _gpu_memory


def _compute_capability(device: str) -> tuple[int, int]:
    tf = framework()
    index = int(device.partition(":")[2] or 0)
    try:
        gpu = tf.config.list_physical_devices("GPU")[index]
        return tuple(tf.config.experimental.get_device_details(gpu).get("compute_capability", (0, 0)))
    except Exception:  # no details (not CUDA): nothing is declared beyond fp32
        return (0, 0)


def runs_natively(device: str, precision: str) -> bool:
    """Whether the hardware of `device` runs `precision` natively (before any probe). On a CPU the
    contract has already required the precision's instructions (Backend._runs, CPU_NATIVE_FLAGS):
    of those, this backend offers bf16 only."""
    if device.startswith("gpu"):
        capability = _compute_capability(device)
        return capability >= {"tf32": (8, 0), "bf16": (8, 0), "fp16": (7, 0)}[precision]
    return precision == "bf16"  # tf32 is a CUDA tensor-core format; fp16 on a CPU is not offered


def _probe_precision(device: str, precision: str) -> bool:
    """Whether `precision` trains a tiny conv/BN/dense net on `device` with finite results."""
    if not runs_natively(device, precision):
        return False
    try:
        from aiperf_core.backend import Schedule
        from aiperf_core.builders import resnet_small
        from aiperf_backends.tensorflow.lowering import lower_graph
        from aiperf_backends.tensorflow.training import Trainer

        graph = resnet_small((8, 8, 3), 3)
        model = lower_graph(graph, init_weights(graph, 0), precision, device)
        trainer = Trainer(model, TrainConfig(epochs=1, batch_size=2, schedule=Schedule(0.01), precision=precision))
        rng = np.random.default_rng(0)
        batch = trainer.put(rng.normal(size=(2, 8, 8, 3)).astype(np.float32), np.array([0, 2]))
        loss = float(trainer.step(batch, 0.01))
        return bool(np.isfinite(loss)) and all(np.all(np.isfinite(v.numpy())) for v in model.trainables)
    except Exception:  # an unsupported dtype raises in many ways; it just is not declared
        return False


class TensorFlowBackend(Backend):
    name = "tensorflow"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        with _loading_tensorflow():  # the probe imports TF first
            return cls.import_availability("tensorflow", "tensorflow")

    def framework_version(self) -> str:
        return framework().__version__

    def devices(self) -> list[str]:
        tf = framework()
        gpus = tf.config.list_logical_devices("GPU")
        if gpus:
            return [f"gpu:{i}" for i in range(len(gpus))]
        cpus = tf.config.list_logical_devices("CPU")
        return ["cpu"] if len(cpus) <= 1 else [f"cpu:{i}" for i in range(len(cpus))]

    def device_model(self, device: str) -> str | None:
        if not device.startswith("gpu"):
            return super().device_model(device)
        tf = framework()
        gpu = tf.config.list_physical_devices("GPU")[int(device.partition(":")[2] or 0)]
        return tf.config.experimental.get_device_details(gpu).get("device_name")

    def device_memory(self, device: str) -> int | None:
        """A GPU: its memory as TensorFlow's runtime sizes it (gpu_memory_limits); None when that
        cannot be read. A CPU: the base class's share of RAM."""
        if not device.startswith("gpu"):
            return super().device_memory(device)
        return gpu_memory_limits().get(tf_device_name(device))

    def runs_precision(self, device: str, precision: str) -> bool:
        return _probe_precision(device, precision)

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        from aiperf_backends.tensorflow.peak import matmul_seconds

        return matmul_seconds(device, precision, size, repeats)

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True,
                           expert_parallel_why_not=("MirroredStrategy mirrors every variable on every device; "
                                                    "sharding experts would need per-device variables outside the "
                                                    "strategy and the experimental raw op CollectiveAllToAllV3, which"
                                                    " tf.distribute does not expose (docs/backends/tensorflow.md, "
                                                    "\"Expert parallelism\")"),
                           multi_node_why_not=("MirroredStrategy spans one process's devices; "
                                               "MultiWorkerMirroredStrategy with TF_CONFIG is not wired yet "
                                               "(docs/backends/tensorflow.md, \"Across nodes\")"),
                           notes="MirroredStrategy over the training devices with synchronised batch norm")

    def supported_ops(self) -> frozenset[str]:
        return ALL_OPS  # lowering.py lowers every op of the IR, forward and backward

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.tensorflow.counter import TFProfilerCounter

        return TFProfilerCounter()

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        weights = self.starting_weights(graph, weights, precision)
        framework()
        from aiperf_backends.tensorflow.lowering import lower_graph

        return lower_graph(graph, weights, precision, self.devices()[0])

    def model_type(self) -> type:
        from aiperf_backends.tensorflow.lowering import LoweredModel

        return LoweredModel

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        self.check_model(model).load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        tf = framework()
        from aiperf_backends.tensorflow.lowering import precision_scope
        from aiperf_backends.tensorflow.training import PREDICT_BATCH

        forward = model.predict_fn()
        with tf.device(tf_device_name(model.device)), precision_scope(model.precision):
            outputs = [forward(x[s:s + PREDICT_BATCH]).numpy() for s in range(0, len(x), PREDICT_BATCH)]
        return np.ascontiguousarray(np.concatenate(outputs), dtype=np.float32)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        tf = framework()
        from aiperf_backends.tensorflow.lowering import precision_scope
        from aiperf_backends.tensorflow.training import summed_loss

        # Training mode (batch statistics) but the moving statistics are returned, not assigned:
        # computing gradients never changes the model. Dropout masks are the NumPy reference's
        # for seed 0 (float64 draws in graph order), so the result is comparable.
        masks = _reference_masks(model.graph, len(x))
        with tf.device(tf_device_name(model.device)), precision_scope(model.precision):
            with tf.GradientTape() as tape:
                total, _, _ = summed_loss(model, tf.constant(x), tf.constant(labels), label_smoothing, True, masks)
                loss = total / labels.size  # the mean over every label: images, or every token
            grads = tape.gradient(loss, model.trainables) if model.trainables else []
        return float(loss), model.canonical_grads(grads)

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        devices = self.train_devices(config)
        # Train in the config's precision (the model's variables are float32 either way).
        saved = model.precision
        model.set_precision(config.precision)
        try:
            if len(devices) > 1:
                from aiperf_backends.tensorflow.distributed import train_data_parallel

                return train_data_parallel(model, data, config, devices, on_epoch)
            from aiperf_backends.tensorflow.training import train_one_device

            return train_one_device(model, data, config, devices[0], on_epoch)
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
