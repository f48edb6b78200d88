"""The system description (system.toml): `aiperf system describe` and `validate`, its schema and checks."""

from __future__ import annotations

import copy
import tomllib

import pytest

from aiperf_core import inventory
from aiperf_core.cli import main
from aiperf_core.submission import SubmissionError
from aiperf_core.submission.system import (PLACEHOLDER_FIELDS, SCHEMA_VERSION, declared_peak_ops, describe,
                                           device_count, load_system, placeholders, to_toml, validate_system)

SITE_FIELDS = {"submitter": "HPC team", "site": "Example University", "country": "DE",
               "system_name": "Example-1", "availability": "research", "interconnect": "none",
               "shared_storage": "Lustre 2.15", "cooling": "air", "notes": "none"}


@pytest.fixture(scope="module")
def described() -> dict:
    return describe()


@pytest.fixture
def filled(described) -> dict:
    d = copy.deepcopy(described)
    d.update(SITE_FIELDS)
    d["accelerators"]["peak_ops"]["fp32"] = 1.6e11
    return d


def write(tmp_path, description, name="system.toml"):
    path = tmp_path / name
    path.write_text(to_toml(description))
    return path


def set_field(description: dict, dotted: str, value) -> dict:
    *tables, key = dotted.split(".")
    table = description
    for name in tables:
        table = table[name]
    table[key] = value
    return description


