"""Streamed text: a trial's token batches cut from a byte-level corpus while it trains.

A trial reads its training windows as one seeded stream over the whole training split:

- The split is cut into `n` non-overlapping windows of `seq_len` bytes (and the byte after each),
  starting at a seeded phase in [0, seq_len). A *pass* visits every one of them once, in the order
  of a seeded pseudo-random permutation of [0, n); pass p has its own phase and permutation, both
  drawn from (trial seed, p), so a second pass reads windows that straddle the first one's.
- Epoch e of a trial reads stream positions [e * W, (e + 1) * W), W = epoch_tokens // seq_len: new
  text every epoch, and no window twice within a trial until the split is used up (a pass ends).
- Every window is a pure function of (trial seed, epoch, position): a trial restarted after a
  crash with the same seed reads the same windows, and no table of the epoch is ever stored.

The permutation is a balanced Feistel network on the next even power of two above n, walked
until it lands in [0, n) (cycle walking), so a window's offset is computed from its position
alone: a replica's memory for text is its batch, never its epoch or the split (a prepared corpus is
a memory map; only the windows of a batch are read from it).

Validation reads the first `val_tokens` bytes of the validation split as consecutive windows, the
same for every trial of every run on that corpus, so that bits per byte compare across them.

What a backend sees (the contract's streamed data, aiperf_core.backend.is_streaming): `plan`,
`load` and `iterate` as aiperf_core.data.stream.StreamingDataset has them, with windows' start
offsets as the indices and (x, y) int32 token ids of shape (n, seq_len), y the byte after each x.
Nothing is skipped: a byte always decodes.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from aiperf_core.data.batch import TRAIN, VAL, Batch, check_split, shard
from aiperf_core.errors import AiperfError

_FEISTEL_ROUNDS = 4
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a 64-bit hash, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (x ^ (x >> np.uint64(31))) & _MASK64


class SeededPermutation:
    """A pseudo-random bijection of [0, n) keyed by `key` (a tuple of ints), evaluated at any
    positions without a table: O(1) memory whatever n is."""

    def __init__(self, n: int, key: Sequence[int]):
        if n < 1:
            raise AiperfError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(2, int(self.n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._low = np.uint64((1 << (bits // 2)) - 1)
        self._keys = np.random.SeedSequence([int(k) for k in key]).generate_state(_FEISTEL_ROUNDS, np.uint64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._low
        for k in self._keys:
            left, right = right, left ^ (_mix(right ^ k) & self._low)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._encrypt(np.asarray(positions, dtype=np.uint64))
        outside = x >= self.n
        while outside.any():  # cycle walking: the domain is under 4n, so a few rounds at most
            x[outside] = self._encrypt(x[outside])
            outside = x >= self.n
        return x.astype(np.int64)


class _EpochPlan(Sequence):
    """The global batches of one epoch as window start offsets, each computed when asked for."""

    def __init__(self, offsets, first: int, count: int, batch_size: int):
        self._offsets, self._first, self._count, self._batch = offsets, first, count, batch_size

    def __len__(self) -> int:
        return -(-self._count // self._batch)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(k)
        start = k * self._batch
        stop = min(start + self._batch, self._count)
        return self._offsets(np.arange(self._first + start, self._first + stop, dtype=np.int64))


class TokenStream:
    """A corpus (aiperf_core.data.text_corpus.TokenData) cut into one trial's windows; what a
    backend's train() receives for a sequence graph (see the module's docstring)."""

    tokens = True  # what backends and the dataset check tell a token stream from an image stream by
    loader = "native"

    def __init__(self, corpus, seq_len: int, epoch_tokens: int, val_tokens: int):
        from aiperf_core.data.text_corpus import TextDataError

        self.corpus = corpus
        self.seq_len = int(seq_len)
        if self.seq_len < 1:
            raise TextDataError(f"seq_len: must be >= 1, got {seq_len}")
        self.epoch_windows = max(1, int(epoch_tokens) // self.seq_len)
        if len(corpus.train) < 2 * self.seq_len:
            raise TextDataError(f"{corpus.name}: its training split ({len(corpus.train):,} bytes) is shorter than "
                                f"two windows of seq_len {self.seq_len}")
        self.val_windows = min(int(val_tokens), len(corpus.val) - 1) // self.seq_len
        if self.val_windows < 1:
            raise TextDataError(f"{corpus.name}: its validation split ({len(corpus.val):,} bytes) is shorter than "
                                f"one window of seq_len {self.seq_len} and its next byte")
        # Windows of one pass: every phase in [0, seq_len) leaves room for the last one's next byte.
        self.pass_windows = (len(corpus.train) - self.seq_len) // self.seq_len
        self._passes: dict[tuple[int, int], tuple[int, SeededPermutation]] = {}

    # -- pickling: a copy (a spawned rank, a worker) reopens the corpus instead of copying its bytes
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_passes"] = {}
        if self.corpus.path is not None:
            state["corpus"] = ("prepared", self.corpus.path, self.corpus.digest)
        return state

    def __setstate__(self, state: dict) -> None:
        corpus = state["corpus"]
        if isinstance(corpus, tuple):
            from aiperf_core.data.text_corpus import TextDataError, open_prepared

            _, path, digest = corpus
            state["corpus"] = open_prepared(path)
            if state["corpus"].digest != digest:
                raise TextDataError(f"{path}: its manifest changed while the trial ran")
        self.__dict__.update(state)

    def close(self) -> None:
        """Nothing to end: windows are read in the consumer's process."""

    # -- what a backend and the score rules need to know ------------------------------------------
    @property
    def name(self) -> str:
        return self.corpus.name

    @property
    def classes(self) -> int:
        return self.corpus.vocab

    @property
    def vocab(self) -> int:
        return self.corpus.vocab

    @property
    def train_images(self) -> int:
        """Sequences an epoch trains on (the contract counts samples as images)."""
        return self.epoch_windows

    @property
    def val_images(self) -> int:
        return self.val_windows

    def describe(self) -> dict:
        return {"name": self.name, "path": self.corpus.path, "seq_len": self.seq_len,
                "epoch_sequences": self.epoch_windows, "val_sequences": self.val_windows,
                "pass_sequences": self.pass_windows}

    # -- the stream -------------------------------------------------------------------------------
    def _pass(self, seed: int, number: int) -> tuple[int, SeededPermutation]:
        key = (int(seed), int(number))
        if key not in self._passes:
            if len(self._passes) > 4:  # a trial reads one pass at a time; keep a few keys, not all
                self._passes.clear()
            phase = int(np.random.default_rng([int(seed), int(number), 0]).integers(self.seq_len))
            self._passes[key] = (phase, SeededPermutation(self.pass_windows, (int(seed), int(number), 1)))
        return self._passes[key]

    def train_offsets(self, seed: int, positions: np.ndarray) -> np.ndarray:
        """Start offsets in the training split of the windows at these stream positions."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(len(positions), np.int64)
        passes = positions // self.pass_windows
        for number in np.unique(passes):
            where = passes == number
            phase, order = self._pass(seed, int(number))
            out[where] = phase + order(positions[where] - number * self.pass_windows) * self.seq_len
        return out

    def plan(self, split: str, epoch: int, seed: int, batch_size: int) -> Sequence[np.ndarray]:
        """The global batches of an epoch, as window start offsets in `split` (computed lazily)."""
        check_split(split)
        if batch_size < 1:
            raise AiperfError(f"batch_size must be >= 1, got {batch_size}")
        if split == TRAIN:
            return _EpochPlan(lambda p: self.train_offsets(seed, p), epoch * self.epoch_windows,
                              self.epoch_windows, batch_size)
        return _EpochPlan(lambda p: p * self.seq_len, 0, self.val_windows, batch_size)

    def load(self, split: str, offsets: np.ndarray, epoch: int = 0,
             seed: int = 0) -> tuple[np.ndarray, np.ndarray, int, list[str]]:
        """(x, y, 0, []) for windows starting at `offsets` of `split`: int32 (n, seq_len) each."""
        data = self.corpus.split(check_split(split))
        offsets = np.asarray(offsets, dtype=np.int64)
        windows = np.asarray(data[offsets[:, None] + np.arange(self.seq_len + 1)], dtype=np.int32)
        return windows[:, :-1], windows[:, 1:], 0, []

    def iterate(self, split: str, epoch: int, seed: int, batch_size: int, rank: int = 0,
                world: int = 1) -> Iterator[Batch]:
        """This rank's shard of every global batch of the epoch (validation: epoch and seed unused)."""
        for offsets in self.plan(split, epoch, seed, batch_size):
            x, y, _, _ = self.load(split, shard(offsets, rank, world))
            yield Batch(x, y, len(offsets))


def is_token_stream(data) -> bool:
    return getattr(data, "tokens", False) is True and hasattr(data, "iterate")


__all__ = ["TokenStream", "SeededPermutation", "is_token_stream", "TRAIN", "VAL"]
