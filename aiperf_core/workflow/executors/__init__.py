"""Executors start, watch and stop replicas: `local` (processes here) and `slurm` (batch jobs)."""
