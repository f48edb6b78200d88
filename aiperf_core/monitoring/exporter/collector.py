"""A prometheus-client collector of one run directory: what a scrape of `/metrics` returns.

Every scrape reads only what the run directory gained since the previous one. The scored figures,
trials and replicas come from scoring.progress.live_ledger (the ledger and running totals the live
display of `aiperf run` keeps, shared with it when both run in the primary's process); the live
rates from the heartbeats, as the display reads them (workflow.progress.live_figures); the
accelerator and host figures from the latest sample of each replica's monitor.jsonl, whose tail
is found once (`MonitorTail`) and then followed. Labels are bounded by the run's replicas, hosts
and accelerators: no trial id or time is ever a label.

A line the ledger cannot use counts as a reason (`aiperf_run_reasons`), never as a failed scrape;
a run directory that cannot be read at all gives `aiperf_run_readable 0` and the scrape still
succeeds. The series are documented in docs/monitoring.md (SERIES is the table a test holds the
document to).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from prometheus_client.core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from aiperf_core.errors import AiperfError
from aiperf_core.gcpause import gc_paused
from aiperf_core.rundir import RunDir
from aiperf_core.scoring.ledger import LogRewritten, LogTail, RunLedger, read_run_info
from aiperf_core.scoring.progress import Progress, live_ledger
from aiperf_core.scoring.rules import validity_reasons
from aiperf_core.workflow.progress import QUIET_STEP_S, live_figures

REPLICA_STATES = ("queued", "running", "stalled", "restarting", "done")
TRIAL_STATUSES = ("running", "ok", "early_stopped", "failed", "interrupted", "other")
RUN_LABELS = ("run_id", "backend", "executor", "dataset", "workload")
REPLICA_LABELS = ("replica", "host")
ACCELERATOR_LABELS = ("host", "index", "uuid", "name")
MAX_ERRORS_KEPT = 100  # distinct read errors remembered as reasons

# name -> (type, labels, help). Counter names carry their `_total`, as Prometheus stores them.
SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "aiperf_run_info": ("gauge", RUN_LABELS, "Always 1; the run's identity in its labels"),
    "aiperf_run_readable": ("gauge", (), "1 when this scrape read the run directory, 0 when it could not"),
    "aiperf_read_errors_total": ("counter", (), "Scrapes whose read of the run directory raised an error"),
    "aiperf_score_ops": ("gauge", (), "The score so far: OPS(now) in analytic operations per second"),
    "aiperf_regulated_score_ops": ("gauge", (), "The regulated score so far: -ln(best error) x OPS(now)"),
    "aiperf_best_accuracy_ratio": ("gauge", (), "Best validation accuracy so far (absent before the first)"),
    "aiperf_best_error_ratio": ("gauge", (), "Best validation error so far as the run's workload defines it, the "
                                "one the regulated score uses (cnn: 1 - accuracy; lm: bits per byte / 8)"),
    "aiperf_epochs_total": ("counter", (), "Epochs counted in the score"),
    "aiperf_operations_total": ("counter", (), "Analytic operations of the epochs counted"),
    "aiperf_all_to_all_bytes_total": ("counter", (), "Analytic bytes the experts' all-to-all moved in the "
                                      "expert-parallel epochs logged (absent before the first); not scored"),
    "aiperf_all_to_all_seconds_total": ("counter", (), "Seconds the backends measured in the experts' all-to-all "
                                        "of those epochs, summed over replicas"),
    "aiperf_all_to_all_bytes_per_second": ("gauge", (), "All-to-all bytes over all-to-all seconds: one replica's "
                                           "bandwidth in it, weighted by time (absent without a measured second)"),
    "aiperf_all_reduce_bytes_total": ("counter", (), "Analytic bytes per rank the gradient all-reduce moved in "
                                      "the data-parallel epochs logged (absent before the first); not scored"),
    "aiperf_all_reduce_seconds_total": ("counter", (), "Seconds the backends measured waiting on that all-reduce, "
                                        "summed over replicas (epochs a backend could not time add none)"),
    "aiperf_all_reduce_bytes_per_second": ("gauge", (), "The timed epochs' all-reduce bytes per rank over their "
                                           "seconds: one replica's bus bandwidth (absent without a timed second)"),
    "aiperf_all_reduce_inter_node_bytes_total": ("counter", (), "Analytic bytes the gradient all-reduce sent "
                                                 "over each node's network link in those epochs (0 where every "
                                                 "replica is one node)"),
    "aiperf_network_wait_share_ratio": ("gauge", (), "The share of the replicas' step time spent waiting on "
                                        "communication, all-reduce and all-to-all (absent before a trial "
                                        "communicated); not scored"),
    "aiperf_network_efficiency_ratio": ("gauge", (), "The score over the score an ideal network would have given: the "
                                        "run's time less its replicas' waits on communication, over its time "
                                        "(absent before a trial communicated); not scored"),
    "aiperf_trials": ("gauge", ("status",), "Trials by status (running: started, not ended)"),
    "aiperf_replicas": ("gauge", ("state",), "Replicas by state: queued, running, stalled, restarting, done"),
    "aiperf_elapsed_seconds": ("gauge", (), "Seconds since the run's clock started, to its end once ended"),
    "aiperf_remaining_seconds": ("gauge", (), "Seconds to the deadline, never negative"),
    "aiperf_budget_seconds": ("gauge", (), "The run's time budget"),
    "aiperf_run_ended": ("gauge", (), "1 once the primary logged run_end"),
    "aiperf_run_official": ("gauge", (), "1 while no rule of an official run is broken so far"),
    "aiperf_run_reasons": ("gauge", (), "Reasons the run is unofficial so far (aiperf score lists them)"),
    "aiperf_damaged_logs": ("gauge", ("log",), "Logs with a damaged line, which is not read past"),
    "aiperf_replica_images_per_second": ("gauge", REPLICA_LABELS, "Live training images/s (heartbeat)"),
    "aiperf_replica_live_ops": ("gauge", REPLICA_LABELS, "Live analytic OPS: images/s x FP+BP per image"),
    "aiperf_replica_last_step_age_seconds": ("gauge", REPLICA_LABELS, "Seconds since its last training step"),
    "aiperf_replica_attempts": ("gauge", REPLICA_LABELS, "Attempts started (replica_start events)"),
    "aiperf_replica_trials_done_total": ("counter", REPLICA_LABELS, "Trials it ended"),
    "aiperf_replica_trial_round": ("gauge", REPLICA_LABELS, "Search round of the trial it trains"),
    "aiperf_replica_trial_epoch": ("gauge", REPLICA_LABELS, "Epoch (from 1) the trial it trains is in"),
    "aiperf_replica_stalled": ("gauge", REPLICA_LABELS, "1 while it trains with no step for 60 s or no fresh "
                               "heartbeat"),
    "aiperf_accelerator_utilization_ratio": ("gauge", ACCELERATOR_LABELS, "Accelerator utilisation, 0 to 1"),
    "aiperf_accelerator_memory_used_bytes": ("gauge", ACCELERATOR_LABELS, "Accelerator memory in use"),
    "aiperf_accelerator_power_watts": ("gauge", ACCELERATOR_LABELS, "Accelerator power draw"),
    "aiperf_accelerator_energy_joules_total": ("counter", ACCELERATOR_LABELS,
                                               "Accelerator energy counter (NVML, since the driver loaded)"),
    "aiperf_host_cpu_utilization_ratio": ("gauge", ("host",), "Host CPU utilisation, 0 to 1"),
    "aiperf_host_memory_used_bytes": ("gauge", ("host",), "Host memory in use"),
    "aiperf_host_energy_joules_total": ("counter", ("host", "zone"), "Host RAPL energy counter (wraps)"),
    "aiperf_monitor_sample_age_seconds": ("gauge", ("host",), "Seconds since the host's latest monitor sample"),
}


def open_run(path: str | os.PathLike) -> Path:
    """The resolved root of a run directory, checked readable as a run; AiperfError otherwise."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise AiperfError(f"{path}: no such run directory")
    read_run_info(RunDir(root))  # RunDirError: not a run, or a malformed run.json
    return root


