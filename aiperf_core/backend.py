"""The backend contract. Every backend, first-party or a vendor's plugin, implements `Backend`.

A backend lowers the IR to its framework, moves canonical weights in and out, runs inference,
computes gradients, and trains one trial. It never counts the ops that are scored and never owns
the clock: the core counts (opcount) and times. Backends are found through the entry-point group
`aiperf.backends` (see aiperf_core.registry) and must import their framework lazily, inside methods,
so that listing backends never fails because one framework is missing.

Arrays crossing this interface are NumPy, in the IR's canonical layout: images NHWC, conv kernels
HWIO, dense kernels (in, out).
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import PARAMETRIC_OPS, Graph
from aiperf_core.weights import Weights, init_weights, validate_weights

PRECISIONS = ("fp32", "fp16", "bf16")  # fp16 and bf16 mean mixed precision with fp32 master weights


class BackendError(AiperfError):
    """A backend cannot do what was asked (missing framework, unsupported precision or device)."""


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str | None = None  # why not, when unavailable


@dataclass(frozen=True)
class Schedule:
    """Learning rate per epoch: `initial` decayed linearly to `final_fraction * initial` over `epochs`."""

    initial: float = 0.1
    final_fraction: float = 0.0
    warmup_epochs: int = 0

    def rate(self, epoch: int, epochs: int) -> float:
        if epoch < self.warmup_epochs:
            return self.initial * (epoch + 1) / (self.warmup_epochs + 1)
        span = max(epochs - self.warmup_epochs, 1)
        progress = (epoch - self.warmup_epochs) / span
        return self.initial * (1.0 - (1.0 - self.final_fraction) * progress)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int
    schedule: Schedule = field(default_factory=Schedule)
    momentum: float = 0.9
    label_smoothing: float = 0.0
    precision: str = "fp32"
    seed: int = 0


@dataclass(frozen=True)
class EpochReport:
    """What a backend reports after each epoch. Images are counted exactly, not estimated."""

    epoch: int
    train_images: int
    val_images: int
    loss: float
    val_loss: float
    val_accuracy: float
    skipped_images: int = 0  # training and validation images that could not be decoded (streamed data)
    step_seconds: float | None = None  # the epoch's wall seconds in train and eval steps (StepClock); None: not measured


class StepClock:
    """Wall seconds a backend spends in its train and eval steps, for EpochReport.step_seconds.

    A backend wraps, with `with clock:`, each step from the transfer of its batch to the device, and
    the calls that wait for step results (reading a loss sum, an evaluation's outputs); never the
    reading, decoding or indexing of batches on the host. With
    asynchronous dispatch (jax, GPUs) the wait for results is where the device time shows up, so the
    sum is a lower bound on the device's busy time: host work that overlaps a running step is not
    counted. The first step of a trial includes the framework's tracing or compilation, if any.
    Single-threaded: one clock per epoch loop. Diagnostic only: the report shows it, the score
    never reads it (the core keeps the clock that scores)."""

    __slots__ = ("seconds", "_start")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "StepClock":
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        self.seconds += time.perf_counter() - self._start
        return False

    def lap(self) -> float:
        """The seconds since the last lap (for one epoch's report), and start again from zero."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclass(frozen=True)
class Dataset:
    """In-memory arrays: images NHWC float32, labels int64 class indices.

    train() also accepts an aiperf_core.data.stream.StreamingDataset (images decoded and augmented
    while training, e.g. ImageNet); a backend tells the two apart with is_streaming(data)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    classes: int


EpochCallback = Callable[[EpochReport], bool | None]  # return True to stop training early


@dataclass(frozen=True)
class CounterConvention:
    """How a native op counter counts, so the kit compares like with like.

    mac_ops: ops per multiply-accumulate (2 when a MAC counts as a mul and an add).
    padding: 'paper' when padded taps are counted, 'valid' when only taps on real input are.
    covers: opcount categories the counter measures; the others it reports as 0 or leaves out.
    """

    mac_ops: int
    padding: str
    covers: tuple[str, ...]
    includes_update: bool = False  # whether a backward count contains the weight update
    notes: str = ""


class NativeCounter(abc.ABC):
    convention: CounterConvention

    @abc.abstractmethod
    def count(self, model: Any, batch: int, backward: bool) -> dict[str, int]:
        """Native ops per category for `batch` images, forward (and backward if asked)."""

    @staticmethod
    def counted_nodes(graph: Graph, backward: bool) -> Iterable[tuple[Any, bool]]:
        """(node, needs_input_grad) for each conv2d and dense node, in order, for counters that
        measure node by node. A node's input gradient is computed only when a parameter lies
        upstream of it (opcount's rule, so both sides count the same backward work)."""
        if backward and len(graph.output_shape) != 1:
            raise ValueError("a backward count needs a flat class output")
        upstream: dict[str, bool] = {}
        for node in graph.nodes:
            upstream[node.id] = any(upstream[i] or graph[i].op in PARAMETRIC_OPS for i in node.inputs)
            if node.op in ("conv2d", "dense"):
                yield node, upstream[node.id]


class Backend(abc.ABC):
    """One framework's implementation of the contract. Subclasses set `name`."""

    name: str = ""

    # -- discovery ----------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def availability(cls) -> Availability:
        """Whether the framework imports and works here; must not raise."""

    @abc.abstractmethod
    def framework_version(self) -> str: ...

    @abc.abstractmethod
    def devices(self) -> list[str]:
        """Local devices this backend would train on, e.g. ['cpu'] or ['cuda:0', 'cuda:1']."""

    _precisions_found: dict[tuple[str, str], tuple[str, ...]] = {}  # (backend, device) -> precisions

    def precisions(self) -> tuple[str, ...]:
        """Precisions the first local device supports, probed once per process; lower() rejects the others."""
        key = (self.name, self.devices()[0])
        if key not in Backend._precisions_found:
            mixed = tuple(p for p in ("bf16", "fp16") if self.runs_precision(key[1], p))
            Backend._precisions_found[key] = ("fp32",) + mixed
        return Backend._precisions_found[key]

    def runs_precision(self, device: str, precision: str) -> bool:
        """Whether `device` runs mixed `precision` natively (a short probe is fine). fp32 always runs."""
        return False

    # -- models -------------------------------------------------------------
    @abc.abstractmethod
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        """Build a framework model for `graph`. Without weights, initialise as init_weights does."""

    @abc.abstractmethod
    def export_weights(self, model: Any) -> Weights:
        """Canonical weights (float32 NumPy arrays, IR layout) of a lowered model."""

    @abc.abstractmethod
    def import_weights(self, model: Any, weights: Weights) -> None: ...

    # -- running a model: the arguments are checked here, once for every backend, so that bad input
    # gets the same one-line error everywhere; backends implement the *_checked methods below.
    def predict(self, model: Any, x: np.ndarray) -> np.ndarray:
        """Inference-mode output for a batch of NHWC images."""
        model = self.check_model(model)
        return self.predict_checked(model, check_input(model.graph, x))

    def loss_and_grads(self, model: Any, x: np.ndarray, labels: np.ndarray,
                       label_smoothing: float = 0.0) -> tuple[float, Weights]:
        """Training-mode mean cross-entropy and its gradients (trainable params, canonical layout).
        The model is left as it was: weights, moving statistics and any held gradients."""
        model = self.check_model(model)
        x = check_input(model.graph, x)
        labels = check_labels(model.graph, labels, len(x))
        check_label_smoothing(label_smoothing)
        return self.loss_and_grads_checked(model, x, labels, float(label_smoothing))

    def train(self, model: Any, data: Dataset, config: TrainConfig, on_epoch: EpochCallback | None = None) -> list[EpochReport]:
        """Train one trial: SGD with momentum, config.schedule per epoch, data parallel over devices().
        `data` is a Dataset or a StreamingDataset; EpochReport.train_images counts the images that
        were trained on (a streamed image that does not decode is skipped and counted in
        skipped_images); step_seconds is the epoch's time in train and eval steps, by a StepClock.
        Training stops after the epoch for which on_epoch returns True."""
        model = self.check_model(model)
        self.check_precision(config.precision)
        check_train_config(config)
        check_dataset(model.graph, data)
        return self.train_checked(model, data, config, on_epoch)

    def check_model(self, model: Any) -> Any:
        """`model` if this backend lowered it, else a BackendError that says what it got."""
        if not isinstance(model, self.model_type()):
            raise BackendError(f"not a model lowered by the {self.name} backend: {type(model).__name__}")
        return model

    @abc.abstractmethod
    def model_type(self) -> type:
        """The class of what lower() returns (import the framework here, not at module top)."""

    @abc.abstractmethod
    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        """predict() once its arguments are checked: x is float32 NHWC of the graph's input shape."""

    @abc.abstractmethod
    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        """loss_and_grads() once its arguments are checked: labels are int64 class indices."""

    @abc.abstractmethod
    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        """train() once the model, precision, config and dataset are checked."""

    def native_counter(self) -> NativeCounter | None:
        return None

    # -- helpers shared by every backend ------------------------------------
    @staticmethod
    def import_availability(module: str, extra: str) -> Availability:
        """Available if `module` imports; otherwise the import error and the install hint."""
        import importlib

        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return Availability(False, f"{module} is not installed: {detail} (pip install 'aiperf[{extra}]')")
        return Availability(True)

    def starting_weights(self, graph: Graph, weights: Weights | None, precision: str) -> Weights:
        """What lower() starts from: checked weights, or init_weights(seed=0) so every backend starts alike."""
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be an aiperf_core.ir.Graph, got {type(graph).__name__}")
        self.check_precision(precision)
        if weights is None:
            weights = init_weights(graph, seed=0)
        validate_weights(graph, weights)
        return weights

    def check_precision(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise BackendError(f"unknown precision '{precision}' (choose from {', '.join(PRECISIONS)})")
        if precision not in self.precisions():
            raise BackendError(
                f"backend '{self.name}' cannot run precision '{precision}' on {', '.join(self.devices())} "
                f"(supported: {', '.join(self.precisions())})"
            )


def cpu_flags() -> set[str]:
    """The host CPU's feature flags (/proc/cpuinfo on Linux; empty elsewhere): whether a CPU runs a
    precision natively (avx512_bf16, amx_bf16, avx512_fp16...) decides what a backend declares."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def batches(n: int, batch_size: int, rng: np.random.Generator | None = None) -> Iterable[np.ndarray]:
    """Index batches over n items, shuffled when rng is given; the last batch may be short."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def one_hot(labels: np.ndarray, classes: int, label_smoothing: float = 0.0, dtype=np.float32) -> np.ndarray:
    y = np.zeros((len(labels), classes), dtype)
    y[np.arange(len(labels)), labels] = 1
    if label_smoothing:
        y = y * (1 - label_smoothing) + label_smoothing / classes
    return y


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(probs, axis=-1) == labels)) if len(labels) else 0.0


def cross_entropy(probs: np.ndarray, labels: np.ndarray, label_smoothing: float = 0.0) -> float:
    y = one_hot(labels, probs.shape[-1], label_smoothing, np.float64)
    return float(-np.mean(np.sum(y * np.log(np.clip(probs.astype(np.float64), 1e-12, 1.0)), axis=-1)))


# -- argument checks every backend applies, so that bad input gets the same error everywhere --------


def check_input(graph: Graph, x) -> np.ndarray:
    arr = np.asarray(x)
    want = tuple(graph.input_shape)
    if arr.ndim != len(want) + 1 or tuple(arr.shape[1:]) != want:
        raise GraphError(f"input batch has shape {list(arr.shape)}, expected [N, {', '.join(map(str, want))}]",
                         graph.input_id)
    if arr.shape[0] < 1:
        raise GraphError("input batch is empty", graph.input_id)
    if arr.dtype.kind not in "fiu":
        raise GraphError(f"input batch must hold real numbers, got dtype {arr.dtype}", graph.input_id)
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_labels(graph: Graph, labels, n: int) -> np.ndarray:
    lab = np.asarray(labels)
    node = graph.output_id
    if len(graph.output_shape) != 1:
        raise GraphError(f"the loss needs a flat class output, got shape {list(graph.output_shape)}", node)
    classes = graph.output_shape[0]
    if lab.shape != (n,):
        raise GraphError(f"labels have shape {list(lab.shape)}, expected [{n}] (one class index per image)", node)
    if lab.dtype.kind not in "iu":
        raise GraphError(f"labels must be integer class indices, got dtype {lab.dtype}", node)
    if n and (lab.min() < 0 or lab.max() >= classes):
        raise GraphError(f"labels must lie in [0, {classes}), got values in [{lab.min()}, {lab.max()}]", node)
    return lab.astype(np.int64)


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_train_config(config: TrainConfig) -> None:
    if config.epochs < 0:
        raise BackendError(f"epochs must be >= 0, got {config.epochs}")
    if config.batch_size < 1:
        raise BackendError(f"batch_size must be >= 1, got {config.batch_size}")
    if not 0.0 <= config.label_smoothing <= 1.0:
        raise BackendError(f"label_smoothing must be in [0, 1], got {config.label_smoothing}")


def is_streaming(data) -> bool:
    """Whether `data` is a StreamingDataset rather than in-memory arrays (no import of aiperf_core.data
    needed: a streaming dataset is recognised by its epoch plan)."""
    return not isinstance(data, Dataset) and hasattr(data, "plan") and hasattr(data, "iterate")


def check_dataset(graph: Graph, data: Dataset) -> None:
    if is_streaming(data):
        _check_streaming(graph, data)
        return
    for xs, ys, what in ((data.x_train, data.y_train, "training"), (data.x_val, data.y_val, "validation")):
        if len(xs) != len(ys):
            raise BackendError(f"{what} set has {len(xs)} images but {len(ys)} labels")
        if len(xs):
            check_input(graph, xs[:1])
            check_labels(graph, np.asarray(ys), len(ys))
    if len(data.x_train) == 0:
        raise BackendError("the training set is empty")


def _check_streaming(graph: Graph, data) -> None:
    want = tuple(graph.input_shape)
    if tuple(data.image_shape) != want:
        raise GraphError(f"dataset '{data.name}' gives images of shape {list(data.image_shape)}, "
                         f"the graph expects {list(want)}", graph.input_id)
    if len(graph.output_shape) != 1 or graph.output_shape[0] != data.classes:
        raise GraphError(f"dataset '{data.name}' has {data.classes} classes, the graph outputs "
                         f"{list(graph.output_shape)}", graph.output_id)
    if data.train_images == 0:
        raise BackendError(f"dataset '{data.name}': split 'train' is empty")


def describe(backend_cls: type[Backend]) -> Mapping[str, Any]:
    """Version and devices of an available backend, for `aiperf backends`."""
    instance = backend_cls()
    return {"version": instance.framework_version(), "devices": instance.devices(),
            "precisions": list(instance.precisions())}
