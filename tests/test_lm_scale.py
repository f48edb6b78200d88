"""The LM track at accelerator scale (issue 39), the parts no backend owns: the official sizing by
the analytic count, the trial's stream of text, the memory estimate and the candidate filter."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from aiperf_core import workloads
from aiperf_core.builders import gpt
from aiperf_core.data.text_corpus import TokenData, embedded_corpus
from aiperf_core.data.text_stream import SeededPermutation, TokenStream
from aiperf_core.policy import Policy
from aiperf_core.workflow.plan import EMBEDDED_LM_DEFAULTS, build_policy, RunRequest
from aiperf_opcount import count
from aiperf_opcount.memory import MEMORY_HEADROOM, estimate, plan_memory

NODE_ACCELERATORS = 8
TERA = 10 ** 12


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


# -- the official sizing ------------------------------------------------------------------------------


def _official_seed(policy: Policy):
    return workloads.get("lm").seed.build(policy, embedded_corpus())


def test_one_official_step_gives_each_device_of_an_eight_accelerator_node_a_teraflop():
    policy = Policy({"workload": "lm"})
    seed = _official_seed(policy)
    heads = next(n for n in seed.nodes if n.op == "attention")
    assert (policy["seq_len"], policy["initial_architecture"]) == (1024, "gpt2_small")
    assert sum(n.op == "attention" for n in seed.nodes) >= 12 and seed.shapes[heads.id][-1] >= 768
    assert heads.attrs["head_dim"] == 64
    per_sequence = count(seed).total  # FP + BP, the paper convention
    for batch in (policy["batch_size"], policy["hpo_batch_size_bounds"][0]):
        assert per_sequence * batch / NODE_ACCELERATORS >= TERA, batch
    # ... and the default global batch fits an 80 GB accelerator without accumulation at bf16.
    shard = -(-policy["batch_size"] // NODE_ACCELERATORS)
    assert plan_memory(seed, shard, 80 * 10 ** 9, "bf16", "adamw").micro_batch == shard


def test_the_embedded_corpus_keeps_a_cpu_sized_unofficial_default():
    values = build_policy(RunRequest(workload="lm"), "embedded")
    policy = Policy(values)
    assert {k: policy[k] for k in EMBEDDED_LM_DEFAULTS} == EMBEDDED_LM_DEFAULTS
    assert set(policy.overridden_fixed()) == {"dataset", "seq_len", "initial_architecture", "epoch_tokens", "val_tokens",
                                              "max_bits_per_byte"}
    assert count(_official_seed(policy)).total < count(_official_seed(Policy({"workload": "lm"}))).total / 1000


# -- fresh text every epoch ----------------------------------------------------------------------------


def test_a_seeded_permutation_is_a_bijection_at_any_size():
    for n in (1, 2, 3, 17, 1000, 4097):
        order = SeededPermutation(n, (5, 0))(np.arange(n))
        assert sorted(order.tolist()) == list(range(n))
    assert not np.array_equal(SeededPermutation(1000, (5, 0))(np.arange(1000)), np.arange(1000))
    assert not np.array_equal(SeededPermutation(1000, (5, 0))(np.arange(1000)),
                              SeededPermutation(1000, (6, 0))(np.arange(1000)))


def _epoch_offsets(stream: TokenStream, epoch: int, seed: int, batch: int = 16) -> np.ndarray:
    return np.concatenate(list(stream.plan("train", epoch, seed, batch)))


def test_no_window_repeats_within_a_trial_until_the_split_is_used_up(corpus):
    stream = TokenStream(corpus, 128, epoch_tokens=16_384, val_tokens=16_384)
    epochs_per_pass = stream.pass_windows // stream.epoch_windows
    assert epochs_per_pass >= 20  # the embedded corpus: 25 epochs of new text before any repeats
    seen = np.concatenate([_epoch_offsets(stream, e, seed=3) for e in range(epochs_per_pass)])
    assert len(np.unique(seen)) == len(seen) == epochs_per_pass * stream.epoch_windows
    # Windows never overlap within a pass: one phase, every offset a window apart from the others.
    assert len(np.unique(seen % 128)) == 1
    # Past the end of a pass the next one reads other windows: a new phase and a new order.
    later = _epoch_offsets(stream, epochs_per_pass + 1, seed=3)
    assert len(np.unique(later % 128)) == 1 and (later % 128)[0] != (seen % 128)[0]
    # Every window and its next byte lie inside the training split.
    assert seen.min() >= 0 and seen.max() + 128 + 1 <= len(corpus.train)


def test_the_windows_are_a_function_of_trial_seed_and_epoch_alone(corpus):
    """What a trial restarted after SIGKILL relies on: the same seed and epoch read the same
    windows, whatever was read before and in whatever process (the stream pickles to a rank)."""
    import pickle

    stream = TokenStream(corpus, 64, epoch_tokens=4096, val_tokens=4096)
    first = _epoch_offsets(stream, 5, seed=11)
    fresh = pickle.loads(pickle.dumps(TokenStream(corpus, 64, epoch_tokens=4096, val_tokens=4096)))
    assert np.array_equal(_epoch_offsets(fresh, 5, seed=11), first)
    assert not np.array_equal(_epoch_offsets(stream, 6, seed=11), first)
    assert not np.array_equal(_epoch_offsets(stream, 5, seed=12), first)
    x, y, skipped, _ = stream.load("train", first[:4])
    assert skipped == 0 and x.shape == y.shape == (4, 64) and x.dtype == np.int32
    assert np.array_equal(x[:, 1:], y[:, :-1])
    assert np.array_equal(x[0], np.asarray(corpus.train[first[0]:first[0] + 64]))


def test_validation_stays_a_fixed_prefix_for_every_trial(corpus):
    a, b = (TokenStream(corpus, 32, epoch_tokens=1024, val_tokens=2048) for _ in range(2))
    va = np.concatenate([batch.x for batch in a.iterate("val", 0, 0, 7)])
    vb = np.concatenate([batch.x for batch in b.iterate("val", 3, 99, 16)])
    assert np.array_equal(va, vb) and va.shape == (64, 32)
    assert np.array_equal(va.reshape(-1), np.asarray(corpus.val[:2048]))


def test_a_replicas_text_memory_is_bounded_by_the_batch_not_the_epoch():
    """Streaming an epoch 64 times larger holds no more memory: only a batch is ever materialised.
    A large split (as enwik8's 90 MB is) is not copied either: it stays where it is (a memory map)."""
    total = 8_000_000
    text = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    corpus = TokenData("big", text[:int(total * 0.9)], text[int(total * 0.9):int(total * 0.95)],
                       text[int(total * 0.95):], digest="x", official=False)

    def peak(epoch_tokens: int) -> int:
        stream = TokenStream(corpus, 256, epoch_tokens=epoch_tokens, val_tokens=4096)
        tracemalloc.start()
        try:
            windows = sum(len(batch.x) for batch in stream.iterate("train", 1, 7, batch_size=8))
            return tracemalloc.get_traced_memory()[1], windows
        finally:
            tracemalloc.stop()

    small, small_windows = peak(256 * 64)
    large, large_windows = peak(256 * 64 * 64)
    assert (small_windows, large_windows) == (64, 4096)
    batch_bytes = 8 * 257 * 8  # one batch of int64 offsets-by-position indices, the largest array built
    assert large < 4 * max(small, batch_bytes) and large < 1_000_000, (small, large)


def test_a_token_stream_is_checked_against_the_graph(corpus):
    from aiperf_core.backend import check_dataset
    from aiperf_core.errors import AiperfError

    stream = TokenStream(corpus, 32, epoch_tokens=1024, val_tokens=1024)
    check_dataset(gpt(layers=1, hidden=16, heads=2, seq_len=32, vocab=256), stream)
    with pytest.raises(AiperfError, match="streams windows of 32 tokens, the graph reads \\[16\\]"):
        check_dataset(gpt(layers=1, hidden=16, heads=2, seq_len=16, vocab=256), stream)
    with pytest.raises(AiperfError, match="validation split .* is shorter than one window"):
        TokenStream(corpus, 4096, epoch_tokens=4096, val_tokens=10)


# -- the memory to grow --------------------------------------------------------------------------------


def test_the_estimate_adds_up_and_checkpointing_keeps_one_block():
    graph = gpt(layers=6, hidden=64, heads=4, seq_len=128, vocab=256)
    params = graph.num_params()
    plain = estimate(graph, 8, "fp32", "adamw")
    assert (plain.parameters, plain.gradients, plain.optimizer_state) == (4 * params, 4 * params, 8 * params)
    assert plain.total == plain.parameters + plain.gradients + plain.optimizer_state + plain.activations
    assert estimate(graph, 16, "fp32", "adamw").activations == 2 * plain.activations
    assert estimate(graph, 8, "fp32", "sgd-momentum").optimizer_state == 4 * params
    mixed = estimate(graph, 8, "bf16", "adamw")
    assert mixed.parameters == 6 * params and mixed.activations < plain.activations
    checkpointed = estimate(graph, 8, "fp32", "adamw", checkpoint_blocks=True)
    assert checkpointed.checkpoint_blocks and checkpointed.activations < plain.activations / 2
    deeper = estimate(gpt(layers=12, hidden=64, heads=4, seq_len=128, vocab=256), 8, "fp32", "adamw", True)
    # Checkpointed, a deeper model adds one block input a block, not a block's activations.
    assert deeper.activations - checkpointed.activations == 6 * 8 * 128 * 64 * 4


def test_the_plan_accumulates_then_checkpoints_only_where_the_device_needs_it():
    graph = gpt(layers=4, hidden=64, heads=4, seq_len=256, vocab=256)
    roomy = plan_memory(graph, 32, 10 ** 10)
    assert (roomy.micro_batch, roomy.checkpoint_blocks) == (32, False)
    whole = estimate(graph, 32).total
    tight = plan_memory(graph, 32, int(whole / MEMORY_HEADROOM / 3))
    assert 1 <= tight.micro_batch < 32 and not tight.checkpoint_blocks
    assert estimate(graph, tight.micro_batch + 1).total > tight.budget * MEMORY_HEADROOM
    one = estimate(graph, 1).total
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
    assert set(memory) >= {"parameters", "gradients", "optimizer_state", "activations", "total"}
