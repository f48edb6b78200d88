"""Level 'train': a step lowers the loss, gradients match the reference, weights round-trip
exactly, and a short run of the small ResNet learns the digits dataset (and times its steps); a
GPT step on next-token labels lowers the loss and its gradients match the reference, for the GPT and
for it with its first MLP upcycled to a mixture of experts (`gpt_moe_*`, whose AdamW steps under the
load-balancing loss match the reference's too); at every precision the backend declares on the device
under test. The experts' load a backend reports is the reference's routing (fp32). The accuracy goal is
the same at every precision: a mixed precision that cannot learn digits is not one a scored run may use."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import numpy as np

from aiperf_core.backend import Dataset, Schedule, TrainConfig
from aiperf_core.builders import gpt, llama, resnet_small
from aiperf_core.morph.transformer import upcycle_moe
from aiperf_conformance.cases import trained_looking_weights
from aiperf_core.ir import is_trainable
from aiperf_core.optim import HostOptimizer, grad_norm
from aiperf_conformance.kit import Check, Context, Outcome, new_ops, normwise_error, reference
from aiperf_conformance.levels.op import compare_grads, key_biases

# The digits run: enough for the small ResNet to pass 90% with plain SGD on every backend.
DIGITS_GOAL = 0.90  # best validation accuracy; a goal, not a tolerance: no expectations file moves it
# 16 px, a quarter of the run's 32 px: every first-party backend passed 90% in 3 or 4 epochs there (4
# to 6 at 32 px), each epoch 2.5 to 4 times cheaper. The goal is the same; the work per step shrinks.
DIGITS_SIZE, DIGITS_EPOCHS = 16, 8
# --quick: the scans' own 8x8 pixels, 4x fewer than 16 px; numpy and torch reach 90% in 6 or 7 epochs.
QUICK_DIGITS_SIZE, QUICK_DIGITS_EPOCHS = 8, 10
DIGITS_BATCH = 32
DIGITS_LR = 0.05


def _small(ctx: Context, size: int = 16, classes: int = 5):
    graph = resnet_small((size, size, 3), classes)
    return graph, trained_looking_weights(graph, ctx.seed)


def step_lowers_loss(ctx: Context, precision: str) -> Outcome:
    graph, weights = _small(ctx)
    rng = ctx.rng(11)
    x = rng.normal(0, 1, (16,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 16)
    model = ctx.backend.lower(graph, weights, precision=precision)
    before, _ = ctx.backend.loss_and_grads(model, x, y)
    data = Dataset(x, y, x, y, 5)
    config = TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.01), seed=ctx.seed,
                         precision=precision)
    ctx.backend.train(model, data, config)
    after, _ = ctx.backend.loss_and_grads(model, x, y)
    return Outcome(bool(after < before), after, f"< {before}", None,
                   f"training-mode loss on the fixed batch went from {before:.5f} to {after:.5f}")


def gradients(ctx: Context, precision: str) -> Outcome:
    graph, weights = _small(ctx)
    rng = ctx.rng(12)
    x = rng.normal(0, 1, (4,) + graph.input_shape).astype(np.float32)
    y = rng.integers(0, 5, 4)
    ref_loss, ref_grads, _ = reference().loss_and_grads(graph, weights, x, y, label_smoothing=0.1, dtype=np.float64)
    model = ctx.backend.lower(graph, weights, precision=precision)
    loss, grads = ctx.backend.loss_and_grads(model, x, y, label_smoothing=0.1)
    # Normwise per tensor: the small ResNet's gradients are ill-conditioned in the max norm (the
    # batch-norm backwards cancel; condition ~100-500, see conformance/defaults.json), so that the
    # max-abs error of a mixed precision would be noise on a few entries; the 2-norm averages it.
    return compare_grads(loss, grads, ref_loss, ref_grads, ctx.tolerance("train_grad", precision), normwise=True)


def weights_round_trip(ctx: Context, precision: str) -> Outcome:
    graph, weights = _small(ctx)
    model = ctx.backend.lower(graph, weights, precision=precision)
    exported = ctx.backend.export_weights(model)
    for node_id, params in weights.items():
        for name, value in params.items():
            got = exported.get(node_id, {}).get(name)
            if got is None or got.shape != value.shape or not np.array_equal(got.astype(np.float32), value):
                return Outcome(False, "differs", "bitwise equal", 0,
                               f"node '{node_id}': weight '{name}' did not round-trip exactly")
    other = trained_looking_weights(graph, ctx.seed + 1)
    ctx.backend.import_weights(model, other)
    exported = ctx.backend.export_weights(model)
    same = all(np.array_equal(exported[n][p].astype(np.float32), other[n][p]) for n in other for p in other[n])
    return Outcome(same, same, True, 0, "import then export returns the same arrays bit for bit")


def digits_accuracy(ctx: Context, precision: str) -> Outcome:
    from aiperf_core.data.digits import load_digits

    size, epochs = (QUICK_DIGITS_SIZE, QUICK_DIGITS_EPOCHS) if ctx.quick else (DIGITS_SIZE, DIGITS_EPOCHS)
    data = load_digits(size)
    graph = resnet_small((size, size, 3), data.classes)
    model = ctx.backend.lower(graph, precision=precision)
    config = TrainConfig(epochs=epochs, batch_size=DIGITS_BATCH, schedule=Schedule(initial=DIGITS_LR),
                         seed=ctx.seed, precision=precision)
    goal = DIGITS_GOAL
    ends = [time.perf_counter()]

    def on_epoch(report) -> bool:
        ends.append(time.perf_counter())
        # Stop as soon as the goal is reached: the check is about learning, not about the time budget.
        return report.val_accuracy >= goal

    reports = ctx.backend.train(model, data, config, on_epoch=on_epoch)
    stopped_early = bool(reports) and reports[-1].val_accuracy >= goal
    if not reports or (len(reports) != epochs and not stopped_early) or len(reports) > epochs:
        return Outcome(False, len(reports), epochs, None, f"{len(reports)} epoch reports for {epochs} epochs")
    counted = [r.train_images for r in reports]
    if any(c != len(data.y_train) for c in counted):
        return Outcome(False, counted, len(data.y_train), 0, "images processed per epoch miscounted")
    walls = np.diff(ends)
    for r, wall in zip(reports, walls):  # the replica's busy fraction is built from step_seconds
        if r.step_seconds is None or not 0 < r.step_seconds <= wall:
            return Outcome(False, r.step_seconds, f"in (0, {wall:.3f}]", None,
                           f"epoch {r.epoch}: step_seconds must be measured (StepClock), positive and within "
                           f"the epoch's wall time")
        if r.compile_seconds is not None and not 0 <= r.compile_seconds <= r.step_seconds:
            return Outcome(False, r.compile_seconds, f"in [0, {r.step_seconds:.3f}]", None,
                           f"epoch {r.epoch}: compile_seconds must lie within step_seconds (it is included "
                           f"in it), or be None when not measured")
    best = max(r.val_accuracy for r in reports)
    return Outcome(best >= goal, best, goal, None,
                   f"best validation accuracy {best:.3f} after {len(reports)} of at most {epochs} epochs at {size} px "
                   f"(goal {goal:.2f}); {sum(r.step_seconds for r in reports) / sum(walls):.3f} of the time "
                   f"in steps")


# The GPT checks (the LM workload): a 2-layer GPT on token ids whose labels are the next tokens.
GPT_SIZES = dict(layers=2, hidden=32, heads=4, seq_len=16, vocab=64)
# Llama's family at the same size: 2 query heads per key-value head, a SwiGLU MLP of 48.
LLAMA_SIZES = dict(GPT_SIZES, kv_heads=2, ffn=48)
MODELS = ("gpt", "gpt_moe", "llama")


def _gpt(model: str = "gpt"):
    """The model a transformer check trains: the GPT, the GPT with its first block's MLP upcycled to 4
    experts, 2 per token ('gpt_moe'), or the Llama ('llama')."""
    if model == "llama":
        return llama(**LLAMA_SIZES)
    graph = gpt(**GPT_SIZES)
    return upcycle_moe(graph, None, "h0_fc1", seed=5).graph if model == "gpt_moe" else graph


def _gpt_batch(ctx: Context, salt: int, n: int, model: str = "gpt"):
    graph = _gpt(model)
    tokens = ctx.rng(salt).integers(0, graph.vocab, (n, graph.input_shape[0] + 1))
    return graph, trained_looking_weights(graph, ctx.seed), tokens[:, :-1], tokens[:, 1:]


def gpt_step_lowers_loss(ctx: Context, precision: str, model: str = "gpt") -> Outcome:
    graph, weights, x, y = _gpt_batch(ctx, 21, 16, model)
    model = ctx.backend.lower(graph, weights, precision=precision)
    before, _ = ctx.backend.loss_and_grads(model, x, y)
    config = TrainConfig(epochs=1, batch_size=16, schedule=Schedule(initial=0.05), seed=ctx.seed,
                         precision=precision)
    reports = ctx.backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    after, _ = ctx.backend.loss_and_grads(model, x, y)
    if not reports or reports[0].train_images != len(x):
        return Outcome(False, reports[0].train_images if reports else None, len(x), 0,
                       "train() must report the sequences it trained on")
    return Outcome(bool(after < before), after, f"< {before}", None,
                   f"{graph.name} training-mode loss (mean over every position) on the fixed batch went from "
                   f"{before:.5f} to {after:.5f}")


def gpt_gradients(ctx: Context, precision: str, model: str = "gpt") -> Outcome:
    graph, weights, x, y = _gpt_batch(ctx, 22, 4, model)
    ref_loss, ref_grads, _ = reference().loss_and_grads(graph, weights, x, y, label_smoothing=0.1, dtype=np.float64)
    model = ctx.backend.lower(graph, weights, precision=precision)
    loss, grads = ctx.backend.loss_and_grads(model, x, y, label_smoothing=0.1)
    return compare_grads(loss, grads, ref_loss, ref_grads, ctx.tolerance("train_grad", precision), normwise=True,
                         zero_in_exact=key_biases(graph))


# The optimizer checks: a few steps on one fixed batch (the whole batch in one step, so that no
# shuffle order matters), weights compared with the float64 reference applying aiperf_core.optim.
OPTIMIZER_STEPS = 3


def _optimizer_config(ctx: Context, precision: str, optimizer: str, batch: int, grad_clip: float | None):
    if optimizer == "adamw":  # warm-up, cosine decay, decay and the clip: every part of the LM policy's step
        schedule = Schedule(initial=0.01, final_fraction=0.1, warmup_epochs=1, shape="cosine")
        return TrainConfig(epochs=OPTIMIZER_STEPS, batch_size=batch, schedule=schedule, optimizer="adamw",
                           betas=(0.9, 0.95), weight_decay=0.1, grad_clip=grad_clip, seed=ctx.seed,
                           precision=precision)
    return TrainConfig(epochs=OPTIMIZER_STEPS, batch_size=batch, schedule=Schedule(initial=0.05), momentum=0.9,
                       grad_clip=grad_clip, seed=ctx.seed, precision=precision)


def optimizer_matches_reference(ctx: Context, precision: str, optimizer: str, micro_batch: int | None = None,
                                checkpoint_blocks: bool = False, model: str = "gpt",
                                moe_aux_loss: float = 0.0) -> Outcome:
    """train() over OPTIMIZER_STEPS epochs of one batch against the reference's steps. The error is
    normwise per tensor on the weights' change (the update, not the weights it is added to). The
    attention key biases are left out: their exact gradient is zero (compare_grads), so that AdamW,
    which divides a gradient by its own size, turns the backend's rounding into steps of up to lr.
    Both optimizers run under a gradient clip at half the first step's gradient norm; `sgd-clip`,
    SGD with momentum, is there because AdamW is nearly blind to a clip that scales every step
    alike. With `micro_batch` (gradient accumulation: the batch of 8 as micro-batches of 3, 3 and 2)
    or `checkpoint_blocks` (activation checkpointing) the backend's steps must still be the
    reference's on the whole batch: neither may change what a step computes. `model` is one of MODELS;
    `moe_aux_loss` (TrainConfig.moe_aux_loss) adds each moe's load-balancing loss on both sides."""
    graph, weights, x, y = _gpt_batch(ctx, 23, 8, model)
    ref = reference()
    exact = {n: {p: np.asarray(a, np.float64) for p, a in ps.items()} for n, ps in weights.items()}
    _, first, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64, moe_aux_loss=moe_aux_loss)
    grad_clip = 0.5 * grad_norm(first)
    config = _optimizer_config(ctx, precision, "adamw" if optimizer == "adamw" else "sgd-momentum", len(x),
                               grad_clip)
    stepper = HostOptimizer(config, exact, is_trainable)
    config = replace(config, micro_batch=micro_batch, checkpoint_blocks=checkpoint_blocks, moe_aux_loss=moe_aux_loss)
    for epoch in range(OPTIMIZER_STEPS):
        _, grads, _ = ref.loss_and_grads(graph, exact, x, y, dtype=np.float64, moe_aux_loss=moe_aux_loss)
        stepper.step(exact, grads, config.schedule.rate(epoch, config.epochs))
    model = ctx.backend.lower(graph, weights, precision=precision)
    reports = ctx.backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    if len(reports) != OPTIMIZER_STEPS:
        return Outcome(False, len(reports), OPTIMIZER_STEPS, 0, f"{len(reports)} epoch reports for "
                       f"{OPTIMIZER_STEPS} epochs of one step each")
    trained = ctx.backend.export_weights(model)
    tol = ctx.tolerance("optimizer", precision)
    skipped = key_biases(graph)
    worst = Outcome(True, 0.0, tol, tol, "")
    for node_id, params in exact.items():
        for name, value in params.items():
            if not is_trainable(name) or (node_id, name) in skipped:
                continue
            start = np.asarray(weights[node_id][name], np.float64)
            error = normwise_error(np.asarray(trained[node_id][name], np.float64) - start, value - start)
            if error > tol or not np.isfinite(error):
                return Outcome(False, error, tol, tol, f"node '{node_id}' parameter '{name}': its change after "
                               f"{OPTIMIZER_STEPS} {optimizer} steps differs from the reference's by {error:.3g} "
                               f"(normwise)")
            if error > worst.measured:
                worst = Outcome(True, error, tol, tol, f"worst tensor {node_id}.{name}: {error:.3g} normwise on the "
                                f"change of {OPTIMIZER_STEPS} {optimizer} steps")
    return worst


