"""Level 'graph': whole networks (two ResNets, a 2-layer GPT) against the reference, parameter
counts and shapes against the IR, and the 9 ONNX model-zoo CNNs with random weights against
onnx.reference.ReferenceEvaluator; at every precision the backend declares on the device under test
(a model lowered at a mixed precision still exports fp32 master weights of the IR's shapes).

The model-zoo CNNs (onnx/backend/test/data/light in the onnx wheel, batch 1 at 224 px) check the
importer and the backend together against an oracle nobody here wrote: each model gets random
weights (aiperf_core.onnx.with_random_initializers), ReferenceEvaluator runs it on a random NCHW
input, and the backend runs the graph import_onnx makes of the same model on the same input in NHWC.
ReferenceEvaluator is slow (pure Python: minutes for the nine), so its outputs are kept on disk
(zoo_cache_folder(), keyed by the sha256 of the model with its weights, the input, the onnx version
and the evaluator's op fixes), and the imported graphs in memory for every backend and precision of
a process.

The outputs compared are the logits, the input of the final softmax (the graph is lowered without
it): with trained-looking weights the softmax of a deep network saturates (ResNet-50's top
probability is 0.99999), which would hide a logit error of any size."""

from __future__ import annotations

import hashlib
import inspect
import math
import os
from functools import partial
from pathlib import Path

import numpy as np

from aiperf_core.builders import gpt, llama, resnet50, resnet_small
from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph
from aiperf_conformance.cases import case_input, trained_looking_weights
from aiperf_conformance.kit import Check, Context, Outcome, compare, new_ops, reference

GRAPHS = {
    "resnet_small": lambda: resnet_small((32, 32, 3), 10),
    "resnet50_64px": lambda: resnet50((64, 64, 3), 10),
    "gpt": lambda: gpt(layers=2, hidden=32, heads=4, seq_len=16, vocab=64),
    # Llama's family: RMS norm, rotary positions, grouped-query attention (2 query heads per key-value
    # head) and a SwiGLU MLP.
    "llama": lambda: llama(layers=2, hidden=32, heads=4, kv_heads=2, seq_len=16, vocab=64, ffn=48),
}
WORKLOAD_OF = {"gpt": "lm", "llama": "lm"}  # the others: cnn
BATCH, QUICK_BATCH = 2, 1
# The model-zoo CNNs shipped in the onnx wheel (onnx/backend/test/data/light), run with random weights
# against onnx.reference.ReferenceEvaluator: an oracle nobody here wrote.
ZOO = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet",
       "vgg19", "zfnet512")
# --quick keeps the four that are fastest to make and import (0.06 to 1.1 s each here, against 2 to 12 s for
# the others: vgg19, alexnet and zfnet512 hold 60 to 140 million weights, densenet121 121 convolutions)
# and between them still need every model-zoo op (tests/test_conformance_workloads.py checks it).
ZOO_QUICK = ("inception_v1", "inception_v2", "shufflenet", "squeezenet")
ZOO_SEED = 4
# The ops each zoo model imports to beyond the CNN ones (tests/test_conformance_workloads.py keeps this
# true): what a backend must declare to run it. Known without importing, so that listing the checks is quick.
ZOO_OPS = {
    "bvlc_alexnet": frozenset({"lrn", "grouped_conv2d"}), "zfnet512": frozenset({"lrn"}),
    "inception_v1": frozenset({"lrn", "avg_pool"}), "inception_v2": frozenset({"avg_pool", "mul_const", "add_const"}),
    "densenet121": frozenset({"avg_pool", "mul_const", "add_const"}),
    "shufflenet": frozenset({"avg_pool", "channel_shuffle", "grouped_conv2d"}),
}
# Per process, for every backend and precision: each model's imported graph and weights, input and reference
# logits (about 1.3 GB for the nine, half of it vgg19's classifier).
_zoo_cache: dict = {}
# Per process: the NumPy reference's logits of the graphs above (graph_reference), by digest.
_graph_references: dict[str, np.ndarray] = {}
zoo_reference_files: dict[str, str] = {}  # model -> the file name its reference output has (zoo_reference_file)


def checks_tags(name: str) -> dict:
    return dict(workload=WORKLOAD_OF.get(name, "cnn"), ops=new_ops(GRAPHS[name]()))


def _model(ctx: Context, name: str, precision: str):
    key = ("graph", name, precision)
    if key not in ctx.cache:
        graph = GRAPHS[name]()
        weights = trained_looking_weights(graph, ctx.seed)
        ctx.cache[key] = (graph, weights, ctx.backend.lower(graph, weights, precision=precision))
    return ctx.cache[key]


