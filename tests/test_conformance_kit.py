"""The kit itself: it catches a wrong backend, names the node, never passes vacuously, reads its
expectations files strictly, certifies every declared precision, refuses a native count <= 0, and
reports machine-readably (naming the expectations file and its hash)."""

import hashlib
import json

import numpy as np
import pytest

import aiperf_opcount

from aiperf_core.backend import CounterConvention, NativeCounter
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError
from aiperf_core.registry import list_backends
from aiperf_numpy.backend import NumpyBackend
from aiperf_conformance.expectations import (DEFAULTS_FILE, Expectations, load_defaults, load_expectations,
                                             read_expectations)
from aiperf_conformance.kit import (LEVELS, Context, catalogue, catalogue_ids, check_id, collect, parse_levels,
                                    run_check, run_conformance)
from aiperf_conformance.pytest_support import conformance_cases
from aiperf_conformance.results import CheckResult, Report


class ShapeBugBackend(NumpyBackend):
    """Drops the last output channel of every image-shaped result, as a buggy lowering might."""

    name = "shapebug"

    def predict(self, model, x):
        out = super().predict(model, x)
        return out[..., :-1] if out.ndim == 4 else out


class GradientBugBackend(NumpyBackend):
    name = "gradbug"

    def loss_and_grads(self, model, x, labels, label_smoothing=0.0):
        loss, grads = super().loss_and_grads(model, x, labels, label_smoothing)
        grads["op"]["kernel"] = grads["op"]["kernel"] * 1.01
        return loss, grads


class DeclaresBf16(NumpyBackend):
    """Declares bf16 (and computes it in fp32, well within bf16's tolerances), whatever the CPU: not
    through runs_precision, which the contract asks only on a CPU with bf16 instructions."""

    name = "declaresbf16"

    def precisions(self, device=None):
        return ("fp32", "bf16")


class FixedCounter(NativeCounter):
    """A native counter that reports `counts` for every model (conv and dense covered)."""

    convention = CounterConvention(mac_ops=2, padding="paper", covers=("conv", "dense"))

    def __init__(self, counts):
        self.counts = counts

    def count(self, model, batch, backward):
        return dict(self.counts)


class NegativeCounter(NumpyBackend):
    """XLA's cost analysis on a cuDNN custom call: -1 per convolution."""

    name = "negativecounter"

    def native_counter(self):
        return FixedCounter({"conv": -53, "dense": 10})


class ZeroCounter(NumpyBackend):
    """Covers conv but reports nothing for it."""

    name = "zerocounter"

    def native_counter(self):
        return FixedCounter({"dense": 10})


def results_for(backend, level, expectations=None, precisions=("fp32",)):
    ctx = Context(backend, expectations or Expectations(), device=backend.devices()[0], precisions=precisions)
    return {c.id: run_check(ctx, c) for c in collect(ctx, [level])}


def test_wrong_shapes_fail_and_name_the_node():
    results = results_for(ShapeBugBackend(), "op")
    bad = results["op/conv_3x3_same/forward"]
    assert bad.status == "fail"
    assert "node 'op'" in bad.message and "IR says" in bad.message
    assert bad.measured == [4, 7, 7, 4] and bad.expected == [4, 7, 7, 5]
    assert results["op/dense/forward"].status == "pass"


def test_wrong_gradients_fail():
    results = results_for(GradientBugBackend(), "op")
    bad = results["op/conv_1x1/backward"]
    assert bad.status == "fail" and "node 'op' gradient 'kernel'" in bad.message


def test_stale_expected_failure_is_reported_as_xpass():
    exp = Expectations(xfail={"op/relu/*": "pretend relu is broken"})
    results = results_for(NumpyBackend(), "op", exp)
    assert results["op/relu/forward"].status == "xpass"
    assert "update the expectations file" in results["op/relu/forward"].message


def test_expected_failure_counts_as_xfail():
    exp = Expectations(xfail={"op/conv_3x3_same/forward": "known channel bug"})
    results = results_for(ShapeBugBackend(), "op", exp)
    assert results["op/conv_3x3_same/forward"].status == "xfail"


