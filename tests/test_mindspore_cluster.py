"""The MindSpore backend's long-lived data-parallel cluster (issue #42): one cluster per process, reused by
every trial, restarted when a worker dies and stopped in order after a failed trial, at exit and on
SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")

from test_mindspore_step_memory import _close  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CLUSTER_SCRIPT = """
    import json, os, sys, time
    import numpy as np
    from aiperf_core.backend import Schedule, TrainConfig
    from aiperf_core.builders import gpt
    from aiperf_core.data.text_corpus import embedded_corpus
    from aiperf_core.data.text_stream import TokenStream
    from aiperf_core.weights import init_weights
    from aiperf_backends.mindspore import MindSporeBackend
    from aiperf_backends.mindspore import distributed

    stopped = distributed.Cluster.stop

    def stop(self):  # what each stop leaves: the exit codes, workers first, then the scheduler
        processes = [r.process for r in self.ranks] + ([self.scheduler] if self.scheduler else [])
        stopped(self)
        if processes:
            print(json.dumps({"stopped": [p.returncode for p in processes]}), flush=True)

    distributed.Cluster.stop = stop
    GRACE_S = distributed.STOP_GRACE_S
    # The killed worker's cluster stops with the next trial: its scheduler waits on the dead worker and
    # ends only at SIGTERM, after the whole grace (10 s). How that cluster's processes end is not checked
    # (stops[0] below; its live worker may take SIGTERM too): that one stop gets a short grace. Every
    # other stop has the real one, and its workers must end by themselves.
    KILLED_GRACE_S = 2.0

    def pids():
        c = distributed._cluster
        return None if c is None else [r.process.pid for r in c.ranks] + [c.scheduler.pid]

    backend = MindSporeBackend()
    graph = gpt(layers=1, hidden=16, heads=2, seq_len=16, vocab=256)
    weights = init_weights(graph, seed=3)
    stream = TokenStream(embedded_corpus(), seq_len=16, epoch_tokens=16 * 13, val_tokens=16 * 5)

    def train(devices, mode, **options):
        config = TrainConfig(epochs=int(os.environ.get("EPOCHS", "1")), batch_size=8, seed=1, optimizer="adamw",
                             weight_decay=0.1, grad_clip=0.5, schedule=Schedule(initial=0.01), devices=devices,
                             **options)
        model = backend.lower(graph, weights)
        def on_epoch(report):
            if mode == "fail":
                raise RuntimeError("the caller gave up")
        reports = backend.train(model, stream, config, on_epoch)
        out = backend.export_weights(model)
        return {"counts": [[r.train_images, r.val_images] for r in reports], "loss": [r.loss for r in reports],
                "weights": {n: {p: a.tolist() for p, a in ps.items()} for n, ps in out.items()}, "pids": pids()}

    def say(**fields):
        print(json.dumps(fields), flush=True)

    steps = sys.argv[1].split(",")
    for step in steps:
        if step == "one":
            say(step=step, **train(("cpu:0",), "plain"))
        elif step == "two":
            say(step=step, **train(("cpu:0", "cpu:1"), "plain"))
            distributed.STOP_GRACE_S = GRACE_S
        elif step == "two_accumulated":
            say(step=step, **train(("cpu:0", "cpu:1"), "plain", micro_batch=3, checkpoint_blocks=True))
        elif step == "kill":
            c = distributed._cluster
            os.kill(c.ranks[1].process.pid, 9)
            c.ranks[1].process.wait()
            distributed.STOP_GRACE_S = KILLED_GRACE_S
            say(step=step)
        elif step == "fail":
            before = pids()
            try:
                train(("cpu:0", "cpu:1"), "fail")
            except RuntimeError as exc:
                say(step=step, error=str(exc), before=before, after=pids())
        elif step == "wait":
            say(step=step, pids=pids())
            time.sleep(600)
