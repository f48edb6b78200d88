"""A process whose owner may be killed without a word (SIGKILL: a stalled replica restarted by the
primary, a lost node) must leave by itself rather than linger for ever. A child forked from a fork
server is the fork server's child, not its owner's, and keeps the fork server alive, so neither its
parent pid nor a parent-death signal says when the owner is gone: it watches the owner itself, by pid
and start time (a pid alone may be reused). Used by the data workers' pools (data/stream.py) and torch's
data-parallel ranks (backends/torch/distributed.py)."""

from __future__ import annotations

import os
import threading
import time

CHECK_S = 1.0  # how often a watched owner is looked at: how long a killed one's children may linger


def process_identity(pid: int) -> str | None:
    """(Linux) the start time of a live process, None once it is gone or a zombie: a pid alone
    may be reused. The owner reads its own and hands it to its children: a child still starting
    when the owner was killed would find none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields[19]


def leave_when_gone(owner: int, identity: str | None, exit_code: int, name: str) -> None:
    """End this process (os._exit(exit_code), from a daemon thread called `name`) once `owner`, whose
    process_identity was `identity`, is gone. Where /proc gave no identity, the owner counts as gone
    when this process's parent changes."""
    parent = os.getppid()

    def gone() -> bool:
        if identity is not None:
            return process_identity(owner) != identity
        return os.getppid() != parent

    def watch() -> None:
        while not gone():
            time.sleep(CHECK_S)
        os._exit(exit_code)

    threading.Thread(target=watch, name=name, daemon=True).start()
