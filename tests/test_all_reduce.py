"""Issue 48, items 1 and 2: the data-parallel gradient all-reduce, counted (opcount.communication, the
formula of docs/scoring.md) and measured per epoch (epoch_end.all_reduce, written by
replica.all_reduce_fields), carried by the ledger, summary.json, the report, /metrics, `aiperf watch`
and `aiperf rank`, re-derived by `aiperf score --verify`; and what the network cost (aiperf_core.scoring
.network), reported, never scored. The run builder lives in test_score.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from aiperf_core.builders import gpt
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph
from aiperf_core.monitoring.exporter.collector import RunCollector
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_core.replica import AllReduceLayout, all_reduce_fields, pricing_fields
from aiperf_core.report import write_report
from aiperf_core.rundir import RunDir, read_events
from aiperf_core.scoring import score_run, verify_run
from aiperf_core.scoring.ledger import RunLedger
from aiperf_core.scoring.progress import forget
from aiperf_core.scoring.score import epoch_ops
from aiperf_core.submission.ranking import rank, render_text
from aiperf_opcount import count
from aiperf_opcount.communication import all_reduce_bytes, all_to_all_bytes, gradient_bytes, optimiser_steps
from cpu_devices import run_on_cpu_devices
from test_ranking import verdict
from test_score import RunBuilder

DENSE_GPT = gpt(layers=1, hidden=16, heads=2, seq_len=8, vocab=32)
MOE_GPT = upcycle_moe(DENSE_GPT, None, "h0_fc1", seed=5).graph  # one moe node: E = 4 experts, 16 x 64 x 16


def _expert_stacks(graph: Graph) -> int:
    """Elements of the moe nodes' expert weights: every parameter but the router."""
    return sum(math.prod(shape) for node in graph.nodes if node.op == "moe"
               for name, shape in graph.param_shapes(node.id).items() if name != "router")


# --- the formula --------------------------------------------------------------------------------------
def test_gradient_bytes_are_every_trainable_parameter_in_float32():
    assert gradient_bytes(DENSE_GPT) == 4 * DENSE_GPT.num_params() == 17856
    # Expert parallelism takes the expert stacks out (each expert lives on one device); the router stays.
    stacks = _expert_stacks(MOE_GPT)
    assert stacks == 4 * (16 * 64 + 64 + 64 * 16 + 16)
    assert gradient_bytes(MOE_GPT) == 4 * MOE_GPT.num_params()
    assert gradient_bytes(MOE_GPT, expert_parallel=True) == 4 * (MOE_GPT.num_params() - stacks)


