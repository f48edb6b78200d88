"""Analytic operation count of an IR graph: per node, per category, per image and per epoch."""

from __future__ import annotations

from dataclasses import dataclass

from aiperf_core.errors import AiperfError
from aiperf_core.ir import TRAINED_OPS, Graph
from aiperf_opcount.rules import CATEGORIES, CATEGORY_OF_OP, CONVENTIONS, node_ops


@dataclass(frozen=True)
class NodeCount:
    id: str
    op: str
    category: str
    shape: tuple[int, ...]
    fp: int
    grad: int
    update: int
    split: tuple[tuple[str, int, int], ...] = ()  # (category, fp, grad) parts outside `category`

    @property
    def bp(self) -> int:
        return self.grad + self.update

    def parts(self) -> list[tuple[str, int, int]]:
        """(category, fp, grad) of this node: its own category's share first, then the split ones."""
        own_fp = self.fp - sum(fp for _, fp, _ in self.split)
        own_grad = self.grad - sum(g for _, _, g in self.split)
        return [(self.category, own_fp, own_grad), *self.split]

    def to_dict(self) -> dict:
        out = {"id": self.id, "op": self.op, "category": self.category, "shape": list(self.shape),
               "fp": self.fp, "bp": self.bp, "update": self.update}
        if self.split:
            out["by_category"] = {c: {"fp": fp, "bp": g} for c, fp, g in self.parts()}
        return out


@dataclass(frozen=True)
class EpochCount:
    """Ops of one epoch: training FP+BP over train_images, validation FP over val_images."""

    train_images: int
    val_images: int
    fp_train: int
    bp_train: int
    fp_val: int

    @property
    def total(self) -> int:
        return self.fp_train + self.bp_train + self.fp_val

    def to_dict(self) -> dict:
        return {"train_images": self.train_images, "val_images": self.val_images, "fp_train": self.fp_train,
                "bp_train": self.bp_train, "fp_val": self.fp_val, "total": self.total}


@dataclass(frozen=True)
class OpCount:
    graph_name: str
    convention: str
    nodes: tuple[NodeCount, ...]

    @property
    def fp(self) -> int:
        return sum(n.fp for n in self.nodes)

    @property
    def bp(self) -> int:
        return sum(n.bp for n in self.nodes)

    @property
    def total(self) -> int:
        return self.fp + self.bp

    @property
    def train_per_image(self) -> int:
        return self.total

    def by_category(self) -> dict[str, dict[str, int]]:
        """Weight updates form their own category 'update'; a layer's category holds its FP and gradients."""
        cats = {c: {"fp": 0, "bp": 0} for c in CATEGORIES}
        for n in self.nodes:
            if n.category == "input":
                continue
            for category, fp, grad in n.parts():
                cats[category]["fp"] += fp
                cats[category]["bp"] += grad
            cats["update"]["bp"] += n.update
        return cats

    def by_op(self) -> dict[str, dict[str, int]]:
        """Per layer type, updates included in BP: the rows of the paper's Table 3."""
        ops: dict[str, dict[str, int]] = {}
        for n in self.nodes:
            row = ops.setdefault(n.op, {"fp": 0, "bp": 0})
            row["fp"] += n.fp
            row["bp"] += n.bp
        return ops

    def epoch(self, train_images: int, val_images: int) -> EpochCount:
        for name, value in (("train_images", train_images), ("val_images", val_images)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AiperfError(f"{name} must be a non-negative integer, got {value!r}")
        return EpochCount(train_images, val_images, self.fp * train_images, self.bp * train_images,
                          self.fp * val_images)

    def to_dict(self, train_images: int | None = None, val_images: int | None = None) -> dict:
        out = {
            "graph": self.graph_name,
            "convention": self.convention,
            "fp": self.fp,
            "bp": self.bp,
            "total": self.total,
            "by_category": self.by_category(),
            "nodes": [n.to_dict() for n in self.nodes],
        }
        if train_images is not None or val_images is not None:
            out["epoch"] = self.epoch(train_images or 0, val_images or 0).to_dict()
        return out


def count(graph: Graph, convention: str = "paper") -> OpCount:
    """Count a graph per image. 'paper' is the scoring convention; 'valid' skips padded taps."""
    if convention not in CONVENTIONS:
        raise AiperfError(f"unknown convention '{convention}' (choose from {', '.join(CONVENTIONS)})")
    params_upstream: dict[str, bool] = {}
    nodes = []
    for node in graph.nodes:
        upstream = any(params_upstream[i] or graph[i].op in TRAINED_OPS for i in node.inputs)
        params_upstream[node.id] = upstream
        ops = node_ops(graph, node, convention, reads_data=not upstream)
        nodes.append(NodeCount(node.id, node.op, CATEGORY_OF_OP[node.op], graph.shapes[node.id],
                               ops.fp, ops.grad, ops.update, ops.split))
    return OpCount(graph.name, convention, tuple(nodes))