def refusal(capsys, argv) -> str:
    """Run the CLI expecting exit status 2 and one line on stderr; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


# -- describe -------------------------------------------------------------------------------------

def test_describe_this_cpu_only_machine(described):
    cpu = inventory.host_cpu()
    assert described["schema_version"] == SCHEMA_VERSION
    assert described["nodes"] == {"count": 1, "cpu_model": cpu["model"], "sockets": cpu["sockets"],
                                  "cores": cpu["cores"], "threads": cpu["threads"],
                                  "memory_bytes": inventory.memory_bytes(), "os": inventory.os_description()}
    assert described["nodes"]["memory_bytes"] > 0
    accelerators = described["accelerators"]
    assert accelerators["kind"] == "cpu" and accelerators["model"] == cpu["model"]
    assert accelerators["per_node"] == 1 and accelerators["memory_bytes"] == 0 and accelerators["driver"] == "none"
    assert placeholders(described) == list(PLACEHOLDER_FIELDS)
    software = described["software"]
    assert software["aiperf"] == "0.1.0" and software["python"].startswith("3.")
    assert "numpy" in software["frameworks"]
    # what is installed here as tensorflow-cpu is recorded under that name, never as 'tensorflow'
    assert set(software["frameworks"]) <= {"torch", "tensorflow", "tensorflow-cpu", "jax", "jaxlib", "flax",
                                           "mindspore", "numpy"} | {n for n in software["frameworks"]
                                                                    if n.startswith("nvidia-dali-")}
    assert validate_system(described, allow_placeholders=True) is described


def test_describe_takes_accelerators_from_nvml(monkeypatch):
    gib = 1 << 30
    nvml = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{i}", "memory_total": 80 * gib - i}
            for i in range(4)]
    monkeypatch.setattr(inventory, "nvml_accelerators", lambda: (nvml, "550.54.15", "ok"))
    accelerators = describe()["accelerators"]
    assert accelerators == {"kind": "gpu", "model": "NVIDIA H100 80GB HBM3", "per_node": 4,
                            "memory_bytes": 80 * gib - 3, "driver": "550.54.15",
                            "peak_ops": {"fp32": "<vendor dense peak of one device at fp32, in OPS>"}}
    nvml[1] = dict(nvml[1], name="NVIDIA A100-SXM4-40GB")
    with pytest.raises(SubmissionError, match="several accelerator models"):
        describe()


class FrameworkOnlyBackend:
    """A backend whose framework sees two accelerators that NVML does not (an NPU, say)."""

    name = "fake"

    def __init__(self, devices):
        self._devices = devices

    def devices(self):
        return self._devices

    def device_model(self, device):
        return None if device.startswith("cpu") else "Ascend 910"

    def precisions(self, device=None):
        return ("fp32", "fp16") if not device.startswith("cpu") else ("fp32",)


def test_describe_asks_the_backend_when_nvml_sees_nothing(monkeypatch):
    import aiperf_core.registry

    npus = FrameworkOnlyBackend(["Ascend:0", "Ascend:1"])
    monkeypatch.setattr(aiperf_core.registry, "load_backend", lambda name: npus)
    d = describe("fake")
    assert d["accelerators"]["kind"] == "npu" and d["accelerators"]["model"] == "Ascend 910"
    assert d["accelerators"]["per_node"] == 2
    # what the framework cannot tell is left to the site, as is the peak at each precision it runs
    assert placeholders(d)[len(SITE_FIELDS):] == ["accelerators.memory_bytes", "accelerators.driver",
                                                  "accelerators.peak_ops.fp32", "accelerators.peak_ops.fp16"]

    nvml = [{"index": 0, "name": "NVIDIA H100", "uuid": "GPU-0", "memory_total": 1 << 36}]
    monkeypatch.setattr(inventory, "nvml_accelerators", lambda: (nvml, "550", "ok"))
    monkeypatch.setattr(aiperf_core.registry, "load_backend", lambda name: FrameworkOnlyBackend(["cpu"]))
    with pytest.raises(SubmissionError, match="sees no accelerator here, though NVML shows 1 x NVIDIA H100"):
        describe("fake")


def test_describe_with_the_numpy_backend(capsys):
    assert main(["system", "describe", "--backend", "numpy"]) == 0
    d = tomllib.loads(capsys.readouterr().out)
    assert d["accelerators"]["kind"] == "cpu" and d["accelerators"]["model"] == inventory.host_cpu()["model"]
    assert list(d["accelerators"]["peak_ops"]) == ["fp32"]  # the numpy backend runs fp32 only


# -- TOML -----------------------------------------------------------------------------------------

def test_toml_round_trip(described, filled):
    assert tomllib.loads(to_toml(described)) == described
    tricky = copy.deepcopy(filled)
    tricky["notes"] = 'two lines,\n"quoted" \\ tab\there, control \x01\x7f, unicode µ 中'
    tricky["accelerators"]["peak_ops"].update(fp32=1.95e13, bf16=400_000_000_000_000, fp16=float(1 << 60))
    tricky["software"]["frameworks"]["zope.interface"] = "7.0"
    assert tomllib.loads(to_toml(tricky)) == tricky
    assert validate_system(tomllib.loads(to_toml(tricky))) == tricky


def test_every_field_has_a_comment_above_it(filled):
    lines = to_toml(filled).splitlines()
    fields = [i for i, line in enumerate(lines) if " = " in line and not line.startswith("#")]
    assert len(fields) == 10 + 7 + 5 + 1 + 2 + len(filled["software"]["frameworks"])
    assert all(lines[i - 1].startswith("# ") for i in fields)
    assert "# host memory per node; bytes, integer > 0" in lines


# -- the CLI --------------------------------------------------------------------------------------

def test_cli_writes_a_file_and_refuses_to_overwrite_it(tmp_path, capsys, described):
    out = tmp_path / "system.toml"
    assert main(["system", "describe", "--out", str(out)]) == 0
    assert f"wrote {out}: fill in 10 placeholder(s)" in capsys.readouterr().out
    assert tomllib.loads(out.read_text()) == described
    out.write_text("edited by the site\n")
    assert refusal(capsys, ["system", "describe", "--out", str(out)]) == \
        f"aiperf: error: {out}: exists; pass --force to overwrite it"
    assert out.read_text() == "edited by the site\n"
    assert main(["system", "describe", "--out", str(out), "--force"]) == 0
    assert tomllib.loads(out.read_text()) == described
    assert [p.name for p in tmp_path.iterdir()] == ["system.toml"]  # no temporary file left


def test_cli_validate(tmp_path, capsys, filled):
    path = write(tmp_path, filled)
    assert main(["system", "validate", str(path)]) == 0
    cpu = inventory.host_cpu()["model"]
    assert capsys.readouterr().out == f"{path}: valid (system Example-1 at Example University, 1 node(s) x 1 {cpu})\n"

    draft = tmp_path / "draft.toml"
    assert main(["system", "describe", "--out", str(draft)]) == 0
    capsys.readouterr()
    assert refusal(capsys, ["system", "validate", str(draft)]) == \
        f"aiperf: error: {draft}: submitter: placeholder left: fill in the person or team that submits the result"
    assert main(["system", "validate", str(draft), "--allow-placeholders"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == \
        f"{draft}: 10 placeholder(s) left: {', '.join(PLACEHOLDER_FIELDS)}"


@pytest.mark.parametrize("dotted,value,message", [
    ("accelerators.peak_ops.fp32", -1.95e13, "accelerators.peak_ops.fp32: must be > 0 operations per second"),
    ("accelerators.peak_ops.int8", 1e15,
     "accelerators.peak_ops.int8: unknown precision (allowed: fp32, tf32, bf16, fp16)"),
    ("nodes.gpus", 8,
     "nodes.gpus: unknown key (allowed here: count, cpu_model, sockets, cores, threads, memory_bytes, os)"),
    ("country", "Germany", "country: must be an ISO 3166-1 alpha-2 code"),
    ("cooling", "water", "cooling: must be one of 'air', 'liquid', 'hybrid', 'immersion', got 'water'"),
    ("nodes.count", "2", "nodes.count: must be an integer number of nodes, got string '2'"),
])
def test_cli_validate_names_the_bad_field(tmp_path, capsys, filled, dotted, value, message):
    path = write(tmp_path, set_field(filled, dotted, value))
    assert refusal(capsys, ["system", "validate", str(path)]).startswith(f"aiperf: error: {path}: {message}")


def test_cli_validate_bad_toml_and_missing_key(tmp_path, capsys, filled):
    path = tmp_path / "system.toml"
    lines = to_toml(filled).splitlines()
    lines[lines.index("count = 1")] = "count = = 1"
    path.write_text("\n".join(lines))
    line = refusal(capsys, ["system", "validate", str(path)])
    assert line.startswith(f"aiperf: error: {path}: not valid TOML: ")
    assert f"(at line {lines.index('count = = 1') + 1}, column 9)" in line
    del filled["nodes"]["os"]
    path = write(tmp_path, filled)
    assert refusal(capsys, ["system", "validate", str(path)]) == f"aiperf: error: {path}: nodes.os: missing"


# -- validation through the API ---------------------------------------------------------------------

@pytest.mark.parametrize("field", PLACEHOLDER_FIELDS)
def test_each_placeholder_is_refused(tmp_path, filled, field):
    path = write(tmp_path, set_field(filled, field, "<to be filled in>"))
    with pytest.raises(SubmissionError, match=rf"^{path}: {field}: placeholder left: fill in "):
        load_system(path)
    assert load_system(path, allow_placeholders=True)["schema_version"] == 1
    assert placeholders(load_system(path, allow_placeholders=True)) == [field]


def test_the_first_placeholder_in_file_order_is_named(filled):
    set_field(filled, "accelerators.peak_ops.bf16", "<vendor dense peak of one device at bf16, in OPS>")
    set_field(filled, "accelerators.driver", "<driver version, or none>")
    with pytest.raises(SubmissionError, match=r"^system.toml: accelerators.driver: placeholder left"):
        validate_system(filled)
    set_field(filled, "accelerators.driver", "none")
    with pytest.raises(SubmissionError, match=r"peak_ops.bf16: placeholder left: .* or delete the line"):
        validate_system(filled)


@pytest.mark.parametrize("dotted,value,message", [
    ("accelerators.peak_ops.fp32", 0.0, "must be > 0 operations per second, got 0"),
    ("accelerators.peak_ops.fp32", float("nan"), "must be a finite number"),
    ("accelerators.peak_ops.fp32", 19.5, "must be in operations per second; 19.5 is under 1e9"),
    ("accelerators.peak_ops.fp32", "19.5 TFLOPS", "must be a number of operations per second"),
    ("accelerators.peak_ops.fp32", True, "must be a number of operations per second such as 1.95e13, got boolean"),
    ("accelerators.peak_ops.fp16", -1e14, "must be > 0"),
    ("accelerators.peak_ops.FP16", 1e14, "unknown precision"),
    ("availability", "generally available", "must be one of 'available', 'preview', 'research'"),
    ("accelerators.kind", "tpu", "must be one of 'cpu', 'gpu', 'npu', 'other'"),
    ("country", "de", "must be an ISO 3166-1 alpha-2 code"),
    ("country", "DEU", "must be an ISO 3166-1 alpha-2 code"),
    ("site", "   ", "must not be empty"),
    ("system_name", "two\nlines", "must be one line"),
    ("submitter", 42, "must be a string, got integer 42"),
    ("nodes.memory_bytes", "64 GiB", "must be an integer number of bytes, got string '64 GiB'"),
    ("nodes.memory_bytes", 64, "must be in bytes; 64 is under 1 MiB"),
    ("nodes.memory_bytes", 0, "must be >= 1, got 0"),
    ("nodes.sockets", 0, "must be >= 1, got 0"),
    ("nodes.count", 1.0, "must be an integer number of nodes, got float 1.0"),
    ("nodes.count", True, "must be an integer number of nodes, got boolean True"),
    ("nodes.threads", 1, "must be >= nodes.cores"),
    ("accelerators.model", "NVIDIA H100", "must equal nodes.cpu_model for kind cpu"),
    ("accelerators.per_node", 2, "must be 1 for kind cpu"),
    ("accelerators.memory_bytes", 1 << 30, "must be 0 for kind cpu"),
    ("accelerators.peak_ops", 1e13, "must be a table [accelerators.peak_ops], got float"),
    ("nodes.os", {"name": "Linux"}, "must be a value, got a table"),
    ("software.frameworks.torch", "", "must not be empty"),
    ("software.frameworks.torch", 2.5, "must be a string, got float 2.5"),
    ("rank", 1, "unknown key (allowed here: schema_version, submitter, "),
    ("schema_version", 2, "unsupported version 2 (this aiperf reads schema version 1)"),
    ("schema_version", "<1>", "must be the integer 1, got string '<1>'"),
])
def test_bad_values_are_refused_by_name(filled, dotted, value, message):
    set_field(filled, dotted, value)
    with pytest.raises(SubmissionError) as caught:
        validate_system(filled, source="site/system.toml")
    line = str(caught.value)
    assert line.startswith(f"site/system.toml: {dotted}: {message}") and len(line.splitlines()) == 1, line


@pytest.mark.parametrize("dotted,message", [
    ("schema_version", "must be the integer 1"),
    ("nodes.count", "must be an integer number of nodes, got string '<n>'"),
    ("accelerators.kind", "must be one of 'cpu', 'gpu', 'npu', 'other'"),
    ("accelerators.per_node", "must be an integer number of devices, got string '<n>'"),
])
def test_a_draft_takes_no_placeholder_where_describe_never_leaves_one(filled, dotted, message):
    set_field(filled, dotted, "<n>")
    with pytest.raises(SubmissionError, match=f"^system.toml: {dotted}: {message}"):
        validate_system(filled, allow_placeholders=True)
def test_rules_across_fields(filled):
    set_field(filled, "nodes.count", 16)
    with pytest.raises(SubmissionError, match="interconnect: is 'none', but nodes.count is 16"):
        validate_system(filled)
    set_field(filled, "interconnect", "InfiniBand NDR 400 Gb/s")
    validate_system(filled)
    accelerators = {"kind": "gpu", "model": "NVIDIA H100", "per_node": 8, "memory_bytes": 0, "driver": "550",
                    "peak_ops": {"fp32": 6.7e13}}
    filled["accelerators"] = accelerators
    with pytest.raises(SubmissionError, match="accelerators.memory_bytes: must be > 0 for kind gpu"):
        validate_system(filled)
    accelerators["memory_bytes"] = 80 << 30
    assert validate_system(filled) is filled
    del accelerators["peak_ops"]["fp32"]
    with pytest.raises(SubmissionError, match=r"^system.toml: accelerators.peak_ops.fp32: missing$"):
        validate_system(filled)


def test_unreadable_and_malformed_files(tmp_path):
    missing = tmp_path / "absent.toml"
    with pytest.raises(SubmissionError, match=rf"^{missing}: cannot read: No such file or directory$"):
        load_system(missing)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"site = \"\xff\"\n")
    with pytest.raises(SubmissionError, match="not UTF-8 text"):
        load_system(binary)
    unclosed = tmp_path / "unclosed.toml"
    unclosed.write_text('schema_version = 1\nsite = "Example\n')
    with pytest.raises(SubmissionError, match=r"not valid TOML: .*line 2"):
        load_system(unclosed)
    twice = tmp_path / "twice.toml"
    twice.write_text("schema_version = 1\nschema_version = 1\n")
    with pytest.raises(SubmissionError, match="not valid TOML"):
        load_system(twice)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    with pytest.raises(SubmissionError, match=r"^.*empty.toml: schema_version: missing"):
        load_system(empty)
    huge = tmp_path / "huge.toml"
    huge.write_text("# padding\n" * 200_000)
    with pytest.raises(SubmissionError, match="larger than 1048576 bytes"):
        load_system(huge)


def test_counts_and_declared_peaks(filled):
    filled["nodes"]["count"] = 4
    filled["accelerators"] = {"kind": "gpu", "model": "NVIDIA H100", "per_node": 8, "memory_bytes": 80 << 30,
                              "driver": "550", "peak_ops": {"fp32": 67e12, "bf16": 989_000_000_000_000}}
    filled["interconnect"] = "InfiniBand NDR 400 Gb/s"
    validate_system(filled)
    assert device_count(filled) == 32
    assert declared_peak_ops(filled, "fp32") == 6.7e13
    assert declared_peak_ops(filled, "bf16") == 9.89e14 and isinstance(declared_peak_ops(filled, "bf16"), float)
    assert declared_peak_ops(filled, "fp16") is None
    assert declared_peak_ops(describe(), "fp32") is None  # a placeholder declares nothing
