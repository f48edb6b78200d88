"""The user's config file: TOML, `--config FILE`, else $AIPERF_CONFIG, else ./aiperf.toml if present.

Top-level keys are the options of `aiperf run` (and `backend`, which every command reads); two
tables hold the rest:

    backend = "torch"
    executor = "slurm"            # local | slurm | hosts
    replicas = 8
    devices_per_replica = 4
    time_budget = "12h"
    data = "/datasets/imagenet"   # digits | synthetic | PATH
    run_dir = "/shared/runs/r1"
    seed = 1
    max_restarts = 3              # restarts of a crashed replica
    heartbeat_timeout = "10m"     # a replica silent this long is lost
    stall_timeout = "10m"         # a training replica with no finished step for this long is lost
    stop_after_trials = 2         # bounds a test run (each replica stops after this many trials)

    [policy]                      # aiperf_core.policy items; a changed fixed item makes the run unofficial
    image_size = 64
    precision = "auto"            # auto (default), fp32, tf32, bf16, fp16
    data_workers = 8              # data transformation workers per replica, at least 1 (--data-workers)

    [slurm]
    partition = "gpu"
    account = "proj42"
    time_limit = "13h"            # per replica job; default: the time budget plus 10 minutes
    gpus_per_node = 4
    cpus_per_task = 32
    extra_args = ["--qos=high", "--constraint=a100"]   # passed to sbatch as given

Every value is checked here, and an unknown key is an error that names it: a typo must not
silently fall back to a default in a benchmark run. Command-line flags beat the file.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping

from aiperf_core.errors import AiperfError

DEFAULT_NAME = "aiperf.toml"
ENV_VAR = "AIPERF_CONFIG"


def _non_empty_string(value: Any) -> str | None:
    return None if isinstance(value, str) and value else "must be a non-empty string"


def _integer(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer"
        return None if value >= low else f"must be at least {low}"
    return check


def _one_of(*allowed: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return check


def _duration(value: Any) -> str | None:
    from aiperf_core.workflow.duration import parse_duration

    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return "must be a duration such as \"90m\" or \"12h\""
    try:
        parse_duration(value)
    except AiperfError:
        return "must be a duration such as \"90m\" or \"12h\""
    return None


def _string_list(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None
    return "must be a string or a list of strings"


TOP_LEVEL: dict[str, Callable[[Any], str | None]] = {
    "backend": _non_empty_string,
    "executor": _one_of("local", "slurm", "hosts"),
    "replicas": _integer(1),
    "devices_per_replica": _integer(1),
    "nodes_per_replica": lambda value: None if value == "auto" else _integer(1)(value),
    "time_budget": _duration,
    "workload": _one_of("cnn", "lm"),
    "data": _non_empty_string,
    "run_dir": _non_empty_string,
    "seed": _integer(0),
    "max_restarts": _integer(0),
    "heartbeat_timeout": _duration,
    "stall_timeout": _duration,
    "stop_after_trials": _integer(1),
}
SLURM: dict[str, Callable[[Any], str | None]] = {
    "partition": _non_empty_string,
    "account": _non_empty_string,
    "time_limit": _duration,
    "gpus_per_node": _integer(0),
    "cpus_per_task": _integer(1),
    "extra_args": _string_list,
}
TABLES = ("policy", "slurm")
KNOWN_KEYS = set(TOP_LEVEL) | set(TABLES)


def load_config(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The checked settings of the config file, or {} when there is none."""
    environ = os.environ if environ is None else environ
    explicit = path or environ.get(ENV_VAR)
    candidate = Path(explicit) if explicit else Path(DEFAULT_NAME)
    if not candidate.is_file():
        if explicit:
            raise AiperfError(f"config file {candidate}: no such file")
        return {}
    try:
        data = tomllib.loads(candidate.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AiperfError(f"config file {candidate}: {exc}") from None
    problem = check_config(data)
    if problem:
        raise AiperfError(f"config file {candidate}: {problem}")
    return data


def check_config(data: Mapping[str, Any]) -> str | None:
    """The first problem of a parsed config, as '<key>: <what is wrong>', or None."""
    unknown = sorted(set(data) - KNOWN_KEYS)
    if unknown:
        from aiperf_core.policy import BY_NAME

        if unknown[0] in BY_NAME:  # e.g. data_workers, precision: items of the [policy] table
            return f"unknown setting '{unknown[0]}': it is a policy item, set it under [policy]"
        return f"unknown setting '{unknown[0]}' (known: {', '.join(sorted(KNOWN_KEYS))})"
    problem = _check_keys(data, TOP_LEVEL, prefix="", tables=TABLES)
    if problem:
        return problem
    for table in TABLES:
        if table in data and not isinstance(data[table], dict):
            return f"'{table}' must be a table ([{table}])"
    if "slurm" in data:
        problem = _check_keys(data["slurm"], SLURM, prefix="slurm.")
        if problem:
            return problem
    if "policy" in data:
        from aiperf_core.policy import Policy

        values = dict(data["policy"])
        if "workload" in data:  # the top-level key picks the track the items are checked against
            if values.setdefault("workload", data["workload"]) != data["workload"]:
                return f"policy.workload: {values['workload']!r} differs from workload {data['workload']!r}"
        try:
            Policy(values, source="policy")
        except AiperfError as exc:
            return str(exc)
    return None


def _check_keys(data: Mapping[str, Any], checks: Mapping[str, Callable[[Any], str | None]], prefix: str,
                tables: tuple[str, ...] = ()) -> str | None:
    for key, value in data.items():
        if key in tables:
            continue
        check = checks.get(key)
        if check is None:
            return f"unknown setting '{prefix}{key}' (known: {', '.join(prefix + k for k in sorted(checks))})"
        problem = check(value)
        if problem:
            return f"'{prefix}{key}' {problem}"
    return None
