"""`aiperf submit`: a finished run directory, its system description, conformance reports and
measured peak, packed into one NAME.tar.gz with a SHA-256 manifest.

Layout inside the package (flat, no leading folder):

    MANIFEST.json                 last member: every other member's sha256 and size, and the id
    system.toml                   the site's description (aiperf_core.submission.system)
    peak.json                     optional: `aiperf peak`'s measurement
    conformance/<k>.json          the kit reports, numbered in the order given
    run/run.json, run/score.json, run/summary.json, run/report.html
    run/primary/events.jsonl
    run/replicas/<I>/events.jsonl, run/replicas/<I>/monitor.jsonl (and monitor-node<K>.jsonl of its other nodes)
    run/trials/<T>/graph.json, run/trials/<T>/trial.json

Weights stay home: trial_end.files pins their hashes in the logs. Heartbeats, leases, crash tails
and the executor's job files are left out: nothing scores from them.

The submission id is derived from the manifest's file list, so two packs of the same files carry the
same id, and any change to any file changes it. Members are written in sorted order with fixed
owner, mode and time, so the same input gives the same bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

from aiperf_core.atomic import new_file_mode
from aiperf_core.submission import SubmissionError

MANIFEST = "MANIFEST.json"
MANIFEST_KIND = "aiperf-submission"
MANIFEST_SCHEMA_VERSION = 1
RUN_PREFIX = "run/"
TRIAL_FILES = ("graph.json", "trial.json")
RUN_FILES = ("run.json", "score.json", "summary.json", "report.html")
# What a package leaves out, its hashes kept in the logs: each trial's weights (trial_end.files), and
# the published history (run_end.history_head), which nothing scores from and the packaged logs and
# trial.json files rebuild. A trial file is named alone, a run file by its path in the run.
WITHHELD = frozenset({"weights.npz", "primary/history.jsonl"})
GZIP_LEVEL = 6  # zlib's default: level 9 is about 3x slower for a few per cent


def submission_id(files: dict[str, dict]) -> str:
    """'aiperf-' + the first 20 hex digits of the SHA-256 of the sorted 'path sha256 size' lines."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(f"{path} {files[path]['sha256']} {files[path]['size']}\n".encode())
    return "aiperf-" + digest.hexdigest()[:20]


def run_members(run_dir: Path) -> list[tuple[str, Path]]:
    """(name in the package, path on disk) of every run file a package carries, sorted."""
    from aiperf_core.rundir import RunDir

    run = RunDir(run_dir)
    members = [(RUN_PREFIX + name, run.root / name) for name in RUN_FILES if (run.root / name).is_file()]
    members.append((RUN_PREFIX + "primary/events.jsonl", run.primary_log))
    for replica in run.replica_ids():
        for path in (run.replica_log(replica), *run.monitor_logs(replica)):
            if path.is_file():
                members.append((f"{RUN_PREFIX}replicas/{replica}/{path.name}", path))
    trials = run.root / "trials"
    if trials.is_dir():
        for folder in sorted(p for p in trials.iterdir() if p.is_dir()):
            for name in TRIAL_FILES:
                if (folder / name).is_file():
                    members.append((f"{RUN_PREFIX}trials/{folder.name}/{name}", folder / name))
    return sorted(members)


def check_packable(run_dir: Path) -> None:
    """Refuse, in one line, a run that has not ended or that fails `aiperf score --verify`."""
    from aiperf_core.scoring import score_run, verify_run

    if not (run_dir / "run.json").is_file():
        raise SubmissionError(f"{run_dir}: not a run directory (no run.json)")
    result = score_run(run_dir)
    if not result.ended:
        raise SubmissionError(f"{run_dir}: the run has not ended (no run_end in primary/events.jsonl): "
                              "submit a finished run")
    problems = verify_run(run_dir)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise SubmissionError(f"{run_dir}: fails aiperf score --verify: {problems[0]}{more}")
    refresh_derived(run_dir)


