"""The primary's decisions with a scripted executor (no processes), and the pieces it is built of:
durations, the config file, the local device layout, sbatch passthrough."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiperf_core.config_file import load_config
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import EventLog, RunDir, read_events
from aiperf_core.workflow.duration import format_duration, parse_duration
from aiperf_core.workflow.executors.base import (Executor, NodeProcessesHandle, ProcessEnd, ReplicaHandle,
                                                 describe_exit_code)
from aiperf_core.workflow.executors.local import plan_layout, replica_environment
from aiperf_core.workflow.executors.slurm import SlurmHandle, parse_extra_args
from aiperf_core.workflow.plan import WatchSettings
from aiperf_core.workflow.primary import Primary, stop_file

# A config for quick real runs, shared by the workflow tests: the smallest network, one-epoch
# trials, no HPO rounds (unofficial, which is fine for a test).
TINY_POLICY = """
[policy]
initial_architecture = "resnet_small"
warmup_epochs = [1]
max_epochs = 1
batch_size = 256
hpo_start_round = 50
"""


# --- durations --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, seconds", [("90m", 5400), ("12h", 43200), ("1h30m", 5400), ("45s", 45),
                                           ("2d", 172800), ("600", 600), (" 1.5h ", 5400), (30, 30)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "12x", "h", "1h1h", "-5m", "0", "0s", "5m3"])
def test_bad_durations_name_the_option(text):
    with pytest.raises(AiperfError, match="^--time-budget: "):
        parse_duration(text)


def test_format_duration():
    assert [format_duration(s) for s in (12, 247, 3900)] == ["12s", "4m07s", "1h05m"]


# --- config file ------------------------------------------------------------------------------
def test_config_carries_run_options_policy_and_slurm(tmp_path):
    path = tmp_path / "aiperf.toml"
    path.write_text('backend = "torch"\nexecutor = "slurm"\nreplicas = 4\ntime_budget = "12h"\ndata = "digits"\n'
                    'seed = 3\nmax_restarts = 0\n[policy]\nimage_size = 64\n'
                    '[slurm]\npartition = "gpu"\ngpus_per_node = 4\nextra_args = ["--qos=high"]\n')
    config = load_config(path)
    assert config["replicas"] == 4 and config["policy"] == {"image_size": 64}
    assert config["slurm"]["extra_args"] == ["--qos=high"]


@pytest.mark.parametrize("text, message", [
    ('replica = 2', "unknown setting 'replica'"),
    ('[slurm]\npartitio = "x"', "unknown setting 'slurm.partitio'"),
    ('[policy]\nmax_epoch = 3', "policy.max_epoch: unknown setting"),
    ('[policy]\nmax_epochs = 0', "policy.max_epochs: 0 must be in"),
    ('replicas = 0', "'replicas' must be at least 1"),
    ('executor = "k8s"', "'executor' must be one of local, slurm"),
    ('time_budget = "soon"', "'time_budget' must be a duration"),
    ('stall_timeout = "never"', "'stall_timeout' must be a duration"),
    ('[slurm]\ngpus_per_node = "4"', "'slurm.gpus_per_node' must be an integer"),
    ('policy = 3', "'policy' must be a table"),
])
def test_config_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "aiperf.toml"
    path.write_text(text + "\n")
    with pytest.raises(AiperfError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"config file {path}: ") and message in str(caught.value)


def test_the_stall_timeout_comes_from_the_flag_the_config_or_run_json():
    from aiperf_core.workflow.plan import RunRequest, merge_request, watch_settings

    assert watch_settings(RunRequest()).stall_timeout_s == 600.0
    assert merge_request({}, {"stall_timeout": "20m"}).stall_timeout == "20m"
    assert merge_request({"stall_timeout": "15m"}, {"stall_timeout": "20m"}).stall_timeout == "15m"
    settings = watch_settings(RunRequest(stall_timeout="15m"), {"stall_timeout_s": 120.0})
    assert settings.stall_timeout_s == 900.0 and settings.to_json()["stall_timeout_s"] == 900.0
    assert watch_settings(RunRequest(), {"stall_timeout_s": 120.0}).stall_timeout_s == 120.0  # on --resume
    with pytest.raises(AiperfError, match="^--stall-timeout: 'soon' is not a duration"):
        watch_settings(RunRequest(stall_timeout="soon"))


# --- local layout -----------------------------------------------------------------------------
def test_cpu_machine_runs_one_cpu_replica_with_every_core():
    layout = plan_layout([], None, None, cores=8)
    assert (layout.replicas, layout.devices, layout.threads_per_replica) == (1, [["cpu"]], 8)
    assert plan_layout([], 2, None, cores=8).threads_per_replica == 4


def test_logical_cpu_devices_are_every_cpu_replicas_devices():
    layout = plan_layout([], None, None, cores=2, cpu_devices=2)
    assert (layout.replicas, layout.devices_per_replica, layout.devices) == (1, 2, [["cpu:0", "cpu:1"]])
    assert plan_layout([], None, 2, cores=2, cpu_devices=2).devices_per_replica == 2
    with pytest.raises(AiperfError, match=r"^--devices-per-replica: 1 asked, but the backend shows 2 CPU devices "
                                          r"\(AIPERF_CPU_DEVICES=2\), each replica trains on them all$"):
        plan_layout([], None, 1, cores=2, cpu_devices=2)


def test_accelerators_scale_up_by_default_and_out_on_request():
    gpus = [f"cuda:{i}" for i in range(4)]
    assert plan_layout(gpus, None, None, cores=16).devices == [gpus]
    out = plan_layout(gpus, 4, None, cores=16)
    assert out.devices == [[g] for g in gpus] and out.threads_per_replica == 4
    assert plan_layout(gpus, None, 2, cores=16).devices == [gpus[:2], gpus[2:]]


@pytest.mark.parametrize("accelerators, replicas, per_replica, option", [
    ([], None, 2, "--devices-per-replica"), (["cuda:0"], 2, None, "--replicas"), (["cuda:0", "cuda:1"], 2, 2, "--replicas"),
    ([], 9, None, "--replicas")])
def test_impossible_layouts_name_the_option(accelerators, replicas, per_replica, option):
    with pytest.raises(AiperfError, match=f"^{option}"):
        plan_layout(accelerators, replicas, per_replica, cores=8)


def test_replica_environment_confines_devices_and_threads():
    env = replica_environment(["cuda:1", "cuda:2"], 4, parent={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert env == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4",
                   "CUDA_VISIBLE_DEVICES": "5,6"}
    assert replica_environment(["npu:3"], 2, parent={"OMP_NUM_THREADS": "1"})["ASCEND_RT_VISIBLE_DEVICES"] == "3"
    assert "OMP_NUM_THREADS" not in replica_environment(["cpu"], 2, parent={"OMP_NUM_THREADS": "1"})


def test_exit_codes_in_words():
    assert describe_exit_code(-9).description == "killed by signal 9 (SIGKILL)"
    assert describe_exit_code(1).description == "exit code 1" and describe_exit_code(0).success


def test_sbatch_passthrough():
    assert parse_extra_args("--qos=high --exclusive --constraint a100") == {"qos": "high", "exclusive": True,
                                                                           "constraint": "a100"}
    assert parse_extra_args(["--qos=high", "--comment 'a b'"]) == {"qos": "high", "comment": "a b"}
    with pytest.raises(AiperfError, match="^--slurm-extra: '-q'"):
        parse_extra_args("-q high")


def test_slurm_job_states_from_squeue():
    handle = SlurmHandle(None, "7")
    handle.observe("RUNNING", "None")
    assert handle.poll() is None and handle.started()
    handle.observe("OUT_OF_MEMORY", "OutOfMemory")
    assert handle.poll() == ProcessEnd(False, "SLURM state OUT_OF_MEMORY (OutOfMemory)")
    gone = SlurmHandle(None, "8")
    gone.observe(None, "")  # one missing answer is not enough: squeue may lag behind sbatch
    assert gone.poll() is None
    gone.observe(None, "")
    assert "left the queue" in gone.poll().description


# --- the primary with a scripted executor -----------------------------------------------------
class ScriptedHandle(ReplicaHandle):
    def __init__(self, command, end):
        super().__init__(command, f"job-{command.replica}-{command.attempt}")
        self.end = end

    def poll(self):
        return self.end

    def started(self):
        return True


class ScriptedExecutor(Executor):
    """Each launch runs `script[(replica, attempt)]` at once: it writes the replica's events and
    returns how the attempt ends (None: it runs until stopped)."""

    name = "scripted"
    poll_interval_s = 0.01

    def __init__(self, run_dir: RunDir, script):
        self.run_dir, self.script = run_dir, script
        self.stopped, self.leftovers = [], []

    def launch(self, command):
        behave = self.script.get((command.replica, command.attempt), finish)
        return ScriptedHandle(command, behave(self.run_dir, command.replica, command.attempt))

    def stop(self, handles, grace_s):
        for handle in handles:
            self.stopped.append(handle.job)
            handle.end = handle.end or ProcessEnd(False, "killed by signal 15 (SIGTERM)", signal=15)

    def end_leftover(self, replica, job):
        self.leftovers.append((replica, job))


def _replica_events(run_dir: RunDir, replica: int, *events):
    with EventLog(run_dir.replica_log(replica)) as log:
        for event, fields in events:
            log.append(event, replica=replica, **fields)


def finish(run_dir, replica, attempt):
    _replica_events(run_dir, replica, ("replica_start", {"attempt": attempt}), ("replica_stop", {"reason": "max_trials"}))
    return ProcessEnd(True, "exit code 0", exit_code=0)


def crash_mid_trial(run_dir, replica, attempt):
    _replica_events(run_dir, replica, ("replica_start", {"attempt": attempt}),
                    ("trial_start", {"trial": f"r{replica:04d}-t{attempt:05d}"}))
    with open(run_dir.replica_dir(replica) / "replica.log", "a") as log:
        log.write("Traceback (most recent call last):\nMemoryError: out of memory\n")
    return ProcessEnd(False, "exit code 1", exit_code=1)


def hang_silently(run_dir, replica, attempt):
    return None


def _primary(tmp_path, script, replicas=1, budget_s=60.0, **watch):
    run_dir = RunDir(tmp_path / "run")
    run_dir.primary_dir.mkdir(parents=True)
    settings = WatchSettings(**{"max_restarts": 3, "heartbeat_timeout_s": 60.0, "stop_grace_s": 0.2, "slurm": {},
                                **watch})
    run = {"deadline": time.time() + budget_s, "replicas": replicas}
    executor = ScriptedExecutor(run_dir, script)
    return Primary(run_dir, run, executor, settings), run_dir, executor


def _primary_events(run_dir):
    return read_events(run_dir.primary_log)


def test_a_crashed_replica_is_restarted_and_its_trial_and_log_tail_recorded(tmp_path):
    primary, run_dir, _ = _primary(tmp_path, {(0, 1): crash_mid_trial}, replicas=2)
    assert primary.run_to_end() == "all_replicas_finished"
    events = _primary_events(run_dir)
    crashed = [e for e in events if e["event"] == "replica_exit" and e["status"] == "crashed"]
    assert len(crashed) == 1
    assert crashed[0]["reason"] == "exit code 1 during trial r0000-t00001"
    assert crashed[0]["trial"] == "r0000-t00001" and crashed[0]["restart"] is True
    assert crashed[0]["log_tail"][-1] == "MemoryError: out of memory"
    launches = [(e["replica"], e["attempt"]) for e in events if e["event"] == "replica_launch"]
    assert sorted(launches) == [(0, 1), (0, 2), (1, 1)]
    assert events[-1]["event"] == "run_end" and set(events[-1]["log_heads"]) == {"0", "1"}


def test_a_replica_out_of_restarts_is_given_up(tmp_path):
    primary, run_dir, _ = _primary(tmp_path, {(0, 1): crash_mid_trial, (0, 2): crash_mid_trial}, max_restarts=1)
    assert primary.run_to_end() == "all_replicas_failed"
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert [(e["status"], e["restart"]) for e in exits] == [("crashed", True), ("crashed", False)]


class SlowPollingExecutor(ScriptedExecutor):
    """Each replica a real process that ends after 0.3 s, polled every 30 s."""

    poll_interval_s = 30.0

    def launch(self, command):
        return NodeProcessesHandle(command, [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])])


def test_the_primary_sees_a_replica_process_end_between_its_polls(tmp_path):
    """The run's end, and so its score's time, follows the replica's exit, not the executor's poll interval."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.primary_dir.mkdir(parents=True)
    settings = WatchSettings(max_restarts=0, heartbeat_timeout_s=60.0, stop_grace_s=0.2, slurm={})
    primary = Primary(run_dir, {"deadline": time.time() + 120, "replicas": 1}, SlowPollingExecutor(run_dir, {}), settings)
    started = time.monotonic()
    assert primary.run_to_end() == "all_replicas_failed"  # it logged no replica_stop: a crash, not restarted
    assert time.monotonic() - started < 10
    [launch, end] = [e for e in _primary_events(run_dir) if e["event"] in ("replica_launch", "run_end")]
    assert end["time"] - launch["time"] < 5


