"""Compact results for greedy decoding: the k largest logits of a row and the
row's log-sum-exp, instead of the whole row.

A pipeline's last stage returns one float32 row of ``n_vocab`` logits per
output token: 196,608 bytes for SmolLM2's 49,152 tokens, 1.6 ms on a
1 Gbit/s link, per token, for a decision that in greedy mode reads only the
argmax (the target's verification) or the few best tokens and their
probabilities (the draft's tree), and with top-k sampling only the top-k
logits. With ``reply_k = k`` a run's result carries, per row, the k best
token ids, their logits and the log-sum-exp of the whole row: (2k + 1) x 4
bytes.

Exactness: :func:`top_k` selects and orders as :mod:`ggpipe.sampling`'s top-k
filter does (:func:`top_k_sorted`: by logit descending, ties lowest id
first), so its first id is ``np.argmax`` (llama_sampler_greedy_apply's
choice) and, for ``k >= top_k``, :func:`dense` (the kept logits, ``-inf``
elsewhere) gives :func:`ggpipe.sampling.target_probs` exactly the
distribution of the full row (top-k, then top-p over the survivors, then
temperature). :func:`reply_k_for` says which k a request needs (0: full rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_REPLY_K = 256  # most candidates per row a run may ask for


#: Up to this k, :func:`top_k_sorted` takes the k argmaxes one by one (a
#: greedy reply's 2 or a tree's few: about 5 us each on a 49k vocabulary,
#: against about 270 us for the partition).
SMALL_K = 8


def _small_top_k(x: np.ndarray, k: int) -> np.ndarray | None:
    """:func:`top_k_sorted` by k successive ``np.argmax`` on a copy (each
    takes the lowest index among equal values, so ties come out by index);
    None where a value could repeat an index (a row with -inf or NaN)."""
    y = np.array(x, dtype=np.float32, copy=True)
    out = np.empty(k, dtype=np.int64)
    for j in range(k):
        i = int(np.argmax(y))
        if not np.isfinite(y[i]):
            return None
        out[j] = i
        y[i] = -np.inf
    return out


def top_k_sorted(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of x, sorted by value descending, ties by
    index ascending. O(n + k log k); O(k n) with a small constant up to
    :data:`SMALL_K`."""
    n = x.size
    if k >= n:
        return np.argsort(-x, kind="stable")
    if k <= SMALL_K:
        fast = _small_top_k(x, k)
        if fast is not None:
            return fast
    v = np.partition(x, n - k)[n - k]  # k-th largest value
    above = np.flatnonzero(x > v)
    at = np.flatnonzero(x == v)[: k - above.size]
    cand = np.sort(np.concatenate([above, at]))
    return cand[np.argsort(-x[cand], kind="stable")]


def reply_k_for(greedy: bool, top_k: int, width: int = 1) -> int:
    """The smallest reply that decides like the full row: greedy reads the
    ``width`` best tokens and the next (a tree of that width; 2 for a chain or
    the target's argmax: the argmax and the runner-up, whose gap is the
    decision's margin, :func:`top2_margin`), top-k sampling the top
    ``top_k``; 0 (full rows) when sampling keeps more than MAX_REPLY_K
    tokens or is not top-k limited."""
    if greedy:
        return width + 1
    return top_k if 0 < top_k <= MAX_REPLY_K else 0


@dataclass(frozen=True)
class TopRow:
    """One compact row: ``ids`` int32 (k,) best first (ties: lower id first),
    ``values`` float32 (k,) their logits, ``lse`` the log-sum-exp of the full
    row (float), ``n_vocab`` the full row's length."""

    ids: np.ndarray
    values: np.ndarray
    lse: float
    n_vocab: int

    @property
    def shape(self) -> tuple[int]:
        """The full row's shape, ``(n_vocab,)``."""
        return (self.n_vocab,)


@dataclass(frozen=True)
class TopLogits:
    """Compact rows of one run: ``ids`` int32 (n, k), ``values`` float32
    (n, k), ``lse`` float32 (n,). Indexing gives a :class:`TopRow`;
    ``shape`` is that of the full rows, (n, n_vocab)."""

    ids: np.ndarray
    values: np.ndarray
    lse: np.ndarray
    n_vocab: int

    @property
    def shape(self) -> tuple[int, int]:
        """The full rows' shape, ``(n, n_vocab)``."""
        return (int(self.ids.shape[0]), self.n_vocab)

    @property
    def k(self) -> int:
        """Tokens kept per row."""
        return int(self.ids.shape[1])

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> TopRow:
        return TopRow(self.ids[i], self.values[i], float(self.lse[i]), self.n_vocab)


