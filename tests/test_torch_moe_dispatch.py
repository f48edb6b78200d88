"""The torch backend's sorted dispatch of a moe (lowering.Experts, issue 40): the assignments sorted by
expert into contiguous segments, one host read per moe layer on a CPU, torch._grouped_mm over the segments'
device offsets where it fits (CUDA, bf16), the native counter's `moe` category, and what a compiled step of a
GPT with an upcycled MoE costs (docs/backends/torch.md).

torch's CPU build has its own torch._grouped_mm, so the grouped path runs here with `grouped_mm_fits` forced
true: its offsets, its bias rows and its products, never CUDA's kernel (unverified without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)
from torch.utils._python_dispatch import TorchDispatchMode

from aiperf_backends.torch import TorchBackend, lowering
from aiperf_backends.torch.counter import CONVENTION, TorchFlopCounter, grouped_mm_flops
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.levels.count import BATCH, MOE_CASES, analytic_for_counter, moe_graph, moe_products
from aiperf_core.builders import gpt
from aiperf_core.morph import transformer as transformer_morph


@pytest.fixture(scope="module")
def backend():
    return TorchBackend()


@pytest.fixture
def grouped(monkeypatch):
    """Every moe runs torch._grouped_mm, as on CUDA in bf16."""
    monkeypatch.setattr(lowering, "grouped_mm_fits", lambda *args: True)


def experts_of(model) -> lowering.Experts:
    (module,) = (m for m in model.modules() if isinstance(m, lowering.Experts))
    return module


class DispatchedOps(TorchDispatchMode):
    """The aten ops a region dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# -- the segments --------------------------------------------------------------------------------------


def test_the_segments_are_the_assignments_sorted_stably_by_expert_with_cumulative_int32_offsets():
    chosen = torch.tensor([[3, 0], [0, 3], [5, 3], [0, 2]])  # experts 1 and 4 chosen by nobody, 6 and 7 either
    order, offsets = lowering.expert_segments(chosen, 8)
    assert order.tolist() == [1, 2, 6, 7, 0, 3, 5, 4]  # (token, slot) = (i // 2, i % 2), ties in token order
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [3, 3, 4, 7, 7, 8, 8, 8]
    assert chosen.reshape(-1)[order].tolist() == [0, 0, 0, 2, 3, 3, 3, 5]


def test_the_offsets_count_every_expert_on_random_routings():
    rng = np.random.default_rng(0)
    for experts, top_k in ((8, 2), (8, 1), (3, 3)):
        chosen = np.stack([rng.permutation(experts)[:top_k] for _ in range(37)])
        order, offsets = lowering.expert_segments(torch.from_numpy(chosen), experts)
        assert np.array_equal(offsets.numpy(), np.cumsum(np.bincount(chosen.ravel(), minlength=experts)))
        assert np.array_equal(order.numpy(), np.argsort(chosen.ravel(), kind="stable"))


# -- the two paths -------------------------------------------------------------------------------------


def moe_model(backend, name: str):
    graph = moe_graph(name)
    return graph, backend.lower(graph, trained_looking_weights(graph, 0))


def forward_and_grads(model, x):
    x = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in experts_of(model).parameters()]


def routed_reference(experts: lowering.Experts, tokens):
    """Each token's gate-weighted sum of its chosen experts' outputs, one token at a time."""
    logits = tokens @ experts.router
    chosen = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :experts.top_k]
    gates = torch.gather(logits, 1, chosen).softmax(dim=-1)
    return torch.stack([sum(g * experts.expert(int(e), t[None])[0] for e, g in zip(es, gs))
                        for t, es, gs in zip(tokens, chosen, gates)])


@pytest.mark.parametrize("name", MOE_CASES)
def test_the_sorted_dispatch_is_each_tokens_gated_sum_of_its_experts(backend, name):
    _, model = moe_model(backend, name)
    experts = experts_of(model)
    tokens = torch.from_numpy(np.random.default_rng(1).normal(0, 1, (40, 8)).astype(np.float32))
    with torch.no_grad():
        got, want = experts(tokens), routed_reference(experts, tokens)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MOE_CASES)
def test_the_grouped_products_equal_the_segment_products_with_their_gradients(backend, monkeypatch, name):
    _, model = moe_model(backend, name)
    x = torch.from_numpy(np.random.default_rng(2).normal(0, 1, (2, 16, 8)).astype(np.float32))
    segments = forward_and_grads(model, x)
    monkeypatch.setattr(lowering, "grouped_mm_fits", lambda *args: True)
    grouped = forward_and_grads(model, x)
    for got, want in zip(grouped, segments):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_grouped_products_run_in_bf16_under_autocast(backend, grouped):
    _, model = moe_model(backend, "gelu_top2")
    x = torch.from_numpy(np.random.default_rng(3).normal(0, 1, (2, 16, 8)).astype(np.float32))
    with torch.no_grad():
        want = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16), DispatchedOps() as ops:
            got = model(x)
    assert "_grouped_mm" in ops.names
    assert float((got.float() - want).norm() / want.norm()) < 2e-2


