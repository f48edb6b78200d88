"""The NumPy reference backend: the aiperf backend contract on top of the reference executor.

It is the template for vendor backends (see README.md): one class implementing
aiperf_core.backend.Backend, registered under the entry-point group `aiperf.backends`, and a
conformance data file shipped inside the package.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiperf_core.backend import (Availability, Backend, Dataset, EpochCallback, EpochReport, Parallelism, StepClock,
                                 TrainConfig, accuracy, cross_entropy, micro_batches)
from aiperf_core.ir import ALL_OPS, Graph, is_trainable
from aiperf_core.optim import HostOptimizer
from aiperf_core.weights import Weights, validate_weights
from aiperf_numpy.executor import forward, loss_and_grads

PREDICT_BATCH = 256


@dataclass
class NumpyModel:
    graph: Graph
    weights: Weights  # float32, canonical layout
    precision: str = "fp32"


def _copy(weights: Weights) -> Weights:
    return {n: {p: np.array(a, dtype=np.float32, copy=True) for p, a in ps.items()} for n, ps in weights.items()}


class NumpyBackend(Backend):
    name = "numpy"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    def framework_version(self) -> str:
        return f"numpy {np.__version__}"

    def devices(self) -> list[str]:
        return [f"cpu ({platform.machine() or 'unknown'})"]

    def parallelism(self) -> Parallelism:
        # Single-device: no data parallelism, so nothing to spread over nodes either; the kit's
        # parallel/multi_node_refused wants the reason said.
        return Parallelism(multi_node_why_not="the reference executor trains on one CPU device, in one process")

    def matmul_seconds(self, device: str, precision: str, size: int | tuple[int, int, int],
                       repeats: int) -> list[float]:
        from aiperf_numpy.peak import matmul_seconds

        return matmul_seconds(device, precision, size, repeats)

    def supported_ops(self) -> frozenset[str]:
        return ALL_OPS  # it executes the IR itself

    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> NumpyModel:
        weights = self.starting_weights(graph, weights, precision)
        return NumpyModel(graph, _copy(weights), precision)

    def model_type(self) -> type:
        return NumpyModel

    def export_weights(self, model: NumpyModel) -> Weights:
        return _copy(self.check_model(model).weights)

    def import_weights(self, model: NumpyModel, weights: Weights) -> None:
        validate_weights(self.check_model(model).graph, weights)
        model.weights = _copy(weights)

    def predict_checked(self, model: NumpyModel, x: np.ndarray) -> np.ndarray:
        parts = [forward(model.graph, model.weights, x[i:i + PREDICT_BATCH], dtype=np.float32)
                 for i in range(0, len(x), PREDICT_BATCH)]
        return np.concatenate(parts) if parts else np.zeros((0,) + model.graph.output_shape, np.float32)

    def loss_and_grads_checked(self, model: NumpyModel, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        loss, grads, _ = loss_and_grads(model.graph, model.weights, x, labels, label_smoothing=label_smoothing,
                                        dtype=np.float32)
        return loss, grads

    def train_checked(self, model: NumpyModel, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        """`data` is in-memory arrays, a StreamingDataset read through the shared host pipeline (its
        `workers` setting; an image that does not decode is skipped and counted) or a TokenStream
        (new windows every epoch, cut one batch at a time). Streamed images carry uint8 pixels,
        normalised inside the step (the host is this backend's device) with the arithmetic every
        backend uses, preprocess.model_input; token ids stay integers.

        Each batch is one optimizer step on the gradients of `_batch_gradients`: the whole batch,
        or its micro-batches (config.micro_batch) summed; config.checkpoint_blocks recomputes each
        block's activations in the backward pass (executor.run); config.moe_aux_loss adds each moe's
        load-balancing loss to the gradients (not to the reported loss). The routing counts of the
        training forward passes are summed over the epoch into EpochReport.expert_load."""
        from aiperf_core.data.preprocess import model_input
        from aiperf_core.data.stream import train_batches, val_batches

        optimizer = HostOptimizer(config, model.weights, is_trainable)
        reports: list[EpochReport] = []
        clock = StepClock()
        moes = {node.id: node.attrs["experts"] for node in model.graph.nodes if node.op == "moe"}
        for epoch in range(config.epochs):
            lr = config.schedule.rate(epoch, config.epochs)
            seen, skipped, losses = 0, 0, []
            load = {nid: np.zeros(experts, np.int64) for nid, experts in moes.items()}
            for batch in train_batches(data, epoch, config.seed, config.batch_size):
                skipped += batch.skipped
                if not len(batch.y):
                    continue
                with clock:
                    loss, grads = _batch_gradients(model, model_input(batch.x), batch.y, config, config.seed + seen,
                                                   load)
                    optimizer.step(model.weights, grads, lr)
                clock.count(len(batch.y))  # live progress (stall detection)
                seen += len(batch.y)
                losses.append(loss * len(batch.y))
            val_n, val_loss, correct = 0, 0.0, 0.0
            for batch in val_batches(data, PREDICT_BATCH):
                skipped += batch.skipped
                if len(batch.y):
                    with clock:
                        probs = self.predict_checked(model, model_input(batch.x))
                    val_loss += cross_entropy(probs, batch.y) * len(batch.y)
                    correct += accuracy(probs, batch.y) * len(batch.y)
                    val_n += len(batch.y)
            report = EpochReport(epoch, seen, val_n, float(np.sum(losses) / max(seen, 1)),
                                 val_loss / val_n if val_n else 0.0, round(correct) / val_n if val_n else 0.0,
                                 skipped_images=skipped, step_seconds=clock.lap(), compile_seconds=0.0,
                                 expert_load={nid: tuple(int(c) for c in counts) for nid, counts in load.items()}
                                 if moes else None)
            reports.append(report)
            if on_epoch is not None and on_epoch(report):
                break
        return reports

    def conformance_file(self) -> str:
        return str(Path(__file__).with_name("conformance.json"))


def _batch_gradients(model: NumpyModel, x: np.ndarray, y: np.ndarray, config: TrainConfig, seed: int,
                     expert_load: dict[str, np.ndarray] | None = None) -> tuple[float, dict]:
    """The batch's mean loss and its gradients, computed as consecutive micro-batches of
    config.micro_batch samples (gradient accumulation; all at once without it): micro-batch k's
    loss and gradients weighted by its share of the batch's samples and summed, which is the
    whole batch's mean loss and its gradient. Dropout in micro-batch [start, stop) is seeded by
    seed + start. A batch norm's moving statistics are updated after each micro-batch, from that
    micro-batch's statistics (as if each were a step): what accumulation does to batch norm.
    The load-balancing loss is per sequence, so its micro-batches' shares add up as the cross-entropy's;
    each moe's routing counts are added to `expert_load` where given."""
    slices = micro_batches(len(y), config.micro_batch)
    loss, grads = 0.0, None
    for start, stop in slices:
        part_loss, part_grads, moving = loss_and_grads(
            model.graph, model.weights, x[start:stop], y[start:stop], label_smoothing=config.label_smoothing,
            dtype=np.float32, seed=seed + start, checkpoint_blocks=config.checkpoint_blocks,
            moe_aux_loss=config.moe_aux_loss, expert_load=expert_load)
        for node_id, stats in moving.items():
            for name, value in stats.items():
                model.weights[node_id][name] = value.astype(np.float32)
        if len(slices) == 1:
            return part_loss, part_grads
        share = (stop - start) / len(y)
        loss += share * part_loss
        if grads is None:
            grads = {n: {p: g * np.float32(share) for p, g in ps.items()} for n, ps in part_grads.items()}
        else:
            for n, ps in part_grads.items():
                for p, g in ps.items():
                    grads[n][p] += g * np.float32(share)
    return loss, grads
