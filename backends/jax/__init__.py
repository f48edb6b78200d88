"""The JAX backend. jax itself is imported only when the backend is used.

Modules: backend (the Backend subclass), lowering (IR -> a pure JAX function over a parameter
pytree), training (loss, jitted SGD step, epoch loop), distributed (data parallelism by sharding
the batch axis over local devices), counter (native op counter from XLA's cost analysis).
"""

from aiperf_backends.jax.backend import JaxBackend

__all__ = ["JaxBackend"]
