"""The `aiperf` command line. Each subcommand lives in aiperf_core/commands/<name>.py.

User errors print one line on stderr and exit with status 2; --debug shows the traceback, and the
frameworks' own log lines, which are otherwise kept to warnings and errors (registry.set_framework_logging).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from aiperf_core.errors import AiperfError

# Subcommand modules, in the order `aiperf --help` lists them. Each defines
# HELP, add_arguments(parser) and run(args) -> int.
COMMANDS = ("count", "backends", "conformance", "new-backend", "morph", "data", "replica", "score", "report", "run",
            "system", "peak", "probe", "submit", "check", "rank", "metrics", "watch")

EXIT_USAGE = 2
DEBUG_HELP = "show tracebacks for errors, and the frameworks' own informational log lines"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="aiperf", description="AI-HPC benchmark: AutoML scored in analytic operations per second.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"aiperf_core.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed as one line
        return int(exc.code or 0)
    if args.debug:  # the frameworks' own log lines too, before any backend loads one
        from aiperf_core.registry import set_framework_logging

        set_framework_logging(verbose=True)
    try:
        return int(args._run(args) or 0)
    except AiperfError as exc:
        if args.debug:
            raise
        print(f"aiperf: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("aiperf: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
