"""The list (aiperf_core/submission/ranking.py) and `aiperf rank`, on verdict dicts made here."""

import csv
import io
import json
import re
import sys
import types

import pytest

from aiperf_core.cli import main
from aiperf_core.commands.rank import rank_paths
from aiperf_core.scoring import format_ops
from aiperf_core.submission import SubmissionError
from aiperf_core.submission.ranking import COLUMNS, rank, render_csv, render_html, render_text


def verdict(file, system_name="Alpha", site="Lab A", score=1e12, official=True, regulated=None, peak=1e13,
            sid=None, run_id=None, digests=None, nodes=1, per_node=8, model="Test GPU", ops_per_watt=None,
            level=None, efficiency_declared=None, efficiency_measured=None, status="ACCEPTED", reasons=()):
    """A verdict as check_submission(...).to_dict() gives it."""
    stem = file.removesuffix(".tar.gz")
    metered = ops_per_watt is not None
    return {
        "file": file, "submission_id": sid or f"sub-{stem}", "workload": "cnn", "verdict": status,
        "official": official,
        "reasons": list(reasons), "findings": [], "run_id": run_id or f"run-{stem}",
        "log_digests": digests if digests is not None else [f"digest-{stem}-0", f"digest-{stem}-1"],
        "system": {"system_name": system_name, "site": site, "country": "CN", "submitter": "A. Person",
                   "nodes": nodes, "accelerator_kind": "gpu", "accelerator_model": model,
                   "accelerators_per_node": per_node},
        "accelerators": nodes * per_node, "backend": "torch", "framework_version": "torch 2.3.1",
        "precisions": ["fp16"],
        "score_ops": score, "regulated_ops": score * 0.9 if regulated is None else regulated, "best_accuracy": 0.76,
        "elapsed_s": 3600.0, "start_time": 1.7e9, "date": "2024-06-01", "declared_peak_ops": peak,
        "measured_peak_ops": None if efficiency_measured is None else score / efficiency_measured,
        "efficiency_declared": efficiency_declared if efficiency_declared is not None else score / peak,
        "efficiency_measured": efficiency_measured,
        "energy": {"measured": metered, "joules": score * 3600 / ops_per_watt if metered else None,
                   "ops_per_watt": ops_per_watt, "node_coverage": 1.0 if metered else None,
                   "time_coverage": 0.98 if metered else None, "level": level if metered else None,
                   "statement": "metered" if metered else "not measured"},
    }


def rejected_verdict(file, reasons):
    v = verdict(file, status="REJECTED", official=False, reasons=reasons)
    v.update(system=None, submission_id=None, run_id=None, log_digests=[], accelerators=None, score_ops=None)
    return v


def files(rows):
    return [row["file"] for row in rows]


def test_official_results_come_first_then_score_then_tie_breaks():
    ranking = rank([
        verdict("unofficial-fast.tar.gz", system_name="U", score=9e15, official=False),
        verdict("slow.tar.gz", system_name="S", score=1e12),
        verdict("fast.tar.gz", system_name="F", score=5e14),
        verdict("tie-low-regulated.tar.gz", system_name="T1", score=1e13, regulated=5e12),
        verdict("tie-high-regulated.tar.gz", system_name="T2", score=1e13, regulated=8e12),
        verdict("tie-big-peak.tar.gz", system_name="P1", score=2e13, regulated=1e13, peak=4e14),
        verdict("tie-small-peak.tar.gz", system_name="P2", score=2e13, regulated=1e13, peak=1e14),
        verdict("tie-b.tar.gz", system_name="B", score=3e12, regulated=1e12, peak=1e14, sid="sub-b"),
        verdict("tie-a.tar.gz", system_name="A", score=3e12, regulated=1e12, peak=1e14, sid="sub-a"),
    ])
    assert files(ranking.entries) == [
        "fast.tar.gz", "tie-small-peak.tar.gz", "tie-big-peak.tar.gz", "tie-high-regulated.tar.gz",
        "tie-low-regulated.tar.gz", "tie-a.tar.gz", "tie-b.tar.gz", "slow.tar.gz", "unofficial-fast.tar.gz"]
    assert [e["rank"] for e in ranking.entries] == list(range(1, 10))
    assert ranking.superseded == [] and ranking.rejected == []


