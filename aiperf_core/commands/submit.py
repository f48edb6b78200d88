"""aiperf submit RUN_DIR: pack a finished run for the list (aiperf_core.submission.package)."""

from __future__ import annotations

HELP = "pack a finished run, its system description, conformance reports and peak into one checkable .tar.gz"


def add_arguments(p) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory whose run has ended")
    p.add_argument("--system", required=True, metavar="system.toml",
                   help="the system description (aiperf system describe, then filled in by the site)")
    p.add_argument("--conformance", required=True, nargs="+", metavar="REPORT.json",
                   help="kit reports (aiperf conformance --report) certifying the run's backend on its device")
    p.add_argument("--peak", metavar="peak.json", help="the measured peak (aiperf peak)")
    p.add_argument("--out", required=True, metavar="NAME.tar.gz", help="the package to write")
    p.add_argument("--force", action="store_true", help="replace an existing --out")


def run(args) -> int:
    from pathlib import Path

    from aiperf_core.commands.options import writable_file
    from aiperf_core.submission import SubmissionError
    from aiperf_core.submission.package import pack, print_progress

    if Path(args.out).exists() and not args.force:
        raise SubmissionError(f"{args.out}: exists (use --force to replace it)")
    writable_file("--out", args.out, folder_made=False)  # before hashing and packing the run; pack makes no folder
    path, ident = pack(args.run_dir, args.system, args.conformance, args.out, peak=args.peak,
                       progress=print_progress)
    print(f"{path}: submission {ident} ({path.stat().st_size / 2**20:.1f} MiB); check it with: aiperf check {path}")
    return 0
