"""report.html and summary.json of a hand-made run (the run builder lives in test_score.py)."""

import json
import re

from aiperf_core.cli import main
from aiperf_core.report import write_report
from aiperf_core.scoring import format_ops, score_run
from test_score import GRAPH_1, RunBuilder, standard_run


def add_monitor_samples(run, replica, accelerators):
    path = run.monitor_log(replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"kind": "host", "time": 1000.0, "host": f"node{replica}", "cpus": 8, "memory_total": 1 << 34,
                "accelerators": [{"index": 0, "name": "Test GPU", "memory_total": 100}] if accelerators else [],
                "nvml": "ok" if accelerators else "unavailable: no driver", "psutil": "ok"}]
    for k in range(30):
        sample = {"kind": "sample", "time": 1000.0 + 30 * k, "cpu_percent": 50.0, "memory_percent": 20.0,
                  "memory_used": 1 << 30, "accelerators": []}
        if accelerators:
            sample["accelerators"] = [{"index": 0, "utilization": 90.0, "memory_utilization": 40.0,
                                       "memory_used": 60, "memory_total": 100}]
        records.append(sample)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "sam')  # torn last line


def test_report_has_plots_and_summary(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    add_monitor_samples(b.run, 0, accelerators=True)
    add_monitor_samples(b.run, 1, accelerators=False)
    html_path, summary_path = write_report(tmp_path)
    assert html_path == tmp_path / "report.html" and summary_path == tmp_path / "summary.json"

    summary = json.loads(summary_path.read_text())
    result = score_run(tmp_path)
    assert summary["score_ops"] == result.score_ops and summary["regulated_ops"] == result.regulated_ops
    assert summary["valid"] is True and summary["reasons"] == []
    assert summary["configuration"] == b.run.read_run()
    assert summary["software"]["backend"] == "numpy"
    assert summary["software"]["framework_versions"] == {"numpy": ["numpy 2.0"]}
    assert summary["machine"]["hosts"] == ["node0", "node1"]
    assert summary["machine"]["accelerators"] == {"Test GPU": 1}
    assert [n["attempts"] for n in summary["machine"]["nodes"]] == [1, 2]

    html = html_path.read_text()
    assert html.count("<svg") == 5  # score, regulated score, error, timeline, utilisation
    for title in ("Score: OPS(t)", "Regulated score", "Best validation error", "Trials of each replica",
                  "Mean utilisation"):
        assert title in html
    assert format_ops(result.score_ops) in html
    assert "<polyline" in html and "r0001-t00002: running" in html and "r0001-t00000: failed" in html
    assert "accelerator %" in html and "CPU %" in html
    # Self-contained: nothing fetched, nothing run.
    assert "<script" not in html and "<link" not in html
    assert not re.search(r"(src|href)\s*=", html) and "http" not in html


def test_report_of_an_unofficial_run_lists_reasons(tmp_path, capsys):
    b = standard_run(tmp_path)  # still going: no run_end
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(unofficial)" in out and "report.html" in out
    html = (tmp_path / "report.html").read_text()
    assert "Unofficial, because:" in html and "no run_end" in html
    assert "NVML was not available" in html  # no monitor samples at all
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["valid"] is False and summary["label"] == "unofficial"
    b.finish(1960)


def test_report_of_a_missing_run_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_time_in_steps_per_replica_and_for_the_run(tmp_path):
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    b.replica_start(1, 1000)
    t = b.trial_start(0, 1000, GRAPH_1, "fp32")
    b.epoch(0, t, 1100, 0, 1000, 200, 0.5, step_seconds=90.0)
    b.epoch(0, t, 1200, 1, 1000, 200, 0.6, step_seconds=95.0)
    b.trial_end(0, t, 1210, epochs=2, best=0.6)
    b.log(0).append("replica_stop", time=1250, replica=0, reason="deadline")
    u = b.trial_start(1, 1000, GRAPH_1, "fp32")  # a backend that does not measure: step_seconds null
    b.epoch(1, u, 1100, 0, 1000, 200, 0.5, step_seconds=None)
    b.finish(1260)
    _, summary_path = write_report(tmp_path)
    summary = json.loads(summary_path.read_text())
    nodes = summary["machine"]["nodes"]
    assert nodes[0]["step_seconds"] == 185.0 and abs(nodes[0]["busy_fraction"] - 185 / 250) < 1e-12
    assert nodes[1]["busy_fraction"] is None
    assert abs(summary["machine"]["busy_fraction"] - 185 / 250) < 1e-12
    html = (tmp_path / "report.html").read_text()
    assert "74.0% of the replicas&#x27; wall time" in html or "74.0% of the replicas' wall time" in html
    assert "not measured" in html


def write_monitor(run, replica, host, devices, rapl, samples):
    """replicas/<replica>/monitor.jsonl with one host record and `samples`: (time, {uuid: energy_mj},
    host_energy_uj or None). `devices`: (uuid, has an energy counter); `rapl`: its status."""
    path = run.monitor_log(replica)
    path.parent.mkdir(parents=True, exist_ok=True)
    host_record = {"kind": "host", "time": 960.0, "host": host, "cpus": 8, "memory_total": 1 << 34,
                   "accelerators": [{"index": i, "name": "Test GPU", "uuid": uuid, "memory_total": 100, "power": True,
                                     "energy_counter": counter} for i, (uuid, counter) in enumerate(devices)],
                   "nvml": "ok", "psutil": "ok", "rapl": rapl,
                   "rapl_zones": [{"zone": "intel-rapl:0", "name": "package-0", "max_energy_range_uj": 1_000_000}]
                   if rapl == "ok" else []}
    records = [host_record]
    for t, energies, host_uj in samples:
        accelerators = []
        for i, (uuid, counter) in enumerate(devices):
            device = {"index": i, "utilization": 90.0, "memory_utilization": 40.0, "memory_used": 60,
                      "memory_total": 100, "power_w": 250.0}
            if counter:
                device["energy_mj"] = energies[uuid]
            accelerators.append(device)
        sample = {"kind": "sample", "time": t, "cpu_percent": 50.0, "memory_percent": 20.0, "memory_used": 1,
                  "accelerators": accelerators}
        if host_uj is not None:
            sample["host_energy_uj"] = {"intel-rapl:0": host_uj}
        records.append(sample)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


TIMES = (970.0, 1000.0, 1300.0, 1600.0, 1900.0, 1930.0)  # the scored window is [1000, 1900]


def two_replicas_on_one_node(run, second_counter=True, rapl="ok"):
    """Replica 0 reads GPU-a and the host's RAPL counter (which wraps at 1,000,000 uJ between 1300
    and 1600); replica 1 reads GPU-b. Only the three intervals inside the window count."""
    host_uj = (100, 200_000, 700_000, 100_000, 600_000, 900_000)
    write_monitor(run, 0, "node0", [("GPU-a", True)], rapl,
                  [(t, {"GPU-a": 300_000 * k}, host_uj[k] if rapl == "ok" else None) for k, t in enumerate(TIMES)])
    write_monitor(run, 1, "node0", [("GPU-b", second_counter)], rapl,
                  [(t, {"GPU-b": 7 + 600_000 * k}, None) for k, t in enumerate(TIMES)])


def test_energy_and_operations_per_joule(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    two_replicas_on_one_node(b.run)
    write_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    energy = summary["energy"]
    # GPU-a: 3 x 300 J; GPU-b: 3 x 600 J; host: 0.5 + 0.4 (across the wrap) + 0.5 J.
    assert energy["accelerators_j"] == 2700.0 and abs(energy["host_j"] - 1.4) < 1e-9
    assert abs(energy["total_j"] - 2701.4) < 1e-9 and energy["missing"] == []
    assert energy["accelerators"] == 2 and energy["hosts"] == 1
    assert energy["coverage"] == {"accelerators": 1.0, "host": 1.0}
    total_ops = summary["total_ops"]
    assert abs(energy["ops_per_joule"]["total"] - total_ops / 2701.4) < 1e-6 * total_ops
    assert energy["ops_per_joule"]["accelerators"] == total_ops / 2700.0
    html = (tmp_path / "report.html").read_text()
    assert "OPS/W (analytic operations per joule)" in html and "2.7 kJ (2701 J)" in html
    headline = html[html.index('<p class="big">'):].split("</p>")[0]
    assert f"{format_ops(total_ops / 2701.4)}/W" in headline
    assert "Mean power draw" in html and "accelerator (mean per device)" in html


def test_missing_energy_counters_are_reported_missing_never_zero(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    two_replicas_on_one_node(b.run, second_counter=False, rapl="unavailable: /sys/class/powercap: Permission denied")
    write_report(tmp_path)
    energy = json.loads((tmp_path / "summary.json").read_text())["energy"]
    assert energy["accelerators_j"] is None and energy["host_j"] is None and energy["total_j"] is None
    assert energy["ops_per_joule"] == {"total": None, "accelerators": None, "host": None}
    assert "accelerators: 1 of 2 have no energy counter in NVML" in energy["missing"]
    assert any(line.startswith("host: RAPL not readable on 1 of 1 nodes (node0: unavailable: /sys/class/powercap")
               for line in energy["missing"])
    html = (tmp_path / "report.html").read_text()
    assert "energy: total</th><td>not measured" in html


def test_a_cpu_run_counts_the_host_as_the_whole(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    write_monitor(b.run, 0, "node0", [], "ok",
                  [(t, {}, u) for t, u in zip(TIMES, (0, 0, 300_000, 600_000, 900_000, 950_000))])
    write_report(tmp_path)
    energy = json.loads((tmp_path / "summary.json").read_text())["energy"]
    assert energy["accelerators_j"] is None and abs(energy["host_j"] - 0.9) < 1e-9
    assert energy["total_j"] == energy["host_j"]
    assert energy["missing"] == ["accelerators: none sampled (no NVML on the replica nodes, or no accelerator)"]


def test_a_run_shorter_than_one_sampling_interval_measured_nothing(tmp_path):
    b = standard_run(tmp_path)
    b.finish(1960)
    write_monitor(b.run, 0, "node0", [("GPU-a", True)], "ok", [(1000.0, {"GPU-a": 5}, 10)])
    write_report(tmp_path)
    energy = json.loads((tmp_path / "summary.json").read_text())["energy"]
    assert energy["accelerators_j"] is None and energy["host_j"] is None and energy["total_j"] is None
    assert len(energy["missing"]) == 2 and all("fewer than two" in line for line in energy["missing"])


def test_precision_compile_time_and_failure_in_the_report(tmp_path):
    from aiperf_core.policy import Policy

    b = RunBuilder(tmp_path, policy=Policy({"precision": "auto"}).to_json(), precision="bf16")
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1, "bf16")
    b.epoch(0, t, 1100, 0, 1000, 200, 0.5, compile_seconds=30.0)
    b.epoch(0, t, 1200, 1, 1000, 200, 0.6, compile_seconds=0.0)
    b.trial_end(0, t, 1250, epochs=2, best=0.6)
    b.log(0).append("replica_stop", time=1250, replica=0, reason="deadline")
    b.finish(1250)
    write_report(tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == {"policy": "auto", "resolved": "bf16", "trials": {"bf16": 1}}
    assert summary["compile"] == {"seconds": 30.0, "share": 30.0 / 250, "trials_measured": 1}
    assert summary["machine"]["nodes"][0]["compile_seconds"] == 30.0
    assert summary["failure"] is None
    html = (tmp_path / "report.html").read_text()
    assert "bf16 (auto: the fastest the backend declares on the run&#x27;s device)" in html
    assert "30.0 s (12.0% of the replicas" in html and "30.0 s compiling" in html
    assert "Failed: the run produced nothing" not in html


def test_a_run_whose_every_trial_failed_says_so(tmp_path, capsys):
    b = RunBuilder(tmp_path, replicas=1)
    b.replica_start(0, 1000)
    for k, t in enumerate((1010, 1020, 1030)):
        trial = b.trial_start(0, t - 5, GRAPH_1, "fp16")
        b.trial_end(0, trial, t, status="failed", epochs=0,
                    reason=f"BackendError: backend 'jax' cannot run precision 'fp16' on cpu:0 (try {k})")
    b.log(0).append("replica_stop", time=1031, replica=0, reason="failures")
    b.finish(1040, reason="all_replicas_finished")
    assert main(["report", str(tmp_path)]) == 0
    assert "FAILED: the run produced nothing: no trial succeeded" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    failure = summary["failure"]
    assert failure["failed_trials"] == 3 and failure["first_where"] == "trial r0000-t00000"
    assert failure["first_cause"] == "BackendError: backend 'jax' cannot run precision 'fp16' on cpu:0 (try 0)"
    assert "(try 0)" in (tmp_path / "report.html").read_text()
    assert main(["score", str(tmp_path)]) == 0  # scoring a failed run is not an error of `aiperf score`
    out = capsys.readouterr().out
    assert "FAILED: the run produced nothing: no trial succeeded (3 failed trial(s)" in out and "(try 0)" in out


def test_the_load_balance_of_mixtures_of_experts_beside_the_score(tmp_path):
    """Issue 40, item 4: epoch_end.expert_load (replica.expert_load_fields) reaches summary.json and the
    report: per trial its least even moe layer in its last epoch, never the score."""
    from aiperf_core.replica import expert_load_fields

    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    t = b.trial_start(0, 1000, GRAPH_1, "fp32")
    b.epoch(0, t, 1100, 0, 1000, 200, 0.5, **expert_load_fields({"m1_moe": (40, 0, 0, 24), "m2_moe": (16,) * 4}))
    b.epoch(0, t, 1200, 1, 1000, 200, 0.6, **expert_load_fields({"m1_moe": (20, 12, 16, 16), "m2_moe": (16,) * 4}))
    b.trial_end(0, t, 1210, epochs=2, best=0.6)
    u = b.trial_start(0, 1210, GRAPH_1, "fp32")  # no mixture of experts: no field
    b.epoch(0, u, 1300, 0, 1000, 200, 0.5)
    b.finish(1400)
    plain = score_run(tmp_path)
    _, summary_path = write_report(tmp_path)
    summary = json.loads(summary_path.read_text())
    assert summary["expert_load"] == {
        "trials": 1, "mean_max_over_mean": 1.25, "worst_max_over_mean": 1.25,
        "least_even": [{"trial": t, "max_over_mean": {"m1_moe": 1.25, "m2_moe": 1.0}}]}
    assert summary["score_ops"] == plain.score_ops
    html = (tmp_path / "report.html").read_text()
    assert "Mixture of experts: load balance" in html and "m1_moe 1.25, m2_moe 1.00" in html
    assert "expert load 1.25 x the mean" in html


def test_a_run_without_a_mixture_of_experts_has_no_load_section(tmp_path):
    standard_run(tmp_path).finish(1960)
    _, summary_path = write_report(tmp_path)
    assert json.loads(summary_path.read_text())["expert_load"] is None
    assert "load balance" not in (tmp_path / "report.html").read_text()
