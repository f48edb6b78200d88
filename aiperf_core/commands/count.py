"""aiperf count MODEL: the analytic FP/BP operation count, per layer and in total."""

from __future__ import annotations

import json

from aiperf_core.commands.options import (add_gpt_size_arguments, add_model_arguments, gpt_sizes, non_negative_int,
                                          positive_int)
from aiperf_opcount.memory import OPTIMIZER_STATE_BYTES, PRECISIONS
from aiperf_core.models import load_model

HELP = ("count the analytic operations of a model (builder name, IR .json or .onnx), per image (per sequence "
        "for a gpt) and per epoch")

# Table 3's rows, in its order, from IR ops.
_TABLE3_ROWS = (
    ("Convolutional", "conv2d"),
    ("Dense", "dense"),
    ("Batch normalization", "batch_norm"),
    ("ReLU", "relu"),
    ("Max-pooling", "max_pool"),
    ("Average-pooling", "global_avg_pool"),
    ("Add", "add"),
    ("Softmax", "softmax"),
)


def add_arguments(p) -> None:
    add_model_arguments(p, "builder name (resnet50, resnet_small, gpt), IR .json or .onnx file")
    add_gpt_size_arguments(p)
    p.add_argument("--train-images", type=non_negative_int, default=None, metavar="N",
                   help="training images per epoch, for the per-epoch figure")
    p.add_argument("--val-images", type=non_negative_int, default=None, metavar="M",
                   help="validation images per epoch, for the per-epoch figure")
    p.add_argument("--convention", choices=("paper", "valid"), default="paper",
                   help="'paper' (scoring, padded taps counted) or 'valid' (padded taps left out, as XLA counts)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    memory = p.add_argument_group("memory", "the estimate of one device's training step (docs/search.md, \"Memory\")")
    memory.add_argument("--batch", type=positive_int, default=1, metavar="N",
                        help="samples one device takes through a step at once (default 1)")
    memory.add_argument("--precision", choices=PRECISIONS, default="fp32", help="training precision (default fp32)")
    memory.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default=None,
                        help="whose state is held (default: adamw for a sequence model, sgd-momentum for images)")
    memory.add_argument("--checkpoint-blocks", action="store_true",
                        help="with activation checkpointing: only each block's input is kept")


def run(args) -> int:
    from aiperf_opcount import count
    from aiperf_opcount.memory import estimate

    graph, _ = load_model(args.model, args.input, args.classes, **gpt_sizes(args))
    result = count(graph, args.convention)
    optimizer = args.optimizer or ("adamw" if graph.takes_tokens else "sgd-momentum")
    memory = estimate(graph, args.batch, args.precision, optimizer, args.checkpoint_blocks)
    epoch = args.train_images is not None or args.val_images is not None
    if args.json:
        out = result.to_dict(args.train_images, args.val_images) if epoch else result.to_dict()
        print(json.dumps({**out, "memory": memory.to_dict()}))
        return 0
    print(render(result, graph, args.train_images, args.val_images) if epoch else render(result, graph))
    print(render_memory(memory))
    return 0


def render_memory(memory) -> str:
    gib = 2.0 ** 30
    return (f"memory of one device's step, {memory.batch} at once, {memory.precision}, {memory.optimizer}"
            f"{', blocks checkpointed' if memory.checkpoint_blocks else ''}: {memory.total / gib:.3f} GiB, the larger "
            f"of the passes' {memory.passes / gib:.3f} and the update's {memory.update / gib:.3f} (parameters "
            f"{memory.parameters / gib:.3f}, gradients {memory.gradients / gib:.3f}, optimizer state "
            f"{memory.optimizer_state / gib:.3f}, activations {memory.activations / gib:.3f}, the update's "
            f"temporaries {memory.update_temporaries / gib:.3f})")


def sci(x: float) -> str:
    return f"{x:.2e}" if x else "0"


def ratio(bp: int, fp: int) -> str:
    if not fp:
        return "-"
    r = bp / fp
    # Table 3 prints BN's tiny ratio as 0.00003: one significant digit rather than a flat zero.
    return f"{r:.5f}" if 0 < r < 1e-3 else f"{r:.4f}"


def render(result, graph, train_images: int | None = None, val_images: int | None = None) -> str:
    unit = "sequence" if graph.takes_tokens else "image"
    lines = [f"{graph.name}: input {'x'.join(map(str, graph.input_shape))}, {len(graph)} nodes, "
             f"{graph.num_params():,} parameters, convention '{result.convention}' (ops per {unit})", ""]
    width = max(len(n.id) for n in result.nodes)
    lines.append(f"{'node':<{width}}  {'op':<15} {'output':>14} {'FP':>16} {'BP':>16}")
    for n in result.nodes:
        shape = "x".join(map(str, n.shape))
        lines.append(f"{n.id:<{width}}  {n.op:<15} {shape:>14} {n.fp:>16,} {n.bp:>16,}")
    lines += ["", f"{'layer (paper Table 3)':<22} {'FP':>10} {'BP':>10} {'BP/FP':>8} {'total':>10}"]
    by_op = result.by_op()
    shown = set()
    for label, op in _TABLE3_ROWS:
        if op in by_op:
            shown.add(op)
            row = by_op[op]
            lines.append(f"{label:<22} {sci(row['fp']):>10} {sci(row['bp']):>10} "
                         f"{ratio(row['bp'], row['fp']):>8} {sci(row['fp'] + row['bp']):>10}")
    for op, row in by_op.items():
        if op not in shown and op != "input" and (row["fp"] or row["bp"]):
            lines.append(f"{op:<22} {sci(row['fp']):>10} {sci(row['bp']):>10} "
                         f"{ratio(row['bp'], row['fp']):>8} {sci(row['fp'] + row['bp']):>10}")
    lines.append(f"{'Total':<22} {sci(result.fp):>10} {sci(result.bp):>10} "
                 f"{ratio(result.bp, result.fp):>8} {sci(result.total):>10}")
    lines.append(f"exact per {unit}: FP {result.fp:,}  BP {result.bp:,}  total {result.total:,}")
    if train_images is not None or val_images is not None:
        e = result.epoch(train_images or 0, val_images or 0)
        lines += ["", f"per epoch ({e.train_images:,} training, {e.val_images:,} validation images):",
                  f"  FP (training)   {sci(e.fp_train)}",
                  f"  BP (training)   {sci(e.bp_train)}",
                  f"  BP/FP training  {ratio(e.bp_train, e.fp_train)}",
                  f"  total training  {sci(e.fp_train + e.bp_train)}",
                  f"  FP (validation) {sci(e.fp_val)}",
                  f"  total           {sci(e.total)}"]
    return "\n".join(lines)
