"""The torch backend's segment products of a moe as one autograd node (lowering.SegmentProducts, issue 40
item 5): the same outputs and gradients as each expert's own products under autograd (lowering.Experts.expert),
experts without tokens and no tokens at all included, with and without the batched block of the rows every
expert has, in fp32 and under bf16 autocast; and the work it dispatches: the routed products and no
stack-sized zero gradient per expert."""

from __future__ import annotations

import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)

from aiperf_backends.torch import lowering
from test_torch_moe_dispatch import DispatchedOps

WIDTH, UNITS, EXPERTS = 8, 12, 4
SIZES = (3, 0, 5, 2)  # expert 1 gets no token: no block, one product per segment
# Every expert has rows: a block of the 2 (of 3) rows each has, then the rest; every expert the same rows.
LAYOUTS = [SIZES, (3, 4, 5, 2), (3, 3, 3, 3)]
PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of a few rows, so that these small cases run the batched block (lowering.BLOCK_MIN_ROWS)."""
    monkeypatch.setattr(lowering, "BLOCK_MIN_ROWS", 1)


def experts_module(mlp: str) -> lowering.Experts:
    module = lowering.Experts(WIDTH, {"experts": EXPERTS, "units": UNITS, "top_k": 2, "mlp": mlp})
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return module


def sorted_tokens(rows: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(1))


def grads_of(module, tokens, products):
    """(outputs, the tokens' gradient, each parameter's gradient) of a weighted sum of `products`' outputs."""
    module.zero_grad(set_to_none=True)
    tokens = tokens.clone().requires_grad_()
    out = products(tokens)
    weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out.float() * weights).sum().backward()
    return [out.detach(), tokens.grad] + [p.grad for p in module.parameters()]


def per_expert(module, sizes):
    """The reference: each non-empty segment through Experts.expert, under autograd."""
    def products(tokens):
        segments = tokens.split(list(sizes))
        return torch.cat([module.expert(e, segment) for e, segment in enumerate(segments) if sizes[e]])
    return products


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_segment_products_and_their_gradients_are_each_experts_own(mlp, sizes):
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(sizes))
    got = grads_of(module, tokens, lambda t: module.segment_products(t, None, list(sizes)))
    want = grads_of(module, tokens, per_expert(module, sizes))
    for g, w in zip(got, want):
        if w is None:  # the router's: the products do not use it
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
    for p in module.parameters():
        if p is not module.router and 0 in sizes:
            assert not p.grad[sizes.index(0)].any()  # the expert that got no token: a zero gradient, present


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_offsets_give_the_sizes_when_the_caller_has_not_read_them(mlp):
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(SIZES))
    offsets = torch.tensor(SIZES).cumsum(0).to(torch.int32)
    with torch.no_grad():
        got = module.segment_products(tokens, offsets)
        want = per_expert(module, SIZES)(tokens)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_no_token_at_all_gives_no_rows_and_zero_gradients(mlp):
    module = experts_module(mlp)
    tokens = torch.zeros(0, WIDTH, requires_grad=True)
    out = module.segment_products(tokens, None, [0] * EXPERTS)
    assert out.shape == (0, WIDTH)
    out.sum().backward()
    for name, p in module.named_parameters():
        if name != "router":
            assert p.grad is not None and not p.grad.any(), name
    assert tokens.grad.shape == (0, WIDTH)


def test_the_tokens_may_need_no_gradient():
    module = experts_module("gelu")
    tokens = sorted_tokens(sum(SIZES))
    module.segment_products(tokens, None, list(SIZES)).sum().backward()
    reference = experts_module("gelu")
    per_expert(reference, SIZES)(tokens).sum().backward()
    for p, q in zip(module.parameters(), reference.parameters()):
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", LAYOUTS[:2])
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_under_bf16_autocast_the_products_run_in_bf16_and_the_gradients_come_back_in_fp32(mlp, sizes):
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(sizes))
    want = grads_of(module, tokens, lambda t: module.segment_products(t, None, list(sizes)))

    def products(t):
        with torch.autocast("cpu", dtype=torch.bfloat16), DispatchedOps() as ops:
            out = module.products(t, None, None, t.device, list(sizes))
        assert set(PRODUCTS) & set(ops.names)
        return out

    got = grads_of(module, tokens, products)
    assert got[0].dtype == torch.bfloat16
    for g, w in zip(got[1:], want[1:]):
        if w is None:
            continue
        assert g.dtype == torch.float32
        assert float((g - w).norm() / w.norm()) < 3e-2


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("mlp, forward, backward", [("gelu", 2, 4), ("swiglu", 3, 6)])
def test_the_block_runs_the_routed_products_and_fills_only_the_gradients_of_experts_without_tokens(
        mlp, forward, backward, sizes):
    """Per group of rows (the batched block of the rows every expert has, and each expert's other rows): the
    forward's products and, in the backward, each product's weight and input gradient (the hidden gradient,
    each weight's, the tokens'); one zero fill per stack for an expert without rows, never one stack-sized
    zero gradient per expert."""
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(sizes)).requires_grad_()
    block = min(sizes)
    groups = (1 if block else 0) + sum(1 for size in sizes if size > block)
    with DispatchedOps() as forward_ops:
        out = module.segment_products(tokens, None, list(sizes))
    assert sum(forward_ops.names.count(name) for name in PRODUCTS) == forward * groups
    assert ("bmm" in forward_ops.names or "baddbmm" in forward_ops.names) == bool(block)
    with DispatchedOps() as backward_ops:
        out.sum().backward()
    assert sum(backward_ops.names.count(name) for name in PRODUCTS) == backward * groups
    stacks = sum(1 for name, _ in module.named_parameters() if name != "router")
    idle = sizes.count(0)
    assert backward_ops.names.count("zero_") + backward_ops.names.count("fill_") == stacks * idle
    assert "select_backward" not in backward_ops.names


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_flop_counter_mode_books_what_the_per_expert_products_book(mlp, sizes):
    """The native counter's rule (FlopCounterMode): the block's batched products and the rest count exactly
    the FLOPs of each expert's own products, forward and backward."""
    from torch.utils.flop_counter import FlopCounterMode

    module = experts_module(mlp)
    tokens = sorted_tokens(sum(sizes))

    def flops(products):
        counter = FlopCounterMode(display=False)
        with counter:
            grads_of(module, tokens, products)
        return counter.get_total_flops()

    got = flops(lambda t: module.segment_products(t, None, list(sizes)))
    assert got == flops(per_expert(module, sizes)) > 0


def test_small_segments_run_one_product_each_by_default(monkeypatch):
    monkeypatch.setattr(lowering, "BLOCK_MIN_ROWS", 128)
    module = experts_module("gelu")
    with torch.no_grad(), DispatchedOps() as ops:
        module.segment_products(sorted_tokens(14), None, [3, 4, 5, 2])
    assert "bmm" not in ops.names and "baddbmm" not in ops.names and ops.names.count("addmm") == 8
