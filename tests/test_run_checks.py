"""What `aiperf run` checks before anything starts (precision, devices, data workers), and what it
says when a run produced nothing. Backends are planted as a plugin distribution on PYTHONPATH, as
a vendor's would be installed, so that the primary's probe and the replicas find them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from aiperf_core.cli import main
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import RunDir
from aiperf_core.workflow import plan
from test_workflow import TINY_POLICY

PLANTED = '''
from aiperf_core.backend import Parallelism
from aiperf_numpy.backend import NumpyBackend


class FailingBackend(NumpyBackend):
    """Every trial fails: the case of a run that produces nothing."""
    name = "planted-failing"

    def train_checked(self, model, data, config, on_epoch):
        raise RuntimeError("planted: this backend fails every trial")


class TwoDevices(NumpyBackend):
    """Two accelerators and no data parallelism."""
    name = "planted-two-devices"

    def devices(self):
        return ["fake:0", "fake:1"]


class TwoDevicesParallel(TwoDevices):
    name = "planted-two-devices-parallel"

    def parallelism(self):
        return Parallelism(data_parallel=True, synchronized_batch_norm=True)


class MixedPrecision(NumpyBackend):
    """An accelerator that declares bf16 and fp16."""
    name = "planted-mixed"

    def devices(self):
        return ["fake:0"]

    def runs_precision(self, device, precision):
        return precision in ("bf16", "fp16")
'''


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A folder holding the module and its dist-info (entry points), for PYTHONPATH."""
    root = tmp_path_factory.mktemp("planted")
    (root / "planted_backends.py").write_text(PLANTED)
    info = root / "aiperf_planted-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: aiperf-planted\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [aiperf.backends]
        planted-failing = planted_backends:FailingBackend
        planted-two-devices = planted_backends:TwoDevices
        planted-two-devices-parallel = planted_backends:TwoDevicesParallel
        planted-mixed = planted_backends:MixedPrecision
        """))
    return root


@pytest.fixture
def on_path(planted, monkeypatch):
    """The planted backends visible to this process and to every child it starts."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(planted), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(planted))
    return planted


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def _config(tmp_path, extra: str = "") -> str:
    path = tmp_path / "aiperf.toml"
    path.write_text(TINY_POLICY + extra)
    return str(path)


# --- precision ---------------------------------------------------------------------------------
def test_auto_resolves_to_the_fastest_declared_precision_of_the_run_device(on_path):
    seed = {"model": "resnet_small", "input_shape": [8, 8, 3], "classes": 3, "batch_size": 4}
    with plan.BackendProbe("planted-mixed") as probe:
        facts = probe.facts(auto=seed)
    assert (facts.devices, facts.device, facts.precisions) == (["fake:0"], "fake:0", ("fp32", "bf16", "fp16"))
    timed = facts.precision_probe["seconds_per_step"]  # measured: tests/test_auto_precision.py
    assert set(timed) == {"fp32", "bf16", "fp16"} and facts.precision_probe["chosen"] == min(timed, key=timed.get)
    assert plan.resolve_precision("auto", facts, "planted-mixed") == facts.precision_probe["chosen"]
    assert plan.resolve_precision("fp16", facts, "planted-mixed") == "fp16"
    with pytest.raises(AiperfError, match=r"^policy\.precision: backend 'planted-mixed' does not declare tf32 on "
                                          r"fake:0 \(it declares fp32, bf16, fp16; auto picks the fastest\)$"):
        plan.resolve_precision("tf32", facts, "planted-mixed")
    with plan.BackendProbe("numpy") as probe:  # a CPU without AMX: fp32
        assert plan.resolve_precision("auto", probe.facts(auto=seed), "numpy") == "fp32"


def test_a_slurm_primary_leaves_auto_to_the_replicas():
    facts = plan.BackendFacts(devices=["cpu"], data_parallel=True)  # precisions not probed
    assert plan.resolve_precision("auto", facts, "torch") is None
    assert plan.resolve_precision("bf16", facts, "torch") == "bf16"


def test_run_json_records_the_resolved_precision_in_the_fixed_configuration(tmp_path):
    from aiperf_core.replica import write_run_json

    run = write_run_json(tmp_path / "a", policy={"dataset": "digits"}, precision="bf16")
    assert run["policy"]["precision"] == "auto" and run["precision"] == "bf16"
    assert "precision" in plan.CONFIG_KEYS and run["config_sha256"] == plan.config_sha256(run)
    assert plan.config_sha256({**run, "precision": "fp16"}) != run["config_sha256"]
    with pytest.raises(AiperfError, match="not a resolution of policy.precision 'fp16'"):
        write_run_json(tmp_path / "b", policy={"dataset": "digits", "precision": "fp16"}, precision="bf16")


@pytest.mark.parametrize("text, message", [
    ('[policy]\nprecision = "fp8"\n', "policy.precision: 'fp8' must be one of auto, fp32, tf32, bf16, fp16"),
    ('precision = "bf16"\n', "unknown setting 'precision': it is a policy item, set it under [policy]"),
])
def test_bad_precision_in_the_config_is_one_line(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--config", str(path),
                          "--run-dir", str(tmp_path / "r")])
    assert err == f"aiperf: error: config file {path}: {message}"
    assert not (tmp_path / "r").exists()


def test_a_precision_the_device_does_not_declare_is_refused_before_the_start(tmp_path, capsys):
    config = _config(tmp_path, 'precision = "fp16"\n')  # TINY_POLICY ends in its [policy] table
    err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--config", config,
                          "--run-dir", str(tmp_path / "r")])
    assert err.startswith("aiperf: error: policy.precision: backend 'numpy' does not declare fp16 on cpu")
    assert not (tmp_path / "r").exists()


