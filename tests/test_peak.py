"""The measured peak (aiperf_core/submission/peak.py, `aiperf peak`): measured with the NumPy reference
and torch on tiny sizes, the size ladder's time budget, the peak.json schema and its round trip, the
command writing peak.json, and load_peak refusing each kind of bad file with one line naming the field."""

from __future__ import annotations

import copy
import json

import pytest

from aiperf_core.backend import PRECISIONS, Backend, BackendError
from aiperf_core.cli import main
from aiperf_core.errors import AiperfError
from aiperf_core.inventory import host_cpu
from aiperf_core.submission import SubmissionError
from aiperf_core.submission import peak as peak_module
from aiperf_core.submission.peak import (load_peak, measure_peak, ops_per_product, peak_per_device, validate_peak,
                                         write_peak)
from aiperf_numpy.backend import NumpyBackend

TINY = (16, 48)


def check_schema(record: dict, backend_name: str, precisions: tuple[str, ...]) -> None:
    assert record["schema_version"] == 1 and record["kind"] == "aiperf-peak"
    assert record["backend"] == backend_name and record["framework_version"] and record["host"]
    assert record["measured_at"].endswith("+00:00")
    assert len(record["devices"]) == 1
    entry = record["devices"][0]
    assert tuple(entry["precisions"]) == precisions
    for m in entry["precisions"].values():
        assert m["size"] in TINY and m["repeats"] == 2
        assert m["best_seconds"] > 0 and m["ops_per_s"] == ops_per_product(m["size"]) / m["best_seconds"]


def round_trip(record: dict, tmp_path) -> None:
    path = tmp_path / "peak.json"
    write_peak(record, path)
    assert load_peak(path) == record


def test_numpy_measures_fp32_and_round_trips(tmp_path):
    backend = NumpyBackend()
    lines = []
    record = measure_peak(backend, sizes=TINY, repeats=2, progress=lines.append)
    check_schema(record, "numpy", ("fp32",))
    assert record["devices"][0]["device"] == backend.devices()[0]
    assert len(lines) == len(TINY) and all(line.startswith(f"{backend.devices()[0]} fp32 ") for line in lines)
    assert peak_per_device(record, "fp32") == record["devices"][0]["precisions"]["fp32"]["ops_per_s"] > 0
    round_trip(record, tmp_path)


def test_torch_measures_every_declared_precision(tmp_path):
    from aiperf_backends.torch import TorchBackend

    backend = TorchBackend()
    declared = backend.precisions("cpu")
    record = measure_peak(backend, sizes=TINY, repeats=2)
    check_schema(record, "torch", declared)
    assert record["devices"][0]["model"] == host_cpu()["model"]  # a CPU device keeps the host CPU's model
    round_trip(record, tmp_path)


def test_torch_multiplies_in_the_precisions_dtype_with_ieee_fp32(monkeypatch):
    """fp32 runs inside the training scope that holds oneDNN to IEEE fp32; bf16 multiplies bf16."""
    import torch

    from aiperf_backends.torch import TorchBackend

    seen = []
    real_mm = torch.mm

    def recording_mm(a, b, **kwargs):
        seen.append((a.dtype, getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)))
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "mm", recording_mm)
    backend = TorchBackend()
    assert len(backend.matmul_seconds("cpu", "fp32", 8, 3)) == 3
    assert len(seen) == 4  # the warm-up and three timed products
    assert {dtype for dtype, _ in seen} == {torch.float32}
    if hasattr(torch.backends.mkldnn, "matmul"):
        assert {mode for _, mode in seen} == {"ieee"}
    seen.clear()
    backend.matmul_seconds("cpu", "bf16", 8, 1)
    assert {dtype for dtype, _ in seen} == {torch.bfloat16}


def test_undeclared_and_unknown_precisions_are_refused():
    backend = NumpyBackend()
    with pytest.raises(BackendError, match=r"does not declare precision 'bf16' on cpu \(.*\) \(declared: fp32\)"):
        measure_peak(backend, ["fp32", "bf16"], sizes=TINY, repeats=1)
    with pytest.raises(BackendError, match="unknown precision 'fp8'"):
        measure_peak(backend, ["fp8"], sizes=TINY, repeats=1)
    with pytest.raises(BackendError, match="cannot multiply matrices at precision 'bf16'"):
        backend.matmul_seconds(backend.devices()[0], "bf16", 4, 1)


