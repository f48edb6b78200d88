"""The entry-point group `aiperf.backends`: which installed distribution registers which backend.

aiperf_core.registry finds and loads backends through it, and aiperf_core.backend's install hint
(Backend.import_availability) names the distribution that registers a backend; both import this
module, which imports neither of them.
"""

from __future__ import annotations

NAMESPACE = "aiperf.backends"


def backend_entry_points():
    """Every installed entry point of the group (whether or not it imports)."""
    from importlib.metadata import entry_points

    return list(entry_points(group=NAMESPACE))


def distribution_of(backend_cls: type) -> str | None:
    """The name of the installed distribution whose `aiperf.backends` entry point names this class
    (e.g. 'aiperf' for the first-party backends, 'aiperf-numpy'), or None when none does. Only entry
    points whose module is already imported are compared, so that asking never imports a framework."""
    import sys

    for ep in backend_entry_points():
        module = sys.modules.get(ep.module)
        target = module
        for part in (ep.attr or "").split("."):
            target = getattr(target, part, None) if part else target
        if module is not None and target is backend_cls:
            dist = getattr(ep, "dist", None)
            return dist.metadata["Name"] if dist is not None else None
    return None


def install_hint(backend_cls: type, module: str, extra: str | None = None) -> str:
    """How to install what a backend needs: through the distribution that registers it."""
    dist = distribution_of(backend_cls)
    if dist is None:
        return f"install the package that provides '{module}'"
    requirement = f"{dist}[{extra}]" if extra else dist
    return f"pip install '{requirement}'"