ACCUMULATION_MICRO_BATCH = 3  # of the optimizer checks' batch of 8: micro-batches of 3, 3 and 2
# The load-balancing loss's coefficient in the kit: ten times the lm policy's 0.01, so that its gradient
# is a visible part of the router's.
KIT_MOE_AUX_LOSS = 0.1


def gpt_moe_expert_load(ctx: Context, precision: str) -> Outcome:
    """One epoch of one step on a fixed batch of the upcycled GPT: EpochReport.expert_load must be, per moe
    node, the (token, choice) assignments of the reference's routing of that batch on the initial weights
    (exact counts: the forward pass that trained routed them)."""
    graph, weights, x, y = _gpt_batch(ctx, 24, 8, "gpt_moe")
    want = {nid: list(counts) for nid, counts in reference().expert_load(graph, weights, x).items()}
    model = ctx.backend.lower(graph, weights, precision=precision)
    config = TrainConfig(epochs=1, batch_size=len(x), schedule=Schedule(initial=0.01), seed=ctx.seed,
                         precision=precision)
    reports = ctx.backend.train(model, Dataset(x, y, x, y, graph.vocab), config)
    if len(reports) != 1:
        return Outcome(False, len(reports), 1, 0, f"{len(reports)} epoch reports for 1 epoch")
    if reports[0].expert_load is None:
        return Outcome(False, None, want, 0, "EpochReport.expert_load is None for a graph with a moe")
    got = {nid: [int(c) for c in counts] for nid, counts in reports[0].expert_load.items()}
    return Outcome(got == want, got, want, 0, f"tokens x top_k per expert of the step on {len(x)} sequences: "
                   f"{got} (the reference's: {want})")


