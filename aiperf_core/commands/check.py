"""aiperf check SUBMISSION: the reviewer's check (aiperf_core.submission.check).

Exit status: 0 ACCEPTED (official or not), 1 REJECTED, 2 bad input (a file that is not a readable
package: not gzip, truncated, an unsafe member, over a size limit, no manifest)."""

from __future__ import annotations

import json

HELP = "check a submission package, trusting nothing in it: exit 0 accepted, 1 rejected, 2 unreadable"


def add_arguments(p) -> None:
    p.add_argument("package", metavar="SUBMISSION", help="a .tar.gz made by aiperf submit")
    p.add_argument("--json", action="store_true", help="print the verdict as one JSON object")


def run(args) -> int:
    from aiperf_core.submission.check import EXIT_ACCEPTED, EXIT_REJECTED, check_submission

    verdict = check_submission(args.package)
    print(json.dumps(verdict.to_dict()) if args.json else verdict.render())
    return EXIT_ACCEPTED if verdict.accepted else EXIT_REJECTED
