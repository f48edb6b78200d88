"""The endpoint's command-line options, without importing prometheus-client (every `aiperf`
command builds its parser)."""

from __future__ import annotations

import argparse

DEFAULT_HOST = "127.0.0.1"


def port_number(text: str) -> int:
    """argparse type of a TCP port."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a port number (1 to 65535)")
    return value
