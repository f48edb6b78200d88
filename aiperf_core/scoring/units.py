"""Figures in the paper's units: operations per second with an SI prefix ("56.1 Tera-OPS")."""

from __future__ import annotations

import math

# The paper writes the prefix out in full: "56.1 Tera-OPS", "194.53 Peta-OPS".
PREFIXES = ("", "Kilo-", "Mega-", "Giga-", "Tera-", "Peta-", "Exa-", "Zetta-", "Yotta-")


def ops_prefix(value: float) -> tuple[float, str]:
    """(divisor, prefix) that brings `value` into [1, 1000): one unit for a whole plot axis."""
    if not math.isfinite(value) or value < 1000:
        return 1.0, ""
    power = min(int(math.log10(value) // 3), len(PREFIXES) - 1)
    return 10.0 ** (3 * power), PREFIXES[power]


def format_ops(value: float, digits: int = 3) -> str:
    """`value` ops/s as e.g. '12.3 Tera-OPS', to `digits` significant digits."""
    if value is None or not math.isfinite(value):
        return f"{value} OPS"
    if value == 0:
        return "0 OPS"
    divisor, prefix = ops_prefix(abs(value))
    rounded = float(f"{value / divisor:.{digits - 1}e}")
    # Rounding can carry into the next prefix (999.96 Tera -> 1000 Tera): then say 1.00 Peta.
    if abs(rounded) >= 1000 and prefix != PREFIXES[-1]:
        divisor *= 1000
        prefix = PREFIXES[PREFIXES.index(prefix) + 1]
        rounded = float(f"{value / divisor:.{digits - 1}e}")
    decimals = max(digits - 1 - int(math.floor(math.log10(abs(rounded)))), 0)
    return f"{rounded:.{decimals}f} {prefix}OPS"
