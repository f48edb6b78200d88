"""`aiperf new-backend NAME --out DIR`: a plugin package for a new backend, ready to fill in.

It writes pyproject.toml (the `aiperf.backends` entry point), README.md, <package>/backend.py (a
skeleton whose methods raise NotImplementedYet, naming what each must do), <package>/conformance.json
(strict expectations: no native counter yet) and tests/test_backend.py. It never overwrites: DIR must
not exist or be empty. The templates are in aiperf_conformance/templates/.
"""

from __future__ import annotations

import re
from pathlib import Path
from string import Template

from aiperf_core.errors import AiperfError

TEMPLATES = Path(__file__).with_name("templates")
NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def names(name: str) -> dict[str, str]:
    """The names derived from a backend name: entry point, package, distribution, class."""
    if not NAME.match(name):
        raise AiperfError(f"backend name '{name}': use 1-40 lowercase letters, digits and '_', starting with a letter")
    return {"name": name, "package": f"aiperf_{name}", "dist": f"aiperf-{name.replace('_', '-')}",
            "cls": "".join(part.capitalize() for part in name.split("_")) + "Backend"}


def files(name: str, framework: str | None = None) -> dict[str, str]:
    """Relative path -> text of every file of the package."""
    values = names(name)
    if framework is None:
        values["availability"] = ("return Availability(True)  # no framework was named: once there is one, "
                                  "return cls.import_availability(\"<module>\")")
    elif MODULE.match(framework):
        values["availability"] = f'return cls.import_availability("{framework}")'
    else:
        raise AiperfError(f"--framework '{framework}' is not a Python module name")
    package = values["package"]
    layout = {"pyproject.toml": "pyproject.toml.tmpl", "README.md": "README.md.tmpl",
              f"{package}/__init__.py": "__init__.py.tmpl", f"{package}/backend.py": "backend.py.tmpl",
              f"{package}/conformance.json": "conformance.json.tmpl", "tests/test_backend.py": "test_backend.py.tmpl"}
    return {path: Template((TEMPLATES / template).read_text()).substitute(values) for path, template in layout.items()}


def scaffold(name: str, out, framework: str | None = None) -> list[Path]:
    """Write the package into `out` (absent or empty); the paths written."""
    from aiperf_core.atomic import write_text_atomic
    from aiperf_core.registry import backend_entry_points

    out = Path(out)
    taken = {ep.name: ep for ep in backend_entry_points()}
    if name in taken:
        dist = getattr(taken[name], "dist", None)
        owner = f" by {dist.metadata['Name']}" if dist is not None else ""
        raise AiperfError(f"a backend named '{name}' is already installed{owner}: choose another name")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise AiperfError(f"--out {out}: exists and is not an empty folder (new-backend never overwrites)")
    texts = files(name, framework)
    written = []
    for relative, text in texts.items():
        write_text_atomic(out / relative, text)
        written.append(out / relative)
    return written
