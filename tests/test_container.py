"""Replicas in an aiperf image, without building one (that is tests/test_container_image.py, `make
test-container`): the wrapping of a command for each runtime, the refusals before any replica
starts, the image's digest and stamp, what a replica records, and how the report and the reviewer's
check read it."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiperf_core.errors import AiperfError
from aiperf_core.report import write_report
from aiperf_core.submission.check import check_submission
from aiperf_core.submission.package import pack
from aiperf_core.workflow import container
from aiperf_core.workflow.container import (IMAGE_ENV, IMAGE_PYTHON, RUNTIME_ENV, Bind, ContainerSpec, ImageFacts,
                                            charliecloud_binds, check_devices, check_image, host_accelerators,
                                            image_reasons, launch_command, running_image, tree_digest, wrap_argv)
from test_score import GRAPH_1, RunBuilder
from test_submission import NODES, inputs, write_monitors  # noqa: F401 (inputs is a fixture)

REPLICA = [sys.executable, "-u", "-m", "aiperf_core", "replica", "--run-dir", "/scratch/run", "--replica-id", "3"]
IN_IMAGE = [IMAGE_PYTHON, "-I", "-u", "-m", "aiperf_core", "replica", "--run-dir", "/scratch/run", "--replica-id", "3"]
DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64
BINDS = (Bind("/scratch/run"), Bind("/data/imagenet", read_only=True))


# -- the wrapping ----------------------------------------------------------------------------------
def test_charliecloud_runs_the_images_python_isolated_with_binds(monkeypatch):
    monkeypatch.setenv("USER", "alice")
    argv = wrap_argv(REPLICA, ContainerSpec("charliecloud", "/img/aiperf", binds=BINDS))
    assert argv == ["ch-run", "--unset-env=LD_LIBRARY_PATH", "--unset-env=LD_PRELOAD", "--bind=/scratch/run",
                    "--bind=/data/imagenet", "/img/aiperf", "--", *IN_IMAGE]


def test_charliecloud_gets_a_user_where_the_environment_has_none(monkeypatch):
    monkeypatch.delenv("USER", raising=False)
    argv = wrap_argv(["true"], ContainerSpec("charliecloud", "/img/aiperf"))
    assert argv[0] == "env" and re.fullmatch(r"USER=\S+", argv[1]) and argv[2] == "ch-run"
    assert argv[-2:] == ["--", "true"]  # only this Python is replaced by the image's


def test_apptainer_binds_data_read_only_and_passes_gpus():
    argv = wrap_argv(REPLICA, ContainerSpec("apptainer", "/img/aiperf.sif", binds=BINDS, gpus=True))
    assert argv == ["apptainer", "exec", "--nv", "--bind", "/scratch/run:/scratch/run", "--bind",
                    "/data/imagenet:/data/imagenet:ro", "/img/aiperf.sif", *IN_IMAGE]
    assert "--nv" not in wrap_argv(REPLICA, ContainerSpec("apptainer", "/img/aiperf.sif"))


def test_podman_shares_the_nodes_namespaces_and_is_told_the_replicas_variables():
    argv = wrap_argv(REPLICA, ContainerSpec("podman", "aiperf:latest", binds=BINDS, gpus=True))
    head = argv[:argv.index("aiperf:latest")]
    for flag in ("--rm", "-i", "--network=host", "--pid=host", "--ipc=host", "--uts=host",
                 "--device=nvidia.com/gpu=all"):
        assert flag in head
    passed = {head[i + 1] for i, a in enumerate(head) if a == "--env"}
    assert {"AIPERF_*", "OMP_*", "MKL_*", "OPENBLAS_*", "CUDA_*"} <= passed  # podman expands NAME* from its own
    assert all(name.endswith("*") for name in passed)  # no value of the primary's is baked into the command
    assert ["--volume", "/data/imagenet:/data/imagenet:ro"] == head[head.index("/data/imagenet:/data/imagenet:ro") - 1:
                                                                  head.index("/data/imagenet:/data/imagenet:ro") + 1]
    assert argv[argv.index("aiperf:latest") + 1:] == IN_IMAGE


def test_pyxis_runs_a_job_step_in_the_image():
    argv = wrap_argv(REPLICA, ContainerSpec("pyxis", "/img/aiperf.sqsh", binds=BINDS))
    assert argv == ["srun", "--overlap", "--ntasks=1", "--container-image=/img/aiperf.sqsh",
                    "--container-mounts=/scratch/run:/scratch/run,/data/imagenet:/data/imagenet:ro",
                    "--no-container-mount-home", *IN_IMAGE]


def test_a_launch_in_the_image_tells_the_replica_its_image():
    spec = ContainerSpec("apptainer", "/img/aiperf.sif", digest=DIGEST_A)
    argv, env = launch_command(spec, REPLICA, {"OMP_NUM_THREADS": "1"})
    assert argv[-len(IN_IMAGE):] == IN_IMAGE
    assert env == {"OMP_NUM_THREADS": "1", IMAGE_ENV: "/img/aiperf.sif", RUNTIME_ENV: "apptainer"}
    assert launch_command(None, REPLICA, {"A": "1"}) == (REPLICA, {"A": "1"})


def test_the_wrapping_composes_with_a_command_extended_after_it():
    """A launcher that appends to the replica's command (a node rank) still runs it in the image."""
    spec = ContainerSpec("charliecloud", "/img/aiperf")
    assert wrap_argv(REPLICA, spec) + ["--node-rank", "1"] == wrap_argv(REPLICA + ["--node-rank", "1"], spec)