def test_efficiency_figures_are_the_checks_own():
    v = verdict("a.tar.gz", score=47.5e12, peak=256e12, efficiency_declared=0.185546875, efficiency_measured=0.25)
    ranking = rank([v])
    entry = ranking.entries[0]
    assert entry["efficiency_declared"] == 0.185546875 and entry["efficiency_measured"] == 0.25
    row = next(csv.DictReader(io.StringIO(render_csv(ranking))))
    assert float(row["efficiency vs declared peak"]) == 0.185546875
    assert float(row["efficiency vs measured peak"]) == 0.25
    assert float(row["score (OPS)"]) == 47.5e12 and float(row["declared peak (OPS)"]) == 256e12
    html = render_html(ranking)
    assert ">18.6%<" in html and ">25.0%<" in html and format_ops(47.5e12) in html
    text = render_text(ranking)
    assert "18.6%" in text and "25.0%" in text and format_ops(47.5e12) in text


def test_a_tiny_efficiency_is_not_shown_as_zero():
    text = render_text(rank([verdict("a.tar.gz", score=6.47e7, peak=4e12)]))
    assert "0.0016%" in text and " 0.0% " not in text


@pytest.mark.parametrize("backend, version, shown", [
    ("torch", "torch 2.3.1", "torch 2.3.1"), ("torch", "2.3.1", "torch 2.3.1"),
    ("tf-keras", "tensorflow 2.16.1", "tf-keras (tensorflow 2.16.1)"), ("numpy", None, "numpy"),
])
def test_backend_column_names_the_backend_once(backend, version, shown):
    v = verdict("a.tar.gz")
    v.update(backend=backend, framework_version=version)
    assert next(csv.DictReader(io.StringIO(render_csv(rank([v])))))["backend"] == shown


def test_one_entry_per_system_the_others_superseded():
    ranking = rank([
        verdict("old.tar.gz", score=1e13),
        verdict("unofficial-better.tar.gz", score=9e13, official=False),
        verdict("best.tar.gz", score=2e13),
        verdict("other-site.tar.gz", site="Lab B", score=5e12),
    ])
    assert files(ranking.entries) == ["best.tar.gz", "other-site.tar.gz"]
    assert files(ranking.superseded) == ["old.tar.gz", "unofficial-better.tar.gz"]
    assert {s["reason"] for s in ranking.superseded} == {"superseded by sub-best"}
    assert {s["superseded_by"] for s in ranking.superseded} == {"sub-best"}
    text = render_text(ranking)
    assert "Superseded" in text and "sub-old" in text
    assert "sub-unofficial-better" in render_html(ranking)


def test_a_system_with_unofficial_results_only_is_ranked_by_its_best():
    ranking = rank([verdict("a.tar.gz", score=1e12, official=False), verdict("b.tar.gz", score=3e12, official=False)])
    assert files(ranking.entries) == ["b.tar.gz"] and files(ranking.superseded) == ["a.tar.gz"]


@pytest.mark.parametrize("copy, reason", [
    (dict(file="again.tar.gz", sid="sub-first"), "same submission as first.tar.gz"),
    (dict(file="repacked.tar.gz", run_id="run-first", digests=["other"]), "same run run-first as first.tar.gz"),
    (dict(file="renamed.tar.gz", digests=["x", "digest-first-1"]),
     "same event log as first.tar.gz under another name"),
])
def test_duplicates_are_rejected_and_named(copy, reason):
    file = copy.pop("file")
    ranking = rank([verdict("first.tar.gz", score=1e12), verdict(file, system_name="Other", score=5e12, **copy)])
    assert files(ranking.entries) == ["first.tar.gz"]  # the earlier one stays, though it scores less
    assert ranking.rejected == [{"file": file, "submission_id": copy.get("sid", f"sub-{file[:-7]}"),
                                 "run_id": copy.get("run_id", f"run-{file[:-7]}"), "system_name": "Other",
                                 "site": "Lab A", "reasons": [reason]}]
    assert reason in render_text(ranking) and reason in render_html(ranking)


def test_a_rejected_package_does_not_block_a_repacked_one():
    first = verdict("first.tar.gz", status="REJECTED", official=False, reasons=["node count 2, the run saw 1"])
    ranking = rank([first, verdict("fixed.tar.gz", run_id="run-first", digests=first["log_digests"])])
    assert files(ranking.entries) == ["fixed.tar.gz"]
    assert ranking.rejected[0]["reasons"] == ["node count 2, the run saw 1"]


