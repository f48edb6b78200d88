"""Expert parallelism in the torch backend (issue 40, item 2; backends/torch/expert_parallel.py).

The model is a small GPT whose MLP is upcycled to E = 4 experts, top-2, with trained-looking weights
(distinct experts, a random router). On 2 CPU ranks (gloo) each rank holds experts [0, 2) or [2, 4),
and tokens travel to their experts by all_to_all_single and back. Training must equal one device's
on the combined batch: the same computation up to float32 summation order, so ~1e-5 relative, the
bound of tests/test_torch_distributed.py. The attention key biases are left out of the weight
comparison, as the kit leaves them out: their exact gradient is zero, and AdamW turns rounding into
steps of up to the learning rate.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)
import torch.distributed as dist  # noqa: E402

assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is not available"

from aiperf_backends.torch import TorchBackend  # noqa: E402
from aiperf_backends.torch.distributed import make_job, rank_queue, run_rank_steps  # noqa: E402
from aiperf_backends.torch.expert_parallel import ShardedExperts, ignored_parameter_names, shard_experts  # noqa: E402
from aiperf_backends.torch.training import Stepper, device_of  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.op import key_biases  # noqa: E402
from aiperf_core.backend import Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import gpt  # noqa: E402
from aiperf_core.morph import transformer as transformer_morph  # noqa: E402

from cpu_devices import run_on_cpu_devices  # noqa: E402
from test_torch_distributed import one_device_steps, run_ranks  # noqa: E402

TOL = 2e-5
SEQ, VOCAB = 8, 32


def upcycled(experts: int = 4):
    graph = gpt(layers=1, hidden=16, heads=2, seq_len=SEQ, vocab=VOCAB)
    graph = transformer_morph.upcycle_moe(graph, None, "h0_fc1", experts=experts, seed=5).graph
    return graph, trained_looking_weights(graph, 3)


def lm_config(**extra) -> TrainConfig:
    """The lm policy's step: AdamW with decay, warm-up then cosine, a clip that engages, the balance loss."""
    return TrainConfig(epochs=2, batch_size=16, seed=3, optimizer="adamw", weight_decay=0.1, grad_clip=0.05,
                       moe_aux_loss=0.01,
                       schedule=Schedule(initial=0.01, final_fraction=0.1, warmup_epochs=1, shape="cosine"), **extra)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def worst(got: dict, want: dict, skip: frozenset = frozenset()) -> tuple[float, str]:
    return max((rel_err(got[n][p], want[n][p]), f"{n}/{p}") for n in want for p in want[n] if (n, p) not in skip)


def test_torch_declares_expert_parallelism():
    declared = TorchBackend().parallelism()
    assert declared.data_parallel and declared.expert_parallel


def test_a_rank_holds_only_its_experts():
    """shard_experts, as each rank calls it: rank 1 of 2 holds experts [2, 4) of every stack (E / 2 of
    them), the whole router, and DDP is told to leave those expert parameters out."""
    graph, weights = upcycled()
    (moe_id,) = (n.id for n in graph.nodes if n.op == "moe")
    model = TorchBackend().lower(graph, weights)
    whole_params = sum(p.numel() for p in model.parameters())
    ep = shard_experts(model, rank=1, world=2, device="cpu", group=None)
    module = model.layers[model.module_names[moe_id]]
    assert isinstance(module, ShardedExperts) and model.experts == {moe_id: module}
    assert (module.start, module.stop) == (2, 4)
    for name in ("w_in", "b_in", "w_out", "b_out"):
        held = getattr(module, name).detach().numpy()
        assert held.shape[0] == 2 and held.shape[1:] == weights[moe_id][name].shape[1:]
        np.testing.assert_array_equal(held, weights[moe_id][name][2:4])
    np.testing.assert_array_equal(module.router.detach().numpy(), weights[moe_id]["router"])
    expert_numel = sum(weights[moe_id][name].size for name in ("w_in", "b_in", "w_out", "b_out"))
    assert sum(p.numel() for p in model.parameters()) == whole_params - expert_numel // 2
    prefix = f"layers.{model.module_names[moe_id]}."
    assert sorted(ignored_parameter_names(model)) == sorted(prefix + n for n in ("b_in", "b_out", "w_in", "w_out"))
    assert [p for p in ep.parameters] == module.expert_parameters()


