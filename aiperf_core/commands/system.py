"""aiperf system: describe this machine for a submission (system.toml), or check a description.

    aiperf system describe [--out system.toml] [--backend NAME] [--probe-network FILE] [--force]
    aiperf system validate FILE [--allow-placeholders]

docs/submission.md, "The system description", has the schema.
"""

from __future__ import annotations

import argparse
import sys

HELP = "describe this machine for a submission (system.toml), or check a system description"


def add_arguments(p) -> None:
    actions = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    actions.required = True
    describe = actions.add_parser(
        "describe", help="write what this node shows, with placeholders for what only the site knows",
        description="Write a system description: the host CPU, memory, OS, accelerators and software "
                    "versions of this node; placeholders (\"<...>\") for the site's fields and the peak.")
    describe.add_argument("--out", default=None, metavar="FILE", help="write here (default: print to stdout)")
    describe.add_argument("--backend", default=None, metavar="NAME",
                          help="also ask this backend's framework for the devices and their precisions")
    describe.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    describe.add_argument("--probe-network", default=None, metavar="FILE",
                          help="record what `aiperf probe network` measured (its JSON) in [network_probe], beside "
                               "the declared interconnect")
    validate = actions.add_parser("validate", help="check a system description (exit status 2 if it is bad)",
                                  description="Check a system description against its schema.")
    validate.add_argument("file", metavar="FILE")
    validate.add_argument("--allow-placeholders", action="store_true",
                          help="accept values still written as \"<...>\" (a draft; a submission refuses them)")
    for sub in (describe, validate):
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                         help="show tracebacks for errors")


def run(args) -> int:
    return _describe(args) if args.action == "describe" else _validate(args)


def _describe(args) -> int:
    from pathlib import Path

    from aiperf_core.commands.options import writable_file
    from aiperf_core.submission import SubmissionError
    from aiperf_core.submission.system import describe, placeholders, to_toml, write_description

    if args.out is not None:  # before a slow backend load
        if Path(args.out).exists() and not args.force:
            raise SubmissionError(f"{args.out}: exists; pass --force to overwrite it")
        writable_file("--out", args.out)
    description = describe(args.backend, args.probe_network)
    if args.out is None:
        sys.stdout.write(to_toml(description))
        return 0
    write_description(args.out, description, force=args.force)
    left = placeholders(description)
    print(f"wrote {args.out}: fill in {len(left)} placeholder(s) ({', '.join(left)}), "
          f"then run: aiperf system validate {args.out}")
    return 0


def _validate(args) -> int:
    from aiperf_core.submission.system import load_system, placeholders

    d = load_system(args.file, allow_placeholders=args.allow_placeholders)
    accelerators = d["accelerators"]
    print(f"{args.file}: valid (system {d['system_name']} at {d['site']}, {d['nodes']['count']} node(s) x "
          f"{accelerators['per_node']} {accelerators['model']})")
    left = placeholders(d)
    if left:
        print(f"{args.file}: {len(left)} placeholder(s) left: {', '.join(left)}")
    return 0