def test_a_silent_replica_is_lost_stopped_and_restarted(tmp_path):
    primary, run_dir, executor = _primary(tmp_path, {(0, 1): hang_silently}, heartbeat_timeout_s=0.2)
    assert primary.run_to_end() == "all_replicas_finished"
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert exits[0]["status"] == "lost" and exits[0]["reason"].startswith("no heartbeat for")
    assert executor.stopped == ["job-0-1"] and exits[1]["status"] == "finished"


def test_a_fresh_heartbeat_keeps_a_replica_alive(tmp_path):
    def beat_then_finish(run_dir, replica, attempt):
        run_dir.write_heartbeat(replica, state="training")
        return None
    primary, run_dir, _ = _primary(tmp_path, {(0, 1): beat_then_finish}, heartbeat_timeout_s=5.0, budget_s=0.5)
    assert primary.run_to_end() == "deadline"
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert [e["status"] for e in exits] == ["stopped"]


def test_at_the_deadline_replicas_are_asked_then_made_to_stop(tmp_path):
    primary, run_dir, executor = _primary(tmp_path, {(0, 1): hang_silently, (1, 1): hang_silently}, replicas=2,
                                          budget_s=0.3)
    assert primary.run_to_end() == "deadline"
    assert stop_file(run_dir).exists()
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert sorted((e["replica"], e["status"]) for e in exits) == [(0, "stopped"), (1, "stopped")]
    assert sorted(executor.stopped) == ["job-0-1", "job-1-1"]