"""


def _cluster_script(steps: str, **popen) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "AIPERF_CPU_DEVICES"}
    env["AIPERF_CPU_DEVICES"] = "2"  # read once, when the backend first loads MindSpore: a fresh process
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CLUSTER_SCRIPT), steps], cwd=ROOT, env=env,
                            text=True, **popen)


def _read(file) -> str:
    file.seek(0)
    return file.read()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module", autouse=True)
def waiting_script(request, tmp_path_factory):
    """The SIGTERM test's process (a cluster trained once, then waiting), started with the module's first test
    when its test is selected: its cluster forms and trains beside the other test's, which mostly waits on its
    own cluster's processes. Its stderr goes to a file, which nothing need read while it waits."""
    test = "test_sigterm_stops_the_cluster_in_order_and_the_process_dies_of_it"
    if not any(item.module is request.module and item.originalname == test for item in request.session.items):
        yield None
        return
    with open(tmp_path_factory.mktemp("sigterm") / "stderr", "w+") as stderr:
        script = _cluster_script("two,wait", stderr=stderr)
        try:
            yield script, stderr
        finally:
            if script.poll() is None:
                script.kill()
                script.wait()


@pytest.mark.slow
def test_one_cluster_serves_every_trial_and_restarts_after_a_killed_worker():
    script = _cluster_script("one,two,two_accumulated,kill,two,fail,two")
    out, err = script.communicate(timeout=1500)
    assert script.returncode == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    steps = {line["step"]: line for line in lines if "step" in line and line["step"] != "two"}
    twos = [line for line in lines if line.get("step") == "two"]
    stops = [line["stopped"] for line in lines if "stopped" in line]
    one, first, accumulated, second, third = steps["one"], twos[0], steps["two_accumulated"], twos[1], twos[2]
    # TokenStream data parallel: 13 windows an epoch (batches of 8 and 5), the stream's counts.
    assert first["counts"] == one["counts"] == [[13, 5]]
    _close(one["weights"], first["weights"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(first["loss"], one["loss"], rtol=1e-5)
    # The second trial reused the cluster (the same processes); accumulation over micro-batches of 3
    # per rank and recomputed blocks train as the plain steps do.
    assert accumulated["pids"] == first["pids"]
    _close(first["weights"], accumulated["weights"], rtol=1e-4, atol=1e-5)
    # A killed worker: one line in the replica's log, a new cluster, the same training.
    restarts = [line for line in err.splitlines() if "restarting the cluster" in line]
    assert len(restarts) == 1 and "rank 1" in restarts[0] and "killed by signal 9" in restarts[0], err[-2000:]
    assert not set(second["pids"]) & set(first["pids"])
    assert second["counts"] == first["counts"]
    _close(first["weights"], second["weights"], rtol=1e-5, atol=1e-6)
    # A failed trial stops its cluster in order (every worker ends by itself), and nothing is left.
    fail = steps["fail"]
    assert fail["error"] == "the caller gave up" and fail["before"] == second["pids"] and fail["after"] is None
    # The next trial starts a fresh cluster, which the process's exit stops in order (atexit).
    assert not set(third["pids"]) & set(second["pids"]) and third["counts"] == first["counts"]
    # The killed worker's cluster (its stop with KILLED_GRACE_S), the failed trial's, the one at exit.
    assert len(stops) == 3, stops
    assert stops[1][:2] == stops[2][:2] == [0, 0], stops
    assert not any(_alive(pid) for pid in first["pids"] + second["pids"] + third["pids"])


@pytest.mark.slow
def test_sigterm_stops_the_cluster_in_order_and_the_process_dies_of_it(waiting_script):
    script, stderr = waiting_script
    try:
        pids = None
        for line in script.stdout:
            message = json.loads(line) if line.startswith("{") else {}
            if message.get("step") == "wait":
                pids = message["pids"]
                break
        assert pids is not None and all(_alive(pid) for pid in pids), _read(stderr)[-3000:]
        script.send_signal(signal.SIGTERM)
        rest, _ = script.communicate(timeout=120)
        err = _read(stderr)
    finally:
        if script.poll() is None:
            script.kill()
    assert script.returncode == -signal.SIGTERM, err[-3000:]
    stops = [json.loads(line)["stopped"] for line in rest.splitlines() if line.startswith('{"stopped"')]
    assert len(stops) == 1 and stops[0][:2] == [0, 0], (stops, err[-2000:])  # the workers ended by themselves
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
