"""The torch backend's segment products of a moe as one autograd node (lowering.SegmentProducts, issue 40
item 5): the same outputs and gradients as each expert's own products under autograd (lowering.Experts.expert),
experts without tokens and no tokens at all included, in fp32 and under bf16 autocast; and the work it
dispatches: the routed products and no stack-sized zero gradient per expert."""

from __future__ import annotations

import pytest
import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)
from torch.utils._python_dispatch import TorchDispatchMode

from aiperf_backends.torch import lowering

WIDTH, UNITS, EXPERTS = 8, 12, 4
SIZES = (3, 0, 5, 2)  # expert 1 gets no token


class DispatchedOps(TorchDispatchMode):
    """The aten ops a region dispatches, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


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


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_segment_products_and_their_gradients_are_each_experts_own(mlp):
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(SIZES))
    got = grads_of(module, tokens, lambda t: module.segment_products(t, None, list(SIZES)))
    want = grads_of(module, tokens, per_expert(module, SIZES))
    for g, w in zip(got, want):
        if w is None:  # the router's: the products do not use it
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
    for p in module.parameters():
        if p is not module.router:
            assert not p.grad[1].any()  # the expert that got no token: a zero gradient, present


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


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_under_bf16_autocast_the_products_run_in_bf16_and_the_gradients_come_back_in_fp32(mlp):
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(SIZES))
    want = grads_of(module, tokens, lambda t: module.segment_products(t, None, list(SIZES)))

    def products(t):
        with torch.autocast("cpu", dtype=torch.bfloat16), DispatchedOps() as ops:
            out = module.products(t, None, None, t.device, list(SIZES))
        assert {"mm", "addmm"} & set(ops.names)
        return out

    got = grads_of(module, tokens, products)
    assert got[0].dtype == torch.bfloat16
    for g, w in zip(got[1:], want[1:]):
        if w is None:
            continue
        assert g.dtype == torch.float32
        assert float((g - w).norm() / w.norm()) < 3e-2


@pytest.mark.parametrize("mlp, forward, backward", [("gelu", 2, 4), ("swiglu", 3, 6)])
def test_the_block_runs_the_routed_products_and_fills_only_the_gradients_of_experts_without_tokens(
        mlp, forward, backward):
    """Per non-empty segment: the forward's products and, in the backward, each product's weight and input
    gradient (the hidden gradient, each weight's, the tokens'); one zero fill per stack for the one empty
    expert, never one stack-sized zero gradient per expert."""
    module = experts_module(mlp)
    tokens = sorted_tokens(sum(SIZES)).requires_grad_()
    busy = sum(1 for size in SIZES if size)
    with DispatchedOps() as forward_ops:
        out = module.segment_products(tokens, None, list(SIZES))
    assert forward_ops.names.count("mm") + forward_ops.names.count("addmm") == forward * busy
    with DispatchedOps() as backward_ops:
        out.sum().backward()
    products = backward_ops.names.count("mm") + backward_ops.names.count("addmm")
    assert products == backward * busy
    stacks = sum(1 for name, _ in module.named_parameters() if name != "router")
    assert backward_ops.names.count("zero_") + backward_ops.names.count("fill_") == stacks  # expert 1's slices
    assert "select_backward" not in backward_ops.names