def test_jax_fp16_is_refused_up_front(tmp_path, capsys):
    """Issue 18's case: it ran three failing trials and exited 0 (jax declares no fp16 anywhere)."""
    pytest.importorskip("jax")
    config = _config(tmp_path, 'precision = "fp16"\n')
    err = _error(capsys, ["run", "--backend", "jax", "--data", "digits", "--config", config,
                          "--run-dir", str(tmp_path / "r")])
    assert err.startswith("aiperf: error: policy.precision: backend 'jax' does not declare fp16 on ")
    assert not (tmp_path / "r").exists()


def test_resume_trains_at_the_recorded_precision(tmp_path):
    run = {"backend": "planted-mixed", "precision": "bf16"}
    facts = plan.BackendFacts(devices=["fake:0"], data_parallel=False, device="fake:0", precisions=("fp32",))
    with pytest.raises(AiperfError, match=r"^--resume: the run trains at bf16 \(run.json precision\), which backend "
                                          r"'planted-mixed' does not declare on fake:0 here"):
        plan.check_recorded_precision(run, facts)
    plan.check_recorded_precision({**run, "precision": "fp32"}, facts)


def test_a_run_json_without_a_resolved_precision_is_not_resumed_silently(tmp_path, capsys):
    from aiperf_core.replica import write_run_json

    run = write_run_json(tmp_path / "run", policy={"dataset": "digits"})
    del run["precision"], run["schema_version"]
    run["config_sha256"] = "made by an older aiperf"
    RunDir(tmp_path / "run").write_run(run)
    err = _error(capsys, ["run", "--resume", str(tmp_path / "run")])
    assert "run.json records no resolved precision" in err and "resume it with that version" in err


# --- devices ----------------------------------------------------------------------------------
def test_several_devices_for_a_single_device_backend_are_refused(tmp_path, capsys, on_path):
    err = _error(capsys, ["run", "--backend", "planted-two-devices", "--data", "digits", "--config", _config(tmp_path),
                          "--run-dir", str(tmp_path / "r")])
    assert err == ("aiperf: error: --backend planted-two-devices: trains on one device only (it declares no data "
                   "parallelism), but each replica would get 2 devices; give --devices-per-replica 1")
    assert not (tmp_path / "r").exists()
    facts = plan.BackendFacts(devices=["fake:0", "fake:1"], data_parallel=False)
    plan.check_parallelism("planted-two-devices", facts, 1, "--devices-per-replica")  # one each: fine
    with pytest.raises(AiperfError, match="give --slurm-gpus-per-node 1"):
        plan.check_parallelism("planted-two-devices", facts, 4, "--slurm-gpus-per-node")
    plan.check_parallelism("x", plan.BackendFacts(devices=["fake:0", "fake:1"], data_parallel=True), 2, "-")


# --- data workers -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, config, message", [
    (["--data-workers", "0"], "", "aiperf run: error: argument --data-workers: '0' must be at least 1"),
    (["--data-workers", "-3"], "", "aiperf run: error: argument --data-workers: '-3' must be at least 1"),
    (["--data-workers=-1"], "", "aiperf run: error: argument --data-workers: '-1' must be at least 1"),
    ([], "data_workers = 0\n", "policy.data_workers: 0 must be at least 1"),
    ([], "data_workers = -2\n", "policy.data_workers: -2 must be at least 1"),
    ([], "data_workers = 1.5\n", "policy.data_workers: 1.5 must be an integer"),
])
def test_data_workers_below_one_are_one_line_errors(tmp_path, capsys, args, config, message):
    path = _config(tmp_path, config)
    err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--config", path,
                          "--run-dir", str(tmp_path / "r"), *args])
    assert err.endswith(message), err
    assert not (tmp_path / "r").exists()


def test_data_workers_at_the_top_of_the_config_points_to_the_policy(tmp_path, capsys):
    path = tmp_path / "top.toml"
    path.write_text("data_workers = 4\n")
    assert _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--config", str(path)]) == \
        f"aiperf: error: config file {path}: unknown setting 'data_workers': it is a policy item, set it under [policy]"


def test_dali_for_in_memory_digits_is_refused_before_the_start(tmp_path, capsys):
    path = _config(tmp_path, 'data_loader = "dali"\n')
    err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--config", path,
                          "--run-dir", str(tmp_path / "r")])
    assert "data_loader: dali decodes stored images; the digits dataset is in memory" in err, err
    assert not (tmp_path / "r").exists()


# --- a run that produced nothing ----------------------------------------------------------------
def test_a_run_whose_every_trial_fails_exits_non_zero_and_names_the_cause(tmp_path, on_path):
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "aiperf_core", "run", "--backend", "planted-failing", "--data", "digits",
         "--config", _config(tmp_path), "--run-dir", str(run_dir), "--time-budget", "3m"],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 1, result.stdout + result.stderr
    cause = "RuntimeError: planted: this backend fails every trial"
    assert ("the run produced nothing: no trial succeeded (3 failed trial(s), 0 failed replica attempt(s)); "
            f"first failure, trial r0000-t00000: {cause}") in result.stderr
    assert "FAILED: the run produced nothing" in result.stdout and "run ended: all_replicas_finished" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failure"]["first_cause"] == cause and summary["failure"]["failed_trials"] == 3
    probe = summary["precision"].pop("probe")  # only fp32 declared on this CPU: nothing timed
    assert (probe["chosen"], probe["seconds_per_step"]) == ("fp32", {})
    assert summary["precision"] == {"policy": "auto", "resolved": "fp32", "trials": {"fp32": 3}}
    assert json.loads((run_dir / "score.json").read_text())["failure"]["first_where"] == "trial r0000-t00000"
