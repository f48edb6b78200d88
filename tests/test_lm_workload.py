"""The language-model workload: its policy, data, error rule, a replica's search over GPTs, and a
whole `aiperf run --workload lm` scored and verified."""

import json
import math

import numpy as np
import pytest

from aiperf_core import workloads
from aiperf_core.cli import main
from aiperf_core.data.text_corpus import embedded_corpus
from aiperf_core.policy import Policy, PolicyError
from aiperf_core.replica import run_replica, write_run_json
from aiperf_core.rundir import RunDir, read_events, verify_chain
from aiperf_core.scoring import score_run
from aiperf_core.search.hpo import Proposal
from test_submission import inputs, package, run_dir  # noqa: F401 (fixtures: a CNN package)

# The smallest search that still grows: the tiny GPT, 8 steps of 4 windows a trial.
TINY = {"workload": "lm", "dataset": "embedded", "initial_architecture": "gpt_tiny", "seq_len": 32,
        "epoch_tokens": 1024, "val_tokens": 2048, "batch_size": 4, "reference_batch_size": 4,
        "warmup_epochs": [1, 1, 1], "max_epochs": 2, "nas_candidates": 3, "precision": "fp32"}


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


def test_the_lm_policy_has_its_own_defaults_items_and_fixed_rules():
    lm, cnn = Policy({"workload": "lm"}), Policy()
    assert (lm["optimizer"], lm["lr_schedule"], lm["grad_clip"], lm["weight_decay"]) == ("adamw", "cosine", 1.0, 0.1)
    assert (lm["dataset"], lm["initial_architecture"], lm["seq_len"]) == ("enwik8", "gpt2_small", 1024)
    assert (cnn["optimizer"], cnn["dataset"], cnn["workload"]) == ("sgd-momentum", "imagenet", "cnn")
    assert "seq_len" not in cnn and "image_size" not in lm and "hpo_kernel_sizes" not in lm
    assert lm.overridden_fixed() == [] and Policy({"workload": "lm", "seq_len": 64}).overridden_fixed() == ["seq_len"]
    for values, field in (({"seq_len": 64}, "policy.seq_len: a setting of the lm workload, not of cnn"),
                          ({"workload": "lm", "image_size": 64}, "policy.image_size: a setting of the cnn"),
                          ({"workload": "lm", "dataset": "imagenet"}, "policy.dataset: 'imagenet' must be one of"),
                          ({"workload": "rnn"}, "policy.workload: 'rnn' must be one of cnn, lm"),
                          ({"optimizer": "adamw"}, "policy.optimizer: 'adamw' must be one of sgd-momentum")):
        with pytest.raises(PolicyError, match=field):
            Policy(values)