def test_the_segment_path_reads_the_host_once_per_moe_layer(backend, monkeypatch):
    _, model = moe_model(backend, "gelu_top2")
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.numel()) or tolist(self))
    with torch.no_grad(), DispatchedOps() as ops:
        model(torch.zeros(2, 16, 8))
    assert reads == [8]  # the 8 segment sizes, once
    assert not {"nonzero", "item", "_local_scalar_dense"} & set(ops.names)


def test_the_grouped_path_never_reads_the_host(backend, grouped, monkeypatch):
    _, model = moe_model(backend, "swiglu_top2")
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("a host read"))
    with torch.no_grad(), DispatchedOps() as ops:
        model(torch.zeros(2, 16, 8))
    assert ops.names.count("_grouped_mm") == 3
    assert not {"nonzero", "item", "_local_scalar_dense"} & set(ops.names)


# -- the native counter --------------------------------------------------------------------------------


def test_grouped_mm_flops_are_two_per_multiply_accumulate():
    assert grouped_mm_flops((10, 8), (3, 8, 16), (3,), out_shape=(10, 16)) == 2 * 10 * 8 * 16  # forward
    assert grouped_mm_flops((8, 10), (10, 16), (3,), out_shape=(3, 8, 16)) == 2 * 8 * 10 * 16  # weight grad
    assert grouped_mm_flops((3, 5, 8), (3, 8, 16), out_shape=(3, 5, 16)) == 2 * 3 * 5 * 8 * 16  # batched


@pytest.mark.parametrize("path", ["segments", "grouped"])
@pytest.mark.parametrize("name", MOE_CASES)
def test_the_counter_books_the_routed_products_under_moe(backend, monkeypatch, name, path):
    """The router's and each token's k experts' products, forward and backward (their weight and input
    gradients), exactly; nothing of the moe's under dense."""
    if path == "grouped":
        monkeypatch.setattr(lowering, "grouped_mm_fits", lambda *args: True)
    graph, model = moe_model(backend, name)
    for backward in (False, True):
        counted = TorchFlopCounter().count(model, BATCH, backward)
        assert counted["moe"] == moe_products(graph, backward) * BATCH
        assert counted["dense"] == analytic_for_counter(graph, CONVENTION, backward)["dense"]


# -- the compiled step ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def upcycled_gpt():
    """A 2-layer GPT whose first MLP is 8 experts, top-2."""
    graph = gpt(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
    morphed = transformer_morph.upcycle_moe(graph, trained_looking_weights(graph, 0), "h0_fc1", experts=8,
                                            top_k=2, seed=1)
    return morphed.graph, morphed.weights


def token_batch(seed: int):
    rng = np.random.default_rng(seed)
    return tuple(torch.from_numpy(rng.integers(0, 64, (4, 16))) for _ in range(2))


def test_an_upcycled_gpt_step_breaks_the_graph_at_each_level_of_its_moe_call(backend, upcycled_gpt):
    """The segment products are outside the graph (torch.compiler.disable): the break lands in the moe's
    forward, the block function that calls it and the model's forward that calls the block, each split in
    two: 6 breaks, 7 graphs (docs/backends/torch.md)."""
    model = backend.lower(*upcycled_gpt)
    model.train()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model._training_loss)(model, *token_batch(0), 0.0)
    assert explained.graph_break_count == 6
    assert explained.graph_count == 7
    assert all("disable" in reason.reason for reason in explained.break_reasons)


def test_an_upcycled_gpt_compiles_once_whatever_the_routing(backend, upcycled_gpt):
    """The segment sizes are read outside the graphs, so a new routing is no new graph (dynamo only)."""
    from torch._dynamo.utils import counters

    model = backend.lower(*upcycled_gpt)
    model.train()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model._training_loss, backend="eager")
    graphs = []
    for seed in range(3):
        compiled(model, *token_batch(seed), 0.0).backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [7, 7, 7]
    assert not counters["recompiles"]


def test_an_upcycled_gpt_step_with_grouped_products_is_one_graph(backend, upcycled_gpt, grouped):
    """The grouped path has no data-dependent shape: dynamo traces it whole (in bf16, the dtype of
    torch._grouped_mm's meta function)."""
    model = backend.lower(*upcycled_gpt)
    model.train()
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model._training_loss)(model, *token_batch(0), 0.0)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
