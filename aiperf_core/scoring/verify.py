"""`aiperf score --verify`: check the content hashes recorded while the run was written.

- every event log's hash chain (each line pins the one before it);
- the primary's run_end.log_heads, which pin the last line of every replica log, so that lines
  removed from or added to the end of a log are caught too;
- trial_start.graph_sha256 against trials/<trial>/graph.json;
- trial_end.files against the files each trial wrote;
- the published history (primary/history.jsonl), when the run has one: its hash chain, and that
  each line is a trial published once, whose trial_end and trial.json say what the line says; once
  the run ended, also that every usable trial was published (the primary publishes them all
  before run_end), and that the file ends where run_end.history_head pins it (a deleted history is
  caught; a run_end without the field, written by an aiperf before it, pins nothing). The score
  never reads the history: this is about what replicas planned on.
- each epoch_end.all_to_all (an expert-parallel epoch's communication, reported beside the score):
  its form, its bytes against opcount.communication's analytic count on the trial's pinned graph at
  its precision for the epoch's trained and evaluated samples, and bytes_per_second against bytes
  over seconds. The seconds are the backend's measurement: nothing in the run directory re-derives
  them.
- each epoch_end.all_reduce (a data-parallel epoch's gradient all-reduce, reported beside the score):
  its form; its ranks and nodes against the replica's latest replica_start (its devices times its
  nodes); its steps against the epoch's trained samples over trial_start.hyper.batch_size; an
  expert-parallel flag set wherever the epoch logged an all-to-all; bytes, inter_node_bytes and
  intra_node_bytes against opcount.communication.all_reduce_bytes on the pinned graph; and
  bytes_per_second against bytes over seconds (null seconds: the backend could not measure).
Other fields of epoch_end that scoring does not read are hashed with their line and not checked
further.
Each problem is one line naming the file; an empty list means the run directory is intact.
"""

from __future__ import annotations

import math
import os

from aiperf_core.rundir import GENESIS, RunDir, chain_head, read_events, sha256_file, verify_chain
from aiperf_core.search.history import (HISTORY_NAME, LEGACY_WORKLOAD, PUBLISHED, PUBLISHED_FIELDS, as_published,
                                        published_fields, usable_end)

PRIMARY_LOG = "primary/events.jsonl"


