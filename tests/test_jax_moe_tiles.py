"""The jax routed mixture's tiles in levels of decreasing rows (lowering.moe_tile_levels) and its custom
VJP (lowering._tiles_backward): the layout holds every routing, from balanced to every token on one
expert, with the padding bound of tiles of b rows alone, and the values and gradients are the
every-expert formula's."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from test_jax_llama import _backend
from test_jax_moe import _every_expert


@pytest.mark.parametrize("assignments,experts", [(64, 8), (800, 4), (2048, 8), (8192, 8), (8192, 64), (3, 2),
                                                 (10 ** 6, 8)])
def test_the_levels_hold_the_padded_rows_of_tiles_of_b_in_fewer_tiles(assignments, experts):
    _backend()
    from aiperf_backends.jax.lowering import moe_tile_levels, moe_tile_rows

    rows = moe_tile_rows(assignments, experts)
    levels = moe_tile_levels(assignments, experts, rows)
    sizes = [size for size, _ in levels]
    assert sizes == sorted(set(sizes), reverse=True) and sizes[-1] == rows
    assert all(size % rows == 0 and count > 0 for size, count in levels)
    # the same rows as (T k + E (b - 1)) / b tiles of b: the padding bound E (b - 1) is unchanged
    assert sum(size * count for size, count in levels) == (assignments + experts * (rows - 1)) // rows * rows
    assert sum(count for _, count in levels) <= (assignments + experts * (rows - 1)) // rows
    if assignments == 2048:  # the benchmark's layer (T 1024, top 2, E 8): 55 tiles, not 263
        assert levels == ((128, 8), (64, 8), (32, 8), (16, 8), (8, 23))


def _routed_against_formula(router_bias, top_k: int, mlp: str = "gelu", experts: int = 4, tokens: int = 400):
    """The routed mixture's output and gradients against the every-expert formula's, the router's logits
    shifted by `router_bias` (E,) so that the routing is as skewed as wanted."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import moe_tile_levels, moe_tile_rows

    d, f = 8, 12
    assert len(moe_tile_levels(tokens * top_k, experts, moe_tile_rows(tokens * top_k, experts))) >= 2
    rng = np.random.default_rng(1)
    params = {"router": rng.normal(size=(d + 1, experts)) / 3, "w_in": rng.normal(size=(experts, d + 1, f)) / 3,
              "w_out": rng.normal(size=(experts, f, d + 1)) / 4}
    params["router"][d] = router_bias  # the last input feature is 1: a bias on each expert's logit
    if mlp == "swiglu":
        params["w_gate"] = rng.normal(size=(experts, d + 1, f)) / 3
    else:
        params.update(b_in=rng.normal(size=(experts, f)), b_out=rng.normal(size=(experts, d + 1)))
    params = {name: jnp.asarray(value, jnp.float32) for name, value in params.items()}
    x = np.concatenate([rng.normal(size=(2, tokens // 2, d)), np.ones((2, tokens // 2, 1))], axis=-1)
    x = jnp.asarray(x, jnp.float32)
    probe = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    routed, formula = (fn(x, params, probe) for fn in _value_and_grads(mlp, top_k, experts, f))
    for got, want in zip(jax.tree.leaves(routed), jax.tree.leaves(formula)):  # test_jax_moe's tolerance
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=2e-6 * scale * (x.shape[0] * x.shape[1]) ** 0.5)


@functools.cache
def _value_and_grads(mlp: str, top_k: int, experts: int, units: int):
    """The jitted value and gradients (to x and every parameter) of sum(moe(x) * probe), routed and by the
    every-expert formula (test_jax_moe.assert_routed_matches_every_expert, with the probe an argument): one
    compilation each for every routing of the same shapes, the routing being the router's values."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import mixture_of_experts

    attrs = {"experts": experts, "top_k": top_k, "units": units, "mlp": mlp}

    def compiled(fn):
        return jax.jit(jax.value_and_grad(lambda x, p, probe: jnp.sum(fn(x, p, attrs) * probe), (0, 1)))

    return compiled(mixture_of_experts), compiled(_every_expert)


@pytest.mark.parametrize("name,bias,top_k", [
    ("balanced", [0.0, 0.0, 0.0, 0.0], 2),
    ("every token on expert 2", [0.0, 0.0, 50.0, 0.0], 1),
    ("every token on experts 3 and 0", [40.0, 0.0, 0.0, 50.0], 2),
    ("one expert idle, one most", [5.0, -50.0, 0.0, 0.0], 2),
])
def test_every_routing_fits_the_levels_and_gives_the_formulas_values_and_gradients(name, bias, top_k):
    _backend()
    _routed_against_formula(np.asarray(bias), top_k)


def test_swiglu_experts_through_the_custom_vjp_give_the_formulas_gradients():
    _backend()
    _routed_against_formula(np.asarray([2.0, 0.0, 0.0, 0.0]), 2, mlp="swiglu")
