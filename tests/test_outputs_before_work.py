"""Every command that writes an output refuses one it cannot write before it starts its work (#33.3):
one line naming the option or argument, exit 2, and the work function never called. /proc refuses new
files even to root; a path under a regular file cannot be a folder's."""

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


def _refused(capsys, argv, name: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert name in err and "Traceback" not in err, err


@pytest.mark.parametrize("option", ["--html", "--csv"])
def test_rank_refuses_its_list_before_checking_packages(capsys, monkeypatch, tmp_path, a_file, option):
    monkeypatch.setattr("aiperf_core.commands.rank.rank_paths", _never)
    package = tmp_path / "x.tar.gz"
    package.write_bytes(b"")
    _refused(capsys, ["rank", str(package), option, UNWRITABLE], option)
    _refused(capsys, ["rank", str(package), option, str(a_file / "list")], option)


def test_submit_refuses_its_package_before_packing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("aiperf_core.submission.package.pack", _never)
    _refused(capsys, ["submit", str(tmp_path), "--system", "s.toml", "--conformance", "k.json",
                      "--out", UNWRITABLE], "--out")


def test_peak_refuses_its_file_before_measuring(capsys, monkeypatch):
    monkeypatch.setattr("aiperf_core.submission.peak.measure_peak", _never)
    monkeypatch.setattr("aiperf_core.registry.load_backend", _never)
    _refused(capsys, ["peak", "--backend", "numpy", "--out", UNWRITABLE], "--out")


def test_system_describe_refuses_its_file_before_describing(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("aiperf_core.submission.system.describe", _never)
    _refused(capsys, ["system", "describe", "--out", UNWRITABLE], "--out")
    _refused(capsys, ["system", "describe", "--out", str(tmp_path), "--force"], "--out")  # a folder, not a file


def test_data_prepare_refuses_its_folder_before_reading_archives(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.data.prepare.prepare", _never)
    _refused(capsys, ["data", "prepare", str(tmp_path), UNWRITABLE], "OUT")
    _refused(capsys, ["data", "prepare", str(tmp_path), str(a_file / "out")], "OUT")
    assert not (tmp_path / "out").exists()


def test_data_stage_refuses_its_folder_before_reading_the_source(capsys, monkeypatch, tmp_path, a_file):
    monkeypatch.setattr("aiperf_core.data.stage.stage", _never)
    _refused(capsys, ["data", "stage", str(tmp_path), UNWRITABLE], "DST")
    _refused(capsys, ["data", "stage", str(tmp_path), str(a_file)], "DST")


def test_conformance_refuses_its_report_before_any_check(capsys, monkeypatch):
    monkeypatch.setattr("aiperf_conformance.kit.run_conformance", _never)
    monkeypatch.setattr("aiperf_conformance.kit.iter_results", _never)
    _refused(capsys, ["conformance", "--backend", "numpy", "--report", UNWRITABLE], "--report")


def test_report_refuses_a_run_directory_it_cannot_write_before_scoring(capsys, monkeypatch, a_file):
    monkeypatch.setattr("aiperf_core.report.write_report", _never)
    _refused(capsys, ["report", UNWRITABLE], "RUN_DIR")
    _refused(capsys, ["report", str(a_file)], "RUN_DIR")


def test_a_writable_output_is_not_created_by_the_check(tmp_path):
    from aiperf_core.commands.options import writable_file, writable_folder

    writable_folder("OUT", tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()
    writable_file("--out", tmp_path / "peak.json")
    assert list(tmp_path.iterdir()) == []