def refresh_derived(run_dir: Path) -> None:
    """score.json, summary.json and report.html rewritten from the logs, so that what the package
    shows equals what the check recomputes; a read-only run directory keeps the ones it has."""
    from aiperf_core.commands.score import score_and_record
    from aiperf_core.report import write_report

    score_and_record(run_dir)
    try:
        write_report(run_dir, as_of_run_end=True)
    except OSError as exc:
        print(f"aiperf: warning: report not rewritten: {exc}", file=sys.stderr)
    for name in RUN_FILES:
        if not (run_dir / name).is_file():
            raise SubmissionError(f"{run_dir / name}: missing, and the run directory cannot be written to "
                                  "make it (run `aiperf report` where it can)")


def load_conformance_report(path: Path) -> dict:
    """A kit report as JSON, with the fields the check reads; a file that is not one is refused."""
    try:
        report = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SubmissionError(f"{path}: cannot read the conformance report: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise SubmissionError(f"{path}: not JSON: {exc}") from None
    if not isinstance(report, dict):
        raise SubmissionError(f"{path}: a conformance report is a JSON object")
    for key, kind in (("backend", str), ("levels", list), ("precisions", list), ("checks", list), ("quick", bool)):
        if not isinstance(report.get(key), kind):
            raise SubmissionError(f"{path}: {key}: missing or not a {kind.__name__} (not an aiperf conformance report?)")
    if "workload_scope" in report and not isinstance(report["workload_scope"], list):  # absent: from before it
        raise SubmissionError(f"{path}: workload_scope: not a list (not an aiperf conformance report?)")
    return report


def pack(run_dir: str | os.PathLike, system: str | os.PathLike, conformance: Iterable[str | os.PathLike],
         out: str | os.PathLike, peak: str | os.PathLike | None = None,
         progress: Callable[[str], None] | None = None) -> tuple[Path, str]:
    """Check the inputs, write the package atomically at `out`; returns (path, submission id)."""
    from aiperf_core.submission.system import load_system

    run_dir, out = Path(run_dir), Path(out)
    conformance = [Path(p) for p in conformance]
    if not conformance:
        raise SubmissionError("no conformance report given: certify the backend with `aiperf conformance "
                              "--backend NAME --report R.json` and pass --conformance R.json")
    load_system(system)
    for path in conformance:
        load_conformance_report(path)
    if peak is not None:
        from aiperf_core.submission.peak import load_peak

        load_peak(peak)
    say = progress or (lambda message: None)
    check_packable(run_dir)

    members = [("system.toml", Path(system))]
    members += [(f"conformance/{k}.json", path) for k, path in enumerate(conformance, 1)]
    if peak is not None:
        members.append(("peak.json", Path(peak)))
    members += run_members(run_dir)
    if not out.parent.is_dir():
        raise SubmissionError(f"{out}: its folder {out.parent} does not exist")

    files: dict[str, dict] = {}
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as zipped:
                with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
                    started, last = time.monotonic(), time.monotonic()
                    for k, (name, path) in enumerate(members, 1):
                        data = path.read_bytes()
                        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                        _add(tar, name, data)
                        if time.monotonic() - last > 2.0:
                            last = time.monotonic()
                            say(f"packed {k}/{len(members)} files ({time.monotonic() - started:.0f} s)")
                    ident = submission_id(files)
                    manifest = {"kind": MANIFEST_KIND, "schema_version": MANIFEST_SCHEMA_VERSION,
                                # No packing time: the same files must pack to the same bytes.
                                "submission_id": ident, "aiperf": _aiperf_version(), "withheld": sorted(WITHHELD),
                                "files": files}
                    _add(tar, MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
    except OSError as exc:
        _remove(tmp)
        raise SubmissionError(f"{out}: cannot write the package: {exc.strerror or exc}") from None
    except BaseException:
        _remove(tmp)
        raise
    return out, ident


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = len(data), 0o644, 0, tarfile.REGTYPE
    tar.addfile(info, io.BytesIO(data))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _aiperf_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiperf")
    except PackageNotFoundError:  # pragma: no cover - a source tree that was never installed
        return None


def print_progress(message: str) -> None:
    print(f"aiperf submit: {message}", file=sys.stderr, flush=True)
