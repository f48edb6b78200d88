"""The primary: starts the replicas, watches them, restarts the ones that crash, stops them all at
the deadline. It never trains and never writes a replica's files.

What it knows of a replica comes from three places: the executor (is the process or job still
there, and how did it end), the replica's event log (did it log `replica_stop`, i.e. finish; which
trial was in flight) and its heartbeat (is it still making progress). Everything it decides goes
to primary/events.jsonl, which is also what `--resume` reads to pick up where a killed primary
left off (docs/workflow.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from aiperf_core.atomic import write_text_atomic
from aiperf_core.clock import SYSTEM_CLOCK, Clock
from aiperf_core.errors import AiperfError
from aiperf_core.rundir import EventLog, RunDir, chain_head, read_events
from aiperf_core.workflow.executors.base import Executor, ProcessEnd, ReplicaCommand, ReplicaHandle, replica_argv
from aiperf_core.workflow.plan import WatchSettings

LOG_TAIL_LINES = 20
LOG_TAIL_CHARS = 400  # per line: a runaway line must not bloat the primary log
ENDED_REASONS = ("deadline", "all_replicas_finished", "all_replicas_failed")  # a resume has nothing left to do
FAILURES = ("crashed", "lost")  # what the restart limit counts
LAUNCH_RETRY_S = 10.0


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


def stop_file(run_dir: RunDir) -> Path:
    """Its existence tells every replica to stop after its current epoch (docs/run-directory.md)."""
    return run_dir.primary_dir / "stop"


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line[:LOG_TAIL_CHARS] for line in text.splitlines()[-lines:]]


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
        self.log = EventLog(run_dir.primary_log, clock)
        self._interrupted: int | None = None

    # --- the run ----------------------------------------------------------------------------
    def run_to_end(self) -> str:
        """Run until the deadline, until every replica has finished or failed, or until SIGINT or
        SIGTERM; returns run_end's reason."""
        history = read_events(self.run_dir.primary_log)
        ended = [e for e in history if e.get("event") == "run_end"]
        if self.resume and ended and ended[-1].get("reason") in ENDED_REASONS:
            self.notify(f"the run already ended ({ended[-1]['reason']}); nothing to resume")
            return ended[-1]["reason"]
        self.log.open()
        previous = self._install_signal_handlers()
        try:
            self.log.append("run_start", resume=self.resume, pid=os.getpid(), host=socket.gethostname())
            self._recover(history)
            if self.resume:
                self.executor.end_strays({slot.handle.job for slot in self.slots if slot.handle is not None})
            if self.clock.time() < self.deadline:
                stop_file(self.run_dir).unlink(missing_ok=True)  # left by an earlier primary's shutdown
            return self._watch()
        finally:
            self._restore_signal_handlers(previous)
            self.log.close()

    def _watch(self) -> str:
        while True:
            now = self.clock.time()
            if self._interrupted is not None:
                return self._end_all("interrupted", f"the primary got {signal.Signals(self._interrupted).name}")
            if now >= self.deadline:
                return self._end_at_deadline()
            self._poll(now)
            for slot in self.slots:
                if slot.handle is None and not slot.done:
                    self._launch(slot)
            if all(slot.done and slot.handle is None for slot in self.slots):
                finished = any(self._finished_ever(slot.replica) for slot in self.slots)
                return self._end("all_replicas_finished" if finished else "all_replicas_failed")
            self.tick(now)
            self._sleep(self.executor.poll_interval_s)

    def _sleep(self, seconds: float) -> None:
        end = self.clock.monotonic() + seconds
        while self._interrupted is None and self.clock.monotonic() < end:
            self.clock.sleep(min(0.2, max(0.0, end - self.clock.monotonic())))

    # --- launching and watching ---------------------------------------------------------------
    def _launch(self, slot: ReplicaSlot) -> None:
        if self.clock.time() < slot.not_before:
            return
        slot.attempt += 1
        slot.log_offset = len(read_events(self.run_dir.replica_log(slot.replica)))
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
        self.log.append("replica_launch", replica=slot.replica, attempt=slot.attempt, job=slot.handle.job,
                        log_seq=slot.log_offset)
        self.notify(f"replica {slot.replica}: attempt {slot.attempt} launched ({self.executor.name} job {slot.handle.job})")

    def _command(self, slot: ReplicaSlot) -> ReplicaCommand:
        return ReplicaCommand(slot.replica, slot.attempt, replica_argv(self.run_dir.root, slot.replica),
                              log_path=self.run_dir.replica_dir(slot.replica) / "replica.log")

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
            silent_for = self._silence(slot, now)
            if silent_for is not None and silent_for > self.watch.heartbeat_timeout_s:
                self.executor.stop([slot.handle], grace_s=5)
                self._record_exit(slot, ProcessEnd(False, f"no heartbeat for {silent_for:.0f} s"), lost=True)

    def _silence(self, slot: ReplicaSlot, now: float) -> float | None:
        """Seconds since the running replica last showed life; None while it is queued."""
        if slot.running_since is None:
            return None
        # Heartbeats only move forward, so the silence since the last beat seen bounds the true one
        # from above: while that is within the timeout the decision is the same, and the file (the
        # primary's main cost per poll at thousands of replicas, docs/performance.md) is not read.
        if slot.last_life is not None and now - slot.last_life <= self.watch.heartbeat_timeout_s:
            return now - slot.last_life
        beat = self.run_dir.read_heartbeat(slot.replica) or {}
        beat_time = beat.get("time") if isinstance(beat.get("time"), (int, float)) else 0.0
        slot.last_life = max(slot.running_since, beat_time if beat_time >= slot.launched_at else 0.0)
        return now - slot.last_life

    def _replica_events_since(self, slot: ReplicaSlot) -> list[dict[str, Any]]:
        return read_events(self.run_dir.replica_log(slot.replica))[slot.log_offset:]

    def _record_exit(self, slot: ReplicaSlot, end: ProcessEnd, lost: bool = False, stopped: str | None = None) -> None:
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
            fields.update(trial=trial, log_tail=log_tail(self.run_dir.replica_dir(slot.replica) / "replica.log"))
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
        heads = {str(slot.replica): chain_head(self.run_dir.replica_log(slot.replica)) for slot in self.slots}
        self.log.append("run_end", reason=reason, log_heads=heads)
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
