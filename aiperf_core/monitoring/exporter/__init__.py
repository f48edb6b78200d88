"""Live figures of a run directory for Prometheus: custom collectors that read it incrementally
(collector.py) and the HTTP endpoint that serves them (server.py); options.py holds the endpoint's
command-line options without importing prometheus-client. Used by `aiperf run --metrics-port` and
`aiperf metrics`; the series are listed in docs/monitoring.md.
"""
