"""The Prometheus collector of a run directory, on hand-made runs (the run builder lives in
test_score.py): an ended run against `aiperf score`, a restarted, a stalled and a queued replica,
damaged and malformed log lines, monitor samples, a replaced log; the HTTP endpoint and its
one-line errors; the Grafana dashboard and the series table of docs/monitoring.md."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.openmetrics.parser import text_string_to_metric_families
from prometheus_client.parser import text_string_to_metric_families as text_format_families

from aiperf_core.cli import main
from aiperf_core.monitoring.exporter.collector import SERIES, MonitorTail, RunCollector
from aiperf_core.monitoring.exporter.server import serve
from aiperf_core.scoring import score_run
from test_metrics_prometheus import prometheus_binaries
from test_score import GRAPH_1, RunBuilder, standard_run

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "examples" / "grafana" / "aiperf-dashboard.json"
PROMETHEUS_YML = ROOT / "examples" / "grafana" / "prometheus.yml"
DOC = ROOT / "docs" / "monitoring.md"


def scrape(collector: RunCollector) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted label items): value} of one OpenMetrics scrape, as the endpoint
    renders it, parsed by prometheus-client's OpenMetrics parser."""
    text = collector.render(openmetrics=True).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, series, /, **labels):
    return samples[series, tuple(sorted(labels.items()))]


def names(samples) -> set[str]:
    return {name for name, _ in samples}


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the collector ----------------------------------------------------------------------------
def test_an_ended_run_matches_aiperf_score(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    samples = scrape(RunCollector(tmp_path))
    result = score_run(tmp_path)
    assert value(samples, "aiperf_score_ops") == result.score_ops
    assert value(samples, "aiperf_regulated_score_ops") == result.regulated_ops
    assert value(samples, "aiperf_best_accuracy_ratio") == result.best_accuracy
    assert value(samples, "aiperf_best_error_ratio") == result.best_error
    assert value(samples, "aiperf_epochs_total") == result.epochs_counted
    assert value(samples, "aiperf_operations_total") == result.total_ops
    trials = {labels[0][1]: v for (name, labels), v in samples.items() if name == "aiperf_trials" and v}
    assert trials == result.trials_by_status
    assert value(samples, "aiperf_run_ended") == 1 and value(samples, "aiperf_remaining_seconds") == 0
    assert value(samples, "aiperf_elapsed_seconds") == 960 and value(samples, "aiperf_budget_seconds") == 900
    assert value(samples, "aiperf_run_official") == int(result.valid) and value(samples, "aiperf_run_reasons") == 0
    assert value(samples, "aiperf_replicas", state="done") == 2
    assert value(samples, "aiperf_replica_attempts", replica="1", host="node1") == 2  # restarted once
    assert value(samples, "aiperf_replica_trials_done_total", replica="0", host="node0") == 2
    assert value(samples, "aiperf_run_readable") == 1 and value(samples, "aiperf_read_errors_total") == 0
    assert value(samples, "aiperf_run_info", run_id="test-run", backend="numpy", executor="local",
                 dataset="imagenet", workload="cnn") == 1


def test_the_collector_interface_and_both_formats_give_the_same_samples(tmp_path):
    """The endpoint's own exposition (OpenMetrics and text 0.0.4) against prometheus-client's
    exposition of the same collector registered in a CollectorRegistry."""
    b = standard_run(tmp_path)
    b.finish(1960)
    collector = RunCollector(tmp_path)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)

    def samples(families):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples)

    through_registry = samples(text_format_families(generate_text(registry).decode()))
    assert samples(text_format_families(collector.render(openmetrics=False).decode())) == through_registry
    assert samples(text_string_to_metric_families(collector.render(openmetrics=True).decode())) == through_registry