def gpt_token_stream(ctx: Context, precision: str) -> Outcome:
    """train() on streamed text (a TokenStream over the embedded corpus, new windows every epoch):
    each epoch reports the stream's sequences and the validation prefix's, and the validation loss
    falls from the first epoch to the last."""
    from aiperf_core.data.text_corpus import embedded_corpus
    from aiperf_core.data.text_stream import TokenStream

    sizes = dict(GPT_SIZES, vocab=256)
    graph = gpt(**sizes)
    stream = TokenStream(embedded_corpus(), sizes["seq_len"], epoch_tokens=64 * sizes["seq_len"],
                         val_tokens=32 * sizes["seq_len"])
    config = TrainConfig(epochs=3, batch_size=16, schedule=Schedule(initial=0.01, final_fraction=0.1, shape="cosine"),
                         optimizer="adamw", weight_decay=0.1, seed=ctx.seed, precision=precision)
    model = ctx.backend.lower(graph, trained_looking_weights(graph, ctx.seed), precision=precision)
    reports = ctx.backend.train(model, stream, config)
    counts = [(r.train_images, r.val_images) for r in reports]
    want = [(stream.train_images, stream.val_images)] * config.epochs
    if counts != want:
        return Outcome(False, counts, want, None, "train() on a TokenStream must report its sequences per epoch")
    first, last = reports[0].val_loss, reports[-1].val_loss
    return Outcome(bool(last < first), last, f"< {first}", None,
                   f"validation loss on the embedded corpus went from {first:.4f} to {last:.4f} over "
                   f"{config.epochs} epochs of new windows")


