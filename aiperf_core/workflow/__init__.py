"""The benchmark's workflow: the primary (`aiperf run`), its executors, resume and fault tolerance.
See docs/workflow.md."""
