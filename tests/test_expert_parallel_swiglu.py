"""Expert parallelism with SwiGLU experts (a Llama's MLP upcycled, mlp: swiglu, no biases, a w_gate stack)
on torch and jax: the kit's expert-parallel scenario on that model, 2 devices against 1 (the kit's own check
trains GELU experts)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cpu_devices import run_on_cpu_devices

_SCRIPT = """
import json
from aiperf_conformance.levels import parallel
from aiperf_core.builders import llama
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.registry import load_backend

def graph():
    return upcycle_moe(llama(layers=1, hidden=16, heads=2, kv_heads=1, seq_len=8, vocab=32), None, "h0_gate",
                       seed=5).graph

if __name__ == "__main__":
    assert [n.attrs.get("mlp") for n in graph().nodes if n.op == "moe"] == ["swiglu"]
    scenario = parallel.Scenario(graph, 2 * parallel.BATCH + 3, 5, 2, lm=True, expert_parallel=True)
    outcome = parallel._data_parallel(load_backend("{backend}"), parallel.EXPERT_PARALLEL_CHECK, scenario, 0, 1e-4)
    print(json.dumps({{"passed": bool(outcome.passed), "message": outcome.message}}))
"""


BACKENDS = ["torch", "jax"]


@pytest.fixture(scope="module")
def runs(request):
    """Each selected backend's subprocess, all started with the first test, side by side (each mostly on one
    core); each test waits for its own."""
    test = "test_swiglu_experts_train_expert_parallel_as_on_one_device"
    wanted = [b for b in BACKENDS if any(item.module is request.module and item.originalname == test
                                         and item.callspec.params["backend"] == b for item in request.session.items)]
    with ThreadPoolExecutor(len(wanted) or 1) as pool:
        yield {b: pool.submit(run_on_cpu_devices, _SCRIPT.format(backend=b)) for b in wanted}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_swiglu_experts_train_expert_parallel_as_on_one_device(runs, backend):
    found = runs[backend].result()
    assert found["passed"], found["message"]
    assert "expert load equal every epoch" in found["message"]
    assert "35 training images counted exactly" in found["message"]
