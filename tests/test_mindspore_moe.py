"""The MindSpore lowering's routed mixture of experts (issue 40): each expert's products run on the rows of
the tokens that chose it, with one host read per moe layer; ties in the router go to the lower index, as the
IR says (ops.topk does not do that); the native counter books the routed products, exactly, under 'moe'; data
parallelism over two CPU workers trains an upcycled GPT as one process does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from aiperf_backends.mindspore import MindSporeBackend

# `make test` installs MindSpore: a missing one is a failure here, never a skip.
assert MindSporeBackend.availability().available, MindSporeBackend.availability().reason

import mindspore as ms  # noqa: E402

from aiperf_backends.mindspore.counter import MindSporeFlopsCounter  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402
from aiperf_conformance.levels.count import BATCH, MOE_CASES, moe_graph, moe_products  # noqa: E402
from aiperf_numpy.backend import NumpyBackend  # noqa: E402
from beside import beside


@pytest.fixture(scope="module")
def backend():
    return MindSporeBackend()


def assert_matches_the_reference(backend, graph, weights, seed: int):
    """Outputs, loss and the moe's gradients against the NumPy reference; returns the moe's gradients."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH,) + graph.input_shape).astype(np.float32)
    labels = rng.integers(0, graph.output_shape[-1], (BATCH,) + graph.output_shape[:-1])
    reference = NumpyBackend()
    model, oracle = backend.lower(graph, weights), reference.lower(graph, weights)
    want = reference.predict_checked(oracle, x)
    got = backend.predict_checked(model, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    loss, grads = backend.loss_and_grads_checked(model, x, labels, 0.0)
    want_loss, want_grads = reference.loss_and_grads_checked(oracle, x, labels, 0.0)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, want_grad in want_grads["op"].items():
        scale = max(np.linalg.norm(want_grad), 1e-12)
        assert np.linalg.norm(grads["op"][name] - want_grad) / scale < 1e-4, name
    return grads["op"]


@pytest.mark.parametrize("name", MOE_CASES)
def test_the_routed_experts_match_the_reference(backend, name):
    graph = moe_graph(name)
    assert_matches_the_reference(backend, graph, trained_looking_weights(graph, 0), 1)


def test_tied_logits_choose_the_lower_index_and_unchosen_experts_get_no_gradient(backend):
    graph = moe_graph("gelu_top1")
    weights = trained_looking_weights(graph, 0)
    weights["op"]["router"][:, 2:] = weights["op"]["router"][:, 2:3]  # experts 2 to 7 always tie
    grads = assert_matches_the_reference(backend, graph, weights, 2)
    # Among the tied experts only expert 2 (the lowest index) is ever chosen.
    assert grads["w_in"][:3].any() and not grads["w_in"][3:].any() and not grads["w_out"][3:].any()


def test_a_forward_reads_the_host_once_per_moe_layer(backend, monkeypatch):
    graph = moe_graph("swiglu_top2")
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    x = np.random.default_rng(3).standard_normal((BATCH,) + graph.input_shape).astype(np.float32)
    reads = []
    asnumpy = ms.Tensor.asnumpy
    monkeypatch.setattr(ms.Tensor, "asnumpy", lambda self: reads.append(self.shape) or asnumpy(self))
    experts = next(cell for cell in model.cells_and_names() if type(cell[1]).__name__ == "Experts")[1]
    experts(ms.Tensor(x))
    assert reads == [(BATCH * graph.input_shape[0], MOE_CASES["swiglu_top2"]["experts"])]  # the logits


@pytest.mark.parametrize("name", MOE_CASES)
@pytest.mark.parametrize("backward", (False, True))
def test_the_counter_books_exactly_the_routed_products_under_moe(backend, name, backward):
    graph = moe_graph(name)
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    assert MindSporeFlopsCounter().count(model, BATCH, backward)["moe"] == moe_products(graph, backward) * BATCH


_DATA_PARALLEL_SCRIPT = """
from aiperf_backends.mindspore import MindSporeBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.levels import parallel
from aiperf_core.morph import transformer as transformer_morph

def upcycled():
    graph = parallel._gpt()
    weights = trained_looking_weights(graph, 0)
    return transformer_morph.upcycle_moe(graph, weights, "h0_fc1", experts=4, top_k=2, seed=1).graph

scenario = parallel.Scenario(upcycled, 2 * parallel.BATCH + 3, 5, 2, lm=True)
outcome = parallel._data_parallel(MindSporeBackend(), "gpt_moe_matches_one_device", scenario, 0, 1e-4)
print("passed" if outcome.passed else "failed", outcome.message)
"""


def _run_data_parallel(environ: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in environ.items() if k != "AIPERF_CPU_DEVICES"}
    env["AIPERF_CPU_DEVICES"] = "2"  # read once, when the backend first loads MindSpore: a fresh process
    return subprocess.run([sys.executable, "-c", textwrap.dedent(_DATA_PARALLEL_SCRIPT)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module", autouse=True)
def data_parallel(request):
    """The data-parallel subprocess, started with the module's first test when its test is selected, so that
    the in-process tests run beside it (its cluster's processes mostly wait); its test waits for it."""
    yield from beside(request, "test_data_parallel_training_of_an_upcycled_gpt_matches_one_process",
                      _run_data_parallel, dict(os.environ))


@pytest.mark.slow
def test_data_parallel_training_of_an_upcycled_gpt_matches_one_process(data_parallel):
    """The kit's GPT data-parallel scenario (AdamW, a clip that engages, an uneven last batch) with its MLP
    upcycled to 4 experts, top-2: each rank routes its own shard."""
    out = data_parallel.result()
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("passed"), out.stdout[-2000:]
