"""Data-parallel training of the torch backend equals single-process training on the global batch.

The ranks are every CUDA device where there are two or more (NCCL), else two CPU processes with
gloo (MASTER_ADDR 127.0.0.1, a free port); they run the small ResNet. Batch norm is synchronised
across the ranks (backends/torch/distributed.py), so a data-parallel step is the same computation
as a single-process step on the combined batch, up to float32 summation order (fp32 is IEEE fp32
on GPUs too: no TF32): the gradients and the updated weights must agree to ~1e-5. Training over
devices goes through the contract: AIPERF_CPU_DEVICES=2 (in a subprocess: it is read when the
backend first initialises) and TrainConfig.devices.
"""

from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402  (`make test` installs torch: missing it is a failure, never a skip)
import torch.distributed as dist  # noqa: E402

assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is not available"

from aiperf_core.backend import Dataset, Schedule, TrainConfig  # noqa: E402
from aiperf_core.builders import resnet_small  # noqa: E402
from aiperf_backends.torch import TorchBackend  # noqa: E402
from aiperf_backends.torch.distributed import (make_job, rank_messages, rank_queue, run_rank_steps,  # noqa: E402
                                               start_ranks)
from aiperf_backends.torch.training import Stepper, device_of  # noqa: E402
from aiperf_conformance.cases import trained_looking_weights  # noqa: E402

from cpu_devices import run_on_cpu_devices  # noqa: E402

# float32 throughout: the two runs differ only in summation order (BN statistics summed per rank
# then across ranks, gradients averaged by DDP). On this network float32 itself is ~5e-6 away from
# the float64 reference (conformance train/gradients_match_reference), hence ~1e-5 between two
# float32 computations.
TOL = 2e-5
# Every GPU where there are several, else two CPU processes.
DEVICES = ([f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.device_count() >= 2
           else ["cpu"] * 2)
WORLD = len(DEVICES)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def worst(got: dict, want: dict) -> tuple[float, str]:
    errs = [(rel_err(got[n][p], want[n][p]), f"{n}/{p}") for n in want for p in want[n]]
    return max(errs)


@pytest.fixture(scope="module")
def setup():
    graph = resnet_small((16, 16, 3), 5)
    weights = trained_looking_weights(graph, 3)
    rng = np.random.default_rng(5)
    x = rng.normal(0, 1, (40,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 40)
    return graph, weights, x, y


def run_ranks(fn, job: dict, world: int) -> list:
    """Run `fn` (run_rank_steps or a wrapper) on `world` ranks started as the backend starts its own
    (start_ranks); what they put on job["results"] (a rank_queue), by rank. A rank that fails fails the
    test at once (the join raises), not at a timeout."""
    return sorted(rank_messages(start_ranks(fn, job, world), job["results"]), key=lambda r: r[0])


def one_device_steps(backend, graph, weights, config: TrainConfig, batches) -> tuple[list, list, dict]:
    """(summed loss, canonical gradients) of each of `batches` stepped on one device at epoch 0's rate,
    and the final canonical weights: what a data-parallel run's ranks must match."""
    model = backend.lower(graph, weights)
    stepper = Stepper(model, device_of(model), config)
    stepper.set_lr(config.schedule.rate(0, max(config.epochs, 1)))
    losses, grads = [], []
    for xb, yb in batches:
        losses.append(float(stepper.step(xb, yb, len(yb))))
        grads.append(model.canonical_grads())
    return losses, grads, model.export_canonical()


@pytest.mark.slow
def test_ddp_steps_match_single_process(setup):
    graph, weights, x, y = setup
    config = TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.05), momentum=0.9,
                         label_smoothing=0.1)
    # Global batches that split evenly (8 + 8) and unevenly (4 + 3, 3 + 2). The case of a rank
    # with an empty shard is covered by the next test.
    sizes = [16, 7, 5]
    starts = np.cumsum([0] + sizes)
    global_batches = [(torch.from_numpy(x[a:b]), torch.from_numpy(y[a:b])) for a, b in zip(starts, starts[1:])]

    backend = TorchBackend()
    single_losses, single_grads, single_weights = one_device_steps(backend, graph, weights, config, global_batches)

    job = make_job(backend.lower(graph, weights), config, DEVICES, batches=global_batches, results=rank_queue(),
                   threads_after=rank_queue())
    results = run_ranks(run_rank_steps, job, WORLD)
    # Each rank ends its process group in order: none of its threads outlives the teardown (a
    # rank that exited with gloo's threads running aborted now and then, docs/backends/torch.md).
    left = sorted(job["threads_after"].get(timeout=60) for _ in range(WORLD))
    assert left == [(rank, []) for rank in range(WORLD)], left

    for rank, losses, grads, final in results:
        for step, (g_dp, g_single) in enumerate(zip(grads, single_grads)):
            err, where = worst(g_dp, g_single)
            assert err <= TOL, f"rank {rank} step {step}: gradient {where} differs by {err:.3g}"
        err, where = worst(final, single_weights)
        assert err <= TOL, f"rank {rank}: weight {where} differs by {err:.3g} after {len(sizes)} steps"
    # The shards' summed losses add up to the global batch's.
    for step in range(len(sizes)):
        total = sum(r[1][step] for r in results)
        assert total == pytest.approx(single_losses[step], rel=TOL)


