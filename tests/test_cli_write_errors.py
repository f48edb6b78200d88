"""Every command that writes prints one line naming the path and the reason, and exits 2, when it
cannot write there. The tests run as any user, root included (for whom a read-only mode bit is no
obstacle), so the unwritable places are a missing parent on /proc, where nothing can be created,
and a file where a folder is expected."""

from __future__ import annotations

from aiperf_core.cli import main
from aiperf_core.data.samples import digits_tree
from test_score import standard_run


def one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("aiperf: error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_new_backend_into_proc_and_under_a_file(tmp_path, capsys):
    line = one_line_error(capsys, ["new-backend", "mychip", "--out", "/proc/nope"])
    assert line == "aiperf: error: --out /proc/nope: cannot write there: No such file or directory"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line_error(capsys, ["new-backend", "mychip", "--out", str(blocker / "pkg")])
    assert line == f"aiperf: error: --out {blocker / 'pkg'}: cannot write there: {blocker} is a file, not a folder"


def test_conformance_report_is_checked_before_the_kit_runs(tmp_path, capsys):
    line = one_line_error(capsys, ["conformance", "--backend", "numpy", "--report", "/proc/nope/R.json"])
    assert line == ("aiperf: error: --report /proc/nope/R.json: cannot write there: No such file or directory "
                    "(/proc/nope)")
    line = one_line_error(capsys, ["conformance", "--backend", "numpy", "--report", str(tmp_path)])
    assert line == f"aiperf: error: --report {tmp_path}: is a folder, not a file"
    assert capsys.readouterr().out == ""  # no check ran


def test_run_dir_into_proc_and_under_a_file(tmp_path, capsys):
    common = ["run", "--backend", "numpy", "--data", "synthetic", "--time-budget", "30s"]
    line = one_line_error(capsys, common + ["--run-dir", "/proc/nope/run"])
    assert line == "aiperf: error: --run-dir /proc/nope/run: not writable: No such file or directory"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line_error(capsys, common + ["--run-dir", str(blocker / "run")])
    assert line == f"aiperf: error: --run-dir {blocker / 'run'}: not writable: Not a directory"


def test_report_where_its_file_cannot_be_written(tmp_path, capsys):
    builder = standard_run(tmp_path)
    builder.finish(1960)
    (tmp_path / "report.html").mkdir()  # a folder where the report goes
    line = one_line_error(capsys, ["report", str(tmp_path)])
    assert line == f"aiperf: error: {tmp_path}: cannot write there: Is a directory ({tmp_path / 'report.html'})"


def test_data_convert_into_proc_and_under_a_file(tmp_path, capsys):
    src = digits_tree(tmp_path / "src", 2, 1)
    line = one_line_error(capsys, ["data", "convert", str(src), "/proc/nope/dst", "--to", "tfrecord", "--quiet",
                                   "--workers", "0"])
    assert line == "aiperf: error: /proc/nope/dst: cannot write there: No such file or directory (/proc/nope)"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_line_error(capsys, ["data", "convert", str(src), str(blocker / "dst"), "--to", "tfrecord", "--quiet",
                                   "--workers", "0"])
    assert line == f"aiperf: error: {blocker / 'dst'}: cannot write there: {blocker} is a file, not a folder"