class MonitorTail:
    """The latest 'host' record and 'sample' of one replica's monitor.jsonl, followed incrementally.

    The first read finds the latest 'host' record (the start of the current sampler's life) without
    reading the log whole: in its last 64 KiB, else just before the replica's latest start, found by
    bisecting on the lines' times (a sampler starts shortly before its replica logs replica_start).
    It then follows the log from its last complete line: a 12-hour monitor log is never read whole."""

    PROBE_BYTES = 8192
    HOST_LINE = b'{"kind": "host"'  # how monitoring.sampler.Sampler writes a host record (json.dumps, "kind" first)
    TIME_FIELD = re.compile(rb'\{"kind": "[a-z]+", "time": (-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)[,}]')

    def __init__(self, path: Path, name: str):
        self.path = path
        self.name = name
        self.tail: LogTail | None = None
        self.host: dict[str, Any] | None = None
        self.sample: dict[str, Any] | None = None
        self._lines = None  # sample_lines() of the latest sample, made once per sample
        self._labels: dict = {}  # label texts of the current host record's devices

    def read(self, since: float | None) -> None:
        """Follow the log; `since` is the time of the replica's latest start (None: unknown)."""
        try:
            if self.tail is None:
                if not self.path.is_file():
                    return
                self._position(since)
            for _, record in self.tail.read():
                self._take(record)
        except LogRewritten:
            self.tail = self.host = self.sample = self._lines = None
            self._labels = {}

    def lines(self):
        """sample_lines() of the latest sample (None without one)."""
        if self._lines is None and self.sample is not None and self.host is not None:
            self._lines = sample_lines(self.host, self.sample, self._labels)
        return self._lines

    @property
    def damaged(self) -> bool:
        return self.tail is not None and self.tail.damaged_line is not None

    def _take(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "host":
            self.host, self.sample, self._lines, self._labels = record, None, None, {}
        elif record.get("kind") == "sample" and self.host is not None:
            self.sample, self._lines = record, None

    def _position(self, since: float | None) -> None:
        self.tail = LogTail(self.path, self.name)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # The last 64 KiB, read once: the last line's start and a recent host record are in it.
            begin = max(size - (1 << 16), 0)
            f.seek(begin)
            tail = f.read(size - begin)
            end = tail.rfind(b"\n")
            start = tail.rfind(b"\n", 0, end) + 1 if end >= 0 else -1
            last_at = begin + start if start > 0 or (begin == 0 and end >= 0) else self._last_line_start(f, size)
            at = tail.rfind(b"\n" + self.HOST_LINE)
            host_at = begin + at + 1 if at >= 0 else (0 if begin == 0 and tail.startswith(self.HOST_LINE) else None)
            if host_at is None and since is not None:
                host_at = self._host_before(f, self._first_at_or_after(f, size, since), 0)
            if host_at is None or host_at >= last_at:
                self.tail.offset = last_at if host_at is None else host_at
                return
            f.seek(host_at)
            try:
                self._take(json.loads(f.readline()))
            except ValueError:
                pass
        self.tail.offset = last_at

    def _host_before(self, f, end: int, floor: int | None) -> int | None:
        """Start of the last host line beginning before `end`, searching back to `floor` (None: to
        the file's start; `end` itself: only the last 64 KiB)."""
        floor = max(end - (1 << 16), 0) if floor == end else (floor or 0)
        chunk = 1 << 16  # doubled each step back: the record is usually within a few lines
        while end > floor:
            begin = max(end - chunk, floor, 0)
            f.seek(begin)
            data = f.read(end - begin + len(self.HOST_LINE))
            at = data.rfind(b"\n" + self.HOST_LINE, 0, end - begin + 1)
            if at >= 0:
                return begin + at + 1
            if begin == 0 and data.startswith(self.HOST_LINE):
                return 0
            end, chunk = begin, min(chunk * 2, 1 << 24)
        return None

    def _first_at_or_after(self, f, size: int, since: float) -> int:
        """An offset at or after the end of the lines written before `since`: galloping from the
        log's start (a replica that started once started within its first lines: one or two
        probes), then bisection on time."""
        lo, hi = 0, self.PROBE_BYTES
        while hi < size and self._time_at(f, hi, since):
            lo, hi = hi, hi * 2
        hi = min(hi, size)
        while hi - lo > self.PROBE_BYTES:
            mid = (lo + hi) // 2
            if self._time_at(f, mid, since):
                lo = mid
            else:
                hi = mid
        return min(hi + self.PROBE_BYTES, size)

    def _time_at(self, f, offset: int, since: float) -> bool:
        """Whether the first whole line after `offset` was written before `since`."""
        f.seek(offset)
        data = f.read(self.PROBE_BYTES)
        first = data.find(b"\n") + 1
        second = data.find(b"\n", first)
        when = self._line_time(data[first:second]) if first and second > 0 else None
        return when is not None and when < since

    @classmethod
    def _line_time(cls, line: bytes) -> float | None:
        """A record's "time", read from its head where monitoring.sampler.Sampler writes it ({"kind": ...,
        "time": ...}): a sample of 8 accelerators takes 30 times longer to parse whole, and a first
        scrape at 4096 replicas makes about 45,000 of these probes. The whole line otherwise."""
        head = cls.TIME_FIELD.match(line)
        if head is not None:
            return float(head.group(1))
        try:
            when = json.loads(line).get("time")
        except (ValueError, AttributeError):
            return None
        return float(when) if type(when) in (int, float) else None

    @staticmethod
    def _last_line_start(f, size: int) -> int:
        """Start of the last complete line (the file's size if it has none)."""
        back = min(size, 1 << 16)
        while True:
            f.seek(size - back)
            data = f.read(back)
            end = data.rfind(b"\n")
            if end < 0:
                return size
            start = data.rfind(b"\n", 0, end) + 1
            if start > 0 or back == size:
                return size - back + start
            back = min(size, back * 4)


class RunCollector:
    """prometheus-client custom collector of one run directory (register it with a CollectorRegistry)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self._lock = threading.Lock()  # one scrape at a time: they share the incremental state
        self.root: Path | None = None
        self.read_errors = 0
        self.errors: dict[str, None] = {}  # distinct read errors, oldest first (reasons)
        self.scrapes = 0
        self.ended_scraped = threading.Event()  # a scrape has returned the run's end
        if root is not None:
            self.attach(root)

    def attach(self, root: str | os.PathLike) -> None:
        """Serve this run directory from now on (the primary binds its port before the run exists)."""
        with self._lock:
            self.root = Path(root).resolve()
            self.run_dir = RunDir(self.root)
            self._monitors: dict[int, MonitorTail] = {}
            self._generation = -1
            self._trials_key: tuple | None = None
            self._trials_view: tuple[dict[str, int], int] = ({}, 0)

    def describe(self) -> Iterable[Metric]:
        return []  # nothing to check at registration: the series depend on the run

    def collect(self) -> Iterable[Metric]:
        """The prometheus-client collector interface (a CollectorRegistry calls it): the families
        of render(), parsed back. The endpoint serves render() itself: prometheus-client's own
        exposition takes seconds for the ~160,000 series of a 4096-replica, 8-GPU-per-node run."""
        return list(text_string_to_metric_families(self.render(openmetrics=True).decode()))

    def render(self, openmetrics: bool) -> bytes:
        """One scrape: OpenMetrics, or the Prometheus text format 0.0.4."""
        # A scrape allocates a line per series and no cycles: the cyclic collector would only
        # rescan the ledger's millions of objects during it.
        with gc_paused():
            return render(self.families(), openmetrics)

    def families(self) -> list["Family"]:
        """Every family of one scrape, `aiperf_run_readable` and `aiperf_read_errors_total` last."""
        with self._lock:
            families: list[Family] = []
            readable = 0
            if self.root is not None:
                for _ in range(3):  # a malformed line raises once: the ledger has moved past it
                    try:
                        families, ended = self._families(time.time())
                        readable = 1
                        if ended:
                            self.ended_scraped.set()
                        break
                    except (AiperfError, OSError, ValueError, KeyError, TypeError) as exc:
                        self.read_errors += 1
                        if len(self.errors) < MAX_ERRORS_KEPT:
                            self.errors[f"{type(exc).__name__}: {exc}"] = None
            self.scrapes += 1
            families.append(_gauge("aiperf_run_readable", readable))
            counter = _family("aiperf_read_errors_total")
            counter.add_metric([], self.read_errors)
            families.append(counter)
        return families

    # --- the figures ------------------------------------------------------------------------
    def _families(self, now: float) -> tuple[list["Family"], bool]:
        with live_ledger(self.root, now) as (progress, ledger):
            self._follow_primary(ledger)
            view = self._ledger_view(progress, ledger)
        live = live_figures(self.run_dir, progress)
        out = self._run_families(progress, ledger.info.run, view)
        out += self._replica_families(progress, view, live)
        out += self._monitor_families(now, view["replica_ids"], view["starts"], view["damaged_events"])
        return out, view["ended"]

    def _follow_primary(self, ledger: RunLedger) -> None:
        """Each replica's latest launch and exit from the primary log, read once per event."""
        if ledger.generation != self._generation:
            self._generation = ledger.generation
            self._seen = 0
            self._launched: dict[int, int] = {}
            self._exits: dict[int, dict[str, Any]] = {}
        for event in ledger.primary_events[self._seen:]:
            replica = event.get("replica")
            if not isinstance(replica, int):
                continue
            if event.get("event") == "replica_launch":
                self._launched[replica] = event.get("attempt") if isinstance(event.get("attempt"), int) else 0
            elif event.get("event") == "replica_exit":
                self._exits[replica] = event
        self._seen = len(ledger.primary_events)

    def _ledger_view(self, progress: Progress, ledger: RunLedger) -> dict[str, Any]:
        """What the families need from the ledger, taken while it is held."""
        damaged = ledger.damaged_logs()
        # Trial statuses and reasons change only with these: a scrape of a quiet run does not
        # go over every trial again.
        key = (ledger.generation, len(ledger.trials), len(ledger.epochs), progress.trials_done, progress.best_error,
               len(damaged), len(self.errors), None if ledger.run_end is None else ledger.run_end.get("reason"))
        if key != self._trials_key:
            statuses = dict.fromkeys(TRIAL_STATUSES, 0)
            for trial in ledger.trials.values():
                status = trial.status or "running"
                statuses[status if status in statuses else "other"] += 1
            reasons = validity_reasons(ledger.info.run, ledger.trials.values(), progress.best_error,
                                       ledger.replicas)
            reasons += damaged
            reasons += [trial.id for trial in ledger.unresolved_trials()]
            if ledger.run_end is not None and ledger.run_end.get("reason") in ("interrupted", "all_replicas_failed"):
                reasons.append("ended early")
            reasons += list(self.errors)
            self._trials_key, self._trials_view = key, (statuses, len(reasons))
        statuses, reasons = self._trials_view
        rounds, starts = {}, {}
        for replica, state in ledger.replicas.items():
            if state.running is not None:
                rounds[replica] = state.running.round
            if state.starts:
                starts[replica] = state.starts[-1].get("time")
        return {"statuses": statuses, "reasons": reasons, "rounds": rounds, "starts": starts,
                "damaged_events": len(damaged), "replica_ids": sorted(ledger.replicas), "ended": ledger.run_end is not None,
                "end_time": ledger.run_end["time"] if ledger.run_end is not None else None,
                "replicas": int(ledger.info.run.get("replicas") or 0)}

    def _state(self, replica: int, progress_replica, live, ended: bool) -> str:
        if ended or (progress_replica is not None and progress_replica.stopped):
            return "done"
        launched = self._launched.get(replica, 0)
        exit_ = self._exits.get(replica)
        if exit_ is not None and exit_.get("attempt") == launched:
            return "restarting" if exit_.get("restart") else "done"
        attempts = progress_replica.attempts if progress_replica is not None else 0
        if attempts < launched or progress_replica is None:
            return "restarting" if launched > 1 else "queued"
        if progress_replica.running and _stalled(live.replicas.get(replica)):
            return "stalled"
        return "running"

    def _run_families(self, progress: Progress, run: dict[str, Any], view: dict[str, Any]) -> list["Family"]:
        dataset = run.get("dataset") if isinstance(run.get("dataset"), dict) else {}
        info = _family("aiperf_run_info")
        info.add_metric([str(run.get("run_id")), str(run.get("backend")), str(run.get("executor")),
                         str(dataset.get("name")), str(run.get("workload", "cnn"))], 1)
        out = [info, _gauge("aiperf_score_ops", progress.ops_per_s),
               _gauge("aiperf_regulated_score_ops", progress.regulated_ops)]
        if progress.best_accuracy is not None:
            out.append(_gauge("aiperf_best_accuracy_ratio", progress.best_accuracy))
        if progress.best_error is not None:
            out.append(_gauge("aiperf_best_error_ratio", progress.best_error))
        epochs, operations = _family("aiperf_epochs_total"), _family("aiperf_operations_total")
        epochs.add_metric([], progress.epochs_counted)
        operations.add_metric([], progress.operations)
        if progress.all_to_all_trials:  # an expert-parallel epoch was logged
            moved, seconds = _family("aiperf_all_to_all_bytes_total"), _family("aiperf_all_to_all_seconds_total")
            moved.add_metric([], progress.all_to_all_bytes)
            seconds.add_metric([], progress.all_to_all_seconds)
            out += [moved, seconds]
            if progress.all_to_all_bytes_per_second is not None:
                out.append(_gauge("aiperf_all_to_all_bytes_per_second", progress.all_to_all_bytes_per_second))
        if progress.all_reduce_trials:  # a data-parallel epoch was logged
            moved, seconds = _family("aiperf_all_reduce_bytes_total"), _family("aiperf_all_reduce_seconds_total")
            moved.add_metric([], progress.all_reduce_bytes)
            seconds.add_metric([], progress.all_reduce_seconds)
            inter_node = _family("aiperf_all_reduce_inter_node_bytes_total")
            inter_node.add_metric([], progress.all_reduce_inter_node_bytes)
            out += [moved, inter_node, seconds]
            if progress.all_reduce_bytes_per_second is not None:
                out.append(_gauge("aiperf_all_reduce_bytes_per_second", progress.all_reduce_bytes_per_second))
        if progress.network_share is not None:
            out.append(_gauge("aiperf_network_wait_share_ratio", progress.network_share))
        if progress.network_efficiency is not None:
            out.append(_gauge("aiperf_network_efficiency_ratio", progress.network_efficiency))
        trials = _family("aiperf_trials")
        for status, count in view["statuses"].items():
            trials.add_metric([status], count)
        out += [epochs, operations, trials,
                _gauge("aiperf_elapsed_seconds", progress.elapsed_s if view["end_time"] is None
                       else min(progress.now, view["end_time"]) - progress.now + progress.elapsed_s),
                _gauge("aiperf_remaining_seconds", progress.remaining_s),
                _gauge("aiperf_budget_seconds", progress.budget_s),
                _gauge("aiperf_run_ended", int(progress.ended)),
                _gauge("aiperf_run_official", int(view["reasons"] == 0)),
                _gauge("aiperf_run_reasons", view["reasons"])]
        return out

    def _replica_families(self, progress: Progress, view: dict[str, Any], live) -> list["Family"]:
        names = ("aiperf_replica_images_per_second", "aiperf_replica_live_ops", "aiperf_replica_last_step_age_seconds",
                 "aiperf_replica_attempts", "aiperf_replica_trials_done_total", "aiperf_replica_trial_round",
                 "aiperf_replica_trial_epoch", "aiperf_replica_stalled")
        fams = {name: _family(name) for name in names}
        states = dict.fromkeys(REPLICA_STATES, 0)
        by_id = {r.replica: r for r in progress.replicas}
        for replica in sorted(set(range(view["replicas"])) | set(by_id)):
            state = self._state(replica, by_id.get(replica), live, view["ended"])
            states[state] += 1
            r = by_id.get(replica)
            if r is None or r.host is None:  # not started: its host label is not known yet
                continue
            labels = [str(replica), r.host]
            fams["aiperf_replica_attempts"].add_metric(labels, r.attempts)
            fams["aiperf_replica_trials_done_total"].add_metric(labels, r.trials_done)
            fams["aiperf_replica_stalled"].add_metric(labels, int(state == "stalled"))
            if r.running:
                round_number = view["rounds"].get(replica)
                if isinstance(round_number, (int, float)) and not isinstance(round_number, bool):
                    fams["aiperf_replica_trial_round"].add_metric(labels, round_number)
                fams["aiperf_replica_trial_epoch"].add_metric(labels, r.running_epochs + 1)
            figures = live.replicas.get(replica)
            if figures is None:
                continue
            if figures.images_per_s is not None:
                fams["aiperf_replica_images_per_second"].add_metric(labels, figures.images_per_s)
            if figures.ops_per_s is not None:
                fams["aiperf_replica_live_ops"].add_metric(labels, figures.ops_per_s)
            if figures.last_step_age_s is not None:
                fams["aiperf_replica_last_step_age_seconds"].add_metric(labels, figures.last_step_age_s)
        replicas = _family("aiperf_replicas")
        for state, count in states.items():
            replicas.add_metric([state], count)
        return [replicas, *fams.values()]

    def _monitor_families(self, now: float, replicas: list[int], starts: dict[int, Any],
                          damaged_events: int) -> list["Family"]:
        devices: dict[tuple[str, ...], tuple[float, dict[str, str]]] = {}
        hosts: dict[str, tuple[float, dict[str, str]]] = {}
        zones: dict[str, tuple[float, str]] = {}  # host -> the latest sample's RAPL lines
        damaged = 0
        for replica in replicas:
            monitor = self._monitors.get(replica)
            if monitor is None:
                monitor = self._monitors[replica] = MonitorTail(self.run_dir.monitor_log(replica),
                                                                f"replicas/{replica}/monitor.jsonl")
            since = starts.get(replica)
            monitor.read(since if isinstance(since, (int, float)) else None)
            damaged += monitor.damaged
            lines = monitor.lines()
            if lines is None:
                continue
            # Replicas sharing a node report its host and devices each: the latest sample wins.
            t, host, device_lines, host_lines, zone_lines = lines
            if host not in hosts or hosts[host][0] < t:
                hosts[host] = (t, host_lines)
            if zone_lines and (host not in zones or zones[host][0] < t):
                zones[host] = (t, zone_lines)
            for key, entry in device_lines:
                if key not in devices or devices[key][0] < t:
                    devices[key] = (t, entry)
        fams = {name: _family(name) for name in SERIES if name.startswith(("aiperf_accelerator_", "aiperf_host_"))}
        for name, _, _ in ACCELERATOR_FIELDS:
            fams[name].lines = [entry[name] for _, entry in devices.values() if name in entry]
        for name, _, _ in HOST_FIELDS:
            fams[name].lines = [entry[name] for _, entry in hosts.values() if name in entry]
        fams["aiperf_host_energy_joules_total"].lines = [text for _, text in zones.values()]
        ages = _family("aiperf_monitor_sample_age_seconds")
        for host, (t, _) in hosts.items():
            ages.add_metric([host], max(now - t, 0.0))
        damaged_logs = _family("aiperf_damaged_logs")
        damaged_logs.add_metric(["events"], damaged_events)
        damaged_logs.add_metric(["monitor"], damaged)
        return [*fams.values(), ages, damaged_logs]


ACCELERATOR_FIELDS = (("aiperf_accelerator_utilization_ratio", "utilization", 0.01),
                      ("aiperf_accelerator_memory_used_bytes", "memory_used", 1),
                      ("aiperf_accelerator_power_watts", "power_w", 1),
                      ("aiperf_accelerator_energy_joules_total", "energy_mj", 0.001))
HOST_FIELDS = (("aiperf_host_cpu_utilization_ratio", "cpu_percent", 0.01),
               ("aiperf_host_memory_used_bytes", "memory_used", 1))


def sample_lines(record: dict[str, Any], sample: dict[str, Any], labels: dict):
    """(time, host, [(device key, {series: line})], {series: line}, RAPL lines) of one monitor
    sample under its host record, or None if it has no time. `labels` keeps the label texts of
    one host record between its samples."""
    t = _number(sample.get("time"))
    if t is None:
        return None
    host = str(record.get("host") or "unknown")
    if not labels:
        described = {d.get("index"): d for d in record.get("accelerators") or [] if isinstance(d, dict)}
        for index, about in described.items():
            key = (host, str(index), str(about.get("uuid") or ""), str(about.get("name") or ""))
            labels["device", index] = (key, _device_prefixes(key))
        labels["host"] = _label_text(("host",), (host,))
    device_lines = []
    for device in sample.get("accelerators") or []:
        if not isinstance(device, dict):
            continue
        index = device.get("index")
        found = labels.get(("device", index))
        if found is None:  # not in the host record
            key = (host, str(index), "", "")
            found = labels["device", index] = (key, _device_prefixes(key))
        key, prefixes = found
        entry = {}
        for (name, field, scale), prefix in zip(ACCELERATOR_FIELDS, prefixes):
            value = device.get(field)
            if type(value) in (int, float):
                number = repr(float(value * scale))
                entry[name] = prefix + (number if number[-1].isdigit() else _value(value * scale)) + "\n"
        device_lines.append((key, entry))
    host_labels = labels["host"]
    host_lines = {}
    for name, field, scale in HOST_FIELDS:
        value = sample.get(field)
        if type(value) in (int, float):
            host_lines[name] = f"{name}{host_labels} {_value(value * scale)}\n"
    energy = sample.get("host_energy_uj") if isinstance(sample.get("host_energy_uj"), dict) else {}
    zone_lines = "".join(f"aiperf_host_energy_joules_total{_label_text(('host', 'zone'), (host, str(zone)))} "
                         f"{_value(value / 1e6)}\n" for zone, value in energy.items() if type(value) in (int, float))
    return t, host, device_lines, host_lines, zone_lines


def _device_prefixes(key: tuple[str, ...]) -> tuple[str, ...]:
    """'name{labels} ' of each accelerator series of one device: built once per host record, since
    a 4096-node scrape writes ~131,000 such lines and their formatting is most of a later scrape."""
    text = _label_text(ACCELERATOR_LABELS, key)
    return tuple(f"{name}{text} " for name, _, _ in ACCELERATOR_FIELDS)


def _stalled(figures) -> bool:
    """Training with no fresh heartbeat, or with its last step a minute or more ago."""
    return figures is None or (figures.last_step_age_s is not None and figures.last_step_age_s >= QUIET_STEP_S)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class Family:
    """One metric family of a scrape, with its sample lines as the exposition writes them."""

    __slots__ = ("name", "kind", "help", "labels", "lines")

    def __init__(self, name: str):
        self.name = name
        self.kind, self.labels, self.help = SERIES[name]
        self.lines: list[str] = []

    def add_metric(self, values: list[str], value: float) -> None:
        self.lines.append(f"{self.name}{_label_text(self.labels, values)} {_value(value)}\n")


def _label_text(names: tuple[str, ...], values) -> str:
    """'{a="x",b="y"}' (escaped), or '' without labels."""
    key = (names, tuple(values))
    text = _LABEL_TEXT.get(key)
    if text is None:
        if len(_LABEL_TEXT) >= MAX_LABEL_TEXTS:
            _LABEL_TEXT.clear()
        text = _LABEL_TEXT[key] = ("{" + ",".join(f'{n}="{_escape(v)}"' for n, v in zip(*key)) + "}"
                                   if names else "")
    return text


# Label sets are few and repeat every scrape (replicas, hosts, devices): their text is kept.
_LABEL_TEXT: dict[tuple, str] = {}
MAX_LABEL_TEXTS = 1 << 20


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        value = value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
    return value


def _value(value: float) -> str:
    value = float(value)
    if value != value:
        return "NaN"
    if value in (math.inf, -math.inf):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def render(families: list[Family], openmetrics: bool) -> bytes:
    """The exposition of `families`: OpenMetrics 1.0 (counter families named without `_total`,
    `# EOF` at the end) or the Prometheus text format 0.0.4; the sample lines are the same."""
    parts = []
    for family in families:
        name = family.name
        head = name.removesuffix("_total") if openmetrics and family.kind == "counter" else name
        parts.append(f"# HELP {head} {family.help}\n# TYPE {head} {family.kind}\n")
        parts.extend(family.lines)
    if openmetrics:
        parts.append("# EOF\n")
    return "".join(parts).encode()


def _family(name: str) -> Family:
    return Family(name)


def _gauge(name: str, value: float) -> Family:
    family = _family(name)
    family.add_metric([], value)
    return family