_TRAIN_SCRIPT = """
import json, sys
import numpy as np
from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import resnet_small
from aiperf_backends.torch import TorchBackend
from aiperf_conformance.cases import trained_looking_weights

graph = resnet_small((16, 16, 3), 5)
weights = trained_looking_weights(graph, 3)
rng = np.random.default_rng(5)
x = rng.normal(0, 1, (40,) + graph.input_shape).astype(np.float32)
y = rng.integers(0, 5, 40)
# 37 images in batches of 12: the last global batch has one image, so rank 1 gets none.
data = Dataset(x[:37], y[:37], x[37:], y[37:], 5)
config = dict(epochs=3, batch_size=12, schedule=Schedule(initial=0.05), seed=4)
backend = TorchBackend()
out = {"devices": backend.devices(), "runs": {}}
for name, devices in (("one", (backend.devices()[0],)), ("all", None)):
    model = backend.lower(graph, weights)
    seen = []
    def on_epoch(report):
        seen.append(report.epoch)
        return report.epoch + 1 >= 2  # stops early: the decision must reach every rank
    reports = backend.train(model, data, TrainConfig(devices=devices, **config), on_epoch=on_epoch)
    out["runs"][name] = {"reports": [r.__dict__ for r in reports], "seen": seen,
                         "weights": {n: {p: a.tolist() for p, a in ps.items()}
                                     for n, ps in backend.export_weights(model).items()}}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_train_over_cpu_devices_matches_one_device():
    """AIPERF_CPU_DEVICES=2: devices() lists two CPU devices, train() on both (gloo processes)
    equals train() on the first alone (TrainConfig.devices), early stop and an empty shard included."""
    out = run_on_cpu_devices(_TRAIN_SCRIPT)
    assert out["devices"] == ["cpu:0", "cpu:1"]
    one, both = out["runs"]["one"], out["runs"]["all"]
    assert one["seen"] == both["seen"] == [0, 1]
    for a, b in zip(both["reports"], one["reports"]):
        assert a["train_images"] == b["train_images"] == 37
        assert a["val_images"] == b["val_images"] == 3
        assert a["loss"] == pytest.approx(b["loss"], rel=TOL)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-4)
        assert a["val_accuracy"] == b["val_accuracy"]
    as_arrays = [{n: {p: np.asarray(a, np.float32) for p, a in ps.items()} for n, ps in run["weights"].items()}
                 for run in (both, one)]
    err, where = worst(*as_arrays)
    assert err <= TOL, f"weight {where} differs by {err:.3g} after data-parallel training"


def _report_start(local_rank: int, job: dict) -> None:
    import os

    job["results"].put((local_rank, os.getppid(), os.environ.get(job["variable"])))
    job["results"].close()
    job["results"].join_thread()


def test_ranks_fork_from_one_server_and_take_the_environment_of_their_start(monkeypatch):
    """Ranks are forks of the process's one forkserver, which imported torch once (start_ranks), and each
    takes this process's environment as it is when they start, not the one the server started with."""
    import os

    variable = "AIPERF_TEST_RANK_START"
    seen = []
    for value in ("first", "second", None):
        if value is None:
            monkeypatch.delenv(variable)
        else:
            monkeypatch.setenv(variable, value)
        job = {"results": rank_queue(), "variable": variable}
        started = start_ranks(_report_start, job, 2)
        seen.append(sorted(rank_messages(started, job["results"])))
    servers = {parent for starts in seen for _, parent, _ in starts}
    assert len(servers) == 1 and os.getpid() not in servers, seen  # one forkserver, started once
    assert [[(rank, value) for rank, _, value in starts] for starts in seen] == [
        [(0, "first"), (1, "first")], [(0, "second"), (1, "second")], [(0, None), (1, None)]]


