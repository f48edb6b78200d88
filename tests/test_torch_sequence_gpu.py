"""The torch backend's lowering of the IR's second-version ops on a CUDA GPU (`make test-gpu`; deselected
by `make test`), at every precision the GPU declares: each op forward and backward and a 2-layer GPT
against the NumPy reference with the kit's tolerances per precision (conformance/defaults.json), the
native counter on the GPU's fused attention kernels, and a GPT's training step in each precision,
eager and compiled. tests/test_backend_sequence.py checks the same at fp32 on a CPU.

Each test prints its measured errors, in units of the precision's u, before it asserts: a run on a lent
GPU is short, and the figures are what a tolerance is set from.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from aiperf_backends.torch import TorchBackend
from aiperf_backends.torch.precision import math_scope
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_conformance.cases import trained_looking_weights
from aiperf_numpy.executor import backward, forward, loss_and_grads, run
from aiperf_opcount import count
from test_backend_sequence import (CASES, _assert_gradients, _inputs, _labels, _normwise, _op_graph, _relative,
                                   _weights, _with_head)

pytestmark = pytest.mark.gpu
TOLERANCES = {p: {k: v["value"] for k, v in levels.items()}
              for p, levels in json.loads((Path(__file__).parents[1] / "conformance" / "defaults.json")
                                          .read_text())["tolerances"].items()}
UNIT = {"fp32": 2.0 ** -24, "tf32": 2.0 ** -11, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
SEQ, VOCAB = 16, 64


@pytest.fixture(scope="module")
def backend():
    assert torch.cuda.is_available(), "no CUDA device: the torch GPU tests cannot run"
    return TorchBackend()


def _precisions():
    return TorchBackend().precisions() if torch.cuda.is_available() else ["fp32", "tf32", "bf16", "fp16"]


@pytest.mark.parametrize("precision", _precisions())
def test_every_new_op_forward_and_backward_at_each_precision(backend, precision):
    tol, u = TOLERANCES[precision], UNIT[precision]
    failures = []
    for name in sorted(CASES):
        graph = _op_graph(name)
        weights = _weights(graph, 1)
        x = _inputs(graph, 3, 2)
        model = backend.lower(graph, weights, precision)
        fwd = _relative(backend.predict(model, x), forward(graph, weights, x))
        grad_in = 0.0
        if not graph.takes_tokens:
            trace = run(graph, weights, x)
            grad_out = np.random.default_rng(3).normal(0, 1, trace.output.shape)
            want, _ = backward(trace, grad_out)
            xt = torch.from_numpy(x).cuda().requires_grad_(True)
            model.eval()
            with math_scope(xt.device, precision):
                out = model(xt)
            (out.double() * torch.from_numpy(grad_out).cuda()).sum().backward()
            grad_in = _relative(xt.grad.cpu().numpy(), want)
        head = _with_head(graph)
        head_weights = _weights(head, 4)
        hx, labels = _inputs(head, 3, 5), _labels(head, 3, 6)
        _, want_grads, _ = loss_and_grads(head, head_weights, hx, labels)
        _, grads = backend.loss_and_grads(backend.lower(head, head_weights, precision), hx, labels)
        key_biases = {n.inputs[1] for n in head.nodes if n.op == "attention"}
        grad_params = max(_relative(grads[n][p], want_grads[n][p]) for n in want_grads for p in want_grads[n]
                          if not (n in key_biases and p == "bias"))
        print(f"{precision} {name}: forward {fwd / u:.2f}u, input gradient {grad_in / u:.2f}u, "
              f"parameter gradients {grad_params / u:.2f}u")
        if fwd > tol["op"] or max(grad_in, grad_params) > tol["op_grad"]:
            failures.append(name)
    assert not failures, f"{precision}: {failures} beyond op {tol['op']} / op_grad {tol['op_grad']}"


@pytest.mark.parametrize("precision", _precisions())
def test_a_gpt_end_to_end_at_each_precision(backend, precision):
    graph = gpt(2, 64, 4, SEQ, VOCAB)
    weights = trained_looking_weights(graph, 0)
    x, labels = _inputs(graph, 4, 1), _labels(graph, 4, 2)
    model = backend.lower(graph, weights, precision)
    logits_error = _relative(backend.predict(model, x), forward(graph, weights, x))
    _, want, _ = loss_and_grads(graph, weights, x, labels)
    _, grads = backend.loss_and_grads(model, x, labels)
    worst = max((_normwise(grads[n][p], want[n][p]), n, p) for n in want for p in want[n]
                if not (graph[n].op == "dense" and p == "bias" and n.endswith("_k")))
    u = UNIT[precision]
    print(f"{precision} gpt: output {logits_error / u:.2f}u, worst gradient {worst[0] / u:.1f}u ({worst[1]} {worst[2]})")
    # The kit's graph tolerance is 4u (CNNs: batch norm renormalises each layer). A GPT's logits pass two
    # blocks of mixed-precision products whose errors each layer norm scales by 1/sigma, and the lm head
    # rounds its output: with autocast emulated on a CPU they measured 4.0u (bf16) and 7.3u (fp16).
    assert logits_error <= (TOLERANCES["fp32"]["graph"] if precision == "fp32" else 16 * u)
    _assert_gradients(graph, grads, want, _normwise, TOLERANCES[precision]["train_grad"])


def test_the_counter_counts_the_fused_attention_kernels_of_a_gpu(backend):
    graph = gpt(2, 64, 4, SEQ, VOCAB)
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    counter = backend.native_counter()
    analytic = count(graph, counter.convention.padding).by_category()
    for backward_too in (False, True):
        native = counter.count(model, 2, backward_too)
        print(f"counter backward={backward_too}: {native}")
        for category in ("dense", "attention"):
            want = analytic[category]["fp"] + (analytic[category]["bp"] if backward_too else 0)
            assert native[category] == 2 * want, (category, backward_too)


@pytest.mark.parametrize("precision,compile_mode", [(p, "never") for p in _precisions()] + [("bf16", "always")])
def test_a_gpt_trains_at_each_precision(backend, precision, compile_mode):
    graph = gpt(2, 64, 4, SEQ, VOCAB)
    model = backend.lower(graph, trained_looking_weights(graph, 0), precision)
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, 48)
    tokens = (start[:, None] + np.arange(SEQ + 1)) % VOCAB  # each next token is the current one plus one
    x, y = tokens[:, :-1], tokens[:, 1:]
    data = Dataset(x[:32], y[:32], x[32:], y[32:], classes=VOCAB)
    before, _ = backend.loss_and_grads(model, x[32:], y[32:])
    reports = backend.train(model, data, TrainConfig(epochs=4, batch_size=8, schedule=Schedule(initial=0.2),
                                                     precision=precision, compile=compile_mode))
    after, _ = backend.loss_and_grads(model, x[32:], y[32:])
    print(f"{precision} {compile_mode}: validation loss {before:.3f} -> {after:.3f}, accuracy "
          f"{reports[-1].val_accuracy:.3f}, compile {reports[0].compile_seconds:.1f} s")
    assert [r.train_images for r in reports] == [32] * 4
    assert after < before
    assert (reports[0].compile_seconds > 0) == (compile_mode == "always")


@pytest.mark.parametrize("precision", _precisions())
def test_the_lm_policy_step_matches_the_reference_at_each_precision(backend, precision):
    """The kit's AdamW and SGD-with-clip checks (train/gpt_*_matches_reference) on the GPU, at each
    precision, with their errors printed in u; the tolerance is the kit's own `optimizer` key."""
    from aiperf_conformance.expectations import Expectations
    from aiperf_conformance.kit import Context
    from aiperf_conformance.levels.train import optimizer_matches_reference

    ctx = Context(backend, Expectations(), device=backend.devices()[0], precisions=(precision,))
    for optimizer in ("adamw", "sgd-clip"):
        outcome = optimizer_matches_reference(ctx, precision, optimizer)
        print(f"{precision} {optimizer}: {outcome.measured:.3g} = {outcome.measured / UNIT[precision]:.1f}u "
              f"({outcome.message})")
        assert outcome.passed, outcome.message


