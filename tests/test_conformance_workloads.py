"""The kit's workloads: a check needs IR ops and certifies a workload (cnn, lm, or ir for the model-zoo
ops); where the backend does not declare an op it is 'unsupported', never a pass, and a plugin that
lowers only the CNN ops still certifies for the CNN workload. Also: the op cases cover every new op,
the model-zoo table of ops is true, the ReferenceEvaluator's outputs are cached on disk, and the
reviewer's check reads per-workload certification (an old report without workloads is CNN-only)."""

import contextlib
import json

import numpy as np
import pytest
import scipy.special
from onnx import TensorProto, helper, numpy_helper

from aiperf_core.builders import gpt
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError, GraphError
from aiperf_core.ir import ALL_OPS, VERSION_1_OPS, lowering_need
from aiperf_core.submission.check import check_submission
from aiperf_numpy import executor
from aiperf_numpy.backend import NumpyBackend
from aiperf_conformance.cases import OP_CASES
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import LEVELS, Context, catalogue, collect, new_ops, run_check, run_conformance
from aiperf_conformance.levels import graph as graph_level
from aiperf_conformance.results import CheckResult, Report
from test_submission import inputs, kit_report, members, package, repack, run_dir  # noqa: F401 (fixtures)


SHIPPED = graph_level.SHIPPED_ZOO_REFERENCES
LM_NEEDS = {"token_input", "sequence_input", "embedding", "position_embedding", "layer_norm", "gelu", "attention"}


class CnnOnly(NumpyBackend):
    """A plugin written before the sequence ops: it declares the CNN ops of the IR's first version."""

    name = "cnnonly"

    def supported_ops(self):
        return VERSION_1_OPS


def test_a_cnn_only_backend_conforms_for_the_cnn_workload_and_reports_the_rest_unsupported():
    report = run_conformance(CnnOnly(), ["op"])
    by_id = {r.id: r for r in report.results}
    assert report.ok and report.certifies
    assert report.workloads() == {"cnn": True, "lm": False}
    assert {r.status for r in report.results if r.workload == "cnn"} == {"pass"}
    lm = [r for r in report.results if r.workload == "lm"]
    assert lm and {r.status for r in lm} == {"unsupported"}
    attention = by_id["op/attention_causal/backward"]
    assert attention.missing_ops == ["attention", "sequence_input"]
    assert "does not lower attention, sequence_input" in attention.message
    assert by_id["op/dense_sequence/forward"].missing_ops == ["sequence_input"]  # dense over (S, D)
    assert attention.seconds == 0.0  # never ran
    assert by_id["op/conv_grouped/forward"].status == "unsupported"
    assert by_id["op/conv_grouped/forward"].missing_ops == ["grouped_conv2d"]
    counts = report.counts()
    unsupported = counts["unsupported"]
    assert unsupported == len(lm) + sum(r.workload == "ir" for r in report.results)
    assert report.verdict() == (f"CONFORMS: {counts['pass']} passed, 0 failed, 0 expected failures (workloads "
                                f"certified: cnn; unsupported: {unsupported} checks of lm, ir)")
    data = report.to_dict()
    assert data["workloads"] == {"cnn": True, "lm": False} and data["counts"]["unsupported"] == unsupported
    assert "unsupported: " in report.summary() and "attention, embedding, gelu" in report.summary()


def test_every_transformer_check_of_every_level_is_unsupported_on_a_cnn_only_backend():
    backend = CnnOnly()
    ctx = Context(backend, Expectations(), device=backend.devices()[0], precisions=("fp32",))
    lm = [c for c in collect(ctx, LEVELS) if c.workload == "lm"]
    assert {c.level for c in lm} == {"op", "graph", "train", "count", "morph"}
    for check in lm:
        result = run_check(ctx, check)
        assert result.status == "unsupported" and result.workload == "lm", check.id