def _live_run(root, replicas=3):
    """A run going on now: replica 0 trains and steps, replica 1 trains but its last step was 5
    minutes ago, replica 2 crashed and waits for its restart."""
    now = time.time()
    b = RunBuilder(root, start_time=now - 600, time_budget_s=3600.0, deadline=now + 3000, replicas=replicas)
    run = b.run
    for replica in range(replicas):
        b.primary.append("replica_launch", replica=replica, attempt=1, job=str(replica), log_seq=0)
        b.log(replica).append("replica_start", time=now - 590, replica=replica, pid=1, host=f"node{replica}",
                              backend="numpy", framework_version="1", devices=1, attempt=1)
    trials = [b.trial_start(r, now - 580, GRAPH_1, round_number=r + 1) for r in range(replicas)]
    b.epoch(0, trials[0], now - 300, 0, 1000, 100, 0.5)
    for replica, last_step in ((0, now - 1), (1, now - 300)):
        run.write_heartbeat(replica, state="training", trial=trials[replica], round=replica + 1, epoch=0,
                            since=now - 580, progress={"time": last_step, "epoch_start": last_step - 10,
                                                       "images": 500})
    b.primary.append("replica_exit", replica=2, attempt=1, status="crashed", reason="exit code 1", restart=True)
    return b, trials


def test_running_stalled_and_restarting_replicas(tmp_path):
    b, trials = _live_run(tmp_path)
    collector = RunCollector(tmp_path)
    samples = scrape(collector)
    assert value(samples, "aiperf_replicas", state="running") == 1
    assert value(samples, "aiperf_replicas", state="stalled") == 1
    assert value(samples, "aiperf_replicas", state="restarting") == 1
    assert value(samples, "aiperf_replica_stalled", replica="1", host="node1") == 1
    assert value(samples, "aiperf_replica_stalled", replica="0", host="node0") == 0
    assert value(samples, "aiperf_replica_images_per_second", replica="0", host="node0") == 50.0
    assert value(samples, "aiperf_replica_live_ops", replica="0", host="node0") > 0
    assert value(samples, "aiperf_replica_last_step_age_seconds", replica="1", host="node1") >= 299
    assert value(samples, "aiperf_replica_trial_round", replica="1", host="node1") == 2
    assert value(samples, "aiperf_replica_trial_epoch", replica="0", host="node0") == 2
    assert value(samples, "aiperf_run_ended") == 0 and value(samples, "aiperf_epochs_total") == 1
    assert 2990 < value(samples, "aiperf_remaining_seconds") <= 3000

    # The restart: launched again (still restarting until its replica_start), then running again.
    b.primary.append("replica_launch", replica=2, attempt=2, job="2b", log_seq=2)
    assert value(scrape(collector), "aiperf_replicas", state="restarting") == 1
    b.log(2).append("replica_start", replica=2, pid=2, host="node9", backend="numpy", framework_version="1",
                    devices=1, attempt=2)
    samples = scrape(collector)
    assert value(samples, "aiperf_replicas", state="restarting") == 0
    assert value(samples, "aiperf_replica_attempts", replica="2", host="node9") == 2
    b.finish(time.time())
    assert value(scrape(collector), "aiperf_replicas", state="done") == 3


def test_a_queued_replica_and_no_label_per_trial(tmp_path):
    b, _ = _live_run(tmp_path, replicas=3)
    b.run.write_run({**b.run.read_run(), "replicas": 4})
    samples = scrape(RunCollector(tmp_path))
    assert value(samples, "aiperf_replicas", state="queued") == 1
    assert sum(v for (n, _), v in samples.items() if n == "aiperf_replicas") == 4
    label_values = {v for _, labels in samples for _, v in labels}
    assert not any(re.fullmatch(r"r\d{4}-t\d{5}", v) for v in label_values)


