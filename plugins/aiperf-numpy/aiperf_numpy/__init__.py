"""aiperf-numpy: the NumPy reference executor for aiperf graphs."""

from aiperf_numpy.executor import Trace, backward, expert_load, forward, loss_and_grads, run

__all__ = ["Trace", "backward", "expert_load", "forward", "loss_and_grads", "run"]
