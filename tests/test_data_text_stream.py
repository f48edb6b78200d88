"""The LM trial's stream of text (aiperf_core.data.text_stream): fresh windows every epoch, a function of
the trial's seed and the epoch alone, a fixed validation prefix, memory bounded by the batch, and the
stream checked against the graph."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from aiperf_core.builders import gpt
from aiperf_core.data.text_corpus import TokenData, embedded_corpus
from aiperf_core.data.text_stream import SeededPermutation, TokenStream


@pytest.fixture(scope="module")
def corpus():
    return embedded_corpus()


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
