"""Issue 40, item 3: the experts' all-to-all of expert-parallel trials (epoch_end.all_to_all, written by
replica.all_to_all_fields from opcount.communication's analytic bytes and the backend's measured
seconds) reaches summary.json, the report, /metrics and `aiperf watch`, is checked by `aiperf score
--verify`, and never changes the score. The run builder lives in test_score.py."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from aiperf_core.backend import Parallelism
from aiperf_core.builders import gpt
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph
from aiperf_core.monitoring.exporter.collector import RunCollector
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.replica import all_to_all_fields, run_replica, write_run_json
from aiperf_core.report import write_report
from aiperf_core.rundir import EventLog, RunDir, chain_head, read_events
from aiperf_core.scoring import score_run, verify_run
from aiperf_core.scoring.ledger import RunLedger
from aiperf_core.scoring.progress import forget, snapshot
from aiperf_core.workflow.progress import render
from aiperf_core.workloads import lm
from aiperf_numpy.backend import NumpyBackend
from aiperf_opcount.communication import all_to_all_bytes, bytes_per_sample
from test_score import GRAPH_1, RunBuilder

DENSE_GPT = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
MOE_GPT = upcycle_moe(DENSE_GPT, None, "h0_fc1", seed=5).graph  # one moe node: E = 4, top_k = 2, 16 wide

# By hand, from opcount.communication's formula: positions x top_k x (D_in + D_out) x element bytes, x2
# for a training sample (forward and backward). The moe node replaces the block's whole MLP, so it
# reads and writes the model width: 8 x 2 x (16 + 16) = 512 elements each way.
FP32_TRAIN, FP32_EVAL = 8 * 2 * (16 + 16) * 4 * 2, 8 * 2 * (16 + 16) * 4
BF16_TRAIN, BF16_EVAL = 8 * 2 * (16 + 16) * 2 * 2, 8 * 2 * (16 + 16) * 2


def _epoch_report(train_images, val_images, seconds):
    return SimpleNamespace(train_images=train_images, val_images=val_images, all_to_all_seconds=seconds)


# --- the analytic bytes and the log field ------------------------------------------------------
def test_bytes_per_sample_of_an_upcycled_gpt_by_hand():
    [moe] = [node for node in MOE_GPT.nodes if node.op == "moe"]
    assert (moe.attrs["experts"], moe.attrs["top_k"]) == (4, 2)
    assert MOE_GPT.shapes[moe.inputs[0]] == (8, 16) and MOE_GPT.shapes[moe.id] == (8, 16)
    assert (FP32_TRAIN, FP32_EVAL) == (4096, 2048)
    assert bytes_per_sample(MOE_GPT, "fp32", True) == FP32_TRAIN
    assert bytes_per_sample(MOE_GPT, "tf32", True) == FP32_TRAIN
    assert bytes_per_sample(MOE_GPT, "fp32", False) == FP32_EVAL
    assert bytes_per_sample(MOE_GPT, "bf16", True) == BF16_TRAIN == bytes_per_sample(MOE_GPT, "fp16", True)
    assert bytes_per_sample(MOE_GPT, "bf16", False) == BF16_EVAL
    assert all_to_all_bytes(MOE_GPT, "fp32", 10, 3) == 10 * FP32_TRAIN + 3 * FP32_EVAL
    assert bytes_per_sample(DENSE_GPT, "fp32", True) == 0  # no moe node: nothing travels
    with pytest.raises(AiperfError, match="precision must be one of"):
        bytes_per_sample(MOE_GPT, "int8", True)


def test_all_to_all_fields_of_an_epoch():
    per_sample = (FP32_TRAIN, FP32_EVAL)
    fields = all_to_all_fields(_epoch_report(1000, 200, 0.5), per_sample)
    moved = 1000 * FP32_TRAIN + 200 * FP32_EVAL
    assert fields == {"all_to_all": {"bytes": moved, "seconds": 0.5, "bytes_per_second": moved / 0.5}}
    assert type(fields["all_to_all"]["bytes"]) is int
    assert all_to_all_fields(_epoch_report(1000, 200, 0.0), per_sample)["all_to_all"]["bytes_per_second"] is None
    # Not expert-parallel (no per-sample bytes), or nothing measured: no field at all.
    assert all_to_all_fields(_epoch_report(1000, 200, 0.5), None) == {}
    assert all_to_all_fields(_epoch_report(1000, 200, None), per_sample) == {}
    assert all_to_all_fields(_epoch_report(1000, 200, float("nan")), per_sample) == {}
    assert all_to_all_fields(_epoch_report(1000, 200, -1.0), per_sample) == {}
    assert all_to_all_fields(SimpleNamespace(train_images=1, val_images=0), per_sample) == {}


# --- a run with two expert-parallel trials and a dense one -----------------------------------------
TRIAL_A_BYTES = 2 * (1000 * FP32_TRAIN + 200 * FP32_EVAL)  # two fp32 epochs, 0.5 s and 1.5 s
TRIAL_B_BYTES = 500 * BF16_TRAIN + 100 * BF16_EVAL  # one bf16 epoch, 0.5 s
RUN_BYTES, RUN_SECONDS = TRIAL_A_BYTES + TRIAL_B_BYTES, 2.5


def _run(root, with_all_to_all: bool = True) -> RunBuilder:
    """Replica 0: an fp32 expert-parallel trial (2 epochs), then a dense trial; replica 1: a bf16
    expert-parallel trial. Without `with_all_to_all`, the same run with no field logged."""

    def fields(report, per_sample):
        return all_to_all_fields(report, per_sample) if with_all_to_all else {}

    fp32 = (bytes_per_sample(MOE_GPT, "fp32", True), bytes_per_sample(MOE_GPT, "fp32", False))
    bf16 = (bytes_per_sample(MOE_GPT, "bf16", True), bytes_per_sample(MOE_GPT, "bf16", False))
    b = RunBuilder(root)
    b.replica_start(0, 1000)
    b.replica_start(1, 1000)
    a = b.trial_start(0, 1000, MOE_GPT, "fp32")
    b.epoch(0, a, 1100, 0, 1000, 200, 0.5, **fields(_epoch_report(1000, 200, 0.5), fp32))
    b.epoch(0, a, 1200, 1, 1000, 200, 0.6, **fields(_epoch_report(1000, 200, 1.5), fp32))
    b.trial_end(0, a, 1210, epochs=2, best=0.6)
    dense = b.trial_start(0, 1210, GRAPH_1, "fp32")
    b.epoch(0, dense, 1300, 0, 1000, 200, 0.5)
    b.trial_end(0, dense, 1310, epochs=1, best=0.5)
    t_b = b.trial_start(1, 1005, MOE_GPT, "bf16")
    b.epoch(1, t_b, 1250, 0, 500, 100, 0.55, **fields(_epoch_report(500, 100, 0.5), bf16))
    b.trial_end(1, t_b, 1260, epochs=1, best=0.55)
    return b


def test_summary_json_and_the_report_give_the_communication_figure(tmp_path):
    _run(tmp_path).finish(1400)
    _, summary_path = write_report(tmp_path)
    summary = json.loads(summary_path.read_text())
    communication = summary["communication"]
    assert communication["all_to_all"] == {
        "trials": 2, "bytes": RUN_BYTES, "seconds": RUN_SECONDS, "bytes_per_second": RUN_BYTES / RUN_SECONDS}
    assert communication["all_reduce"] is None  # no data-parallel epoch logged one
    assert [(t["trial"], t["all_to_all"], t["all_reduce"]) for t in communication["per_trial"]] == [
        ("r0000-t00000", {"bytes": TRIAL_A_BYTES, "seconds": 2.0, "bytes_per_second": TRIAL_A_BYTES / 2.0}, None),
        ("r0001-t00000", {"bytes": TRIAL_B_BYTES, "seconds": 0.5, "bytes_per_second": TRIAL_B_BYTES / 0.5}, None)]
    assert communication["network"]["wait_seconds"] == RUN_SECONDS
    assert (RUN_BYTES, RUN_BYTES / RUN_SECONDS) == (10137600, 4055040.0)
    html = (tmp_path / "report.html").read_text()
    assert "Communication: the network" in html
    assert "<tr><th>all-to-all bytes (analytic)</th><td>0.0101 GB (10137600 bytes)</td></tr>" in html
    assert "<tr><th>seconds in all-to-all (measured)</th><td>2.5 s</td></tr>" in html
    assert "<tr><th>all-to-all bandwidth</th><td>0.00406 GB/s (4.055e+06 bytes/s)</td></tr>" in html
    assert "<tr><th>trials that ran expert-parallel</th><td>2</td></tr>" in html
    assert "r0000-t00000: ok, 2 epochs, best accuracy 60.00%, all-to-all 0.00451 GB/s" in html  # its tooltip
    # The section sits beside the score, before the charts.
    assert html.index("Communication: the network") < html.index("Score over time")


def test_the_score_does_not_change(tmp_path):
    _run(tmp_path / "with").finish(1400)
    _run(tmp_path / "without", with_all_to_all=False).finish(1400)
    with_field, without = score_run(tmp_path / "with"), score_run(tmp_path / "without")
    assert with_field.score_ops == without.score_ops > 0
    assert with_field.regulated_ops == without.regulated_ops and with_field.total_ops == without.total_ops
    assert with_field.valid == without.valid and with_field.reasons == without.reasons


def test_a_run_without_expert_parallel_trials_has_no_figure(tmp_path, capsys):
    _run(tmp_path, with_all_to_all=False).finish(1400)
    _, summary_path = write_report(tmp_path)
    assert json.loads(summary_path.read_text())["communication"] is None
    assert "all-to-all" not in (tmp_path / "report.html").read_text()
    assert b"aiperf_all_to_all" not in RunCollector(tmp_path).render(openmetrics=False)
    forget(tmp_path)
    assert main(["watch", "--once", str(tmp_path)]) == 0
    assert "all-to-all" not in capsys.readouterr().out
    assert verify_run(tmp_path) == []


# --- live: /metrics and `aiperf watch` ------------------------------------------------------------
def test_metrics_give_all_to_all_bytes_seconds_and_bandwidth(tmp_path):
    _run(tmp_path).finish(1400)
    text = RunCollector(tmp_path).render(openmetrics=False).decode()
    forget(tmp_path)
    assert f"aiperf_all_to_all_bytes_total {float(RUN_BYTES)!r}\n" in text
    assert "aiperf_all_to_all_seconds_total 2.5\n" in text
    assert f"aiperf_all_to_all_bytes_per_second {RUN_BYTES / RUN_SECONDS!r}\n" in text
    assert "# TYPE aiperf_all_to_all_bytes_total counter" in text
    assert "# TYPE aiperf_all_to_all_bytes_per_second gauge" in text
    openmetrics = RunCollector(tmp_path).render(openmetrics=True).decode()
    forget(tmp_path)
    assert "# TYPE aiperf_all_to_all_seconds counter" in openmetrics  # OpenMetrics names it without _total


def test_watch_shows_the_bandwidth_beside_ops(tmp_path, capsys):
    _run(tmp_path).finish(1400)
    assert main(["watch", "--once", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("OPS ")
    assert lines[2] == "all-to-all 0.00406 GB/s (0.0101 GB in 2.5 s, 2 expert-parallel trials), not scored"


def test_the_live_figure_grows_as_epochs_are_logged(tmp_path):
    """The live totals follow the logs: only the epochs read so far, none before the first."""
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    trial = b.trial_start(0, 1000, MOE_GPT, "fp32")
    before = snapshot(tmp_path, 1050)
    assert (before.all_to_all_bytes, before.all_to_all_trials, before.all_to_all_bytes_per_second) == (0, 0, None)
    assert not any(line.startswith("all-to-all") for line in render(before))
    per_sample = (FP32_TRAIN, FP32_EVAL)
    b.epoch(0, trial, 1100, 0, 1000, 200, 0.5, **all_to_all_fields(_epoch_report(1000, 200, 0.5), per_sample))
    after = snapshot(tmp_path, 1150)
    forget(tmp_path)
    assert (after.all_to_all_bytes, after.all_to_all_seconds, after.all_to_all_trials) == (TRIAL_A_BYTES // 2, 0.5, 1)
    assert after.all_to_all_bytes_per_second == TRIAL_A_BYTES // 2 / 0.5


def test_the_ledger_state_keeps_the_trials_figures(tmp_path):
    """The progress checkpoint (primary/progress.json) holds the ledger's state: a reader that starts
    from it has the same totals as one that read the logs."""
    _run(tmp_path).finish(1400)
    ledger = RunLedger(tmp_path)
    ledger.refresh()
    restored = RunLedger.from_state(tmp_path, json.loads(json.dumps(ledger.state())))
    assert (restored.all_to_all_bytes, restored.all_to_all_seconds, restored.all_to_all_trials) == (
        RUN_BYTES, RUN_SECONDS, 2)
    trial = restored.trials["r0000-t00000"]
    assert (trial.all_to_all_bytes, trial.all_to_all_seconds) == (TRIAL_A_BYTES, 2.0)
    assert trial.to_dict()["all_to_all"] == {"bytes": TRIAL_A_BYTES, "seconds": 2.0,
                                             "bytes_per_second": TRIAL_A_BYTES / 2.0}
    assert restored.trials["r0000-t00001"].to_dict()["all_to_all"] is None  # the dense trial


# --- aiperf score --verify ------------------------------------------------------------------------
def test_verify_passes_with_and_without_the_field(tmp_path, capsys):
    _run(tmp_path / "with").finish(1400)
    _run(tmp_path / "without", with_all_to_all=False).finish(1400)
    assert verify_run(tmp_path / "with") == [] and verify_run(tmp_path / "without") == []
    assert main(["score", "--verify", str(tmp_path / "with")]) == 0
    assert "verify: intact" in capsys.readouterr().out


@pytest.mark.parametrize("logged, problem", [
    ({"bytes": 4505601, "seconds": 0.5, "bytes_per_second": 9011202.0},
     "all_to_all: bytes 4505601 differ from the analytic 4505600 (opcount.communication on "
     "trials/r0000-t00000/graph.json at fp32, 1000 samples trained, 200 evaluated)"),
    ({"bytes": 4505600, "seconds": 0.5, "bytes_per_second": 1.0},
     "all_to_all: bytes_per_second 1.0 is not bytes over seconds (9011200.0)"),
    ({"bytes": 4505600, "seconds": 0.0, "bytes_per_second": 1.0},
     "all_to_all: bytes_per_second 1.0 is not bytes over seconds (None)"),
    ({"bytes": "4505600", "seconds": 0.5, "bytes_per_second": None},
     "all_to_all: not {bytes: integer >= 0, seconds: number >= 0, bytes_per_second: number or null}"),
    ([4505600, 0.5], "all_to_all: not {bytes: integer >= 0"),
])
def test_verify_names_an_all_to_all_the_run_directory_does_not_bear_out(tmp_path, logged, problem):
    """A replica that logged a figure opcount.communication does not give (a hash chain intact, as
    the replica wrote it) is named, one line; scoring passes over a malformed one."""
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    trial = b.trial_start(0, 1000, MOE_GPT, "fp32")
    b.epoch(0, trial, 1100, 0, 1000, 200, 0.5, all_to_all=logged)
    b.trial_end(0, trial, 1110, epochs=1, best=0.5)
    b.finish(1400)
    problems = verify_run(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(
        "replicas/0/events.jsonl: epoch_end of r0000-t00000 epoch 0: " + problem), problems
    assert score_run(tmp_path).score_ops > 0


def test_verify_names_a_figure_on_a_graph_without_experts(tmp_path):
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    trial = b.trial_start(0, 1000, DENSE_GPT, "fp32")
    b.epoch(0, trial, 1100, 0, 1000, 200, 0.5, all_to_all={"bytes": 10, "seconds": 1.0, "bytes_per_second": 10.0})
    b.finish(1400)
    assert verify_run(tmp_path) == ["replicas/0/events.jsonl: epoch_end of r0000-t00000 epoch 0: all_to_all: bytes "
                                    "10 differ from the analytic 0 (opcount.communication on "
                                    "trials/r0000-t00000/graph.json at fp32, 1000 samples trained, 200 evaluated)"]


# --- what a replica writes -----------------------------------------------------------------------
TINY_LM = {"workload": "lm", "dataset": "embedded", "initial_architecture": "gpt_tiny", "seq_len": 32,
           "epoch_tokens": 1024, "val_tokens": 2048, "batch_size": 4, "reference_batch_size": 4,
           "warmup_epochs": [1, 1, 1], "max_epochs": 2, "nas_candidates": 3, "precision": "fp32"}
MEASURED_SECONDS = 0.25  # what the fake backend says its all-to-all took each epoch


def test_a_replicas_expert_parallel_trial_verifies_and_reports(tmp_path, monkeypatch, capsys):
    """A replica trains an upcycled seed on a backend that declares expert parallelism over two devices
    and measures its all-to-all (a NumPy backend that trains data-parallel and reports a fixed time: the
    figure's path, not a backend's exchange, is under test); `aiperf score --verify` passes on what it
    logged and the report adds it up."""
    class TimedExpertParallel(NumpyBackend):
        def devices(self):
            return ["cpu:0", "cpu:1"]

        def parallelism(self):
            return Parallelism(data_parallel=True, synchronized_batch_norm=True, expert_parallel=True)

        def train_checked(self, model, data, config, on_epoch):
            def measured(report):
                if config.expert_parallel:
                    report = dataclasses.replace(report, all_to_all_seconds=MEASURED_SECONDS)
                return on_epoch(report) if on_epoch is not None else False
            return super().train_checked(model, data, config, measured)

    seed = lm.Seed.build
    monkeypatch.setattr(lm.Seed, "build", lambda self, policy, corpus: upcycle_moe(
        seed(self, policy, corpus), None, "h0_fc1", seed=5).graph)
    write_run_json(tmp_path, backend="numpy", policy=TINY_LM, stop_after_trials=1)
    run = RunDir(tmp_path)
    primary = EventLog(run.primary_log).open()
    primary.append("run_start", time=run.read_run()["start_time"], resume=False)
    assert run_replica(tmp_path, 0, backend=TimedExpertParallel()) == "max_trials"
    primary.append("run_end", time=read_events(run.replica_log(0))[-1]["time"], reason="stopped",
                   log_heads={"0": chain_head(run.replica_log(0))})
    primary.close()

    [start] = [e for e in read_events(run.replica_log(0)) if e["event"] == "trial_start"]
    epochs = [e for e in read_events(run.replica_log(0)) if e["event"] == "epoch_end"]
    graph = Graph.from_json((run.trial_dir(start["trial"]) / "graph.json").read_text())
    per_sample = (bytes_per_sample(graph, "fp32", True), bytes_per_sample(graph, "fp32", False))
    assert per_sample[0] > 0 and epochs
    for epoch in epochs:
        moved = per_sample[0] * epoch["train_images"] + per_sample[1] * epoch["val_images"]
        assert epoch["all_to_all"] == {"bytes": moved, "seconds": MEASURED_SECONDS,
                                       "bytes_per_second": moved / MEASURED_SECONDS}
    assert verify_run(tmp_path) == []
    assert main(["score", "--verify", str(tmp_path)]) == 0
    assert "verify: intact" in capsys.readouterr().out
    _, summary_path = write_report(tmp_path)
    communication = json.loads(summary_path.read_text())["communication"]
    all_to_all = communication["all_to_all"]
    total = sum(e["all_to_all"]["bytes"] for e in epochs)
    assert (all_to_all["trials"], all_to_all["bytes"]) == (1, total)
    assert all_to_all["seconds"] == MEASURED_SECONDS * len(epochs)
    [trial] = communication["per_trial"]
    assert trial["all_to_all"] == {"bytes": total, "seconds": all_to_all["seconds"],
                                   "bytes_per_second": total / all_to_all["seconds"]}
    # Two devices: the gradient all-reduce is counted too (NumPy measures no seconds of it), the expert
    # stacks left out of it.
    assert all(e["all_reduce"]["ranks"] == 2 and e["all_reduce"]["expert_parallel"] for e in epochs)
    assert all(e["all_reduce"]["seconds"] is None for e in epochs)
    assert trial["all_reduce"]["bytes"] == sum(e["all_reduce"]["bytes"] for e in epochs) > 0