def test_steps_gradients_match_one_device():
    """Per step, the gradient each rank's update took (every rank's experts gathered: the whole model) is
    one device's on the global batch: the expert gradients divided by world, the clip on the global norm
    (0.05 engages). Global batches of 16, 7 and 1 (rank 1's shard empty: it still exchanges). SGD with
    momentum, whose update is linear in the gradient: AdamW would turn the rounding of a near-zero gradient
    element of the zero-initialised expert biases into a step of the learning rate (the epoch tests below
    train with AdamW)."""
    graph, weights = upcycled()
    config = TrainConfig(epochs=1, batch_size=16, optimizer="sgd-momentum", momentum=0.9, grad_clip=0.05,
                         moe_aux_loss=0.01, schedule=Schedule(initial=0.05), expert_parallel=True)
    rng = np.random.default_rng(7)
    sizes = [16, 7, 1]
    batches = []
    for n in sizes:
        tokens = rng.integers(0, VOCAB, (n, SEQ + 1))
        batches.append((torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])))

    backend = TorchBackend()
    single_losses, single_grads, single_weights = one_device_steps(backend, graph, weights, config, batches)

    job = make_job(backend.lower(graph, weights), config, ["cpu", "cpu"], batches=batches, results=rank_queue())
    results = run_ranks(run_rank_steps, job, 2)
    skip = key_biases(graph)
    for rank, losses, grads, final in results:
        for step, (got, want) in enumerate(zip(grads, single_grads)):
            err, where = worst(got, want, skip)  # a key bias's gradient is rounding alone
            assert err <= TOL, f"rank {rank} step {step}: gradient {where} differs by {err:.3g}"
        err, where = worst(final, single_weights, skip)
        assert err <= TOL, f"rank {rank}: weight {where} differs by {err:.3g} after {len(sizes)} steps"
    for step in range(len(sizes)):
        assert sum(r[1][step] for r in results) == pytest.approx(single_losses[step], rel=TOL)


