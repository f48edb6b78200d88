"""The system description (system.toml): what machine a result comes from (docs/submission.md).

`aiperf system describe` fills in what the node shows (aiperf_core/inventory.py, the same source as
the monitor's host record, so that `aiperf check` compares like with like) and leaves what only the
site knows as placeholders, "<...>", which every check refuses. The file is TOML, written by hand
here with a comment above every field, and read with tomllib.

Schema version 1 (docs/submission.md, "The system description"): the keys are fixed, an unknown key
is refused by name, and every value is checked for its type, unit and allowed values. A bad file is
one line: "{path}: {dotted.field}: {what is wrong}".
"""

from __future__ import annotations

import math
import platform
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from aiperf_core.backend import PRECISIONS
from aiperf_core.inventory import device_type
from aiperf_core.submission import SubmissionError

SCHEMA_VERSION = 1

# The fields only the site knows, and the declared peak: describe leaves them as placeholders.
# describe also leaves a placeholder for a fact the node does not show (a CPU topology that
# /proc/cpuinfo hides, an accelerator's memory and driver when only a framework saw it) and, with
# --backend, for the peak at every other precision the device runs.
PLACEHOLDER_FIELDS = ("submitter", "site", "country", "system_name", "availability", "interconnect",
                      "shared_storage", "cooling", "notes", "accelerators.peak_ops.fp32")

AVAILABILITY = ("available", "preview", "research")
COOLING = ("air", "liquid", "hybrid", "immersion")
ACCELERATOR_KINDS = ("cpu", "gpu", "npu", "other")

# Below these a value is in the wrong unit, not a real machine: a peak of 19.5 means TFLOPS were
# written where operations per second belong, a memory of 64 means GiB where bytes belong.
MIN_PEAK_OPS = 1e9
MIN_MEMORY_BYTES = 1 << 20

# A description is a few kilobytes; the reviewer's check reads one from an untrusted package.
MAX_FILE_BYTES = 1 << 20

# Distributions whose versions describe a run's software, looked up without importing them.
FRAMEWORK_DISTRIBUTIONS = ("torch", "tensorflow", "tensorflow-cpu", "jax", "jaxlib", "flax", "mindspore", "numpy")
DALI_PREFIX = "nvidia-dali-"

# A backend's device string's type ("cuda:0" -> "cuda") -> accelerators.kind.
DEVICE_KINDS = {"cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu", "ascend": "npu", "npu": "npu"}

_COUNTRY = re.compile(r"[A-Z]{2}")
_DISTRIBUTION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class _Invalid(Exception):
    """What is wrong with one value; validate_system adds the file and the field."""


def is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and len(value) >= 2 and value.startswith("<") and value.endswith(">")


# -- value checks ---------------------------------------------------------------------------------