def verify_run(run_dir: str | os.PathLike | RunDir, withheld: frozenset[str] = frozenset()) -> list[str]:
    """`withheld`: files left out on purpose (a submission keeps the weights and the published history
    home): trial file names, and HISTORY_NAME. Their absence is no problem; their recorded hashes
    still stand in the logs."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    workload = run.read_run().get("workload", LEGACY_WORKLOAD)  # a missing or malformed run.json is an error
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
        if "history_head" in run_end and HISTORY_NAME not in withheld:
            problems += _check_history_head(run, run_end["history_head"])

    hashes: dict[str, str | None] = {}  # relative path -> sha256, None when missing
    reported: set[str] = set()
    usable: dict[str, tuple[int, dict]] = {}  # trial -> (replica, its trial_end), for the history
    communication = _AllToAllCheck(run, hashes)
    reduction = _AllReduceCheck(run, hashes)
    for replica in replicas:
        for event in read_events(run.replica_log(replica)):
            kind = event.get("event")
            if kind == "replica_start":
                reduction.replica_started(event)
            elif kind == "epoch_end" and "all_reduce" in event:
                problems += reduction.check(f"replicas/{replica}/events.jsonl", event)
            if usable_end(event):
                usable.setdefault(event["trial"], (replica, event))
            if kind == "trial_start":
                problems += _check_file(run, hashes, reported, event.get("trial"), "graph.json",
                                        event.get("graph_sha256"), "trial_start.graph_sha256", withheld)
                communication.started(event)
                reduction.started(event)
            elif kind == "epoch_end" and "all_to_all" in event:
                problems += communication.check(f"replicas/{replica}/events.jsonl", event)
            elif kind == "trial_end":
                files = event.get("files") or {}
                if not isinstance(files, dict):
                    problems.append(f"replicas/{replica}/events.jsonl: trial_end of {event.get('trial')}: "
                                    "files is not an object")
                    continue
                for name, digest in sorted(files.items()):
                    problems += _check_file(run, hashes, reported, event.get("trial"), name, digest,
                                            "trial_end.files", withheld)
    if run.history_file.exists():
        problems += _check_history(run, usable, ended=run_end is not None, workload=workload)
    return problems


class _AllToAllCheck:
    """epoch_end.all_to_all against what the run directory re-derives (the module's docstring)."""

    def __init__(self, run: RunDir, hashes: dict[str, str | None]):
        self.run = run
        self.hashes = hashes  # verify_run's: relative path -> sha256 of the file as it is now
        self.trials: dict[str, tuple] = {}  # trial -> (graph_sha256, precision) from its trial_start
        self.per_sample: dict[tuple, tuple[int, int] | str] = {}  # (sha256, precision) -> bytes, or a problem

    def started(self, event: dict) -> None:
        hyper = event.get("hyper") if isinstance(event.get("hyper"), dict) else {}
        if isinstance(event.get("trial"), str):
            self.trials.setdefault(event["trial"], (event.get("graph_sha256"), hyper.get("precision")))

    def check(self, log: str, event: dict) -> list[str]:
        trial, value = event.get("trial"), event["all_to_all"]
        where = f"{log}: epoch_end of {trial} epoch {event.get('epoch')}: all_to_all"
        moved = value.get("bytes") if isinstance(value, dict) else None
        seconds = value.get("seconds") if isinstance(value, dict) else None
        rate = value.get("bytes_per_second") if isinstance(value, dict) else None
        if (type(moved) is not int or moved < 0 or type(seconds) not in (int, float) or not 0 <= seconds < math.inf
                or (rate is not None and type(rate) not in (int, float))):
            return [f"{where}: not {{bytes: integer >= 0, seconds: number >= 0, bytes_per_second: number or null}}"]
        problems = []
        expected_rate = moved / seconds if seconds > 0 else None
        if (rate is None) != (expected_rate is None) or (
                rate is not None and not math.isclose(rate, expected_rate, rel_tol=1e-9)):
            problems.append(f"{where}: bytes_per_second {rate} is not bytes over seconds ({expected_rate})")
        start = self.trials.get(trial)
        train, val = event.get("train_images"), event.get("val_images")
        if start is None or type(train) is not int or type(val) is not int:
            return problems  # an epoch of a trial never started, or malformed counts: scoring names them
        sha, precision = start
        if not isinstance(sha, str) or self.hashes.get(f"trials/{trial}/graph.json") != sha:
            return problems  # the graph is missing or changed: its own check names it
        per_sample = self._per_sample(trial, sha, precision)
        if isinstance(per_sample, str):
            return problems + [f"{where}: {per_sample}"]
        expected = per_sample[0] * train + per_sample[1] * val
        if moved != expected:
            problems.append(f"{where}: bytes {moved} differ from the analytic {expected} (opcount.communication on "
                            f"trials/{trial}/graph.json at {precision}, {train} samples trained, {val} evaluated)")
        return problems

    def _per_sample(self, trial: str, sha: str, precision) -> tuple[int, int] | str:
        """All-to-all bytes of a trained and an evaluated sample of the pinned graph, or a problem."""
        key = (sha, precision)
        if key not in self.per_sample:
            from aiperf_core.errors import AiperfError
            from aiperf_core.ir import Graph
            from aiperf_opcount.communication import bytes_per_sample

            try:
                graph = Graph.from_json((self.run.trial_dir(trial) / "graph.json").read_text(encoding="utf-8"))
                self.per_sample[key] = (bytes_per_sample(graph, precision, True),
                                        bytes_per_sample(graph, precision, False))
            except (AiperfError, OSError, UnicodeDecodeError, TypeError) as exc:  # TypeError: an unhashable precision
                self.per_sample[key] = f"bytes not re-derivable: {exc}"
        return self.per_sample[key]


class _AllReduceCheck:
    """epoch_end.all_reduce against what the run directory re-derives (the module's docstring)."""

    FORM = ("not {bytes, inter_node_bytes, intra_node_bytes: integers >= 0, seconds: number >= 0 or null, "
            "bytes_per_second: number or null, ranks, nodes: integers >= 1, steps: integer >= 0, expert_parallel: "
            "boolean}")

    def __init__(self, run: RunDir, hashes: dict[str, str | None]):
        self.run = run
        self.hashes = hashes
        self.trials: dict[str, tuple] = {}  # trial -> (graph_sha256, batch_size)
        self.ranks: int | None = None  # the replica's devices times its nodes, from its latest replica_start
        self.nodes = 1
        self.graphs: dict[str, object] = {}  # sha256 -> Graph, or a problem

    def replica_started(self, event: dict) -> None:
        devices, nodes = event.get("devices"), event.get("nodes")
        self.nodes = len(nodes) if isinstance(nodes, list) and nodes else 1
        self.ranks = len(devices) * self.nodes if isinstance(devices, list) else None

    def started(self, event: dict) -> None:
        hyper = event.get("hyper") if isinstance(event.get("hyper"), dict) else {}
        if isinstance(event.get("trial"), str):
            self.trials.setdefault(event["trial"], (event.get("graph_sha256"), hyper.get("batch_size")))

    def check(self, log: str, event: dict) -> list[str]:
        trial, value = event.get("trial"), event["all_reduce"]
        where = f"{log}: epoch_end of {trial} epoch {event.get('epoch')}: all_reduce"
        if not isinstance(value, dict):
            return [f"{where}: {self.FORM}"]
        counts = [value.get(key) for key in ("bytes", "inter_node_bytes", "intra_node_bytes", "steps")]
        ranks, nodes, seconds, rate = (value.get(key) for key in ("ranks", "nodes", "seconds", "bytes_per_second"))
        if (any(type(v) is not int or v < 0 for v in counts) or any(type(v) is not int or v < 1 for v in (ranks, nodes))
                or type(value.get("expert_parallel")) is not bool
                or (seconds is not None and (type(seconds) not in (int, float) or not 0 <= seconds < math.inf))
                or (rate is not None and type(rate) not in (int, float))):
            return [f"{where}: {self.FORM}"]
        moved, steps = counts[0], counts[3]
        problems = []
        expected_rate = moved / seconds if seconds else None
        if (rate is None) != (expected_rate is None) or (
                rate is not None and not math.isclose(rate, expected_rate, rel_tol=1e-9)):
            problems.append(f"{where}: bytes_per_second {rate} is not bytes over seconds ({expected_rate})")
        if self.ranks is not None and (ranks, nodes) != (self.ranks, self.nodes):
            problems.append(f"{where}: {ranks} ranks on {nodes} node(s), but the replica started with {self.ranks} "
                            f"on {self.nodes}")
        if "all_to_all" in event and not value["expert_parallel"]:
            problems.append(f"{where}: expert_parallel is false, but the epoch logged an all-to-all")
        start, train = self.trials.get(trial), event.get("train_images")
        if start is None or type(train) is not int:
            return problems  # an epoch of a trial never started, or malformed counts: scoring names them
        sha, batch_size = start
        if type(batch_size) is int and batch_size > 0 and steps != -(-train // batch_size):
            problems.append(f"{where}: steps {steps} differ from {train} samples trained in batches of {batch_size}")
        if not isinstance(sha, str) or self.hashes.get(f"trials/{trial}/graph.json") != sha:
            return problems  # the graph is missing or changed: its own check names it
        from aiperf_core.errors import AiperfError
        from aiperf_opcount.communication import all_reduce_bytes

        graph = self._graph(trial, sha)
        if isinstance(graph, str):
            return problems + [f"{where}: {graph}"]
        try:
            expected = all_reduce_bytes(graph, ranks, nodes, steps, value["expert_parallel"])
        except AiperfError as exc:
            return problems + [f"{where}: bytes not re-derivable: {exc}"]
        logged = (moved, counts[1], counts[2])
        if logged != (expected.bytes, expected.inter_node_bytes, expected.intra_node_bytes):
            problems.append(f"{where}: bytes, inter_node_bytes, intra_node_bytes {logged} differ from the analytic "
                            f"{(expected.bytes, expected.inter_node_bytes, expected.intra_node_bytes)} "
                            f"(opcount.communication on trials/{trial}/graph.json, {ranks} ranks on {nodes} node(s), "
                            f"{steps} steps)")
        return problems

    def _graph(self, trial: str, sha: str):
        if sha not in self.graphs:
            from aiperf_core.errors import AiperfError
            from aiperf_core.ir import Graph

            try:
                text = (self.run.trial_dir(trial) / "graph.json").read_text(encoding="utf-8")
                self.graphs[sha] = Graph.from_json(text)
            except (AiperfError, OSError, UnicodeDecodeError) as exc:
                self.graphs[sha] = f"bytes not re-derivable: {exc}"
        return self.graphs[sha]


def _check_history(run: RunDir, usable: dict[str, tuple[int, dict]], ended: bool, workload: str) -> list[str]:
    """The published history against the replica logs and trial.json files (a missing history is
    no finding: replicas run without a primary, or by an aiperf before it, read the logs)."""
    problems = [f"{HISTORY_NAME}: line {p.line}: {p.message}" for p in verify_chain(run.history_file)]
    published: set[str] = set()
    expected_of: dict[str, dict | None] = {}

    def expected(trial: str) -> dict | None:
        if trial not in expected_of:
            replica, end = usable[trial]
            try:
                raw = (run.trial_dir(trial) / "trial.json").read_bytes()
            except OSError:
                raw = b""
            expected_of[trial] = published_fields(trial, replica, raw, end["files"], workload)
        return expected_of[trial]

    for number, line in enumerate(read_events(run.history_file), start=1):
        trial = line.get("trial")
        where = f"{HISTORY_NAME}: line {number}"
        if line.get("event") != PUBLISHED or not isinstance(trial, str):
            problems.append(f"{where}: not a published trial")
            continue
        if trial in published:
            problems.append(f"{where}: trial {trial} published again")
            continue
        published.add(trial)
        if trial not in usable:
            problems.append(f"{where}: trial {trial} has no trial_end with status ok or early_stopped and files "
                            "in any replica log")
            continue
        fields = expected(trial)
        if fields is None:
            problems.append(f"{where}: trial {trial}: its trial.json is not the one its trial_end recorded")
        elif (shown := as_published(line, workload)) != fields:
            differing = [key for key in PUBLISHED_FIELDS if shown[key] != fields[key]]
            problems.append(f"{where}: trial {trial}: {', '.join(differing)} differ from its trial_end and "
                            "trial.json (the line was forged or altered)")
    if ended:
        for trial in sorted(set(usable) - published):
            if expected(trial) is not None:
                problems.append(f"{HISTORY_NAME}: trial {trial} ended usable but was never published (lines "
                                "removed, or published by no primary before run_end)")
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


def _check_history_head(run: RunDir, pinned) -> list[str]:
    if not run.history_file.exists():
        return [] if pinned == GENESIS else [f"{HISTORY_NAME}: missing (pinned by run_end.history_head)"]
    if chain_head(run.history_file) != pinned:
        return [f"{HISTORY_NAME}: last line differs from run_end.history_head "
                "(lines added, removed or changed after the run ended)"]
    return []


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
