"""Every command that writes an output refuses one it cannot write before it starts its work (#33.3):
one line naming the option (or, for an argument, the path), exit 2, and the work function never called.
/proc refuses new files even to root; a path under a regular file cannot be a folder's. The check
itself leaves nothing behind: no probe file, no folder made for a command that then fails."""

from __future__ import annotations

import pytest

from aiperf_core.cli import main

UNWRITABLE = "/proc/nope/out"


def _never(*args, **kwargs):
    raise AssertionError("the command started its work before checking its output")


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "plain-file"
    path.write_text("not a folder")
    return path


def _refused(capsys, argv, name: str) -> str:
    """The one stderr line of a refused command, which names `name`; nothing on stdout."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("aiperf: error: ") and name in captured.err, captured.err
    assert "Traceback" not in captured.err and ".probe" not in captured.err, captured.err
    assert captured.out == ""
    return captured.err.strip()


@pytest.mark.parametrize("option", ["--html", "--csv"])
def test_rank_refuses_its_list_before_checking_packages(capsys, monkeypatch, tmp_path, a_file, option):
    monkeypatch.setattr("aiperf_core.commands.rank.rank_paths", _never)
    package = tmp_path / "x.tar.gz"
    package.write_bytes(b"")
    line = _refused(capsys, ["rank", str(package), option, "/proc/nope/list.html"], option)
    assert line == f"aiperf: error: {option} /proc/nope/list.html: cannot write there: No such file or directory " \
                   "(/proc/nope)"
    line = _refused(capsys, ["rank", str(package), "--json", option, str(a_file / "list")], option)
    assert line.endswith(f"cannot write there: {a_file} is a file, not a folder")
    _refused(capsys, ["rank", str(package), option, str(tmp_path)], option)  # a folder, not a file


def test_rank_makes_no_folder_for_a_list_it_never_writes(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("aiperf_core.commands.rank.rank_paths", _never)
    package = tmp_path / "x.tar.gz"
    package.write_bytes(b"")
    # The writable --html passes its check; the unwritable --csv is refused before any package is checked.
    _refused(capsys, ["rank", str(package), "--html", str(tmp_path / "new" / "list.html"), "--csv", UNWRITABLE],
             "--csv")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tar.gz"]


def test_submit_refuses_its_package_before_packing(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.submission.package.pack", _never)
    common = ["submit", str(tmp_path), "--system", "s.toml", "--conformance", "k.json", "--out"]
    _refused(capsys, common + [UNWRITABLE], "--out")
    _refused(capsys, common + [str(a_file / "x.tar.gz")], "--out")
    _refused(capsys, common + [str(tmp_path), "--force"], "--out")
    # pack makes no folder, so a missing one is refused too, and not made by the check
    line = _refused(capsys, common + [str(tmp_path / "new" / "x.tar.gz")], "--out")
    assert line.endswith(f"its folder {tmp_path / 'new'} does not exist")
    assert not (tmp_path / "new").exists()


def test_peak_refuses_its_file_before_measuring(capsys, monkeypatch, a_file):
    monkeypatch.setattr("aiperf_core.submission.peak.measure_peak", _never)
    monkeypatch.setattr("aiperf_core.registry.load_backend", _never)
    _refused(capsys, ["peak", "--backend", "numpy", "--out", UNWRITABLE], "--out")
    _refused(capsys, ["peak", "--backend", "numpy", "--out", str(a_file / "peak.json")], "--out")


def test_system_describe_refuses_its_file_before_describing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("aiperf_core.submission.system.describe", _never)
    _refused(capsys, ["system", "describe", "--out", UNWRITABLE], "--out")
    line = _refused(capsys, ["system", "describe", "--out", str(tmp_path), "--force"], "--out")
    assert line == f"aiperf: error: --out {tmp_path}: is a folder, not a file"


def test_data_prepare_refuses_its_folder_before_reading_archives(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.data.prepare.prepare", _never)
    line = _refused(capsys, ["data", "prepare", str(tmp_path), UNWRITABLE], UNWRITABLE)
    assert line == f"aiperf: error: {UNWRITABLE}: cannot write there: No such file or directory (/proc/nope)"
    _refused(capsys, ["data", "prepare", str(tmp_path), str(a_file / "out")], str(a_file / "out"))
    _refused(capsys, ["data", "prepare", str(tmp_path), str(a_file)], str(a_file))


def test_data_stage_refuses_its_folder_before_reading_the_source(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.data.stage.stage", _never)
    _refused(capsys, ["data", "stage", str(tmp_path), UNWRITABLE], UNWRITABLE)
    _refused(capsys, ["data", "stage", str(tmp_path), str(a_file)], str(a_file))
    _refused(capsys, ["data", "stage", str(tmp_path), str(a_file / "dst")], str(a_file / "dst"))


def test_conformance_refuses_its_report_before_any_check(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_conformance.kit.run_conformance", _never)
    monkeypatch.setattr("aiperf_core.registry.load_backend", _never)
    _refused(capsys, ["conformance", "--backend", "numpy", "--report", UNWRITABLE], "--report")
    _refused(capsys, ["conformance", "--backend", "numpy", "--report", str(a_file / "R.json")], "--report")
    _refused(capsys, ["conformance", "--backend", "numpy", "--report", str(tmp_path)], "--report")


def test_report_refuses_its_files_before_scoring(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.report.write_report", _never)
    _refused(capsys, ["report", "/proc/nope"], "/proc/nope")
    _refused(capsys, ["report", str(a_file)], str(a_file))
    (tmp_path / "summary.json").mkdir()  # a folder where one of its files goes
    line = _refused(capsys, ["report", str(tmp_path)], str(tmp_path))
    assert line == f"aiperf: error: {tmp_path}: cannot write there: Is a directory ({tmp_path / 'summary.json'})"


def test_the_check_leaves_nothing_behind(tmp_path):
    from aiperf_core.commands.options import writable_file, writable_folder

    assert writable_folder("OUT", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert writable_folder("OUT", tmp_path) == tmp_path
    assert writable_file("--out", tmp_path / "new" / "peak.json") == tmp_path / "new" / "peak.json"
    assert writable_file("--out", tmp_path / "peak.json", folder_made=False) == tmp_path / "peak.json"
    assert list(tmp_path.iterdir()) == []


def test_a_relative_output_is_checked_where_it_would_be_written(tmp_path, monkeypatch):
    from aiperf_core.commands.options import writable_file, writable_folder
    from aiperf_core.errors import AiperfError

    monkeypatch.chdir(tmp_path)
    writable_file("--out", "peak.json", folder_made=False)
    writable_folder(None, "new/out")
    (tmp_path / "blocker").write_text("")
    with pytest.raises(AiperfError, match=r"^--out blocker/x/peak.json: cannot write there: .*blocker is a file"):
        writable_file("--out", "blocker/x/peak.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]
