"""aiperf data check PATH | aiperf data convert SRC DST --to tfrecord|imagefolder."""

from __future__ import annotations

import argparse
import json
import sys
import time

from aiperf_core.commands.options import non_negative_int, positive_int, writing

HELP = ("check an ImageNet folder (counts, classes, corrupt images) or convert it between the ImageFolder "
        "and TFRecord layouts")
DEFAULT_WORKERS = 4
EXIT_PROBLEMS = 1  # the check ran and found corrupt images or a class mismatch


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    c = sub.add_parser("check", help="count images and classes per split; decode every image to find corrupt ones")
    c.add_argument("path", metavar="PATH", help="dataset folder (ImageFolder tree or TFRecord shards)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(_action=run_check)
    v = sub.add_parser("convert", help="convert a dataset folder between the ImageFolder and TFRecord layouts")
    v.add_argument("src", metavar="SRC", help="source dataset folder")
    v.add_argument("dst", metavar="DST", help="destination folder (new or empty)")
    v.add_argument("--to", required=True, choices=("tfrecord", "imagefolder"), help="layout to write")
    v.add_argument("--shard-size", type=positive_int, default=None, metavar="N",
                   help="images per TFRecord shard (default 1024)")
    v.set_defaults(_action=run_convert)
    for action in (c, v):
        action.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
        action.add_argument("--workers", type=non_negative_int, default=DEFAULT_WORKERS, metavar="N",
                            help=f"worker processes reading and decoding images (default {DEFAULT_WORKERS})")
        action.add_argument("--quiet", action="store_true", help="no progress on stderr")


class _Progress:
    """One stderr line per split, rewritten at most ten times a second."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.last = 0.0

    def __call__(self, split: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{split}: {done:,}/{total:,} images ({100.0 * done / max(total, 1):.0f}%)" + end)
        sys.stderr.flush()


def run(args) -> int:
    return args._action(args)


def run_check(args) -> int:
    from aiperf_core.data.tools import check

    report = check(args.path, args.workers, _Progress(not args.quiet and not args.json))
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0 if report.ok else EXIT_PROBLEMS
    print(f"{report.path}: layout {report.layout}, {report.classes} classes (train)")
    for split, s in report.splits.items():
        print(f"  {split:<5} {s.images:>10,} images  {s.classes:>6,} classes  {len(s.corrupt):>6,} corrupt")
        for error in s.corrupt[:20]:
            print(f"        corrupt: {error}")
        if len(s.corrupt) > 20:
            print(f"        ... and {len(s.corrupt) - 20} more")
        if not s.images:
            print(f"  problem: split '{split}' is empty")
    if report.mismatch:
        print(f"  problem: {report.mismatch}")
    print("ok" if report.ok else "problems found")
    return 0 if report.ok else EXIT_PROBLEMS


def run_convert(args) -> int:
    from aiperf_core.data.tools import DEFAULT_SHARD_SIZE, convert

    with writing(args.dst):
        result = convert(args.src, args.dst, args.to, args.workers, args.shard_size or DEFAULT_SHARD_SIZE,
                         _Progress(not args.quiet))
    for split, r in result.items():
        print(f"{split}: {r['written']:,} images written, {len(r['skipped']):,} skipped")
        for error in r["skipped"][:20]:
            print(f"  skipped: {error}")
    return 0
