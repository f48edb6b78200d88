"""Backend discovery: listing never crashes, loading by name fails loudly, selection precedence."""

import sys
import textwrap

import pytest

from aiperf_core.backend import BackendError
from aiperf_core.cli import main
from aiperf_core.registry import DEFAULT_BACKEND, list_backends, load_backend, resolve_backend_name


@pytest.fixture
def fake_plugins(tmp_path, monkeypatch):
    """Install, for this test only, a distribution with a broken and an unavailable backend."""
    pkg = tmp_path / "fake_backends.py"
    pkg.write_text(textwrap.dedent("""
        from aiperf_core.backend import Availability, Backend

        class Missing(Backend):
            name = "missing_fw"
            @classmethod
            def availability(cls):
                return Availability(False, "framework 'quantumflow' is not installed")

        class NeedsFramework(Backend):
            name = "needs_fw"
            @classmethod
            def availability(cls):
                return cls.import_availability("quantumflow_runtime", "qf")
    """))
    broken = tmp_path / "broken_backend.py"
    broken.write_text("import framework_that_does_not_exist\n")
    dist = tmp_path / "fake_backends-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-backends\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[aiperf.backends]\nbroken = broken_backend:Broken\nmissing_fw = fake_backends:Missing\n"
        "needs_fw = fake_backends:NeedsFramework\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_backend", raising=False)
    monkeypatch.delitem(sys.modules, "fake_backends", raising=False)
    return tmp_path


def test_listing_shows_broken_and_unavailable(fake_plugins):
    infos = {i.name: i for i in list_backends()}
    assert infos["broken"].available is False
    assert "import failed" in infos["broken"].reason and "framework_that_does_not_exist" in infos["broken"].reason
    assert infos["missing_fw"].available is False
    assert "quantumflow" in infos["missing_fw"].reason


def test_install_hint_names_the_plugins_own_distribution(fake_plugins):
    infos = {i.name: i for i in list_backends()}
    assert infos["needs_fw"].available is False and infos["needs_fw"].distribution == "fake-backends"
    assert "quantumflow_runtime is not installed" in infos["needs_fw"].reason
    assert "(pip install 'fake-backends[qf]')" in infos["needs_fw"].reason and "aiperf[" not in infos["needs_fw"].reason


def test_install_hint_of_first_party_and_unregistered_backends():
    from aiperf_backends.torch import TorchBackend
    from aiperf_numpy.backend import NumpyBackend
    from aiperf_core.registry import distribution_of, install_hint

    assert install_hint(TorchBackend, "torch", "torch") == "pip install 'aiperf[torch]'"
    assert install_hint(NumpyBackend, "numpy") == "pip install 'aiperf-numpy'"
    assert distribution_of(NumpyBackend) == "aiperf-numpy"

    class Unregistered(NumpyBackend):
        name = "unregistered"

    assert distribution_of(Unregistered) is None
    assert install_hint(Unregistered, "chipfw") == "install the package that provides 'chipfw'"


def test_cli_backends_lists_reasons(fake_plugins, capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "broken" in out and "unavailable: import failed" in out
    assert "quantumflow" in out


def test_loading_fails_loudly(fake_plugins):
    with pytest.raises(BackendError, match="failed to import.*framework_that_does_not_exist"):
        load_backend("broken")
    with pytest.raises(BackendError, match="unavailable: framework 'quantumflow'"):
        load_backend("missing_fw")
    with pytest.raises(BackendError, match=r"no backend named 'nope' is installed \(installed: .*broken"):
        load_backend("nope")


def test_unknown_backend_on_cli_is_one_line(fake_plugins, capsys):
    assert main(["conformance", "--backend", "nope", "--level", "op"]) == 2
    err = capsys.readouterr().err
    assert "no backend named 'nope'" in err and "installed:" in err and err.count("\n") == 1


def test_selection_precedence():
    env = {"AIPERF_BACKEND": "jax"}
    config = {"backend": "mindspore"}
    assert resolve_backend_name("torch", env, config) == "torch"
    assert resolve_backend_name(None, env, config) == "jax"
    assert resolve_backend_name(None, {}, config) == "mindspore"
    assert resolve_backend_name(None, {}, None) == DEFAULT_BACKEND == "tensorflow"


def test_config_file_selects_backend(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AIPERF_BACKEND", raising=False)
    monkeypatch.delenv("AIPERF_CONFIG", raising=False)
    (tmp_path / "aiperf.toml").write_text('backend = "numpy"\n')
    assert main(["backends", "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["selected"] == "numpy"
    monkeypatch.setenv("AIPERF_BACKEND", "torch")
    assert main(["backends", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["selected"] == "torch"
    (tmp_path / "bad.toml").write_text('backend = "numpy"\nbackned = 1\n')
    assert main(["backends", "--config", "bad.toml"]) == 2
    assert "unknown setting 'backned'" in capsys.readouterr().err
    assert main(["backends", "--config", "missing.toml"]) == 2
    assert "missing.toml: no such file" in capsys.readouterr().err
