"""No module of the code base imports one that imports it back, lazy imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aiperf_core", "opcount", "conformance", "backends", "plugins")


def _modules() -> dict[str, Path]:
    """Every module of the code base, by dotted name (a package by its own name)."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The code base's modules that `path` imports at any level of its code (lazy imports too).
    `from package import submodule` imports the submodule, not the package's own code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules.keys()
            found.update(submodules or {base})
    return (found & modules.keys()) - {name}


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    assert {"aiperf_core.backend", "aiperf_core.registry", "aiperf_core.data.dali",
            "aiperf_core.data.stream"} <= modules.keys()
    imports = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = sorted({tuple(sorted((a, b))) for a, found in imports.items() for b in found if a in imports[b]})
    assert not circles, "modules that import each other: " + "; ".join(f"{a} <-> {b}" for a, b in circles)
