"""A fraction of the peak never exceeds 1 (issue 51): the GEMM peak a benchmark divides by is measured
between its timed steps, on the model's own shapes beside a square one (benchmarks/_common.py's
InterleavedPeak, benchmarks/transformer_step.py); a utilisation above 1 is printed as a failed
measurement, the peak under-measured, never a met goal; the utilisation is printed in the paper's
convention and the valid one; `aiperf peak` records the spread of its repeats and warns above 10%;
the check flags a result whose efficiency against its measured peak exceeds 1, and the list says
so beside such an efficiency. Every backend times rectangular products (Backend.matmul_seconds with
a shape)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from aiperf_core.backend import BackendError, matmul_shape
from aiperf_core.cli import main
from aiperf_core.submission import SubmissionError
from aiperf_core.submission import peak as peak_module
from aiperf_core.submission.check import check_submission
from aiperf_core.submission.peak import SPREAD_WARNING, load_peak, measure_peak, spread_warnings, validate_peak
from aiperf_core.submission.ranking import rank, render_text
from aiperf_numpy.backend import NumpyBackend
from test_ranking import verdict as ranking_verdict
from test_submission import CPU, inputs, members, package, repack, run_dir  # noqa: F401 (fixtures)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _common  # noqa: E402
import transformer_step  # noqa: E402


class PeakBackend:
    """A backend whose products run at `rate` operations per second (times reported, not slept),
    recording each call in `calls` (shared with the steps, to see the order)."""

    name = "fake"

    def __init__(self, rate: float, calls: list | None = None, model: str = CPU, jitter: float = 0.0):
        self.rate, self.calls, self.model, self.jitter = rate, calls if calls is not None else [], model, jitter

    def devices(self):
        return ["cpu"]

    def precisions(self, device):
        return ("fp32", "bf16", "fp16")

    def framework_version(self):
        return "1.0"

    def device_model(self, device):
        return self.model

    def matmul_seconds(self, device, precision, size, repeats):
        m, k, n = matmul_shape(size)
        self.calls.append(("product", (m, k, n)))
        seconds = 2 * m * k * n / self.rate
        return [seconds * (1 + self.jitter * (i % 2)) for i in range(repeats)]


def fake_pair(rate: float, calls: list) -> transformer_step.Pair:
    return transformer_step.Pair(PeakBackend(rate, calls), "cpu", "fp32", "fake backend",
                                 lambda: calls.append(("step", "lowered")),
                                 {"hand": lambda: calls.append(("step", "hand"))}, lambda: 1000)


OPS = {"paper": 10 ** 9, "valid": 9 * 10 ** 8}
SHAPES = {"8x8": (8, 8, 8), "mlp": (16, 8, 32)}


# -- the benchmark -----------------------------------------------------------------------------------
def test_a_peak_probe_below_the_achieved_rate_is_a_failed_measurement(capsys):
    """The acceptance test's first half: the fake backend's products run at 1 Mops/s, its steps (no
    work at all) achieve far more: the utilisation is above 1 in both conventions, printed as a
    failed measurement (the peak under-measured), its row not met, never "goal met", and the script's
    failures name it."""
    failures = transformer_step.bench_pair("fake", fake_pair(1e6, []), OPS, batch=1, warmup=1, steps=2,
                                           shapes=SHAPES, goal=0.5, parameters=1000)
    out = capsys.readouterr().out
    assert len(failures) == 2 and all("above 1" in f and "peak under-measured" in f for f in failures), failures
    assert not any("goal met" in line for line in out.splitlines() if "utilisation" in line)
    rows = [json.loads(line[len("BENCH "):]) for line in out.splitlines() if line.startswith("BENCH ")]
    utilisation = {row["name"]: row for row in rows if "utilisation" in row["name"]}
    assert set(utilisation) == {"fake gpt model-FLOP utilisation (paper)", "fake gpt model-FLOP utilisation (valid)"}
    for row in utilisation.values():
        assert row["value"] > 1 and row["met"] is False and row["failed"] == "peak under-measured"
    assert sum("FAILED MEASUREMENT: above 1, the peak under-measured" in line for line in out.splitlines()) == 2


def test_the_peak_is_probed_between_the_steps_and_both_conventions_are_printed(capsys):
    calls = []
    failures = transformer_step.bench_pair("fake", fake_pair(1e18, calls), OPS, batch=1, warmup=1, steps=2,
                                           shapes=SHAPES, goal=0.5, parameters=1000)
    assert failures == []
    products = [("product", shape) for shape in SHAPES.values()]
    # Warm-up round, a probe; then pair 1 (lowered first), a probe; pair 2 (hand-written first), a probe.
    assert calls == ([("step", "lowered"), ("step", "hand")] + products
                     + [("step", "lowered"), ("step", "hand")] + products
                     + [("step", "hand"), ("step", "lowered")] + products)
    out = capsys.readouterr().out
    rows = {row["name"]: row for row in (json.loads(line[6:]) for line in out.splitlines() if line.startswith("BENCH "))}
    peak = next(row for name, row in rows.items() if "GEMM peak" in name)
    assert "best of 3 probes" in peak["name"] and peak["value"] == pytest.approx(1e9)  # GOPS
    paper, valid = rows["fake gpt model-FLOP utilisation (paper)"], rows["fake gpt model-FLOP utilisation (valid)"]
    assert paper["goal"] == 0.5 and valid["goal"] is None and paper["met"] is False  # a tiny utilisation
    assert valid["value"] == pytest.approx(0.9 * paper["value"])


def test_a_hand_written_model_of_another_size_is_a_failure_before_anything_is_timed():
    failures = transformer_step.bench_pair("fake", fake_pair(1e6, []), OPS, batch=1, warmup=1, steps=2,
                                           shapes=SHAPES, goal=None, parameters=999)
    assert failures == ["fake: the hand-written model has 1,000 parameters, the IR's 999"]


def test_the_model_shapes_beside_the_square_one():
    sizes = dict(layers=12, hidden=768, heads=12, seq_len=1024, vocab=256)
    shapes = transformer_step.gemm_shapes("cpu", sizes, 1)
    assert list(shapes.values()) == [(2048, 2048, 2048), (1024, 768, 2304), (1024, 768, 3072), (1024, 3072, 768),
                                     (768, 1024, 3072)]
    assert transformer_step.gemm_shapes("cuda:0", sizes, 32)["mlp-up T.h.4h"] == (32768, 768, 3072)


def test_the_valid_convention_counts_fewer_operations_of_a_causal_gpt():
    from aiperf_core.builders import gpt

    graph = gpt(layers=1, hidden=32, heads=2, seq_len=64, vocab=64)
    paper = transformer_step.training_ops_per_sequence(graph)
    valid = transformer_step.training_ops_per_sequence(graph, "valid")
    assert valid < paper


def test_interleaved_peak_is_the_best_of_all_its_products():
    times = iter([0.2, 0.1, 0.4, 0.5])
    peak = _common.InterleavedPeak({"a": (100, lambda: next(times)), "b": (300, lambda: next(times))})
    peak.probe()
    peak.probe()
    assert peak.probes == 2 and peak.seconds == {"a": [0.2, 0.4], "b": [0.1, 0.5]}
    assert peak.best() == ("b", pytest.approx(3000.0)) and peak.spread("a") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="never probed"):
        _common.InterleavedPeak({"a": (1, lambda: 1.0)}).best()


def test_compare_training_throughput_probes_between_pairs(capsys):
    calls = []
    _common.compare_training_throughput("x", 1, lambda: calls.append("low"), {"h": lambda: calls.append("hand")}, 3,
                                        between=lambda: calls.append("peak"))
    assert calls == ["low", "hand", "peak", "hand", "low", "peak", "low", "hand", "peak"]


@pytest.mark.parametrize("value, met, failed", [(0.6, True, None), (1.0, True, None), (1.02, False, "peak under-measured")])
def test_a_fraction_of_the_peak_above_1_is_never_a_met_goal(value, met, failed, capsys):
    row = _common.report_fraction_of_peak("t utilisation", value, goal=0.5)
    out = capsys.readouterr().out
    assert row["met"] is met and row.get("failed") == failed
    assert ("goal met" in out) is (failed is None) and ("FAILED MEASUREMENT" in out) is (failed is not None)


def test_report_peak_fraction_with_a_callable_and_with_an_interleaved_peak(capsys):
    # A callable is timed ten times after the steps, as before; the fraction is then far above 1.
    failed = _common.report_peak_fraction("t", 1e6, 10 ** 9, lambda: None, n=8, valid_ops_per_image=10 ** 8)
    assert len(failed) == 2 and "(paper)" in failed[0] and "(valid)" in failed[1]
    peak = _common.InterleavedPeak({"8x8": (1024, lambda: 1.0)})
    peak.probe()
    assert _common.report_peak_fraction("t", 1e-9, 10 ** 9, peak) == []
    assert "t resnet50 model-FLOP utilisation (paper)" in capsys.readouterr().out


# -- rectangular products on every backend --------------------------------------------------------
def test_matmul_shape_reads_a_size_or_a_shape():
    assert matmul_shape(4) == (4, 4, 4) and matmul_shape((2, 3, 5)) == (2, 3, 5) and matmul_shape([2, 3, 5]) == (2, 3, 5)
    for bad in (0, (2, 3), (2, 0, 5), 2.0, True, "4", (2, 3.0, 5)):
        with pytest.raises(BackendError, match="a positive size n or a shape"):
            matmul_shape(bad)


@pytest.mark.parametrize("backend_name", ["numpy", "torch", "jax", "tensorflow", "mindspore"])
def test_backends_time_rectangular_products(backend_name):
    from aiperf_core.registry import load_backend

    backend = NumpyBackend() if backend_name == "numpy" else load_backend(backend_name)
    device = backend.devices()[0]
    assert len(backend.matmul_seconds(device, "fp32", (8, 16, 4), 2)) == 2
    assert len(backend.matmul_seconds(device, "fp32", 8, 1)) == 1  # a square size, as before
    with pytest.raises(BackendError):
        backend.matmul_seconds(device, "fp32", (8, 16), 1)


def test_torch_multiplies_the_shape_it_is_given(monkeypatch):
    import torch

    from aiperf_backends.torch import TorchBackend

    seen = []
    real_mm = torch.mm

    def recording_mm(a, b, **kwargs):
        seen.append((tuple(a.shape), tuple(b.shape), tuple(kwargs["out"].shape)))
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    TorchBackend().matmul_seconds("cpu", "fp32", (3, 5, 7), 1)
    assert seen == [((3, 5), (5, 7), (3, 7))] * 2


# -- aiperf peak: the spread of its repeats ----------------------------------------------------------
def test_the_spread_of_the_repeats_is_recorded_and_warned_about(tmp_path):
    quiet = measure_peak(PeakBackend(1e9), sizes=(8, 16), repeats=3)
    loaded = measure_peak(PeakBackend(1e9, jitter=0.25), sizes=(8, 16), repeats=3)
    assert quiet["devices"][0]["precisions"]["fp32"]["spread"] == 0.0
    assert loaded["devices"][0]["precisions"]["fp32"]["spread"] == pytest.approx(0.25)
    assert spread_warnings(quiet) == []
    lines = spread_warnings(loaded)
    assert len(lines) == 3 and "cpu fp32: the 3 products at 8x8 spread 25% (more than 10%)" in lines[0]
    assert spread_warnings(loaded, ["bf16"]) == [lines[1]] and spread_warnings(loaded, model="Other") == []
    for spread, ok in ((0.0, True), (SPREAD_WARNING, True), (-0.1, False), ("big", False), (True, False)):
        record = json.loads(json.dumps(quiet))
        record["devices"][0]["precisions"]["fp32"]["spread"] = spread
        if ok:
            validate_peak(record, "peak.json")
        else:
            with pytest.raises(SubmissionError, match="fp32.spread: must be a non-negative number"):
                validate_peak(record, "peak.json")
    del quiet["devices"][0]["precisions"]["fp32"]["spread"]  # a file from before spreads were recorded
    assert validate_peak(quiet, "peak.json") is quiet and spread_warnings(quiet) == []


def test_the_command_prints_the_spread_and_warns_above_10_percent(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(peak_module.SIZES, "cpu", (16, 48))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(peak_module, "SPREAD_WARNING", -1.0)  # every measurement "spreads": the warning shows
    assert main(["peak", "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    table = captured.out.splitlines()
    assert table[1].split() == ["device", "model", "precision", "size", "best", "spread"]
    assert table[2].split()[-1].endswith("%")
    assert "spread" in captured.err and "warning: " in captured.err and "under-measured" in captured.err
    assert "spread" in load_peak(tmp_path / "peak.json")["devices"][0]["precisions"]["fp32"]


# -- the check and the list ----------------------------------------------------------------------------
def peak_file(rate_per_device: float, jitter: float = 0.0) -> bytes:
    record = measure_peak(PeakBackend(rate_per_device, jitter=jitter), sizes=(64,), repeats=3)
    return json.dumps(record).encode()


def test_the_check_flags_an_efficiency_above_1_against_the_measured_peak(package, tmp_path):  # noqa: F811
    """The acceptance test's second half: a peak.json whose products ran slower than the run did."""
    score = check_submission(package).score_ops  # two devices
    files = members(package)
    files["peak.json"] = peak_file(score / 4)  # the system's measured peak: half the score
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert verdict.to_dict()["efficiency_measured"] == pytest.approx(2.0)
    assert not verdict.accepted
    assert any(r.startswith("implausible: efficiency 200.0% against the measured peak exceeds 1")
               and "peak.json under-measures the devices" in r for r in verdict.rejections), verdict.rejections

    files["peak.json"] = peak_file(score)  # efficiency 0.5: accepted, nothing said
    repack(files, tmp_path / "u.tar.gz")
    verdict = check_submission(tmp_path / "u.tar.gz")
    assert verdict.accepted and not any("peak.json" in f for f in verdict.findings), verdict.findings


def test_the_check_reports_a_peak_measured_on_a_busy_device(package, tmp_path):  # noqa: F811
    score = check_submission(package).score_ops
    files = members(package)
    files["peak.json"] = peak_file(score, jitter=0.3)
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert verdict.accepted, verdict.rejections
    assert any(f.startswith("peak.json: cpu fp") and "spread 30%" in f and "under-measured" in f
               for f in verdict.findings), verdict.findings


def test_the_list_says_an_efficiency_above_1_is_a_peak_under_measured():
    v = ranking_verdict("a.tar.gz", score=47.5e12, peak=256e12, efficiency_declared=0.185546875,
                        efficiency_measured=1.25)
    text = render_text(rank([v]))
    assert "125.0% (peak under-measured)" in text and "18.6%" in text
    v = ranking_verdict("b.tar.gz", score=47.5e12, peak=40e12, efficiency_declared=1.1875, efficiency_measured=0.5)
    text = render_text(rank([v]))
    assert "118.8% (peak understated)" in text and "50.0%" in text and "under-measured" not in text
