"""aiperf morph MODEL: grow a model by function-preserving morphs and write the child's graph and weights.

The graph says which morphs apply: a CNN's (aiperf_core.morph.cnn: deeper, wider, skip, kernel) or, for a
graph of token sequences (a GPT's or a Llama's), a transformer's (aiperf_core.morph.transformer: deeper,
wider_mlp, more_heads, double_width, upcycle_moe)."""

from __future__ import annotations

import json
from pathlib import Path

from aiperf_core.commands.options import (add_gpt_size_arguments, add_model_arguments, gpt_sizes, non_negative_int,
                                          positive_int)
from aiperf_core.errors import AiperfError

HELP = "apply function-preserving morphs (a CNN's or a transformer's) to a model and write the child"
CNN_OPS = ("deeper", "wider", "skip", "kernel")
TRANSFORMER_OPS = ("deeper", "wider_mlp", "more_heads", "double_width", "upcycle_moe")
# The record argument --node fills for each transformer op (double_width takes none): the residual-stream node
# for deeper (h0_res2, positions, a Llama's embed), the MLP's opening dense for wider_mlp and upcycle_moe (a GPT's
# h0_fc1, a Llama's h0_gate), the attention for more_heads (h0_attn).
TRANSFORMER_TARGETS = {"deeper": "after", "wider_mlp": "fc1", "more_heads": "attention", "upcycle_moe": "fc1"}


