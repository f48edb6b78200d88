"""JaxBackend: the aiperf Backend contract on JAX (XLA).

jax is imported lazily, inside functions, so that `import aiperf_backends.jax` and listing backends work
where jax is not installed; availability() then says why not.

* devices: jax.local_devices() of the default platform ('cpu:0', 'gpu:0', 'tpu:0', ...).
* precisions: fp32 everywhere; bf16 (bfloat16 compute, float32 master weights and BN
  statistics) on GPUs and TPUs, where XLA runs it natively and a small probe trains finitely.
  On CPUs XLA emulates bfloat16 convolutions by converting to float32 (slower than fp32), so
  bf16 is not offered there. fp16 is not offered: it would need loss scaling, which this backend
  does not implement; check_precision rejects it loudly.
* model: a pure function over a parameter pytree (lowering.py), jit-compiled per model.
* train: SGD with momentum in a jitted step; data parallel over the local devices by sharding
  the batch axis (distributed.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from aiperf_core.backend import (Availability, Backend, Dataset, EpochCallback, EpochReport, NativeCounter,
                                 Parallelism, TrainConfig)
from aiperf_core.ir import Graph
from aiperf_core.weights import Weights, init_weights



def _probe_bf16() -> bool:
    """Whether a tiny conv/BN/dense net trains in bf16 with finite values on the default device."""
    try:
        import jax
        import jax.numpy as jnp

        from aiperf_core.builders import resnet_small
        from aiperf_backends.jax.lowering import lower_graph
        from aiperf_backends.jax.training import summed_loss

        graph = resnet_small((8, 8, 3), 3)
        model = lower_graph(graph, init_weights(graph, seed=0), "bf16")
        x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype(np.float32))
        y = jnp.asarray(np.array([0, 2], np.int32))
        loss, grads = jax.value_and_grad(
            lambda p: summed_loss(graph, p, model.state, x, y, 0.0, precision="bf16")[0])(model.params)
        leaves = jax.tree_util.tree_leaves(grads)
        return bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    except Exception:  # an unsupported dtype fails in many ways; it is just not declared
        return False


class JaxBackend(Backend):
    name = "jax"

    # -- discovery ----------------------------------------------------------
    @classmethod
    def availability(cls) -> Availability:
        return cls.import_availability("jax", "jax")

    def framework_version(self) -> str:
        import jax

        return jax.__version__

    def devices(self) -> list[str]:
        import jax

        return [f"{d.platform}:{d.id}" for d in jax.local_devices()]

    def runs_precision(self, device: str, precision: str) -> bool:
        # XLA on CPU turns bf16 convolutions back into fp32, so bf16 is offered on accelerators only.
        platform = device.partition(":")[0]
        return precision == "bf16" and platform in ("gpu", "cuda", "rocm", "tpu") and _probe_bf16()

    def parallelism(self) -> Parallelism:
        return Parallelism(data_parallel=True, synchronized_batch_norm=True,
                           notes="the batch axis sharded over a device mesh in one jitted step; batch statistics over the global batch array")

    def native_counter(self) -> NativeCounter | None:
        from aiperf_backends.jax.counter import XlaCostCounter

        return XlaCostCounter()

    # -- models -------------------------------------------------------------
    def lower(self, graph: Graph, weights: Weights | None = None, precision: str = "fp32") -> Any:
        from aiperf_backends.jax.lowering import lower_graph

        weights = self.starting_weights(graph, weights, precision)
        return lower_graph(graph, weights, precision)

    def model_type(self) -> type:
        from aiperf_backends.jax.lowering import JaxModel

        return JaxModel

    def export_weights(self, model: Any) -> Weights:
        return self.check_model(model).export_canonical()

    def import_weights(self, model: Any, weights: Weights) -> None:
        self.check_model(model).load_canonical(weights)

    def predict_checked(self, model: Any, x: np.ndarray) -> np.ndarray:
        from aiperf_backends.jax.training import predict

        return predict(model, x)

    def loss_and_grads_checked(self, model: Any, x: np.ndarray, labels: np.ndarray,
                               label_smoothing: float) -> tuple[float, Weights]:
        import jax
        import jax.numpy as jnp

        from aiperf_backends.jax.lowering import reference_dropout_masks
        from aiperf_backends.jax.training import summed_loss

        graph = model.graph
        # Dropout masks are the NumPy reference's for seed 0: deterministic, and comparable.
        shapes = {n.id: (len(x),) + tuple(graph.shapes[n.id]) for n in graph.nodes if n.op == "dropout"}
        masks = {k: jnp.asarray(v) for k, v in reference_dropout_masks(graph, shapes, 0).items()}
        key = ("loss_and_grads", label_smoothing)
        if key not in model.cache:
            precision = model.precision

            def loss_fn(params, state, xb, yb, dropout_masks):
                total, _ = summed_loss(graph, params, state, xb, yb, label_smoothing, precision=precision,
                                       masks=dropout_masks)
                return total / xb.shape[0]

            model.cache[key] = jax.jit(jax.value_and_grad(loss_fn))
        # Functional: the model's parameters and BN statistics are untouched.
        loss, grads = model.cache[key](model.params, model.state, jnp.asarray(x), jnp.asarray(labels), masks)
        out: Weights = {}
        for node_id, params in grads.items():
            out[node_id] = {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}
        return float(loss), out

    def train_checked(self, model: Any, data: Dataset, config: TrainConfig,
                      on_epoch: EpochCallback | None) -> list[EpochReport]:
        from aiperf_backends.jax.distributed import make_mesh
        from aiperf_backends.jax.training import run_epochs

        return run_epochs(model, data, config, make_mesh(), on_epoch=on_epoch)
