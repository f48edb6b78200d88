"""Durations as people write them: `90m`, `12h`, `1h30m`, `45s`, `2d`, or a plain number of seconds."""

from __future__ import annotations

import re

from aiperf_core.errors import AiperfError

UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def parse_duration(text: str | int | float, what: str = "--time-budget") -> float:
    """Seconds in `text`; a bad or non-positive duration raises AiperfError naming `what`."""
    if isinstance(text, bool):
        raise AiperfError(f"{what}: {text!r} is not a duration (for example 90m, 12h, 1h30m)")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        compact = str(text).strip().lower().replace(" ", "")
        try:
            seconds = float(compact)
        except ValueError:
            parts = _PART.findall(compact)
            if not parts or "".join(n + u for n, u in parts) != compact or len({u for _, u in parts}) != len(parts):
                raise AiperfError(f"{what}: '{text}' is not a duration (for example 90m, 12h, 1h30m)") from None
            seconds = sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
    if not seconds > 0:
        raise AiperfError(f"{what}: '{text}' must be longer than zero")
    return seconds


def format_duration(seconds: float) -> str:
    """`1h05m`, `4m07s`, `12s`: compact, for status lines."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
