"""aiperf conformance --backend NAME: prove a backend computes what the IR says."""

from __future__ import annotations

import sys

HELP = ("run the conformance kit on a backend (levels op, graph, morph, train, count, parallel) at every "
        "precision it declares; exit 0 only if nothing failed and something passed")


def add_arguments(p) -> None:
    p.add_argument("--backend", default=None,
                   help="backend name (default: $AIPERF_BACKEND, else the config file's 'backend', else tensorflow)")
    p.add_argument("--level", default="all",
                   help="op, graph, morph, train, count, parallel, a comma-separated list, or all")
    p.add_argument("--precision", default=None, metavar="LIST",
                   help="run the op, graph and train levels only at these precisions, each declared on the "
                        "device under test (default: every declared one); morph, count and parallel run at fp32")
    p.add_argument("--workload", default="all", metavar="LIST",
                   help="run only the checks that certify these workloads: cnn, lm, ir (the model-zoo ops), a "
                        "comma-separated list, or all (default); a workload left out is not certified")
    p.add_argument("--quick", action="store_true",
                   help="every level on reduced sizes: a smoke test, never a certification")
    p.add_argument("--list", action="store_true",
                   help="print every check id with its level, precision, the workload it certifies (cnn, lm, "
                        "or ir: the model-zoo ops) and whether it needs a native counter (for the backend given "
                        "by --backend: the checks it would run), and exit")
    p.add_argument("--report", default=None, metavar="FILE.json", help="write the machine-readable report here")
    p.add_argument("--json", action="store_true", help="print the report (or the --list) as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed for the random inputs and weights")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="config file (default: $AIPERF_CONFIG, else ./aiperf.toml if present)")


def list_checks(args, levels, workloads) -> int:
    import json

    from aiperf_core.backend import PRECISIONS
    from aiperf_core.registry import load_backend
    from aiperf_conformance.kit import catalogue, collect, make_context, parse_precisions

    if args.backend:  # the checks this backend would run, on its device under test
        backend = load_backend(args.backend)
        checks = collect(make_context(backend, args.backend, precisions=args.precision), levels)
    else:
        checks = catalogue(levels, parse_precisions(args.precision, PRECISIONS, "any", "any device"))
    checks = [c for c in checks if c.workload in workloads]
    rows = [{"id": c.id, "level": c.level, "precision": c.precision, "needs_native_counter": c.needs_counter,
             "workload": c.workload, "ops": sorted(c.ops)} for c in checks]
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max(len(r["id"]) for r in rows)
    print(f"{'check id':<{width}}  {'level':<8}  {'precision':<9}  {'workload':<8}  native counter")
    for r in rows:
        print(f"{r['id']:<{width}}  {r['level']:<8}  {r['precision']:<9}  {r['workload']:<8}  "
              f"{'needed' if r['needs_native_counter'] else '-'}")
    return 0


def run(args) -> int:
    import json

    from aiperf_core.commands.options import writable_file, writing
    from aiperf_core.config_file import load_config
    from aiperf_core.registry import load_backend, resolve_backend_name
    from aiperf_conformance.kit import parse_levels, parse_workloads, run_conformance

    levels = parse_levels(args.level)
    workloads = parse_workloads(args.workload)
    if args.list:
        return list_checks(args, levels, workloads)
    if args.report:  # before the kit's minutes, not after them
        writable_file("--report", args.report)
    backend = load_backend(resolve_backend_name(args.backend, config=load_config(args.config)))

    def progress(result):
        if not args.json:
            print(f"  {result.status:5} {result.id} ({result.seconds:.1f} s)", file=sys.stderr, flush=True)

    report = run_conformance(backend, levels, seed=args.seed, quick=args.quick, precisions=args.precision,
                             workloads=workloads, progress=progress)
    if args.report:
        with writing(args.report, "--report"):
            report.write(args.report)
    print(json.dumps(report.to_dict(), default=str) if args.json else report.summary())
    return 0 if report.ok else 1