def checks(ctx: Context):
    lm = dict(workload="lm", ops=new_ops(_gpt()))
    for precision in ctx.precisions:
        for name, run in (("step_lowers_loss", step_lowers_loss), ("gradients_match_reference", gradients),
                          ("weights_round_trip", weights_round_trip), ("digits_accuracy", digits_accuracy)):
            yield Check("train", name, partial(run, precision=precision), precision)
        for name, run in (("gpt_step_lowers_loss", gpt_step_lowers_loss),
                          ("gpt_gradients_match_reference", gpt_gradients)):
            for model in MODELS:
                yield Check("train", name.replace("gpt_", f"{model}_"), partial(run, precision=precision, model=model),
                            precision, workload="lm", ops=new_ops(_gpt(model)))
        for optimizer in ("adamw", "sgd-clip"):
            yield Check("train", f"gpt_{optimizer.replace('-', '_')}_matches_reference",
                        partial(optimizer_matches_reference, precision=precision, optimizer=optimizer), precision, **lm)
        yield Check("train", "gpt_accumulation_matches_reference",
                    partial(optimizer_matches_reference, precision=precision, optimizer="adamw",
                            micro_batch=ACCUMULATION_MICRO_BATCH), precision, **lm)
        yield Check("train", "gpt_checkpointing_matches_reference",
                    partial(optimizer_matches_reference, precision=precision, optimizer="adamw",
                            checkpoint_blocks=True), precision, **lm)
        yield Check("train", "gpt_token_stream", partial(gpt_token_stream, precision=precision), precision, **lm)
    # Both MoE checks run at fp32 only. Routing is discontinuous: at bf16 a few of the batch's 128 tokens
    # choose another expert within three steps (torch: 3, where the narrowest margin between a token's
    # second and third logit is 0.004 and the moe input's bf16 error 0.6%), whatever the loss, so a
    # reduced precision would test the batch's margins, not the loss's arithmetic or the counts'
    # bookkeeping; train/gpt_moe_gradients_match_reference covers the MoE's reduced-precision gradients.
    if "fp32" in ctx.precisions:
        moe = dict(workload="lm", ops=new_ops(_gpt("gpt_moe")))
        yield Check("train", "gpt_moe_aux_loss_matches_reference",
                    partial(optimizer_matches_reference, precision="fp32", optimizer="adamw", model="gpt_moe",
                            moe_aux_loss=KIT_MOE_AUX_LOSS), "fp32", **moe)
        yield Check("train", "gpt_moe_expert_load", partial(gpt_moe_expert_load, precision="fp32"), "fp32", **moe)