def test_the_local_executor_starts_the_wrapped_command(tmp_path, monkeypatch):
    """A fake ch-run on PATH writes down what it was asked to run: the executor's launch is wrapped."""
    from aiperf_core.workflow.executors.base import ReplicaCommand
    from aiperf_core.workflow.executors.local import LocalExecutor

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ch-run").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\necho $AIPERF_CONTAINER_RUNTIME "
                                    f"$OMP_NUM_THREADS > {tmp_path}/env\n")
    (bin_dir / "ch-run").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("USER", "alice")
    executor = LocalExecutor(tmp_path, [{"OMP_NUM_THREADS": "2"}])
    executor.container = ContainerSpec("charliecloud", "/img/aiperf", binds=(Bind("/srv"),))
    handle = executor.launch(ReplicaCommand(0, 1, REPLICA, log_path=tmp_path / "replica.log"))
    handle.process.wait(timeout=30)
    assert (tmp_path / "argv").read_text().split() == wrap_argv(REPLICA, executor.container)[1:]
    assert (tmp_path / "env").read_text().split() == ["charliecloud", "2"]


def test_the_hosts_executor_starts_each_node_in_the_image(tmp_path, monkeypatch):
    from aiperf_core.workflow.executors.base import ReplicaCommand
    from aiperf_core.workflow.executors.hosts import Host, HostsExecutor

    monkeypatch.setenv("USER", "alice")
    executor = HostsExecutor(tmp_path, [[Host("n1", 1), Host("n2", 1)]])
    executor.container = ContainerSpec("apptainer", "/img/aiperf.sif", binds=BINDS)
    argv = executor.node_command(ReplicaCommand(0, 1, REPLICA, nodes=2), 1)
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "n2"]
    assert f"{IMAGE_ENV}=/img/aiperf.sif" in argv and f"{RUNTIME_ENV}=apptainer" in argv
    tail = wrap_argv(REPLICA + ["--node-rank", "1"], executor.container)
    assert argv[-len(tail):] == tail


# -- mount points for ch-run -----------------------------------------------------------------------
def test_charliecloud_binds_the_deepest_folder_the_image_has():
    folders = {"/srv/runs/r1": "/srv", "/home/u/data": "/home", "/tmp/pytest/run": "/tmp"}
    binds = charliecloud_binds([Bind("/srv/runs/r1"), Bind("/home/u/data", read_only=True), Bind("/tmp/pytest/run")],
                               folders, "img")
    assert binds == (Bind("/home", read_only=True), Bind("/srv"))  # /tmp is ch-run's own bind


