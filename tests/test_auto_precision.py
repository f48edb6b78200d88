"""Issue 33.2: `auto` is measured. At the start of a run the seed model, at the run's input size,
trains a few steps at each precision declared on the run's device, and the fastest per step is the
precision the run trains at (aiperf_core.workflow.auto_precision); the timings go to run.json's
`precision_probe`, the start line and the report. The stub backend's steps only sleep, for as long
as its precision says, on a CPU faked to have AMX-BF16 (where the preference order says bf16)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

import aiperf_core.backend as contract
from aiperf_core.backend import Backend, EpochReport, StepClock
from aiperf_core.builders import resnet_small
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import RunDir
from aiperf_core.workflow import auto_precision, plan
from aiperf_numpy.backend import NumpyBackend
from test_workflow import TINY_POLICY

AMX = {"amx_bf16", "amx_tile", "avx512f"}
STEP_S_ENV = "AIPERF_TEST_STEP_S"  # {"fp32": seconds, "bf16": seconds}: how long a step sleeps


class SleepingSteps(NumpyBackend):
    """fp32 and bf16 on a CPU with AMX-BF16 (the probe step passes); each step sleeps as long as
    STEP_S_ENV says for its precision, and `warmup_s` more on a train() call's first step."""

    name = "sleeping-steps"
    warmup_s = 0.0

    def devices(self):
        return ["cpu"]

    def runs_precision(self, device, precision):
        return precision == "bf16"

    def train_checked(self, model, data, config, on_epoch):
        step_s = json.loads(os.environ[STEP_S_ENV])[config.precision]
        steps = math.ceil(len(data.y_train) / config.batch_size)
        clock, reports = StepClock(), []
        for epoch in range(config.epochs):
            for step in range(steps):
                with clock:
                    time.sleep(step_s + (self.warmup_s if epoch == step == 0 else 0.0))
                clock.count(min(config.batch_size, len(data.y_train) - step * config.batch_size))
            report = EpochReport(epoch=epoch, train_images=len(data.y_train), val_images=len(data.y_val),
                                 loss=1.0 / (epoch + 1), val_loss=1.0 / (epoch + 1), val_accuracy=0.5,
                                 step_seconds=clock.lap())
            reports.append(report)
            if on_epoch is not None and on_epoch(report):
                break
        return reports


@pytest.fixture
def amx_cpu(monkeypatch):
    monkeypatch.setattr(Backend, "_probes", {})
    monkeypatch.setattr(contract, "cpu_flags", lambda: set(AMX))


def _steps(monkeypatch, **seconds):
    monkeypatch.setenv(STEP_S_ENV, json.dumps(seconds))


GRAPH = resnet_small((8, 8, 3), 3)


# -- the measurement --------------------------------------------------------------------------------
@pytest.mark.parametrize("fp32_s, bf16_s, fastest", [(0.02, 0.15, "fp32"), (0.15, 0.02, "bf16")])
def test_auto_picks_the_measured_fastest_not_the_preference_order(amx_cpu, monkeypatch, fp32_s, bf16_s, fastest):
    _steps(monkeypatch, fp32=fp32_s, bf16=bf16_s)
    backend = SleepingSteps()
    assert backend.precisions("cpu") == ("fp32", "bf16") and backend.fastest_precision("cpu") == "bf16"
    probe = auto_precision.measure(backend, "cpu", GRAPH, backend.precisions("cpu"), batch_size=4)
    assert probe["chosen"] == fastest
    assert list(probe["seconds_per_step"]) == ["fp32", "bf16"]
    assert (probe["device"], probe["batch_size"], probe["timed_steps"]) == ("cpu", 4, auto_precision.TIMED_STEPS)
    seconds = probe["seconds_per_step"]
    assert seconds["fp32"] >= fp32_s and seconds["bf16"] >= bf16_s  # each a step's sleep, at least
    assert probe["seconds"] >= sum(s * (auto_precision.WARMUP_STEPS + auto_precision.TIMED_STEPS)
                                   for s in (fp32_s, bf16_s))


def test_the_warm_up_step_is_not_timed(amx_cpu, monkeypatch):
    """Lowering, tracing and compiling land in the first step: a slow first step of bf16 alone
    must not make fp32 the pick."""
    _steps(monkeypatch, fp32=0.15, bf16=0.02)
    backend = SleepingSteps()
    backend.warmup_s = 1.0
    probe = auto_precision.measure(backend, "cpu", GRAPH, ("fp32", "bf16"), batch_size=4)
    assert probe["chosen"] == "bf16" and probe["seconds_per_step"]["bf16"] < 1.0


