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
