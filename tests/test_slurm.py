"""`aiperf run --executor slurm` against a real one-node SLURM cluster (tests/slurm_cluster.py):
two replicas as two batch jobs, one of them killed mid-trial and restarted, both finishing
epochs, and a score at the end. Job state comes from squeue: this cluster has no slurmdbd, so
sacct fails here exactly as on the clusters the executor must cope with."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from aiperf_core.rundir import read_events, verify_chain
from slurm_cluster import SlurmCluster, aiperf_argv
from test_workflow import TINY_POLICY

ADOPT_TRIALS = 6  # one-epoch trials of each replica in the adoption test



@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _aiperf(args, env, **kwargs):
    # aiperf_argv: `python -m aiperf_core`, its SLURM executor polling squeue every second, not every 5 s.
    return subprocess.Popen(aiperf_argv(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


def _start_two_replicas(cluster, tmp_path, *extra):
    """`aiperf run` with two one-CPU replica jobs of two one-epoch trials each."""
    config = tmp_path / "aiperf.toml"
    config.write_text(TINY_POLICY)
    run_dir = tmp_path / "run"
    env = {**cluster.env, "OMP_NUM_THREADS": "1"}
    primary = _aiperf(["run", "--executor", "slurm", "--replicas", "2", "--backend", "torch", "--data", "digits",
                       "--config", str(config), "--run-dir", str(run_dir), "--time-budget", "10m",
                       "--stop-after-trials", "2", "--slurm-cpus-per-task", "1", *extra], env)
    return primary, run_dir, env


@pytest.mark.slow  # a real run of two SLURM jobs, one killed and restarted
def test_two_replicas_as_slurm_jobs_with_a_crash(cluster, tmp_path):
    primary, run_dir, _ = _start_two_replicas(cluster, tmp_path, "--slurm-extra=--comment=aiperf")
    # Kill replica 1's process once it trains: SLURM marks the job FAILED, the primary restarts it.
    victim = None
    deadline = time.monotonic() + 150
    while victim is None and time.monotonic() < deadline and primary.poll() is None:
        events = read_events(run_dir / "replicas/1/events.jsonl")
        beat = run_dir / "replicas/1/heartbeat.json"
        if any(e["event"] == "trial_start" for e in events) and beat.exists():
            victim = json.loads(beat.read_text())["pid"]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
    output, _ = primary.communicate(timeout=300)
    assert primary.returncode == 0, output
    assert victim is not None, output

    primary_log = read_events(run_dir / "primary/events.jsonl")
    exits = [e for e in primary_log if e["event"] == "replica_exit"]
    crashed = [e for e in exits if e["status"] == "crashed"]
    assert [e["replica"] for e in crashed] == [1], exits
    assert "signal 9" in crashed[0]["reason"] or "FAILED" in crashed[0]["reason"], crashed
    assert crashed[0]["restart"] is True and crashed[0]["trial"].startswith("r0001-")
    # Where the job itself says why it failed: submitit's stderr in executor/, apart from replica.log.
    assert any("replica exited with code -9" in line for line in crashed[0]["job_log_tail"]), crashed
    assert sorted((e["replica"], e["status"]) for e in exits if e["status"] == "finished") == [(0, "finished"),
                                                                                             (1, "finished")]
    assert [e["attempt"] for e in primary_log if e["event"] == "replica_launch" and e["replica"] == 1] == [1, 2]
    assert primary_log[-1]["event"] == "run_end" and primary_log[-1]["reason"] == "all_replicas_finished"
    for replica in (0, 1):
        events = read_events(run_dir / f"replicas/{replica}/events.jsonl")
        assert any(e["event"] == "epoch_end" for e in events), f"replica {replica} finished no epoch"
        assert verify_chain(run_dir / f"replicas/{replica}/events.jsonl") == []
    interrupted = [e for e in read_events(run_dir / "replicas/1/events.jsonl")
                   if e["event"] == "trial_end" and e["status"] == "interrupted"]
    assert [e["trial"] for e in interrupted] == [crashed[0]["trial"]]

    score = json.loads((run_dir / "score.json").read_text())
    assert score["score_ops"] > 0 and score["epochs_counted"] >= 2
    assert stat.S_IMODE((run_dir / "executor").stat().st_mode) == 0o700
    assert list((run_dir / "executor").glob("*.pkl")), "submitit's files belong in executor/"


def test_slurm_preflight_names_the_problem(cluster, tmp_path):
    run_dir = tmp_path / "run"
    no_slurm = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    result = subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--executor", "slurm", "--backend", "torch",
                             "--data", "digits", "--run-dir", str(run_dir)], env=no_slurm, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == "aiperf: error: --executor slurm: 'sbatch' is not on PATH (is this a SLURM " \
                                    "submit host?)"
    dead_controller = tmp_path / "slurm.conf"
    text = cluster.conf.read_text()
    port_line = next(line for line in text.splitlines() if line.startswith("SlurmctldPort="))
    dead_controller.write_text(text.replace(port_line, "SlurmctldPort=9") + "MessageTimeout=1\n")
    result = subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--executor", "slurm", "--backend", "torch",
                             "--data", "digits", "--run-dir", str(run_dir)],
                            env={**cluster.env, "SLURM_CONF": str(dead_controller)}, capture_output=True, text=True,
                            timeout=200)
    assert result.returncode == 2
    assert result.stderr.startswith("aiperf: error: --executor slurm: the SLURM controller does not answer"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not run_dir.exists(), "nothing may start before the checks pass"


@pytest.mark.slow  # a real run of two SLURM jobs, its primary killed and resumed
def test_a_killed_primary_resumes_and_adopts_its_running_jobs(cluster, tmp_path):
    # Six trials a replica, not two: on a fast CPU (a Zen 5 trains two of these in less time than the
    # resumed primary takes to start) a replica's job could end before there was anything to adopt.
    primary, run_dir, env = _start_two_replicas(cluster, tmp_path, "--stop-after-trials", str(ADOPT_TRIALS))
    deadline = time.monotonic() + 150
    while not all(any(e["event"] == "trial_start" for e in read_events(run_dir / f"replicas/{i}/events.jsonl"))
                  for i in (0, 1)):
        assert time.monotonic() < deadline and primary.poll() is None, primary.communicate()[0]
        time.sleep(0.2)
    primary.kill()  # the jobs outlive it, as they would a crashed login node
    primary.communicate()

    resumed = _aiperf(["run", "--resume", str(run_dir)], env)
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output
    events = read_events(run_dir / "primary/events.jsonl")
    assert sorted((e["replica"], e["attempt"]) for e in events if e["event"] == "replica_adopt") == [(0, 1), (1, 1)]
    assert sorted((e["replica"], e["attempt"], e["status"]) for e in events if e["event"] == "replica_exit") == [
        (0, 1, "finished"), (1, 1, "finished")]
    assert [e["attempt"] for e in events if e["event"] == "replica_launch"] == [1, 1], "nothing is launched twice"
    assert events[-1]["reason"] == "all_replicas_finished"
    for replica in (0, 1):
        replica_events = read_events(run_dir / f"replicas/{replica}/events.jsonl")
        assert sum(e["event"] == "replica_start" for e in replica_events) == 1
        assert not [e for e in replica_events if e.get("status") == "interrupted"]
    assert json.loads((run_dir / "score.json").read_text())["epochs_counted"] == 2 * ADOPT_TRIALS


def test_data_stage_under_srun_one_task_per_node_and_two_at_once(cluster, tmp_path):
    """docs/data.md's staging line, as a job step: `srun --ntasks-per-node=1 aiperf data stage`; then
    two tasks on the one node at once, as a careless `srun -n 2` would start: one copies, the other
    waits for it and finds the verified copy."""
    from test_data_stage import jpeg_dataset

    src = tmp_path / "shared" / "imagenet"
    manifest = jpeg_dataset(src)
    env = {**cluster.env, "OMP_NUM_THREADS": "1"}
    stage = [sys.executable, "-m", "aiperf_core", "data", "stage", str(src), str(tmp_path / "local"), "--json"]
    one = subprocess.run(["srun", "--nodes=1", "--ntasks-per-node=1", *stage], env=env, capture_output=True,
                         text=True, timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    (result,) = [json.loads(line) for line in one.stdout.splitlines()]
    assert result["copied"] == len(manifest.files) and result["digest"] == manifest.digest

    stage[-2] = str(tmp_path / "local2")
    two = subprocess.run(["srun", "--nodes=1", "--ntasks=2", *stage], env=env, capture_output=True, text=True,
                         timeout=120)
    assert two.returncode == 0, two.stdout + two.stderr
    results = [json.loads(line) for line in two.stdout.splitlines()]
    assert sorted(r["copied"] for r in results) == [0, len(manifest.files)]
    assert {r["digest"] for r in results} == {manifest.digest}
    check = subprocess.run([sys.executable, "-m", "aiperf_core", "data", "check", "--deep", str(tmp_path / "local2")],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and check.stdout.rstrip().endswith("ok"), check.stdout + check.stderr
