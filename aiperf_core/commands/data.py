"""aiperf data check PATH | convert SRC DST --to tfrecord|imagefolder | stage SRC DST | prepare SOURCE OUT."""

from __future__ import annotations

import argparse
import json
import sys
import time

from aiperf_core.commands.options import non_negative_int, positive_int, writable_folder, writing
from aiperf_core.errors import AiperfError

HELP = ("prepare ImageNet from its official archives or enwik8 from its zip; check an ImageNet folder (counts, "
        "classes, corrupt images) or convert it between the ImageFolder and TFRecord layouts; stage a prepared "
        "dataset to node-local storage")
DEFAULT_WORKERS = 4
EXIT_PROBLEMS = 1  # the check ran and found corrupt images or a class mismatch


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="ACTION", parser_class=type(p))
    sub.required = True
    c = sub.add_parser("check", help="count images and classes per split; decode every image to find corrupt ones")
    c.add_argument("path", metavar="PATH", help="dataset folder (ImageFolder tree or TFRecord shards)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.add_argument("--deep", action="store_true",
                   help="a folder with a manifest.json: checksum every file too (default: sizes only)")
    c.set_defaults(_action=run_check)
    v = sub.add_parser("convert", help="convert a dataset folder between the ImageFolder and TFRecord layouts")
    v.add_argument("src", metavar="SRC", help="source dataset folder")
    v.add_argument("dst", metavar="DST", help="destination folder (new or empty)")
    v.add_argument("--to", required=True, choices=("tfrecord", "imagefolder"), help="layout to write")
    v.add_argument("--shard-size", type=positive_int, default=None, metavar="N",
                   help="images per TFRecord shard (default 1024)")
    v.set_defaults(_action=run_convert)
    _add_stage(sub)
    _add_prepare(sub)
    for action in (c, v):
        action.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
        action.add_argument("--workers", type=non_negative_int, default=DEFAULT_WORKERS, metavar="N",
                            help=f"worker processes reading and decoding images (default {DEFAULT_WORKERS})")
        action.add_argument("--quiet", action="store_true", help="no progress on stderr")


