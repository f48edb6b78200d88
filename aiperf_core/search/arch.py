"""Architecture codes and the edit distance between them (Auto-Keras style, Jin et al. 2019).

An architecture is reduced to two sequences:
  layers: one row per weighted layer in topological order: (kind, width, kernel), with
          kind 0 conv2d: its filters and kernel size;
          kind 1 dense: its units, kernel 1;
          kind 2 attention: its width heads * head_dim, and its heads in the kernel's place (so that
                 more heads of the same width move it in both);
          kind 3 moe: its experts' hidden units, and its experts in the kernel's place;
          kind 4 grouped-query attention (kv_heads below heads, multi-query included): as kind 2; its
                 key-value width is the k and v projections' units;
          kind 5 moe of SwiGLU experts (mlp: swiglu): as kind 3;
          a transformer's attention and mixture of experts count as layers, as its dense ones do. The
          ops that are no layer of the code pass the rank through: batch norm, relu and pooling; layer
          norm, positions and gelu; and Llama's rms_norm, rotary, silu and mul. In every block of its
          family each is fixed by the layers around it and no morph changes one alone, so a row for it
          would repeat what the dense and attention rows say (and weigh a deeper morph more). A SwiGLU's
          mul joins two parallel projections (gate and up), not a skip connection: only an add is one;
  skips:  one row per `add` node: (u, d), u the rank of the layer the connection leaves from
          and d the number of weighted layers it skips.

The distance is D_layers + D_skips, each an edit distance with insertion and deletion cost 1:
  layer substitution: 1 for layers of different kinds, else
                      min(1, |w1 - w2| / max(w1, w2) + |k1 - k2| / (2 max(k1, k2)))
  skip substitution:  (|u1 - u2| + |d1 - d2|) / (max(u1, u2) + max(d1, d2))   (Auto-Keras)
Auto-Keras matches skip connections by an optimal assignment; here they are aligned in order of
u, which gives the same value whenever the optimal matching keeps that order and an upper bound
otherwise, at a fraction of the cost.

The distances of many pairs are computed together, one DP row at a time over all pairs, so
that the work is a few NumPy operations per row instead of Python loops per cell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from aiperf_core.errors import AiperfError
from aiperf_core.ir import Graph, kv_heads, moe_mlp

CONV, DENSE, ATTENTION, MOE, GQA_ATTENTION, SWIGLU_MOE = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class ArchCode:
    layers: np.ndarray  # (n, 3) float64: kind, width, kernel
    skips: np.ndarray   # (s, 2) float64: u, d

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers.astype(int).tolist(), "skips": self.skips.astype(int).tolist()}

    @classmethod
    def from_json(cls, data: Any) -> "ArchCode":
        try:
            layers = np.asarray(data["layers"], dtype=np.float64).reshape(-1, 3)
            skips = np.asarray(data["skips"], dtype=np.float64).reshape(-1, 2)
        except (KeyError, TypeError, ValueError) as exc:
            raise AiperfError(f"arch: not an architecture code ({exc})") from None
        return cls(layers, skips)

    def summary(self) -> np.ndarray:
        """A cheap vector whose L1 distances roughly follow the edit distance (for pre-filtering)."""
        widths = self.layers[:, 1] if len(self.layers) else np.zeros(1)
        return np.array([len(self.layers), len(self.skips), np.log2(np.sum(widths) + 1.0)])


def encode(graph: Graph) -> ArchCode:
    rank: dict[str, int] = {}
    layers: list[tuple[int, int, int]] = []
    skips: list[tuple[int, int]] = []
    for node in graph.nodes:
        below = max((rank[i] for i in node.inputs), default=-1)
        if node.op == "conv2d":
            layers.append((CONV, node.attrs["filters"], node.attrs["kernel"][0]))
            rank[node.id] = len(layers) - 1
        elif node.op == "dense":
            layers.append((DENSE, node.attrs["units"], 1))
            rank[node.id] = len(layers) - 1
        elif node.op == "attention":
            kind = GQA_ATTENTION if kv_heads(node.attrs) != node.attrs["heads"] else ATTENTION
            layers.append((kind, node.attrs["heads"] * node.attrs["head_dim"], node.attrs["heads"]))
            rank[node.id] = len(layers) - 1
        elif node.op == "moe":
            kind = SWIGLU_MOE if moe_mlp(node.attrs) == "swiglu" else MOE
            layers.append((kind, node.attrs["units"], node.attrs["experts"]))
            rank[node.id] = len(layers) - 1
        else:
            rank[node.id] = below
            if node.op == "add":
                ranks = [rank[i] for i in node.inputs]
                skips.append((min(ranks) + 1, max(ranks) - min(ranks)))
    skips.sort()
    return ArchCode(np.asarray(layers, dtype=np.float64).reshape(-1, 3),
                    np.asarray(skips, dtype=np.float64).reshape(-1, 2))


def _layer_cost(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a: (P, 3) one layer per pair; b: (P, M, 3). Substitution costs (P, M)."""
    a = a[:, None, :]
    width = np.abs(a[..., 1] - b[..., 1]) / np.maximum(np.maximum(a[..., 1], b[..., 1]), 1.0)
    kernel = np.abs(a[..., 2] - b[..., 2]) / (2.0 * np.maximum(np.maximum(a[..., 2], b[..., 2]), 1.0))
    return np.where(a[..., 0] == b[..., 0], np.minimum(width + kernel, 1.0), 1.0)