def test_an_epoch_is_a_fixed_number_of_tokens_and_validation_a_fixed_prefix(corpus):
    data = workloads.get("lm").data
    policy = Policy(TINY)
    one, again, other = (data.trial_data(corpus, policy, seed) for seed in (1, 1, 2))
    epoch = [one.load("train", b)[0] for b in one.plan("train", 0, 1, 8)]
    assert sum(len(x) for x in epoch) == one.train_images == 1024 // 32 and epoch[0].dtype == np.int32
    assert np.array_equal(np.concatenate([b for b in again.plan("train", 0, 1, 8)]),
                          np.concatenate([b for b in one.plan("train", 0, 1, 8)]))
    assert not np.array_equal(np.concatenate(list(other.plan("train", 0, 2, 8))),
                              np.concatenate(list(one.plan("train", 0, 1, 8))))
    x_val, y_val = (np.concatenate(part) for part in zip(*[(b.x, b.y) for b in one.iterate("val", 0, 0, 16)]))
    assert x_val.shape == (2048 // 32, 32) and one.val_images == 2048 // 32
    # y is x shifted by one byte: next-byte labels, from the same split.
    assert np.array_equal(x_val.reshape(-1)[1:], y_val.reshape(-1)[:-1])
    assert np.array_equal(x_val[0], np.asarray(corpus.val[:32]))
    assert one.classes == 256 and data.digest(corpus, {}) == corpus.digest


def test_the_error_is_bits_per_byte_over_eight_bounded_to_zero_and_one():
    validity = workloads.get("lm").validity
    assert validity.error(None, math.log(256), 100) == pytest.approx(1.0)  # uniform: knows nothing
    assert validity.error(None, 2 * math.log(256), 100) == 1.0  # worse than uniform: still nothing
    assert validity.error(0.5, math.log(2) * 2, 100) == pytest.approx(2 / 8)
    assert validity.error(None, 0.0, 100) == pytest.approx(1 / 64)  # the floor keeps -ln finite
    assert validity.error(0.9, None, 100) is None
    rules = {"max_bits_per_byte": 3.0}
    assert validity.reasons(rules, 2.9 / 8) == []
    assert validity.reasons(rules, 3.5 / 8) == ["best validation 3.500 bits per byte is above the maximum 3"]
    cnn = workloads.get("cnn").validity
    assert cnn.error(0.75, 9.0, 10) == pytest.approx(0.25) and cnn.error(1.0, 0.0, 10) == 0.05


def test_the_lm_tuner_scales_the_learning_rate_and_the_seed_reads_the_policy(corpus):
    lm = workloads.get("lm")
    policy = Policy(TINY)
    assert lm.hpo.learning_rate(policy, Proposal({"batch_size": 8, "lr_scale": 0.5}, "hpo")) == \
        pytest.approx(policy["learning_rate"] * math.sqrt(8 / 4) * 0.5)
    graph = lm.seed.build(policy, corpus)
    assert graph.takes_tokens and graph.input_shape == (32,) and graph.vocab == 256
    with pytest.raises(Exception, match="workload: 'gan' is not one of cnn, lm"):
        workloads.get("gan")


def test_a_replica_grows_gpts_by_transformer_morphs_and_records_bits_per_byte(tmp_path):
    write_run_json(tmp_path, backend="numpy", policy=TINY, stop_after_trials=3)
    run = RunDir(tmp_path).read_run()
    assert run["workload"] == "lm" and run["dataset"]["name"] == "embedded" and run["model"] == "gpt_tiny"
    assert run_replica(tmp_path, 0) == "max_trials"
    log = RunDir(tmp_path).replica_log(0)
    assert verify_chain(log) == []
    found = read_events(log)
    assert found[0]["dataset_digest"] == run["dataset"]["digest"] == embedded_corpus().digest
    starts = [e for e in found if e["event"] == "trial_start"]
    ends = [e for e in found if e["event"] == "trial_end"]
    assert [s["round"] for s in starts] == [1, 2, 3] and all(e["status"] in ("ok", "early_stopped") for e in ends)
    assert starts[0]["morph"] is None
    grown = [s["morph"]["op"] for s in starts[1:]]
    assert all(op in ("deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe") for op in grown)
    for start in starts:
        info = json.loads((RunDir(tmp_path).trial_dir(start["trial"]) / "trial.json").read_text())
        assert set(info["hpo_point"]) == {"batch_size", "lr_scale"} and info["hyper"]["lr_scale"] == 1.0
        # The search maximises 1 - error: 1 - bits per byte / 8, from the validation loss. A warm-up
        # trial of one epoch has too few points for a curve, so its prediction is that value too.
        best_loss = min(info["val_loss"])
        quality = 1 - min(best_loss / math.log(2), 8) / 8
        assert info["target"] == pytest.approx(quality, abs=1e-9)
        assert info["predicted_accuracy"] == pytest.approx(quality, abs=1e-9)
    epochs = [e for e in found if e["event"] == "epoch_end"]
    assert all(e["train_images"] == 1024 // 32 and e["val_images"] == 2048 // 32 for e in epochs)
    result = score_run(tmp_path)
    assert result.workload == "lm" and result.score_ops > 0
    best_loss = min(e["val_loss"] for e in epochs)
    assert result.best_error == pytest.approx(min(best_loss / math.log(2), 8) / 8)
    assert result.regulated_ops == pytest.approx(-math.log(result.best_error) * result.score_ops)
    assert "dataset is 'embedded', not enwik8 ('enwik8')" in result.reasons


def test_aiperf_run_workload_lm_scores_verifies_and_reports_bits_per_byte(tmp_path, capsys):
    config = tmp_path / "lm.toml"
    policy = {k: v for k, v in TINY.items() if k != "workload" and k != "dataset"}
    config.write_text('workload = "lm"\n[policy]\n' + "".join(f"{k} = {json.dumps(v)}\n" for k, v in policy.items()))
    folder = tmp_path / "run"
    assert main(["run", "--config", str(config), "--backend", "numpy", "--time-budget", "20s",
                 "--run-dir", str(folder), "--stop-after-trials", "2"]) == 0
    out = capsys.readouterr().out
    assert "best validation" in out and "bits per byte" in out
    run = RunDir(folder).read_run()
    assert run["workload"] == "lm" and run["policy"]["workload"] == "lm" and run["dataset"]["layout"] == "bytes"
    # nodes_per_replica auto is resolved before the run is recorded: the local executor's machine is one node.
    assert run["policy"]["nodes_per_replica"] == 1 and run["rules_version"] == 2
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["workload"] == "lm"
    assert summary["machine"]["nodes_per_replica"] == 1 and summary["machine"]["network_loaded"] is False
    assert "1: no network was loaded" in (folder / "report.html").read_text()
    assert "bits per byte" in (folder / "report.html").read_text()
    assert main(["score", "--verify", str(folder)]) == 0
    # The flag overrides the config's workload, whose lm items then do not apply; the lm workload
    # refuses image data.
    assert main(["run", "--config", str(config), "--workload", "cnn", "--data", "digits", "--backend", "numpy",
                 "--time-budget", "5s", "--run-dir", str(tmp_path / "other")]) == 2
    assert "policy.initial_architecture: 'gpt_tiny' must be one of resnet50" in capsys.readouterr().err
    assert main(["run", "--workload", "lm", "--data", "digits", "--backend", "numpy", "--time-budget", "5s",
                 "--run-dir", str(tmp_path / "third")]) == 2
    assert "--data digits: not a folder" in capsys.readouterr().err


# -- an LM submission: certified for its workload, checked, ranked in its own list ------------------


def _lm_package(tmp_path, kit: dict):
    from aiperf_core.builders import gpt
    from aiperf_core.submission.package import pack
    from aiperf_core.submission.system import to_toml, validate_system
    from test_score import RunBuilder
    from test_submission import system_description, write_monitors

    b = RunBuilder(tmp_path / "lm-run", model="gpt2_small", dataset={"name": "enwik8", "vocab": 256},
                   policy=Policy({"workload": "lm"}).to_json(), workload="lm", rules_version=2)
    seed = gpt(layers=1, hidden=32, heads=2, seq_len=16, vocab=256)
    for replica in (0, 1):
        b.replica_start(replica, 1000)
        trial = b.trial_start(replica, 1000, seed, "fp32")
        # val_loss 1.0 nat per byte: 1.443 bits, well under the 4-bit rule
        b.epoch(replica, trial, 1100 + 50 * replica, 0, 4000, 100, 0.55)
        b.trial_end(replica, trial, 1200, epochs=1, best=0.55)
    b.finish(1900)
    write_monitors(tmp_path / "lm-run")
    (tmp_path / "kit.json").write_text(json.dumps(kit))
    (tmp_path / "system.toml").write_text(to_toml(validate_system(system_description(system_name="lmbox"))))
    path, _ = pack(tmp_path / "lm-run", tmp_path / "system.toml", [tmp_path / "kit.json"], tmp_path / "lm.tar.gz")
    return path


def test_an_lm_submission_needs_the_lm_certification_and_ranks_in_its_own_list(package, tmp_path, capsys):  # noqa: F811
    from aiperf_core.submission.check import check_submission
    from test_submission import kit_report

    cnn_kit = _lm_package(tmp_path / "a", kit_report(workload_scope=["cnn"]))
    rejections = check_submission(cnn_kit).rejections
    assert any("the lm workload was not checked (--workload cnn)" in r for r in rejections), rejections
    lm_only = kit_report(workload_scope=["lm"])
    lm_only["checks"] = [dict(c, workload="lm") for c in lm_only["checks"]]
    lm_package = _lm_package(tmp_path / "b", lm_only)
    verdict = check_submission(lm_package)
    assert verdict.accepted and verdict.workload == "lm", verdict.rejections
    assert verdict.official, verdict.rule_reasons  # enwik8, gpt2_small, 1.443 bits per byte
    assert main(["rank", str(package), str(lm_package), "--json"]) == 0
    lists = json.loads(capsys.readouterr().out)["lists"]
    assert [(ranked["workload"], [e["file"] for e in ranked["entries"]]) for ranked in lists] == \
        [("cnn", [str(package)]), ("lm", [str(lm_package)])]
    assert all(e["rank"] == 1 for ranked in lists for e in ranked["entries"])


def test_the_lm_policy_caps_bound_the_growth():
    from aiperf_core.builders import gpt
    from aiperf_core.morph.transformer import TransformerCaps, transformer_size

    seed = gpt(layers=2, hidden=32, heads=2, seq_len=16, vocab=64)
    assert transformer_size(seed) == {"layers": 2, "width": 32, "heads": 2, "experts": 0}
    morphs = workloads.get("lm").morphs
    free = morphs.generate_candidates(seed, None, 12, 3, Policy({"workload": "lm"}))
    assert {r.record["op"] for r in free} >= {"deeper", "double_width", "more_heads"}
    # At its caps a parent still grows, but never past them: no deeper, no doubling, no more heads.
    capped = Policy({"workload": "lm", "max_layers": 2, "max_width": 32, "max_heads": 2, "max_experts": 4})
    children = morphs.generate_candidates(seed, None, 12, 3, capped)
    assert children and {r.record["op"] for r in children} <= {"wider_mlp", "upcycle_moe"}
    assert all(transformer_size(r.graph)["experts"] <= 4 for r in children)
    with pytest.raises(Exception, match="max_heads must be a positive integer or None"):
        TransformerCaps(max_heads=0)


def test_a_prepared_text_that_is_not_the_real_enwik8_makes_the_run_unofficial():
    from aiperf_core.scoring.rules import validity_reasons

    run = {"model": "gpt2_small", "policy": Policy({"workload": "lm"}).to_json(),
           "dataset": {"name": "enwik8", "official": True, "digest": None}, "rules_version": 2}
    assert validity_reasons(run, [], 2.0 / 8) == []
    run["dataset"]["official"] = False
    assert validity_reasons(run, [], 2.0 / 8) == [
        "dataset 'enwik8' is not the official one: its manifest records official = false"]
    assert validity_reasons(run, [], 4.5 / 8)[-1] == "best validation 4.500 bits per byte is above the maximum 2"
