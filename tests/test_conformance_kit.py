"""The kit itself: it catches a wrong backend, names the node, and reports machine-readably."""

import json

import numpy as np

from aiperf_core.cli import main
from aiperf_core.registry import list_backends
from aiperf_numpy.backend import NumpyBackend
from aiperf_conformance.expectations import Expectations
from aiperf_conformance.kit import Context, collect, run_check, run_conformance


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


def results_for(backend, level, expectations=None):
    ctx = Context(backend, expectations or Expectations())
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
    assert "update the data file" in results["op/relu/forward"].message


def test_expected_failure_counts_as_xfail():
    exp = Expectations(xfail={"op/conv_3x3_same/forward": "known channel bug"})
    results = results_for(ShapeBugBackend(), "op", exp)
    assert results["op/conv_3x3_same/forward"].status == "xfail"


def test_report_json_and_exit_status(tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert main(["conformance", "--backend", "numpy", "--level", "op,graph", "--report", str(report_path)]) == 0
    summary = capsys.readouterr().out
    assert "CONFORMS" in summary
    report = json.loads(report_path.read_text())
    assert report["ok"] is True and report["backend"] == "numpy"
    check = report["checks"][0]
    assert {"level", "name", "status", "measured", "expected", "tolerance", "message", "id"} <= set(check)
    assert {c["level"] for c in report["checks"]} == {"op", "graph"}


def test_failing_backend_exits_nonzero():
    report = run_conformance(ShapeBugBackend(), ["op"])
    assert not report.ok and "DOES NOT CONFORM" in report.summary()


def test_bad_level_is_one_line(capsys):
    assert main(["conformance", "--backend", "numpy", "--level", "bogus"]) == 2
    assert "unknown level 'bogus'" in capsys.readouterr().err


def test_plugin_discovered_from_its_own_package():
    info = {i.name: i for i in list_backends()}["numpy"]
    assert info.available and info.module == "aiperf_numpy.backend:NumpyBackend"
    assert np.__version__ in info.version
