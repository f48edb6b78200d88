"""aiperf metrics RUN_DIR --port PORT: serve a run's live figures to Prometheus, read-only, from
any machine that sees the run directory (docs/monitoring.md)."""

from __future__ import annotations

import signal
import sys
import threading

HELP = "serve a run directory's live figures to Prometheus (OpenMetrics on /metrics), read-only"


def add_arguments(p) -> None:
    from aiperf_core.monitoring.exporter.options import DEFAULT_HOST, port_number

    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (going or ended)")
    p.add_argument("--port", type=port_number, required=True, metavar="PORT", help="TCP port to serve on")
    p.add_argument("--host", default=DEFAULT_HOST, metavar="ADDRESS",
                   help=f"address to listen on (default {DEFAULT_HOST}: this machine only; 0.0.0.0: every interface)")


def run(args) -> int:
    from aiperf_core.monitoring.exporter.collector import RunCollector, open_run
    from aiperf_core.monitoring.exporter.server import serve

    root = open_run(args.run_dir)
    server = serve(args.host, args.port, RunCollector(root), "--port", "--host")
    stopping = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    print(f"serving {server.url} for {root}; Ctrl-C stops", flush=True)
    try:
        while not stopping.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
    print("stopped", file=sys.stderr)
    return 0
