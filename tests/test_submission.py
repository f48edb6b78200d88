"""Submission packages and the reviewer's check (aiperf submit, aiperf check), on a synthetic run:
the package's contents, a run accepted as official, and one test per kind of bad input or tampering,
each failing without its check. The end-to-end path with real runs and real kit reports is in
test_submission_e2e.py."""

import gzip
import io
import json
import tarfile
import tomllib

import pytest

from aiperf_conformance.kit import LEVELS
from aiperf_core.cli import main
from aiperf_core.submission import SubmissionError
from aiperf_core.submission.check import check_submission, power_level
from aiperf_core.submission.package import MANIFEST, pack, submission_id
from aiperf_core.submission.system import to_toml, validate_system
from aiperf_core.submission.unpack import Limits
from test_score import GRAPH_1, START, RunBuilder, standard_run

CPU = "Test CPU 9000"
NODES = ("node0", "node1")
RAPL_RANGE = 1 << 40
HOST_WATTS = 150.0


def system_description(**changes) -> dict:
    d = {"schema_version": 1, "submitter": "A Team", "site": "Test Centre", "country": "DE",
         "system_name": "testbox", "availability": "research", "interconnect": "10 Gb Ethernet", "shared_storage": "none",
         "cooling": "air", "notes": "none",
         "nodes": {"count": 2, "cpu_model": CPU, "sockets": 1, "cores": 8, "threads": 16, "memory_bytes": 1 << 34,
                   "os": "Linux"},
         "accelerators": {"kind": "cpu", "model": CPU, "per_node": 1, "memory_bytes": 0, "driver": "none",
                          "peak_ops": {"fp32": 1e12, "bf16": 2e12, "fp16": 2e12}},
         "software": {"python": "3.11", "aiperf": "0.1.0", "frameworks": {"numpy": "2.0"}}}
    for dotted, value in changes.items():
        table = d
        *parents, key = dotted.split(".")
        for parent in parents:
            table = table[parent]
        table[key] = value
    return d


def kit_report(**changes) -> dict:
    precisions = ["fp32", "bf16", "fp16"]
    checks = [{"level": level, "name": "x", "status": "pass", "precision": p} for level in LEVELS for p in precisions]
    report = {"backend": "numpy", "framework_version": "numpy 2.0", "levels": list(LEVELS), "device": "cpu",
              "device_model": CPU, "precisions": precisions, "quick": False, "checks": checks}
    report.update(changes)
    return report


def write_monitors(run_root, energy: bool = False) -> None:
    """A host record per replica (the inventory the check compares against) and, with `energy`,
    RAPL samples every 30 s over the scored window at HOST_WATTS per node."""
    for replica, host in enumerate(NODES):
        record = {"kind": "host", "time": START, "host": host, "pid": 1, "cpus": 16, "cpu_model": CPU, "sockets": 1,
                  "cores": 8, "memory_total": 1 << 34, "accelerators": [], "nvml": "unavailable: test",
                  "visible": "all", "psutil": "ok", "rapl": "ok" if energy else "unavailable: test",
                  "rapl_zones": [{"zone": "intel-rapl:0", "name": "package-0", "max_energy_range_uj": RAPL_RANGE}]
                  if energy else []}
        lines = [record]
        for k in range(31):
            sample = {"kind": "sample", "time": START + 30 * k, "cpu_percent": 50.0, "memory_percent": 10.0,
                      "memory_used": 1, "accelerators": []}
            if energy:
                sample["host_energy_uj"] = {"intel-rapl:0": int(30 * k * HOST_WATTS * 1e6)}
            lines.append(sample)
        folder = run_root / "replicas" / str(replica)
        (folder / "monitor.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def run_dir(tmp_path):
    builder = standard_run(tmp_path / "run")
    builder.finish(1900)
    write_monitors(tmp_path / "run")
    return tmp_path / "run"


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "system.toml").write_text(to_toml(validate_system(system_description())))
    (tmp_path / "kit.json").write_text(json.dumps(kit_report()))
    return tmp_path / "system.toml", tmp_path / "kit.json"


@pytest.fixture
def package(run_dir, inputs, tmp_path):
    system, kit = inputs
    path, _ = pack(run_dir, system, [kit], tmp_path / "sub.tar.gz")
    return path


def members(path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}