def add_arguments(p) -> None:
    add_model_arguments(p, "builder name (resnet50, resnet_small, gpt, llama) or IR .json file")
    add_gpt_size_arguments(p)
    p.add_argument("--weights", metavar="W.npz", default=None,
                   help="the model's weights (default: He-initialised from --seed)")
    p.add_argument("--op", choices=tuple(dict.fromkeys(CNN_OPS + TRANSFORMER_OPS)) + ("random",), default="random",
                   help="the morph of every step; 'random' draws one per step (default). A CNN's: deeper, wider, "
                        "skip, kernel; a transformer's: deeper, wider_mlp, more_heads, double_width, upcycle_moe")
    p.add_argument("--node", metavar="ID", default=None,
                   help="target of every step: for a CNN the relu for deeper, the conv for wider and kernel, the "
                        "destination for skip; for a transformer the residual-stream node for deeper (an add, the "
                        "positions, a llama's embed), the MLP's first dense for wider_mlp and upcycle_moe (a gpt's "
                        "h0_fc1, a llama's h0_gate), the attention for more_heads (default: a random valid one)")
    p.add_argument("--src", metavar="ID", default=None, help="source of the skip connection (with --op skip --node)")
    p.add_argument("--steps", type=positive_int, default=1, metavar="N", help="number of morphs (default 1)")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="S",
                   help="seed of the random choices and of initial weights (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for graph.json and weights.npz")
    p.add_argument("--max-nodes", type=positive_int, default=None, metavar="N", help="cap on the child's node count")
    p.add_argument("--max-params", type=positive_int, default=None, metavar="N",
                   help="cap on the child's trainable parameters")
    p.add_argument("--max-ops", type=positive_int, default=None, metavar="N",
                   help="cap on the child's training ops per image (FP + BP, paper convention)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_targets(args, transformer: bool) -> None:
    family, ops = ("a transformer", TRANSFORMER_OPS) if transformer else ("a CNN", CNN_OPS)
    if args.op != "random" and args.op not in ops:
        raise AiperfError(f"--op {args.op} is not a morph of {family} (its morphs: {', '.join(ops)})")
    if args.node is None and args.src is None:
        return
    if args.op == "random":
        raise AiperfError("--node and --src need a specific --op, not random")
    if args.op == "skip" and (args.node is None or args.src is None):
        raise AiperfError("--op skip with a fixed target needs both --src and --node (the destination)")
    if args.op != "skip" and args.src is not None:
        raise AiperfError("--src applies to --op skip only")
    if args.op == "double_width" and args.node is not None:
        raise AiperfError("--op double_width takes no --node: it doubles the whole model")


def _transformer_step(graph, weights, args, rng, caps):
    from aiperf_core.morph import signature_hash, transformer

    if args.node is None:
        ops = transformer.OPERATORS if args.op == "random" else (args.op,)
        return transformer.random_morph(graph, weights, rng, ops, caps=caps)
    seed = int(rng.integers(2**31))
    record = {"op": args.op, "args": {TRANSFORMER_TARGETS[args.op]: args.node, "seed": seed},
              "parent": signature_hash(graph)}
    return transformer.replay(graph, weights, record, caps=caps)


def _step(graph, weights, args, rng, caps):
    from aiperf_core.morph import cnn

    if graph.takes_tokens:
        return _transformer_step(graph, weights, args, rng, caps)
    if args.node is None:
        ops = cnn.OPERATORS if args.op == "random" else (args.op,)
        return cnn.random_morph(graph, weights, rng, ops, caps=caps)
    if args.op == "deeper":
        return cnn.deeper(graph, weights, args.node, caps=caps)
    if args.op == "wider":
        return cnn.wider(graph, weights, args.node, rng=rng, caps=caps)
    if args.op == "kernel":
        return cnn.kernel(graph, weights, args.node, caps=caps)
    return cnn.skip(graph, weights, args.src, args.node, caps=caps)


def run(args) -> int:
    import numpy as np

    from aiperf_core.ir import save_graph
    from aiperf_core.models import load_model
    from aiperf_core.morph import MorphCaps
    from aiperf_core.weights import init_weights, save_weights, validate_weights
    from aiperf_opcount import count

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise AiperfError(f"{out}: exists and is not a folder")
    graph, weights = load_model(args.model, args.input, args.classes, args.weights, **gpt_sizes(args))
    _check_targets(args, graph.takes_tokens)
    unit = "sequence" if graph.takes_tokens else "image"
    if weights is None:
        weights = init_weights(graph, args.seed)
    caps = MorphCaps(args.max_nodes, args.max_params, args.max_ops)
    rng = np.random.default_rng(args.seed)

    start = count(graph)
    fp, bp = start.fp, start.bp
    summary = {"model": graph.name, "seed": args.seed,
               "start": {"nodes": len(graph), "params": graph.num_params(), "fp": fp, "bp": bp}, "steps": []}
    lines = [f"{graph.name}: {len(graph)} nodes, {graph.num_params():,} parameters, "
             f"FP {fp:,} BP {bp:,} per {unit}"]
    for step in range(1, args.steps + 1):
        result = _step(graph, weights, args, rng, caps)
        graph, weights, record = result.graph, result.weights, result.record
        fp, bp = fp + record["delta"]["fp"], bp + record["delta"]["bp"]
        entry = {"step": step, "op": record["op"], "args": record["args"], "delta": record["delta"],
                 "nodes": len(graph), "params": graph.num_params(), "fp": fp, "bp": bp}
        summary["steps"].append(entry)
        lines.append(f"step {step}: {record['op']} {_format_args(record['args'])}: "
                     f"FP {record['delta']['fp']:+,} BP {record['delta']['bp']:+,} -> "
                     f"{entry['nodes']} nodes, {entry['params']:,} parameters, FP {fp:,} BP {bp:,} per {unit}")

    validate_weights(graph, weights)
    graph_path, weights_path = out / "graph.json", out / "weights.npz"
    save_graph(graph, graph_path)
    save_weights(weights, weights_path)
    summary.update(graph=str(graph_path), weights=str(weights_path))
    if args.json:
        print(json.dumps(summary))
    else:
        lines.append(f"wrote {graph_path} and {weights_path}")
        print("\n".join(lines))
    return 0


def _format_args(args: dict) -> str:
    parts = []
    for key, value in args.items():
        if isinstance(value, list):
            value = f"<{len(value)} channels>" if key == "sources" else json.dumps(value)
        parts.append(f"{key}={value}")
    return " ".join(parts)