def test_a_rejected_duplicate_keeps_its_own_reasons_too():
    ranking = rank([verdict("a.tar.gz"),
                    verdict("b.tar.gz", sid="sub-a", status="REJECTED", official=False, reasons=["stale"])])
    assert ranking.rejected[0]["reasons"] == ["same submission as a.tar.gz", "stale"]


def test_rejected_submissions_are_listed_with_their_reasons():
    reasons = ["backend torch 2.3.1 is not certified on Test GPU at fp16: the report is from a quick run",
               "score 9e15 OPS exceeds the declared peak 8e15 OPS"]
    ranking = rank([verdict("good.tar.gz"), rejected_verdict("bad.tar.gz", reasons)])
    assert files(ranking.entries) == ["good.tar.gz"]
    assert ranking.rejected == [{"file": "bad.tar.gz", "submission_id": None, "run_id": None, "system_name": None,
                                 "site": None, "reasons": reasons}]
    text, html = render_text(ranking), render_html(ranking)
    assert all(r in text for r in reasons) and all(r in html for r in reasons)
    assert json.loads(json.dumps(ranking.to_dict()))["rejected"][0]["reasons"] == reasons


def test_an_accepted_verdict_without_a_score_is_an_error():
    v = verdict("a.tar.gz")
    v["score_ops"] = None
    with pytest.raises(SubmissionError, match="a.tar.gz: an ACCEPTED verdict without score_ops"):
        rank([v])


def test_green_list_orders_metered_entries_by_ops_per_watt():
    # A figure from counters the check does not call a measurement keeps a result off the list.
    partly = verdict("partly.tar.gz", system_name="P", score=1e12, ops_per_watt=5e11, level="L1")
    partly["energy"].update(measured=False, level=None, statement="not measured: RAPL on 1 of 64 nodes")
    ranking = rank([
        verdict("fast-hungry.tar.gz", system_name="H", score=1e15, ops_per_watt=2e10, level="L1"),
        verdict("unmetered.tar.gz", system_name="U", score=5e14),
        verdict("frugal.tar.gz", system_name="F", score=1e13, ops_per_watt=9e10, level="L3"),
        verdict("middle.tar.gz", system_name="M", score=1e14, ops_per_watt=5e10, level="L2"),
        # A superseded result is not on the Green list, however frugal.
        verdict("frugal-old.tar.gz", system_name="F", score=5e12, ops_per_watt=1e12, level="L3"),
        partly,
    ])
    assert files(ranking.green) == ["frugal.tar.gz", "middle.tar.gz", "fast-hungry.tar.gz"]
    assert [(g["green_rank"], g["rank"]) for g in ranking.green] == [(1, 4), (2, 3), (3, 1)]
    assert "partly.tar.gz" in files(ranking.entries)
    text = render_text(ranking)
    green = text[text.index("Green list"):text.index("Superseded")]
    assert "U " not in green and green.index(" F ") < green.index(" M ") < green.index(" H ")
    html = render_html(ranking)
    green_html = html[html.index("<h2>Green list"):html.index("<h2>Superseded")]
    assert green_html.count("<tr class=") == 3 and ">L3<" in green_html and "unmetered" not in green_html


def test_power_level_reads_not_measured_for_unmetered_entries():
    ranking = rank([verdict("a.tar.gz"), verdict("b.tar.gz", system_name="B", ops_per_watt=1e10, level="L2"),
                    verdict("c.tar.gz", system_name="C", score=1e11, ops_per_watt=1e9, level=None)])
    rows = list(csv.DictReader(io.StringIO(render_csv(ranking))))
    assert [(r["power level"], r["OPS per watt"]) for r in rows] == [
        ("not measured", ""), ("L2", "10000000000.0"), ("below L1", "1000000000.0")]
    assert files(ranking.green) == ["b.tar.gz", "c.tar.gz"]
    assert "no ranked result" not in render_text(ranking)
    assert "no ranked result metered its energy" in render_text(rank([verdict("a.tar.gz")]))