def repack(files: dict[str, bytes], path, manifest: bool = True) -> None:
    """Write `files` as a package; with `manifest`, a MANIFEST.json made anew for them (a forger's
    package whose manifest matches)."""
    files = dict(files)
    if manifest:
        listed = {name: {"sha256": __import__("hashlib").sha256(data).hexdigest(), "size": len(data)}
                  for name, data in files.items() if name != MANIFEST}
        old = json.loads(files[MANIFEST])
        old.update(files=listed, submission_id=submission_id(listed))
        files[MANIFEST] = json.dumps(old).encode()
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def check_cli(capsys, path) -> tuple[int, str, str]:
    code = main(["check", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def bad_input(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- the package ------------------------------------------------------------------------------
def test_the_package_holds_the_run_without_weights_and_a_manifest(package, run_dir):
    files = members(package)
    assert list(files)[-1] == MANIFEST
    assert {"system.toml", "conformance/1.json", "run/run.json", "run/score.json", "run/summary.json",
            "run/report.html", "run/primary/events.jsonl", "run/replicas/0/events.jsonl",
            "run/replicas/1/monitor.jsonl", "run/trials/r0000-t00000/graph.json",
            "run/trials/r0000-t00000/trial.json"} <= set(files)
    assert not any(name.endswith((".npz", "heartbeat.json", "lease.json")) for name in files)
    manifest = json.loads(files[MANIFEST])
    assert set(manifest["files"]) == set(files) - {MANIFEST}
    assert manifest["submission_id"] == submission_id(manifest["files"])
    assert files["run/run.json"] == (run_dir / "run.json").read_bytes()


def test_the_same_files_pack_to_the_same_bytes_and_id(run_dir, inputs, tmp_path):
    a, id_a = pack(run_dir, *inputs[:1], [inputs[1]], tmp_path / "a.tar.gz")
    __import__("time").sleep(1.1)  # a second later: nothing in the package may record when it was packed
    b, id_b = pack(run_dir, *inputs[:1], [inputs[1]], tmp_path / "b.tar.gz")
    assert id_a == id_b and a.read_bytes() == b.read_bytes()


def test_a_clean_package_is_accepted_as_official(package, capsys):
    verdict = check_submission(package)
    assert verdict.accepted and verdict.official, verdict.render()
    data = verdict.to_dict()
    assert data["verdict"] == "ACCEPTED" and data["system"]["nodes"] == 2 and data["accelerators"] == 2
    assert data["precisions"] == ["bf16", "fp16", "fp32"] and data["backend"] == "numpy"
    assert data["declared_peak_ops"] == 2e12 * 2  # the highest peak among the trained precisions, x 2 devices
    assert data["efficiency_declared"] == pytest.approx(data["score_ops"] / 4e12)
    assert data["energy"]["measured"] is False and data["energy"]["statement"].startswith("not measured")
    code, out, _ = check_cli(capsys, package)
    assert code == 0 and "ACCEPTED official" in out
    assert main(["check", "--json", str(package)]) == 0
    assert json.loads(capsys.readouterr().out)["submission_id"] == data["submission_id"]


# -- submit refuses ---------------------------------------------------------------------------
def test_submit_refuses_a_run_that_has_not_ended(tmp_path, inputs, capsys):
    standard_run(tmp_path / "live")  # no run_end
    err = bad_input(capsys, ["submit", str(tmp_path / "live"), "--system", str(inputs[0]), "--conformance",
                             str(inputs[1]), "--out", str(tmp_path / "x.tar.gz")])
    assert "the run has not ended" in err and not (tmp_path / "x.tar.gz").exists()


def test_submit_refuses_a_run_that_fails_verify(run_dir, inputs, tmp_path, capsys):
    graph = run_dir / "trials/r0000-t00000/graph.json"
    graph.write_text(graph.read_text().replace(" ", "  "))
    err = bad_input(capsys, ["submit", str(run_dir), "--system", str(inputs[0]), "--conformance", str(inputs[1]),
                             "--out", str(tmp_path / "x.tar.gz")])
    assert "fails aiperf score --verify: trials/r0000-t00000/graph.json" in err
    assert not list(tmp_path.glob("*.tar.gz")) and not list(tmp_path.glob(".x.tar.gz*"))


@pytest.mark.parametrize("field, value, expected", [
    ("site", "<institution>", "site: placeholder left"),
    ("accelerators.peak_ops.fp32", -1e12, "accelerators.peak_ops.fp32"),
    ("accelerators.peak_ops.fp8", 1e12, "accelerators.peak_ops.fp8"),
])
def test_submit_refuses_a_bad_system_description(run_dir, inputs, tmp_path, capsys, field, value, expected):
    bad = system_description(**{field: value})
    inputs[0].write_text(to_toml(bad))
    err = bad_input(capsys, ["submit", str(run_dir), "--system", str(inputs[0]), "--conformance", str(inputs[1]),
                             "--out", str(tmp_path / "x.tar.gz")])
    assert expected in err and not (tmp_path / "x.tar.gz").exists()


def test_submit_refuses_a_peak_file_that_does_not_parse(run_dir, inputs, tmp_path, capsys):
    (tmp_path / "peak.json").write_text("{not json")
    err = bad_input(capsys, ["submit", str(run_dir), "--system", str(inputs[0]), "--conformance", str(inputs[1]),
                             "--peak", str(tmp_path / "peak.json"), "--out", str(tmp_path / "x.tar.gz")])
    assert "peak.json" in err and not (tmp_path / "x.tar.gz").exists()


def test_submit_refuses_to_overwrite_without_force(package, run_dir, inputs, capsys):
    err = bad_input(capsys, ["submit", str(run_dir), "--system", str(inputs[0]), "--conformance", str(inputs[1]),
                             "--out", str(package)])
    assert "exists (use --force" in err


# -- packages that cannot be read: bad input, exit 2, nothing outside the temporary directory ----
def test_a_truncated_package(package, capsys):
    data = package.read_bytes()
    package.write_bytes(data[: len(data) // 2])
    code, _, err = check_cli(capsys, package)
    assert code == 2 and "truncated or corrupt" in err and len(err.strip().splitlines()) == 1


def test_a_file_that_is_not_gzip(tmp_path, capsys):
    (tmp_path / "x.tar.gz").write_bytes(b"PK\x03\x04 a zip, say")
    code, _, err = check_cli(capsys, tmp_path / "x.tar.gz")
    assert code == 2 and "not a gzip file" in err


def _tar_with(path, info: tarfile.TarInfo, data: bytes = b"") -> None:
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(info, io.BytesIO(data) if data else None)


@pytest.mark.parametrize("name, kind, expected", [
    ("../escaped", tarfile.REGTYPE, "unsafe path"),
    ("run/../../escaped", tarfile.REGTYPE, "unsafe path"),
    ("/tmp/aiperf-escaped", tarfile.REGTYPE, "unsafe path"),
    ("run/link", tarfile.SYMTYPE, "symbolic link"),
    ("run/hard", tarfile.LNKTYPE, "hard link"),
    ("run/dev", tarfile.CHRTYPE, "device"),
    ("run/fifo", tarfile.FIFOTYPE, "FIFO"),
])
def test_unsafe_members_are_refused(tmp_path, capsys, name, kind, expected):
    info = tarfile.TarInfo(name)
    info.type = kind
    data = b""
    if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
        info.linkname = "/etc/passwd"
    elif kind == tarfile.REGTYPE:
        data = b"x"
        info.size = 1
    _tar_with(tmp_path / "evil.tar.gz", info, data)
    code, _, err = check_cli(capsys, tmp_path / "evil.tar.gz")
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert not __import__("pathlib").Path("/tmp/aiperf-escaped").exists()


def test_a_member_over_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys):
    info = tarfile.TarInfo("run/huge")
    info.size = 3 << 30  # the header claims 3 GiB; the stream ends long before
    (tmp_path / "bomb.tar.gz").write_bytes(gzip.compress(info.tobuf(tarfile.PAX_FORMAT) + b"\0" * 4096))
    code, _, err = check_cli(capsys, tmp_path / "bomb.tar.gz")
    assert code == 2 and "over the limit" in err


def test_a_tar_bomb_is_refused_at_the_total_and_member_limits(package):
    with pytest.raises(SubmissionError, match="over the limit of 1000"):
        check_submission(package, Limits(max_member_bytes=1000))
    with pytest.raises(SubmissionError, match="add up to more than 20000 bytes"):
        check_submission(package, Limits(max_total_bytes=20000))
    with pytest.raises(SubmissionError, match="more than 5 members"):
        check_submission(package, Limits(max_members=5))


def test_a_member_given_twice_is_refused(package, tmp_path):
    files = members(package)
    with tarfile.open(tmp_path / "twice.tar.gz", "w:gz") as tar:
        for name, data in list(files.items()) + [("run/run.json", b"{}")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(SubmissionError, match="'run/run.json' appears twice"):
        check_submission(tmp_path / "twice.tar.gz")


# -- tampering: read fine, REJECTED (exit 1) with the reason ------------------------------------
def test_a_file_changed_after_packing(package, tmp_path, capsys):
    files = members(package)
    files["run/trials/r0000-t00000/trial.json"] += b" "
    repack(files, tmp_path / "t.tar.gz", manifest=False)
    code, out, _ = check_cli(capsys, tmp_path / "t.tar.gz")
    assert code == 1 and "run/trials/r0000-t00000/trial.json: content differs from MANIFEST.json" in out


def test_a_manifest_whose_id_does_not_match(package, tmp_path):
    files = members(package)
    manifest = json.loads(files[MANIFEST])
    manifest["submission_id"] = "aiperf-00000000000000000000"
    files[MANIFEST] = json.dumps(manifest).encode()
    repack(files, tmp_path / "t.tar.gz", manifest=False)
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted and any("submission_id" in r for r in verdict.rejections)


def test_a_file_not_in_the_manifest(package, tmp_path):
    files = members(package)
    files["run/extra.json"] = b"{}"
    repack(files, tmp_path / "t.tar.gz", manifest=False)
    assert "run/extra.json: in the package but not in MANIFEST.json" in check_submission(tmp_path / "t.tar.gz").reasons


def test_a_forged_log_with_a_matching_manifest_fails_the_hash_chain(package, tmp_path):
    files = members(package)
    log = files["run/replicas/0/events.jsonl"].decode().splitlines()
    event = json.loads(log[2])
    event["train_images"] = event.get("train_images", 0) * 100
    log[2] = json.dumps(event)
    files["run/replicas/0/events.jsonl"] = ("\n".join(log) + "\n").encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted
    assert any(r.startswith("verify: run/replicas/0/events.jsonl: line") and "hash chain broken" in r
               for r in verdict.rejections), verdict.reasons


def test_a_stored_score_that_differs_is_reported_and_the_recomputed_one_used(package, tmp_path):
    files = members(package)
    score = json.loads(files["run/score.json"])
    true_score = score["score_ops"]
    score["score_ops"] *= 10
    files["run/score.json"] = json.dumps(score).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert verdict.accepted and verdict.score_ops == pytest.approx(true_score)
    assert any("run/score.json: stored score_ops" in f for f in verdict.findings)


def test_placeholders_in_a_packaged_description(package, tmp_path):
    files = members(package)
    files["system.toml"] = files["system.toml"].replace(b'site = "Test Centre"', b'site = "<institution>"')
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted and any("system.toml: site: placeholder left" in r for r in verdict.rejections)


@pytest.mark.parametrize("changes, expected", [
    ({"quick": True}, "a quick run"),
    ({"backend": "torch"}, "for backend 'torch', not 'numpy'"),
    ({"device_model": "Other CPU"}, "on 'Other CPU', not the run's 'Test CPU 9000'"),
    ({"framework_version": "numpy 1.0"}, "for framework version 'numpy 1.0'"),
    ({"levels": ["op", "graph"]}, "levels not run: morph"),
    ({"precisions": ["fp32", "fp16"]}, "not certified on 'Test CPU 9000' at bf16: no conforming report"),
])
def test_a_conformance_report_that_does_not_certify(package, tmp_path, changes, expected):
    files = members(package)
    files["conformance/1.json"] = json.dumps(kit_report(**changes)).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted and any(expected in r for r in verdict.rejections), verdict.rejections


def test_a_report_with_a_failed_check_does_not_certify_whatever_it_claims(package, tmp_path):
    report = kit_report(ok=True, certifies=True)
    report["checks"][0]["status"] = "fail"
    files = members(package)
    files["conformance/1.json"] = json.dumps(report).encode()
    repack(files, tmp_path / "t.tar.gz")
    assert any("does not conform (1 failed" in r for r in check_submission(tmp_path / "t.tar.gz").rejections)


def test_two_reports_may_certify_different_precisions(package, tmp_path):
    files = members(package)
    files["conformance/1.json"] = json.dumps(kit_report(precisions=["fp32", "fp16"])).encode()
    files["conformance/2.json"] = json.dumps(kit_report(precisions=["bf16"])).encode()
    repack(files, tmp_path / "t.tar.gz")
    assert check_submission(tmp_path / "t.tar.gz").accepted


@pytest.mark.parametrize("changes, expected", [
    ({"nodes.count": 3}, "nodes.count is 3, but the run recorded 2 host(s)"),
    ({"nodes.cpu_model": "Other CPU", "accelerators.model": "Other CPU"},
     "nodes.cpu_model is 'Other CPU', but the run recorded 'Test CPU 9000'"),
    ({"accelerators.kind": "gpu", "accelerators.model": "H100", "accelerators.per_node": 8,
      "accelerators.memory_bytes": 80 << 30},
     "accelerators.kind is 'gpu', but the run trained on CPU devices"),
])
def test_the_description_is_checked_against_the_runs_inventory(package, tmp_path, changes, expected):
    files = members(package)
    files["system.toml"] = to_toml(system_description(**changes)).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted and any(expected in r for r in verdict.rejections), verdict.rejections


def test_a_score_above_the_declared_peak_is_implausible(tmp_path, inputs):
    builder = RunBuilder(tmp_path / "run")
    builder.replica_start(0, START)
    builder.replica_start(1, START)
    trial = builder.trial_start(0, START, GRAPH_1, "fp16")
    builder.epoch(0, trial, START + 500, 0, 10**6, 200, 0.8)  # ~1e13 operations in 900 s: ~1e10 OPS
    builder.trial_end(0, trial, START + 500, epochs=1, best=0.8)
    builder.finish(START + 900)
    write_monitors(tmp_path / "run")
    inputs[0].write_text(to_toml(system_description(**{"accelerators.peak_ops": {"fp32": 1e9, "fp16": 1e9}})))
    path, _ = pack(tmp_path / "run", inputs[0], [inputs[1]], tmp_path / "t.tar.gz")
    verdict = check_submission(path)
    assert verdict.score_ops > 2e9
    assert any(r.startswith("implausible: the score") and "exceeds the declared peak 2.00 Giga-OPS (2 device(s))" in r
               for r in verdict.rejections), verdict.rejections


def test_a_peak_file_that_does_not_parse_in_a_package(package, tmp_path):
    files = members(package)
    files["peak.json"] = b"{not json"
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert not verdict.accepted and any(r.startswith("peak.json") for r in verdict.rejections), verdict.rejections


# -- energy ------------------------------------------------------------------------------------
def test_energy_coverage_and_power_level(tmp_path, inputs):
    builder = standard_run(tmp_path / "run")
    builder.finish(1900)
    write_monitors(tmp_path / "run", energy=True)
    path, _ = pack(tmp_path / "run", inputs[0], [inputs[1]], tmp_path / "e.tar.gz")
    verdict = check_submission(path)
    energy = verdict.energy
    score = json.loads((tmp_path / "run/score.json").read_text())
    joules = 2 * HOST_WATTS * 900  # two nodes sampled from the start to the deadline
    assert energy["measured"] and energy["joules"] == pytest.approx(joules)
    assert energy["node_coverage"] == 1.0 and energy["time_coverage"] == pytest.approx(1.0)
    assert energy["level"] == "L3"
    assert energy["ops_per_watt"] == pytest.approx(score["total_ops"] / joules)


def test_power_levels():
    assert power_level(1.0, 0.99, True) == "L3"
    assert power_level(1.0, 0.99, False) == "L2"
    assert power_level(0.5, 0.85, True) == "L2"
    assert power_level(0.05, 0.5, True) == "L1"
    assert power_level(0.01, 0.5, True) is None
    assert power_level(1.0, 0.1, True) is None


def test_the_description_written_for_tests_is_valid_toml():
    assert tomllib.loads(to_toml(system_description()))["nodes"]["count"] == 2


def test_a_measured_peak_above_the_declared_one_is_reported(package, tmp_path):
    files = members(package)
    measured = {p: {"ops_per_s": 2 * 1024**3 / 1e-4, "size": 1024, "best_seconds": 1e-4, "repeats": 3}
                for p in ("fp32", "bf16", "fp16")}  # 21.5 Tera-OPS per device, against 2 declared
    files["peak.json"] = json.dumps({"schema_version": 1, "kind": "aiperf-peak", "backend": "numpy",
                                     "framework_version": "1", "host": "n1", "measured_at": "2026-11-25T00:00:00+00:00",
                                     "devices": [{"device": "cpu", "model": "Test CPU 9000",
                                                  "precisions": measured}]}).encode()
    repack(files, tmp_path / "t.tar.gz")
    verdict = check_submission(tmp_path / "t.tar.gz")
    assert verdict.accepted, verdict.rejections
    assert any(f.startswith("the measured matrix-multiply peak") and "is 10.7x the declared peak" in f
               and "looks understated" in f for f in verdict.findings), verdict.findings
