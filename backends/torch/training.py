"""Loss, one SGD step and the epoch loop, shared by the single-process and the data-parallel path.

The data-parallel path (distributed.py) runs the same loop in every rank with `rank`/`world` set:
every rank draws the same shuffled order (np.random.default_rng(seed + epoch)), cuts the same
global batches of `config.batch_size`, and takes its own contiguous shard of each. Each rank's
loss is its shard's summed cross-entropy scaled by world / global batch size, so that after
DistributedDataParallel averages the gradients over the ranks they are exactly the gradients of
the global batch's mean loss, even when the last batch does not split evenly.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from aiperf_core.backend import BackendError, Dataset, EpochReport, StepClock, TrainConfig, batches, is_streaming

PROBABILITY_CLIP = 1e-7  # as the NumPy reference, for graphs whose output is not a softmax
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PREDICT_BATCH = 256


def autocast(device: torch.device | str, precision: str):
    """torch.autocast for a mixed precision, a null context for fp32."""
    if precision == "fp32":
        return nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])


def summed_loss(model, x: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
    """Summed (not mean) categorical cross-entropy of a batch, against smoothed one-hot targets.

    With a softmax output the loss comes from its logits (F.cross_entropy, a stable log-softmax);
    otherwise the output is read as probabilities, clipped to [1e-7, 1 - 1e-7] as the reference does.
    """
    base = getattr(model, "module", model)  # DistributedDataParallel wraps the LoweredModel
    if base.has_logits:
        logits = model(x, logits=True).float()
        return F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)
    probs = model(x).float()
    classes = probs.shape[-1]
    target = F.one_hot(labels, classes).to(probs.dtype) * (1.0 - label_smoothing) + label_smoothing / classes
    clipped = probs.clamp(PROBABILITY_CLIP, 1.0 - PROBABILITY_CLIP)
    return -(target * clipped.log()).sum()


class preserved:
    """Restore every buffer (batch-norm statistics) and parameter gradient on exit, so that a
    training-mode pass that must not change the model (loss_and_grads, op counting) does not."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        self.grads = [(p, p.grad) for p in self.model.parameters()]
        for p, _ in self.grads:
            p.grad = None
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        return False


class Stepper:
    """SGD with momentum (torch.optim.SGD), autocast per precision, loss scaling for fp16."""

    def __init__(self, model, device, config: TrainConfig):
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise BackendError("the graph has no trainable parameters: there is nothing to train")
        self.model = model
        self.device = torch.device(device)
        self.precision = config.precision
        self.label_smoothing = config.label_smoothing
        self.optimizer = torch.optim.SGD(params, lr=config.schedule.initial, momentum=config.momentum)
        self.scaler = torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, x: torch.Tensor, y: torch.Tensor, global_batch: int, world: int = 1) -> torch.Tensor:
        """One synchronous SGD step on this rank's shard; returns the shard's summed loss (detached)."""
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.precision):
            total = summed_loss(self.model, x, y, self.label_smoothing)
        loss = total * (world / global_batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return total.detach()


def evaluate(model, x: np.ndarray, labels: np.ndarray, device, precision: str, label_smoothing: float = 0.0,
             batch: int = PREDICT_BATCH) -> tuple[float, int, int]:
    """(summed loss, correct predictions, images) over x in eval mode, `batch` images at a time."""
    base = getattr(model, "module", model)
    was_training = base.training
    base.eval()
    total, correct = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch):
                xb = torch.from_numpy(np.ascontiguousarray(x[start:start + batch], dtype=np.float32)).to(device)
                yb = torch.from_numpy(np.asarray(labels[start:start + batch], dtype=np.int64)).to(device)
                with autocast(device, precision):
                    out = base(xb, logits=True).float()
                if base.has_logits:  # out holds logits; argmax is the same as the softmax's
                    total += float(F.cross_entropy(out, yb, reduction="sum", label_smoothing=label_smoothing))
                else:
                    classes = out.shape[-1]
                    target = F.one_hot(yb, classes).float() * (1.0 - label_smoothing) + label_smoothing / classes
                    total += float(-(target * out.clamp(PROBABILITY_CLIP, 1 - PROBABILITY_CLIP).log()).sum())
                correct += int((out.argmax(dim=-1) == yb).sum())
    finally:
        base.train(was_training)
    return total, correct, len(x)