@pytest.mark.parametrize("ranks, nodes, inter, intra", [
    (2, 1, 0, 2),  # one node: both ring links inside it
    (4, 1, 0, 4),
    (4, 2, 1, 1),  # 2 nodes x 2: one link of each node leaves it, one stays
    (8, 4, 1, 1),
    (3, 3, 1, 0),  # one device per node: every link crosses the network
])
def test_ring_bytes_per_rank_and_where_they_travel(ranks, nodes, inter, intra):
    g, steps = gradient_bytes(DENSE_GPT), 5
    per_rank = steps * (2 * (ranks - 1) * g // ranks)  # 2(n-1)/n x G per step, to the whole byte
    moved = all_reduce_bytes(DENSE_GPT, ranks, nodes, steps)
    assert (moved.bytes, moved.inter_node_bytes, moved.intra_node_bytes) == (per_rank, inter * per_rank,
                                                                              intra * per_rank)


def test_the_formula_refuses_a_layout_that_does_not_hold():
    with pytest.raises(AiperfError, match="3 ranks do not divide over 2 nodes"):
        all_reduce_bytes(DENSE_GPT, 3, 2, 1)
    with pytest.raises(AiperfError, match="ranks must be a whole number >= 1"):
        all_reduce_bytes(DENSE_GPT, 0, 1, 1)


def test_one_all_reduce_per_optimiser_step():
    assert [optimiser_steps(n, 16) for n in (0, 1, 16, 17, 35)] == [0, 1, 1, 2, 3]


def test_all_reduce_fields_of_an_epoch():
    layout = AllReduceLayout(DENSE_GPT, ranks=4, nodes=2, batch_size=16)
    report = SimpleNamespace(train_images=35, val_images=5, all_reduce_seconds=0.25)
    per_rank = 3 * (2 * 3 * gradient_bytes(DENSE_GPT) // 4)
    assert all_reduce_fields(report, layout) == {"all_reduce": {
        "bytes": per_rank, "seconds": 0.25, "bytes_per_second": per_rank / 0.25, "ranks": 4, "nodes": 2, "steps": 3,
        "expert_parallel": False, "inter_node_bytes": per_rank, "intra_node_bytes": per_rank}}
    # Not measured (a backend that cannot time it): the bytes all the same, seconds null.
    unmeasured = all_reduce_fields(SimpleNamespace(train_images=35, val_images=5), layout)["all_reduce"]
    assert (unmeasured["bytes"], unmeasured["seconds"], unmeasured["bytes_per_second"]) == (per_rank, None, None)
    # One device: no all-reduce, no field.
    assert all_reduce_fields(report, AllReduceLayout(DENSE_GPT, 1, 1, 16)) == {} == all_reduce_fields(report, None)


# --- a run: two data-parallel trials (one across 2 nodes), one with experts -----------------------------
# Replica 0 (2 devices on 1 node) trains DENSE_GPT data-parallel, 2 epochs of 64 samples (batch 32: 2 steps
# each), 1 s of steps each of which 0.25 s waiting on the all-reduce; replica 1 (2 nodes x 2 devices) trains
# MOE_GPT expert-parallel, one epoch of 32 samples, 2 s of steps, 0.5 s all-reduce and 0.3 s all-to-all.
def _layouts():
    return (AllReduceLayout(DENSE_GPT, 2, 1, 32), AllReduceLayout(MOE_GPT, 4, 2, 32, expert_parallel=True))


def _run(root, seconds=(0.25, 0.5)) -> RunBuilder:
    dense, experts = _layouts()
    b = RunBuilder(root)
    b.replica_start(0, 1000)
    b.replica_start(1, 1000)
    a = b.trial_start(0, 1000, DENSE_GPT, "fp32")
    for epoch, t in enumerate((1100, 1200)):
        report = SimpleNamespace(train_images=64, val_images=8, all_reduce_seconds=seconds[0])
        b.epoch(0, a, t, epoch, 64, 8, 0.5, step_seconds=1.0, **all_reduce_fields(report, dense))
    b.trial_end(0, a, 1210, epochs=2, best=0.5)
    c = b.trial_start(1, 1000, MOE_GPT, "fp32")
    report = SimpleNamespace(train_images=32, val_images=8, all_reduce_seconds=seconds[1])
    b.epoch(1, c, 1100, 0, 32, 8, 0.5, step_seconds=2.0,
            all_to_all={"bytes": A2A_BYTES, "seconds": 0.3, "bytes_per_second": A2A_BYTES / 0.3},
            **all_reduce_fields(report, experts))
    b.trial_end(1, c, 1110, epochs=1, best=0.5)
    return b


# One epoch of DENSE_GPT: 64 samples trained (forward and backward), 8 evaluated (forward).
DENSE_GPT_OPS = epoch_ops((lambda c: (c.fp, c.bp))(count(DENSE_GPT)), 64, 8)
A2A_BYTES = all_to_all_bytes(MOE_GPT, "fp32", 32, 8)
DENSE_EPOCH = 2 * (2 * gradient_bytes(DENSE_GPT) // 2)  # 2 steps, 2 ranks: G per rank per step
MOE_EPOCH = 2 * 3 * gradient_bytes(MOE_GPT, True) // 4  # 1 step, 4 ranks: 3/2 G
WAITED = 2 * 0.25 + 0.5 + 0.3
# The run's 400 s (1000 to the run_end at 1400) less the waits over the replicas' mean concurrency: 320 s
# of lives in a span of 210 s.
EFFICIENCY = (400 - WAITED * 210 / 320) / 400


def test_summary_json_gives_the_all_reduce_and_the_network_cost(tmp_path):
    _run(tmp_path).finish(1400)
    _, summary_path = write_report(tmp_path)
    summary = json.loads(summary_path.read_text())
    communication = summary["communication"]
    assert communication["all_reduce"] == {
        "trials": 2, "bytes": 2 * DENSE_EPOCH + MOE_EPOCH, "inter_node_bytes": MOE_EPOCH,
        "intra_node_bytes": 2 * 2 * DENSE_EPOCH + MOE_EPOCH, "seconds": 1.0,
        "bytes_per_second": (2 * DENSE_EPOCH + MOE_EPOCH) / 1.0}
    assert communication["all_to_all"]["bytes"] == A2A_BYTES
    # Replica lives: 1000 to their last events (1400 is the primary's run_end), 210 + 110 s; steps 4 s.
    network = communication["network"]
    assert network["wait_seconds"] == pytest.approx(WAITED) and network["step_seconds"] == 4.0
    assert network["share"] == pytest.approx(WAITED / 4.0)
    assert network["efficiency"] == pytest.approx(EFFICIENCY)
    assert network["ideal_score_ops"] == pytest.approx(summary["score_ops"] / network["efficiency"])
    assert network["complete"] is True
    [dense, moe] = communication["per_trial"]
    operations = 2 * DENSE_GPT_OPS
    assert dense["network"] == {"wait_seconds": 0.5, "step_seconds": 2.0, "share": 0.25, "efficiency": 0.75,
                                "complete": True, "ops_per_second": operations / 2.0,
                                "ideal_ops_per_second": operations / 1.5}
    assert moe["network"]["share"] == pytest.approx(0.8 / 2.0) and moe["all_to_all"]["seconds"] == 0.3
    assert dense["all_reduce"] == {"bytes": 2 * DENSE_EPOCH, "inter_node_bytes": 0,
                                   "intra_node_bytes": 4 * DENSE_EPOCH, "seconds": 0.5,
                                   "bytes_per_second": 4 * DENSE_EPOCH}
    html = (tmp_path / "report.html").read_text()
    assert "<tr><th>seconds waiting on the all-reduce (measured)</th><td>1 s</td></tr>" in html
    assert f"<tr><th>network efficiency</th><td>{100 * EFFICIENCY:.1f}%</td></tr>" in html
    assert "score an ideal network would have given" in html and "all-reduce bus bandwidth" in html


def test_one_replicas_ideal_network_time_is_the_runs_time_less_its_waits(tmp_path):
    """The primary's seconds outside the replica (starting, launching, the report) are not the network's:
    an ideal network gives back the 30 s waited, not 30 s of every 100 of the run's 120."""
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1010)
    a = b.trial_start(0, 1010, DENSE_GPT, "fp32")
    report = SimpleNamespace(train_images=64, val_images=8, all_reduce_seconds=30.0)
    b.epoch(0, a, 1100, 0, 64, 8, 0.5, step_seconds=40.0, **all_reduce_fields(report, _layouts()[0]))
    b.trial_end(0, a, 1110, epochs=1, best=0.5)
    b.finish(1120)
    summary = json.loads(write_report(tmp_path)[1].read_text())
    network = summary["communication"]["network"]
    assert network["efficiency"] == pytest.approx((120 - 30) / 120)
    assert network["ideal_score_ops"] == pytest.approx(DENSE_GPT_OPS / (120 - 30))
    assert summary["score_ops"] == pytest.approx(DENSE_GPT_OPS / 120)


def test_the_pricing_outside_the_steps_is_given_back_by_the_run_not_by_its_trial(tmp_path):
    """jax times its all-reduce apart from the steps (EpochReport.pricing_seconds): communication an ideal
    network would not have taken, so the run's time less the waits loses it too; a trial's figures are
    over its time in steps, where it never was. The live figures, /metrics' and a restored ledger's agree."""
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1010)
    a = b.trial_start(0, 1010, DENSE_GPT, "fp32")
    report = SimpleNamespace(train_images=64, val_images=8, all_reduce_seconds=30.0, pricing_seconds=6.0)
    b.epoch(0, a, 1100, 0, 64, 8, 0.5, step_seconds=40.0, **all_reduce_fields(report, _layouts()[0]),
            **pricing_fields(report))
    b.trial_end(0, a, 1110, epochs=1, best=0.5)
    b.finish(1120)
    [epoch_end] = [e for e in read_events(tmp_path / "replicas/0/events.jsonl") if e["event"] == "epoch_end"]
    assert epoch_end["pricing_seconds"] == 6.0 and pricing_fields(SimpleNamespace(pricing_seconds=None)) == {}
    communication = json.loads(write_report(tmp_path)[1].read_text())["communication"]
    network = communication["network"]
    assert (network["wait_seconds"], network["pricing_seconds"]) == (30.0, 6.0)
    assert network["share"] == pytest.approx(30 / 40)  # of the time in steps: the pricing is not in it
    assert network["efficiency"] == pytest.approx((120 - 36) / 120)
    assert network["ideal_score_ops"] == pytest.approx(DENSE_GPT_OPS / (120 - 36))
    [trial] = communication["per_trial"]
    assert trial["network"]["efficiency"] == pytest.approx(1 - 30 / 40)
    text = RunCollector(tmp_path).render(openmetrics=False).decode()
    forget(tmp_path)
    [line] = [x for x in text.splitlines() if x.startswith("aiperf_network_efficiency_ratio ")]
    assert float(line.split()[1]) == pytest.approx((120 - 36) / 120)
    ledger = RunLedger(tmp_path)
    ledger.refresh()
    restored = RunLedger.from_state(tmp_path, json.loads(json.dumps(ledger.state())))
    assert ledger.pricing_seconds == restored.pricing_seconds == restored.trials[a].pricing_seconds == 6.0


def test_unmeasured_seconds_make_the_efficiency_an_upper_bound(tmp_path):
    b = RunBuilder(tmp_path)
    b.replica_start(0, 1000)
    a = b.trial_start(0, 1000, DENSE_GPT, "fp32")
    report = SimpleNamespace(train_images=64, val_images=8)  # TensorFlow's, MindSpore's: no seconds
    b.epoch(0, a, 1100, 0, 64, 8, 0.5, step_seconds=1.0, **all_reduce_fields(report, _layouts()[0]))
    b.finish(1400)
    communication = json.loads(write_report(tmp_path)[1].read_text())["communication"]
    assert communication["all_reduce"]["seconds"] is None and communication["all_reduce"]["bytes"] == DENSE_EPOCH
    assert communication["network"]["complete"] is False and communication["network"]["efficiency"] == 1.0
    assert "an upper bound" in (tmp_path / "report.html").read_text()
    assert verify_run(tmp_path) == []


def test_the_score_does_not_change(tmp_path):
    _run(tmp_path / "slow").finish(1400)
    _run(tmp_path / "fast", seconds=(0.0, 0.0)).finish(1400)
    slow, fast = score_run(tmp_path / "slow"), score_run(tmp_path / "fast")
    assert slow.score_ops == fast.score_ops > 0 and slow.regulated_ops == fast.regulated_ops


def test_the_ledger_state_keeps_the_all_reduce(tmp_path):
    _run(tmp_path).finish(1400)
    ledger = RunLedger(tmp_path)
    ledger.refresh()
    restored = RunLedger.from_state(tmp_path, json.loads(json.dumps(ledger.state())))
    for reader in (ledger, restored):
        assert (reader.all_reduce_bytes, reader.all_reduce_seconds, reader.all_reduce_trials) == (
            2 * DENSE_EPOCH + MOE_EPOCH, 1.0, 2)
        assert reader.trials["r0000-t00000"].step_seconds == 2.0


def test_metrics_and_watch_carry_the_all_reduce_and_the_efficiency(tmp_path, capsys):
    _run(tmp_path).finish(1400)
    text = RunCollector(tmp_path).render(openmetrics=False).decode()
    forget(tmp_path)
    total = 2 * DENSE_EPOCH + MOE_EPOCH
    assert f"aiperf_all_reduce_bytes_total {float(total)!r}\n" in text
    assert "aiperf_all_reduce_seconds_total 1.0\n" in text
    assert f"aiperf_all_reduce_bytes_per_second {float(total)!r}\n" in text
    assert "# TYPE aiperf_network_efficiency_ratio gauge" in text
    [line] = [x for x in text.splitlines() if x.startswith("aiperf_network_efficiency_ratio ")]
    assert float(line.split()[1]) == pytest.approx(EFFICIENCY)
    [line] = [x for x in text.splitlines() if x.startswith("aiperf_network_wait_share_ratio ")]
    share = WAITED / 4.0  # the replicas' 4 s in steps
    assert float(line.split()[1]) == pytest.approx(share)
    assert f"aiperf_all_reduce_inter_node_bytes_total {float(MOE_EPOCH)!r}\n" in text
    assert main(["watch", "--once", str(tmp_path)]) == 0
    forget(tmp_path)
    out = capsys.readouterr().out
    assert f"all-reduce {total / 1e9:.3g} GB/s" in out
    assert f"2 data-parallel trials), {share:.1%} of step time waiting, network efficiency" in out


def test_rank_shows_the_network_share_and_efficiency():
    with_network = dict(verdict("a.tar.gz", score=2e12), network_share=0.0625, network_efficiency=0.875)
    ranking = rank([with_network, verdict("b.tar.gz", system_name="B", score=1e12)])  # b: none recorded
    lines = render_text(ranking).splitlines()
    header = next(line for line in lines if line.startswith("rank"))
    assert header.index("network share") < header.index("network efficiency")
    row = next(line for line in lines if "Alpha" in line)
    assert row.index("6.2%") < row.index("87.5%")


# --- aiperf score --verify ------------------------------------------------------------------------------
def _tampered(root, **changes):
    """A run whose first epoch logged `changes` into its all_reduce, as a replica would (hash chain intact)."""
    b = RunBuilder(root)
    b.replica_start(0, 1000)
    a = b.trial_start(0, 1000, DENSE_GPT, "fp32")
    report = SimpleNamespace(train_images=64, val_images=8, all_reduce_seconds=0.25)
    fields = all_reduce_fields(report, _layouts()[0])
    fields["all_reduce"].update(changes)
    b.epoch(0, a, 1100, 0, 64, 8, 0.5, step_seconds=1.0, **fields)
    b.finish(1400)
    return verify_run(root)


def test_verify_passes_an_honest_run(tmp_path, capsys):
    _run(tmp_path).finish(1400)
    assert verify_run(tmp_path) == []
    assert main(["score", "--verify", str(tmp_path)]) == 0
    assert "verify: intact" in capsys.readouterr().out


@pytest.mark.parametrize("changes, problem", [
    ({"bytes": DENSE_EPOCH + 1, "bytes_per_second": (DENSE_EPOCH + 1) / 0.25},
     f"bytes, inter_node_bytes, intra_node_bytes ({DENSE_EPOCH + 1}, 0, {2 * DENSE_EPOCH}) differ from the analytic "
     f"({DENSE_EPOCH}, 0, {2 * DENSE_EPOCH}) (opcount.communication on trials/r0000-t00000/graph.json, 2 ranks on "
     "1 node(s), 2 steps)"),
    ({"inter_node_bytes": 5}, "bytes, inter_node_bytes, intra_node_bytes"),
    ({"steps": 1}, "steps 1 differ from 64 samples trained in batches of 32"),
    ({"bytes_per_second": 1.0}, "bytes_per_second 1.0 is not bytes over seconds"),
    ({"bytes": "many"}, "not {bytes, inter_node_bytes, intra_node_bytes: integers >= 0"),
])
def test_verify_catches_a_tampered_all_reduce(tmp_path, changes, problem):
    problems = _tampered(tmp_path, **changes)
    assert problems and problems[0].startswith(
        "replicas/0/events.jsonl: epoch_end of r0000-t00000 epoch 0: all_reduce: " + problem), problems


def test_verify_catches_ranks_the_replica_did_not_start_with(tmp_path):
    b = RunBuilder(tmp_path)
    b.log(0).append("replica_start", time=1000, replica=0, pid=1, host="node0", backend="numpy",
                    framework_version="numpy 2.0", devices=["cpu:0", "cpu:1"], attempt=1)
    a = b.trial_start(0, 1000, DENSE_GPT, "fp32")
    layout = AllReduceLayout(DENSE_GPT, 4, 1, 32)  # 4 ranks claimed, 2 devices on 1 node
    b.epoch(0, a, 1100, 0, 64, 8, 0.5, **all_reduce_fields(SimpleNamespace(train_images=64, val_images=8), layout))
    b.finish(1400)
    assert verify_run(tmp_path) == ["replicas/0/events.jsonl: epoch_end of r0000-t00000 epoch 0: all_reduce: 4 ranks "
                                    "on 1 node(s), but the replica started with 2 on 1"]


# --- a real run: torch on 2 CPU devices -------------------------------------------------------------------
_REPLICA_SCRIPT = """
import json, sys, tempfile

from aiperf_backends.torch import TorchBackend
from aiperf_core.replica import run_replica, write_run_json
from aiperf_core.rundir import EventLog, RunDir, chain_head, read_events

TINY_LM = {"workload": "lm", "dataset": "embedded", "initial_architecture": "gpt_tiny", "seq_len": 32,
           "epoch_tokens": 1024, "val_tokens": 2048, "batch_size": 4, "reference_batch_size": 4,
           "warmup_epochs": [1, 1, 1], "max_epochs": 2, "nas_candidates": 3, "precision": "fp32"}

if __name__ == "__main__":
    root = sys.argv[-1]
    write_run_json(root, backend="torch", policy=TINY_LM, stop_after_trials=1)
    run = RunDir(root)
    primary = EventLog(run.primary_log).open()
    primary.append("run_start", time=run.read_run()["start_time"], resume=False)
    backend = TorchBackend()
    assert run_replica(root, 0, backend=backend) == "max_trials"
    primary.append("run_end", time=read_events(run.replica_log(0))[-1]["time"], reason="stopped",
                   log_heads={"0": chain_head(run.replica_log(0))})
    primary.close()
    [start] = [e for e in read_events(run.replica_log(0)) if e["event"] == "trial_start"]
    model = backend.lower(__import__("aiperf_core.ir", fromlist=["Graph"]).Graph.from_json(
        (run.trial_dir(start["trial"]) / "graph.json").read_text()), None)
    print(json.dumps({"trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
"""


@pytest.mark.slow
def test_a_torch_replica_on_two_devices_logs_the_formulas_bytes(tmp_path, capsys):
    """A replica trains the tiny lm seed on torch over 2 CPU devices (gloo): each epoch_end.all_reduce has
    the bytes of docs/scoring.md's formula, recomputed here from the pinned graph by hand (every trainable
    parameter, which is what torch's lowered model trains, in float32, times 2(n-1)/n, once per step), and
    seconds that DDP's hook measured; `aiperf score --verify` passes and the report adds them up."""
    script = tmp_path / "replica_script.py"
    script.write_text(_REPLICA_SCRIPT)
    out = run_on_cpu_devices(f"import runpy, sys; sys.argv = ['x', {str(tmp_path / 'run')!r}]; "
                             f"runpy.run_path({str(script)!r}, run_name='__main__')")
    run = RunDir(tmp_path / "run")
    events = read_events(run.replica_log(0))
    [start] = [e for e in events if e["event"] == "trial_start"]
    graph = Graph.from_json((run.trial_dir(start["trial"]) / "graph.json").read_text())
    assert out["trainable"] == graph.num_params()
    epochs = [e for e in events if e["event"] == "epoch_end"]
    assert epochs
    for epoch in epochs:
        logged = epoch["all_reduce"]
        steps = -(-epoch["train_images"] // start["hyper"]["batch_size"])
        per_rank = steps * (2 * (2 - 1) * (4 * graph.num_params()) // 2)
        assert (logged["bytes"], logged["steps"], logged["ranks"], logged["nodes"]) == (per_rank, steps, 2, 1)
        assert (logged["inter_node_bytes"], logged["intra_node_bytes"]) == (0, 2 * per_rank)
        assert 0 < logged["seconds"] <= epoch["step_seconds"]
        assert logged["bytes_per_second"] == per_rank / logged["seconds"]
    assert verify_run(run.root) == []
    communication = json.loads(write_report(run.root)[1].read_text())["communication"]
    assert communication["all_reduce"]["bytes"] == sum(e["all_reduce"]["bytes"] for e in epochs)
    assert 0 < communication["network"]["share"] < 1 and 0 < communication["network"]["efficiency"] < 1
