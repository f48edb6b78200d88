"""Issue 33.1: a CPU precision is declared only where the CPU has the instructions for it (bf16:
AVX512-BF16 or AMX-BF16; fp16: AMX-FP16), by every backend, through one rule in the contract
(Backend._runs, CPU_NATIVE_FLAGS). The CPU's flags are faked both ways; each backend's own probe
step still decides on top of the rule."""

from __future__ import annotations

import pytest

import aiperf_core.backend as contract
from aiperf_core.backend import Backend

# The first-party backends and the NumPy reference, as classes: the rule needs no framework.
BACKENDS = {
    "torch": "aiperf_backends.torch.backend:TorchBackend",
    "tensorflow": "aiperf_backends.tensorflow.backend:TensorFlowBackend",
    "jax": "aiperf_backends.jax.backend:JaxBackend",
    "mindspore": "aiperf_backends.mindspore.backend:MindSporeBackend",
    "numpy": "aiperf_numpy.backend:NumpyBackend",
}
# The issue's Cascade Lake: AVX-512 and VNNI, no AVX512-BF16, no AMX.
CASCADE_LAKE = {"avx2", "fma", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni"}


def _class(name: str) -> type[Backend]:
    import importlib

    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


@pytest.fixture
def cpu(monkeypatch):
    """fake(flags): this host's CPU reports `flags`, and nothing probed so far is remembered."""
    monkeypatch.setattr(Backend, "_probes", {})

    def fake(flags):
        monkeypatch.setattr(contract, "cpu_flags", lambda: set(flags))
        Backend._probes.clear()
    return fake


@pytest.fixture
def probe_passes(monkeypatch):
    """Each backend's own probe says yes to every precision, recording what it was asked: what is
    declared is then the contract's rule alone."""
    asked: list[tuple[str, str]] = []
    for name in BACKENDS:
        monkeypatch.setattr(_class(name), "runs_precision",
                            lambda self, device, precision: asked.append((device, precision)) or True)
    return asked


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("flags, declared", [
    (set(), ("fp32",)),
    (CASCADE_LAKE, ("fp32",)),
    (CASCADE_LAKE | {"avx512_fp16"}, ("fp32",)),  # AVX512-FP16 alone: fp16 would be converted
    (CASCADE_LAKE | {"avx512_bf16"}, ("fp32", "bf16")),
    ({"amx_bf16", "amx_tile"}, ("fp32", "bf16")),
    ({"amx_bf16", "amx_fp16", "amx_tile"}, ("fp32", "bf16", "fp16")),
])
def test_a_cpu_precision_is_declared_only_with_its_instructions(name, flags, declared, cpu, probe_passes):
    cpu(flags)
    assert _class(name)().precisions("cpu") == declared
    # The backend is not even asked about a precision the CPU has no instructions for; tf32 never.
    assert sorted(p for _, p in probe_passes) == sorted(declared[1:])


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_an_accelerator_is_left_to_the_backend(name, cpu, probe_passes):
    cpu(set())
    assert _class(name)().precisions("cuda:0") == ("fp32", "tf32", "bf16", "fp16")


def test_the_rule_is_remembered_per_backend_device_and_precision(cpu, probe_passes):
    cpu(CASCADE_LAKE)
    backend = _class("numpy")()
    assert backend.precisions("cpu") == ("fp32",)
    assert Backend._probes == {("numpy", "cpu", p): False for p in ("tf32", "bf16", "fp16")}


# -- each backend's probe step on top of the rule -----------------------------------------------------
def test_torch_on_the_issues_cascade_lake_declares_fp32_only(cpu, monkeypatch):
    """oneDNN reports bf16 on any AVX-512 CPU, where it emulates it: the rule alone keeps it out."""
    import aiperf_backends.torch.backend as torch_backend

    monkeypatch.setattr(torch_backend, "_onednn_runs", lambda torch, precision: True)  # as on that Xeon
    cpu(CASCADE_LAKE)
    assert torch_backend.TorchBackend().precisions("cpu") == ("fp32",)


def test_torch_declares_bf16_and_fp16_with_amx_where_its_probe_step_passes(cpu, monkeypatch):
    """This CPU has no AVX-512: oneDNN's own check is faked, the probe step (autocast, backward) runs."""
    import aiperf_backends.torch.backend as torch_backend

    monkeypatch.setattr(torch_backend, "_onednn_runs", lambda torch, precision: True)
    cpu({"amx_bf16", "amx_fp16", "amx_tile"})
    assert torch_backend.TorchBackend().precisions("cpu") == ("fp32", "bf16", "fp16")
    cpu({"amx_bf16", "amx_tile"})
    assert torch_backend.TorchBackend().precisions("cpu") == ("fp32", "bf16")


def test_torch_keeps_what_onednn_lacks_out_even_with_amx(cpu, monkeypatch):
    import aiperf_backends.torch.backend as torch_backend

    monkeypatch.setattr(torch_backend, "_onednn_runs", lambda torch, precision: precision == "bf16")
    cpu({"amx_bf16", "amx_fp16", "amx_tile"})
    assert torch_backend.TorchBackend().precisions("cpu") == ("fp32", "bf16")


def test_tensorflow_declares_bf16_with_amx_where_its_probe_step_passes(cpu):
    """TensorFlow's real probe (one bf16 training step of a small net) on a CPU faked to have AMX."""
    from aiperf_backends.tensorflow.backend import TensorFlowBackend

    cpu({"amx_bf16", "amx_fp16", "amx_tile"})
    assert TensorFlowBackend().precisions("cpu") == ("fp32", "bf16")  # fp16 is never offered on a CPU
    cpu(CASCADE_LAKE)
    assert TensorFlowBackend().precisions("cpu") == ("fp32",)


def test_jax_and_numpy_declare_no_cpu_precision_whatever_the_cpu(cpu):
    from aiperf_backends.jax.backend import JaxBackend
    from aiperf_numpy.backend import NumpyBackend

    cpu({"amx_bf16", "amx_fp16", "avx512_bf16", "amx_tile"})
    assert JaxBackend().precisions(JaxBackend().devices()[0]) == ("fp32",)
    assert NumpyBackend().precisions() == ("fp32",)


def test_mindspore_offers_no_tf32_and_probes_the_rest(cpu, monkeypatch):
    import aiperf_backends.mindspore.backend as ms_backend

    probed = []
    monkeypatch.setattr(ms_backend, "_probe_precision", lambda precision: probed.append(precision) or True)
    cpu({"amx_bf16", "amx_fp16", "amx_tile"})
    assert ms_backend.MindSporeBackend().precisions("cpu") == ("fp32", "bf16", "fp16")
    assert sorted(probed) == ["bf16", "fp16"]
    cpu(CASCADE_LAKE | {"avx512_fp16"})
    probed.clear()
    assert ms_backend.MindSporeBackend().precisions("cpu") == ("fp32",) and probed == []
