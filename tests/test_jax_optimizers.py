"""The JAX backend's optimizers beyond the conformance kit (which checks adamw and sgd-clip apart,
on one device): AdamW and a gradient clip together against the float64 reference, the compiled
step cached per update rule and never retraced for a new learning rate, and AdamW with a clip
over two (host) devices equal to one device on the combined batch.

The two-device test runs in a subprocess: AIPERF_CPU_DEVICES must be read before jax first
initialises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

import jax  # noqa: F401  (`make test` installs jax: missing it is a failure, never a skip)

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.ir import is_trainable
from aiperf_core.optim import HostOptimizer, grad_norm
from aiperf_backends.jax import JaxBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import normwise_error, reference
from aiperf_conformance.levels.op import key_biases

ROOT = Path(__file__).resolve().parents[1]


def _tokens(graph, n: int, seed: int):
    tokens = np.random.default_rng(seed).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return tokens[:, :-1], tokens[:, 1:]


def test_adamw_with_a_clip_matches_the_float64_reference():
    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    weights = trained_looking_weights(graph, 0)
    x, y = _tokens(graph, 6, 1)
    ref = reference()
    exact = {n: {p: np.asarray(a, np.float64) for p, a in ps.items()} for n, ps in weights.items()}
    _, first, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64)
    # a clip at half the first step's norm engages on every step
    config = TrainConfig(epochs=3, batch_size=len(x), optimizer="adamw", weight_decay=0.1,
                         grad_clip=0.5 * grad_norm(first),
                         schedule=Schedule(initial=0.01, final_fraction=0.1, warmup_epochs=1, shape="cosine"))
    stepper = HostOptimizer(config, exact, is_trainable)
    for epoch in range(config.epochs):
        _, grads, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64)
        stepper.step(exact, grads, config.schedule.rate(epoch, config.epochs))
    backend = JaxBackend()
    model = backend.lower(graph, weights)
    backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    trained = backend.export_weights(model)
    skipped = key_biases(graph)  # exact gradient zero: AdamW turns its rounding into steps of lr
    for node_id, params in exact.items():
        for name, value in params.items():
            if not is_trainable(name) or (node_id, name) in skipped:
                continue
            start = np.asarray(weights[node_id][name], np.float64)
            error = normwise_error(np.asarray(trained[node_id][name], np.float64) - start, value - start)
            assert error < 1e-3, (node_id, name, error)


def test_the_step_is_cached_per_update_rule_and_a_new_rate_never_retraces():
    from aiperf_backends.jax.training import step_key

    graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
    x, y = _tokens(graph, 4, 2)
    data = Dataset(x, y, x, y, graph.vocab)
    backend = JaxBackend()
    model = backend.lower(graph, trained_looking_weights(graph, 0))
    adamw = TrainConfig(epochs=2, batch_size=4, optimizer="adamw", weight_decay=0.1, grad_clip=1.0,
                        schedule=Schedule(initial=0.01))
    backend.train(model, data, adamw)
    step = model.cache[step_key(adamw)]
    assert step.traces == 1
    again = backend.train(model, data, TrainConfig(**{**adamw.__dict__, "schedule": Schedule(initial=0.002)}))
    assert step.traces == 1 and again[0].compile_seconds == 0.0
    # every field baked into the traced code keys its own step; SGD without a clip keeps its old key
    variants = [TrainConfig(**{**adamw.__dict__, **change}) for change in
                ({"grad_clip": None}, {"grad_clip": 2.0}, {"weight_decay": 0.0}, {"betas": (0.9, 0.999)},
                 {"adam_epsilon": 1e-6}, {"optimizer": "sgd-momentum"})]
    keys = {step_key(c) for c in variants + [adamw]}
    assert len(keys) == len(variants) + 1
    assert step_key(TrainConfig(epochs=1, batch_size=4)) == ("train", "fp32", 0.9, 0.0)


_DP_SCRIPT = """
import json
import numpy as np
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.optim import grad_norm
from aiperf_backends.jax import JaxBackend
from aiperf_conformance.cases import trained_looking_weights
from aiperf_conformance.kit import reference
from aiperf_conformance.levels.op import key_biases

backend = JaxBackend()
assert backend.devices() == ["cpu:0", "cpu:1"], backend.devices()
graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
weights = trained_looking_weights(graph, 0)
tokens = np.random.default_rng(3).integers(0, graph.vocab, (16, graph.input_shape[0] + 1))
x, y = tokens[:, :-1], tokens[:, 1:]
data = Dataset(x, y, x[:4], y[:4], graph.vocab)
# the reference's gradient norm over every sequence: a tenth of it engages the clip on every step
_, grads, _ = reference().loss_and_grads(graph, weights, x, y, dtype=np.float64)
norm = grad_norm(grads)
# 16 sequences in batches of 8, each sharded 4 + 4 over two devices
config = TrainConfig(epochs=2, batch_size=8, optimizer="adamw", weight_decay=0.1, grad_clip=0.1 * norm,
                     schedule=Schedule(initial=0.01, warmup_epochs=1, shape="cosine"))
runs = {}
for name, devices in (("one", ("cpu:0",)), ("two", ("cpu:0", "cpu:1"))):
    model = backend.lower(graph, weights)
    reports = backend.train(model, data, TrainConfig(**{**config.__dict__, "devices": devices}))
    runs[name] = {"weights": backend.export_weights(model), "losses": [r.loss for r in reports],
                  "images": [r.train_images for r in reports]}

# |two - one| / (atol + rtol |one|), atol = rtol = 1e-5, per tensor. The attention key bias is left
# out: its exact gradient is zero (a bias on every score of a softmax row), so AdamW, which divides
# a gradient by its own size, turns float32 summation order into steps of up to lr.
skipped = key_biases(graph)
one, two = runs["one"]["weights"], runs["two"]["weights"]
worst = max(float(np.max(np.abs(np.asarray(two[n][p], np.float64) - one[n][p]) / (1e-5 + 1e-5 * np.abs(one[n][p]))))
            for n in one for p in one[n] if (n, p) not in skipped)
print(json.dumps({"norm": norm, "skipped": len(skipped), "images": [runs[k]["images"] for k in runs],
                  "losses": {k: v["losses"] for k, v in runs.items()}, "worst_two": worst}))
"""


def test_adamw_with_a_clip_on_two_host_devices_matches_one_device():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "AIPERF_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", AIPERF_CPU_DEVICES="2")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_DP_SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["norm"] > 0 and result["skipped"] == 1 and result["images"] == [[16, 16]] * 2
    # two devices clip the global-batch gradient as one device does: equal up to float32 summation order
    assert result["worst_two"] <= 1.0, result
    np.testing.assert_allclose(result["losses"]["two"], result["losses"]["one"], rtol=1e-5)
