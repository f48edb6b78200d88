"""The HTTP endpoint: a RunCollector on HOST:PORT/metrics, served by prometheus-client's threaded
WSGI server (OpenMetrics when the scraper asks for it, as Prometheus does; the Prometheus text
format otherwise). It binds 127.0.0.1 unless told otherwise, and binds before anything else
starts, so that a port in use or a privileged port is a one-line error before a run begins."""

from __future__ import annotations

import errno
import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client.exposition import ThreadingWSGIServer

from aiperf_core.errors import AiperfError
from aiperf_core.monitoring.exporter.collector import RunCollector

OPENMETRICS = "application/openmetrics-text"
CONTENT_TYPES = {True: f"{OPENMETRICS}; version=1.0.0; charset=utf-8",
                 False: "text/plain; version=0.0.4; charset=utf-8"}

PRIVILEGED_PORTS = 1024


class MetricsServer:
    """A started endpoint; close() stops it and frees the port."""

    def __init__(self, host: str, port: int, collector: RunCollector, port_option: str, host_option: str):
        self.collector = collector
        try:
            server_class = _Server6 if ":" in host else ThreadingWSGIServer
            self._server = make_server(host, port, _app(collector), server_class, handler_class=_QuietHandler)
        except socket.gaierror as exc:
            raise AiperfError(f"{host_option} {host}: not a host name or address ({exc.strerror})") from None
        except OSError as exc:
            raise AiperfError(_bind_error(exc, host, port, port_option, host_option)) from None
        # Scrapes in flight finish before close() returns (it joins them): the last scrape of an
        # ended run must reach the scraper before the primary exits.
        self._server.daemon_threads = False
        self.host, self.port = host, self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def wait_for_final_scrape(self, timeout_s: float) -> bool:
        """After the run's end: if anything scraped the endpoint during the run, wait (up to
        `timeout_s`) until a scrape has returned the ended run, so the scraper stores the final
        score before the endpoint goes away. True if it has."""
        if self.collector.scrapes == 0:
            return False
        return self.collector.ended_scraped.wait(timeout_s)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    timeout = 60  # seconds a connection may stay silent: close() waits for every request in flight

    def log_message(self, format, *args):  # a scrape every few seconds is not news
        pass


def _app(collector: RunCollector):
    def metrics(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"aiperf serves /metrics\n"]
        openmetrics = OPENMETRICS in environ.get("HTTP_ACCEPT", "")
        body = collector.render(openmetrics)
        start_response("200 OK", [("Content-Type", CONTENT_TYPES[openmetrics]), ("Content-Length", str(len(body)))])
        return [body]
    return metrics


def _bind_error(exc: OSError, host: str, port: int, port_option: str, host_option: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{port_option} {port}: {host}:{port} is already in use"
    if exc.errno == errno.EACCES and port < PRIVILEGED_PORTS:
        return (f"{port_option} {port}: ports below {PRIVILEGED_PORTS} need root (or CAP_NET_BIND_SERVICE); "
                f"choose one from {PRIVILEGED_PORTS} up")
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return f"{host_option} {host}: not an address of this machine"
    return f"{port_option} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"


def serve(host: str, port: int, collector: RunCollector, port_option: str = "--port",
          host_option: str = "--host") -> MetricsServer:
    """Start serving `collector` on host:port; AiperfError, naming the option, if that cannot be."""
    return MetricsServer(host, port, collector, port_option, host_option)