def _check_start(local_rank: int, job: dict) -> None:
    from aiperf_backends.torch.distributed import end_rank, init_process_group, same_start

    device = torch.device("cpu")
    init_process_group(local_rank, 2, device, "127.0.0.1", job["port"])
    torch.manual_seed(job["seeds"][local_rank])
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    try:
        same_start(model, [], device)
        outcome = None
    except Exception as exc:  # noqa: BLE001 (reported to the test, which asserts on it)
        outcome = str(exc)
    end_rank(None)
    job["results"].put((local_rank, outcome))
    job["results"].close()
    job["results"].join_thread()


def test_ranks_that_start_from_different_weights_are_refused():
    """DDP does not broadcast rank 0's weights (init_sync=False: every rank lowered the same ones), so
    same_start checks them: the same seed passes, another seed on rank 1 fails on every rank."""
    from aiperf_backends.torch.distributed import free_port

    seen = []
    for seeds in ((0, 0), (0, 1)):
        job = {"results": rank_queue(), "port": free_port(), "seeds": seeds}
        seen.append(sorted(rank_messages(start_ranks(_check_start, job, 2), job["results"])))
    assert seen[0] == [(0, None), (1, None)]
    assert [rank for rank, _ in seen[1]] == [0, 1]
    assert all(message is not None and "rank 1 starts the trial from other weights than rank 0" in message
               for _, message in seen[1]), seen[1]


def _wait_for_ever(local_rank: int, job: dict) -> None:
    import os

    job["results"].put(os.getpid())
    job["never"].get()


_KILLED_PARENT_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
from aiperf_backends.torch.distributed import rank_queue, start_ranks
from test_torch_distributed import _wait_for_ever

job = {{"results": rank_queue(), "never": rank_queue()}}
start_ranks(_wait_for_ever, job, 2)
ranks = sorted(job["results"].get(timeout=120) for _ in range(2))
print(" ".join(map(str, ranks)), flush=True)
job["never"].get()
"""


def test_ranks_and_their_forkserver_end_when_their_parent_is_killed():
    """A rank waiting on its parent (a queue, a collective) ends when the parent is SIGKILLed, and the
    forkserver with it: nothing is left behind by a replica killed mid-trial."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    tests = str(Path(__file__).resolve().parent)
    parent = subprocess.Popen([sys.executable, "-c", _KILLED_PARENT_SCRIPT.format(tests=tests)],
                              stdout=subprocess.PIPE, text=True)
    try:
        ranks = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert len(ranks) == 2
        server = psutil.Process(ranks[0].ppid())
        assert server.pid != parent.pid and ranks[1].ppid() == server.pid
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    _, alive = psutil.wait_procs([*ranks, server], timeout=10)
    assert alive == [], [p.cmdline() for p in alive]