def test_csv_has_every_column_and_one_row_per_entry():
    ranking = rank([verdict("a.tar.gz", score=3e12), verdict("b.tar.gz", system_name="B", score=2e12),
                    verdict("c.tar.gz", score=1e12), rejected_verdict("d.tar.gz", ["broken"])])
    rows = list(csv.reader(io.StringIO(render_csv(ranking))))
    assert rows[0] == [
        "rank", "system", "site", "country", "submitter", "nodes", "accelerators", "backend", "precision",
        "score (OPS)", "declared peak (OPS)", "efficiency vs declared peak", "efficiency vs measured peak",
        "regulated score (OPS)", "best accuracy", "run length (h)", "network share", "network efficiency", "OPS per watt",
        "power level", "date", "official", "submission id", "workload"]
    assert len(rows) == 1 + 2
    first = dict(zip(rows[0], rows[1]))
    assert first["accelerators"] == "Test GPU x 8" and first["backend"] == "torch 2.3.1"
    assert first["run length (h)"] == "1.0" and first["official"] == "yes" and first["submission id"] == "sub-a"
    assert first["efficiency vs measured peak"] == ""


def test_csv_does_not_let_a_spreadsheet_run_a_submitted_name():
    rows = list(csv.DictReader(io.StringIO(render_csv(rank([verdict("a.tar.gz", system_name="=cmd|'/c calc'!A1")])))))
    assert rows[0]["system"] == "'=cmd|'/c calc'!A1"


HOSTILE = '<script>alert(1)</script><img src="http://x/y.png" onerror="z()">'


def _demo_ranking():
    return rank([
        verdict("laptop.tar.gz", system_name="Laptop", score=6e10, nodes=1, per_node=1, peak=1e12, official=False),
        verdict("node.tar.gz", system_name="GPU node", score=2e14, nodes=1, per_node=8, peak=2e15),
        verdict("cluster.tar.gz", system_name=HOSTILE, site="Lab & Co", score=2e16, nodes=100, per_node=8,
                peak=8e17, ops_per_watt=3e10, level="L2"),
        verdict("old.tar.gz", system_name="GPU node", score=1e14, nodes=1, per_node=8, peak=2e15),
        rejected_verdict("bad.tar.gz", ["manifest does not match: score.json <changed>"]),
    ])


def test_html_is_one_self_contained_page_with_everything_escaped():
    html = render_html(_demo_ranking())
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]*\bsrc\s*=", html) and "<link" not in html and "@import" not in html
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", html)
    assert "url(" not in html
    # The hostile name appears only escaped: in the tables, the plot label and its tooltip.
    assert HOSTILE not in html and "<img" not in html and "alert(1)</script>" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") >= 4
    assert "Lab &amp; Co" in html
    assert "manifest does not match: score.json &lt;changed&gt;" in html
    assert html.count("<script>") == 1  # ours: the sort script


def test_html_tables_sort_on_click():
    html = render_html(_demo_ranking())
    script = html[html.index("<script>"):html.index("</script>")]
    assert 'querySelectorAll("table.sortable")' in script and 'addEventListener("click"' in script
    assert "Number(" in script  # numeric columns sort as numbers
    main_table = html[html.index('<table class="sortable list">'):html.index("</table>")]
    headers = re.findall(r"<th( data-type=\"num\")?>([^<]*)</th>", main_table)
    assert [h for _, h in headers] == [c.header.replace("&", "&amp;") for c in COLUMNS]
    assert {h for numeric, h in headers if numeric} >= {"rank", "nodes", "score (OPS)", "OPS per watt"}
    # Each numeric cell carries its raw value, so "2 Peta-OPS" sorts above "200 Tera-OPS".
    assert 'data-sort="2e+16"' in main_table and 'data-sort="200000000000000.0"' in main_table
    assert 'data-sort="800"' in main_table  # accelerators sort by count, not by model name