class FakeBackend:
    """A device whose products take size**3 milliseconds (times reported, not slept)."""

    name = "fake"

    def __init__(self, seconds=None):
        self.calls = []
        self.seconds = seconds

    def devices(self):
        return ["accel:0", "accel:1"]

    def precisions(self, device):
        return ("fp32", "bf16")

    def framework_version(self):
        return "1.0"

    def device_model(self, device):
        return "Fake X1"

    def matmul_seconds(self, device, precision, size, repeats):
        self.calls.append((device, precision, size))
        if self.seconds is not None:
            return self.seconds
        return [size ** 3 * 1e-3 * (1.0 if precision == "fp32" else 0.5)] * repeats


def test_the_size_ladder_stops_before_overrunning_its_budget():
    backend = FakeBackend()
    lines = []
    # Each device has 2.0 s for two precisions: 1.0 s each. Size 2 takes 6 x 8 ms, so size 4 is
    # projected at 0.38 s (fits); size 4 takes 6 x 64 ms, so size 8 (3.1 s) is skipped.
    record = measure_peak(backend, sizes=(8, 2, 4), repeats=5, budget_s=2.0, progress=lines.append)
    assert backend.calls == [(d, p, n) for d in ("accel:0", "accel:1") for p in ("fp32", "bf16") for n in (2, 4)]
    assert sum("8x8 and larger skipped" in line for line in lines) == 4
    entry = record["devices"][1]
    assert entry["model"] == "Fake X1" and entry["precisions"]["fp32"]["size"] == 2  # same rate: the first wins
    assert entry["precisions"]["bf16"]["ops_per_s"] == pytest.approx(2 * 2 ** 3 / (2 ** 3 * 0.5e-3))
    assert measure_peak(backend, ["bf16"], sizes=(2,), repeats=1)["devices"][0]["precisions"].keys() == {"bf16"}


def test_a_backend_without_a_timer_or_with_bad_times_is_refused():
    with pytest.raises(AiperfError, match="^backend fake cannot measure a peak$"):
        Backend.matmul_seconds(FakeBackend(), "cpu", "fp32", 4, 1)
    with pytest.raises(BackendError, match="expected 2 positive seconds"):
        measure_peak(FakeBackend(seconds=[0.1, 0.0]), sizes=(4,), repeats=2)


def test_peak_per_device_is_the_best_of_the_model():
    record = measure_peak(FakeBackend(), sizes=(2,), repeats=1)
    record["devices"][1]["model"] = "Fake X2"
    record["devices"][1]["precisions"]["fp32"]["ops_per_s"] *= 3
    record["devices"][1]["precisions"]["fp32"]["best_seconds"] /= 3
    validate_peak(record, "peak.json")
    fp32 = record["devices"][0]["precisions"]["fp32"]["ops_per_s"]
    assert peak_per_device(record, "fp32", "Fake X1") == fp32
    assert peak_per_device(record, "fp32") == pytest.approx(3 * fp32)
    assert peak_per_device(record, "fp32", "Other") is None and peak_per_device(record, "tf32") is None


# -- the command ------------------------------------------------------------------------------------
def test_cli_writes_peak_json_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(peak_module.SIZES, "cpu", TINY)
    monkeypatch.chdir(tmp_path)
    assert main(["peak", "--backend", "numpy"]) == 0
    captured = capsys.readouterr()
    assert "fp32 16x16: best" in captured.err and "wrote peak.json" in captured.out
    table = captured.out.splitlines()
    assert table[1].split() == ["device", "model", "precision", "size", "best", "spread"]
    assert "fp32" in table[2] and "OPS" in table[2]
    record = load_peak(tmp_path / "peak.json")
    assert record["backend"] == "numpy" and list(record["devices"][0]["precisions"]) == ["fp32"]

    before = (tmp_path / "peak.json").read_text()
    assert main(["peak", "--backend", "numpy"]) == 2
    assert capsys.readouterr().err.strip() == "aiperf: error: peak.json: exists (give --force to overwrite it)"
    assert (tmp_path / "peak.json").read_text() == before
    assert main(["peak", "--backend", "numpy", "--force", "--precision", "fp32"]) == 0
    assert load_peak(tmp_path / "peak.json")["measured_at"]