def test_the_lm_workload_grows_gpts_on_the_gpu(backend, tmp_path):
    """A replica of the lm workload on the GPU, at the backend's fastest precision: the seed and two
    morph children train, and the run scores as an lm run."""
    from aiperf_core.replica import run_replica, write_run_json
    from aiperf_core.rundir import RunDir, read_events
    from aiperf_core.scoring import score_run

    policy = {"workload": "lm", "dataset": "embedded", "epoch_tokens": 65536, "val_tokens": 16384,
              "warmup_epochs": [1, 1, 1], "precision": backend.fastest_precision()}
    write_run_json(tmp_path, backend="torch", policy=policy, stop_after_trials=3)
    assert run_replica(tmp_path, 0, backend=backend) == "max_trials"
    found = read_events(RunDir(tmp_path).replica_log(0))
    ends = [e for e in found if e["event"] == "trial_end"]
    starts = [e for e in found if e["event"] == "trial_start"]
    assert [e["status"] for e in ends] == ["ok"] * 3 and all(s["morph"] for s in starts[1:])
    result = score_run(tmp_path)
    print(f"lm on {backend.device_model(backend.devices()[0])} at {policy['precision']}: "
          f"{result.score_ops / 1e12:.2f} TOPS, best {result.best_error * 8:.3f} bits per byte")
    assert result.workload == "lm" and result.best_error * 8 < 5.0
