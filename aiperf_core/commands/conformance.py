"""aiperf conformance --backend NAME: prove a backend computes what the IR says."""

from __future__ import annotations

import sys

HELP = "run the conformance kit on a backend (levels op, graph, morph, train, count); exit 0 only if nothing failed"


def add_arguments(p) -> None:
    p.add_argument("--backend", default=None,
                   help="backend name (default: $AIPERF_BACKEND, else the config file's 'backend', else tensorflow)")
    p.add_argument("--level", default="all", help="op, graph, morph, train, count, a comma-separated list, or all")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the machine-readable report here")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the summary")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs and weights")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")


def run(args) -> int:
    import json

    from aiperf_core.config_file import load_config
    from aiperf_core.errors import AiperfError
    from aiperf_core.registry import load_backend, resolve_backend_name
    from aiperf_conformance.kit import LEVELS, run_conformance

    levels = list(LEVELS) if args.level == "all" else [x.strip() for x in args.level.split(",") if x.strip()]
    for level in levels:
        if level not in LEVELS:
            raise AiperfError(f"--level: unknown level '{level}' (levels: {', '.join(LEVELS)}, all)")
    backend = load_backend(resolve_backend_name(args.backend, config=load_config(args.config)))

    def progress(result):
        if not args.json:
            print(f"  {result.status:5} {result.id} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)

    report = run_conformance(backend, levels, seed=args.seed, progress=progress)
    if args.report:
        report.write(args.report)
    print(json.dumps(report.to_dict(), default=str) if args.json else report.summary())
    return 0 if report.ok else 1