def test_resume_ends_what_the_killed_primary_left_running_and_continues(tmp_path):
    primary, run_dir, executor = _primary(tmp_path, {}, replicas=2)
    with EventLog(run_dir.primary_log) as log:  # an earlier primary, killed with both replicas running
        log.append("run_start", resume=False)
        log.append("replica_launch", replica=0, attempt=1, job="111", log_seq=0)
        log.append("replica_launch", replica=1, attempt=1, job="222", log_seq=0)
        log.append("replica_exit", replica=1, attempt=1, status="crashed", reason="exit code 1", restart=True)
        log.append("replica_launch", replica=1, attempt=2, job="333", log_seq=0)
    with open(run_dir.primary_log, "ab") as f:
        f.write(b'{"event": "replica_ex')  # torn by the kill
    _replica_events(run_dir, 0, ("replica_start", {"attempt": 1}), ("trial_start", {"trial": "r0000-t00000"}))
    primary.resume = True
    assert primary.run_to_end() == "all_replicas_finished"
    assert sorted(executor.leftovers) == [(0, "111"), (1, "333")]
    events = _primary_events(run_dir)
    assert [e["resume"] for e in events if e["event"] == "run_start"] == [False, True]
    recovered = [e for e in events if e["event"] == "replica_exit" and e.get("exit") == "unknown (primary was down)"]
    assert [(e["replica"], e["attempt"], e["status"], e["trial"]) for e in recovered] == [
        (0, 1, "stopped", "r0000-t00000"), (1, 2, "stopped", None)]
    relaunched = [(e["replica"], e["attempt"]) for e in events if e["event"] == "replica_launch"][3:]
    assert sorted(relaunched) == [(0, 2), (1, 3)]


