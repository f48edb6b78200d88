"""Live figures of a run directory for Prometheus: custom collectors that read it incrementally
(aiperf_core/monitoring/collector.py) and the HTTP endpoint that serves them (server.py). Used by
`aiperf run --metrics-port` and `aiperf metrics`; the series are listed in docs/monitoring.md.
"""
