"""The backend contract. Every backend, first-party or a vendor's plugin, implements `Backend`.

A backend lowers the IR to its framework, moves canonical weights in and out, runs inference,
computes gradients, and trains one trial. It never counts the ops that are scored and never owns
the clock: the core counts (opcount) and times. Backends are found through the entry-point group
`aiperf.backends` (see aiperf_core.registry) and must import their framework lazily, inside methods,
so that listing backends never fails because one framework is missing.

Arrays crossing this interface are NumPy, in the IR's canonical layout: images NHWC, conv kernels
HWIO, dense kernels (in, out). A sequence graph (a `token_input`) takes integer token ids (N, S) and
its labels are one class per token, (N, S).

A backend declares the IR ops it lowers (Backend.supported_ops); the conformance kit reports a check
whose graph needs another op as unsupported, never as a pass, and a workload as certified only where
every one of its checks ran.
"""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.inventory import device_model, is_cpu_device
from aiperf_core.ir import ALL_OPS, TRAINED_OPS, VERSION_1_OPS, Graph, lowering_need  # noqa: F401 (ALL_OPS: for backends)
from aiperf_core.weights import Weights, init_weights, validate_weights
from aiperf_core.replica_layout import ReplicaLayout

# fp32: IEEE fp32 arithmetic everywhere (no TF32 behind the user's back). tf32: fp32 storage with
# convolutions and matrix products on TF32 tensor cores (CUDA compute capability 8.0+). bf16 and fp16:
# mixed precision with fp32 master weights (fp16 with loss scaling). A backend declares, per device,
# only the precisions that device runs natively and that pass a probe step (Backend.precisions).
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
MIXED_PRECISIONS = ("tf32", "bf16", "fp16")  # probed per device; fp32 always runs
# A run's default: the fastest declared precision on the run's device, measured by timing steps of
# the run's seed model at the start (aiperf_core.workflow.auto_precision).
AUTO_PRECISION = "auto"
# Where a device has several, fastest first by tensor-core throughput: Backend.fastest_precision's
# order, assumed without measuring (for listings and benchmarks; a run's `auto` measures).
ACCELERATOR_PRECISION_PREFERENCE = ("bf16", "fp16", "tf32", "fp32")
# The instructions a CPU needs to run a mixed precision natively, any one of them. Without them the
# frameworks still run it, by converting, several times slower than fp32 (torch's oneDNN bf16 on an
# AVX-512 Cascade Lake: 4.1x; fp16 on AVX512-FP16 without AMX-FP16: 25x, docs/backends/torch.md), so
# no backend declares it there (Backend._runs). tf32 is a CUDA tensor-core format: no CPU has it.
CPU_NATIVE_FLAGS = {"bf16": frozenset({"avx512_bf16", "amx_bf16"}), "fp16": frozenset({"amx_fp16"})}

# A backend that declares data parallelism exposes this many CPU devices (worker processes or
# logical devices) when the variable is set and no accelerator is present, so that its parallel
# path can be certified on a machine without accelerators (the kit's `parallel` level sets it in a
# child process). Read it once, when the backend first initialises its framework.
CPU_DEVICES_ENV = "AIPERF_CPU_DEVICES"



class BackendError(AiperfError):
    """A backend cannot do what was asked (missing framework, unsupported precision or device)."""