def _shown(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table", list: "array"}.get(
        type(value), type(value).__name__)
    if isinstance(value, (dict, list)):
        return f"an {kind}" if kind == "array" else f"a {kind}"
    text = repr(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _text(one_line: bool = True) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if not isinstance(value, str):
            raise _Invalid(f"must be a string, got {_shown(value)}")
        if not value.strip():
            raise _Invalid("must not be empty")
        if one_line and ("\n" in value or "\r" in value):
            raise _Invalid("must be one line")
    return check


def _choice(allowed: tuple[str, ...]) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        _text()(value)
        if value not in allowed:
            raise _Invalid(f"must be one of {', '.join(repr(a) for a in allowed)}, got {value!r}")
    return check


def _country(value: Any) -> None:
    _text()(value)
    if not _COUNTRY.fullmatch(value):
        raise _Invalid(f"must be an ISO 3166-1 alpha-2 code, two capital letters such as 'DE' or 'CN', got {value!r}")


def _integer(minimum: int, unit: str = "") -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            what = f"an integer number of {unit}" if unit else "an integer"
            raise _Invalid(f"must be {what}, got {_shown(value)}")
        if value < minimum:
            raise _Invalid(f"must be >= {minimum}, got {value}")
    return check


def _memory_bytes(minimum: int) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        _integer(minimum, "bytes")(value)
        if 0 < value < MIN_MEMORY_BYTES:
            raise _Invalid(f"must be in bytes; {value} is under 1 MiB (64 GiB is {64 << 30})")
    return check


def _peak_ops(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid(f"must be a number of operations per second such as 1.95e13, got {_shown(value)}")
    if not math.isfinite(value):
        raise _Invalid(f"must be a finite number, got {value}")
    if value <= 0:
        raise _Invalid(f"must be > 0 operations per second, got {value:g}")
    if value < MIN_PEAK_OPS:
        raise _Invalid(f"must be in operations per second; {value:g} is under 1e9 (19.5 TFLOPS is 1.95e13)")


def _schema_version(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"must be the integer {SCHEMA_VERSION}, got {_shown(value)}")
    if value != SCHEMA_VERSION:
        raise _Invalid(f"unsupported version {value} (this aiperf reads schema version {SCHEMA_VERSION})")


# -- the schema -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    name: str  # dotted
    what: str  # what it is, for the comment and for "placeholder left: fill in ..."
    unit: str  # its unit and allowed values, for the comment
    check: Callable[[Any], None]
    # What describe writes when it leaves the field to the site. "": describe always knows the
    # value (or it is a count others multiply), so a placeholder there is a wrong type, also in a draft.
    placeholder: str = ""


def _peak_field(precision: str) -> Field:
    return Field(f"accelerators.peak_ops.{precision}", f"the vendor's dense peak of one device at {precision}",
                 "operations per second, a number > 0 (19.5 TFLOPS is 1.95e13)", _peak_ops,
                 f"<vendor dense peak of one device at {precision}, in OPS>")


def _framework_field(name: str) -> Field:
    return Field(f"software.frameworks.{name}", f"the installed version of {name}", "version string", _text())


FIELDS = (
    Field("schema_version", "the version of this schema", f"integer, {SCHEMA_VERSION}", _schema_version),
    Field("submitter", "the person or team that submits the result", "text", _text(), "<person or team>"),
    Field("site", "the institution that runs the system", "text", _text(), "<institution>"),
    Field("country", "the site's country", "ISO 3166-1 alpha-2 code, two capital letters", _country,
          "<ISO 3166-1 alpha-2 code, such as DE>"),
    Field("system_name", "the system's name", "text", _text(), "<system name>"),
    Field("availability", "whether others can buy or use the system", "one of: " + ", ".join(AVAILABILITY),
          _choice(AVAILABILITY), "<" + " | ".join(AVAILABILITY) + ">"),
    Field("interconnect", "the network between nodes", "text, such as InfiniBand NDR 400 Gb/s; none for one node",
          _text(), "<such as InfiniBand NDR 400 Gb/s, or none for one node>"),
    Field("shared_storage", "the file system the nodes share", "text, such as Lustre 2.15; or none", _text(),
          "<such as Lustre 2.15, or none>"),
    Field("cooling", "how the nodes are cooled", "one of: " + ", ".join(COOLING), _choice(COOLING),
          "<" + " | ".join(COOLING) + ">"),
    Field("notes", "anything else a reader needs", "free text, several lines allowed; or none", _text(one_line=False),
          "<free text, or none>"),
    Field("nodes.count", "the number of nodes the run used (describe writes 1: the site sets it)", "integer >= 1",
          _integer(1, "nodes")),
    Field("nodes.cpu_model", "the host CPU model of a node", "text, as the node reports it", _text(),
          "<host CPU model>"),
    Field("nodes.sockets", "CPU sockets per node", "integer >= 1", _integer(1, "sockets"), "<CPU sockets per node>"),
    Field("nodes.cores", "physical CPU cores per node, over all sockets", "integer >= sockets",
          _integer(1, "cores"), "<physical CPU cores per node>"),
    Field("nodes.threads", "logical CPUs per node", "integer >= cores", _integer(1, "threads"),
          "<logical CPUs per node>"),
    Field("nodes.memory_bytes", "host memory per node", "bytes, integer > 0", _memory_bytes(1),
          "<host memory per node, in bytes>"),
    Field("nodes.os", "the operating system and kernel of a node", "text", _text(), "<operating system>"),
    Field("accelerators.kind", "the compute device of a node (cpu: the host CPUs are its one device)",
          "one of: " + ", ".join(ACCELERATOR_KINDS), _choice(ACCELERATOR_KINDS)),
    Field("accelerators.model", "the model of one device (for kind cpu, nodes.cpu_model)", "text",
          _text(), "<accelerator model>"),
    Field("accelerators.per_node", "devices per node (1 for kind cpu)", "integer >= 1", _integer(1, "devices")),
    Field("accelerators.memory_bytes", "memory of one device (0 for kind cpu: see nodes.memory_bytes)",
          "bytes, integer >= 0", _memory_bytes(0), "<memory of one device, in bytes>"),
    Field("accelerators.driver", "the accelerator driver's version", "text, or none", _text(),
          "<driver version, or none>"),
    _peak_field("fp32"),
    Field("software.python", "the Python version", "version string", _text()),
    Field("software.aiperf", "the aiperf version", "version string", _text(), "<aiperf version>"),
)


def _bytes_per_second(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _Invalid(f"must be a number of bytes per second > 0, got {_shown(value)}")


def _seconds(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise _Invalid(f"must be a number of seconds >= 0, got {_shown(value)}")


def _probe_fields(collective: str) -> tuple[Field, ...]:
    name = collective.replace("_", "-")
    return (
        Field(f"network_probe.{collective}_latency_s", f"the {name}'s fitted latency (alpha)", "seconds", _seconds),
        Field(f"network_probe.{collective}_busbw_bytes_per_s", f"the {name}'s fitted bus bandwidth (beta)",
              "bytes per second", _bytes_per_second),
        Field(f"network_probe.{collective}_largest_bytes", f"the largest {name} size measured", "bytes per rank",
              _integer(1, "bytes")),
        Field(f"network_probe.{collective}_largest_busbw_bytes_per_s", f"the {name}'s bus bandwidth at that size",
              "bytes per second", _bytes_per_second),
    )


# The optional [network_probe] table: what `aiperf probe network` measured between the nodes, beside
# the declared interconnect (describe --probe-network FILE; docs/submission.md).
PROBE_FIELDS = (
    Field("network_probe.backend", "the backend whose collectives were timed", "backend name", _text()),
    Field("network_probe.device", "the device type the ranks ran on", "text, such as cpu or cuda", _text()),
    Field("network_probe.nodes", "the nodes the probe ran across", "integer >= 1", _integer(1, "nodes")),
    Field("network_probe.ranks", "the ranks the probe ran", "integer >= 1", _integer(1, "ranks")),
    *_probe_fields("all_reduce"),
    *_probe_fields("all_to_all"),
)
FIELDS = FIELDS + PROBE_FIELDS
FIELD = {f.name: f for f in FIELDS}

# Each table's keys, in file order; None: a table whose keys vary (checked by _dynamic_field).
TABLES: dict[str, tuple[str, ...] | None] = {
    "": ("schema_version", "submitter", "site", "country", "system_name", "availability", "interconnect",
         "shared_storage", "cooling", "notes", "network_probe", "nodes", "accelerators", "software"),
    "network_probe": tuple(f.name.split(".", 1)[1] for f in PROBE_FIELDS),
    "nodes": ("count", "cpu_model", "sockets", "cores", "threads", "memory_bytes", "os"),
    "accelerators": ("kind", "model", "per_node", "memory_bytes", "driver", "peak_ops"),
    "accelerators.peak_ops": None,
    "software": ("python", "aiperf", "frameworks"),
    "software.frameworks": None,
}
# Keys a table may leave out.
OPTIONAL_KEYS = {"": ("network_probe",)}
TABLE_COMMENTS = {
    "network_probe": "measured by `aiperf probe network` between the nodes (nccl-tests' bus bandwidth), beside "
                     "the declared interconnect above; optional",
    "nodes": "one node of the system: every node is the same",
    "accelerators": "the compute devices of one node",
    "accelerators.peak_ops": "the vendor's dense peak of ONE device, in operations per second, per precision "
                             f"({', '.join(PRECISIONS)}); fp32 is required",
    "software": "the software the run used",
    "software.frameworks": "installed distribution -> its version",
}
REQUIRED_DYNAMIC = {"accelerators.peak_ops": ("fp32",), "software.frameworks": ()}


def _dynamic_field(table: str, key: str) -> Field:
    if table == "accelerators.peak_ops":
        if key not in PRECISIONS:
            raise _Invalid(f"unknown precision (allowed: {', '.join(PRECISIONS)})")
        return _peak_field(key)
    if not _DISTRIBUTION_NAME.fullmatch(key):
        raise _Invalid("not a distribution name")
    return _framework_field(key)


def _field_of(dotted: str) -> Field | None:
    """The schema's field of a dotted name, or None for a name the schema does not know."""
    table, _, key = dotted.rpartition(".")
    if dotted in FIELD or TABLES.get(table, ()) is not None:
        return FIELD.get(dotted)
    try:
        return _dynamic_field(table, key)
    except _Invalid:
        return None


def _comment(dotted: str) -> str | None:
    field = _field_of(dotted)
    return f"{field.what}; {field.unit}" if field else None


# -- validation -----------------------------------------------------------------------------------

def _join(table: str, key: str) -> str:
    return f"{table}.{key}" if table else key


def validate_system(description: dict, source: str = "system.toml", allow_placeholders: bool = False) -> dict:
    """Check a description against schema version 1 and return it. SubmissionError, one line
    "{source}: {field}: {what is wrong}", on the first problem: the schema version first, then each
    table (an unknown key, then a missing one, then each value in file order: wrong type, unit or
    value), then the rules across fields, then (unless allow_placeholders) the first placeholder in
    file order."""

    def fail(field: str, what: str) -> None:
        raise SubmissionError(f"{source}: {field}: {what}")

    if not isinstance(description, dict):
        raise SubmissionError(f"{source}: not a table of fields, got {_shown(description)}")
    if "schema_version" not in description:
        fail("schema_version", f"missing (this aiperf reads schema version {SCHEMA_VERSION})")
    try:
        _schema_version(description["schema_version"])
    except _Invalid as exc:
        fail("schema_version", str(exc))
    _check_table(description, "", fail)
    _check_across(description, fail)
    if not allow_placeholders:
        left = placeholders(description)
        if left:
            optional = left[0].startswith("accelerators.peak_ops.") and left[0] not in PLACEHOLDER_FIELDS
            fail(left[0], f"placeholder left: fill in {_field_of(left[0]).what}"
                          + (", or delete the line to declare no peak at that precision" if optional else ""))
    return description


def _check_table(table: dict, name: str, fail: Callable[[str, str], None]) -> None:
    keys = TABLES[name]
    if keys is not None:
        for key in table:
            if key not in keys:
                fail(_join(name, key), f"unknown key (allowed here: {', '.join(keys)})")
    for key in keys if keys is not None else REQUIRED_DYNAMIC[name]:
        if key not in table and key not in OPTIONAL_KEYS.get(name, ()):
            fail(_join(name, key), "missing")
    for key, value in table.items():
        dotted = _join(name, key)
        if dotted in TABLES:
            if not isinstance(value, dict):
                fail(dotted, f"must be a table [{dotted}], got {_shown(value)}")
            _check_table(value, dotted, fail)
            continue
        try:
            field = FIELD.get(dotted) if keys is not None else _dynamic_field(name, key)
            if isinstance(value, dict):
                raise _Invalid("must be a value, got a table")
            if not (is_placeholder(value) and field.placeholder):
                field.check(value)
        except _Invalid as exc:
            fail(dotted, str(exc))


def _check_across(d: dict, fail: Callable[[str, str], None]) -> None:
    """The rules between fields; a placeholder on either side leaves a rule unchecked."""
    nodes, accelerators = d["nodes"], d["accelerators"]

    def known(*values: Any) -> bool:
        return not any(is_placeholder(v) for v in values)

    if known(nodes["cores"], nodes["sockets"]) and nodes["cores"] < nodes["sockets"]:
        fail("nodes.cores", f"must be >= nodes.sockets ({nodes['sockets']}), got {nodes['cores']}")
    if known(nodes["threads"], nodes["cores"]) and nodes["threads"] < nodes["cores"]:
        fail("nodes.threads", f"must be >= nodes.cores ({nodes['cores']}), got {nodes['threads']}")
    if known(d["interconnect"], nodes["count"]) and d["interconnect"] == "none" and nodes["count"] > 1:
        fail("interconnect", f"is 'none', but nodes.count is {nodes['count']}: name the network between the nodes")
    kind = accelerators["kind"]
    if kind == "cpu":
        if known(accelerators["model"], nodes["cpu_model"]) and accelerators["model"] != nodes["cpu_model"]:
            fail("accelerators.model", f"must equal nodes.cpu_model for kind cpu ({nodes['cpu_model']!r}), "
                                       f"got {accelerators['model']!r}")
        if known(accelerators["per_node"]) and accelerators["per_node"] != 1:
            fail("accelerators.per_node", f"must be 1 for kind cpu (the host CPUs are one device), "
                                          f"got {accelerators['per_node']}")
        if known(accelerators["memory_bytes"]) and accelerators["memory_bytes"] != 0:
            fail("accelerators.memory_bytes", "must be 0 for kind cpu (the host memory is nodes.memory_bytes), "
                                              f"got {accelerators['memory_bytes']}")
    elif known(kind, accelerators["memory_bytes"]) and accelerators["memory_bytes"] == 0:
        fail("accelerators.memory_bytes", f"must be > 0 for kind {kind}: the memory of one device, in bytes")


def load_system(path, allow_placeholders: bool = False) -> dict:
    """Read and validate a system description file (SubmissionError, one line, naming the file)."""
    from aiperf_core.atomic import read_small_file

    data = read_small_file(path, MAX_FILE_BYTES, "a system description", SubmissionError)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SubmissionError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        description = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SubmissionError(f"{path}: not valid TOML: {str(exc).splitlines()[0]}") from None
    return validate_system(description, str(path), allow_placeholders)


def placeholders(description: dict) -> list[str]:
    """The dotted names of every placeholder left, in file order."""
    return [name for name, value in _leaves(description) if is_placeholder(value)]


def _leaves(table: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        if isinstance(value, dict):
            yield from _leaves(value, _join(prefix, key))
        else:
            yield _join(prefix, key), value


def device_count(description: dict) -> int:
    """Devices in the whole system: nodes.count * accelerators.per_node."""
    return int(description["nodes"]["count"]) * int(description["accelerators"]["per_node"])


def declared_peak_ops(description: dict, precision: str) -> float | None:
    """The declared dense peak of one device at `precision`, in operations per second; None where
    the description declares none (or leaves a placeholder)."""
    value = description.get("accelerators", {}).get("peak_ops", {}).get(precision)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


# -- describe -------------------------------------------------------------------------------------

def _placeholder(name: str) -> str:
    return FIELD[name].placeholder


def network_probe_table(record: dict) -> dict:
    """The [network_probe] table of a probe record (aiperf_core.network.probe; read with load_probe)."""
    from aiperf_core.network.probe import COLLECTIVES, summary

    shown = summary(record)
    table = {key: shown[key] for key in ("backend", "device", "nodes", "ranks")}
    for collective in COLLECTIVES:
        if collective not in shown:
            raise SubmissionError(f"network probe: no {collective} measured")
        for key, value in shown[collective].items():
            table[f"{collective}_{key}"] = value
    return table


def describe(backend_name: str | None = None, probe_network: str | Path | None = None) -> dict:
    """This node's description, with placeholders for what only the site knows. Accelerators come
    from NVML; where NVML sees none and `backend_name` is given, from that backend's device query;
    else the host CPUs are the node's one device. With a backend, the peak gets one placeholder per
    precision the device runs. With `probe_network` (a file `aiperf probe network` wrote), its
    figures go into [network_probe], beside the declared interconnect."""
    from aiperf_core import inventory

    cpu = inventory.host_cpu()
    memory = inventory.memory_bytes()
    nodes = {
        "count": 1,
        "cpu_model": cpu["model"] or _placeholder("nodes.cpu_model"),
        "sockets": cpu["sockets"] or _placeholder("nodes.sockets"),
        "cores": cpu["cores"] or _placeholder("nodes.cores"),
        "threads": cpu["threads"] or _placeholder("nodes.threads"),
        "memory_bytes": memory or _placeholder("nodes.memory_bytes"),
        "os": inventory.os_description() or _placeholder("nodes.os"),
    }
    backend = None
    if backend_name is not None:
        from aiperf_core.registry import load_backend

        backend = load_backend(backend_name)
    accelerators, precisions = _accelerators(nodes["cpu_model"], backend)
    accelerators["peak_ops"] = {p: _peak_field(p).placeholder for p in PRECISIONS if p in precisions}
    description = {"schema_version": SCHEMA_VERSION}
    description.update({name: _placeholder(name) for name in PLACEHOLDER_FIELDS if "." not in name})
    if probe_network is not None:
        from aiperf_core.network.probe import load_probe

        description["network_probe"] = network_probe_table(load_probe(probe_network))
    description.update(nodes=nodes, accelerators=accelerators, software=_software())
    return description


def _device_kind(device: str) -> str:
    """accelerators.kind of a backend's device string ('cpu', 'cpu:1', 'cpu (x86_64)', 'cuda:0', 'Ascend:0')."""
    return DEVICE_KINDS.get(device_type(device), "other")


def _accelerators(cpu_model: str, backend) -> tuple[dict, tuple[str, ...]]:
    """(the accelerators table without its peak, the precisions to leave a peak placeholder for)."""
    from aiperf_core import inventory

    devices, driver, _status = inventory.nvml_accelerators()
    framework_devices = list(backend.devices()) if backend is not None else []
    framework_accelerators = [d for d in framework_devices if _device_kind(d) != "cpu"]
    if devices:
        models = sorted({d["name"] for d in devices})
        if len(models) > 1:
            raise SubmissionError(f"this node has several accelerator models ({', '.join(models)}); "
                                  "a system description declares one model per node")
        table = {"kind": "gpu", "model": models[0], "per_node": len(devices),
                 # the smallest is what every device of the node offers
                 "memory_bytes": min(d["memory_total"] for d in devices),
                 "driver": driver or _placeholder("accelerators.driver")}
        if backend is not None and not framework_accelerators:
            raise SubmissionError(f"backend '{backend.name}' sees no accelerator here, though NVML shows "
                                  f"{len(devices)} x {models[0]}: its precisions would be the CPU's")
        device = framework_accelerators[0] if framework_accelerators else None
    elif framework_accelerators:
        models = sorted({backend.device_model(d) or _placeholder("accelerators.model")
                         for d in framework_accelerators})
        if len(models) > 1:
            raise SubmissionError(f"backend '{backend.name}' sees several accelerator models "
                                  f"({', '.join(models)}); a system description declares one model per node")
        table = {"kind": _device_kind(framework_accelerators[0]), "model": models[0],
                 "per_node": len(framework_accelerators),
                 "memory_bytes": _placeholder("accelerators.memory_bytes"),
                 "driver": _placeholder("accelerators.driver")}
        device = framework_accelerators[0]
    else:
        table = {"kind": "cpu", "model": cpu_model, "per_node": 1, "memory_bytes": 0, "driver": "none"}
        device = framework_devices[0] if framework_devices else None
    precisions = tuple(backend.precisions(device)) if device is not None else ("fp32",)
    return table, ("fp32",) + precisions


def _software() -> dict:
    from importlib.metadata import PackageNotFoundError, distributions, version

    installed: dict[str, str] = {}
    for dist in distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        installed.setdefault(name, dist.version)  # the first on sys.path is the one that imports
    names = [n for n in FRAMEWORK_DISTRIBUTIONS if n in installed]
    names += sorted(n for n in installed if n.startswith(DALI_PREFIX))
    try:
        aiperf = version("aiperf")
    except PackageNotFoundError:
        aiperf = _placeholder("software.aiperf")
    return {"python": platform.python_version(), "aiperf": aiperf,
            "frameworks": {n: installed[n] for n in names}}


# -- TOML -----------------------------------------------------------------------------------------

HEADER = (f"# aiperf system description, schema version {SCHEMA_VERSION} (docs/submission.md).",
          "# Written by `aiperf system describe`. Replace every value written as \"<...>\"; a value the",
          "# site must fill in is never guessed. Check it with `aiperf system validate FILE`.", "")


def to_toml(description: dict) -> str:
    """The description as TOML with a comment line above each field: tomllib.loads(to_toml(d)) == d."""
    lines = list(HEADER)
    _emit(lines, description, ())
    return "\n".join(lines) + "\n"


def _emit(lines: list[str], table: dict, path: tuple[str, ...]) -> None:
    dotted = ".".join(path)
    if path:
        lines.append("")
        if dotted in TABLE_COMMENTS:
            lines.append(f"# {TABLE_COMMENTS[dotted]}")
        lines.append("[" + ".".join(_key(k) for k in path) + "]")
    for key, value in table.items():
        if not isinstance(value, dict):
            comment = _comment(_join(dotted, key))
            if comment:
                lines.append(f"# {comment}")
            lines.append(f"{_key(key)} = {_value(value, _join(dotted, key))}")
    for key, value in table.items():
        if isinstance(value, dict):
            _emit(lines, value, path + (key,))


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: Any, dotted: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # 'inf', 'nan', '1e+16' and '1.5' are TOML floats as written
    if isinstance(value, str):
        return _string(value)
    raise SubmissionError(f"{dotted}: cannot be written as TOML: {_shown(value)}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _string(text: str) -> str:
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def write_description(path: str | Path, description: dict, force: bool = False) -> None:
    """Write to_toml(description) to `path` atomically; without `force` an existing file is refused."""
    from aiperf_core.atomic import write_text_atomic

    path = Path(path)
    refusal = f"{path}: exists; pass --force to overwrite it"
    if path.exists() and not force:
        raise SubmissionError(refusal)
    try:
        write_text_atomic(path, to_toml(description), exclusive=not force)
    except FileExistsError:
        raise SubmissionError(refusal) from None
    except OSError as exc:
        raise SubmissionError(f"{path}: cannot write: {exc.strerror or exc}") from None
