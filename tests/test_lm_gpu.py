"""The LM track's official shape on a CUDA GPU (`make test-gpu`; deselected by `make test`), issue 39:
the official seed's training step at the official seq_len and global batch at the backend's fastest
precision (bf16 on an H100 or H200), and the memory estimate (aiperf_opcount.memory) against
torch.cuda.max_memory_allocated. docs/backends/gpu.md lists them among what a GPU must still verify.
Without a CUDA device every test fails: the GPU tier must not pass having checked nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.training import Stepper
from aiperf_core.backend import TrainConfig
from aiperf_core.data.text_corpus import embedded_corpus
from aiperf_core.policy import Policy
from aiperf_core.workloads.lm import BITS_PER_BYTE, OFFICIAL_SEED, seed_graph
from aiperf_opcount.memory import estimate

pytestmark = pytest.mark.gpu
POLICY = Policy({"workload": "lm"})
SEQ_LEN, BATCH = POLICY["seq_len"], POLICY["batch_size"]
TOLERANCE = 0.20  # issue 39: the estimate within 20% of the measurement


@pytest.fixture(scope="module")
def device():
    assert torch.cuda.is_available(), "no CUDA device: the LM GPU tests cannot run"
    return torch.device("cuda", 0)


@pytest.fixture(scope="module")
def precision(device):
    chosen = TorchBackend().fastest_precision()
    assert chosen in ("bf16", "fp16"), chosen
    return chosen


# The Llama seed of the official size (issue 41): RMS norm, rotary, grouped-query attention, SwiGLU.
LLAMA_SEED = "llama_gpt2_size"
# A grown child: the official seed after double_width (width 1,536, 24 heads, 342 M parameters).
GROWN_CHILD = "gpt2_small_double_width"


def official_seed(name: str = OFFICIAL_SEED):
    return seed_graph(name, SEQ_LEN, 2 ** BITS_PER_BYTE)


def memory_case(name: str):
    """A seed of the official size, or the grown child."""
    if name == GROWN_CHILD:
        from aiperf_core.morph.transformer import double_width

        return double_width(official_seed(), None).graph
    return official_seed(name)


def trial_config(precision: str, checkpoint: bool = False) -> TrainConfig:
    """A trial's step as the LM policy sets it: AdamW (fused on CUDA), its betas, decay and clip."""
    return TrainConfig(epochs=1, batch_size=BATCH, precision=precision, optimizer=POLICY["optimizer"],
                       betas=tuple(POLICY["adam_betas"]), weight_decay=POLICY["weight_decay"],
                       grad_clip=POLICY["grad_clip"] or None, checkpoint_blocks=checkpoint)


def text_batch(device):
    """BATCH windows of SEQ_LEN bytes of the embedded corpus, and the byte after each position."""
    train = embedded_corpus().train
    starts = np.arange(BATCH) * (SEQ_LEN + 1)
    windows = np.stack([train[s:s + SEQ_LEN + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows[:, :-1]).to(device), torch.from_numpy(windows[:, 1:]).to(device)


@pytest.mark.parametrize("seed", [OFFICIAL_SEED, LLAMA_SEED])
def test_the_official_seed_trains_at_the_official_shape_loss_finite_and_falling(device, precision, seed):
    """Item 5: the official step (12 x 768 at 1,024 tokens, batch 32) at bf16, fused AdamW: a few
    steps on one batch of text, the loss finite every step and lower at the end; and the same for the
    Llama seed of that size."""
    model = TorchBackend().lower(official_seed(seed), precision=precision)
    stepper = Stepper(model, device, trial_config(precision))
    assert stepper.optimizer.defaults.get("fused") is True
    # A rate a trial's warm-up passes through: the policy's full 1e-3 without the warm-up lifts the
    # loss for the first steps (measured on a CPU at fp32, batch 2: 6.9 -> 9.4 before it falls).
    stepper.set_lr(1e-4)
    x, y = text_batch(device)
    losses = [float(stepper.step(x, y, BATCH)) / BATCH for _ in range(8)]
    assert all(math.isfinite(loss) for loss in losses), losses
    # On a CPU at fp32, batch 2, the same eight steps went from 6.87 to 3.65 nats a byte.
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("case", [OFFICIAL_SEED, LLAMA_SEED, GROWN_CHILD])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_the_memory_estimate_is_within_a_fifth_of_max_memory_allocated(device, precision, checkpoint, case):
    """Item 3: the estimate of the official step against torch.cuda.max_memory_allocated over two
    steps (the first creates the gradients and AdamW's moments), the counter reset before lowering;
    for both seeds and a grown child (issue 50)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    graph = memory_case(case)
    stepper = Stepper(TorchBackend().lower(graph, precision=precision), device, trial_config(precision, checkpoint))
    x, y = text_batch(device)
    for _ in range(2):
        stepper.step(x, y, BATCH)
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - before
    guess = estimate(graph, BATCH, precision, POLICY["optimizer"], checkpoint)
    ratio = guess.total / measured
    print(f"{case}, {precision}, batch {BATCH}, checkpointing {checkpoint}: estimate {guess.total / 2 ** 20:.0f} MiB "
          f"{guess.to_dict()}, max_memory_allocated {measured / 2 ** 20:.0f} MiB, ratio {ratio:.3f}")
    assert abs(ratio - 1) <= TOLERANCE, (ratio, guess.to_dict(), measured)