def test_charliecloud_refuses_to_cover_the_images_own_folders():
    with pytest.raises(AiperfError, match=r"^--container img: charliecloud cannot bind /work/run: the image has no "
                                          r"folder to mount it on \(only /\); build the image with IMAGE_MOUNTS=/work"):
        charliecloud_binds([Bind("/work/run")], {"/work/run": "/"}, "img")
    with pytest.raises(AiperfError, match="only /opt"):
        charliecloud_binds([Bind("/opt/runs/x")], {"/opt/runs/x": "/opt"}, "img")


# -- refusals, one line each -----------------------------------------------------------------------
def _fake_tool(folder: Path, name: str, script: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("#!/bin/sh\n" + script)
    (folder / name).chmod(0o755)


def test_no_runtime_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AiperfError, match=r"^--container img: no container runtime on PATH \(looked for ch-run, "
                                          r"apptainer, podman\)"):
        container.choose_runtime(None, "img")
    with pytest.raises(AiperfError, match=r"^--container-runtime apptainer: 'apptainer' is not on PATH$"):
        container.check_runtime("apptainer", "local")


def test_the_first_runtime_on_path_is_chosen(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "apptainer", "exit 0\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert container.choose_runtime(None, "img") == "apptainer"
    assert container.choose_runtime("podman", "img") == "podman"


def test_pyxis_needs_the_slurm_executor_and_the_plugin(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "srun", "echo 'Usage: srun [OPTIONS...] executable'\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(AiperfError, match="^--container-runtime pyxis: .*give --executor slurm$"):
        container.check_runtime("pyxis", "local")
    with pytest.raises(AiperfError, match=r"no --container-image \(the pyxis plugin is not installed"):
        container.check_runtime("pyxis", "slurm")
    _fake_tool(tmp_path, "srun", "echo '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'\n")
    container.check_runtime("pyxis", "slurm")


def test_an_image_that_is_not_there(tmp_path):
    with pytest.raises(AiperfError, match=f"^--container {tmp_path}/nope: no such image"):
        container.resolve_image("charliecloud", f"{tmp_path}/nope")
    (tmp_path / "aiperf.sif").write_bytes(b"")
    assert container.resolve_image("apptainer", str(tmp_path / "aiperf.sif")) == str(tmp_path / "aiperf.sif")
    assert container.resolve_image("apptainer", "docker://example/aiperf:1") == "docker://example/aiperf:1"
    assert container.resolve_image("pyxis", "example#aiperf:1") == "example#aiperf:1"


def test_an_image_without_a_stamp_or_without_the_backend():
    stamp = {"name": "aiperf", "extras": "search", "digest": DIGEST_A}
    assert check_image(ImageFacts(stamp=stamp, folders={}), "img", "numpy") == DIGEST_A
    with pytest.raises(AiperfError, match=r"^--container img: not an aiperf image: no /etc/aiperf/image.json"):
        check_image(ImageFacts(stamp=None, folders={}), "img", "numpy")
    facts = ImageFacts(stamp=stamp, folders={}, backend_error="backend 'torch' is unavailable: torch is not installed")
    with pytest.raises(AiperfError, match=r"^--container img: the image cannot run --backend torch: backend 'torch' is "
                                          r"unavailable: torch is not installed \(built with extras 'search'\)$"):
        check_image(facts, "img", "torch")


def test_a_device_that_cannot_pass_through(tmp_path):
    (tmp_path / "davinci0").touch()
    (tmp_path / "davinci_manager").touch()
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    found = host_accelerators(tmp_path)
    assert found == {"Ascend NPU": [str(tmp_path / "davinci0")], "NVIDIA GPU": [str(tmp_path / "nvidia0")]}
    with pytest.raises(AiperfError, match=r"^--container-runtime apptainer: this node's Ascend NPUs \(.*davinci0\) "
                                          r"cannot pass through a container .*run --backend mindspore without "
                                          r"--container, from a venv$"):
        check_devices("apptainer", "mindspore", found)
    check_devices("apptainer", "torch", {"NVIDIA GPU": found["NVIDIA GPU"]})  # --nv passes these through


# -- the refusals as `aiperf run` prints them ------------------------------------------------------
def _aiperf_run(args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiperf_core", "run", "--data", "digits", "--time-budget", "1m",
                           *args], capture_output=True, text=True, env=env, timeout=120)


def _fake_image(tmp_path: Path) -> Path:
    """A folder standing in for an image, and a ch-run that runs a command 'in' it: the image's
    Python is this test's, and paths under /etc/aiperf and /opt/aiperf are the folder's."""
    image = tmp_path / "image"
    (image / "opt/aiperf/bin").mkdir(parents=True)
    _fake_tool(image / "opt/aiperf/bin", "python", f'exec {sys.executable} "$@"\n')
    (image / "etc/aiperf").mkdir(parents=True)
    (image / "etc/aiperf/image.json").write_text(json.dumps({"name": "fake", "extras": "search", "digest": DIGEST_A}))
    _fake_tool(tmp_path / "bin", "ch-run", textwrap.dedent("""\
        while [ "${1#-}" != "$1" ]; do shift; done
        image=$1; shift 2
        for a in "$@"; do case $a in /etc/aiperf/*|/opt/aiperf/*) set -- "$@" "$image$a";; *) set -- "$@" "$a";; esac
        shift; done
        exec "$@"
        """))
    _fake_tool(tmp_path / "bin", "srun", "exit 0\n")
    return image


def test_aiperf_run_refuses_in_one_line_before_anything_starts(tmp_path):
    image = _fake_image(tmp_path)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "USER": "alice"}
    cases = [
        (["--container", str(image), "--container-runtime", "apptainer"], "--container-runtime apptainer: 'apptainer' "
         "is not on PATH"),
        (["--container", str(tmp_path / "nope"), "--container-runtime", "charliecloud"],
         f"--container {tmp_path}/nope: no such image"),
        (["--container", str(image), "--container-runtime", "charliecloud", "--backend", "nosuch"],
         f"--container {image}: the image cannot run --backend nosuch: no backend named 'nosuch'"),
        (["--container", str(image), "--container-runtime", "pyxis"], "--container-runtime pyxis: replicas run as "
         "SLURM job steps"),
        (["--container-runtime", "charliecloud"], "--container-runtime charliecloud: give --container IMAGE too"),
    ]
    for args, expected in cases:
        result = _aiperf_run([*args, "--run-dir", str(tmp_path / "run")], env)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(f"aiperf: error: {expected}"), \
            result.stderr
        assert not (tmp_path / "run").exists()