def test_html_plot_has_log_axes_and_an_efficiency_legend():
    html = render_html(rank([
        verdict("one.tar.gz", system_name="One", score=1e12, nodes=1, per_node=1, efficiency_declared=0.6),
        verdict("ten.tar.gz", system_name="Ten", score=1e13, nodes=1, per_node=10, efficiency_declared=0.3),
        verdict("hundred.tar.gz", system_name="Hundred", score=1e14, nodes=10, per_node=10,
                efficiency_declared=0.05, official=False),
    ]))
    svg = html[html.index('<svg role="img"'):html.index("</svg>")]
    assert "log-log" in svg and "accelerators (log scale)" in svg and "score, OPS (log scale)" in svg
    circles = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)" r="6" fill="([^"]+)" stroke="([^"]+)"[^>]*><title>',
                         svg)
    assert len(circles) == 3
    circles.sort(key=lambda c: float(c[0]))  # drawn in rank order: Ten, One, Hundred
    xs = [float(c[0]) for c in circles]
    ys = [float(c[1]) for c in circles]
    # Equal ratios, equal distances: 1 -> 10 -> 100 accelerators, 1 -> 10 -> 100 Tera-OPS.
    assert abs((xs[1] - xs[0]) - (xs[2] - xs[1])) < 0.2 and xs[1] - xs[0] > 50
    assert abs((ys[0] - ys[1]) - (ys[1] - ys[2])) < 0.2 and ys[0] - ys[1] > 50
    fills, strokes = [c[2] for c in circles], [c[3] for c in circles]
    assert len(set(strokes)) == 3  # three efficiency bands, three colours
    assert fills[:2] == strokes[:2] and fills[2] == "#fff"  # the unofficial one is hollow
    for label in ("One", "Ten", "Hundred", "efficiency vs declared peak", ">= 50%", "< 10%", "unofficial"):
        assert f">{label.replace('<', '&lt;').replace('>', '&gt;')}</text>" in svg
    for tick in (">1</text>", ">10</text>", ">100</text>", ">1 Tera-OPS</text>", ">100 Tera-OPS</text>"):
        assert tick in svg


def test_an_empty_list_renders():
    ranking = rank([rejected_verdict("bad.tar.gz", ["not a gzip file"])])
    assert ranking.entries == [] and ranking.green == []
    assert "no accepted submission" in render_text(ranking)
    assert "No accepted submission" in render_html(ranking) and "no data" in render_html(ranking)
    assert render_csv(ranking).count("\n") == 1


def test_text_table_keeps_control_characters_off_the_terminal():
    text = render_text(rank([verdict("a.tar.gz", system_name="evil\x1b[2J\nname")]))
    assert "\x1b" not in text and "evil?[2J?name" in text


# ----------------------------------------------------------------------------------------------
# The command, with a fake check


class FakeVerdict:
    def __init__(self, data):
        self.data = data

    def to_dict(self):
        return self.data


def fake_check(verdicts):
    def check(path):
        if path not in verdicts:
            raise SubmissionError(f"{path}: not a gzip file")
        return FakeVerdict(verdicts[path])
    return check


@pytest.fixture
def fake_check_module(monkeypatch):
    """Stands in for aiperf_core.submission.check, which `aiperf rank` imports when it runs."""
    def install(verdicts):
        module = types.ModuleType("aiperf_core.submission.check")
        module.check_submission = fake_check(verdicts)
        monkeypatch.setitem(sys.modules, "aiperf_core.submission.check", module)
    return install


def test_rank_paths_reports_progress_and_rejects_an_unreadable_package(capsys):
    verdicts = {"a.tar.gz": verdict("a.tar.gz"), "b.tar.gz": verdict("b.tar.gz", system_name="B", official=False)}
    ranking, unread = rank_paths(["a.tar.gz", "b.tar.gz", "junk.tar.gz"], check=fake_check(verdicts))
    assert (ranking.workload, unread.workload, unread.entries) == ("cnn", None, [])
    assert files(ranking.entries) == ["a.tar.gz", "b.tar.gz"]
    assert unread.rejected == [{"file": "junk.tar.gz", "submission_id": None, "run_id": None, "system_name": None,
                                 "site": None, "reasons": ["junk.tar.gz: not a gzip file"]}]
    assert capsys.readouterr().err.splitlines() == [
        "checking 1/3 a.tar.gz ... ACCEPTED official", "checking 2/3 b.tar.gz ... ACCEPTED unofficial",
        "checking 3/3 junk.tar.gz ... REJECTED"]