def test_report_json_names_device_precision_and_expectations(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert main(["conformance", "--backend", "numpy", "--level", "op,morph", "--report", str(report_path)]) == 0
    summary = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["certifies"] is True and report["backend"] == "numpy"
    assert report["device"] == NumpyBackend().devices()[0] and report["precisions"] == ["fp32"]
    check = report["checks"][0]
    assert {"level", "name", "status", "measured", "expected", "tolerance", "message", "id", "precision",
            "device"} <= set(check)
    assert {c["level"] for c in report["checks"]} == {"op", "morph"}
    assert {c["precision"] for c in report["checks"]} == {"fp32"}
    used = NumpyBackend().conformance_file()
    sha = hashlib.sha256(open(used, "rb").read()).hexdigest()
    assert report["expectations"]["file"] == {"path": used, "sha256": sha}
    assert report["expectations"]["defaults"]["sha256"] == hashlib.sha256(DEFAULTS_FILE.read_bytes()).hexdigest()
    assert f"expectations: {used} (sha256 {sha})" in summary and "CONFORMS" in summary


def test_failing_backend_exits_nonzero():
    report = run_conformance(ShapeBugBackend(), ["op"])
    assert not report.ok and "DOES NOT CONFORM" in report.summary()


@pytest.mark.parametrize("level, text", [("bogus", "unknown level 'bogus'"), ("", "no level given"),
                                         (",", "no level given"), (" , ,", "no level given")])
def test_empty_or_unknown_level_is_a_usage_error(level, text, capsys):
    assert main(["conformance", "--backend", "numpy", "--level", level]) == 2
    err = capsys.readouterr().err
    assert text in err and err.count("\n") == 1
    with pytest.raises(AiperfError, match=text):
        run_conformance(NumpyBackend(), level)
    with pytest.raises(AiperfError, match=text):
        conformance_cases(["numpy"], level)


def test_levels_in_kit_order_and_all():
    assert parse_levels("all") == list(LEVELS)
    assert parse_levels("count, op") == ["op", "count"]


def test_a_report_without_a_passing_check_is_never_ok():
    empty = Report("x", "1", ["op"])
    assert not empty.ok and not empty.certifies and "no check ran" in empty.verdict()
    only_xfail = Report("x", "1", ["count"], [CheckResult("count", "a/forward", "xfail")])
    assert not only_xfail.ok and "no check passed" in only_xfail.verdict()
    report = run_conformance(NumpyBackend(), ["count"])  # numpy: every count check is an expected failure
    # 6 on routed experts, 2 on each of the 4 networks and each of the 2 grouped convolutions
    assert not report.ok and report.counts()["xfail"] == len(catalogue(["count"], ("fp32",))) == 18
    assert main(["conformance", "--backend", "numpy", "--level", "count"]) == 1


def test_quick_run_is_marked_as_not_a_certification(tmp_path, capsys):
    assert main(["conformance", "--backend", "numpy", "--level", "op", "--quick", "--report",
                 str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("QUICK: NOT A CERTIFICATION")
    assert out.strip().splitlines()[-1].endswith("-- quick: not a certification (reduced sizes)")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["quick"] is True and report["ok"] is True and report["certifies"] is False
    assert "not a certification" in report["note"]


# -- expectations files ---------------------------------------------------------------------------


def write(tmp_path, data) -> str:
    path = tmp_path / "exp.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("data, text", [
    ({"xfails": []}, "unknown key 'xfails' in the top level"),
    ({"tolerance": {}}, "unknown key 'tolerance' in the top level"),
    ({"tolerances": {"op": 1e-3}}, "tolerances are given per precision"),
    ({"tolerances": {"fp64": {}}}, "unknown precision 'fp64'"),
    ({"tolerances": {"fp32": {"opp": {"value": 1, "reason": "r"}}}}, "unknown key 'opp' in tolerances.fp32"),
    ({"tolerances": {"bf16": {"morph": {"value": 1, "reason": "r"}}}}, "unknown key 'morph' in tolerances.bf16"),
    ({"tolerances": {"fp32": {"op": 1e-3}}}, "tolerances.fp32.op must be {\"value\""),
    ({"tolerances": {"fp32": {"op": {"value": 1e-3}}}}, "tolerances.fp32.op needs a 'reason'"),
    ({"tolerances": {"fp32": {"op": {"value": -1, "reason": "r"}}}}, "value must be a finite number >= 0"),
    ({"tolerances": {"fp32": {"op": {"value": 1, "reason": "r", "why": "x"}}}}, "unknown key 'why'"),
    ({"xfail": [{"check": "op/nonexistent/*", "reason": "r"}]}, "matches no check of the kit"),
    ({"xfail": [{"check": "op/conv 1x1", "reason": "r"}]}, "has characters no check id has"),
    ({"xfail": [{"check": "op/[conv*", "reason": "r"}]}, "unbalanced brackets"),
    ({"xfail": [{"check": "", "reason": "r"}]}, "non-empty check-id pattern"),
    ({"xfail": [{"check": "count/*", "reason": "r"}, {"check": "count/*", "reason": "s"}]}, "listed twice"),
    ({"xfail": [{"check": "count/*", "why": "r"}]}, "unknown key 'why' in xfail[0]"),
    ({"xfail": [{"check": "count/*"}]}, "xfail[0] (count/*) needs a 'reason'"),
    ({"xfail": {"check": "count/*"}}, "'xfail' must be a list"),
    ("{not json", "not valid JSON"),
    ("[]", "must hold a JSON object"),
])
def test_expectations_are_read_strictly(tmp_path, data, text):
    with pytest.raises(AiperfError) as caught:
        read_expectations(write(tmp_path, data), catalogue_ids())
    assert text in str(caught.value) and "exp.json" in str(caught.value)


def test_expectations_file_sets_tolerances_per_precision(tmp_path):
    path = write(tmp_path, {"about": "test", "tolerances": {"bf16": {"graph": {"value": 0.02, "reason": "ours"}}},
                            "xfail": [{"check": "op/*@bf16", "reason": "no bf16 yet"}]})
    exp = read_expectations(path, catalogue_ids())
    defaults, _ = load_defaults()
    assert exp.tolerance("graph", "bf16") == 0.02 and exp.tolerances["bf16"]["graph"].reason == "ours"
    assert exp.tolerance("graph") == defaults["fp32"]["graph"].value
    assert exp.xfail_reason("op/relu/forward@bf16") == "no bf16 yet" and exp.xfail_reason("op/relu/forward") is None


def test_every_default_tolerance_has_a_reason():
    table, source = load_defaults()
    for precision, keys in table.items():
        for key, tolerance in keys.items():
            assert len(tolerance.reason) > 40, (precision, key)
    assert source.path == str(DEFAULTS_FILE)
    # A mixed precision is never held to fp32's forward tolerance.
    assert table["bf16"]["op"].value > table["fp32"]["op"].value


def test_declared_conformance_file_must_exist(tmp_path, capsys):
    class Misdeclared(NumpyBackend):
        name = "misdeclared"

        def conformance_file(self):
            return str(tmp_path / "missing.json")

    with pytest.raises(AiperfError, match=r"conformance_file\(\) names .*missing.json, which does not exist"):
        load_expectations("misdeclared", Misdeclared())


def test_first_party_expectations_files_are_valid():
    for name in ("torch", "tensorflow", "jax", "mindspore"):
        assert load_expectations(name).file.path.endswith(f"data/{name}.json")


# -- precisions -----------------------------------------------------------------------------------


def test_every_declared_precision_is_checked_with_its_own_tolerance():
    backend = DeclaresBf16()
    report = run_conformance(backend, "op,morph")
    assert report.precisions == ["fp32", "bf16"]
    by_id = {r.id: r for r in report.results}
    fp32, bf16 = by_id["op/conv_1x1/forward"], by_id["op/conv_1x1/forward@bf16"]
    assert fp32.precision == "fp32" and bf16.precision == "bf16" and bf16.device == backend.devices()[0]
    assert bf16.tolerance == load_defaults()[0]["bf16"]["op"].value != fp32.tolerance
    assert "morph/deeper/preserves_function" in by_id and not any(i.startswith("morph/") and "@" in i for i in by_id)
    assert "  op       bf16" in report.summary()


def test_precision_option_checks_only_declared_ones(capsys):
    report = run_conformance(DeclaresBf16(), "op", precisions="bf16")
    assert {r.precision for r in report.results} == {"bf16"}
    assert main(["conformance", "--backend", "numpy", "--level", "op", "--precision", "bf16"]) == 2
    assert "does not declare 'bf16'" in capsys.readouterr().err
    assert main(["conformance", "--backend", "numpy", "--level", "op", "--precision", "fp8"]) == 2
    assert "unknown precision 'fp8'" in capsys.readouterr().err


def test_check_ids_say_the_precision():
    assert check_id("op", "relu/forward") == "op/relu/forward"
    assert check_id("op", "relu/forward", "bf16") == "op/relu/forward@bf16"
    ids = catalogue_ids()
    assert "train/digits_accuracy@fp16" in ids and "graph/resnet50_64px/outputs@tf32" in ids
    assert "count/resnet_small/forward" in ids and not any(i.startswith(("count/", "morph/", "parallel/"))
                                                           and "@" in i for i in ids)
    assert len(ids) == len(set(ids))


# -- native counters ------------------------------------------------------------------------------


def test_a_native_count_at_or_below_zero_is_never_a_match():
    results = results_for(NegativeCounter(), "count")
    bad = results["count/resnet_small/forward"]
    assert bad.status == "fail" and bad.measured == -53
    assert "the native counter returned -53 for a category with" in bad.message
    assert "never a match" in bad.message
    zero = results_for(ZeroCounter(), "count")["count/resnet_small/forward_backward"]
    assert zero.status == "fail" and "returned 0 for a category" in zero.message and "conv" in zero.message


def test_morph_count_delta_refuses_non_positive_counts():
    results = results_for(NegativeCounter(), "morph")
    bad = results["morph/deeper/count_delta"]
    assert bad.status == "fail" and "parent forward conv: the native counter returned -53" in bad.message
    assert results["morph/deeper/preserves_function"].status == "pass"


class XlaLikeCounter(NativeCounter):
    """Counts as XLA does: padded taps skipped ('valid'), every one of attention's S x S scores counted
    ('paper'), from opcount itself, so only the declared convention decides the check."""

    def __init__(self, attention):
        self.convention = CounterConvention(mac_ops=2, padding="valid", covers=("conv", "dense", "attention"),
                                            attention=attention)

    def count(self, model, batch, backward):
        out = {}
        for category in self.convention.covers:
            rule = "paper" if category == "attention" else "valid"
            counted = aiperf_opcount.count(model.graph, rule).by_category().get(category, {"fp": 0, "bp": 0})
            out[category] = batch * (counted["fp"] + (counted["bp"] if backward else 0))
        return out


class XlaLikeBackend(NumpyBackend):
    name = "xlalike"

    def __init__(self, attention=None):
        self.attention = attention

    def native_counter(self):
        return XlaLikeCounter(self.attention)


def test_a_counter_declares_attention_apart_from_padding_and_the_kit_compares_each_so():
    assert CounterConvention(2, "valid", ("conv",), attention="paper").convention_for("conv") == "valid"
    assert CounterConvention(2, "valid", ("conv",)).convention_for("attention") == "valid"
    declared = results_for(XlaLikeBackend(attention="paper"), "count")
    assert {i: r.status for i, r in declared.items() if i.startswith("count/gpt/")} == {
        "count/gpt/forward": "pass", "count/gpt/forward_backward": "pass"}
    assert "attention" in declared["count/gpt/forward"].message
    # The same counts under a convention that claims attention follows 'valid' padding: the causal
    # mask's S(S+1)/2 pairs against every score, a failure that names the rule.
    undeclared = results_for(XlaLikeBackend(), "count")["count/gpt/forward"]
    assert undeclared.status == "fail" and "attention" in undeclared.message and "analytic (valid)" in undeclared.message


class RecordingCounter(XlaLikeCounter):
    """XlaLikeCounter that records the graph (as JSON) and pass of every count it is asked for."""

    def __init__(self):
        super().__init__("paper")
        self.asked = []

    def count(self, model, batch, backward):
        self.asked.append((model.graph.to_json(indent=None), backward))
        return super().count(model, batch, backward)


class RecordingBackend(NumpyBackend):
    name = "recording"

    def __init__(self):
        self.counter = RecordingCounter()

    def native_counter(self):
        return self.counter


def test_a_kit_run_counts_each_graph_natively_once_with_the_results_of_counting_it_each_time():
    # One kit run of the morph and count levels: a morph family's parent and the count level's GPT and
    # Llama (the morph level's parents) are counted once, each other graph once per pass.
    backend = RecordingBackend()
    ctx = Context(backend, Expectations(), device=backend.devices()[0])
    checks = collect(ctx, ["morph", "count"])
    shared = {c.id: run_check(ctx, c) for c in checks}
    asked = backend.counter.asked
    assert len(asked) == len(set(asked))
    morphs = [c for c in checks if c.id.startswith("morph/") and c.id.endswith("/count_delta")]
    assert len(asked) < sum(c.level == "count" for c in checks) + 4 * len(morphs)  # 2 graphs x 2 passes a morph
    # Each check on its own context (a kit run of that check alone, which counts every graph it needs) has
    # the same status, figures and message.
    for check in checks:
        alone = RecordingBackend()
        result = run_check(Context(alone, Expectations(), device=alone.devices()[0]), check)
        assert (result.status, result.measured, result.expected, result.message) == (
            shared[check.id].status, shared[check.id].measured, shared[check.id].expected, shared[check.id].message)
    assert all(shared[c.id].status == "pass" for c in morphs), {c.id: shared[c.id].message for c in morphs}


# -- listing --------------------------------------------------------------------------------------


def test_list_prints_every_check_with_level_precision_and_counter(capsys):
    assert main(["conformance", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["check", "id", "level", "precision", "workload", "native", "counter"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert set(rows) == set(catalogue_ids())
    assert rows["count/resnet50_64px/forward"] == ["count", "fp32", "cnn", "needed"]
    assert rows["op/relu/forward@bf16"] == ["op", "bf16", "cnn", "-"]
    assert rows["op/attention_causal/backward@bf16"] == ["op", "bf16", "lm", "-"]
    assert rows["count/gpt/forward_backward"] == ["count", "fp32", "lm", "needed"]
    assert rows["count/conv_grouped_strided/forward_backward"] == ["count", "fp32", "ir", "needed"]
    assert rows["graph/onnx_zoo/shufflenet@fp16"] == ["graph", "fp16", "ir", "-"]
    assert main(["conformance", "--list", "--json", "--backend", "numpy"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {r["precision"] for r in listed} == {"fp32"}
    assert "parallel/refuses_two_devices" in {r["id"] for r in listed}
    assert "parallel/matches_one_device" not in {r["id"] for r in listed}
    # count: 4 graphs x 2, 2 grouped convolutions x 2 and 3 moe cases x 2; morph: 4 CNN, 5 GPT, 5 Llama
    assert sum(r["needs_native_counter"] for r in listed) == 32
    assert rows["op/attention_grouped_query/backward@bf16"] == ["op", "bf16", "lm", "-"]
    assert {"rms_norm", "rotary", "silu", "mul", "grouped_query_attention"} <= set(
        by_id_ops(listed, "train/llama_gradients_match_reference"))
    by_id = {r["id"]: r for r in listed}
    assert by_id["train/gpt_gradients_match_reference"]["workload"] == "lm"
    assert {"attention", "embedding", "gelu", "layer_norm"} <= set(by_id["train/gpt_gradients_match_reference"]["ops"])
    assert by_id["op/conv_grouped/forward"]["ops"] == ["grouped_conv2d"]
    assert by_id["count/conv_depthwise_multiplier2/forward"]["ops"] == ["grouped_conv2d"]
    assert by_id["train/digits_accuracy"]["ops"] == []
    # 5 data-parallel (one of them the GPT's), the expert-parallel check or its refusal, 2 single-device,
    # and across nodes: the CNN's and the GPT's, the expert-parallel one, or the refusal
    assert len(catalogue(["parallel"])) == 13
    assert rows["parallel/multi_node_matches_one_device"] == ["parallel", "fp32", "cnn", "-"]
    assert rows["parallel/gpt_multi_node_matches_one_device"] == ["parallel", "fp32", "lm", "-"]
    assert rows["parallel/multi_node_expert_parallel_matches_one_device"] == ["parallel", "fp32", "lm", "-"]
    assert rows["parallel/multi_node_refused"] == ["parallel", "fp32", "cnn", "-"]
    assert rows["parallel/gpt_matches_one_device"] == ["parallel", "fp32", "lm", "-"]
    assert rows["parallel/gpt_moe_expert_parallel_matches_one_device"] == ["parallel", "fp32", "lm", "-"]
    assert rows["parallel/gpt_moe_expert_parallel_refused"] == ["parallel", "fp32", "lm", "-"]
    assert by_id["train/gpt_adamw_matches_reference"]["workload"] == "lm"


def test_plugin_discovered_from_its_own_package():
    info = {i.name: i for i in list_backends()}["numpy"]
    assert info.available and info.module == "aiperf_numpy.backend:NumpyBackend"
    assert info.distribution == "aiperf-numpy"
    assert np.__version__ in info.version


def by_id_ops(listed, check_id: str) -> list:
    return next(r["ops"] for r in listed if r["id"] == check_id)


def test_the_session_report_is_the_cli_report_once_every_check_ran(monkeypatch):
    """pytest_support.session_report (what test_submission_e2e submits): the report `aiperf conformance`
    writes, made of the session's results, and none while one check has not run (here the kit's levels
    are the op level alone, so that the session's checks are few)."""
    from aiperf_conformance import pytest_support

    monkeypatch.setattr(pytest_support, "LEVELS", ("op",))
    monkeypatch.setattr(pytest_support, "_contexts", {})
    monkeypatch.setattr(pytest_support, "_results", {})
    assert pytest_support.session_report("numpy") is None
    cases = conformance_cases(["numpy"], "op")
    for case in cases[:-1]:
        pytest_support.run_case(case)
    assert pytest_support.session_report("numpy") is None
    pytest_support.run_case(cases[-1])
    session = pytest_support.session_report("numpy").to_dict()
    cli = run_conformance(NumpyBackend(), "op").to_dict()
    for report in (session, cli):
        for check in report["checks"]:
            check.pop("seconds")
    assert session == cli and session["certifies"] and len(session["checks"]) == len(cases)
