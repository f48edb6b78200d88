"""The benchmark's rules and training policy: paper Table 4, each item fixed or customizable.

One place holds every default, for both workloads (aiperf_core.workloads): the item `workload`
(cnn, the default, or lm) picks the track, and with it each item's default and which items exist:
an item of the other track is an unknown setting. A run may change any item through the `[policy]`
table of its config file; changing a *fixed* item is allowed for experiments, but the run is then
unofficial and its summary names every fixed item that was changed (aiperf_core.scoring reads
`Policy.overridden_fixed()`). Values are never clamped or "fixed up": a bad value is an error
that names the item.

Learning-rate scaling with batch size, for SGD (the CNN; the "linear scaling rule", Goyal et al.
2017):
    lr = learning_rate * batch_size / reference_batch_size
so the CNN's default 0.1 holds at the paper's default batch of 448 and scales in proportion. The
LM's AdamW scales with the square root of the ratio, times a factor its tuner picks
(hpo_lr_scale_bounds; aiperf_core.workloads.lm.HpoSpace). The rate then decays to
`final_lr_fraction` of itself over the trial's epochs (linearly for the CNN, along a half cosine
after `lr_warmup_epochs` of linear warm-up for the LM).

Early-stopping patience grows with the round, because later rounds start from better-trained
parents whose validation loss moves more slowly:
    patience(round) = min(patience_min + round - 1, patience_max)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from aiperf_core.backend import AUTO_PRECISION, COMPILE_MODES, PRECISIONS
from aiperf_core.data.stream import check_loader
from aiperf_core.errors import AiperfError

# Table 4's "FP16 or better", as an order: a precision meets a minimum when its rank is at least
# the minimum's. bf16 ranks with fp16 (fewer mantissa bits, a wider exponent); tf32 above both:
# fp16's 10-bit mantissa with fp32's 8-bit exponent (docs/scoring.md). fp8 is below every minimum.
PRECISION_RANK = {"fp8": 0, "fp16": 1, "bf16": 1, "tf32": 2, "fp32": 3}


class PolicyError(AiperfError):
    pass


def _choice(*allowed: Any) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(map(str, allowed))}"
    return check


def _int_range(low: int, high: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
        if value < low or (high is not None and value > high):
            return f"must be in [{low}, {high}]" if high is not None else f"must be at least {low}"
        return None
    return check


def _number_range(low: float, high: float, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return "must be a number"
        if value > high or value < low or (low_open and value == low):
            return f"must be in {'(' if low_open else '['}{low}, {high}]"
        return None
    return check


def _int_pair(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
            return "must be a pair of integers [low, high]"
        if value[0] < low or value[0] > value[1]:
            return f"must satisfy {low} <= low <= high"
        return None
    return check


def _int_list(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)):
            return f"must be a non-empty list of integers >= {low}"
        return None
    return check


MAX_MORPH_KERNEL = 7  # aiperf_core.morph.cnn.MAX_KERNEL, the largest kernel a morph can make


def _odd_kernels(value: Any) -> str | None:
    problem = _int_list(1)(value)
    if problem is None and any(k % 2 == 0 or k > MAX_MORPH_KERNEL for k in value):
        return f"must hold odd kernel sizes from 1 to {MAX_MORPH_KERNEL} only"
    return problem


# aiperf_core.morph.transformer.OPERATORS (a test holds them equal; importing it here would import the
# morph and counting modules into every reader of a policy).
TRANSFORMER_MORPHS = ("deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe")


def _transformer_morphs(value: Any) -> str | None:
    if (not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) for v in value)
            or len(set(value)) != len(value)):
        return "must be a non-empty list of distinct morph names"
    unknown = [v for v in value if v not in TRANSFORMER_MORPHS]
    if unknown:
        return f"has {unknown[0]!r}, not a transformer morph (choose from {', '.join(TRANSFORMER_MORPHS)})"
    return None


def _int_pair_range(low: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
            return "must be a pair of numbers [low, high]"
        if not low < value[0] <= value[1]:
            return f"must satisfy {low} < low <= high"
        return None
    return check


def _betas(value: Any) -> str | None:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0 for v in value)):
        return "must be two numbers in [0, 1)"
    return None


def _auto_or_int(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value == "auto":
            return None
        return None if _int_range(low)(value) is None else f"must be auto or an integer >= {low}"
    return check


WORKLOADS = ("cnn", "lm")
_SAME = object()  # an item whose LM default is its CNN default


@dataclass(frozen=True)
class PolicyItem:
    name: str
    default: Any
    fixed: bool
    doc: str
    check: Callable[[Any], str | None]
    workloads: tuple[str, ...] = WORKLOADS  # the tracks the item exists in
    lm: Any = _SAME  # the LM track's default, where it differs
    lm_check: Callable[[Any], str | None] | None = None  # the LM track's check, where it differs

    def default_for(self, workload: str) -> Any:
        return self.default if workload == "cnn" or self.lm is _SAME else self.lm

    def check_for(self, workload: str) -> Callable[[Any], str | None]:
        return self.lm_check if workload == "lm" and self.lm_check is not None else self.check


CNN, LM = ("cnn",), ("lm",)

ITEMS: tuple[PolicyItem, ...] = (
    PolicyItem("workload", "cnn", False, "the track: cnn (ResNet-50 on ImageNet, the paper's) or lm (a GPT on "
               "byte-level text); each is ranked in its own list", _choice(*WORKLOADS)),
    # Paper Table 4, fixed rows.
    PolicyItem("server_arrangement", "primary-replica", True, "a primary dispatches, replicas train",
               _choice("primary-replica")),
    PolicyItem("nas_method", "network-morphism", True, "NAS by function-preserving network morphism",
               _choice("network-morphism")),
    PolicyItem("hpo_method", "bayesian", True, "HPO by Bayesian optimisation (scikit-optimize)",
               _choice("bayesian")),
    PolicyItem("dataset", "imagenet", True, "the scored dataset (lm: enwik8, or the embedded corpus)",
               _choice("imagenet", "digits", "synthetic"), lm="enwik8", lm_check=_choice("enwik8", "embedded")),
    PolicyItem("initial_architecture", "resnet50", True, "the search starts from ResNet-50 (lm: from GPT-2 small's "
               "shape, aiperf_core.workloads.lm.SEEDS; embedded corpus: gpt_small unless set)",
               _choice("resnet50", "resnet_small"), lm="gpt2_small", lm_check=_choice("gpt2_small", "gpt_small", "gpt_tiny", "llama_gpt2_size", "llama_small",
                                                      "llama_tiny")),
    PolicyItem("min_precision", "fp16", True, "no training precision below this", _choice("fp16")),
    PolicyItem("max_error", 0.30, True, "a valid run reaches at most this validation error",
               _number_range(0.0, 1.0, low_open=True), CNN),
    PolicyItem("max_bits_per_byte", 2.0, True, "a valid run reaches at most this many validation bits per byte "
               "on enwik8 (embedded corpus: 4.0 unless set; docs/scoring.md)", _number_range(0.0, 8.0, low_open=True),
               LM),
    PolicyItem("seq_len", 1024, True, "tokens (bytes) per training and validation sequence (embedded corpus: 128 "
               "unless set)", _int_range(2, 4096), LM),
    PolicyItem("epoch_tokens", 1_048_576, True, "training tokens in one epoch: an epoch is this many tokens of the "
               "training split, whatever the sequence length (embedded corpus: 16,384 unless set)",
               _int_range(2), LM),
    PolicyItem("val_tokens", 131_072, True, "validation tokens each epoch is scored on: the first this many of the "
               "validation split, or all of it where it is shorter (embedded corpus: 16,384 unless set)",
               _int_range(2), LM),
    PolicyItem("hpo_start_round", 4, True, "HPO proposes from this round on; earlier rounds are warm-up",
               _int_range(1)),
    PolicyItem("max_epochs", 60, True, "no trial trains more epochs than this", _int_range(1, 60)),
    # Paper Table 4, default (customizable) rows.
    PolicyItem("initial_weights", "he", False, "initialisation of the initial network (He et al.)",
               _choice("he")),
    PolicyItem("batch_size", 448, False, "global batch size (images or sequences) of rounds before HPO starts "
               "(lm: embedded corpus 16 unless set)", _int_range(1), lm=32),
    PolicyItem("optimizer", "sgd-momentum", False, "sgd-momentum (the cnn's only one), or adamw (decoupled weight "
               "decay on matrices)", _choice("sgd-momentum"), lm="adamw", lm_check=_choice("sgd-momentum", "adamw")),
    PolicyItem("momentum", 0.9, False, "SGD momentum", _number_range(0.0, 1.0)),
    PolicyItem("adam_betas", [0.9, 0.95], False, "AdamW's moment decay rates (b1, b2)", _betas, LM),
    PolicyItem("weight_decay", 0.1, False, "AdamW's decoupled weight decay", _number_range(0.0, 1.0), LM),
    PolicyItem("grad_clip", 1.0, False, "the gradients' global 2-norm is clipped to this (0: no clipping)",
               _number_range(0.0, 1e6), LM),
    PolicyItem("learning_rate", 0.1, False, "learning rate at the reference batch size (lm: embedded corpus 0.005 "
               "unless set)", _number_range(0.0, 10.0, low_open=True), lm=0.001),
    PolicyItem("reference_batch_size", 448, False, "batch size at which learning_rate applies unscaled "
               "(lm: embedded corpus 16 unless set)", _int_range(1), lm=32),
    PolicyItem("lr_schedule", "linear", False, "the rate's decay after warm-up: linear or cosine",
               _choice("linear", "cosine"), lm="cosine"),
    PolicyItem("lr_warmup_epochs", 0, False, "epochs of linear learning-rate warm-up at the start of each trial",
               _int_range(0), lm=1),
    PolicyItem("final_lr_fraction", 0.0, False, "the decay ends at this fraction of the rate",
               _number_range(0.0, 1.0), lm=0.1),
    PolicyItem("loss", "categorical-cross-entropy", False, "training loss", _choice("categorical-cross-entropy")),
    PolicyItem("label_smoothing", 0.0, False, "label smoothing of the cross-entropy", _number_range(0.0, 0.5)),
    PolicyItem("parallelism", "synchronous-all-reduce", False, "data parallelism inside a replica",
               _choice("synchronous-all-reduce")),
    PolicyItem("data_workers", 48, False, "parallel data transformation workers per replica", _int_range(1)),
    PolicyItem("data_loader", "native", False, "who decodes streamed images: native (the backend's pipeline or "
               "aiperf's host workers) or dali (NVIDIA DALI, aiperf[dali]; on the GPU where CUDA is present)",
               check_loader, CNN),
    PolicyItem("precision", AUTO_PRECISION, False, "training precision: auto (the fastest the backend declares "
               "on the run's device), fp32, tf32, bf16 or fp16", _choice(AUTO_PRECISION, *PRECISIONS)),
    PolicyItem("compile", "auto", False, "compile the training step: auto (the backend's rule, "
               "docs/backends/<backend>.md), always or never", _choice(*COMPILE_MODES)),
    # Search settings the paper leaves open.
    PolicyItem("warmup_epochs", [15, 30, 45], False, "epochs of each warm-up round (rounds before HPO)",
               _int_list(1), lm=[1, 1, 2]),
    PolicyItem("patience_min", 3, False, "early-stopping patience in round 1", _int_range(1)),
    PolicyItem("patience_max", 10, False, "early-stopping patience ceiling", _int_range(1)),
    PolicyItem("hpo_batch_size_bounds", [16, 512], False, "HPO search range of the global batch size "
               "(lm: embedded corpus [8, 128] unless set)", _int_pair(1), lm=[32, 256]),
    PolicyItem("hpo_kernel_sizes", [3, 5, 7], False, "HPO choices of a morph-added conv's kernel size",
               _odd_kernels, CNN),
    PolicyItem("max_layers", 24, False, "no grown GPT has more blocks (attention layers) than this", _int_range(1),
               LM),
    PolicyItem("max_width", 2048, False, "no grown GPT's residual stream is wider than this", _int_range(1), LM),
    PolicyItem("max_heads", 32, False, "no attention of a grown GPT has more heads than this", _int_range(1), LM),
    PolicyItem("max_experts", 16, False, "no mixture of experts of a grown GPT has more experts than this",
               _int_range(2), LM),
    PolicyItem("hpo_lr_scale_bounds", [0.25, 2.0], False, "HPO search range of the factor on the learning rate",
               _int_pair_range(0.0), LM),
    PolicyItem("micro_batch", "auto", False, "gradient accumulation: the most sequences one device takes through one "
               "forward and backward pass; auto: the whole shard where the memory estimate fits it, else the "
               "largest that fits (docs/search.md, \"Memory\")", _auto_or_int(1), LM),
    PolicyItem("moe_aux_loss", 0.01, False, "a mixture of experts' sequence-wise load-balancing loss, with this "
               "coefficient (Switch Transformer's 0.01; 0: none; docs/search.md, \"Load balance\")",
               _number_range(0.0, 1.0), LM),
    PolicyItem("expert_parallel", "auto", False, "shard a mixture of experts' experts over a replica's devices, "
               "tokens travelling by all-to-all: auto (where the backend implements it, the replica has several "
               "devices and they divide every moe node's experts) or none (every device holds every expert; "
               "docs/search.md, \"Expert parallelism\")", _choice("auto", "none"), LM),
    PolicyItem("activation_checkpointing", "auto", False, "recompute each block's activations in the backward pass: "
               "auto (where the memory estimate needs it), always or never", _choice("auto", "always", "never"), LM),
    PolicyItem("nas_morphs", list(TRANSFORMER_MORPHS), False, "the morphs a round's candidates are drawn from "
               "(docs/search.md, \"Transformer morphs\")", _transformer_morphs, LM),
    PolicyItem("nodes_per_replica", 1, False, "the nodes each replica spans: its devices are this many times one "
               "node's, and its gradients (and experts) cross the network every step (docs/workflow.md, \"A replica "
               "across nodes\"); lm: auto, 2 where the machine has 2 or more nodes, else 1, the lm rules' value "
               "(docs/search.md, \"The official LM track\")", _int_range(1), lm="auto", lm_check=_auto_or_int(1)),
    PolicyItem("node_timeout_s", 60.0, False, "how long a node of a replica across nodes waits on its peers (joining, "
               "a collective) before it calls them lost; a lost node fails its trial within about twice this "
               "(the collective's timeout, then the process group's)", _number_range(1.0, 3600.0)),
    PolicyItem("nas_candidates", 8, False, "morph candidates generated and scored per round", _int_range(1)),
    PolicyItem("nas_acquisition", "ucb", False, "acquisition function of the architecture GP",
               _choice("ucb", "ei")),
    PolicyItem("nas_kappa", 2.576, False, "UCB exploration weight", _number_range(0.0, 100.0)),
    PolicyItem("nas_parents", 3, False, "best trials of the shared history whose children compete each round",
               _int_range(1)),
    PolicyItem("nas_active_set", 64, False, "most history trials the architecture GP is fitted on",
               _int_range(2)),
    PolicyItem("image_size", 224, False, "training and validation resolution (square)", _int_range(32), CNN),
)
BY_NAME: dict[str, PolicyItem] = {item.name: item for item in ITEMS}


def items_of(workload: str) -> tuple[PolicyItem, ...]:
    return tuple(item for item in ITEMS if workload in item.workloads)


class Policy(Mapping[str, Any]):
    """Every item's value for the track its `workload` item names, defaults filled in; read-only."""

    def __init__(self, values: Mapping[str, Any] | None = None, source: str = "policy"):
        values = dict(values or {})
        workload = values.get("workload", "cnn")
        problem = BY_NAME["workload"].check(workload)
        if problem:
            raise PolicyError(f"{source}.workload: {workload!r} {problem}")
        items = items_of(workload)
        known = {item.name for item in items}
        for name, value in values.items():
            item = BY_NAME.get(name)
            if item is None:
                raise PolicyError(f"{source}.{name}: unknown setting (known: {', '.join(sorted(known))})")
            if name not in known:
                raise PolicyError(f"{source}.{name}: a setting of the {'/'.join(item.workloads)} workload, not of "
                                  f"{workload}")
            problem = item.check_for(workload)(value)
            if problem:
                raise PolicyError(f"{source}.{name}: {value!r} {problem}")
        self.workload = workload
        self._items = items
        self._values = {item.name: values.get(item.name, item.default_for(workload)) for item in items}
        self._values = {k: list(v) if isinstance(v, tuple) else v for k, v in self._values.items()}
        if self._values["patience_min"] > self._values["patience_max"]:
            raise PolicyError(f"{source}.patience_min: {self._values['patience_min']} is above "
                              f"patience_max {self._values['patience_max']}")
        if max(self._values["warmup_epochs"]) > self._values["max_epochs"]:
            raise PolicyError(f"{source}.warmup_epochs: {self._values['warmup_epochs']} exceeds "
                              f"max_epochs {self._values['max_epochs']}")

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def overridden_fixed(self) -> list[str]:
        """Fixed items whose value differs from the paper's: each one makes a run unofficial."""
        return [item.name for item in self._items
                if item.fixed and self._values[item.name] != _plain(item.default_for(self.workload))]

    def to_json(self) -> dict[str, Any]:
        return dict(self._values)

    def learning_rate_for(self, batch_size: int) -> float:
        return self["learning_rate"] * batch_size / self["reference_batch_size"]

    def patience_for(self, round_number: int) -> int:
        return min(self["patience_min"] + round_number - 1, self["patience_max"])

    def epochs_for(self, round_number: int) -> int:
        """Warm-up rounds train their listed epochs; later rounds up to max_epochs."""
        warmup = self["warmup_epochs"]
        if round_number < self["hpo_start_round"] and round_number <= len(warmup):
            return warmup[round_number - 1]
        return self["max_epochs"]

    def is_warmup(self, round_number: int) -> bool:
        return round_number < self["hpo_start_round"]


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def precision_allowed(precision: str, minimum: str = "fp16") -> bool:
    return PRECISION_RANK.get(precision, -1) >= PRECISION_RANK[minimum]


def describe(workload: str = "cnn") -> list[dict[str, Any]]:
    """The table of a track, documented in docs/rules.md and shown by the report."""
    return [{"name": i.name, "default": i.default_for(workload), "fixed": i.fixed, "doc": i.doc}
            for i in items_of(workload)]
