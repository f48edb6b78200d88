"""aiperf replica --run-dir DIR --replica-id I: one replica's trial loop (started by the primary)."""

from __future__ import annotations

from aiperf_core.commands.options import non_negative_int

HELP = "internal: run one replica's trial loop in a run directory (the primary starts these)"


def add_arguments(p) -> None:
    p.add_argument("--run-dir", required=True, metavar="DIR", help="the run directory (holds run.json)")
    p.add_argument("--replica-id", required=True, type=non_negative_int, metavar="I", help="this replica's number")
    p.add_argument("--node-rank", type=non_negative_int, default=0, metavar="K",
                   help="this node's place in a replica across nodes (0, the default: the node that leads)")


def run(args) -> int:
    import faulthandler

    from aiperf_core.replica import run_replica
    from aiperf_core.workflow.executors.base import STACKS_SIGNAL

    # A crash (SIGSEGV, SIGABRT from a corrupted heap, ...) writes the Python stack of every thread to
    # stderr, which is replica.log: the primary's replica_exit carries its tail. STACKS_SIGNAL does the
    # same on request: the primary sends it to a stalled replica before stopping it.
    try:
        faulthandler.enable(all_threads=True)
        faulthandler.register(STACKS_SIGNAL, all_threads=True)
    except (RuntimeError, ValueError, OSError, AttributeError):  # stderr is no file (run in-process, captured)
        pass
    reason = run_replica(args.run_dir, args.replica_id, node_rank=args.node_rank)
    node = f" node {args.node_rank}" if args.node_rank else ""
    print(f"replica {args.replica_id}{node}: stopped ({reason})", flush=True)
    return 0