def test_one_declared_precision_is_not_measured(amx_cpu, monkeypatch):
    trained = []
    monkeypatch.setattr(SleepingSteps, "train_checked", lambda *args: trained.append(args))
    probe = auto_precision.measure(SleepingSteps(), "cpu", GRAPH, ("fp32",), batch_size=4)
    assert probe == {"device": "cpu", "chosen": "fp32", "seconds_per_step": {}} and trained == []
    assert auto_precision.describe(probe) == "auto: the only precision declared on cpu"


def test_a_precision_that_fails_to_train_is_recorded_and_not_chosen(amx_cpu, monkeypatch):
    _steps(monkeypatch, fp32=0.05, bf16=0.01)
    real = SleepingSteps.train_checked

    def failing_bf16(self, model, data, config, on_epoch):
        if config.precision == "bf16":
            raise RuntimeError("no bf16 kernel for conv2d\nsecond line")
        return real(self, model, data, config, on_epoch)
    monkeypatch.setattr(SleepingSteps, "train_checked", failing_bf16)
    probe = auto_precision.measure(SleepingSteps(), "cpu", GRAPH, ("fp32", "bf16"), batch_size=4)
    assert probe["chosen"] == "fp32" and probe["seconds_per_step"]["bf16"] is None
    assert probe["errors"] == {"bf16": "no bf16 kernel for conv2d"}
    assert auto_precision.describe(probe).endswith(", bf16 failed")
    monkeypatch.setenv(STEP_S_ENV, json.dumps({"bf16": 0.01}))  # fp32 now fails too (KeyError)
    with pytest.raises(AiperfError, match=r"^precision auto: the seed model trained at no precision on cpu \(fp32: "):
        auto_precision.measure(SleepingSteps(), "cpu", GRAPH, ("fp32", "bf16"), batch_size=4)


def test_the_probe_is_not_a_replicas_live_progress(amx_cpu, monkeypatch, tmp_path):
    _steps(monkeypatch, fp32=0.01, bf16=0.01)
    progress = tmp_path / "progress.json"
    monkeypatch.setenv(StepClock.PROGRESS_FILE_ENV, str(progress))
    auto_precision.measure(SleepingSteps(), "cpu", GRAPH, ("fp32", "bf16"), batch_size=4)
    assert not progress.exists() and os.environ[StepClock.PROGRESS_FILE_ENV] == str(progress)


def test_a_small_batch_on_a_cpu_the_policys_on_an_accelerator():
    assert auto_precision.batch_size_for("cpu", 448) == auto_precision.CPU_BATCH_SIZE
    assert auto_precision.batch_size_for("cpu", 4) == 4
    assert auto_precision.batch_size_for("cuda:0", 448) == 448


def test_describe_names_each_timing():
    probe = {"device": "cpu", "chosen": "fp32", "seconds_per_step": {"fp32": 0.2134, "bf16": 0.35}}
    assert auto_precision.describe(probe) == "auto: fp32 0.213 s/step, bf16 0.35 s/step"


# -- on this CPU -------------------------------------------------------------------------------------
def test_on_this_cpu_auto_times_only_where_there_is_a_choice():
    """Without AVX512-BF16, AMX-BF16 or AMX-FP16 every backend declares fp32 alone, so nothing is
    timed; with them (a Zen 4 or 5, a Sapphire Rapids) torch may declare bf16 too, and then `auto`
    times each declared precision and picks the fastest. Either way on whichever CPU runs this."""
    native = contract.cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_fp16"}
    seed = {"model": "resnet_small", "input_shape": [8, 8, 3], "classes": 3, "batch_size": 256}
    with plan.BackendProbe("torch") as probe:
        facts = probe.facts(auto=seed)
    if not native:
        assert facts.precisions == ("fp32",)
    if facts.precisions == ("fp32",):
        assert facts.precision_probe == {"device": "cpu", "chosen": "fp32", "seconds_per_step": {}}
    else:
        timed = facts.precision_probe["seconds_per_step"]
        assert set(timed) == set(facts.precisions) and all(t > 0 for t in timed.values())
        assert facts.precision_probe["chosen"] == min(timed, key=timed.get)
    assert plan.resolve_precision("auto", facts, "torch") == facts.precision_probe["chosen"]


def test_auto_request_names_the_seed_model_at_the_runs_input_size():
    from aiperf_core.policy import Policy

    policy = Policy({"image_size": 64, "batch_size": 32}).to_json()
    assert plan.auto_request(policy, {"classes": 10}) == {
        "model": "resnet50", "input_shape": [64, 64, 3], "classes": 10, "batch_size": 32}
    assert plan.auto_request({**policy, "precision": "fp32"}, {"classes": 10}) is None


