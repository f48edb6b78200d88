"""The bytes an expert-parallel training step moves by all-to-all, counted from the IR alone.

Under expert parallelism (aiperf_core.backend.TrainConfig.expert_parallel) every (token, choice)
assignment of a `moe` node travels to its expert's device and its output travels back: forward,
the token's input vector out (width D_in) and the expert's output back (D_out); backward, the
output's gradient out (D_out) and the input's gradient back (D_in). So a training sample moves

    sum over moe nodes of  positions x top_k x (D_in + D_out) x 2 x element bytes

and an evaluated sample half that (forward only). Elements travel at the run's compute precision
(2 bytes under bf16 and fp16, 4 under fp32 and tf32), as the experts compute in it.

The figure is the all-to-all payload, the same on any number of devices: the share that stays on
its own device (1/devices of it, on average, copied rather than sent) is included, as the
collective moves it too; padding a backend adds to fixed-size buffers is not (it is the
backend's cost, not the model's). Recomputation under activation checkpointing is not counted
either, as its operations are not (docs/counting.md).
"""

from __future__ import annotations

import math

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph

ELEMENT_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def bytes_per_sample(graph: Graph, precision: str, training: bool = True) -> int:
    """All-to-all bytes one sample's training step (forward and backward) or evaluation moves."""
    if precision not in ELEMENT_BYTES:
        raise AiperfError(f"precision must be one of {', '.join(ELEMENT_BYTES)}, got {precision!r}")
    total = 0
    for node in graph.nodes:
        if node.op != "moe":
            continue
        in_shape, out_shape = graph.shapes[node.inputs[0]], graph.shapes[node.id]
        positions = math.prod(in_shape[:-1])
        total += positions * node.attrs["top_k"] * (in_shape[-1] + out_shape[-1])
    return total * ELEMENT_BYTES[precision] * (2 if training else 1)


def all_to_all_bytes(graph: Graph, precision: str, train_samples: int, val_samples: int = 0) -> int:
    """All-to-all bytes of an epoch that trained on `train_samples` and evaluated `val_samples`."""
    return (train_samples * bytes_per_sample(graph, precision, True)
            + val_samples * bytes_per_sample(graph, precision, False))
