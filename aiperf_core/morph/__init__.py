"""Function-preserving morphs of the graph IR, one module per family: a CNN's (cnn.py: deeper, wider, skip,
kernel) and a decoder-only transformer's (transformer.py: deeper, wider_mlp, more_heads, double_width,
upcycle_moe). What they share is here: caps on a child, the memory check, a morph's result and an
architecture's signature hash (plan.py also holds the plan machinery behind them).
"""

from aiperf_core.morph.plan import CapExceeded, MemoryCheck, MorphCaps, MorphResult, signature_hash

__all__ = ["CapExceeded", "MemoryCheck", "MorphCaps", "MorphResult", "signature_hash"]
