"""The memory a step needs (aiperf_opcount.memory): the estimate adds up, its peak is the larger of
the passes and the update, the plan accumulates then checkpoints only where a device needs it, a child
over the device's memory is skipped as a cap skips one, and `aiperf count --json` carries the estimate.
The estimate against what torch allocates is tests/test_lm_gpu.py (on a GPU) and benchmarks/lm_memory.py."""

from __future__ import annotations

import json

from aiperf_core import workloads
from aiperf_core.builders import gpt
from aiperf_core.policy import Policy
from aiperf_opcount.memory import MEMORY_HEADROOM, estimate, plan_memory, smallest_step


def test_the_estimate_adds_up_and_checkpointing_keeps_one_block():
    graph = gpt(layers=6, hidden=64, heads=4, seq_len=128, vocab=256)
    params = graph.num_params()
    plain = estimate(graph, 8, "fp32", "adamw")
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (4 * params, 4 * params, 8 * params)
    assert estimate(graph, 16, "fp32", "adamw").activations == 2 * plain.activations
    assert estimate(graph, 8, "fp32", "sgd-momentum").optimizer_state == 4 * params
    mixed = estimate(graph, 8, "bf16", "adamw")
    assert mixed.parameters == 6 * params and mixed.activations < plain.activations
    checkpointed = estimate(graph, 8, "fp32", "adamw", checkpoint_blocks=True)
    assert checkpointed.checkpoint_blocks and checkpointed.activations < plain.activations / 2
    deeper = estimate(gpt(layers=12, hidden=64, heads=4, seq_len=128, vocab=256), 8, "fp32", "adamw", True)
    # Checkpointed, a deeper model adds one block input a block, not a block's activations.
    assert deeper.activations - checkpointed.activations == 6 * 8 * 128 * 64 * 4


def test_the_peak_is_the_larger_of_the_passes_and_the_update():
    graph = gpt(layers=4, hidden=64, heads=4, seq_len=128, vocab=256)
    params = graph.num_params()
    wide = estimate(graph, 16, "fp32", "adamw")
    # A step of one micro-batch has no gradients while its activations live: they are made as the
    # backward pass frees them, after the previous step's were freed.
    assert wide.passes == wide.parameters + wide.optimizer_state + wide.activations
    # foreach AdamW's float32 copy of the parameters while it updates; SGD's momentum updates in place
    assert wide.update_temporaries == 4 * params
    assert estimate(graph, 16, "fp32", "sgd-momentum").update_temporaries == 0
    assert wide.update == wide.parameters + wide.gradients + wide.optimizer_state + wide.update_temporaries
    assert wide.total == wide.passes > wide.update
    lean = estimate(graph, 1, "fp32", "adamw", checkpoint_blocks=True)
    assert lean.total == lean.update > lean.passes
    # Accumulating, the earlier micro-batches' gradients are held through the later passes.
    accumulating = estimate(graph, 16, "fp32", "adamw", accumulating=True)
    assert accumulating.passes == wide.passes + wide.gradients
    assert accumulating.update == wide.update and accumulating.total == accumulating.passes


# Short sequences under SGD: a step's gradients weigh more than its activations, so one sequence at a time
# (the earlier ones' gradients held through the passes) needs more than the shard whole.
SHORT = dict(layers=2, hidden=128, heads=4, seq_len=8, vocab=256)


def test_the_plan_takes_the_shard_whole_where_it_fits_though_accumulating_would_not():
    graph = gpt(**SHORT)
    whole = estimate(graph, 4, "fp32", "sgd-momentum")
    assert estimate(graph, 1, "fp32", "sgd-momentum", accumulating=True).total > whole.total
    plan = plan_memory(graph, 4, int(whole.total / MEMORY_HEADROOM) + 1, "fp32", "sgd-momentum",
                       checkpointing="never")
    assert plan.micro_batch == 4 and plan.estimate == whole


