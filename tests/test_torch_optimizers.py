"""AdamW with gradient clipping in the torch backend: data-parallel training equals one device.

The clip must see the all-reduced gradient (the global batch's), not a rank's shard, or k devices
would clip differently from one device on the combined batch; the update then runs identically in
every rank. A tiny GPT trains for 2 epochs on two CPU devices (AIPERF_CPU_DEVICES=2, in a
subprocess: it is read when the backend first initialises, as in test_torch_distributed.py) and
on the first alone, with a clip far below the gradient norm, and the two must agree to float32
summation order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from aiperf_conformance.levels.op import key_biases
from aiperf_core.builders import gpt

ROOT = Path(__file__).resolve().parents[1]
GRAD_CLIP = 0.01
TOL = 1e-5

_SCRIPT = """
import json
import numpy as np
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt
from aiperf_core.optim import grad_norm
from aiperf_backends.torch import TorchBackend

graph = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
tokens = np.random.default_rng(3).integers(0, 32, (25, 9))
x, y = tokens[:, :-1], tokens[:, 1:]
# 21 training sequences in global batches of 8: the last one (5) splits unevenly, 3 + 2.
data = Dataset(x[:21], y[:21], x[21:], y[21:], 32)
backend = TorchBackend()
_, grads = backend.loss_and_grads(backend.lower(graph), x[:21], y[:21])
out = {"devices": backend.devices(), "norm": grad_norm(grads), "runs": {}}
for name, devices in (("one", (backend.devices()[0],)), ("all", None)):
    model = backend.lower(graph)
    config = TrainConfig(epochs=2, batch_size=8, schedule=Schedule(initial=0.01, warmup_epochs=1),
                         optimizer="adamw", weight_decay=0.1, grad_clip=GRAD_CLIP, seed=1, devices=devices)
    reports = backend.train(model, data, config)
    out["runs"][name] = {"losses": [r.loss for r in reports],
                         "weights": {n: {p: a.tolist() for p, a in ps.items()}
                                     for n, ps in backend.export_weights(model).items()}}
print(json.dumps(out))
"""


def test_adamw_with_clip_over_two_cpu_devices_matches_one_device():
    env = {k: v for k, v in os.environ.items() if k != "AIPERF_CPU_DEVICES"}
    env["AIPERF_CPU_DEVICES"] = "2"
    script = textwrap.dedent(_SCRIPT).replace("GRAD_CLIP", repr(GRAD_CLIP))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["devices"] == ["cpu:0", "cpu:1"]
    # A batch's gradient norm is of the order of the whole set's: the clip scales every step.
    assert out["norm"] > 10 * GRAD_CLIP, out["norm"]
    one, both = out["runs"]["one"], out["runs"]["all"]
    np.testing.assert_allclose(both["losses"], one["losses"], rtol=TOL)
    # An attention key bias's exact gradient is zero: AdamW divides its rounding noise by its own
    # size, so the two summation orders move it by unrelated steps of up to lr (the kit leaves it
    # out of its optimizer check for the same reason).
    skipped = key_biases(gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32))
    compared = 0
    for node, params in one["weights"].items():
        for name, want in params.items():
            if (node, name) in skipped:
                continue
            np.testing.assert_allclose(np.asarray(both["weights"][node][name]), np.asarray(want), rtol=TOL,
                                       atol=TOL, err_msg=f"{node}.{name}")
            compared += 1
    assert compared > 10
