"""`aiperf score --verify`: check the content hashes recorded while the run was written.

- every event log's hash chain (each line pins the one before it);
- the primary's run_end.log_heads, which pin the last line of every replica log, so that lines
  removed from or added to the end of a log are caught too;
- trial_start.graph_sha256 against trials/<trial>/graph.json;
- trial_end.files against the files each trial wrote.
Each problem is one line naming the file; an empty list means the run directory is intact.
"""

from __future__ import annotations

import os

from aiperf_core.rundir import RunDir, chain_head, read_events, sha256_file, verify_chain

PRIMARY_LOG = "primary/events.jsonl"


def verify_run(run_dir: str | os.PathLike | RunDir, withheld: frozenset[str] = frozenset()) -> list[str]:
    """`withheld`: trial file names left out on purpose (a submission keeps weights home); their absence
    is no problem, their recorded hashes still stand in the logs."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    run.read_run()  # a missing or malformed run.json is an error, not a finding
    problems: list[str] = []
    replicas = run.replica_ids()
    logs = [(PRIMARY_LOG, run.primary_log)]
    logs += [(f"replicas/{r}/events.jsonl", run.replica_log(r)) for r in replicas]
    for name, path in logs:
        for problem in verify_chain(path):
            problems.append(f"{name}: missing" if problem.line == 0
                            else f"{name}: line {problem.line}: {problem.message}")

    primary = read_events(run.primary_log)
    run_end = next((e for e in reversed(primary) if e.get("event") == "run_end"), None)
    if run_end is None:
        problems.append(f"{PRIMARY_LOG}: no run_end, so nothing pins the end of the replica logs "
                        "(the run is still going or its primary died)")
    else:
        problems += _check_log_heads(run, replicas, run_end.get("log_heads"))

    hashes: dict[str, str | None] = {}  # relative path -> sha256, None when missing
    reported: set[str] = set()
    for replica in replicas:
        for event in read_events(run.replica_log(replica)):
            kind = event.get("event")
            if kind == "trial_start":
                problems += _check_file(run, hashes, reported, event.get("trial"), "graph.json",
                                        event.get("graph_sha256"), "trial_start.graph_sha256", withheld)
            elif kind == "trial_end":
                files = event.get("files") or {}
                if not isinstance(files, dict):
                    problems.append(f"replicas/{replica}/events.jsonl: trial_end of {event.get('trial')}: "
                                    "files is not an object")
                    continue
                for name, digest in sorted(files.items()):
                    problems += _check_file(run, hashes, reported, event.get("trial"), name, digest,
                                            "trial_end.files", withheld)
    return problems


def _check_log_heads(run: RunDir, replicas: list[int], heads) -> list[str]:
    if not isinstance(heads, dict):
        return [f"{PRIMARY_LOG}: run_end has no log_heads"]
    problems = []
    pinned = {str(key): value for key, value in heads.items()}
    for replica in sorted(set(replicas) | {int(k) for k in pinned if k.isdigit()}):
        name = f"replicas/{replica}/events.jsonl"
        expected = pinned.get(str(replica))
        if expected is None:
            problems.append(f"{name}: not pinned by run_end.log_heads (a replica log that appeared later)")
        elif not run.replica_log(replica).exists():
            problems.append(f"{name}: missing (pinned by run_end.log_heads)")
        elif chain_head(run.replica_log(replica)) != expected:
            problems.append(f"{name}: last line differs from run_end.log_heads "
                            "(lines added, removed or changed after the run ended)")
    return problems


def _check_file(run: RunDir, hashes: dict, reported: set, trial, name, expected, recorded_as: str,
                withheld: frozenset[str] = frozenset()) -> list[str]:
    if not all(isinstance(part, str) and part and "/" not in part and not part.startswith(".")
               for part in (trial, name)):
        return [f"{recorded_as}: bad trial or file name {trial!r}/{name!r}"]
    relative = f"trials/{trial}/{name}"
    if relative not in hashes:
        try:
            hashes[relative] = sha256_file(run.trial_dir(trial) / name)
        except FileNotFoundError:
            hashes[relative] = None
    actual = hashes[relative]
    if actual == expected or relative in reported:  # graph.json is pinned twice: say a bad file once
        return []
    reported.add(relative)
    if actual is None and name in withheld:
        return []
    if actual is None:
        return [f"{relative}: missing (recorded in {recorded_as})"]
    return [f"{relative}: content differs from {recorded_as}"]
