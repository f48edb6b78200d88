"""aiperf new-backend NAME --out DIR: scaffold a plugin package for a new backend."""

from __future__ import annotations

HELP = "write a plugin package for a new backend: entry point, skeleton, expectations file and tests"


def add_arguments(p) -> None:
    p.add_argument("name", metavar="NAME", help="the backend's name (lowercase letters, digits, '_'), e.g. mychip")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write the package (default: ./aiperf-NAME); must not exist or be empty")
    p.add_argument("--framework", default=None, metavar="MODULE",
                   help="the framework's import name, for availability() (e.g. paddle)")


def run(args) -> int:
    from aiperf_conformance.scaffold import names, scaffold
    from aiperf_core.commands.options import writing

    out = args.out or names(args.name)["dist"]
    with writing(out, "--out"):
        written = scaffold(args.name, out, args.framework)
    for path in written:
        print(f"wrote {path}")
    print(f"next: cd {out} && python -m pip install -e . && aiperf conformance --backend {args.name} --quick")
    return 0