def run_epochs(model, data: Dataset, config: TrainConfig, device, *, rank: int = 0, world: int = 1,
               all_reduce: Callable[[list[float]], list[float]] | None = None,
               on_epoch: Callable[[EpochReport], bool] | None = None,
               stepper: Stepper | None = None) -> list[EpochReport]:
    """The epoch loop. `all_reduce` sums a list of floats over the ranks (None when world == 1);
    `on_epoch` returns True to stop and must give every rank the same answer.

    Per epoch: the learning rate config.schedule.rate(epoch, epochs); every training image once,
    in the order np.random.default_rng(config.seed + epoch).permutation(n), in batches of
    config.batch_size (the last one short, never dropped); then the validation set in eval mode.
    The report's loss is the mean training loss over the epoch's images (as each step saw it), and
    val_loss the same cross-entropy (label smoothing included) on the validation images."""
    device = torch.device(device)
    stepper = stepper or Stepper(model, device, config)
    base = getattr(model, "module", model)
    # Dropout draws from a generator seeded by config.seed and the rank: a run is reproducible.
    seed = int(np.random.SeedSequence([config.seed, rank]).generate_state(1)[0])
    generator = torch.Generator(device=device).manual_seed(seed)
    with base.dropout_masks(generator):
        if is_streaming(data):
            return _stream_epochs(model, base, stepper, data, config, device, rank, world, all_reduce, on_epoch)
        x_train = torch.from_numpy(np.ascontiguousarray(data.x_train, dtype=np.float32))
        y_train = torch.from_numpy(np.asarray(data.y_train, dtype=np.int64))
        return _epochs(model, base, stepper, x_train, y_train, data, config, device, rank, world, all_reduce,
                       on_epoch)


def _epochs(model, base, stepper, x_train, y_train, data, config, device, rank, world, all_reduce, on_epoch):
    n = len(y_train)
    reports: list[EpochReport] = []
    clock = StepClock()
    for epoch in range(config.epochs):
        stepper.set_lr(config.schedule.rate(epoch, config.epochs))
        base.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        images = 0
        for idx in batches(n, config.batch_size, np.random.default_rng(config.seed + epoch)):
            shard = np.array_split(idx, world)[rank] if world > 1 else idx
            index = torch.from_numpy(shard)
            x_host, y_host = x_train.index_select(0, index), y_train.index_select(0, index)
            with clock:  # a step starts with its batch's transfer to the device
                xb, yb = x_host.to(device, non_blocking=True), y_host.to(device, non_blocking=True)
                loss_sum += stepper.step(xb, yb, len(idx), world)
            images += len(idx)
        with clock:  # waits for the queued steps on an asynchronous device
            train_loss = float(loss_sum)
        # Validation: each rank takes a contiguous slice; the sums are reduced.
        xv, yv = data.x_val, data.y_val
        if world > 1:
            part = np.array_split(np.arange(len(yv)), world)[rank]
            xv, yv = xv[part], yv[part]
        with clock:
            val_loss, correct, val_n = evaluate(model, xv, yv, device, config.precision, config.label_smoothing)
        if all_reduce is not None:
            train_loss, val_loss, correct, val_n = all_reduce([train_loss, val_loss, float(correct), float(val_n)])
        val_total = len(data.y_val)
        report = EpochReport(
            epoch=epoch, train_images=images, val_images=val_total,
            loss=train_loss / max(images, 1),
            val_loss=val_loss / val_total if val_total else 0.0,
            val_accuracy=float(round(correct)) / val_total if val_total else 0.0, step_seconds=clock.lap(),
        )
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports


# ---------------------------------------------------------------------------
# Streamed data (aiperf_core.data.stream.StreamingDataset) through a torch DataLoader
# ---------------------------------------------------------------------------


