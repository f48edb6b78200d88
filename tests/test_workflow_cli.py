"""`aiperf run` end to end with local replicas, and its checks before anything starts."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from aiperf_core.atomic import new_file_mode
from aiperf_core.cli import main
from aiperf_core.rundir import RunDir, read_events
from aiperf_core.scoring import progress, score_run
from aiperf_core.workflow.plan import CONFIG_KEYS, config_sha256
from test_workflow import TINY_POLICY

RUN_JSON_KEYS = {"schema_version", "run_id", "created", "start_time", "time_budget_s", "deadline", "backend",
                 "executor", "replicas", "devices_per_replica", "seed", "model", "dataset", "policy",
                 "policy_overridden_fixed", "config_sha256"}


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "aiperf.toml"
    path.write_text(TINY_POLICY)
    return path


def test_unknown_backend(tmp_path, capsys):
    err = _error(capsys, ["run", "--backend", "nosuch", "--data", "digits", "--run-dir", str(tmp_path / "r")])
    assert err.startswith("aiperf: error: --backend nosuch: no backend named 'nosuch' is installed")
    assert not (tmp_path / "r").exists()


def test_missing_data_path(tmp_path, capsys):
    err = _error(capsys, ["run", "--backend", "numpy", "--data", str(tmp_path / "imagenet"), "--run-dir",
                          str(tmp_path / "r")])
    assert err == f"aiperf: error: --data {tmp_path / 'imagenet'}: no such file or directory"
    assert "--data" in _error(capsys, ["run", "--backend", "numpy", "--run-dir", str(tmp_path / "r")])


def test_unwritable_run_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--run-dir", str(blocker / "run")])
    assert err.startswith(f"aiperf: error: --run-dir {blocker / 'run'}: not writable")


def test_bad_time_budget_and_config(tmp_path, capsys):
    assert _error(capsys, ["run", "--time-budget", "soon", "--backend", "numpy", "--data", "digits"]) == \
        "aiperf: error: --time-budget: 'soon' is not a duration (for example 90m, 12h, 1h30m)"
    bad = tmp_path / "bad.toml"
    bad.write_text("[slurm]\nqueue = 'x'\n")
    assert "unknown setting 'slurm.queue'" in _error(capsys, ["run", "--config", str(bad), "--data", "digits"])


def test_resume_of_a_folder_without_a_run(tmp_path, capsys):
    assert "not a run directory" in _error(capsys, ["run", "--resume", str(tmp_path)])


def _run(args, timeout=240):
    return subprocess.run([sys.executable, "-m", "aiperf_core", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


# A real torch run to its 10 s deadline: its replica starts and counts epochs (some 2 s each here) in it,
# and a longer run checks nothing more.
@pytest.mark.slow
def test_a_local_run_to_its_deadline_then_resume_rules(tmp_path, config, capsys):
    run_dir = tmp_path / "run"
    result = _run(["run", "--backend", "torch", "--data", "digits", "--config", str(config), "--run-dir",
                   str(run_dir), "--time-budget", "10s", "--seed", "7", "--stop-grace", "20s"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launched (local job" in result.stdout and "run ended: deadline" in result.stdout

    run = RunDir(run_dir).read_run()
    assert RUN_JSON_KEYS <= set(run)
    assert run["deadline"] == run["start_time"] + 10 and run["executor"] == "local" and run["seed"] == 7
    assert run["model"] == "resnet_small" and run["dataset"]["name"] == "digits"
    assert run["dataset"]["train_images"] > 0 and run["policy"]["image_size"] == 32
    assert set(run["policy_overridden_fixed"]) >= {"dataset", "initial_architecture", "max_epochs"}
    assert run["config_sha256"] == config_sha256({k: run.get(k) for k in CONFIG_KEYS})
    events = read_events(run_dir / "primary/events.jsonl")
    assert [e["event"] for e in events][:2] == ["run_start", "replica_launch"]
    assert events[-1]["event"] == "run_end" and events[-1]["reason"] == "deadline"
    exits = [e for e in events if e["event"] == "replica_exit"]
    assert len(exits) == 1 and exits[0]["status"] in ("finished", "stopped")
    replica = read_events(run_dir / "replicas/0/events.jsonl")
    assert replica[0]["event"] == "replica_start"
    assert (run_dir / "score.json").exists() and json.loads((run_dir / "score.json").read_text())["epochs_counted"] >= 0
    assert (run_dir / "summary.json").exists() and (run_dir / "report.html").exists()
    # Readable as the umask allows, as open(2) makes files: other users of a site read run directories.
    modes = {str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode) for p in run_dir.rglob("*") if p.is_file()}
    assert {name: mode for name, mode in modes.items() if mode != new_file_mode()} == {}

    # The primary left its live ledger's checkpoint at its end: a new reader (aiperf metrics or
    # watch on a login node) starts from it and shows the score's figures.
    checkpoint = json.loads((run_dir / "primary/progress.json").read_text())
    assert checkpoint["run_id"] == run["run_id"] and set(checkpoint["ledger"]["tails"]) == {"0"}
    progress.forget(run_dir)
    with progress.live_ledger(run_dir) as (shown, _):
        assert progress._LIVE[run_dir.resolve()].from_checkpoint
    progress.forget(run_dir)
    scored = score_run(run_dir)
    assert (shown.ops_per_s, shown.epochs_counted, shown.operations) == (scored.score_ops, scored.epochs_counted,
                                                                          scored.total_ops)

    # A different fixed configuration is refused, naming what differs; nothing is written.
    size = (run_dir / "primary/events.jsonl").stat().st_size
    assert "seed: 7 in the run, 8 now" in _error(capsys, ["run", "--resume", str(run_dir), "--seed", "8"])
    other = tmp_path / "other.toml"
    other.write_text(TINY_POLICY.replace("batch_size = 256", "batch_size = 128"))
    assert "policy.batch_size: 256 in the run, 128 now" in _error(capsys, ["run", "--resume", str(run_dir),
                                                                           "--config", str(other)])
    assert "already holds a run" in _error(capsys, ["run", "--backend", "numpy", "--data", "digits",
                                                    "--run-dir", str(run_dir)])
    assert (run_dir / "primary/events.jsonl").stat().st_size == size

    # The same configuration resumes; the run has ended, so nothing runs again.
    result = _run(["run", "--resume", str(run_dir), "--config", str(config), "--seed", "7"])
    assert result.returncode == 0, result.stderr
    assert "nothing to resume" in result.stdout
    assert (run_dir / "primary/events.jsonl").stat().st_size == size


def test_an_edited_run_json_is_refused(tmp_path, capsys):
    from aiperf_core.replica import write_run_json

    write_run_json(tmp_path / "run", policy={"dataset": "digits", "initial_architecture": "resnet_small"})
    run_file = tmp_path / "run" / "run.json"
    run_file.write_text(run_file.read_text().replace('"seed": 0', '"seed": 1'))
    assert "does not match its config_sha256" in _error(capsys, ["run", "--resume", str(tmp_path / "run")])
