"""The primary: starts the replicas, watches them, restarts the ones that crash, stops them all at
the deadline. It never trains and never writes a replica's files.

What it knows of a replica comes from three places: the executor (is the process or job still
there, and how did it end), the replica's event log (did it log `replica_stop`, i.e. finish; which
trial was in flight) and its heartbeat (is it alive, and are its training steps still finishing).
Everything it decides goes to primary/events.jsonl, which is also what `--resume` reads to pick up
where a killed primary left off (docs/workflow.md). It holds the run's lease (primary/lease.json)
while it runs, so that no second primary ever watches, or writes to, the same run.

It also publishes the shared history: each usable trial it reads in a replica's log goes, once,
to primary/history.jsonl, the one file every replica tails (aiperf_core.search.history).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiperf_core.atomic import write_text_atomic
from aiperf_core.clock import SYSTEM_CLOCK, Clock
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import LEASE_RENEW_S, EventLog, Lease, LeaseHeld, RunDir, chain_head, read_events
from aiperf_core.search.history import LEGACY_WORKLOAD, HistoryPublisher, set_aside_note
from aiperf_core.workflow.duration import format_duration
from aiperf_core.workflow.executors.base import (Executor, ProcessEnd, ReplicaCommand, ReplicaHandle, log_tail,
                                                 replica_argv)
from aiperf_core.workflow.plan import WatchSettings

ENDED_REASONS = ("deadline", "all_replicas_finished", "all_replicas_failed")  # a resume has nothing left to do
FAILURES = ("crashed", "lost")  # what the restart limit counts
LAUNCH_RETRY_S = 10.0
# Stalls (docs/workflow.md): a training replica is lost when no step finished for its stall limit,
# max(--stall-timeout, STALL_STEPS x the longest step seen on it); before a trial's first step ends
# (lowering, the data pipeline's start, compilation) it gets the start-up allowance on top.
STALL_STEPS = 20
STARTUP_ALLOWANCE_S = 1200.0
STARTUP_FACTOR = 3  # the allowance is at least this many times the longest trial start-up seen on it
STACKS_WAIT_S = 2.0  # for a stalled replica to write its threads' stacks before it is stopped


def stall_limit(floor_s: float, longest_step_s: float) -> float:
    """Seconds without a finished step after which a training replica is lost."""
    return max(floor_s, STALL_STEPS * longest_step_s)


def startup_allowance(longest_startup_s: float) -> float:
    """Seconds added to the stall limit before a trial's first step has ended."""
    return max(STARTUP_ALLOWANCE_S, STARTUP_FACTOR * longest_startup_s)


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class ReplicaSlot:
    """The primary's view of one replica across its attempts."""

    replica: int
    attempt: int = 0  # of the latest launch
    failures: int = 0  # crashed or lost exits so far, over the whole run
    done: bool = False  # finished, or out of restarts: never launched again
    handle: ReplicaHandle | None = None
    log_offset: int = 0  # events in the replica log when the latest attempt was launched
    launched_at: float = 0.0
    running_since: float | None = None  # when the executor first saw it run
    last_life: float | None = None  # the latest sign of life of this attempt seen so far
    not_before: float = 0.0  # no launch before this time (after a failed launch)
    log_bytes: int = 0  # size of replica.log when the latest attempt was launched: its own output follows
    progress_due: float | None = None  # the heartbeat need not be read for progress before this time
    longest_step_s: float = 0.0  # seen on this replica, over its attempts
    longest_startup_s: float = 0.0
    first_step_s: float | None = None  # of the current trial: stands in for the longest step until one is seen
    last_progress: dict | None = None  # the progress of the latest heartbeat read


def stop_file(run_dir: RunDir) -> Path:
    """Its existence tells every replica to stop after its current epoch (docs/run-directory.md)."""
    return run_dir.primary_dir / "stop"


def in_flight_trial(events: list[dict[str, Any]]) -> str | None:
    """The trial a replica had started and not ended: the one a crash interrupts."""
    open_trials: dict[str, None] = {}
    for event in events:
        if event.get("event") == "trial_start":
            open_trials[event.get("trial")] = None
        elif event.get("event") == "trial_end":
            open_trials.pop(event.get("trial"), None)
    return next(reversed(open_trials), None) if open_trials else None