def test_the_candidate_filter_takes_the_smallest_step_the_policy_allows():
    # what the replica's candidate filter (Replica._memory_check) holds a child's step to
    graph = gpt(**SHORT)
    whole = estimate(graph, 4, "fp32", "sgd-momentum", checkpoint_blocks=True)
    one_at_a_time = estimate(graph, 1, "fp32", "sgd-momentum", checkpoint_blocks=True, accumulating=True)
    assert one_at_a_time.total > whole.total
    assert smallest_step(graph, 4, "fp32", "sgd-momentum") == whole
    assert smallest_step(graph, 4, "fp32", "sgd-momentum", micro_batch=1) == one_at_a_time
    assert smallest_step(graph, 4, "fp32", "sgd-momentum", checkpointing="never") == estimate(graph, 4, "fp32",
                                                                                            "sgd-momentum")
    # Where activations outweigh the gradients, one sequence at a time.
    long = gpt(layers=2, hidden=64, heads=2, seq_len=256, vocab=256)
    assert smallest_step(long, 8) == estimate(long, 1, checkpoint_blocks=True, accumulating=True)


def test_the_plan_accumulates_then_checkpoints_only_where_the_device_needs_it():
    graph = gpt(layers=4, hidden=64, heads=4, seq_len=256, vocab=256)
    roomy = plan_memory(graph, 32, 10 ** 10)
    assert (roomy.micro_batch, roomy.checkpoint_blocks) == (32, False)
    whole = estimate(graph, 32).total
    tight = plan_memory(graph, 32, int(whole / MEMORY_HEADROOM / 3))
    assert 1 <= tight.micro_batch < 32 and not tight.checkpoint_blocks
    assert estimate(graph, tight.micro_batch + 1, accumulating=True).total > tight.budget * MEMORY_HEADROOM
    one = estimate(graph, 1, accumulating=True).total
    squeezed = plan_memory(graph, 32, int(one / MEMORY_HEADROOM) - 1)
    assert squeezed.checkpoint_blocks and squeezed.micro_batch >= 1
    assert plan_memory(graph, 32, int(one / MEMORY_HEADROOM) - 1, checkpointing="never") is None
    assert plan_memory(graph, 32, 10 ** 10, micro_batch=4, checkpointing="always").micro_batch == 4
    assert plan_memory(graph, 32, None, micro_batch="auto").micro_batch == 32  # no budget known: whole


def test_a_child_over_the_device_memory_is_skipped_as_a_cap_skips_one():
    from aiperf_core.morph import MemoryCheck
    from aiperf_core.morph.transformer import transformer_size

    seed = gpt(layers=2, hidden=64, heads=2, seq_len=64, vocab=256)
    morphs = workloads.get("lm").morphs
    policy = Policy({"workload": "lm"})
    free = morphs.generate_candidates(seed, None, 12, 3, policy)
    assert any(r.record["op"] == "double_width" for r in free)
    # A device that holds the parent (and a little more) but never a doubled width.
    limit = estimate(seed, 1, checkpoint_blocks=True).total * 2
    skipped = []

    def needs(graph):
        total = estimate(graph, 1, checkpoint_blocks=True).total
        if total <= limit:
            return None
        skipped.append(total)
        return total

    kept = morphs.generate_candidates(seed, None, 12, 3, policy, MemoryCheck(needs, limit))
    assert kept and all(transformer_size(r.graph)["width"] == 64 for r in kept)
    assert skipped and all(total > limit for total in skipped)


def test_count_json_gains_the_memory_object(capsys):
    from aiperf_core.cli import main

    assert main(["count", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2", "--seq-len", "64",
                 "--vocab", "256", "--batch", "4", "--precision", "bf16", "--checkpoint-blocks", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    expected = estimate(gpt(layers=2, hidden=64, heads=2, seq_len=64, vocab=256), 4, "bf16", "adamw", True)
    assert memory == expected.to_dict()
    assert set(memory) >= {"parameters", "gradients", "optimizer_state", "activations", "update_temporaries",
                           "passes", "update", "total"}
