"""Frameworks' own log lines stay out of aiperf's output unless the user asks for them (issue 33.5).

The commands run as a user runs them: the console script, in an environment holding only PATH and
HOME, so that nothing the test runner exported (TF_CPP_MIN_LOG_LEVEL, GLOG_v...) quiets them instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiperf_backends.tensorflow.backend import kept_import_lines
from aiperf_core.registry import FRAMEWORK_LOG_LEVELS, set_framework_logging

AIPERF = Path(sys.executable).parent / "aiperf"

# A line some framework's logger wrote: absl (TensorFlow, XLA), TensorFlow's older logger, MindSpore's,
# and the notices TensorFlow prints at import.
FRAMEWORK_LINE = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]"
    r"|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWEF] "
    r"|^\[(DEBUG|INFO|WARNING|ERROR)\] [A-Z_]+\(\d+,"
    r"|oneDNN custom operations|All log messages before absl|This TensorFlow binary is optimized")


def aiperf(*args: str, cwd: Path, **extra_env: str) -> subprocess.Popen:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", str(cwd)), **extra_env}
    return subprocess.Popen([str(AIPERF), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


# Each command below imports every framework or TensorFlow and little else, one core's work for 10-20 s:
# the four run side by side, started once for the module, and each test reads the outputs it checks.
COMMANDS = {
    "backends": (("backends",), {}),
    "quiet": (("conformance", "--backend", "tensorflow", "--list"), {}),
    "debug": (("--debug", "conformance", "--backend", "tensorflow", "--list"), {}),
    "loud": (("conformance", "--backend", "tensorflow", "--list"), {"TF_CPP_MIN_LOG_LEVEL": "0"}),
}


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    started = {}
    try:
        for name, (args, extra_env) in COMMANDS.items():
            started[name] = aiperf(*args, cwd=tmp_path_factory.mktemp(name), **extra_env)
        finished = {}
        for name, process in started.items():
            stdout, stderr = process.communicate(timeout=600)
            finished[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        return finished
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def framework_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (done.stdout + done.stderr).splitlines() if FRAMEWORK_LINE.search(line)]


@pytest.mark.slow  # the module's four framework imports: about 25 s on 2 cores
def test_backends_prints_its_table_and_no_framework_log_line(done):
    backends = done["backends"]
    assert backends.returncode == 0, backends.stderr
    assert framework_lines(backends) == []
    assert re.search(r"^\* tensorflow +available +\S+ +devices: ", backends.stdout, re.MULTILINE), backends.stdout
    for name in ("jax", "mindspore", "torch"):
        assert re.search(rf"^  {name} +available ", backends.stdout, re.MULTILINE), backends.stdout


@pytest.mark.slow  # the module's four framework imports: about 25 s on 2 cores
def test_debug_shows_the_framework_log_lines_again(done):
    # conformance --list loads the tensorflow backend (and so TensorFlow) and does no other work. The
    # notice also shows that oneDNN stays on (the backend turns it on on x86-64): only its line goes.
    quiet, debug = done["quiet"], done["debug"]
    assert quiet.returncode == debug.returncode == 0, quiet.stderr + debug.stderr
    assert framework_lines(quiet) == []
    assert any("oneDNN custom operations are on" in line for line in framework_lines(debug)), debug.stderr
    assert quiet.stdout == debug.stdout


@pytest.mark.slow  # the module's four framework imports: about 25 s on 2 cores
def test_a_level_the_user_set_is_kept(done):
    loud = done["loud"]
    assert loud.returncode == 0, loud.stderr
    assert any("oneDNN custom operations are on" in line for line in framework_lines(loud)), loud.stderr


def test_quiet_levels_hide_info_and_keep_what_the_user_set(monkeypatch):
    for name in FRAMEWORK_LOG_LEVELS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLOG_v", "1")
    set_framework_logging()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"  # warnings and errors kept
    assert os.environ["GLOG_v"] == "1"
    set_framework_logging(verbose=True)  # a value already there is never replaced
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "1"
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL")
    monkeypatch.delenv("GLOG_v")
    set_framework_logging(verbose=True)
    assert (os.environ["TF_CPP_MIN_LOG_LEVEL"], os.environ["GLOG_v"]) == ("0", "2")  # the frameworks' own defaults


IMPORT_STDERR = (
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
    b"I0000 00:00:1795729418.123082    6092 port.cc:153] oneDNN custom operations are on.\n"
    b"W0000 00:00:1795729418.174236    6092 gpu_device.cc:2341] Cannot dlopen some GPU libraries.\n"
    b"E0000 00:00:1795729418.174236    6092 cuda_dnn.cc:8310] Unable to register cuDNN factory\n"
    b"/x/y.py:3: UserWarning: something Python said\n"
    b"  warnings.warn(\"something Python said\")\n"
)


def test_the_import_filter_drops_only_what_the_level_drops():
    assert kept_import_lines(IMPORT_STDERR, 0) == IMPORT_STDERR
    assert kept_import_lines(IMPORT_STDERR, 1) == b"".join(IMPORT_STDERR.splitlines(keepends=True)[2:])
    assert kept_import_lines(IMPORT_STDERR, 2) == b"".join(IMPORT_STDERR.splitlines(keepends=True)[3:])
    assert kept_import_lines(IMPORT_STDERR, 3) == b"".join(IMPORT_STDERR.splitlines(keepends=True)[4:])