def test_a_resume_runs_in_the_image_the_run_recorded(tmp_path, monkeypatch):
    image = _fake_image(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("USER", "alice")
    recorded = {"image": str(image), "digest": DIGEST_A, "runtime": "charliecloud"}
    run = {"container": recorded, "backend": "numpy", "executor": "local", "dataset": {"name": "digits", "path": None}}
    spec = container.for_resume(run, tmp_path / "run", None, None, None)
    assert spec.record() == recorded
    with pytest.raises(AiperfError, match=f"^--container {tmp_path}/other: the run's replicas run in {image} "):
        container.for_resume(run, tmp_path / "run", str(tmp_path / "other"), None, None)
    with pytest.raises(AiperfError, match="^--container-runtime podman: the run's replicas run under charliecloud"):
        container.for_resume(run, tmp_path / "run", None, "podman", None)
    rebuilt = {**run, "container": {**recorded, "digest": DIGEST_B}}
    with pytest.raises(AiperfError, match=rf"^--resume {tmp_path}/run: {image} now holds image {DIGEST_A}, but the "
                                          rf"run's replicas ran {DIGEST_B} \(run.json container\); resume with that"):
        container.for_resume(rebuilt, tmp_path / "run", None, None, None)
    with pytest.raises(AiperfError, match="^--container: the run at .* was started without --container"):
        container.for_resume({**run, "container": None}, tmp_path / "run", str(image), None, None)
    assert container.for_resume({**run, "container": None}, tmp_path / "run", None, None, None) is None


def test_the_data_is_described_in_the_image(tmp_path, monkeypatch):
    """run.json's dataset as the image's reader sees it (here the fake image's Python is this one)."""
    from aiperf_core.workflow.plan import RunRequest, build_policy, describe_dataset

    _fake_image(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("USER", "alice")
    spec = ContainerSpec("charliecloud", str(tmp_path / "image"))
    policy = build_policy(RunRequest(workload="lm"), "embedded")
    assert container.describe_in_image(spec, "embedded", None, policy) == describe_dataset("embedded", None, policy)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AiperfError) as raised:
        describe_dataset("enwik8", str(tmp_path / "empty"), policy)
    with pytest.raises(AiperfError, match=f"^{re.escape(str(raised.value))}$"):
        container.describe_in_image(spec, "enwik8", str(tmp_path / "empty"), policy)


# -- the image's identity -------------------------------------------------------------------------
def _tree(root: Path) -> None:
    (root / "usr/lib").mkdir(parents=True)
    (root / "usr/lib/a.so").write_bytes(b"library")
    (root / "usr/bin").mkdir()
    (root / "usr/bin/python3").symlink_to("python3.11")
    (root / "opt/aiperf/lib").mkdir(parents=True)
    (root / "opt/aiperf/lib/site.py").write_text("x = 1\n")
    (root / "etc").mkdir()
    (root / "etc/hosts").write_text("127.0.0.1 here\n")


def test_the_digest_covers_usr_and_opt_and_nothing_else(tmp_path):
    _tree(tmp_path / "one")
    first = tree_digest(tmp_path / "one")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first)
    os.utime(tmp_path / "one/usr/lib/a.so", (1, 1))
    (tmp_path / "one/etc/hosts").write_text("changed by a runtime\n")
    assert tree_digest(tmp_path / "one") == first  # times and /etc are not the image's software
    (tmp_path / "one/opt/aiperf/lib/site.py").write_text("x = 2\n")
    assert tree_digest(tmp_path / "one") != first
    _tree(tmp_path / "two")
    (tmp_path / "two/usr/bin/python3").unlink()
    (tmp_path / "two/usr/bin/python3").symlink_to("python3.12")
    assert tree_digest(tmp_path / "two") != first
    (tmp_path / "two/usr/lib/a.so").chmod(0o600)
    assert tree_digest(tmp_path / "two") != tree_digest(tmp_path / "one")


