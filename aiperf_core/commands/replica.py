"""aiperf replica --run-dir DIR --replica-id I: one replica's trial loop (started by the primary)."""

from __future__ import annotations

from aiperf_core.commands.options import non_negative_int

HELP = "internal: run one replica's trial loop in a run directory (the primary starts these)"


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory (holds run.json)")
    p.add_argument("--replica-id", required=True, type=non_negative_int, metavar="I", help="this replica's number")


def run(args) -> int:
    from aiperf_core.replica import run_replica

    reason = run_replica(args.run_dir, args.replica_id)
    print(f"replica {args.replica_id}: stopped ({reason})", flush=True)
    return 0