def test_rank_command_prints_the_table_and_writes_html_and_csv(tmp_path, capsys, fake_check_module):
    fake_check_module({"a.tar.gz": verdict("a.tar.gz", score=2e12),
                       "b.tar.gz": verdict("b.tar.gz", system_name="B", score=3e12)})
    html, table = tmp_path / "out" / "list.html", tmp_path / "list.csv"
    assert main(["rank", "a.tar.gz", "b.tar.gz", "a.tar.gz", "--html", str(html), "--csv", str(table)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("aiperf cnn list (rules version 1): 2 system(s) ranked, 0 superseded, 1 rejected")
    assert "same submission as a.tar.gz" in out
    assert "checking 3/3 a.tar.gz ... ACCEPTED official" in err and f"wrote {html}" in err
    assert "sub-b" in html.read_text() and "<svg" in html.read_text()
    assert [r["submission id"] for r in csv.DictReader(table.open())] == ["sub-b", "sub-a"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["list.csv", "list.html", "out"]  # no temporary left


def test_rank_command_json(capsys, fake_check_module):
    fake_check_module({"a.tar.gz": verdict("a.tar.gz")})
    assert main(["rank", "a.tar.gz", "junk.tar.gz", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"format", "lists"} and printed["format"] == 2  # docs/submission.md, "The JSON's format"
    cnn, unread = printed["lists"]
    assert [e["rank"] for e in cnn["entries"]] == [1] and cnn["entries"][0]["submission_id"] == "sub-a"
    assert unread["workload"] is None and unread["rejected"][0]["reasons"] == ["junk.tar.gz: not a gzip file"]
    assert set(cnn) == {"workload", "rules_version", "entries", "green", "superseded", "rejected"} and cnn["workload"] == "cnn"
    assert cnn["rules_version"] == 1 and unread["rules_version"] is None


def test_rank_command_exits_1_when_nothing_is_ranked(capsys, fake_check_module):
    fake_check_module({"bad.tar.gz": rejected_verdict("bad.tar.gz", ["manifest does not match"])})
    assert main(["rank", "bad.tar.gz", "junk.tar.gz"]) == 1
    out = capsys.readouterr().out
    assert "manifest does not match" in out and "junk.tar.gz: not a gzip file" in out


def test_rank_command_bad_input_exits_2(tmp_path, capsys, fake_check_module):
    fake_check_module({"a.tar.gz": verdict("a.tar.gz")})
    assert main(["rank"]) == 2
    assert "SUBMISSION" in capsys.readouterr().err
    (tmp_path / "list.html").mkdir()
    assert main(["rank", "a.tar.gz", "--html", str(tmp_path / "list.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"aiperf: error: --html {tmp_path / 'list.html'}: is a folder, not a file"]  # before any check
    assert list((tmp_path / "list.html").iterdir()) == []


def test_each_workload_has_its_own_list_and_a_package_never_read_its_own():
    from aiperf_core.submission.ranking import lists_to_dict, rank_lists, render_lists_csv, render_lists_html, \
        render_lists_text

    lm_best = {**verdict("lm-a.tar.gz", system_name="Big", score=9e15), "workload": "lm"}
    lm_other = {**verdict("lm-b.tar.gz", system_name="Small", score=1e12), "workload": "lm"}
    cnn = {**verdict("cnn.tar.gz", system_name="Small", score=5e12), "workload": "cnn"}
    unread = {**rejected_verdict("bad.tar.gz", ["not a gzip file"]), "workload": None}
    lists = rank_lists([lm_best, unread, cnn, lm_other])
    assert [r.workload for r in lists] == ["cnn", "lm", None]
    cnn_list, lm_list, unread_list = lists
    assert [(e["file"], e["rank"]) for e in cnn_list.entries] == [("cnn.tar.gz", 1)]
    assert [(e["file"], e["rank"]) for e in lm_list.entries] == [("lm-a.tar.gz", 1), ("lm-b.tar.gz", 2)]
    assert unread_list.entries == [] and [r["file"] for r in unread_list.rejected] == ["bad.tar.gz"]
    # The same system in two lists is not superseded: its results rank in each.
    assert not cnn_list.superseded and not lm_list.superseded
    data = json.loads(json.dumps(lists_to_dict(lists)))
    assert data["format"] == 2
    assert [(l["workload"], len(l["entries"])) for l in data["lists"]] == [("cnn", 1), ("lm", 2), (None, 0)]
    rows = list(csv.DictReader(io.StringIO(render_lists_csv(lists))))
    assert [(r["workload"], r["rank"]) for r in rows] == [("cnn", "1"), ("lm", "1"), ("lm", "2")]
    text = render_lists_text(lists)
    assert text.index("aiperf cnn list (rules version 1): 1 system(s)") < text.index("aiperf lm list (rules version 2): 2 system(s)") < \
        text.index("packages not read: 0 system(s)")
    html = render_lists_html(lists)
    assert html.count("<h2>The aiperf") == 2 and "The packages not read" in html and html.count("<html") == 1
