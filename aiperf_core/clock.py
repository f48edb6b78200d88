"""The clock that the primary and the run directory's writers read: the system's, or a virtual one.

Everything that stamps an event, writes a heartbeat or waits between polls takes a `Clock`, so the
scale simulation (aiperf_core.workflow.simulation) runs the real primary and real event logs on
virtual time by passing its own clock, while everything else in the process keeps real time.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: what events and heartbeats are stamped with."""

    def monotonic(self) -> float:
        """Seconds for measuring waits: never goes back."""

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