def test_resume_of_an_ended_run_does_nothing(tmp_path):
    primary, run_dir, executor = _primary(tmp_path, {})
    with EventLog(run_dir.primary_log) as log:
        log.append("run_start", resume=False)
        log.append("run_end", reason="deadline", log_heads={})
    primary.resume = True
    assert primary.run_to_end() == "deadline"
    assert len(_primary_events(run_dir)) == 2


def test_the_stop_file_of_an_earlier_shutdown_is_cleared_before_the_deadline(tmp_path):
    primary, run_dir, _ = _primary(tmp_path, {})
    stop_file(run_dir).write_text("{}")
    assert primary.run_to_end() == "all_replicas_finished"
    assert not stop_file(run_dir).exists()


def test_replica_log_lines_are_bounded(tmp_path):
    from aiperf_core.workflow.executors.base import LOG_TAIL_CHARS, LOG_TAIL_LINES, log_tail

    log = Path(tmp_path / "replica.log")
    log.write_text("x" * 5000 + "\n" + "\n".join(f"line {i}" for i in range(80)) + "\n")
    tail = log_tail(log)
    assert tail[-1] == "line 79" and len(tail) == LOG_TAIL_LINES
    assert log_tail(log, lines=100)[0] == "x" * LOG_TAIL_CHARS


