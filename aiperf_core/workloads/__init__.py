"""Workloads: what a run grows, trains and scores. `cnn` (the paper's: ResNet-50 on ImageNet, the
default) and `lm` (a GPT on byte-level text) implement the same concerns (base.py) side by side;
everything after the trial loop (score, verify, report, submission, check) is shared, and the
ranking keeps one list per workload."""

from __future__ import annotations

from aiperf_core.errors import AiperfError
from aiperf_core.policy import WORKLOADS
from aiperf_core.workloads.base import Workload

DEFAULT = "cnn"


def get(name: str | None) -> Workload:
    """The workload `name` names (None: the default); a one-line error for any other name."""
    name = DEFAULT if name is None else name
    if name == "cnn":
        from aiperf_core.workloads.cnn import CNN

        return CNN
    if name == "lm":
        from aiperf_core.workloads.lm import LM

        return LM
    raise AiperfError(f"workload: {name!r} is not one of {', '.join(WORKLOADS)}")


def of_run(run: dict) -> Workload:
    """The workload of a run.json (runs written before workloads existed are cnn)."""
    return get(run.get("workload", DEFAULT))