_TRAIN_SCRIPT = """
import json
import numpy as np
from aiperf_core.backend import Dataset
from aiperf_core.errors import GraphError
from aiperf_backends.torch import TorchBackend
from test_torch_expert_parallel import lm_config, upcycled

backend = TorchBackend()


def tokens(seed, n):
    t = np.random.default_rng(seed).integers(0, 32, (n, 9))
    return t[:, :-1], t[:, 1:]


def train(graph, weights, data, devices, **extra):
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, lm_config(devices=devices, **extra))
    return {"reports": [r.__dict__ for r in reports],
            "weights": {n: {p: a.tolist() for p, a in ps.items()} for n, ps in backend.export_weights(model).items()}}


graph, weights = upcycled()
x, y = tokens(5, 40)
uneven = Dataset(x[:35], y[:35], x[35:], y[35:], 32)  # batches of 16, 16 and 3; 5 validation sequences
x, y = tokens(6, 18)
empty = Dataset(x[:17], y[:17], x[17:], y[17:], 32)  # a last batch of 1 and 1 validation sequence: rank 1 gets none
two = ("cpu:0", "cpu:1")
out = {"one": train(graph, weights, uneven, ("cpu:0",)),
       "two": train(graph, weights, uneven, two, expert_parallel=True),
       "two_micro": train(graph, weights, uneven, two, expert_parallel=True, micro_batch=3),
       "empty_one": train(graph, weights, empty, ("cpu:0",)),
       "empty_two": train(graph, weights, empty, two, expert_parallel=True)}
odd, odd_weights = upcycled(experts=3)
try:
    train(odd, odd_weights, uneven, two, expert_parallel=True)
    out["refused"] = None
except GraphError as exc:
    out["refused"] = {"node": exc.node, "message": str(exc)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def trained():
    """One child with AIPERF_CPU_DEVICES=2 (read when torch first initialises) trains every case."""
    out = run_on_cpu_devices(_TRAIN_SCRIPT)
    graph, _ = upcycled()
    for run in out.values():
        if run is not None and "weights" in run:
            run["weights"] = {n: {p: np.asarray(a, np.float32) for p, a in ps.items()}
                              for n, ps in run["weights"].items()}
    return out, key_biases(graph)


def _matches(run: dict, one: dict, skip: frozenset, images: int, val_images: int) -> None:
    err, where = worst(run["weights"], one["weights"], skip)
    assert err <= TOL, f"weight {where} differs by {err:.3g} from one device's"
    assert len(run["reports"]) == len(one["reports"]) == 2
    for got, want in zip(run["reports"], one["reports"]):
        assert got["train_images"] == want["train_images"] == images
        assert got["val_images"] == want["val_images"] == val_images
        assert got["loss"] == pytest.approx(want["loss"], rel=TOL)
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=TOL)
        assert got["val_accuracy"] == want["val_accuracy"]
        # The router is replicated: every rank routes its own tokens, and the loads add up to one device's.
        assert got["expert_load"] == want["expert_load"]
        assert got["all_to_all_seconds"] is not None and got["all_to_all_seconds"] > 0
        assert want["all_to_all_seconds"] is None
        # DDP's all-reduce of the replicated parameters, timed by its hook (distributed.AllReduceClock).
        assert got["all_reduce_seconds"] is not None and got["all_reduce_seconds"] > 0
        assert want["all_reduce_seconds"] is None


@pytest.mark.slow
def test_training_on_two_devices_matches_one_device(trained):
    """2 epochs of the lm policy's step, an uneven last batch (35 = 16 + 16 + 3): the whole exported
    model (every rank's experts, canonical layout), the losses and the expert loads equal one device's."""
    out, skip = trained
    _matches(out["two"], out["one"], skip, 35, 5)


@pytest.mark.slow
def test_accumulated_micro_batches_match_one_device(trained):
    """micro_batch 3: shards of 8 run as 3 micro-batches, the last batch's shards (2 and 1) as one, padded
    with empty ones to the largest shard's count, so that every rank exchanges as often."""
    out, skip = trained
    _matches(out["two_micro"], out["one"], skip, 35, 5)


def test_an_empty_shard_still_exchanges(trained):
    """A last global batch of 1 and a validation set of 1: rank 1's shard is empty in that training step
    and in evaluation, and it still takes part in every all-to-all (else the run would hang)."""
    out, skip = trained
    _matches(out["empty_two"], out["empty_one"], skip, 17, 1)


def test_experts_that_do_not_divide_are_refused(trained):
    """E = 3 on 2 devices: aiperf_core.backend.check_expert_parallel refuses it, naming the moe node."""
    out, _ = trained
    refused = out["refused"]
    assert refused is not None, "3 experts were trained expert-parallel over 2 devices"
    graph, _ = upcycled(experts=3)
    (moe_id,) = (n.id for n in graph.nodes if n.op == "moe")
    assert refused["node"] == moe_id and f"'{moe_id}'" in refused["message"]


def grouped_rank_steps(rank: int, job: dict) -> None:
    """run_rank_steps with the grouped products forced (torch's CPU build has its own torch._grouped_mm):
    the path a rank's local experts take on CUDA in bf16."""
    from aiperf_backends.torch import lowering

    lowering.grouped_mm_fits = lambda *args: True
    run_rank_steps(rank, job)


@pytest.mark.slow
def test_grouped_products_of_local_experts_match_one_device(monkeypatch):
    """The local experts as torch._grouped_mm over the segments that arrived (int32 local offsets, biases by
    local expert), forced on this CPU at fp32 on both sides: one step on a global batch of 7 and one of 1
    (rank 1 receives rows but sends none) give one device's gradients. CUDA's kernel itself is unverified."""
    from aiperf_backends.torch import lowering

    monkeypatch.setattr(lowering, "grouped_mm_fits", lambda *args: True)
    graph, weights = upcycled()
    config = TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.05), moe_aux_loss=0.01,
                         expert_parallel=True)
    rng = np.random.default_rng(8)
    batches = []
    for n in (7, 1):
        tokens = rng.integers(0, VOCAB, (n, SEQ + 1))
        batches.append((torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])))
    backend = TorchBackend()
    model = backend.lower(graph, weights)
    stepper = Stepper(model, device_of(model), config)
    stepper.set_lr(config.schedule.initial)
    single_grads = []
    for xb, yb in batches:
        stepper.step(xb, yb, len(yb))
        single_grads.append(model.canonical_grads())

    job = make_job(backend.lower(graph, weights), config, ["cpu", "cpu"], batches=batches, results=rank_queue())
    results = run_ranks(grouped_rank_steps, job, 2)
    for rank, _, grads, _ in results:
        for step, (got, want) in enumerate(zip(grads, single_grads)):
            err, where = worst(got, want, key_biases(graph))
            assert err <= TOL, f"rank {rank} step {step}: gradient {where} differs by {err:.3g}"