def test_the_log_tail_of_an_attempt_holds_only_what_it_wrote(tmp_path):
    from aiperf_core.workflow.executors.base import log_tail

    log = Path(tmp_path / "replica.log")
    log.write_text("attempt 1 said this\n")
    since = log.stat().st_size
    assert log_tail(log, since=since) == []
    with open(log, "a") as f:
        f.write("double free or corruption (!prev)\nFatal Python error: Aborted\n")
    assert log_tail(log, since=since) == ["double free or corruption (!prev)", "Fatal Python error: Aborted"]


# --- the live display -------------------------------------------------------------------------
def _progress():
    from aiperf_core.scoring.progress import Progress, ReplicaProgress

    replicas = (ReplicaProgress(0, "node1", 2, 5, "r0000-t00005", 3, False, None),
                ReplicaProgress(1, "node2", 1, 4, None, 0, True, None))
    return Progress(now=0, elapsed_s=600, budget_s=3600, remaining_s=3000, ended=False, trials_done=9,
                    trials_running=1, epochs_counted=20, ops_per_s=1.5e12, regulated_ops=3e12, best_accuracy=0.8,
                    best_error=0.2, replicas=replicas)


def test_display_lines():
    from aiperf_core.workflow.progress import render

    lines = render(_progress())
    assert lines[0] == "elapsed 10m00s of 1h00m (17%), 50m00s left"
    assert "OPS 1.50 Tera-OPS" in lines[1] and "best accuracy 80.00%" in lines[1]
    assert lines[2] == "  replica 0 on node1: attempt 2, 5 trials done, training r0000-t00005 (epoch 4)"
    assert lines[3].endswith("4 trials done, stopped")