def test_a_cnn_only_backend_refuses_to_lower_what_it_does_not_declare():
    with pytest.raises(GraphError, match="does not lower 'token_input'") as caught:
        CnnOnly().lower(gpt(2, 32, 4, 16, 64))
    assert caught.value.node == "tokens"
    sequence = next(c for c in OP_CASES if c.name == "dense_sequence").graph()
    with pytest.raises(GraphError, match="does not lower 'sequence_input'"):
        CnnOnly().lower(sequence)
    grouped = next(c for c in OP_CASES if c.name == "conv_grouped").graph()
    with pytest.raises(GraphError, match="does not lower 'grouped_conv2d'"):
        CnnOnly().lower(grouped)


def test_the_cli_exits_0_for_a_cnn_only_backend(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(NumpyBackend, "supported_ops", lambda self: VERSION_1_OPS)
    path = tmp_path / "kit.json"
    assert main(["conformance", "--backend", "numpy", "--level", "op", "--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "CONFORMS" in out and "(workloads certified: cnn; unsupported:" in out
    report = json.loads(path.read_text())
    assert report["certifies"] is True and report["workloads"] == {"cnn": True, "lm": False}


def test_a_backend_that_lowers_every_op_certifies_both_workloads():
    report = run_conformance(NumpyBackend(), ["op"])
    assert report.workloads() == {"cnn": True, "lm": True} and report.counts()["unsupported"] == 0
    assert report.verdict().endswith("(workloads certified: cnn, lm)")


def test_workload_runs_only_its_checks_and_leaves_the_others_uncertified(tmp_path, capsys):
    report = run_conformance(NumpyBackend(), ["op"], workloads="cnn")
    assert report.results and {r.workload for r in report.results} == {"cnn"}
    assert report.workload_scope == ["cnn"] and report.workloads() == {"cnn": True, "lm": False}
    assert report.verdict().endswith("(workloads certified: cnn; not run (--workload): lm, ir)")
    path = tmp_path / "kit.json"
    assert main(["conformance", "--backend", "numpy", "--level", "op", "--workload", "lm,ir",
                 "--report", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["workload_scope"] == ["lm", "ir"] and {c["workload"] for c in data["checks"]} == {"lm", "ir"}
    assert data["workloads"] == {"cnn": False, "lm": True}
    capsys.readouterr()
    assert main(["conformance", "--list", "--json", "--level", "op", "--workload", "lm"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed and {c["workload"] for c in listed} == {"lm"}


@pytest.mark.parametrize("text", ["vision", "cnn,,moe", ","])
def test_an_unknown_or_empty_workload_is_one_line_and_exit_2(text, capsys):
    assert main(["conformance", "--backend", "numpy", "--workload", text]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aiperf: error: --workload:") and "\n" not in err and "cnn, lm, ir" in err


class Mutant(NumpyBackend):
    """The NumPy reference with one op's forward replaced while it runs as the backend under test (the
    reference the kit compares with stays right): the mistakes a lowering of the transformer ops makes.
    Its backward is not the op's any more, so only forward checks are asserted to fail."""

    name = "mutant"

    def __init__(self, op, forward):
        self.op, self.forward = op, forward

    @contextlib.contextmanager
    def _mutated(self):
        original = executor._FORWARD[self.op]
        executor._FORWARD[self.op] = self.forward
        try:
            yield
        finally:
            executor._FORWARD[self.op] = original

    def predict_checked(self, model, x):
        with self._mutated():
            return super().predict_checked(model, x)

    def loss_and_grads_checked(self, model, x, labels, label_smoothing):
        with self._mutated():
            return super().loss_and_grads_checked(model, x, labels, label_smoothing)


def _erf_gelu(node, inputs, params, ctx):
    (x,) = inputs
    return 0.5 * x * (1.0 + scipy.special.erf(x / np.sqrt(2.0))), None


def _unbiased_layer_norm(node, inputs, params, ctx):
    (x,) = inputs
    centred = x - x.mean(axis=-1, keepdims=True)
    xhat = centred / np.sqrt(np.square(centred).sum(axis=-1, keepdims=True) / (x.shape[-1] - 1) + node.attrs["epsilon"])
    return xhat * params["gamma"] + params["beta"], None


def _attention_with(causal=None, interleaved=False, scaled=True):
    def attention(node, inputs, params, ctx):
        a = node.attrs
        n, s, width = inputs[0].shape
        if interleaved:  # head h = features h, h + A, h + 2A, ...: the reshape (N, S, d, A) read the wrong way
            q, k, v = (t.reshape(n, s, width // a["heads"], a["heads"]).transpose(0, 3, 1, 2) for t in inputs)
        else:
            q, k, v = (t.reshape(n, s, a["heads"], width // a["heads"]).transpose(0, 2, 1, 3) for t in inputs)
        scores = q @ k.swapaxes(-1, -2) / (np.sqrt(a["head_dim"]) if scaled else 1.0)
        if a["causal"] if causal is None else causal:
            scores = np.where(np.tri(s, dtype=bool), scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out = (p / p.sum(axis=-1, keepdims=True)) @ v
        if interleaved:
            return out.transpose(0, 2, 3, 1).reshape(n, s, width), None
        return out.transpose(0, 2, 1, 3).reshape(n, s, width), None
    return attention


class LossPerSequence(NumpyBackend):
    """Averages a per-position loss over the N sequences instead of the N*S labels."""

    name = "losspersequence"

    def loss_and_grads_checked(self, model, x, labels, label_smoothing):
        loss, grads = super().loss_and_grads_checked(model, x, labels, label_smoothing)
        positions = labels.size // len(labels)
        return loss * positions, {n: {p: g * positions for p, g in ps.items()} for n, ps in grads.items()}


@pytest.mark.parametrize("backend, failing, passing", [
    (Mutant("gelu", _erf_gelu), ["op/gelu_tanh_form/forward"], ["op/layer_norm/forward"]),
    (Mutant("layer_norm", _unbiased_layer_norm), ["op/layer_norm/forward"], ["op/gelu/forward"]),
    (Mutant("attention", _attention_with(causal=False)), ["op/attention_causal/forward"],
     ["op/attention_full/forward"]),
    (Mutant("attention", _attention_with(causal=True)), ["op/attention_full/forward"],
     ["op/attention_causal/forward"]),
    (Mutant("attention", _attention_with(interleaved=True)),
     ["op/attention_causal/forward", "op/attention_full/forward"], ["op/gelu/forward"]),
    (Mutant("attention", _attention_with(scaled=False)),
     ["op/attention_causal/forward", "op/attention_full/forward"], ["op/gelu/forward"]),
    (LossPerSequence(), ["op/dense_sequence/backward", "op/softmax_per_position/backward"],
     ["op/dense/backward", "op/dense_sequence/forward"]),
], ids=["erf_gelu", "unbiased_layer_norm", "mask_ignored", "mask_everywhere", "heads_interleaved",
        "scores_unscaled", "loss_per_sequence"])
def test_the_op_level_catches_each_transformer_semantics_error_at_fp32(backend, failing, passing):
    ctx = Context(backend, Expectations(), device=backend.devices()[0], precisions=("fp32",))
    results = {c.id: run_check(ctx, c) for c in collect(ctx, ["op"]) if c.id in failing + passing}
    assert {i: results[i].status for i in failing} == {i: "fail" for i in failing}, \
        {i: results[i].message for i in failing}
    assert {i: results[i].status for i in passing} == {i: "pass" for i in passing}


def _result(workload, status):
    return CheckResult("op", f"{workload}-{status}", status, workload=workload)


@pytest.mark.parametrize("statuses, quick, expected", [
    ([("cnn", "pass"), ("lm", "pass")], False, {"cnn": True, "lm": True}),
    ([("cnn", "pass"), ("lm", "unsupported")], False, {"cnn": True, "lm": False}),
    ([("cnn", "pass"), ("lm", "pass"), ("ir", "unsupported")], False, {"cnn": True, "lm": True}),
    ([("cnn", "pass"), ("lm", "pass"), ("cnn", "unsupported")], False, {"cnn": False, "lm": True}),
    ([("cnn", "pass")], False, {"cnn": True, "lm": False}),  # no lm check ran
    ([("cnn", "pass"), ("lm", "pass"), ("lm", "fail")], False, {"cnn": False, "lm": False}),
    ([("cnn", "pass"), ("lm", "pass")], True, {"cnn": False, "lm": False}),
    ([("cnn", "xfail"), ("lm", "pass")], False, {"cnn": True, "lm": True}),
])
def test_a_workload_is_certified_when_the_report_certifies_and_all_its_checks_ran(statuses, quick, expected):
    report = Report("x", "1", ["op"], [_result(w, s) for w, s in statuses], quick=quick)
    assert report.workloads() == expected
    assert "unsupported" not in report.verdict() or any(s == "unsupported" for _, s in statuses)


def test_every_check_that_needs_a_new_op_says_so():
    """A check tagged lm or ir must need an op beyond the CNN ones, or a CNN-only backend would run it."""
    for check in catalogue(precisions=("fp32",)):
        assert check.workload in ("cnn", "lm", "ir") and check.ops <= ALL_OPS - VERSION_1_OPS, check.id
        if check.workload == "lm" or (check.workload == "ir" and check.level == "op"):
            assert check.ops, check.id
        if check.workload == "cnn":
            assert not check.ops, check.id
    zoo = {c.name: c for c in catalogue(["graph"], ("fp32",)) if c.name.startswith("onnx_zoo/")}
    assert {c.workload for c in zoo.values()} == {"ir"} and len(zoo) == 9
    assert not zoo["onnx_zoo/resnet50"].ops and zoo["onnx_zoo/shufflenet"].ops == {"avg_pool", "channel_shuffle",
                                                                                    "grouped_conv2d"}


def test_every_new_op_has_forward_and_backward_cases():
    names = {c.id for c in catalogue(["op"], ("fp32",))}
    covered: dict[str, set[str]] = {}
    for case in OP_CASES:
        need = lowering_need(case.graph()["op"])
        covered.setdefault(need, set()).add(case.name)
        if need not in VERSION_1_OPS or case.workload == "lm":
            assert f"op/{case.name}/forward" in names and f"op/{case.name}/backward" in names
            assert case.workload == ("lm" if new_ops(case.graph()) & LM_NEEDS else "ir"), case.name
    assert ALL_OPS - {"input", "token_input", "sequence_input"} <= set(covered)
    causal = {case.graph()["op"].attrs["causal"] for case in OP_CASES if case.graph()["op"].op == "attention"}
    assert causal == {True, False}
    pools = {case.graph()["op"].attrs["count_padding"] for case in OP_CASES if case.graph()["op"].op == "avg_pool"}
    assert pools == {True, False}
    for op in ("mul_const", "add_const"):
        assert {case.graph()["op"].attrs["per_channel"] for case in OP_CASES
                if case.graph()["op"].op == op} == {True, False}
    sequence = {case.name for case in OP_CASES if case.workload == "lm"}
    assert {"dense_sequence", "softmax_per_position"} <= sequence


def test_a_sequence_case_is_checked_per_position():
    case = next(c for c in OP_CASES if c.name == "layer_norm")
    head = case.with_head()
    assert head.output_shape == (5, 3) and head["head_dense"].inputs == ("op",)
    embedding = next(c for c in OP_CASES if c.name == "embedding")
    assert embedding.graph().takes_tokens


def test_the_quick_zoo_still_needs_every_model_zoo_op():
    every = set().union(*(graph_level.zoo_ops(n) for n in graph_level.ZOO))
    assert set().union(*(graph_level.zoo_ops(n) for n in graph_level.ZOO_QUICK)) == every
    assert every == {"lrn", "grouped_conv2d", "avg_pool", "mul_const", "add_const", "channel_shuffle"}


@pytest.mark.slow
@pytest.mark.parametrize("name", graph_level.ZOO)
def test_the_zoo_table_names_the_ops_each_model_imports_to(name):
    graph, _, x, expected = graph_level._zoo_model(name)  # as the kit runs it: once per process
    assert {lowering_need(n) for n in graph.nodes} - VERSION_1_OPS == graph_level.zoo_ops(name)
    # Batch norms set to their inputs' statistics keep the logits far inside fp16's range (65,504), which
    # random statistics left (resnet50's reached 1.3e5, shufflenet's 3e6), and not degenerate.
    assert np.all(np.isfinite(expected)) and np.abs(expected).max() < 1000 and expected.std() > 0.1
    assert x.shape == (1, 224, 224, 3) and graph.input_shape == (224, 224, 3)
    # The kit ships this model's reference output under the key it is made with here (else every fresh
    # machine computes it: regenerate with AIPERF_CONFORMANCE_CACHE=conformance/data/zoo_reference).
    shipped = graph_level.SHIPPED_ZOO_REFERENCES / graph_level.zoo_reference_files[name]
    assert shipped.is_file(), f"{shipped.name} is not shipped: the key changed (onnx, the seed or the evaluator)"
    assert np.array_equal(np.load(shipped), expected)


def test_batch_norm_statistics_find_their_channels_even_among_equal_random_values():
    onnx_values = np.array([0.5, 0.7, 0.5, 0.9], np.float32)  # two draws alike, as densenet121 has
    assert list(graph_level._order(onnx_values, onnx_values.copy(), "m")) == [0, 1, 2, 3]
    shuffled = onnx_values[[3, 0, 1, 2]]
    order = graph_level._order(onnx_values, shuffled, "m")
    assert sorted(order) == [0, 1, 2, 3] and np.array_equal(onnx_values[order], shuffled)
    with pytest.raises(AiperfError, match="m: its batch-norm statistics are not a permutation"):
        graph_level._order(onnx_values, np.array([0.5, 0.5, 0.5, 0.9], np.float32), "m")


def test_a_shipped_reference_output_is_the_reference_evaluators(monkeypatch, tmp_path):
    """squeezenet's (the quickest to evaluate, 1.2 million weights), recomputed by ReferenceEvaluator."""
    monkeypatch.setattr(graph_level, "SHIPPED_ZOO_REFERENCES", tmp_path / "none")
    monkeypatch.setenv("AIPERF_CONFORMANCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(graph_level, "_zoo_cache", {})
    monkeypatch.setattr(graph_level, "zoo_reference_files", {})
    _, _, _, computed = graph_level._zoo_model("squeezenet")
    name = graph_level.zoo_reference_files["squeezenet"]
    assert (tmp_path / "cache" / name).is_file()  # it was computed, not read
    # ReferenceEvaluator computes in float32 through numpy's BLAS, whose kernels differ by CPU: the
    # outputs shipped from one machine (AMD Zen 5) and recomputed on another (an Intel Xeon with AMX)
    # differ by float32 rounding (2.9e-6 at most here), never by more.
    shipped = np.load(SHIPPED / name)
    np.testing.assert_allclose(shipped, computed, rtol=0, atol=1e-5 * float(np.abs(shipped).max()))


def _tiny_model(seed):
    rng = np.random.default_rng(seed)
    kernel = numpy_helper.from_array(rng.normal(0, 1, (2, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])], "tiny",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 5, 5])], [kernel])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_the_reference_evaluator_outputs_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("AIPERF_CONFORMANCE_CACHE", str(tmp_path / "cache"))
    model, x = _tiny_model(1), np.random.default_rng(2).uniform(0, 1, (1, 3, 5, 5)).astype(np.float32)
    first = graph_level.zoo_reference("tiny", model, x)
    files = list((tmp_path / "cache").iterdir())
    assert len(files) == 1 and files[0].suffix == ".npy"  # no temporary file left
    assert first.dtype == np.float64 and first.shape == (1, 2, 5, 5)

    def no_evaluation(self, *args, **kwargs):
        raise AssertionError("the evaluator ran although the cache holds its output")

    monkeypatch.setattr("onnx.reference.ReferenceEvaluator.run", no_evaluation)
    assert np.array_equal(graph_level.zoo_reference("tiny", model, x), first)
    with pytest.raises(AssertionError, match="the evaluator ran"):  # other weights: another key
        graph_level.zoo_reference("tiny", _tiny_model(3), x)
    with pytest.raises(AssertionError, match="the evaluator ran"):  # another input: another key
        graph_level.zoo_reference("tiny", model, x + 1)


def test_an_unreadable_cache_entry_is_computed_anew(monkeypatch, tmp_path):
    monkeypatch.setenv("AIPERF_CONFORMANCE_CACHE", str(tmp_path))
    model, x = _tiny_model(1), np.ones((1, 3, 5, 5), np.float32)
    expected = graph_level.zoo_reference("tiny", model, x)
    (entry,) = tmp_path.iterdir()
    entry.write_bytes(b"not an npy file")
    assert np.array_equal(graph_level.zoo_reference("tiny", model, x), expected)
    assert np.array_equal(np.load(entry), expected)


# -- the reviewer's check ---------------------------------------------------------------------------


def _with_checks(report, workload, status):
    report["checks"] = report["checks"] + [{"level": "op", "name": f"extra_{workload}", "status": status,
                                            "precision": p, "workload": workload} for p in report["precisions"]]
    return report


def test_a_cnn_run_accepts_a_report_whose_transformer_checks_are_unsupported(package, tmp_path):  # noqa: F811
    files = members(package)
    files["conformance/1.json"] = json.dumps(_with_checks(kit_report(), "lm", "unsupported")).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert verdict.accepted, verdict.rejections


def test_a_cnn_run_refuses_a_report_whose_cnn_checks_are_unsupported(package, tmp_path):  # noqa: F811
    files = members(package)
    files["conformance/1.json"] = json.dumps(_with_checks(kit_report(), "cnn", "unsupported")).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted
    assert any("the cnn workload is not certified" in r for r in verdict.rejections), verdict.rejections


def test_a_cnn_run_refuses_a_report_that_left_out_the_cnn_checks(package, tmp_path):  # noqa: F811
    files = members(package)
    lm_only = kit_report(workload_scope=["lm"])
    lm_only["checks"] = [dict(c, workload="lm") for c in lm_only["checks"]]
    files["conformance/1.json"] = json.dumps(lm_only).encode()
    repack(files, tmp_path / "t.tar.gz")
    rejections = check_submission(tmp_path / "t.tar.gz").rejections
    assert any("the cnn workload was not checked (--workload lm)" in r for r in rejections), rejections
    assert any("no cnn check at levels: op, graph, morph, train, count, parallel" in r for r in rejections)
    cnn = kit_report(workload_scope=["cnn"])
    files["conformance/1.json"] = json.dumps(cnn).encode()
    repack(files, tmp_path / "t.tar.gz")
    assert check_submission(tmp_path / "t.tar.gz").accepted


def test_a_report_from_before_workloads_is_read_as_cnn_only(package, tmp_path):  # noqa: F811
    old = kit_report()
    assert all("workload" not in c for c in old["checks"]) and "workloads" not in old
    files = members(package)
    files["conformance/1.json"] = json.dumps(old).encode()
    repack(files, tmp_path / "t.tar.gz")
    assert check_submission(tmp_path / "t.tar.gz").accepted
    old["checks"].append({"level": "op", "name": "y", "status": "unsupported", "precision": "fp32"})
    files["conformance/1.json"] = json.dumps(old).encode()
    repack(files, tmp_path / "t.tar.gz")
    assert any("the cnn workload is not certified" in r for r in check_submission(tmp_path / "t.tar.gz").rejections)
