"""The network between a replica's nodes: measured by `aiperf probe network` (probe.py, nccl-tests'
figures through a backend's own collectives) and modelled for the scale simulation (model.py,
collectives priced by latency and bandwidth on a fat tree). What the network cost a run's score is
scoring's (aiperf_core.scoring.network)."""