def top2_margin(row) -> float | None:
    """The best logit minus the runner-up's (logit units, >= 0) of a full
    float32 (n_vocab,) row or a :class:`TopRow` with k >= 2; None for a
    compact row of one. How close a greedy decision came to a tie."""
    if isinstance(row, TopRow):
        return float(row.values[0] - row.values[1]) if row.values.size >= 2 else None
    top2 = np.partition(np.asarray(row), -2)[-2:]
    return float(top2[1] - top2[0])


def top_k(logits: np.ndarray, k: int) -> TopLogits:
    """The compact form of float32 (n, n_vocab) ``logits``: per row the
    ``k`` (at most n_vocab) largest, ``np.argmax`` first, the rest by logit
    descending (ties: lower id first), and the log-sum-exp (float32, as
    ``max + log(sum(exp(row - max)))``)."""
    logits = np.asarray(logits, dtype=np.float32)
    n, v = logits.shape
    k = max(1, min(int(k), v))
    ids = np.empty((n, k), dtype=np.int32)
    for i in range(n):
        ids[i] = np.argmax(logits[i]) if k == 1 else top_k_sorted(logits[i], k)
    values = np.take_along_axis(logits, ids, axis=1)
    mx = values[:, :1]
    lse = (mx[:, 0] + np.log(np.exp(logits - mx).sum(axis=1))).astype(np.float32)
    return TopLogits(ids, values, lse, v)


def pack(t: TopLogits) -> np.ndarray:
    """float32 (n * (2k + 1),): per row the k ids (int32 bit patterns), the
    k logits, the log-sum-exp (the LOGITS payload of a compact reply)."""
    n, k = len(t), t.k
    out = np.empty((n, 2 * k + 1), dtype=np.float32)
    out[:, :k] = t.ids.astype(np.int32).view(np.float32)
    out[:, k:2 * k] = t.values
    out[:, 2 * k] = t.lse
    return out.reshape(-1)


def unpack(flat: np.ndarray, n: int, k: int, n_vocab: int) -> TopLogits:
    """Inverse of :func:`pack`.

    Raises:
        ValueError: ``flat`` is not n x (2k + 1) floats, or an id is outside
            0..n_vocab-1."""
    if flat.shape != (n * (2 * k + 1),):
        raise ValueError(f"{flat.shape[0]} floats, expected {n} x {2 * k + 1}")
    rows = flat.reshape(n, 2 * k + 1)
    ids = np.ascontiguousarray(rows[:, :k]).view(np.int32)
    if ((ids < 0) | (ids >= n_vocab)).any():
        raise ValueError(f"a token id outside 0..{n_vocab - 1}")
    return TopLogits(ids, rows[:, k:2 * k].copy(), rows[:, 2 * k].copy(), n_vocab)


def dense(row: TopRow) -> np.ndarray:
    """float32 (n_vocab,): the row's kept logits at their ids, ``-inf``
    elsewhere (what sampling's top-k filter leaves of the full row)."""
    out = np.full(row.n_vocab, -np.inf, dtype=np.float32)
    out[row.ids] = row.values
    return out


def argmax(row: np.ndarray | TopRow) -> int:
    """The greedy token of a full float32 (n_vocab,) row or a compact one:
    the first index among ties."""
    if isinstance(row, TopRow):
        return int(row.ids[0])
    return int(np.argmax(row))


def best(row: np.ndarray | TopRow, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable tokens of a row, best first (ties: lower id
    first), and their probabilities under softmax of the full row: (int64
    (k,), float64 (k,)). A compact row gives at most its own k.

    The probabilities are ``exp(logit - lse)``, computed in float32 for a full
    row as ``exp(l - l_max) / sum(exp(row - l_max))`` (the head's greedy
    drafting, ggpipe.speculation.proposers.draft_model)."""
    if isinstance(row, TopRow):
        k = min(k, row.ids.shape[0])
        ids = row.ids[:k].astype(np.int64)
        p = np.exp(row.values[:k].astype(np.float64) - row.lse)
        return ids, p
    top = int(np.argmax(row))
    z = float(np.exp(row - row[top]).sum())
    ids = (np.array([top]) if k <= 1 else top_k_sorted(row, k)).astype(np.int64)
    p = np.exp((row[ids] - row[top]).astype(np.float64)) / z
    return ids, p