def test_run_json_keeps_the_probe_out_of_the_fixed_configuration(tmp_path):
    from aiperf_core.replica import write_run_json

    probe = {"device": "cpu", "chosen": "bf16", "seconds_per_step": {"fp32": 0.3, "bf16": 0.2}}
    run = write_run_json(tmp_path / "a", policy={"dataset": "digits"}, precision="bf16")
    assert "precision_probe" not in run  # a run.json from before the measurement stays valid
    assert plan.config_sha256({**run, "precision_probe": probe}) == run["config_sha256"]
    with pytest.raises(AiperfError, match="not what the precision probe chose"):
        plan.run_record(backend="numpy", executor="local", replicas=1, devices_per_replica=1, seed=0,
                        time_budget_s=60, policy=run["policy"], dataset=run["dataset"], stop_after_trials=None,
                        watch=plan.watch_settings(plan.RunRequest()), precision="fp32", precision_probe=probe)


# -- a whole run -------------------------------------------------------------------------------------
PLANTED = f'''
import aiperf_core.backend as contract
from test_auto_precision import SleepingSteps

contract.cpu_flags = lambda: set({sorted(AMX)!r})  # every process of the run stands on a CPU with AMX-BF16
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The stub as an installed plugin, for the primary's probe and the replicas."""
    root = tmp_path / "site"
    root.mkdir()
    (root / "planted_amx.py").write_text(PLANTED)
    info = root / "aiperf_planted_amx-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aiperf-planted-amx\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[aiperf.backends]\nsleeping-steps = planted_amx:SleepingSteps\n")
    here = os.path.dirname(__file__)
    path = os.pathsep.join(filter(None, [str(root), here, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1",
            STEP_S_ENV: json.dumps({"fp32": 0.02, "bf16": 0.15})}


def test_a_run_trains_at_the_measured_fastest_and_records_the_timings(tmp_path, planted):
    config = tmp_path / "aiperf.toml"
    config.write_text(TINY_POLICY)
    run_dir = tmp_path / "run"
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--backend", "sleeping-steps", "--data",
                             "digits", "--config", str(config), "--run-dir", str(run_dir), "--time-budget", "2m",
                             "--stop-after-trials", "1"], capture_output=True, text=True, timeout=240, env=planted)
    assert result.returncode == 0, result.stdout + result.stderr
    run = RunDir(run_dir).read_run()
    probe = run["precision_probe"]
    assert run["precision"] == probe["chosen"] == "fp32"  # the preference order on AMX says bf16
    assert set(probe["seconds_per_step"]) == {"fp32", "bf16"}
    assert (probe["device"], probe["batch_size"]) == ("cpu", auto_precision.CPU_BATCH_SIZE)
    timings = auto_precision.describe(probe)
    assert timings.startswith("auto: fp32 ") and ", bf16 " in timings and timings.endswith(" s/step")
    assert f"precision fp32 ({timings})" in result.stdout.splitlines()[0]
    # Measured before the run's clock: its seconds are not in the budget.
    assert started + probe["seconds"] <= run["start_time"]
    events = [json.loads(line) for line in (run_dir / "replicas/0/events.jsonl").read_text().splitlines()]
    assert {e["hyper"]["precision"] for e in events if e["event"] == "trial_start"} == {"fp32"}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["precision"]["probe"] == probe and summary["precision"]["resolved"] == "fp32"
    assert f"fp32 ({timings})" in (run_dir / "report.html").read_text()
    verify = subprocess.run([sys.executable, "-m", "aiperf_core", "score", str(run_dir), "--verify"],
                            capture_output=True, text=True, timeout=120, env=planted)
    assert verify.returncode == 0 and "verify: intact" in verify.stdout, verify.stdout + verify.stderr


def test_a_slurm_replica_measures_auto_on_its_node(tmp_path, amx_cpu, monkeypatch):
    """A SLURM primary leaves `auto` to each replica (run.json precision null): the replica times
    the seed model on its node the same way, at its first start."""
    from aiperf_core.backend import Dataset
    from aiperf_core.data.digits import load_digits
    from aiperf_core.replica import run_replica, write_run_json

    _steps(monkeypatch, fp32=0.15, bf16=0.02)
    digits = load_digits(size=32)
    data = Dataset(digits.x_train[:64], digits.y_train[:64], digits.x_val[:32], digits.y_val[:32], digits.classes)
    policy = {"dataset": "digits", "initial_architecture": "resnet_small", "warmup_epochs": [1], "max_epochs": 1,
              "batch_size": 32}
    run = write_run_json(tmp_path, backend="sleeping-steps", policy=policy, stop_after_trials=1, executor="slurm")
    RunDir(tmp_path).write_run({**run, "precision": None})
    run_replica(tmp_path, 0, backend=SleepingSteps(), dataset=data)
    events = [json.loads(line) for line in (tmp_path / "replicas/0/events.jsonl").read_text().splitlines()]
    assert [e["precision"] for e in events if e["event"] == "replica_start"] == ["bf16"]