def _skip_cost(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a[:, None, :]
    num = np.abs(a[..., 0] - b[..., 0]) + np.abs(a[..., 1] - b[..., 1])
    den = np.maximum(a[..., 0], b[..., 0]) + np.maximum(a[..., 1], b[..., 1])
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _tokenise(seqs: Sequence[np.ndarray], width: int, cost) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct row becomes a token: returns the sequences as padded token ids, their lengths,
    and the substitution cost of every pair of tokens. Architectures reuse a few layer shapes, so
    one gather from that small table replaces the arithmetic of every DP cell."""
    rows = np.concatenate([*seqs, np.zeros((1, width))]).reshape(-1, width)
    tokens, ids = np.unique(rows, axis=0, return_inverse=True)
    ids = ids.ravel()
    table = cost(tokens, np.broadcast_to(tokens, (len(tokens), len(tokens), width)))
    lengths = np.array([len(q) for q in seqs], dtype=np.int64)
    padded = np.zeros((len(seqs), max(int(lengths.max(initial=0)), 1)), dtype=np.int64)
    ends = np.cumsum(lengths)
    for k, n in enumerate(lengths):
        padded[k, :n] = ids[ends[k] - n:ends[k]]
    return padded, lengths, table


def _edit_distances(seqs: Sequence[np.ndarray], left: np.ndarray, right: np.ndarray, width: int, cost
                    ) -> np.ndarray:
    """Edit distance of seqs[left[p]] to seqs[right[p]] for every pair p, insertions and
    deletions costing 1.

    Row i of the DP over all pairs at once: with unit insertion cost,
        D[i, j] = min_k<=j (T[k] + j - k),  T[j] = min(D[i-1, j] + 1, D[i-1, j-1] + sub(i, j)),
    which is a running minimum, so each row is a handful of array operations.
    """
    pairs = len(left)
    if pairs == 0:
        return np.zeros(0)
    padded, lengths, table = _tokenise(seqs, width, cost)
    table = table.astype(np.float32)  # half the memory traffic; costs are exact to ~1e-7 of the distance
    n, m = lengths[left], lengths[right]
    a = padded[left, :max(int(n.max()), 1)]
    b = padded[right, :max(int(m.max()), 1)]
    cols = np.arange(b.shape[1] + 1, dtype=np.float32)
    row = np.broadcast_to(cols, (pairs, len(cols))).copy()
    t = np.empty_like(row)
    result = np.where(n == 0, m.astype(np.float64), 0.0)
    pick = np.arange(pairs)
    for i in range(1, int(n.max()) + 1):
        sub = table[a[:, i - 1][:, None], b]
        t[:, 0] = row[:, 0] + 1
        np.minimum(row[:, 1:] + 1, row[:, :-1] + sub, out=t[:, 1:])
        t -= cols
        row = np.minimum.accumulate(t, axis=1)
        row += cols
        done = n == i
        if done.any():
            result[done] = row[pick[done], m[done]]
    return result.astype(np.float64)


def pair_distances(codes: Sequence[ArchCode], left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """d(codes[left[p]], codes[right[p]]) for each pair p."""
    return (_edit_distances([c.layers for c in codes], left, right, 3, _layer_cost)
            + _edit_distances([c.skips for c in codes], left, right, 2, _skip_cost))


def distances(left: Sequence[ArchCode], right: Sequence[ArchCode]) -> np.ndarray:
    """d(left[p], right[p]) for each pair p."""
    if len(left) != len(right):
        raise AiperfError(f"distances: {len(left)} left codes but {len(right)} right codes")
    k = np.arange(len(left))
    return pair_distances([*left, *right], k, k + len(left))


def distance_matrix(rows: Sequence[ArchCode], cols: Sequence[ArchCode] | None = None) -> np.ndarray:
    """All distances between rows and cols (cols defaults to rows: symmetric, zero diagonal)."""
    if cols is None:
        i, j = np.triu_indices(len(rows), k=1)
        out = np.zeros((len(rows), len(rows)))
        d = pair_distances(list(rows), i, j)
        out[i, j] = d
        out[j, i] = d
        return out
    i, j = np.meshgrid(np.arange(len(rows)), np.arange(len(cols)), indexing="ij")
    d = pair_distances([*rows, *cols], i.ravel(), j.ravel() + len(rows))
    return d.reshape(len(rows), len(cols))