class ShardBatches(torch.utils.data.Dataset):
    """Item (epoch, k): this rank's shard of global batch k of the epoch, decoded and augmented, as
    (images, labels, skipped, global batch size). Each DataLoader worker decodes whole shards."""

    def __init__(self, data, split: str, seed: int, batch_size: int, rank: int, world: int):
        self.data, self.split, self.seed, self.batch_size = data, split, seed, batch_size
        self.rank, self.world = rank, world
        self._plan: tuple[int, list] | None = None  # (epoch, global batches), per worker

    def plan(self, epoch: int) -> list:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.data.plan(self.split, epoch, self.seed, self.batch_size))
        return self._plan[1]

    def __len__(self) -> int:
        return -(-self.data.source.count(self.split) // self.batch_size)

    def __getitem__(self, key):
        from aiperf_core.data.stream import shard

        epoch, k = key
        indices = self.plan(epoch)[k]
        x, y, skipped, _ = self.data.load(self.split, shard(indices, self.rank, self.world), epoch, self.seed)
        return torch.from_numpy(x), torch.from_numpy(y), skipped, len(indices)


class EpochSampler(torch.utils.data.Sampler):
    """Keys (epoch, k) of one epoch's batches; set_epoch before iterating, as with DistributedSampler."""

    def __init__(self, batches: int):
        self.batches, self.epoch = batches, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return ((self.epoch, k) for k in range(self.batches))

    def __len__(self) -> int:
        return self.batches


def stream_loader(data, split: str, seed: int, batch_size: int, device, rank: int = 0, world: int = 1):
    """A DataLoader over this rank's shards of the split's batches: data.workers worker processes
    per replica (shared among its ranks), each decoding whole shards, data.prefetch batches ahead
    per worker, pinned memory on CUDA. Workers persist across epochs (no re-fork per epoch)."""
    items = ShardBatches(data, split, seed, batch_size, rank, world)
    workers = -(-data.workers // world) if data.workers else 0
    return torch.utils.data.DataLoader(
        items, batch_size=None, sampler=EpochSampler(len(items)), num_workers=workers,
        pin_memory=torch.device(device).type == "cuda", prefetch_factor=max(data.prefetch, 1) if workers else None,
        persistent_workers=bool(workers))


def _stream_epochs(model, base, stepper, data, config, device, rank, world, all_reduce, on_epoch):
    """The epoch loop over streamed data. With several ranks, the number of images that decoded in
    each global batch is summed over the ranks before the step, so the loss is still the global
    batch's mean over the images it really holds."""
    from aiperf_core.data.stream import TRAIN, VAL

    train = stream_loader(data, TRAIN, config.seed, config.batch_size, device, rank, world)
    val = stream_loader(data, VAL, 0, PREDICT_BATCH, device, rank, world)
    reports: list[EpochReport] = []
    clock = StepClock()
    for epoch in range(config.epochs):
        stepper.set_lr(config.schedule.rate(epoch, config.epochs))
        base.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        images = skipped = 0
        train.sampler.set_epoch(epoch)
        for x, y, shard_skipped, _ in train:
            skipped += int(shard_skipped)
            held = len(y) if all_reduce is None else int(round(all_reduce([float(len(y))])[0]))
            if held == 0:  # every image of the global batch was corrupt
                continue
            with clock:
                xb, yb = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                loss_sum += stepper.step(xb, yb, held, world)
            images += held
        with clock:
            train_loss = float(loss_sum)
        val_loss, correct, val_n = 0.0, 0, 0
        for x, y, shard_skipped, _ in val:
            skipped += int(shard_skipped)
            if len(y):
                with clock:
                    part = evaluate(model, x.numpy(), y.numpy(), device, config.precision, config.label_smoothing)
                val_loss, correct, val_n = val_loss + part[0], correct + part[1], val_n + part[2]
        if all_reduce is not None:  # images is already global; the rest are this rank's sums
            train_loss, val_loss, correct, val_n, skipped = all_reduce(
                [train_loss, val_loss, float(correct), float(val_n), float(skipped)])
        val_n = int(round(val_n))
        report = EpochReport(
            epoch=epoch, train_images=images, val_images=val_n, loss=train_loss / max(images, 1),
            val_loss=val_loss / val_n if val_n else 0.0,
            val_accuracy=float(round(correct)) / val_n if val_n else 0.0, skipped_images=int(round(skipped)),
            step_seconds=clock.lap())
        reports.append(report)
        if on_epoch is not None and on_epoch(report):
            break
    return reports