def test_a_damaged_line_is_a_reason_never_a_failed_scrape(tmp_path):
    b = standard_run(tmp_path)
    collector = RunCollector(tmp_path)
    before = scrape(collector)
    assert value(before, "aiperf_damaged_logs", log="events") == 0
    with open(b.run.replica_log(0), "a") as f:
        f.write("{not json\n")
    samples = scrape(collector)
    assert value(samples, "aiperf_run_readable") == 1
    assert value(samples, "aiperf_damaged_logs", log="events") == 1
    assert value(samples, "aiperf_run_reasons") == value(before, "aiperf_run_reasons") + 1
    assert value(samples, "aiperf_run_official") == 0

    # A line that parses but breaks the log format (a time that is not a number): the scrape
    # still answers with every figure, and the error is one more reason.
    with open(b.run.replica_log(1), "a") as f:
        f.write(json.dumps({"event": "epoch_end", "time": "noon", "replica": 1}) + "\n")
    samples = scrape(collector)
    assert value(samples, "aiperf_run_readable") == 1 and value(samples, "aiperf_read_errors_total") == 1
    assert value(samples, "aiperf_run_reasons") == value(before, "aiperf_run_reasons") + 2
    assert "aiperf_score_ops" in names(samples)


def test_a_replaced_log_is_read_again_from_scratch(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    collector = RunCollector(tmp_path)
    assert value(scrape(collector), "aiperf_run_ended") == 1
    events = b.run.primary_log.read_text().splitlines(keepends=True)
    b.run.primary_log.write_text("".join(events[:-1]))  # a primary restarting from an older copy
    samples = scrape(collector)
    assert value(samples, "aiperf_run_ended") == 0 and value(samples, "aiperf_run_readable") == 1


def test_an_unreadable_run_gives_readable_0(tmp_path):
    samples = scrape(RunCollector(tmp_path / "gone"))
    assert value(samples, "aiperf_run_readable") == 0 and value(samples, "aiperf_read_errors_total") == 3
    assert names(samples) == {"aiperf_run_readable", "aiperf_read_errors_total"}


def _monitor_lines(host, uuids, times, energy=True, since_host=None):
    record = {"kind": "host", "time": times[0] - 1 if since_host is None else since_host, "host": host,
              "accelerators": [{"index": i, "name": "Test GPU", "uuid": u} for i, u in enumerate(uuids)]}
    lines = [record]
    for k, t in enumerate(times):
        devices = [{"index": i, "utilization": 50.0 + k % 50, "memory_used": 1000 + k, "memory_total": 4000,
                    "power_w": 200.0 + i, **({"energy_mj": 1000 * k} if energy else {})} for i in range(len(uuids))]
        lines.append({"kind": "sample", "time": t, "cpu_percent": 25.0, "memory_used": 2 << 30,
                      "accelerators": devices, "host_energy_uj": {"intel-rapl:0": 2_000_000 * k}})
    return "".join(json.dumps(r) + "\n" for r in lines)


def test_accelerator_and_host_series_from_the_latest_monitor_sample(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    # Replica 1 restarted at 1750 on another node: its monitor log has two sampler lives, the
    # first long enough that only bisection (not the last 64 KiB) finds the second's host record.
    first = _monitor_lines("node1", ["GPU-old"], [1000 + 0.1 * k for k in range(4000)])
    second = _monitor_lines("node7", ["GPU-b0", "GPU-b1"], [1749.0 + 30 * k for k in range(300)])
    b.run.monitor_log(1).write_text(first + second)
    b.run.monitor_log(0).write_text(_monitor_lines("node0", ["GPU-a"], [1000.0, 1030.0]) + '{"kind": "sam')
    collector = RunCollector(tmp_path)
    samples = scrape(collector)
    labels = {"host": "node7", "index": "1", "uuid": "GPU-b1", "name": "Test GPU"}
    assert value(samples, "aiperf_accelerator_utilization_ratio", **labels) == pytest.approx((50 + 299 % 50) / 100)
    assert value(samples, "aiperf_accelerator_memory_used_bytes", **labels) == 1299
    assert value(samples, "aiperf_accelerator_power_watts", **labels) == 201.0
    assert value(samples, "aiperf_accelerator_energy_joules_total", **labels) == 299.0
    assert not any(dict(l).get("uuid") == "GPU-old" for _, l in samples)
    assert value(samples, "aiperf_accelerator_energy_joules_total", host="node0", index="0", uuid="GPU-a",
                 name="Test GPU") == 1.0
    assert value(samples, "aiperf_host_cpu_utilization_ratio", host="node7") == 0.25
    assert value(samples, "aiperf_host_memory_used_bytes", host="node7") == 2 << 30
    assert value(samples, "aiperf_host_energy_joules_total", host="node7", zone="intel-rapl:0") == 2.0 * 299
    assert value(samples, "aiperf_monitor_sample_age_seconds", host="node0") > 0
    # Followed incrementally: a new sample moves the figures, the torn line completed counts.
    with open(b.run.monitor_log(0), "a") as f:
        f.write('ple", "time": 1060.0, "cpu_percent": 75.0, "accelerators": []}\n')
    assert value(scrape(collector), "aiperf_host_cpu_utilization_ratio", host="node0") == 0.75


def test_two_replicas_on_one_node_give_one_series_per_host_and_device(tmp_path):
    b = standard_run(tmp_path)
    b.run.monitor_log(0).write_text(_monitor_lines("nodeX", ["GPU-0"], [1000.0, 1030.0]))
    b.run.monitor_log(1).write_text(_monitor_lines("nodeX", ["GPU-0"], [1000.0, 1060.0], energy=False))
    samples = scrape(RunCollector(tmp_path))
    cpu = [k for k in samples if k[0] == "aiperf_host_cpu_utilization_ratio"]
    power = [k for k in samples if k[0] == "aiperf_accelerator_power_watts"]
    assert len(cpu) == 1 and len(power) == 1


def test_the_first_monitor_read_does_not_read_the_whole_log(tmp_path):
    path = tmp_path / "monitor.jsonl"
    path.write_text(_monitor_lines("n", ["G"], [1000.0 + k for k in range(20000)]))  # ~4 MB
    reads = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    import builtins
    tail = MonitorTail(path, "monitor.jsonl")
    builtins.open, saved = (lambda *a, **k: Counting(real_open(*a, **k))), builtins.open
    try:
        tail.read(since=1000.0)
    finally:
        builtins.open = saved
    assert tail.host["host"] == "n" and tail.sample["time"] == 1000.0 + 19999
    assert sum(reads) < path.stat().st_size / 4


# --- the endpoint and the commands ------------------------------------------------------------
def test_the_endpoint_serves_openmetrics(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    server = serve("127.0.0.1", _free_port(), RunCollector(tmp_path))
    try:
        request = urllib.request.Request(server.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(request, timeout=30) as response:
            body = response.read().decode()
            assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert body.endswith("# EOF\n") and "aiperf_score_ops " in body
        with urllib.request.urlopen(server.url, timeout=30) as response:  # the classic text format
            assert response.headers["Content-Type"].startswith("text/plain")
    finally:
        server.close()


def test_metrics_and_watch_refuse_what_is_not_a_run(tmp_path, capsys):
    for command in (["metrics", "--port", str(_free_port())], ["watch"]):
        err = _error(capsys, [*command[:1], str(tmp_path / "nothing"), *command[1:]])
        assert err == f"aiperf: error: {tmp_path / 'nothing'}: no such run directory"
        err = _error(capsys, [*command[:1], str(tmp_path), *command[1:]])
        assert err == f"aiperf: error: {tmp_path}: not a run directory (no run.json)"


def test_a_port_in_use_is_one_line(tmp_path, capsys):
    standard_run(tmp_path / "run")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _error(capsys, ["metrics", str(tmp_path / "run"), "--port", str(port)])
        assert err == f"aiperf: error: --port {port}: 127.0.0.1:{port} is already in use"
        err = _error(capsys, ["run", "--backend", "numpy", "--data", "digits", "--run-dir", str(tmp_path / "new"),
                              "--metrics-port", str(port)])
        assert err == f"aiperf: error: --metrics-port {port}: 127.0.0.1:{port} is already in use"
    assert not (tmp_path / "new").exists()
    assert _error(capsys, ["metrics", str(tmp_path / "run"), "--port", "3", "--host", "192.0.2.1"]) == \
        "aiperf: error: --host 192.0.2.1: not an address of this machine"
    assert _error(capsys, ["metrics", str(tmp_path / "run"), "--port", "70000"]).endswith(
        "argument --port: '70000' is not a port number (1 to 65535)")


def test_a_privileged_port_without_rights_is_one_line():
    """As an unprivileged user (nobody), on a run directory it may read (pytest's tmp_path is not)."""
    folder = Path(tempfile.mkdtemp(prefix="aiperf-metrics-"))
    try:
        standard_run(folder / "run")
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        result = subprocess.run([*drop, sys.executable, "-m", "aiperf_core", "metrics", str(folder / "run"), "--port",
                                 "80"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(folder)})
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == ("aiperf: error: --port 80: ports below 1024 need root (or "
                                         "CAP_NET_BIND_SERVICE); choose one from 1024 up")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_metrics_port_on_a_slurm_primary_needs_a_host(tmp_path, capsys):
    err = _error(capsys, ["run", "--executor", "slurm", "--backend", "numpy", "--data", "digits", "--run-dir",
                          str(tmp_path / "r"), "--metrics-port", str(_free_port())])
    assert err.startswith("aiperf: error: --metrics-port: a SLURM run's primary on 127.0.0.1 serves only its own "
                          "node; give --metrics-host")
    assert _error(capsys, ["run", "--metrics-host", "0.0.0.0", "--backend", "numpy", "--data", "digits"]) == \
        "aiperf: error: --metrics-host: give --metrics-port too"
    assert not (tmp_path / "r").exists()


def test_aiperf_metrics_serves_until_terminated(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "aiperf_core", "metrics", str(tmp_path), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving http://127.0.0.1:{port}/metrics for {tmp_path}")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            body = response.read().decode()
        expected = score_run(tmp_path).score_ops
        assert float(re.search(r"^aiperf_score_ops (\S+)$", body, re.M).group(1)) == expected
    finally:
        process.terminate()  # SIGTERM, as a batch system stops it (a background job may ignore SIGINT)
        assert process.wait(timeout=60) == 0


# --- the dashboard, the scrape config and the document -----------------------------------------
def test_the_grafana_dashboard_is_a_provisionable_dashboard(tmp_path):
    """Grafana cannot be installed here: the structure Grafana's provisioning reads, the series
    the queries use, and every query parsed by promtool (as a recording rule)."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard.get("id") is None and dashboard["uid"] and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    datasource = dashboard["templating"]["list"][0]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    kinds = {p["type"] for p in panels}
    assert {"timeseries", "heatmap", "stat"} <= kinds
    used, exprs = set(), []
    for panel in panels:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target["expr"]
            used |= set(re.findall(r"\baiperf_[a-z_]+", target["expr"]))
            exprs.append(target["expr"].replace("$__range", "1h"))
    assert used <= set(SERIES), used - set(SERIES)
    rules = tmp_path / "rules.yml"
    rules.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}))
    prometheus_binaries()
    promtool = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("score", "images/s", "utilisation", "power", "replicas by state", "stalled", "energy", "ops per watt"):
        assert topic in titles, topic


def test_the_prometheus_config_is_valid_and_scrapes_aiperf():
    text = PROMETHEUS_YML.read_text()
    assert "job_name: aiperf" in text and "/metrics" not in text.replace("metrics_path: /metrics", "")
    prometheus_binaries()
    promtool = subprocess.run(["promtool", "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr


def test_every_series_is_documented():
    doc = DOC.read_text()
    for name in SERIES:
        assert f"`{name}`" in doc, name


def test_a_monitor_lines_time_is_read_from_its_head_or_else_from_the_whole_line():
    assert MonitorTail._line_time(b'{"kind": "sample", "time": 1764100000.125, "cpu_percent": 3}') == 1764100000.125
    assert MonitorTail._line_time(b'{"kind": "host", "time": 1.5e9}') == 1.5e9
    assert MonitorTail._line_time(b'{"time": 12, "kind": "sample"}') == 12.0  # another writer's key order
    assert MonitorTail._line_time(b'{"kind": "sample", "time": true}') is None
    assert MonitorTail._line_time(b'{"kind": "sample", "time": 3') is None  # torn
    assert MonitorTail._line_time(b"not json") is None