def test_display_redraws_in_place_on_a_terminal_and_appends_lines_otherwise(monkeypatch):
    import io

    from aiperf_core.workflow import progress

    monkeypatch.setattr(progress.LiveDisplay, "_lines", lambda self, now: ["a", "b"])
    terminal = io.StringIO()
    display = progress.LiveDisplay("unused", terminal, interactive=True)
    display.tick(0, force=True)
    display.tick(0, force=True)
    assert terminal.getvalue() == "a\nb\n\x1b[2F\x1b[Ja\nb\n"
    display.note("replica 0 crashed")  # above the block: erase it, print the note; the next tick redraws
    assert re.search(r"a\nb\n\x1b\[2F\x1b\[J\d\d:\d\d:\d\d replica 0 crashed\n$", terminal.getvalue())
    log = io.StringIO()
    plain = progress.LiveDisplay("unused", log, interactive=False)
    plain.tick(0)
    plain.tick(0)  # within the interval: nothing
    assert log.getvalue().count("\n") == 1 and "\x1b" not in log.getvalue() and log.getvalue().endswith("a | b\n")


def test_resume_adopts_a_job_that_outlived_its_primary(tmp_path):
    primary, run_dir, executor = _primary(tmp_path, {})
    with EventLog(run_dir.primary_log) as log:
        log.append("run_start", resume=False)
        log.append("replica_launch", replica=0, attempt=1, job="job-0-1", log_seq=0)

    def adopt(command, job):  # the job still runs; it finishes while the new primary watches
        return ScriptedHandle(command, finish(run_dir, command.replica, command.attempt))
    executor.adopt = adopt
    primary.resume = True
    assert primary.run_to_end() == "all_replicas_finished"
    events = [(e["event"], e.get("attempt"), e.get("status")) for e in _primary_events(run_dir)]
    assert events[2:] == [("run_start", None, None), ("replica_adopt", 1, None), ("replica_exit", 1, "finished"),
                          ("run_end", None, None)]
    assert executor.leftovers == []


def test_a_refused_relaunch_is_a_failed_attempt_retried_later(tmp_path, monkeypatch):
    from aiperf_core.workflow import primary as primary_module

    monkeypatch.setattr(primary_module, "LAUNCH_RETRY_S", 0.05)

    def refuse(run_dir, replica, attempt):
        raise AiperfError("--executor slurm: sbatch refused replica 0: Invalid partition name specified")
    primary, run_dir, _ = _primary(tmp_path, {(0, 1): crash_mid_trial, (0, 2): refuse})
    assert primary.run_to_end() == "all_replicas_finished"
    exits = [e for e in _primary_events(run_dir) if e["event"] == "replica_exit"]
    assert [(e["attempt"], e["status"]) for e in exits] == [(1, "crashed"), (2, "crashed"), (3, "finished")]
    assert exits[1]["exit"].startswith("launch failed: --executor slurm: sbatch refused")


def test_a_refused_first_launch_is_the_users_error(tmp_path):
    def refuse(run_dir, replica, attempt):
        raise AiperfError("--executor slurm: sbatch refused replica 0: Invalid account")
    primary, _, _ = _primary(tmp_path, {(0, 1): refuse})
    with pytest.raises(AiperfError, match="Invalid account"):
        primary.run_to_end()


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
    primary, run_dir, _ = _primary(tmp_path, {(0, 1): hang_silently, (1, 1): hang_silently}, replicas=2)
    primary.tick = lambda now: setattr(primary, "_interrupted", 15)  # SIGTERM once both run
    assert primary.run_to_end() == "interrupted"
    resumed = Primary(run_dir, primary.run, primary.executor, primary.watch, resume=True)
    assert resumed.run_to_end() == "all_replicas_finished"
    events = _primary_events(run_dir)
    assert [e["reason"] for e in events if e["event"] == "run_end"] == ["interrupted", "all_replicas_finished"]
    assert [(e["replica"], e["attempt"], e["status"]) for e in events if e["event"] == "replica_exit"] == [
        (0, 1, "stopped"), (1, 1, "stopped"), (0, 2, "finished"), (1, 2, "finished")]
