"""The CNN workload, the paper's: ResNet-50 grown by the CNN morphs (aiperf_core.morph.cnn) on
ImageNet, validation error as quality, at most 30% for a valid run."""

from __future__ import annotations

from typing import Any, Mapping

from aiperf_core.backend import Dataset, is_streaming
from aiperf_core.ir import Graph
from aiperf_core.policy import Policy
from aiperf_core.search.hpo import Dimension, Proposal, warmup_kernel
from aiperf_core.workloads.base import Workload


class Seed:
    def build(self, policy: Policy, data) -> Graph:
        from aiperf_core.builders import build

        shape = data.image_shape if is_streaming(data) else data.x_train.shape[1:]
        return build(policy["initial_architecture"], tuple(shape), data.classes)


class Morphs:
    def generate_candidates(self, graph: Graph, weights, n: int, seed: int, policy: Policy, memory=None) -> list:
        from aiperf_core.morph import MorphCaps, cnn

        return cnn.generate_candidates(graph, weights, n, seed, MorphCaps(memory=memory))

    def replay(self, graph: Graph, weights, record: Mapping):
        from aiperf_core.morph import cnn

        return cnn.replay(graph, weights, record)

    def tune_morph(self, record: dict, proposal: Proposal) -> dict:
        """A chosen `deeper` adds a conv of the kernel size the tuner proposed."""
        kernel = proposal.point["kernel_size"]
        if record["op"] == "deeper" and record["args"].get("kernel", 3) != kernel:
            return {**record, "args": {**record["args"], "kernel": kernel}}
        return record


class HpoSpace:
    def dimensions(self, policy: Policy) -> list[Dimension]:
        low, high = policy["hpo_batch_size_bounds"]
        return [Dimension("batch_size", policy["batch_size"], low, high),
                Dimension("kernel_size", warmup_kernel(policy), choices=tuple(sorted(policy["hpo_kernel_sizes"])))]

    def learning_rate(self, policy: Policy, proposal: Proposal) -> float:
        return policy.learning_rate_for(proposal.batch_size)


class Data:
    samples = "images"  # what an epoch's train_images count

    def open(self, spec: Mapping[str, Any], policy: Policy):
        from aiperf_core.data import load_dataset

        return load_dataset(spec, workers=policy["data_workers"], loader=policy.get("data_loader"))

    def trial_data(self, opened, policy: Policy, seed: int) -> Dataset:
        return opened

    def digest(self, opened, spec: Mapping[str, Any]) -> str | None:
        """The digest of this node's copy, as its manifest says (None: a folder without one)."""
        from aiperf_core.data.manifest import recorded_digest

        return recorded_digest(spec.get("path"))


class Validity:
    quality = "accuracy"
    unit = "error (%)"
    limit_item = "max_error"  # the policy item limit() reads

    def display(self, error: float) -> float:
        return 100.0 * error

    def limit(self, rules: Mapping[str, Any]) -> float:
        return rules["max_error"]

    def error(self, val_accuracy: float | None, val_loss: float | None, val_samples: int) -> float | None:
        """1 - accuracy, except that a perfect score is taken as half an image wrong: -ln(0) is
        infinite, and no finite validation set proves a zero error rate."""
        if val_accuracy is None:
            return None
        return 1.0 - val_accuracy if val_accuracy < 1.0 else 0.5 / max(val_samples, 1)

    def best(self, error: float | None, accuracy: float | None) -> str:
        if error is None:
            return "no validation accuracy yet"
        return f"best validation accuracy {accuracy:.2%} (error {error:.2%})"

    def brief(self, error: float | None, accuracy: float | None) -> str:
        return f"best accuracy {'-' if accuracy is None else f'{accuracy:.2%}'}"

    def reasons(self, rules: Mapping[str, Any], best_error: float | None) -> list[str]:
        if best_error is None:
            return ["no validation accuracy was recorded by the end of the run"]
        if best_error > rules["max_error"]:
            return [f"best validation error {best_error:.2%} is above the maximum {rules['max_error']:.0%}"]
        return []


CNN = Workload("cnn", Seed(), Morphs(), HpoSpace(), Data(), Validity())