def requested_cpu_devices() -> int:
    """AIPERF_CPU_DEVICES as a count (0 when unset); a bad value is a one-line error."""
    import os

    raw = os.environ.get(CPU_DEVICES_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise BackendError(f"{CPU_DEVICES_ENV} must be a whole number of devices, got '{raw}'") from None
    if value < 1:
        raise BackendError(f"{CPU_DEVICES_ENV} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Availability:
    available: bool
    reason: str | None = None  # why not, when unavailable


SCHEDULE_SHAPES = ("linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """Learning rate per epoch: a linear warm-up over `warmup_epochs`, then `initial` decayed to
    `final_fraction * initial` over the remaining epochs, linearly or along a half cosine."""

    initial: float = 0.1
    final_fraction: float = 0.0
    warmup_epochs: int = 0
    shape: str = "linear"

    def rate(self, epoch: int, epochs: int) -> float:
        if epoch < self.warmup_epochs:
            return self.initial * (epoch + 1) / (self.warmup_epochs + 1)
        span = max(epochs - self.warmup_epochs, 1)
        progress = (epoch - self.warmup_epochs) / span
        if self.shape == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        return self.initial * (1.0 - (1.0 - self.final_fraction) * progress)


# sgd-momentum: torch.optim.SGD's v = momentum * v + g; w -= lr * v.
# adamw: torch.optim.AdamW's (Loshchilov and Hutter), bias-corrected, epsilon added to the root:
#   w *= 1 - lr * weight_decay   (matrices only: optim.is_decayed)
#   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
#   w -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + epsilon)
# grad_clip (either optimizer): every gradient scaled by min(1, grad_clip / (norm + 1e-6)), norm the
# 2-norm of all gradients together (torch.nn.utils.clip_grad_norm_), before the update.
OPTIMIZERS = ("sgd-momentum", "adamw")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int  # the global batch, over every device trained on
    schedule: Schedule = field(default_factory=Schedule)
    momentum: float = 0.9
    label_smoothing: float = 0.0
    precision: str = "fp32"
    seed: int = 0
    optimizer: str = "sgd-momentum"  # one of OPTIMIZERS; its update rule is written out above
    betas: tuple[float, float] = (0.9, 0.95)  # adamw's b1, b2
    weight_decay: float = 0.0  # adamw's decoupled decay
    adam_epsilon: float = 1e-8
    grad_clip: float | None = None  # the global gradient 2-norm's ceiling; None: no clipping
    # The devices to train on, a subset of Backend.devices() in its order; None: all of them. More
    # than one needs a backend whose parallelism() declares data parallelism.
    devices: tuple[str, ...] | None = None
    # Whether the training step is compiled (torch.compile, XLA, jit_compile): 'auto' is the
    # backend's documented rule (compile where the trial is long enough to pay for it), 'always' or
    # 'never' override it. The policy item `compile`.
    compile: str = "auto"
    # Gradient accumulation: the most samples one device takes through one forward and backward
    # pass. A device's shard of a global batch larger than this runs as consecutive micro-batches of
    # micro_batch samples (the last one short), whose gradients add up, each weighted by its share of
    # the global batch's samples (tokens, for a sequence graph), before the one update: the step
    # equals one on the whole batch (the kit's train level checks it). None: the whole shard at once.
    micro_batch: int | None = None
    # Activation checkpointing: keep only each of the graph's blocks' input (Graph.blocks) for the
    # backward pass and recompute the block's activations there. Gradients are those of plain
    # training (the kit's train level checks it); memory for activations falls from every block's to
    # one block's, for a third more forward work (not counted: the score counts the model's ops).
    checkpoint_blocks: bool = False
    # A mixture of experts' load-balancing loss (docs/search.md, "Load balance"), added to the training
    # loss with this coefficient alpha: for each moe node, alpha times the mean over the batch's sequences
    # of E sum_e f_e P_e, where f_e is the share of the sequence's S top_k (token, choice) assignments
    # that expert e received and P_e the mean over the sequence's tokens of the router's softmax
    # probability of e (over all E experts); f_e carries no gradient. Per sequence (DeepSeek-V3's
    # sequence-wise form), so that it adds up over micro-batches and devices as the cross-entropy does.
    # 1 at an even load. EpochReport.loss stays the cross-entropy alone. 0: no such loss.
    moe_aux_loss: float = 0.0
    # Expert parallelism (the policy item `expert_parallel`; docs/search.md, "Expert
    # parallelism"): on several devices, each moe node's E experts are split into contiguous blocks of
    # E / devices (`expert_shard`), one block per device, and a device holds only its own experts' weights
    # and optimizer state. Each device routes its shard's tokens, sends each (token, choice) assignment
    # to its expert's device by all-to-all, runs its experts on what it received, and sends the outputs
    # back by all-to-all; everything else stays data-parallel. Training equals one device's on the
    # combined batch (the kit's parallel/gpt_moe_expert_parallel_matches_one_device). It needs a
    # backend whose parallelism() declares expert_parallel and experts that divide by the devices
    # (`check_expert_parallel`); on one device it changes nothing.
    expert_parallel: bool = False
    # A replica across nodes (the policy item `nodes_per_replica`): this process's place in it and
    # where the nodes meet (aiperf_core.replica_layout). `devices` are then this node's devices, the
    # global batch is shared by every device of every node, and every node calls train() with the
    # same graph, weights, data and config; only node 0's on_epoch is called, and only its model
    # holds the trained weights afterwards. None: one node, `devices` are all there is. It needs a
    # backend whose parallelism() declares multi_node (`check_multi_node`).
    layout: ReplicaLayout | None = None


COMPILE_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Parallelism:
    """How a backend trains over several local devices (Backend.parallelism()).

    data_parallel: synchronous data parallelism: each device takes a contiguous shard of every
      global batch and the gradients are all-reduced every step, so that training on k devices
      equals training on one with the global batch (the kit's `parallel` level checks it).
    synchronized_batch_norm: training batch-norm statistics are those of the whole global batch.
    expert_parallel: a moe node's experts can be sharded over the devices (TrainConfig.expert_parallel).
    A backend that declares neither is certified as single-device, and `aiperf run` never gives it
    more than one device.
    """

    data_parallel: bool = False
    synchronized_batch_norm: bool = False
    # expert_parallel: TrainConfig.expert_parallel is implemented (it needs data_parallel). A data-parallel
    #   backend without it says why in `expert_parallel_why_not`, and refuses it on several devices.
    expert_parallel: bool = False
    expert_parallel_why_not: str = ""
    # multi_node: TrainConfig.layout with several nodes is implemented: the devices of every node
    #   train as one data-parallel (and, where declared, expert-parallel) group through the
    #   framework's own distributed runtime. A backend without it says why in `multi_node_why_not`
    #   and refuses such a layout before anything trains.
    multi_node: bool = False
    multi_node_why_not: str = ""
    notes: str = ""


SINGLE_DEVICE = Parallelism()


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
    # Seconds of this epoch spent tracing and compiling the step (torch.compile, XLA, jit_compile),
    # included in step_seconds; 0.0 when nothing was compiled, None when not measured.
    compile_seconds: float | None = None
    # Per moe node id: the (token, choice) assignments each of its experts received over the epoch's
    # training steps, E counts summing to the epoch's training tokens times top_k (the load-balance
    # figure); None when the graph has no moe node.
    expert_load: Mapping[str, tuple[int, ...]] | None = None
    # Wall seconds of the epoch's training and evaluation steps spent in the experts' all-to-all
    # exchanges (forward and backward, out and back), measured by the backend; None when no
    # all-to-all ran (one device, no moe node, or expert_parallel off). The bytes they moved are
    # analytic (opcount.communication.all_to_all_bytes): a backend never reports its own.
    all_to_all_seconds: float | None = None
    # Wall seconds of the epoch's training steps spent waiting on the data-parallel gradient all-reduce,
    # measured by the backend as its docs say (docs/backends/<name>.md); None when it cannot measure
    # them or none ran (one device). The bytes are analytic (opcount.communication.all_reduce_bytes).
    all_reduce_seconds: float | None = None
    # Wall seconds of the epoch spent outside its steps running collectives only to price the steps'
    # waits (a backend that times the all-reduce or the all-to-all apart from the steps: jax), compilation
    # excluded; None when none ran. Communication all the same, which an ideal network would have given
    # back: the run's network efficiency counts it with the waits (docs/scoring.md, "What the network
    # cost"), a trial's (over its time in steps) does not.
    pricing_seconds: float | None = None


class StepClock:
    """Wall seconds a backend spends in its train and eval steps, for EpochReport.step_seconds.

    A backend wraps, with `with clock:`, each step from the transfer of its batch to the device, and
    the calls that wait for step results (reading a loss sum, an evaluation's outputs); never the
    reading, decoding or indexing of batches on the host. With
    asynchronous dispatch (jax, GPUs) the wait for results is where the device time shows up, so the
    sum is a lower bound on the device's busy time: host work that overlaps a running step is not
    counted. The first step of a trial includes the framework's tracing or compilation, if any.
    Single-threaded: one clock per epoch loop. Diagnostic only: the report shows it, the score
    never reads it (the core keeps the clock that scores).

    Live progress: where the environment variable PROGRESS_FILE_ENV names a file (a replica sets it
    before it trains, and the processes a backend spawns inherit it), the clock writes its progress
    there, atomically and at most once every PROGRESS_INTERVAL_S: when the last step ended, the
    training images of the epoch so far (count()), and how long steps take. The replica's heartbeat
    carries it to the primary, which restarts a replica that stops making progress and shows live
    throughput (docs/workflow.md, "Stalls"). Without the variable nothing is written."""

    PROGRESS_FILE_ENV = "AIPERF_PROGRESS_FILE"
    PROGRESS_INTERVAL_S = 1.0

    __slots__ = ("seconds", "images", "_start", "_progress_file", "_steps", "_epoch_start", "_last_end",
                 "_train_end", "_first_step_s", "_first_step_end", "_longest_step_s", "_written", "_written_steps")

    def __init__(self) -> None:
        import os

        self.seconds = 0.0
        self.images = 0  # training images of the epoch so far (count())
        self._start = 0.0
        self._progress_file = os.environ.get(self.PROGRESS_FILE_ENV) or None
        self._steps = 0  # steps ended since the clock was made (one clock per trial and process)
        self._epoch_start: float | None = None  # wall time the epoch's first step began
        self._last_end: float | None = None  # wall time the last step ended
        self._train_end: float | None = None  # ... the last training step (one count() followed)
        self._first_step_s: float | None = None  # tracing and compilation included
        self._first_step_end: float | None = None
        self._longest_step_s = 0.0  # of the steps after the first
        self._written = float("-inf")  # monotonic time of the last progress write
        self._written_steps = -1  # steps the last write counted

    def __enter__(self) -> "StepClock":
        if self._progress_file is not None and self._epoch_start is None:
            self._epoch_start = time.time()
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        seconds = time.perf_counter() - self._start
        self.seconds += seconds
        if self._progress_file is not None and exc_type is None:  # a step that raised made no progress
            now = time.time()
            self._steps += 1
            if self._steps == 1:
                self._first_step_s, self._first_step_end = seconds, now
            else:
                self._longest_step_s = max(self._longest_step_s, seconds)
            self._last_end = now
            self._write_progress(force=self._steps == 1)  # the end of compilation shows at once
        return False

    def count(self, images: int) -> None:
        """After each training step: the images of the global batch it trained on (live progress;
        the report's train_images stays the backend's exact count)."""
        self.images += int(images)
        self._train_end = self._last_end  # a step that ends later is an evaluation step
        if self._progress_file is not None:  # a write at this step's end lacks its images: write again
            self._write_progress(force=self._written_steps == self._steps)

    def lap(self) -> float:
        """The seconds since the last lap (for one epoch's report), and start again from zero."""
        seconds, self.seconds, self.images = self.seconds, 0.0, 0
        self._epoch_start = None
        return seconds

    def _write_progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._last_end is None or (not force and now - self._written < self.PROGRESS_INTERVAL_S):
            return
        self._written, self._written_steps = now, self._steps
        import json
        import os

        from aiperf_core.atomic import write_text_atomic

        record = {"time": self._last_end, "train_time": self._train_end, "images": self.images,
                  "epoch_start": self._epoch_start,
                  "steps": self._steps, "first_step_s": self._first_step_s, "first_step_end": self._first_step_end,
                  "longest_step_s": self._longest_step_s, "pid": os.getpid()}
        try:
            write_text_atomic(self._progress_file, json.dumps(record) + "\n")
        except OSError:  # live progress must never stop training; the next write tries again
            pass


@dataclass(frozen=True)
class Dataset:
    """In-memory arrays: images NHWC float32 and labels int64 class indices (N,), or for a sequence
    graph token ids (N, S) and one label per token (N, S) (the next token, for a language model).

    train() also accepts streamed data, which a backend tells apart with is_streaming(data): an
    aiperf_core.data.stream.StreamingDataset (images decoded and augmented while training, e.g.
    ImageNet), or an aiperf_core.data.text_stream.TokenStream (a trial's text, new windows every
    epoch: is_token_stream(data)). Both cut epochs into batches with the same plan/load/iterate
    methods; an epoch of a TokenStream is data.train_images windows, not the whole split."""

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
    attention: how the counter counts causal attention's products: 'paper' when every one of the S x S
      scores is counted, masked or not, 'valid' when only the S(S+1)/2 pairs the mask keeps are; None
      when it follows `padding`. XLA, for one, skips padded taps but multiplies every score.
    """

    mac_ops: int
    padding: str
    covers: tuple[str, ...]
    includes_update: bool = False  # whether a backward count contains the weight update
    notes: str = ""
    attention: str | None = None

    def convention_for(self, category: str) -> str:
        """The opcount convention this counter's `category` count follows."""
        return (self.attention or self.padding) if category == "attention" else self.padding


class NativeCounter(abc.ABC):
    convention: CounterConvention

    @abc.abstractmethod
    def count(self, model: Any, batch: int, backward: bool) -> dict[str, int]:
        """Native ops per category for `batch` images, forward (and backward if asked)."""

    @staticmethod
    def counted_nodes(graph: Graph, backward: bool,
                      ops: tuple[str, ...] = ("conv2d", "dense")) -> Iterable[tuple[Any, bool]]:
        """(node, needs_input_grad) for each node of `ops`, in order, for counters that measure node
        by node. A node's input gradient is computed only when a trained parameter lies upstream of
        it (opcount's rule, so both sides count the same backward work)."""
        if backward and len(graph.output_shape) not in (1, 2):
            raise ValueError("a backward count needs a class output per sample or per position")
        upstream: dict[str, bool] = {}
        for node in graph.nodes:
            upstream[node.id] = any(upstream[i] or graph[i].op in TRAINED_OPS for i in node.inputs)
            if node.op in ops:
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

    def device_model(self, device: str) -> str | None:
        """The hardware model of `device`, as a submission's certification matches it: the host CPU's
        model for CPU devices; a backend that sees accelerators names them (None: it cannot tell)."""
        return device_model(device)

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        """Seconds of each of `repeats` dense (size x size) @ (size x size) products on `device` at
        `precision`, in the backend's own framework: `aiperf peak` (aiperf_core.submission.peak).
        `size` may also be a shape (m, k, n): an (m x k) @ (k x n) product, 2*m*k*n ops (a model's
        own GEMM shapes, as benchmarks/transformer_step.py measures its peak; matmul_shape reads
        either form). Inputs are made on the device once and one warm-up product runs before the
        clock starts; each repeat is timed from a synchronised device to a synchronised device.
        fp32 is IEEE fp32 (no TF32), tf32 lets fp32 products use TF32 units, bf16 and fp16
        multiply inputs of that dtype with the framework's default accumulation. Optional: a
        backend without it cannot measure a peak."""
        raise AiperfError(f"backend {self.name} cannot measure a peak")

    def probe_collectives(self, layout: ReplicaLayout, collectives: tuple[str, ...], sizes: list[int],
                          iterations: int, warmup: int, seconds_per_size: float) -> dict[str, Any] | None:
        """Time the collectives over every rank of `layout` (each node's devices, one rank each, its
        nodes met at layout's coordinator), with the framework's own collectives: `aiperf probe
        network` (aiperf_core.network.probe). Called once on every node. For each collective (names
        of network.probe.COLLECTIVES) and size in bytes, in the given order: one float32 buffer per
        rank of network.probe.element_count elements; one warm-up collective timed, its slowest
        rank's time read by every rank, and network.probe.iteration_plan's further warm-ups and
        timed iterations; each timed one started together on every rank (a barrier) and lasting
        until the rank's device has finished it. Returns on node 0 {"device": "cpu" | "cuda" | ...,
        "hosts": [host of node 0, ...], "ranks_per_node": R, "collectives": {name: [{"bytes": the
        buffer's bytes, "seconds": [per timed iteration, the slowest rank's]}, ...]}}, None on the
        other nodes. Optional: a backend without it cannot probe the network."""
        raise AiperfError(f"backend {self.name} cannot probe the network (aiperf probe network runs on torch and jax)")

    _probes: dict[tuple[str, str, str], bool] = {}  # (backend, device, precision) -> runs_precision

    def precisions(self, device: str | None = None) -> tuple[str, ...]:
        """Precisions `device` (default: the first local device) runs, probed once per process and
        device, in PRECISIONS order; lower() and train() reject the others."""
        device = device or self.devices()[0]
        return ("fp32",) + tuple(p for p in MIXED_PRECISIONS if self._runs(device, p))

    def _runs(self, device: str, precision: str) -> bool:
        """Whether `precision` is declared on `device`: on a CPU only where it has the instructions
        (cpu_runs_natively), and then, as on any device, where the backend's runs_precision says so.
        The CPU rule is the contract's, for every backend: none repeats it."""
        key = (self.name, device, precision)
        if key not in Backend._probes:
            native = not is_cpu_device(device) or cpu_runs_natively(precision)
            Backend._probes[key] = native and bool(self.runs_precision(device, precision))
        return Backend._probes[key]

    def runs_precision(self, device: str, precision: str) -> bool:
        """Whether `device` runs `precision` (one of MIXED_PRECISIONS) natively and a short probe step
        stays finite. fp32 always runs. tf32 only where the device has TF32 units (CUDA 8.0+). On a
        CPU it is asked only where the CPU has the precision's instructions (CPU_NATIVE_FLAGS): the
        backend adds its own checks (its framework's kernels, a probe step)."""
        return False

    def precision_preference(self, device: str) -> tuple[str, ...]:
        """Precisions fastest first on `device`, as assumed without measuring (fastest_precision).
        Accelerators: bf16, fp16, tf32, fp32. CPUs: fp32 first, except bf16 where the CPU has AMX
        tiles (on AVX512-BF16 alone oneDNN's bf16 convolutions are not faster than fp32)."""
        if is_cpu_device(device):
            return ("bf16", "fp32") if "amx_bf16" in cpu_flags() else ("fp32",)
        return ACCELERATOR_PRECISION_PREFERENCE

    def fastest_precision(self, device: str | None = None) -> str:
        """The precision assumed fastest on `device` (default: the first local device), without
        measuring: the first of precision_preference() that the device declares (fp32 when none is).
        For listings and benchmarks; a run's `auto` is measured (aiperf_core.workflow.auto_precision)."""
        device = device or self.devices()[0]
        # Probed in order of preference and no further: on a CPU that prefers fp32 nothing is probed.
        return next((p for p in self.precision_preference(device) if p == "fp32" or self._runs(device, p)), "fp32")

    def parallelism(self) -> Parallelism:
        """How this backend trains over several devices; SINGLE_DEVICE unless a backend says more."""
        return SINGLE_DEVICE

    def start_node(self, layout: ReplicaLayout) -> None:
        """Called once in each process of a replica across nodes (every node's, the leader's too),
        before any other call that touches a device, with its place in the replica and the launch's
        coordinator: node 0's address and a port it keeps for the life of the launch. A runtime that
        needs one coordination service for the life of a process (jax.distributed) starts it here;
        devices() then still names this node's devices. Each trial's layout (TrainConfig.layout)
        carries a port of the trial's own, for a runtime that meets afresh per trial (torch's TCP
        store). Default: nothing to start."""

    def device_memory(self, device: str) -> int | None:
        """Bytes of memory one trial may use on `device`, for the memory estimate that filters grown
        children (opcount.memory): an accelerator's own memory (a backend that sees accelerators
        overrides this; None: it cannot tell, and nothing is filtered); on a CPU, the replica's share
        of the node's RAM (cpu_share_of_ram)."""
        return cpu_share_of_ram(len(self.devices())) if is_cpu_device(device) else None

    def supported_ops(self) -> frozenset[str]:
        """The IR ops this backend lowers, forward and backward, at every precision it declares.
        Default: the CNN ops of the IR's first version, so that a plugin written before the sequence
        ops keeps certifying for the CNN workload and the kit reports the others as unsupported.
        lower() refuses a graph with another op, naming the node (check_ops)."""
        return VERSION_1_OPS

    def check_ops(self, graph: Graph) -> None:
        """A BackendError naming the first node whose op this backend does not lower."""
        supported = self.supported_ops()
        for node in graph.nodes:
            need = lowering_need(node)
            if need not in supported:
                raise GraphError(f"backend '{self.name}' does not lower '{need}' (it declares: "
                                 f"{', '.join(sorted(supported))})", node.id)

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
        """Inference-mode output for a batch of NHWC images, or of token ids (N, S)."""
        model = self.check_model(model)
        return self.predict_checked(model, check_input(model.graph, x))

    def loss_and_grads(self, model: Any, x: np.ndarray, labels: np.ndarray,
                       label_smoothing: float = 0.0) -> tuple[float, Weights]:
        """Training-mode mean cross-entropy (over images, or over every token of a sequence graph) and
        its gradients (trainable params, canonical layout).
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
        self.check_devices(config.devices)
        check_multi_node(self, config)
        check_expert_parallel(self, model.graph, config, train_world(self, config))
        check_dataset(model.graph, data)
        return self.train_checked(model, data, config, on_epoch)

    def train_devices(self, config: TrainConfig) -> list[str]:
        """The devices a checked config trains on: config.devices, else every local device."""
        return list(config.devices) if config.devices else list(self.devices())

    def check_devices(self, devices: tuple[str, ...] | None) -> None:
        if devices is None:
            if len(self.devices()) > 1 and not self.parallelism().data_parallel:
                raise BackendError(f"backend '{self.name}' trains on one device only (it declares no data "
                                   f"parallelism), but {len(self.devices())} are visible: "
                                   f"{', '.join(self.devices())}")
            return
        local = list(self.devices())
        if not devices:
            raise BackendError("TrainConfig.devices: empty (give None for every local device)")
        unknown = [d for d in devices if d not in local]
        if unknown or len(set(devices)) != len(devices):
            raise BackendError(f"TrainConfig.devices: {', '.join(devices)} is not a subset of backend "
                               f"'{self.name}''s devices ({', '.join(local)})")
        if len(devices) > 1 and not self.parallelism().data_parallel:
            raise BackendError(f"backend '{self.name}' trains on one device only (it declares no data "
                               f"parallelism); asked for {len(devices)}")

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
        """predict() once its arguments are checked: x is float32 NHWC of the graph's input shape, or
        int64 token ids (N, S) below the graph's vocab."""

    @abc.abstractmethod
    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        """loss_and_grads() once its arguments are checked: labels are int64 class indices, (N,) or
        (N, S) per position of a sequence output (N, S, classes)."""

    @abc.abstractmethod
    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        """train() once the model, precision, config and dataset are checked."""

    def native_counter(self) -> NativeCounter | None:
        return None

    # -- helpers shared by every backend ------------------------------------
    @classmethod
    def import_availability(cls, module: str, extra: str | None = None) -> Availability:
        """Available if `module` imports; otherwise the import error and an install hint that names
        the distribution registering this backend (aiperf_core.entry_points.install_hint): `aiperf[extra]`
        for a first-party backend, the plugin's own distribution (with `extra` if given) for a plugin."""
        import importlib

        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything else
            from aiperf_core.entry_points import install_hint

            detail = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return Availability(False, f"{module} is not installed: {detail} ({install_hint(cls, module, extra)})")
        return Availability(True)

    def starting_weights(self, graph: Graph, weights: Weights | None, precision: str) -> Weights:
        """What lower() starts from: checked weights, or init_weights(seed=0) so every backend starts alike."""
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be an aiperf_core.ir.Graph, got {type(graph).__name__}")
        self.check_ops(graph)
        self.check_precision(precision)
        if weights is None:
            weights = init_weights(graph, seed=0)
        validate_weights(graph, weights)
        return weights

    def check_precision(self, precision: str, device: str | None = None) -> None:
        if precision not in PRECISIONS:
            raise BackendError(f"unknown precision '{precision}' (choose from {', '.join(PRECISIONS)})")
        device = device or self.devices()[0]
        if precision not in self.precisions(device):
            raise BackendError(
                f"backend '{self.name}' cannot run precision '{precision}' on {device} "
                f"(supported: {', '.join(self.precisions(device))})"
            )


def cpu_flags() -> set[str]:
    """The host CPU's feature flags (/proc/cpuinfo on Linux; empty elsewhere): whether a CPU runs a
    precision natively (cpu_runs_natively) decides what a backend declares."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()



REPLICAS_PER_NODE_ENV = "AIPERF_REPLICAS_PER_NODE"


def cpu_share_of_ram(devices: int = 1) -> int:
    """One CPU device's share of this node's RAM: the total over the replicas the executor started on
    this node (AIPERF_REPLICAS_PER_NODE, 1 when unset) and over the replica's CPU devices."""
    import os

    import psutil

    try:
        replicas = max(1, int(os.environ.get(REPLICAS_PER_NODE_ENV, "1")))
    except ValueError:
        raise BackendError(f"{REPLICAS_PER_NODE_ENV} must be a whole number, got "
                           f"{os.environ[REPLICAS_PER_NODE_ENV]!r}") from None
    return int(psutil.virtual_memory().total // (replicas * max(1, devices)))


def matmul_shape(size: int | tuple[int, int, int] | list[int]) -> tuple[int, int, int]:
    """(m, k, n) of a product that Backend.matmul_seconds times: a square size n is (n, n, n), a
    shape (m, k, n) is an (m x k) @ (k x n) product. BackendError unless every side is a positive
    whole number."""
    try:
        shape = (size,) * 3 if isinstance(size, int) and not isinstance(size, bool) else tuple(size)
    except TypeError:
        shape = ()
    if len(shape) != 3 or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
        raise BackendError(f"a matrix product is a positive size n or a shape (m, k, n), got {size!r}")
    return shape


def cpu_runs_natively(precision: str) -> bool:
    """Whether this host's CPU has the instructions for `precision` (CPU_NATIVE_FLAGS; fp32 always)."""
    if precision == "fp32":
        return True
    return bool(CPU_NATIVE_FLAGS.get(precision, frozenset()) & cpu_flags())

def batches(n: int, batch_size: int, rng: np.random.Generator | None = None) -> Iterable[np.ndarray]:
    """Index batches over n items, shuffled when rng is given; the last batch may be short."""
    order = rng.permutation(n) if rng is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


def one_hot(labels: np.ndarray, classes: int, label_smoothing: float = 0.0, dtype=np.float32) -> np.ndarray:
    """Labels of any shape, (N,) per image or (N, S) per token, as one-hot rows on a last axis."""
    labels = np.asarray(labels)
    y = np.zeros(labels.shape + (classes,), dtype)
    np.put_along_axis(y, labels[..., None], 1, axis=-1)
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
    """x as float32 images, or as int64 token ids for a sequence graph; a one-line GraphError if not."""
    arr = np.asarray(x)
    want = tuple(graph.input_shape)
    if arr.ndim != len(want) + 1 or tuple(arr.shape[1:]) != want:
        raise GraphError(f"input batch has shape {list(arr.shape)}, expected [N, {', '.join(map(str, want))}]",
                         graph.input_id)
    if arr.shape[0] < 1:
        raise GraphError("input batch is empty", graph.input_id)
    if graph.takes_tokens:
        if arr.dtype.kind not in "iu":
            raise GraphError(f"token ids must be integers, got dtype {arr.dtype}", graph.input_id)
        if arr.min() < 0 or arr.max() >= graph.vocab:
            raise GraphError(f"token ids must lie in [0, {graph.vocab}), got values in [{arr.min()}, {arr.max()}]",
                             graph.input_id)
        return np.ascontiguousarray(arr, dtype=np.int64)
    if arr.dtype.kind not in "fiu":
        raise GraphError(f"input batch must hold real numbers, got dtype {arr.dtype}", graph.input_id)
    return np.ascontiguousarray(arr, dtype=np.float32)


def check_labels(graph: Graph, labels, n: int) -> np.ndarray:
    """Labels as int64 class indices: (n,), one per image, or (n, S), one per token."""
    lab = np.asarray(labels)
    node = graph.output_id
    if len(graph.output_shape) not in (1, 2):
        raise GraphError(f"the loss needs a class output per sample (classes) or per position (S, classes), "
                         f"got shape {list(graph.output_shape)}", node)
    classes = graph.output_shape[-1]
    shape = (n,) + tuple(graph.output_shape[:-1])
    if lab.shape != shape:
        what = "one class index per position" if len(shape) == 2 else "one class index per image"
        raise GraphError(f"labels have shape {list(lab.shape)}, expected {list(shape)} ({what})", node)
    if lab.dtype.kind not in "iu":
        raise GraphError(f"labels must be integer class indices, got dtype {lab.dtype}", node)
    if n and (lab.min() < 0 or lab.max() >= classes):
        raise GraphError(f"labels must lie in [0, {classes}), got values in [{lab.min()}, {lab.max()}]", node)
    return lab.astype(np.int64)


def check_label_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_train_config(config: TrainConfig) -> None:
    if config.compile not in COMPILE_MODES:
        raise BackendError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {config.compile!r}")
    if config.epochs < 0:
        raise BackendError(f"epochs must be >= 0, got {config.epochs}")
    if config.batch_size < 1:
        raise BackendError(f"batch_size must be >= 1, got {config.batch_size}")
    if not 0.0 <= config.label_smoothing <= 1.0:
        raise BackendError(f"label_smoothing must be in [0, 1], got {config.label_smoothing}")
    if config.optimizer not in OPTIMIZERS:
        raise BackendError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {config.optimizer!r}")
    if config.schedule.shape not in SCHEDULE_SHAPES:
        raise BackendError(f"schedule.shape must be one of {', '.join(SCHEDULE_SHAPES)}, got {config.schedule.shape!r}")
    if len(config.betas) != 2 or not all(0.0 <= b < 1.0 for b in config.betas):
        raise BackendError(f"betas must be two numbers in [0, 1), got {config.betas!r}")
    if config.weight_decay < 0.0 or not config.adam_epsilon > 0.0:
        raise BackendError(f"weight_decay must be >= 0 and adam_epsilon > 0, got {config.weight_decay} and "
                           f"{config.adam_epsilon}")
    if config.grad_clip is not None and not config.grad_clip > 0.0:
        raise BackendError(f"grad_clip must be > 0 or None, got {config.grad_clip}")
    if config.micro_batch is not None and config.micro_batch < 1:
        raise BackendError(f"micro_batch must be >= 1 or None, got {config.micro_batch}")
    if not (math.isfinite(config.moe_aux_loss) and config.moe_aux_loss >= 0.0):
        raise BackendError(f"moe_aux_loss must be a finite number >= 0, got {config.moe_aux_loss}")


def expert_shard(experts: int, devices: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the experts device `rank` of `devices` holds under expert parallelism: contiguous
    blocks of experts / devices, in device order (check_expert_parallel has made sure they divide)."""
    per = experts // devices
    return rank * per, (rank + 1) * per


def train_world(backend: "Backend", config: TrainConfig) -> int:
    """Every device a checked config trains on, on every node of its replica."""
    local = len(backend.train_devices(config))
    return local * config.layout.nodes if config.layout is not None else local


def check_multi_node(backend: "Backend", config: TrainConfig) -> None:
    """Refuse, before anything trains, a layout of several nodes that the backend does not declare
    (quoting its reason), or whose devices per node are not this node's devices."""
    layout = config.layout
    if layout is None or not layout.multi_node:
        return
    declared = backend.parallelism()
    if not declared.multi_node:
        why = f": {declared.multi_node_why_not}" if declared.multi_node_why_not else ""
        raise BackendError(f"backend '{backend.name}' does not train a replica across nodes{why}")
    local = len(backend.train_devices(config))
    if local != layout.devices_per_node:
        raise BackendError(f"TrainConfig.layout: {layout.devices_per_node} device(s) per node, but this node "
                           f"({layout.host(layout.node_rank)}) trains on {local}")


def check_expert_parallel(backend: "Backend", graph: Graph, config: TrainConfig, devices: int) -> bool:
    """Whether training `graph` with `config` on `devices` devices runs expert-parallel: expert_parallel
    is set, there are several devices and a moe node. Raises BackendError before anything trains when
    the backend does not declare it (with its reason), and GraphError naming the first moe node whose
    experts do not divide by the devices."""
    if not config.expert_parallel or devices < 2:
        return False
    moe = [node for node in graph.nodes if node.op == "moe"]
    if not moe:
        return False
    declared = backend.parallelism()
    if not declared.expert_parallel:
        why = f": {declared.expert_parallel_why_not}" if declared.expert_parallel_why_not else ""
        raise BackendError(f"backend '{backend.name}' does not implement expert parallelism{why}")
    for node in moe:
        if node.attrs["experts"] % devices:
            raise GraphError(f"expert parallelism over {devices} devices needs experts that divide by them, "
                             f"the node has {node.attrs['experts']}", node.id)
    return True


def micro_batches(length: int, micro_batch: int | None) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch of a device's shard of `length` samples (TrainConfig.micro_batch):
    consecutive, micro_batch samples each, the last one short; the whole shard when micro_batch is
    None or not smaller. A backend weights micro-batch k's mean loss by (stop - start) / the global
    batch's samples, so that the sum of the gradients is the whole batch's."""
    if micro_batch is None or micro_batch >= length:
        return [(0, length)]
    return [(start, min(start + micro_batch, length)) for start in range(0, length, micro_batch)]


def is_streaming(data) -> bool:
    """Whether `data` is streamed (a StreamingDataset of images, or a TokenStream of a trial's text)
    rather than in-memory arrays (no import of aiperf_core.data needed: streamed data is recognised
    by its epoch plan)."""
    return not isinstance(data, Dataset) and hasattr(data, "plan") and hasattr(data, "iterate")


def is_token_stream(data) -> bool:
    """Whether `data` is streamed text (aiperf_core.data.text_stream.TokenStream): batches of int32
    token ids (n, seq_len) and the next token of each, nothing to decode, normalise or skip."""
    return is_streaming(data) and getattr(data, "tokens", False) is True


def check_dataset(graph: Graph, data: Dataset) -> None:
    if is_streaming(data):
        _check_streaming(graph, data)
        return
    for xs, ys, what in ((data.x_train, data.y_train, "training"), (data.x_val, data.y_val, "validation")):
        if len(xs) != len(ys):
            raise BackendError(f"{what} set has {len(xs)} samples but {len(ys)} labels")
        if graph.takes_tokens and np.asarray(xs).dtype not in (np.int32, np.int64):
            raise BackendError(f"{what} set: token ids must be int32 or int64 (uint8 is read as pixels), "
                               f"got {np.asarray(xs).dtype}")
        if len(xs):
            check_input(graph, xs[:1])
            check_labels(graph, np.asarray(ys), len(ys))
    if len(data.x_train) == 0:
        raise BackendError("the training set is empty")


def _check_streaming(graph: Graph, data) -> None:
    if is_token_stream(data) or graph.takes_tokens:
        _check_token_stream(graph, data)
        return
    want = tuple(graph.input_shape)
    if tuple(data.image_shape) != want:
        raise GraphError(f"dataset '{data.name}' gives images of shape {list(data.image_shape)}, "
                         f"the graph expects {list(want)}", graph.input_id)
    if len(graph.output_shape) != 1 or graph.output_shape[0] != data.classes:
        raise GraphError(f"dataset '{data.name}' has {data.classes} classes, the graph outputs "
                         f"{list(graph.output_shape)}", graph.output_id)
    if data.train_images == 0:
        raise BackendError(f"dataset '{data.name}': split 'train' is empty")


def _check_token_stream(graph: Graph, data) -> None:
    if not graph.takes_tokens:
        raise GraphError(f"dataset '{data.name}' streams token ids; the graph reads images", graph.input_id)
    if not is_token_stream(data):
        raise GraphError(f"dataset '{data.name}' streams images; the graph reads token ids", graph.input_id)
    if (data.seq_len,) != tuple(graph.input_shape):
        raise GraphError(f"dataset '{data.name}' streams windows of {data.seq_len} tokens, the graph reads "
                         f"{list(graph.input_shape)}", graph.input_id)
    if data.vocab > graph.vocab or graph.output_shape[-1] != data.vocab:
        raise GraphError(f"dataset '{data.name}' has a vocabulary of {data.vocab}, the graph reads "
                         f"{graph.vocab} and predicts {graph.output_shape[-1]}", graph.output_id)
    if data.train_images == 0:
        raise BackendError(f"dataset '{data.name}': split 'train' is empty")


def describe(backend_cls: type[Backend]) -> Mapping[str, Any]:
    """Version and devices of an available backend, for `aiperf backends`."""
    instance = backend_cls()
    return {"version": instance.framework_version(), "devices": instance.devices(),
            "precisions": list(instance.precisions()), "fastest_precision": instance.fastest_precision(),
            "data_parallel": instance.parallelism().data_parallel,
            "expert_parallel": instance.parallelism().expert_parallel}
