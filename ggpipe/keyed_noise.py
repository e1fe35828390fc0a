"""Randomness keyed by position: the noise that decides a sampled token is a
function of (the request's key, the token's output index ``pos``: 0 for the
first generated token, the token id) alone, so that a seeded request gives
the same text whatever was drafted, in whatever order, and after a restart.

Sampling is Gumbel-max: the token at a position is
``argmax_x (log p(x) + G(x))`` with ``G(x)`` standard Gumbel noise, which is
an exact draw from ``p`` (the Gumbel-max trick). A drafter that samples its
own distribution ``q`` with the same noise proposes the token the target
will most likely pick (Daliri, Musco, Suresh, "Coupling without
Communication and Drafter-Invariant Speculative Decoding", 2024: the two
agree with probability at least (1 - TV(p, q)) / (1 + TV(p, q))), and
verification accepts a draft exactly when it equals the target's pick
(llama.cpp's ``common_sampler_sample_and_accept_n``), so the output does
not depend on the drafts.

The noise is a counter-based hash (SplitMix64's finaliser, Steele, Lea and
Flood 2014) of (key, position, token id), vectorised over token ids in
numpy: random access to any token of any position, with no generator state
to keep in step. Pure numpy, no MPI.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
# odd constants: the golden ratio's (SplitMix64's increment) and two of its mixer's multipliers
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over uint64 ``z`` (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(key: int, pos: int, ids: np.ndarray) -> np.ndarray:
    """Uniform numbers in the open interval (0, 1), one per token id of
    ``ids`` (int (n,)) at position ``pos`` of the sequence keyed ``key``
    (an int, any size: reduced to 64 bits). float64 (n,); 53 random bits each."""
    with np.errstate(over="ignore"):
        base = _mix(np.array([(key & _MASK)], dtype=np.uint64) + _GOLDEN * np.uint64(pos & _MASK))
        z = _mix(base + (np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def gumbel(key: int, pos: int, ids: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise ``-log(-log(u))`` for token ids ``ids`` at
    position ``pos`` of the sequence keyed ``key`` (:func:`uniforms`).
    float64 (n,)."""
    return -np.log(-np.log(uniforms(key, pos, ids)))


def gumbel_pick(probs: np.ndarray, key: int, pos: int) -> int:
    """The token at position ``pos`` drawn from ``probs`` (float (n_vocab,),
    non-negative, need not be normalised) by Gumbel-max with the keyed
    noise: ``argmax`` of ``log probs + G`` over the tokens of non-zero
    probability. An exact draw from ``probs`` (over the noise); the same
    token for the same (key, pos, probs).

    Raises:
        ValueError: ``probs`` not 1-D, not finite and non-negative, or all zero.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probs must have shape (n,), got {p.shape}")
    if not np.isfinite(p).all() or (p < 0).any():
        raise ValueError("probs must be finite and non-negative")
    ids = np.flatnonzero(p)
    if ids.size == 0:
        raise ValueError("probs sum to zero")
    return int(ids[np.argmax(np.log(p[ids]) + gumbel(key, pos, ids))])