def test_the_stamp_holds_the_digest_and_the_digest_command_checks_it(tmp_path, capsys):
    _tree(tmp_path)
    stamp = container.write_stamp("aiperf", "search", root=tmp_path)
    assert stamp["digest"] == tree_digest(tmp_path) and stamp["extras"] == "search"
    assert json.loads((tmp_path / "etc/aiperf/image.json").read_text()) == stamp
    assert container.main(["digest", str(tmp_path)]) == 0
    (tmp_path / "usr/lib/a.so").write_bytes(b"patched")
    assert container.main(["digest", str(tmp_path)]) == 1
    assert f"its stamp records {stamp['digest']}" in capsys.readouterr().err


def test_what_a_process_records_about_its_image(tmp_path):
    stamp = tmp_path / "image.json"
    assert running_image({}, stamp) is None  # on the host
    env = {IMAGE_ENV: "/img/aiperf", RUNTIME_ENV: "charliecloud"}
    assert running_image(env, stamp) == {"image": "/img/aiperf", "digest": None, "runtime": "charliecloud"}
    stamp.write_text(json.dumps({"name": "aiperf", "digest": DIGEST_A}))
    assert running_image(env, stamp) == {"image": "/img/aiperf", "digest": DIGEST_A, "runtime": "charliecloud"}
    assert running_image({}, stamp) == {"image": "aiperf", "digest": DIGEST_A, "runtime": None}  # started by hand


