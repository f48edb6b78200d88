"""The interface of a workload, one protocol per concern (../shared/DESIGN.md, "Workloads"): the
replica, the search and the scoring ask the run's workload, never `if workload == ...`.

- Seed: the graph round 1 trains, from the policy and the data.
- Morphs: function-preserving children of a trained graph (generate_candidates, replay) and the
  tuner's say in a chosen morph (tune_morph).
- Distance: the architecture code NAS measures distances on (search.arch.encode covers both
  families: convolutions, attention and mixture-of-experts layers are layers of their own kinds).
- HpoSpace: the dimensions the tuner searches, and the learning rate a proposal trains at.
- Data: the run's data opened once per replica, and what one trial trains on: a Dataset, or streamed
  data (images, or the trial's stream of text) that backend.train() reads batch by batch.
- Validity: an epoch's error (what -ln(error) x OPS regulates, and what the search maximises
  1 - error of), and the run's quality rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from aiperf_core.backend import Dataset
from aiperf_core.ir import Graph
from aiperf_core.policy import Policy
from aiperf_core.search.hpo import Dimension, Proposal


class Seed(Protocol):
    def build(self, policy: Policy, opened: Any) -> Graph: ...


class Morphs(Protocol):
    def generate_candidates(self, graph: Graph, weights, n: int, seed: int, policy: Policy,
                            memory: Any = None) -> list: ...

    def replay(self, graph: Graph, weights, record: Mapping) -> Any: ...

    def tune_morph(self, record: dict, proposal: Proposal) -> dict: ...


class HpoSpace(Protocol):
    def dimensions(self, policy: Policy) -> Sequence[Dimension]: ...

    def learning_rate(self, policy: Policy, proposal: Proposal) -> float: ...


class Data(Protocol):
    samples: str  # what an epoch's train_images count, for displays: "images" or "sequences"

    def open(self, spec: Mapping[str, Any], policy: Policy) -> Any: ...

    def trial_data(self, opened: Any, policy: Policy, seed: int) -> Dataset | Any: ...

    def digest(self, opened: Any, spec: Mapping[str, Any]) -> str | None: ...


class Validity(Protocol):
    quality: str  # what the error measures, for reports: "accuracy" or "bits per byte"
    unit: str  # the unit display() gives the error in: "error (%)" or "bits per byte"
    limit_item: str  # the fixed policy item holding the quality limit ("max_error", "max_bits_per_byte")

    def display(self, error: float) -> float: ...

    def limit(self, rules: Mapping[str, Any]) -> float: ...

    def error(self, val_accuracy: float | None, val_loss: float | None, val_samples: int) -> float | None: ...

    def best(self, error: float | None, accuracy: float | None) -> str: ...

    def brief(self, error: float | None, accuracy: float | None) -> str: ...

    def reasons(self, policy_defaults: Mapping[str, Any], best_error: float | None) -> list[str]: ...


@dataclass(frozen=True)
class Workload:
    name: str
    seed: Seed
    morphs: Morphs
    hpo: HpoSpace
    data: Data
    validity: Validity

    @staticmethod
    def distance_code(graph: Graph):
        from aiperf_core.search.arch import encode

        return encode(graph)