def logits_graph(graph: Graph) -> Graph:
    """The graph without its final softmax (the graph itself when it ends otherwise)."""
    if graph[graph.output_id].op != "softmax":
        return graph
    return Graph(graph.nodes[:-1], name=f"{graph.name}_logits")


def outputs(ctx: Context, name: str, precision: str) -> Outcome:
    graph = logits_graph(GRAPHS[name]())
    weights = trained_looking_weights(graph, ctx.seed)
    batch = QUICK_BATCH if ctx.quick else BATCH
    x = case_input(graph, ctx.rng(7), batch)
    expected = graph_reference(graph, weights, x)
    measured = ctx.backend.predict(ctx.backend.lower(graph, weights, precision=precision), x)
    tolerance = ctx.tolerance("graph_lm" if WORKLOAD_OF.get(name) == "lm" else "graph", precision)
    return compare(measured, expected, tolerance, f"{name} logits (node '{graph.output_id}', the softmax input)")


def graph_reference(graph: Graph, weights: dict, x: np.ndarray) -> np.ndarray:
    """The NumPy reference's float64 logits of `graph` with `weights` on `x`: the same answer for every
    precision and every backend, so computed once per process (resnet50_64px's takes seconds), keyed by
    the digest of the graph, its weights and the input."""
    key = _digest(graph, weights, x)
    if key not in _graph_references:
        _graph_references[key] = reference().forward(graph, weights, x, dtype=np.float64)
    return _graph_references[key]


def _digest(graph: Graph, weights: dict, x: np.ndarray) -> str:
    digest = hashlib.sha256(repr(graph.nodes).encode())
    for node_id in sorted(weights):
        for pname in sorted(weights[node_id]):
            value = np.ascontiguousarray(weights[node_id][pname])
            digest.update(f"{node_id}/{pname}{value.dtype}{value.shape}".encode())
            digest.update(value.tobytes())
    x = np.ascontiguousarray(x)
    digest.update(f"{x.dtype}{x.shape}".encode())
    digest.update(x.tobytes())
    return digest.hexdigest()


def parameters(ctx: Context, name: str, precision: str) -> Outcome:
    graph, _, model = _model(ctx, name, precision)
    exported = ctx.backend.export_weights(model)
    for node_id, shapes in graph.all_param_shapes().items():
        for pname, shape in shapes.items():
            got = exported.get(node_id, {}).get(pname)
            if got is None:
                return Outcome(False, None, list(shape), None, f"node '{node_id}': weight '{pname}' missing")
            if tuple(got.shape) != tuple(shape):
                return Outcome(False, list(got.shape), list(shape), None,
                               f"node '{node_id}': weight '{pname}' has shape {list(got.shape)}, IR says {list(shape)}")
            if np.asarray(got).dtype != np.float32:
                return Outcome(False, str(np.asarray(got).dtype), "float32", None,
                               f"node '{node_id}': weight '{pname}' exported as {np.asarray(got).dtype}; "
                               f"canonical weights are float32 (master weights at every precision)")
    extra = sorted(set(exported) - set(graph.all_param_shapes()))
    if extra:
        return Outcome(False, extra, [], None, f"node '{extra[0]}': weights for a node that has none in the IR")
    total = sum(math.prod(a.shape) for ps in exported.values() for n, a in ps.items() if not n.startswith("moving_"))
    return Outcome(total == graph.num_params(), total, graph.num_params(), 0,
                   f"{name}: {total:,} trainable parameters, IR says {graph.num_params():,}")


def output_shape(ctx: Context, name: str, precision: str) -> Outcome:
    graph, _, model = _model(ctx, name, precision)
    batch = QUICK_BATCH + 1 if ctx.quick else BATCH + 1  # another batch size than the outputs check's
    x = np.zeros((batch,) + graph.input_shape, np.int64 if graph.takes_tokens else np.float32)
    got = tuple(np.shape(ctx.backend.predict(model, x)))
    want = (batch,) + graph.output_shape
    return Outcome(got == want, list(got), list(want), None,
                   f"{name} output (node '{graph.output_id}'): shape {list(got)}, IR says {list(want)}")


def zoo_file(name: str) -> Path:
    import onnx

    return Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{name}.onnx"


def zoo_ops(name: str) -> frozenset[str]:
    return ZOO_OPS.get(name, frozenset())


