"""A real Prometheus server scrapes a short real run's `aiperf run --metrics-port` every second;
after the run, its HTTP API must hold what `aiperf score` says.

Prometheus comes from Debian (package `prometheus`): the fixture installs it with apt-get when it
is missing and this is root, as tests/slurm_cluster.py does for SLURM. Without it, and without
root, the test fails with the install line: it never skips. The server is started on 127.0.0.1 on
a free port with its storage in a temporary folder, and only the process it started is stopped.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from apt_packages import apt_install

from test_workflow import TINY_POLICY

PACKAGES = ("prometheus",)
INSTALL = "apt-get install -y --no-install-recommends " + " ".join(PACKAGES)


def prometheus_binaries() -> None:
    """Install Debian's prometheus (and promtool) if they are missing; fail with the install line
    when they are missing and this is not root."""
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    if os.geteuid() != 0:
        pytest.fail(f"Prometheus is not installed and this is not root: {INSTALL}")
    error = apt_install(PACKAGES)
    if error is not None:
        pytest.fail(f"{INSTALL} failed: {error}")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class PrometheusServer:
    """prometheus on 127.0.0.1:port scraping 127.0.0.1:target every second."""

    def __init__(self, folder: Path, port: int, target: int):
        config = folder / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
                          f"  - job_name: aiperf\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n")
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(folder / "prometheus.log", "w")
        self.process = subprocess.Popen(["prometheus", f"--config.file={config}",
                                         f"--storage.tsdb.path={folder / 'data'}",
                                         f"--web.listen-address=127.0.0.1:{port}"],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def wait_for_first_scrape(self, timeout: float = 120) -> None:
        """Prometheus applies a new scrape config only on its next target-sync tick (every 5 s, for
        discovery and again for the scrape manager), so its first scrape comes up to ~10 s after it
        is ready. Waiting for that attempt (it fails while nothing listens) keeps a short run from
        falling between the start and the first scrape."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=30) as response:
                targets = json.load(response)["data"]["activeTargets"]
            if any(not t["lastScrape"].startswith("0001-") for t in targets):
                return
            time.sleep(0.5)
        raise RuntimeError(f"prometheus made no scrape attempt within {timeout:.0f} s")

    def query(self, expr: str) -> list[dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=30) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        return answer["data"]["result"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def _aiperf(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "aiperf_core", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """(run directory, the Prometheus server that scraped it, `aiperf score --json`). The run ends
    after its replica's first trial (one epoch), so that it always has a score above 0."""
    prometheus_binaries()
    folder = tmp_path_factory.mktemp("prometheus")
    config = folder / "aiperf.toml"
    config.write_text(TINY_POLICY)
    metrics_port, prometheus_port = _free_ports(2)
    server = PrometheusServer(folder, prometheus_port, metrics_port)
    try:
        server.wait_for_first_scrape()
        run_dir = folder / "run"
        result = _aiperf(["run", "--backend", "torch", "--data", "digits", "--config", str(config), "--run-dir",
                          str(run_dir), "--time-budget", "5m", "--stop-after-trials", "1", "--metrics-port",
                          str(metrics_port)])
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"serving metrics on http://127.0.0.1:{metrics_port}/metrics" in result.stdout
        scored = _aiperf(["score", "--json", str(run_dir)])
        assert scored.returncode == 0, scored.stderr
        yield run_dir, server, json.loads(scored.stdout)
    finally:
        server.stop()


def _last(server: PrometheusServer, expr: str) -> list[dict]:
    """The latest stored value of each series of `expr` (the target is gone after the run)."""
    return server.query(f"last_over_time({expr}[1h])")


@pytest.mark.slow  # the module's Prometheus start, first scrape and real run
def test_prometheus_holds_the_score_trials_replicas_and_hosts(scraped_run):
    run_dir, server, score = scraped_run
    up = server.query("sum_over_time(up{job='aiperf'}[1h])")
    # At least one successful scrape while the run went and the one `aiperf run` waits for after its
    # end: the fixture starts the run only once Prometheus scrapes, every second.
    assert up and float(up[0]["value"][1]) >= 2, "Prometheus scraped the run successfully fewer than 2 times"
    assert float(_last(server, "aiperf_run_ended")[0]["value"][1]) == 1.0
    (ops,) = _last(server, "aiperf_score_ops")
    assert float(ops["value"][1]) == score["score_ops"] and score["score_ops"] > 0
    assert float(_last(server, "aiperf_epochs_total")[0]["value"][1]) == score["epochs_counted"]
    trials = {series["metric"]["status"]: int(float(series["value"][1])) for series in _last(server, "aiperf_trials")}
    assert {status: n for status, n in trials.items() if n} == score["trials_by_status"]
    assert sum(trials.values()) == score["trials"]
    info = _last(server, "aiperf_run_info")[0]["metric"]
    assert info["run_id"] == score["run_id"] and info["backend"] == "torch" and info["dataset"] == "digits"

    replica = _last(server, "aiperf_replica_attempts")
    assert [s["metric"]["replica"] for s in replica] == ["0"] and replica[0]["metric"]["host"] == socket.gethostname()
    assert _last(server, "aiperf_replica_trials_done_total")
    host = _last(server, "aiperf_host_cpu_utilization_ratio")
    assert [s["metric"]["host"] for s in host] == [socket.gethostname()]
    assert _last(server, "aiperf_host_memory_used_bytes")
    states = {s["metric"]["state"]: float(s["value"][1]) for s in _last(server, "aiperf_replicas")}
    assert states["done"] == 1.0
    assert float(_last(server, "aiperf_run_official")[0]["value"][1]) == 0.0  # digits, resnet_small
    assert float(_last(server, "aiperf_run_reasons")[0]["value"][1]) >= 2


@pytest.mark.slow  # reads the module's real run (see above)
def test_watch_once_on_the_real_run_agrees_with_score(scraped_run):
    from aiperf_core.scoring import format_ops

    run_dir, _, score = scraped_run
    result = _aiperf(["watch", "--once", str(run_dir)])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("elapsed ")
    assert lines[1].startswith(f"OPS {format_ops(score['score_ops'])}  regulated {format_ops(score['regulated_ops'])}")
    assert f"epochs {score['epochs_counted']}" in lines[1]
    ended = sum(n for status, n in score["trials_by_status"].items() if status != "running")
    assert f"trials done {ended}, running 0" in lines[1]
    assert lines[2].startswith(f"  replica 0 on {socket.gethostname()}: attempt 1, {ended} trials done, stopped")
