"""Monitoring a run, in two parts that meet at each replica's monitor.jsonl:

- sampler.py runs on every replica's node while it trains: utilisation, memory, power and energy,
  written to replicas/<I>/monitor.jsonl (the report's plots and energy come from it);
- exporter/ serves a run directory's live figures to Prometheus (`aiperf run --metrics-port`,
  `aiperf metrics`), reading the run directory, those monitor.jsonl files included.
"""