def test_cli_backend_from_the_environment_and_bad_precisions(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(peak_module.SIZES, "cpu", TINY)
    monkeypatch.setenv("AIPERF_BACKEND", "numpy")
    out = tmp_path / "sub" / "p.json"
    assert main(["peak", "--out", str(out)]) == 0
    assert load_peak(out)["backend"] == "numpy"
    capsys.readouterr()
    assert main(["peak", "--precision", "bf16", "--out", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'bf16'" in err and "declared: fp32" in err
    assert not (tmp_path / "q.json").exists()


def test_cli_budget_bounds_each_device_and_a_bad_one_is_refused_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(peak_module.SIZES, "cpu", TINY)
    budgets = []
    measure = peak_module.measure_peak

    def recording(*args, budget_s=None, **kwargs):
        budgets.append(budget_s)
        return measure(*args, budget_s=budget_s, **kwargs)

    monkeypatch.setattr(peak_module, "measure_peak", recording)
    assert main(["peak", "--backend", "numpy", "--budget", "1m30s", "--out", str(tmp_path / "p.json")]) == 0
    assert main(["peak", "--backend", "numpy", "--out", str(tmp_path / "q.json")]) == 0
    assert budgets == [90.0, None]  # None: BUDGET_S by kind of device
    capsys.readouterr()
    assert main(["peak", "--backend", "numpy", "--budget", "soon", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("aiperf: error: --budget: 'soon' is not a duration") and len(err.splitlines()) == 1
    assert budgets == [90.0, None] and not (tmp_path / "r.json").exists()


# -- load_peak ---------------------------------------------------------------------------------------
GOOD = {"schema_version": 1, "kind": "aiperf-peak", "backend": "torch", "framework_version": "2.13.0",
        "host": "node01", "measured_at": "2026-11-25T15:40:00+00:00",
        "devices": [{"device": "cpu", "model": "Some CPU",
                     "precisions": {"fp32": {"ops_per_s": 2 * 1024 ** 3 / 0.01, "size": 1024, "best_seconds": 0.01,
                                             "repeats": 5}}}]}


def _edit(path: tuple, value=None, delete: bool = False):
    def apply(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        if delete:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return record
    return apply


FP32 = ("devices", 0, "precisions", "fp32")
BAD_FILES = {
    "kind": (_edit(("kind",), "aiperf-system"), "kind: expected 'aiperf-peak'"),
    "version": (_edit(("schema_version",), 2), "schema_version: this aiperf reads version 1, got 2"),
    "missing ops": (_edit(FP32 + ("ops_per_s",), delete=True), "devices[0].precisions.fp32.ops_per_s: missing"),
    "negative ops": (_edit(FP32 + ("ops_per_s",), -1.0), "devices[0].precisions.fp32.ops_per_s: must be a positive"),
    "zero ops": (_edit(FP32 + ("ops_per_s",), 0), "devices[0].precisions.fp32.ops_per_s: must be a positive"),
    "inflated ops": (_edit(FP32 + ("ops_per_s",), 1e18), "devices[0].precisions.fp32.ops_per_s: 1e+18 is not 2*size"),
    "unknown precision": (_edit(("devices", 0, "precisions", "fp8"), GOOD["devices"][0]["precisions"]["fp32"]),
                          "devices[0].precisions.fp8: unknown precision"),
    "empty devices": (_edit(("devices",), []), "devices: must be a non-empty list"),
    "no devices": (_edit(("devices",), delete=True), "devices: missing"),
    "zero seconds": (_edit(FP32 + ("best_seconds",), 0.0), "devices[0].precisions.fp32.best_seconds: must be"),
    "bad time": (_edit(("measured_at",), "yesterday"), "measured_at: not an ISO 8601 time"),
    "no model": (_edit(("devices", 0, "model"), delete=True), "devices[0].model: missing"),
}


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "peak.json"
    path.write_text(json.dumps(GOOD))
    assert load_peak(path) == GOOD


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_load_peak_refuses_a_bad_file_naming_the_field(case, tmp_path):
    edit, expected = BAD_FILES[case]
    path = tmp_path / "peak.json"
    path.write_text(json.dumps(edit(copy.deepcopy(GOOD))))
    with pytest.raises(SubmissionError) as caught:
        load_peak(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {expected}") and "\n" not in message


@pytest.mark.parametrize("text", ["{\"kind\": \"aiperf-peak\",", "", "not json at all"])
def test_load_peak_refuses_a_file_that_does_not_parse(text, tmp_path):
    path = tmp_path / "peak.json"
    path.write_text(text)
    with pytest.raises(SubmissionError, match=r"peak\.json: not JSON: ") as caught:
        load_peak(path)
    assert "\n" not in str(caught.value)


def test_load_peak_on_a_missing_file_and_every_precision_name(tmp_path):
    with pytest.raises(SubmissionError, match=r"nothing\.json: cannot read: No such file"):
        load_peak(tmp_path / "nothing.json")
    record = copy.deepcopy(GOOD)
    record["devices"][0]["precisions"] = {p: GOOD["devices"][0]["precisions"]["fp32"] for p in PRECISIONS}
    assert validate_peak(record, "peak.json") is record