class Primary:
    def __init__(self, run_dir: RunDir, run: dict[str, Any], executor: Executor, watch: WatchSettings,
                 resume: bool = False, notify: Callable[[str], None] | None = None,
                 tick: Callable[[float], None] | None = None, clock: Clock = SYSTEM_CLOCK):
        self.run_dir = run_dir
        self.run = run
        self.executor = executor
        self.watch = watch
        self.resume = resume
        self.notify = notify or (lambda text: None)  # one line per decision, for the user
        self.tick = tick or (lambda now: None)  # the live display
        self.clock = clock  # the system's; a virtual one in the scale simulation
        self.deadline = float(run["deadline"])
        self.slots = [ReplicaSlot(i) for i in range(int(run["replicas"]))]
        self.lease = Lease(run_dir.primary_lease, "primary")
        self.log = EventLog(run_dir.primary_log, clock, lease=self.lease)
        self.publisher = HistoryPublisher(run_dir, len(self.slots), clock, lease=self.lease,
                                          workload=run.get("workload", LEGACY_WORKLOAD))
        self._interrupted: int | None = None
        self._lease_lost = False

    # --- the run ----------------------------------------------------------------------------
    def run_to_end(self) -> str:
        """Run until the deadline, until every replica has finished or failed, or until SIGINT or
        SIGTERM; returns run_end's reason. AiperfError, before anything is written, while another
        live primary holds the run's lease."""
        try:
            self.lease.acquire()
        except LeaseHeld as exc:
            option = "--resume" if self.resume else "--run-dir"
            raise AiperfError(f"{option} {self.run_dir.root}: {exc}") from None
        keeping = threading.Event()
        keeper = threading.Thread(target=self._keep_lease, args=(keeping,), name="primary-lease", daemon=True)
        keeper.start()
        try:
            return self._run_owned()
        finally:
            keeping.set()
            keeper.join()
            self.lease.release()

    def _keep_lease(self, stopping: threading.Event) -> None:
        while not stopping.wait(LEASE_RENEW_S):
            try:
                if not self.lease.renew():
                    self._lease_lost = True
                    return
            except OSError as exc:  # a flaky shared disk: try again at the next renewal
                print(f"aiperf: the run's lease was not renewed: {exc}", file=sys.stderr, flush=True)

    def _run_owned(self) -> str:
        history = read_events(self.run_dir.primary_log)
        ended = [e for e in history if e.get("event") == "run_end"]
        if self.resume and ended and ended[-1].get("reason") in ENDED_REASONS:
            self.notify(f"the run already ended ({ended[-1]['reason']}); nothing to resume")
            return ended[-1]["reason"]
        taken = self.lease.taken_over
        if taken:
            why = "its process is gone" if taken["verdict"] == "gone" else "its lease was stale"
            self.notify(f"took the run over from the primary pid {taken.get('pid')} on host {taken.get('host')} ({why})")
        self.publisher.open(self.clock.time())  # before anything is written: a changed history is refused
        self.log.open()
        previous = self._install_signal_handlers()
        try:
            lease_from = {key: taken.get(key) for key in ("host", "pid", "verdict")} if taken else None
            self.log.append("run_start", resume=self.resume, pid=os.getpid(), host=socket.gethostname(),
                            lease_taken_from=lease_from)
            if self.publisher.set_aside:  # a history an older aiperf wrote: said once, not silently lost
                self.log.append("history_set_aside", trials=self.publisher.set_aside)
                self.notify(set_aside_note(self.publisher.set_aside))
            self._recover(history)
            if self.resume:
                self.executor.end_strays({slot.handle.job for slot in self.slots if slot.handle is not None})
            if self.clock.time() < self.deadline:
                stop_file(self.run_dir).unlink(missing_ok=True)  # left by an earlier primary's shutdown
            return self._watch()
        finally:
            self._restore_signal_handlers(previous)
            self.log.close()
            self.publisher.close()

    def _watch(self) -> str:
        while True:
            now = self.clock.time()
            if self._lease_lost:
                self.lease.verify()  # LeaseLost, naming the new holder: nothing more is written
            if self._interrupted is not None:
                return self._end_all("interrupted", f"the primary got {signal.Signals(self._interrupted).name}")
            if now >= self.deadline:
                return self._end_at_deadline()
            self._poll(now)
            self.publisher.poll(now)
            for slot in self.slots:
                if slot.handle is None and not slot.done:
                    self._launch(slot)
            if all(slot.done and slot.handle is None for slot in self.slots):
                finished = any(self._finished_ever(slot.replica) for slot in self.slots)
                return self._end("all_replicas_finished" if finished else "all_replicas_failed")
            self.tick(now)
            self._sleep(self.executor.poll_interval_s)

    def _sleep(self, seconds: float, until_an_exit: bool = True) -> None:
        """Wait up to `seconds`: less at a signal, or (`until_an_exit`) once a replica's process has ended,
        which the next poll records."""
        end = self.clock.monotonic() + seconds
        while self._interrupted is None and self.clock.monotonic() < end:
            if until_an_exit and any(slot.handle is not None and slot.handle.exited() for slot in self.slots):
                return
            self.clock.sleep(min(0.2, max(0.0, end - self.clock.monotonic())))

    # --- launching and watching ---------------------------------------------------------------
    def _launch(self, slot: ReplicaSlot) -> None:
        if self.clock.time() < slot.not_before:
            return
        slot.attempt += 1
        slot.log_offset = len(read_events(self.run_dir.replica_log(slot.replica)))
        try:
            slot.log_bytes = (self.run_dir.replica_dir(slot.replica) / "replica.log").stat().st_size
        except OSError:
            slot.log_bytes = 0
        try:
            slot.handle = self.executor.launch(self._command(slot))
        except AiperfError as exc:  # sbatch refused, fork failed: a failed attempt, retried after a pause
            if not any(s.handle for s in self.slots) and slot.attempt == 1 and not self.resume:
                raise  # nothing started yet: the user's problem, said at once
            self._record_exit(slot, ProcessEnd(False, f"launch failed: {exc}"))
            slot.not_before = self.clock.time() + LAUNCH_RETRY_S
            return
        slot.launched_at = self.clock.time()
        slot.running_since = None
        slot.last_life = None
        slot.progress_due = None
        slot.first_step_s = None
        slot.last_progress = None
        self.log.append("replica_launch", replica=slot.replica, attempt=slot.attempt, job=slot.handle.job,
                        log_seq=slot.log_offset)
        self.notify(f"replica {slot.replica}: attempt {slot.attempt} launched ({self.executor.name} job {slot.handle.job})")

    def _command(self, slot: ReplicaSlot) -> ReplicaCommand:
        return ReplicaCommand(slot.replica, slot.attempt, replica_argv(self.run_dir.root, slot.replica),
                              log_path=self.run_dir.replica_dir(slot.replica) / "replica.log",
                              nodes=(self.run.get("policy") or {}).get("nodes_per_replica", 1))

    def _poll(self, now: float) -> None:
        active = [slot for slot in self.slots if slot.handle is not None]
        self.executor.refresh([slot.handle for slot in active])
        for slot in active:
            end = slot.handle.poll()
            if end is not None:
                self._record_exit(slot, end)
                continue
            if slot.running_since is None and slot.handle.started():
                slot.running_since = now
            lost = self._lost(slot, now)
            if lost is None:
                continue
            kind, why = lost
            if kind == "stall" and self.executor.request_stacks(slot.handle):
                # its threads' stacks go to replica.log, then to log_tail
                self._sleep(STACKS_WAIT_S, until_an_exit=False)
            self.executor.stop([slot.handle], grace_s=5)
            extra = {"last_progress": slot.last_progress} if kind == "stall" else {}
            self._record_exit(slot, ProcessEnd(False, why), lost=True, extra=extra)

    def _lost(self, slot: ReplicaSlot, now: float) -> tuple[str, str] | None:
        """("heartbeat" or "stall", why) when a running replica counts as lost: its heartbeat is too
        old, or it trains and no step finished for too long; None otherwise. Queued replicas are
        never lost."""
        if slot.running_since is None:
            return None
        # Heartbeat and progress times only move forward, so the silences since the last ones seen
        # bound the true ones from above: while both are within their limits the decision is the
        # same, and the file (the primary's main cost per poll at thousands of replicas,
        # docs/performance.md) is not read.
        alive = slot.last_life is not None and now - slot.last_life <= self.watch.heartbeat_timeout_s
        if alive and slot.progress_due is not None and now <= slot.progress_due:
            return None
        beat = self.run_dir.read_heartbeat(slot.replica) or {}
        beat_time = _seconds(beat.get("time")) or 0.0
        fresh = beat_time >= slot.launched_at
        slot.last_life = max(slot.running_since, beat_time if fresh else 0.0)
        if now - slot.last_life > self.watch.heartbeat_timeout_s:
            return "heartbeat", f"no heartbeat for {now - slot.last_life:.0f} s"
        if not fresh:  # this attempt has not beaten yet
            slot.progress_due = now + self.watch.stall_timeout_s
            return None
        stalled = self._stalled(slot, beat, beat_time)
        return None if stalled is None else ("stall", stalled)

    def _stalled(self, slot: ReplicaSlot, beat: dict[str, Any], beat_time: float) -> str | None:
        """Whether the heartbeat proves a stall: silence is measured on the replica's own clock, from
        its last finished step (or, before a trial's first step, from the trial's start) to the
        heartbeat, so a late heartbeat never makes a healthy replica look stalled."""
        slot.longest_step_s = max(slot.longest_step_s, _seconds(beat.get("longest_step_s")) or 0.0)
        slot.longest_startup_s = max(slot.longest_startup_s, _seconds(beat.get("longest_startup_s")) or 0.0)
        progress = beat.get("progress") if isinstance(beat.get("progress"), dict) else None
        slot.last_progress = progress
        if progress is not None and _seconds(progress.get("first_step_s")) is not None:
            slot.first_step_s = _seconds(progress.get("first_step_s"))
        # Until a step after a first one is seen on this replica, its first step (compilation
        # included) is the best guess of a step's length.
        limit = stall_limit(self.watch.stall_timeout_s, slot.longest_step_s or slot.first_step_s or 0.0)
        since = _seconds(beat.get("since"))
        if beat.get("state") != "training" or since is None:
            slot.progress_due = beat_time + limit
            return None
        last_step = _seconds(progress.get("time")) if progress is not None else None
        if last_step is not None:
            silent, allowed = beat_time - last_step, limit
            why = f"no step finished for {format_duration(silent)} (stall limit {format_duration(allowed)})"
        else:
            extra = startup_allowance(slot.longest_startup_s)
            silent, allowed = beat_time - since, limit + extra
            why = (f"no first step {format_duration(silent)} after the trial started (stall limit "
                   f"{format_duration(limit)} + start-up allowance {format_duration(extra)})")
        slot.progress_due = beat_time - silent + allowed
        return why if silent > allowed else None

    def _replica_events_since(self, slot: ReplicaSlot) -> list[dict[str, Any]]:
        return read_events(self.run_dir.replica_log(slot.replica))[slot.log_offset:]

    def _record_exit(self, slot: ReplicaSlot, end: ProcessEnd, lost: bool = False, stopped: str | None = None,
                     extra: dict[str, Any] | None = None) -> None:
        """Classify how an attempt ended, log replica_exit, and decide whether it runs again."""
        all_events = read_events(self.run_dir.replica_log(slot.replica))
        stops = [e for e in all_events[slot.log_offset:] if e.get("event") == "replica_stop"]
        fields: dict[str, Any] = {"job": slot.handle.job if slot.handle else None, "exit": end.description}
        if stops:
            status, reason = "finished", str(stops[-1].get("reason"))
            slot.done = True
        elif stopped is not None:
            status, reason = "stopped", stopped
        else:
            status = "lost" if lost else "crashed"
            trial = in_flight_trial(all_events)
            reason = end.description + (f" during trial {trial}" if trial else "")
            fields.update(trial=trial, **(extra or {}),
                          log_tail=log_tail(self.run_dir.replica_dir(slot.replica) / "replica.log", since=slot.log_bytes))
            job_tail = self.executor.job_log_tail(slot.handle) if slot.handle is not None else []
            if job_tail:
                fields["job_log_tail"] = job_tail
            slot.failures += 1
            restart = slot.failures <= self.watch.max_restarts and self.clock.time() < self.deadline
            fields["restart"] = restart
            if not restart:
                slot.done = True
        self.log.append("replica_exit", replica=slot.replica, attempt=slot.attempt, status=status, reason=reason,
                        **fields)
        suffix = ""
        if status in FAILURES:
            suffix = (f"; restarting ({slot.failures} of {self.watch.max_restarts} restarts)" if fields["restart"]
                      else "; not restarted")
        self.notify(f"replica {slot.replica}: attempt {slot.attempt} {status}: {reason}{suffix}")
        slot.handle = None

    def _finished_ever(self, replica: int) -> bool:
        return any(e.get("event") == "replica_stop" for e in read_events(self.run_dir.replica_log(replica)))

    # --- resume -------------------------------------------------------------------------------
    def _recover(self, history: list[dict[str, Any]]) -> None:
        """Rebuild each replica's slot from the primary log; end what an earlier primary left running."""
        for slot in self.slots:
            launches = [e for e in history if e.get("event") == "replica_launch" and e.get("replica") == slot.replica]
            exits = [e for e in history if e.get("event") == "replica_exit" and e.get("replica") == slot.replica]
            slot.failures = sum(1 for e in exits if e.get("status") in FAILURES)
            # A replica given up by an earlier primary runs again if --resume raised --max-restarts.
            if exits and exits[-1].get("status") == "finished" or slot.failures > self.watch.max_restarts:
                slot.done = True
            if not launches:
                continue
            last = launches[-1]
            slot.attempt = int(last.get("attempt", len(launches)))
            if any(e.get("attempt") == slot.attempt for e in exits):
                continue
            # Launched by the earlier primary, never seen to end: watch it if it still runs and the
            # executor can (a SLURM job), else make sure it is gone and say so.
            slot.log_offset = int(last.get("log_seq", 0))
            slot.handle = self.executor.adopt(self._command(slot), str(last.get("job")))
            if slot.handle is not None:
                slot.launched_at = float(last.get("time", self.clock.time()))
                self.log.append("replica_adopt", replica=slot.replica, attempt=slot.attempt, job=slot.handle.job)
                self.notify(f"replica {slot.replica}: attempt {slot.attempt} still runs (job {slot.handle.job}); "
                            "watching it again")
                continue
            self.executor.end_leftover(slot.replica, str(last.get("job")))
            events = self._replica_events_since(slot)
            stops = [e for e in events if e.get("event") == "replica_stop"]
            if stops:
                slot.done = True
                status, reason = "finished", str(stops[-1].get("reason"))
            else:
                status, reason = "stopped", "the primary ended without stopping it; ended for --resume"
            self.log.append("replica_exit", replica=slot.replica, attempt=slot.attempt, status=status,
                            reason=reason, job=last.get("job"), exit="unknown (primary was down)",
                            trial=in_flight_trial(read_events(self.run_dir.replica_log(slot.replica))))

    # --- the end ------------------------------------------------------------------------------
    def _end_at_deadline(self) -> str:
        """Replicas stop at the deadline by themselves; the stop file and then signals make sure."""
        stop = {"time": self.clock.time(), "reason": "deadline"}
        write_text_atomic(stop_file(self.run_dir), json.dumps(stop) + "\n")
        waited_until = self.clock.monotonic() + self.watch.stop_grace_s
        while any(s.handle is not None for s in self.slots) and self.clock.monotonic() < waited_until:
            self._poll(self.clock.time())
            if self._interrupted is not None:
                break
            self._sleep(min(self.executor.poll_interval_s, 1.0))
        return self._end_all("deadline", "still running at the deadline plus the stop grace")

    def _end_all(self, reason: str, why_stopped: str) -> str:
        running = [s for s in self.slots if s.handle is not None]
        if running:
            self.executor.stop([s.handle for s in running], grace_s=min(self.watch.stop_grace_s, 10.0))
            for slot in running:
                end = slot.handle.poll() or ProcessEnd(False, "stopped by the primary")
                self._record_exit(slot, end, stopped=why_stopped)
        return self._end(reason)

    def _end(self, reason: str) -> str:
        self.publisher.publish_all(self.clock.time())  # every trial that ended, before run_end
        heads = {str(slot.replica): chain_head(self.run_dir.replica_log(slot.replica)) for slot in self.slots}
        # history_head pins the published history as log_heads pins the replica logs (GENESIS: none).
        self.log.append("run_end", reason=reason, log_heads=heads,
                        history_head=chain_head(self.run_dir.history_file))
        self.notify(f"run ended: {reason}")
        return reason

    # --- signals ------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> dict[int, Any]:
        def on_signal(number, _frame):
            self._interrupted = number

        previous = {}
        for number in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[number] = signal.signal(number, on_signal)
            except ValueError:  # not the main thread (tests): signals stay as they are
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for number, handler in previous.items():
            signal.signal(number, handler)