# -- run.json, replica_start, the report and the reviewer's check ----------------------------------
def _run_in_images(root: Path, run_digest, replica_digests) -> Path:
    """An ended run of two replicas whose run.json and replica_starts record these images."""
    record = lambda digest: None if digest is None else {"image": "/img/aiperf", "digest": digest,
                                                         "runtime": "charliecloud"}
    b = RunBuilder(root, container=record(run_digest))
    for replica, digest in enumerate(replica_digests):
        b.log(replica).append("replica_start", time=1000, replica=replica, pid=100 + replica, host=NODES[replica],
                              backend="numpy", framework_version="numpy 2.0", devices=["cpu"], attempt=1,
                              container=record(digest))
        trial = b.trial_start(replica, 1000, GRAPH_1, "fp32")
        b.epoch(replica, trial, 1100, 0, 1000, 200, 0.8)
        b.trial_end(replica, trial, 1100, epochs=1, best=0.8)
    b.finish(1900)
    write_monitors(root)
    return root


class _Starts:
    def __init__(self, *starts):
        self.starts = list(starts)


def test_image_reasons_name_each_replica_that_ran_another_image():
    run = {"container": {"image": "/img/aiperf", "digest": DIGEST_A, "runtime": "charliecloud"}}
    same = {"event": "replica_start", "attempt": 1, "container": run["container"]}
    other = {"event": "replica_start", "attempt": 2, "container": {**run["container"], "digest": DIGEST_B}}
    host = {"event": "replica_start", "attempt": 1, "container": None}
    assert image_reasons(run, {0: _Starts(same), 1: _Starts(same)}) == []
    assert image_reasons(run, {0: _Starts(same), 1: _Starts(same, other), 2: _Starts(host)}) == [
        f"replica 1 ran image {DIGEST_B[:19]}... (attempt 2), but run.json records image {DIGEST_A[:19]}...",
        f"replica 2 ran outside any image (attempt 1), but run.json records image {DIGEST_A[:19]}..."]
    assert image_reasons({"container": None}, {0: _Starts(host)}) == []
    assert image_reasons({}, {0: _Starts({"event": "replica_start", "attempt": 1})}) == []  # a run from before


def test_the_report_shows_each_replicas_image(tmp_path):
    root = _run_in_images(tmp_path / "run", DIGEST_A, [DIGEST_A, DIGEST_B])
    html_path, summary_path = write_report(root)
    nodes = json.loads(summary_path.read_text())["machine"]["nodes"]
    assert [n["container"]["digest"] for n in nodes] == [DIGEST_A, DIGEST_B]
    html = html_path.read_text()
    assert "<th>image</th>" in html
    assert f"<td>charliecloud {DIGEST_A[:19]}</td>" in html and f"<td>charliecloud {DIGEST_B[:19]}</td>" in html
    assert f"/img/aiperf (charliecloud {DIGEST_A})" in html
    html_path, _ = write_report(_run_in_images(tmp_path / "host", None, [None, None]))
    html = html_path.read_text()
    assert "<th>container</th><td>none</td>" in html and html.count("<td>none</td>") == 3  # the run, its 2 replicas


def test_the_check_rejects_replicas_of_one_run_in_different_images(tmp_path, inputs):  # noqa: F811
    system, kit = inputs
    mixed = _run_in_images(tmp_path / "mixed", DIGEST_A, [DIGEST_A, DIGEST_B])
    verdict = check_submission(pack(mixed, system, [kit], tmp_path / "mixed.tar.gz")[0])
    assert [r for r in verdict.rejections if r.startswith("image:")] == [
        f"image: replica 1 ran image {DIGEST_B[:19]}... (attempt 1), but run.json records image {DIGEST_A[:19]}...: "
        "the replicas of one run must run one software stack"]
    same = _run_in_images(tmp_path / "same", DIGEST_A, [DIGEST_A, DIGEST_A])
    verdict = check_submission(pack(same, system, [kit], tmp_path / "same.tar.gz")[0])
    assert verdict.accepted, verdict.rejections
