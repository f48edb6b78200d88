"""Finding backends through the entry-point group `aiperf.backends`.

Listing never fails: a backend whose import breaks, or whose framework is missing, is shown as
unavailable with the reason (stevedore's ExtensionManager with an on-load-failure callback).
Loading one by name fails loudly (DriverManager), naming what is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from aiperf_core.backend import Backend, BackendError
# The entry points, and the install hint that Backend.import_availability gives, live in a module
# that imports neither this one nor aiperf_core.backend.
from aiperf_core.entry_points import NAMESPACE, backend_entry_points, distribution_of, install_hint  # noqa: F401

DEFAULT_BACKEND = "tensorflow"  # the paper's default framework (Table 4)
ENV_VAR = "AIPERF_BACKEND"

# The frameworks' C++ logging, read from the environment when a framework first loads:
# {variable: (quiet value, the framework's own default)}. Quiet drops informational lines and keeps
# warnings and errors wherever the framework's levels tell them apart.
FRAMEWORK_LOG_LEVELS = {
    # TensorFlow, and XLA under jax: 0 INFO, 1 WARNING, 2 ERROR, 3 FATAL.
    "TF_CPP_MIN_LOG_LEVEL": ("1", "0"),
    # MindSpore: 0 DEBUG, 1 INFO, 2 WARNING, 3 ERROR. Quiet keeps errors only, because MindSpore logs
    # routine events as warnings: "Numpy init failed" at every import, a missing Ascend plugin on a
    # CPU machine.
    "GLOG_v": ("3", "2"),
}


@dataclass
class BackendInfo:
    name: str
    available: bool
    reason: str | None = None
    version: str | None = None
    devices: list[str] = field(default_factory=list)
    precisions: list[str] = field(default_factory=list)
    module: str | None = None
    distribution: str | None = None  # the installed distribution that registers it

    def to_dict(self) -> dict:
        return {"name": self.name, "available": self.available, "reason": self.reason, "version": self.version,
                "devices": self.devices, "precisions": self.precisions, "module": self.module,
                "distribution": self.distribution}


def set_framework_logging(verbose: bool = False) -> None:
    """Put the frameworks' logging levels in the environment, quiet or (verbose: `aiperf --debug`) the
    frameworks' own defaults. A variable already set, by the user or by an earlier call, is kept.
    Each backend calls this before it first imports its framework; the CLI calls it first with --debug."""
    for name, (quiet, framework_default) in FRAMEWORK_LOG_LEVELS.items():
        os.environ.setdefault(name, framework_default if verbose else quiet)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _fresh_scan() -> None:
    """stevedore caches entry points per group for the process; a plugin installed since must still show."""
    from stevedore import ExtensionManager

    ExtensionManager.ENTRY_POINT_CACHE.pop(NAMESPACE, None)


def list_backends() -> list[BackendInfo]:
    from stevedore import ExtensionManager

    _fresh_scan()
    failures: dict[str, BaseException] = {}

    def on_failure(_manager, entry_point, exc):
        failures[entry_point.name] = exc

    manager = ExtensionManager(NAMESPACE, invoke_on_load=False, on_load_failure_callback=on_failure)
    infos: dict[str, BackendInfo] = {}
    for ext in manager:
        infos[ext.name] = _probe(ext.name, ext.plugin, ext.entry_point.value)
    for ep in backend_entry_points():
        if ep.name in failures:
            infos[ep.name] = BackendInfo(ep.name, False, f"import failed: {_one_line(failures[ep.name])}",
                                         module=ep.value)
        if ep.name in infos and getattr(ep, "dist", None) is not None:
            infos[ep.name].distribution = ep.dist.metadata["Name"]
    return [infos[k] for k in sorted(infos)]


def _probe(name: str, plugin: Any, module: str) -> BackendInfo:
    if not (isinstance(plugin, type) and issubclass(plugin, Backend)):
        return BackendInfo(name, False, f"entry point does not name a Backend subclass: {module}", module=module)
    try:
        availability = plugin.availability()
    except Exception as exc:  # a broken plugin must not break the listing
        return BackendInfo(name, False, f"availability check failed: {_one_line(exc)}", module=module)
    if not availability.available:
        return BackendInfo(name, False, availability.reason or "unavailable", module=module)
    try:
        instance = plugin()
        return BackendInfo(name, True, None, instance.framework_version(), list(instance.devices()),
                           list(instance.precisions()), module=module)
    except Exception as exc:
        return BackendInfo(name, False, f"probe failed: {_one_line(exc)}", module=module)


def load_backend(name: str) -> Backend:
    """Instantiate a backend by name, or raise BackendError saying why not and what is installed."""
    from stevedore import DriverManager
    from stevedore.exception import NoMatches

    _fresh_scan()
    try:
        plugin = DriverManager(NAMESPACE, name, invoke_on_load=False).driver
    except NoMatches:
        installed = ", ".join(sorted(ep.name for ep in backend_entry_points())) or "none"
        raise BackendError(f"no backend named '{name}' is installed (installed: {installed})") from None
    except Exception as exc:
        raise BackendError(f"backend '{name}' failed to import: {_one_line(exc)}") from exc
    if not (isinstance(plugin, type) and issubclass(plugin, Backend)):
        raise BackendError(f"backend '{name}': entry point does not name a Backend subclass")
    availability = plugin.availability()
    if not availability.available:
        raise BackendError(f"backend '{name}' is unavailable: {availability.reason}")
    return plugin()


def resolve_backend_name(flag: str | None = None, environ: Mapping[str, str] | None = None,
                         config: Mapping[str, Any] | None = None) -> str:
    """The backend to use: --backend, else $AIPERF_BACKEND, else the config file's `backend`, else the default."""
    environ = os.environ if environ is None else environ
    if flag:
        return flag
    if environ.get(ENV_VAR):
        return environ[ENV_VAR]
    if config and config.get("backend"):
        return str(config["backend"])
    return DEFAULT_BACKEND
