"""The JAX backend's routed mixture of experts (issue 40) and its native count: what the conformance kit
does not check.

The kit certifies the moe op cases against the NumPy reference (op/moe_*), an MoE GPT's training step
(train/gpt_moe_*) and the native count on 8 experts (count/moe_*), all on small batches, where a tile
holds 2 rows. Here:

* the routed lowering against the every-expert formula, values and gradients, on a batch large enough
  for tiles of 8 rows, with a skewed router (one expert takes most tokens);
* the tile rows: a power of two, at least 2, whose padding bound is within 4% of the assignments;
* the counter: a scan's products count times its length, a while loop is refused, and a moe node's
  count is the router's product and the tiles' products, forward and backward.
"""

from __future__ import annotations

import numpy as np
import pytest

from aiperf_core.backend import BackendError
from aiperf_core.ir import Graph, Node
from aiperf_conformance.cases import trained_looking_weights

from test_jax_llama import _backend


def _every_expert(x, params, attrs):
    """The IR's moe written as every expert on every token, weighted by the gates (0 for the unchosen)."""
    import jax
    import jax.numpy as jnp

    logits = jnp.matmul(x, params["router"], precision="highest")
    picked, chosen = jax.lax.top_k(logits, attrs["top_k"])
    weight = jnp.sum(jax.nn.one_hot(chosen, attrs["experts"]) * jax.nn.softmax(picked, -1)[..., None], -2)

    def up(name):
        return jnp.einsum("nsd,edf->nsef", x, params[name], precision="highest")

    if attrs.get("mlp") == "swiglu":
        hidden = jax.nn.silu(up("w_gate")) * up("w_in")
    else:
        hidden = jax.nn.gelu(up("w_in") + params["b_in"], approximate=True)
    out = jnp.einsum("nsef,efd->nsed", hidden, params["w_out"], precision="highest")
    if "b_out" in params:
        out = out + params["b_out"]
    return jnp.einsum("nse,nsed->nsd", weight, out, precision="highest")


@pytest.mark.parametrize("mlp,top_k", [("gelu", 2), ("gelu", 1), ("swiglu", 2)])
def test_the_routed_mixture_gives_the_every_expert_values_and_gradients(mlp, top_k):
    _backend()
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import moe_tile_rows

    experts, d, f, tokens = 4, 8, 12, 2 * 200
    assert moe_tile_rows(tokens * top_k, experts) >= 4  # tiles of several rows, with padding
    rng = np.random.default_rng(0)
    router = rng.normal(size=(d, experts))
    router[:, 0] += 1.0  # expert 0 takes most tokens: segments of very different lengths
    params = {"router": router, "w_in": rng.normal(size=(experts, d, f)) / 3,
              "w_out": rng.normal(size=(experts, f, d)) / 4}
    if mlp == "swiglu":
        params["w_gate"] = rng.normal(size=(experts, d, f)) / 3
    else:
        params.update(b_in=rng.normal(size=(experts, f)), b_out=rng.normal(size=(experts, d)))
    params = {name: jnp.asarray(value, jnp.float32) for name, value in params.items()}
    x = jnp.asarray(rng.normal(size=(2, tokens // 2, d)), jnp.float32)
    attrs = {"experts": experts, "top_k": top_k, "units": f, "mlp": mlp}
    assert_routed_matches_every_expert(x, params, attrs, jnp.asarray(rng.normal(size=x.shape), jnp.float32))


def assert_routed_matches_every_expert(x, params, attrs, probe):
    """The routed mixture's value and gradients (to x and every parameter) of sum(moe(x) * probe) equal
    the every-expert formula's, to float32 rounding over the tokens."""
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.lowering import mixture_of_experts

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x, p: jnp.sum(fn(x, p, attrs) * probe), (0, 1)))(x, params)

    tokens = x.shape[0] * x.shape[1]
    routed, formula = loss(mixture_of_experts), loss(_every_expert)
    for got, want in zip(jax.tree.leaves(routed), jax.tree.leaves(formula)):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6 * scale * tokens ** 0.5)


@pytest.mark.parametrize("assignments,experts", [(64, 8), (400, 8), (8192, 8), (8192, 64), (10 ** 6, 8), (3, 2)])
def test_a_tile_holds_a_power_of_two_rows_and_pads_within_four_percent(assignments, experts):
    _backend()
    from aiperf_backends.jax.lowering import moe_tile_rows

    rows = moe_tile_rows(assignments, experts)
    assert rows >= 2 and rows & (rows - 1) == 0
    if rows > 2:
        assert experts * (rows - 1) <= 0.04 * assignments
    assert experts * (2 * rows - 1) > 0.04 * assignments  # the largest such


def test_the_counter_counts_a_scans_products_times_its_length():
    _backend()
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.counter import _dots_flops

    def looped(x, w):
        return jax.lax.scan(lambda _, row: (None, jnp.matmul(row, w)), None, x)[1]

    assert _dots_flops("loop", looped, (5, 4, 8), (8, 16)) == 5 * 2 * 4 * 8 * 16


def test_the_counter_refuses_a_while_loop():
    _backend()
    import jax
    import jax.numpy as jnp

    from aiperf_backends.jax.counter import _dots_flops

    def looped(x, w):
        return jax.lax.while_loop(lambda c: jnp.sum(c) < 1e3, lambda c: jnp.matmul(c, w), x)

    with pytest.raises(BackendError, match="while loop"):
        _dots_flops("loop", looped, (4, 8), (8, 8))


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_native_moe_count_is_the_routers_and_the_tiles_products(mlp):
    from aiperf_backends.jax.lowering import moe_tile_rows

    backend = _backend()
    experts, top_k, d, f, seq, batch = 8, 2, 8, 16, 40, 3
    graph = Graph((Node("x", "input", (), {"shape": [seq, d]}),
                   Node("pre", "dense", ("x",), {"units": d}),
                   Node("moe", "moe", ("pre",), {"experts": experts, "top_k": top_k, "units": f, "mlp": mlp}),
                   Node("head", "dense", ("moe",), {"units": 3}),
                   Node("probs", "softmax", ("head",), {})), name="moe")
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    assignments = batch * seq * top_k
    rows = moe_tile_rows(assignments, experts)
    tile_rows = (assignments + experts * (rows - 1)) // rows * rows
    projections = 3 if mlp == "swiglu" else 2
    forward = 2 * batch * seq * d * experts + 2 * tile_rows * projections * d * f
    counter = backend.native_counter()
    assert counter.count(model, batch, False)["moe"] == forward
    assert counter.count(model, batch, True)["moe"] == 3 * forward  # weight and input gradients of each