class _Progress:
    """One stderr line per split, rewritten at most ten times a second."""

    def __init__(self, enabled: bool, unit: str = "images"):
        self.enabled = enabled
        self.unit = unit
        self.last = 0.0

    def __call__(self, split: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{split}: {done:,}/{total:,} {self.unit} ({100.0 * done / max(total, 1):.0f}%)" + end)
        sys.stderr.flush()


def run(args) -> int:
    return args._action(args)


# -- stage ----------------------------------------------------------------------------------------
def _add_stage(sub) -> None:
    from aiperf_core.data.stage import DEFAULT_WORKERS as STAGE_WORKERS

    s = sub.add_parser("stage", help="copy a prepared dataset to node-local storage and verify it against its "
                       "manifest (resumable; one copy per DST however many start it)")
    s.add_argument("src", metavar="SRC", help="a prepared dataset (a folder with manifest.json)")
    s.add_argument("dst", metavar="DST", help="the node-local copy: a new or empty folder, or one staged before")
    s.add_argument("--workers", type=positive_int, default=STAGE_WORKERS, metavar="N",
                   help=f"files copied at once (default {STAGE_WORKERS})")
    s.add_argument("--deep", action="store_true", help="on a copy verified before, checksum every file again "
                   "(default: sizes and the manifest's digest) and replace those that differ")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--quiet", action="store_true", help="no progress or waiting message on stderr")
    s.add_argument("--wait", default=None, metavar="DURATION",
                   help="how long another stage of DST may leave its lease unrenewed: then it is taken over if its "
                   "process is gone, or, if it still runs (stopped, hung), this stage gives up with one line naming "
                   "it (exit 2). A duration such as 90s or 5m, or seconds (default 5m)")
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    s.set_defaults(_action=run_stage)


class _StageProgress:
    """One live stderr line: files and bytes done, MB/s, ETA; rewritten at most five times a second."""

    def __init__(self):
        self.last = 0.0
        self.phase = None
        self.started = 0.0

    def __call__(self, phase: str, files: int, total_files: int, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != self.phase:
            self.phase, self.started = phase, now
        elif files < total_files and now - self.last < 0.2:
            return
        self.last = now
        rate = done / max(now - self.started, 1e-6)
        eta = _clock((total - done) / rate) if done else "-:--:--"
        line = (f"\r{phase}: {files:,}/{total_files:,} files, {done / 1e9:,.2f}/{total / 1e9:,.2f} GB "
                f"({100.0 * done / max(total, 1):.0f}%), {rate / 1e6:,.0f} MB/s, ETA {eta}  ")
        sys.stderr.write(line + ("\n" if files >= total_files else ""))
        sys.stderr.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def run_stage(args) -> int:
    from aiperf_core.data.stage import DEFAULT_WAIT_S, stage
    from aiperf_core.workflow.duration import parse_duration

    wait_s = DEFAULT_WAIT_S if args.wait is None else parse_duration(args.wait, "--wait")
    writable_folder(None, args.dst)  # before the source's manifest is read and checked
    live = not args.quiet and sys.stderr.isatty()

    def waiting(holder: str) -> None:
        if not args.quiet:
            print(f"aiperf data stage: {args.dst}: waiting: {holder}", file=sys.stderr, flush=True)

    with writing(args.dst):
        result = stage(args.src, args.dst, args.workers, args.deep, _StageProgress() if live else None, waiting,
                       wait_s)
    if args.json:
        print(json.dumps(result.to_dict()))
        return 0
    checks = "sizes and checksums" if result.deep else "sizes and the manifest's digest; --deep checksums them"
    if result.complete_before:
        print(f"{result.dst}: already a verified copy of {result.src} ({result.files:,} files; checked: {checks}); "
              f"nothing copied")
    else:
        rate = result.copied_bytes / max(result.seconds, 1e-6) / 1e6
        print(f"{result.dst}: copied {result.copied:,} files ({result.copied_bytes / 1e9:,.2f} GB) in "
              f"{result.seconds:,.1f} s ({rate:,.0f} MB/s), each checked by size and checksum as copied; kept "
              f"{result.kept:,} already there (checked by {result.kept_by})")
        for name in result.replaced[:20]:
            print(f"  replaced (differed from the manifest): {name}")
        if len(result.replaced) > 20:
            print(f"  ... and {len(result.replaced) - 20} more")
    print(f"digest {result.digest}")
    return 0


def run_check(args) -> int:
    from aiperf_core.data.tools import check, check_prepared

    prepared = check_prepared(args.path, args.deep, args.workers,
                              _Progress(not args.quiet and not args.json, unit="files"))
    if prepared is not None:
        return _print_prepared(prepared, args.json)
    if args.deep:
        raise AiperfError(f"--deep: {args.path} has no manifest.json; without one every image is decoded anyway")
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


def _print_prepared(report, as_json: bool) -> int:
    from aiperf_core.data.manifest import BYTES

    m = report.manifest
    if as_json:
        print(json.dumps(report.to_dict()))
        return 0 if report.ok else EXIT_PROBLEMS
    if m.layout == BYTES:
        print(f"{report.path}: a prepared byte-level text dataset (manifest.json), {m.extra.get('dataset', '?')}")
        for split, size in m.split_bytes.items():
            print(f"  {split:<5} {size:>12,} bytes")
        official = "yes" if m.official else f"no ({m.extra.get('official_reason', 'not the 100,000,000-byte enwik8')})"
        print(f"  official enwik8: {official}")
    else:
        print(f"{report.path}: a prepared dataset (manifest.json), layout {m.layout}, {len(m.classes):,} classes")
        for split, images in m.images.items():
            print(f"  {split:<5} {images:>10,} images  {len(m.per_class[split]):>6,} classes")
        official = ("yes" if m.official
                    else "no (it is not the complete ILSVRC2012 set: 1,000 classes, 1,281,167 + 50,000 images)")
        print(f"  official ILSVRC2012: {official}")
    print(f"  digest {m.digest}")
    print(f"  {len(m.files):,} files checked against the manifest: "
          f"{'sizes and checksums' if report.deep else 'sizes (--deep: checksums too)'}")
    for problem in report.problems[:20]:
        print(f"  problem: {problem}")
    if len(report.problems) > 20:
        print(f"  ... and {len(report.problems) - 20} more")
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


# -- prepare -----------------------------------------------------------------------------------


def _add_prepare(sub) -> None:
    import os

    from aiperf_core.data.manifest import IMAGE_LAYOUTS  # light: prepare's own module loads numpy

    summary = ("prepare ImageNet from the three official ILSVRC2012 archives (TFRecord shards or a folder tree), "
               "or enwik8 from enwik8.zip (byte-level text, 90/5/5 split); with a manifest")
    r = sub.add_parser("prepare", help=summary, description=summary, epilog=PREPARE_FAILURES)
    r.add_argument("source", metavar="SOURCE", help="a folder holding ILSVRC2012_img_train.tar, "
                                                    "ILSVRC2012_img_val.tar and ILSVRC2012_devkit_t12.tar.gz "
                                                    "(ImageNet), or a zip file holding the file enwik8 (enwik8)")
    r.add_argument("out", metavar="OUT", help="output folder (new, empty, or an unfinished prepare to resume)")
    r.add_argument("--layout", choices=IMAGE_LAYOUTS, default=None,
                   help="ImageNet only: output layout (default tfrecord)")
    r.add_argument("--workers", type=non_negative_int, default=os.cpu_count() or 1, metavar="N",
                   help="ImageNet only: worker processes converting classes in parallel (default: one per core; "
                        "0: none)")
    r.add_argument("--train-shards", type=positive_int, default=None, metavar="N",
                   help="ImageNet only: TFRecord training shards (default 1024, train-00000-of-01024 ...)")
    r.add_argument("--val-shards", type=positive_int, default=None, metavar="N",
                   help="ImageNet only: TFRecord validation shards (default 128, validation-00000-of-00128 ...)")
    r.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for errors")
    r.set_defaults(_action=run_prepare)


PREPARE_FAILURES = (
    "After a failure, OUT holds either a prepare to resume or nothing prepared. Resumable: an interruption "
    "(Ctrl-C, SIGTERM, SIGKILL, a worker process killed) and an error reading SOURCE or writing OUT (a full disk) "
    "keep the finished files and OUT/.prepare/; the same command continues from them. Not resumable: a damaged "
    "source (an enwik8 member failing its CRC-32 or ending early, a damaged class tar, an image that cannot be "
    "decoded, counts contradicting the devkit) removes every split file, shard or class folder this prepare "
    "wrote, and OUT/.prepare/, since every rerun over that source would fail the same way. A source refused "
    "before anything is written (a missing or truncated archive, a zip without enwik8) leaves OUT untouched.")
IMAGENET_ONLY = (("layout", "--layout"), ("train_shards", "--train-shards"), ("val_shards", "--val-shards"))


def run_prepare(args) -> int:
    from aiperf_core.data.enwik8 import is_zip_source

    if is_zip_source(args.source):
        given = [option for attribute, option in IMAGENET_ONLY if getattr(args, attribute) is not None]
        if given:
            raise AiperfError(f"{given[0]}: applies to ImageNet's archives, not to the zip {args.source} (enwik8 "
                              f"has one layout: train.bin, val.bin, test.bin)")
        return _run_prepare_enwik8(args)
    from aiperf_core.data.prepare import ProgressLine, prepare

    writable_folder(None, args.out)  # before the archives are read
    with writing(args.out):
        summary = prepare(args.source, args.out, args.layout or "tfrecord", args.workers, args.train_shards,
                          args.val_shards, ProgressLine(enabled=not args.quiet))
    if summary.already_complete:
        print(f"{summary.out}: already prepared from these archives with these settings; nothing to do")
    images = summary.images
    print(f"{summary.out}: layout {summary.layout}, {summary.classes:,} classes, {images.get('train', 0):,} train "
          f"and {images.get('val', 0):,} val images")
    converted = ", ".join(f"{kind} {n:,}" for kind, n in summary.conversions.items())
    print(f"  images by kind (jpeg kept as stored; jpeg_grayscale, jpeg_cmyk, png converted to RGB JPEG): {converted}")
    if not summary.already_complete:
        rate = sum(images.values()) / summary.seconds if summary.seconds else 0.0
        resumed = f", resumed after {summary.resumed_units:,} finished units" if summary.resumed_units else ""
        print(f"  {summary.seconds:.1f} s ({rate:,.0f} images/s{resumed})")
    print(f"  digest {summary.digest} (manifest.json)")
    return 0


def _run_prepare_enwik8(args) -> int:
    from aiperf_core.data.enwik8 import BytesProgress, prepare_enwik8

    writable_folder(None, args.out)  # before the zip is read
    with writing(args.out):
        summary = prepare_enwik8(args.source, args.out, BytesProgress(enabled=not args.quiet))
    if summary.already_complete:
        print(f"{summary.out}: already prepared from this enwik8 member; nothing to do")
    sizes = summary.split_bytes
    print(f"{summary.out}: enwik8, byte-level (vocabulary 256): {sizes['train']:,} train, {sizes['val']:,} val and "
          f"{sizes['test']:,} test bytes")
    print(f"  official: {'yes' if summary.official else 'no'} ({summary.reason})")
    print(f"  member sha256 {summary.member_sha256}")
    if not summary.already_complete:
        total = sum(sizes.values())
        rate = total / summary.seconds / 1e6 if summary.seconds else 0.0
        kept = f", resumed: {', '.join(summary.kept)} kept from the interrupted run" if summary.kept else ""
        print(f"  {summary.seconds:.1f} s ({rate:,.0f} MB/s{kept})")
    print(f"  digest {summary.digest} (manifest.json)")
    return 0
