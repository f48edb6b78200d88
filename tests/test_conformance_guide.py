"""The vendor guide cannot drift: its generated tables (levels, every check id, default tolerances,
the IR's ops) equal what the code renders, and every IR op has a case in the kit."""

from pathlib import Path

from aiperf_core.ir import INPUT_OPS, OPS
from aiperf_conformance import guide
from aiperf_conformance.cases import OP_CASES
from aiperf_conformance.kit import catalogue

GUIDE = Path(__file__).resolve().parent.parent / "plugins" / "aiperf-numpy" / "README.md"


def test_generated_sections_are_current():
    text = GUIDE.read_text()
    fresh, changed = guide.regenerate(text)
    assert not changed, (f"stale generated sections in {GUIDE}: {', '.join(changed)}; run "
                         f"python -m aiperf_conformance.guide --write {GUIDE}")
    assert fresh == text


def test_every_check_id_and_op_is_in_the_guide():
    text = GUIDE.read_text()
    for check in catalogue(precisions=("fp32",)):
        assert f"| `{check.id}` |" in text
    for op in OPS:
        assert f"| `{op}` |" in text


def test_every_ir_op_has_a_kit_case():
    covered = {case.graph()["op"].op for case in OP_CASES}
    assert set(OPS) - INPUT_OPS <= covered
    assert {case.graph().nodes[0].op for case in OP_CASES} == INPUT_OPS


def test_check_mode_reports_a_stale_guide(tmp_path, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(GUIDE.read_text().replace("| `conv2d` |", "| `conv3d` |"))
    assert guide.main(["--check", str(stale)]) == 1
    assert "stale generated sections: ops" in capsys.readouterr().err
    assert guide.main(["--write", str(stale)]) == 0
    assert stale.read_text() == GUIDE.read_text()


def test_the_guide_documents_the_contract():
    text = GUIDE.read_text()
    for phrase in ("train_batches(data, epoch, seed, batch_size", "val_batches(data, batch_size",
                   "uint8 NHWC pixels", "(float32(x) - MEAN) * INV_STD", "clock.count(images)",
                   "step_seconds=clock.lap()", "compile_seconds", "runs_precision(device, precision)",
                   "AIPERF_CPU_DEVICES", "Parallelism(data_parallel=True", "native_counter()",
                   "conformance_file()", "--quick", "--list", "pytest --aiperf-backend"):
        assert phrase in text, phrase
