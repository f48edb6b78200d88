"""An official-shape LM run end to end on this CPU (issue 39): GPT-2 small's shape at 1,024 bytes of
context, on an enwik8-shaped sample made here (never the real file), with the epoch and the
validation cut to one sequence each so that a trial fits a CPU: one whole trial, then the score
recomputed and verified. The run is unofficial for those cuts and its data, and for the quality
a one-sequence trial cannot reach: nothing else."""

from __future__ import annotations

import json
import zipfile

import pytest

from aiperf_core.cli import main
from aiperf_core.data.text_corpus import embedded_bytes
from aiperf_core.workloads.lm import OFFICIAL_SEED, SEEDS


@pytest.fixture(scope="module")
def enwik8_sample(tmp_path_factory):
    folder = tmp_path_factory.mktemp("enwik8-sample")
    with zipfile.ZipFile(folder / "enwik8.zip", "w") as archive:
        archive.writestr("enwik8", embedded_bytes())
    assert main(["data", "prepare", str(folder / "enwik8.zip"), str(folder / "prepared")]) == 0
    return folder / "prepared"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_an_official_shape_trial_trains_end_to_end_on_a_cpu(backend, enwik8_sample, tmp_path, capsys):
    config = tmp_path / "official-shape.toml"
    config.write_text('workload = "lm"\n\n[policy]\nprecision = "fp32"\nepoch_tokens = 1024\nval_tokens = 1024\n')
    run_dir = tmp_path / "run"
    assert main(["run", "--config", str(config), "--backend", backend, "--data", str(enwik8_sample),
                 "--time-budget", "15m", "--run-dir", str(run_dir), "--stop-after-trials", "1"]) == 0
    capsys.readouterr()
    run = json.loads((run_dir / "run.json").read_text())
    assert run["model"] == OFFICIAL_SEED and run["policy"]["seq_len"] == 1024
    trial = json.loads(next((run_dir / "trials").glob("*/trial.json")).read_text())
    assert trial["status"] in ("ok", "early_stopped") and trial["epochs"] >= 1
    graph = json.loads(next((run_dir / "trials").glob("*/graph.json")).read_text())
    attention = [n for n in graph["nodes"] if n["op"] == "attention"]
    assert len(attention) == SEEDS[OFFICIAL_SEED]["layers"]
    assert attention[0]["attrs"]["heads"] * attention[0]["attrs"]["head_dim"] == SEEDS[OFFICIAL_SEED]["hidden"]
    start = next(json.loads(line) for line in (run_dir / "replicas" / "0" / "events.jsonl").read_text().splitlines()
                 if json.loads(line).get("event") == "trial_start")
    assert start["memory"]["micro_batch"] >= 1 and start["memory"]["estimate_bytes"] > 0

    assert main(["score", str(run_dir), "--verify", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    reasons = summary["reasons"]
    assert summary["total_ops"] > 0 and summary["score_ops"] > 0 and not summary["valid"]
    assert any("not the official one" in r for r in reasons), reasons
    assert any("epoch_tokens changed" in r for r in reasons) and any("val_tokens changed" in r for r in reasons)
    others = [r for r in reasons if not ("not the official one" in r or "epoch_tokens changed" in r
                                          or "val_tokens changed" in r or "bits per byte is above" in r)]
    assert others == [], others