def zoo_cache_folder() -> Path:
    """Where the ReferenceEvaluator's outputs are kept between runs: $AIPERF_CONFORMANCE_CACHE, else
    ~/.cache/aiperf/conformance (per user)."""
    return Path(os.environ.get("AIPERF_CONFORMANCE_CACHE") or Path.home() / ".cache" / "aiperf" / "conformance")


def zoo_reference_key(model_bytes: bytes, x: np.ndarray) -> str:
    """What the reference logits depend on: the model with its random weights (so the seed), the input,
    the onnx version and the evaluator's own op fixes (aiperf_core.onnx.reference_evaluator)."""
    import onnx

    from aiperf_core.onnx import reference_evaluator

    digest = hashlib.sha256()
    for part in (model_bytes, x.tobytes(), str(x.shape).encode(), onnx.__version__.encode(),
                 inspect.getsource(reference_evaluator).encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()


# ReferenceEvaluator's outputs for the nine models as the kit makes them, shipped with the kit as ONNX's
# backend tests ship their expected outputs: a fresh machine (a CI runner, a vendor's first run) saves the
# evaluator's 2 minutes. Their file names hold the key of what they were computed from, so an output of
# another onnx version, seed or evaluator is never used (it is computed anew), and a test recomputes one.
SHIPPED_ZOO_REFERENCES = Path(__file__).resolve().parent.parent / "data" / "zoo_reference"


def zoo_reference_file(name: str, model, x: np.ndarray) -> str:
    return f"onnx_zoo-{name}-seed{ZOO_SEED}-{zoo_reference_key(model.SerializeToString(), x)}.npy"


def _load_reference(path: Path) -> np.ndarray | None:
    try:
        cached = np.load(path, allow_pickle=False)
    except (OSError, ValueError):  # absent, or unreadable: computed anew
        return None
    return cached if cached.dtype == np.float64 and np.all(np.isfinite(cached)) else None


def zoo_reference(name: str, model, x: np.ndarray) -> np.ndarray:
    """The ReferenceEvaluator's output for `model` on `x` (NCHW): shipped with the kit, else from the disk
    cache when it holds it, else computed (ReferenceEvaluator runs in Python: 1 to 35 s a model at 224 px
    on one core, about 2 minutes for the nine on this project's 2-core CPU) and cached."""
    from aiperf_core.atomic import write_atomic
    from aiperf_core.onnx import reference_evaluator

    # Recorded for _zoo_model: the key hashes the whole model (seconds for vgg19), so it is made once.
    file = zoo_reference_files[name] = zoo_reference_file(name, model, x)
    for folder in (SHIPPED_ZOO_REFERENCES, zoo_cache_folder()):
        cached = _load_reference(folder / file)
        if cached is not None:
            return cached
    path = zoo_cache_folder() / file
    data = next(i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    expected = np.asarray(reference_evaluator(model).run(None, {data.name: x})[0], np.float64)
    try:
        write_atomic(path, lambda f: np.save(f, expected, allow_pickle=False))
    except OSError:  # a read-only home: the kit still runs, without a cache
        pass
    return expected


def _zoo_model(name: str):
    """(the IR graph and weights imported from the ONNX model with random weights and without its
    final softmax, the NHWC input, the ReferenceEvaluator's logits), computed once per process: the
    import of vgg19's 140 million weights takes seconds, and every backend and precision reuse it."""
    if name not in _zoo_cache:
        import onnx

        from aiperf_core.onnx import import_onnx, with_random_initializers

        model = _without_softmax(with_random_initializers(onnx.load(str(zoo_file(name))), seed=ZOO_SEED))
        data = next(i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
        shape = [d.dim_value for d in data.type.tensor_type.shape.dim]
        x = np.random.default_rng(ZOO_SEED).uniform(0, 1, shape).astype(np.float32)
        graph, weights = import_onnx(model)
        if any(n.op == "batch_norm" for n in graph.nodes):
            model = with_batch_norm_statistics(model, graph, weights, x.transpose(0, 2, 3, 1))
            graph, weights = import_onnx(model)
        expected = zoo_reference(name, model, x)
        _zoo_cache[name] = (graph, weights, x.transpose(0, 2, 3, 1), expected)
    return _zoo_cache[name]


def with_batch_norm_statistics(model, graph: Graph, weights, x: np.ndarray):
    """A copy of the ONNX model whose batch norms' moving statistics are those of their inputs on `x`
    (NHWC), as a trained network's are: with random ones a batch norm does not normalise, and through
    ResNet-50's residual adds the logits grow to 1.3e5 (shufflenet's to 3e6), beyond fp16's 65,504.

    The statistics come from the NumPy reference running `graph` (import_onnx of `model`, `weights`) in
    training mode, where each batch norm normalises with the statistics of its input: set as the moving
    ones, inference on `x` computes the same. Only weights are made so; ReferenceEvaluator then runs the
    model as it is."""
    from onnx import numpy_helper

    from aiperf_numpy.executor import run

    ir_norms = [n for n in graph.nodes if n.op == "batch_norm"]
    onnx_norms = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    if len(ir_norms) != len(onnx_norms):
        raise AiperfError(f"{graph.name}: {len(onnx_norms)} ONNX batch norms imported as {len(ir_norms)}")
    trace = run(graph, weights, x, training=True, dtype=np.float64)
    out = type(model)()
    out.CopyFrom(model)
    initializers = {t.name: t for t in out.graph.initializer}
    for ir_node, onnx_node in zip(ir_norms, onnx_norms):
        inputs = trace.outputs[ir_node.inputs[0]]
        axes = tuple(range(inputs.ndim - 1))
        # A channel that is (nearly) constant on this one image keeps a variance of 1e-2, so that no batch
        # norm amplifies rounding by more than 10.
        statistics = {3: inputs.mean(axis=axes), 4: np.maximum(inputs.var(axis=axes), 1e-2)}
        for k, value in statistics.items():
            tensor = initializers[onnx_node.input[k]]
            original = numpy_helper.to_array(tensor)
            # The importer may hold channels in another order (a shuffled activation's): IR = ONNX[order].
            imported = weights[ir_node.id]["moving_mean" if k == 3 else "moving_variance"]
            order = _order(original.reshape(-1), imported, f"{graph.name} node '{ir_node.id}'")
            fresh = np.empty(original.size, np.float32)
            fresh[order] = value.astype(np.float32)
            tensor.CopyFrom(numpy_helper.from_array(fresh.reshape(original.shape), tensor.name))
    return out


def _order(onnx_values: np.ndarray, ir_values: np.ndarray, what: str) -> np.ndarray:
    """The permutation `order` with ir_values == onnx_values[order]. Random values can repeat (uniform
    float32 draws do: densenet121 has two equal means among 832), so equal values are paired in their
    order of appearance, which is exact where the importer keeps the channels' order; `order` is always
    a permutation, so every channel gets its statistic (matching each value to its first equal left one
    channel unwritten, and the model, the reference's cache key with it, different in every process)."""
    if onnx_values.shape != ir_values.shape:
        raise AiperfError(f"{what}: {ir_values.size} batch-norm statistics imported from {onnx_values.size}")
    order = np.empty(len(ir_values), np.int64)
    order[np.argsort(ir_values, kind="stable")] = np.argsort(onnx_values, kind="stable")
    if not np.array_equal(onnx_values[order], ir_values):
        raise AiperfError(f"{what}: its batch-norm statistics are not a permutation of the ONNX model's")
    return order


def _without_softmax(model):
    """The model without its final Softmax, which random weights saturate (its logits are compared)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    last = out.graph.node[-1]
    if last.op_type == "Softmax":
        out.graph.output[0].name = last.input[0]
        del out.graph.node[-1]
    return out


def zoo_outputs(ctx: Context, name: str, precision: str) -> Outcome:
    graph, weights, x, expected = _zoo_model(name)
    measured = ctx.backend.predict(ctx.backend.lower(graph, weights, precision=precision), x)
    if measured.ndim == 4:  # an image output (densenet121 and squeezenet end in a 1x1 map): NHWC to NCHW
        measured = measured.transpose(0, 3, 1, 2)
    return compare(measured.reshape(expected.shape), expected, ctx.tolerance("graph_zoo", precision),
                   f"{name} (ONNX model zoo, random weights) logits against onnx.reference.ReferenceEvaluator")


def checks(ctx: Context):
    for precision in ctx.precisions:
        for name in GRAPHS:
            for what, run in (("outputs", outputs), ("parameters", parameters), ("output_shape", output_shape)):
                yield Check("graph", f"{name}/{what}", partial(run, name=name, precision=precision), precision,
                            **checks_tags(name))
        for name in ZOO_QUICK if ctx.quick else ZOO:
            yield Check("graph", f"onnx_zoo/{name}", partial(zoo_outputs, name=name, precision=precision), precision,
                        workload="ir", ops=zoo_ops(name))


