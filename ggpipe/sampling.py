"""Token sampling on the head rank (numpy only).

:func:`target_probs` is the single definition of "the target distribution": the
distribution :meth:`Sampler.sample` draws from, and the one speculative
verification (SpecInfer multi-step speculative sampling) must use.

Filter order follows llama.cpp's default sampler chain (``common/common.h``
``common_params_sampling::samplers`` and ``common/sampling.cpp``: penalties, dry,
top_k, typ_p, top_p, min_p, xtc, temperature, dist); ggpipe implements only
top_k -> top_p -> temperature -> dist:

1. top-k (``llama_sampler_top_k_impl``): keep the ``top_k`` largest logits;
   ``top_k <= 0`` disables it. Ties at the cut are kept lowest token id first
   (llama.cpp uses an unstable partial sort, so its tie order is unspecified).
2. top-p (``llama_sampler_top_p_apply``): softmax of the *raw* logits (no
   temperature yet) over the top-k survivors, sorted descending; keep the
   smallest prefix whose cumulative probability is ``>= top_p`` (``top_p >= 1``
   disables it; if float error keeps the sum below ``top_p``, all are kept).
3. temperature (``llama_sampler_temp_ext_apply``): divide the survivors' logits
   by ``temperature``.
4. dist (``llama_sampler_dist_apply``): softmax over the survivors, draw one.

Differences from llama.cpp: float64 arithmetic (llama.cpp uses float32, which can
move the top-p cut when a cumulative sum lands within ~1e-7 of ``top_p``), and
min_p / typical / penalties are not implemented. ``temperature == 0`` is greedy:
``argmax`` (first index among ties, like ``llama_sampler_greedy_apply``), and so
is every temperature below :data:`GREEDY_BELOW` (1e-6): there, dividing the
logits overflows or leaves the softmax one-hot in all but exact ties anyway
(``1e-320`` made them inf/NaN, and the draw raised), so such a temperature
is taken as 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.logits import TopRow, argmax, dense, reply_k_for
from ggpipe.logits import top_k_sorted as _top_k_sorted

__all__ = ["SamplingParams", "target_probs", "Sampler", "GREEDY_BELOW"]

#: Temperatures below this are greedy. Above it, logits / temperature stays
#: finite for every float32 logit (|x| < 3.5e38, so < 3.5e44 in float64), and
#: logits 1e-5 apart already differ by a factor e^-10 in probability.
GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings.

    ``temperature``: >= 0; 0 (or anything below :data:`GREEDY_BELOW`) means greedy (argmax). ``top_k``: keep the k most
    likely tokens, <= 0 disables. ``top_p``: nucleus mass in (0, 1], 1 disables.
    ``seed``: non-negative int for a reproducible generator, None for fresh
    OS entropy. Construction does not validate; call :meth:`validate`
    (:class:`Sampler` and :func:`target_probs` do).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None

    def reply_k(self, width: int = 1) -> int:
        """How much of a logits row decides like the whole row for these
        settings (a run's ``reply_k``, ggpipe.logits.reply_k_for): greedy
        the argmax (a tree of ``width`` > 1: its width + 1 best), top-k
        sampling the top ``top_k``; 0 (full rows) otherwise."""
        return reply_k_for(self.greedy, self.top_k, width)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: a temperature below :data:`GREEDY_BELOW` (0 included)."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> "SamplingParams":
        """Raise ConfigError (one line) for impossible settings; return self."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0 (got {t!r})")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise ConfigError(f"top_k must be an integer (got {k!r})")
        if k < 0:
            raise ConfigError(f"top_k must be >= 0, 0 disables it (got {k})")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0 < p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], 1 disables it (got {p!r})")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or not 0 <= s < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2^63) or unset, as the server's (got {s!r})")
        return self


def _check_logits(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must have shape (n_vocab,), got {x.shape}")
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    return x


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution that sampling with ``params`` draws from.

    ``logits``: shape (n_vocab,), any float dtype (float32 from llama.cpp);
    ``-inf`` allowed (masked tokens). Returns float64 shape (n_vocab,), summing
    to 1, zero outside the kept set. Greedy params give a one-hot vector at
    ``argmax`` (first index among ties). Algorithm and order: see the module
    docstring (llama.cpp top_k -> top_p -> temperature -> dist).

    A compact row (ggpipe.logits.TopRow) stands for its full row when it
    holds at least the ``top_k`` tokens that sampling keeps (its reply was
    ``reply_k_for``): the other logits cannot change the distribution.

    Raises ConfigError for invalid params; ValueError for a wrong shape, NaN or
    +inf logits, logits that are all -inf, or a compact row holding fewer
    than the tokens sampling keeps.
    """
    params.validate()
    if isinstance(logits, TopRow):
        kept = logits.ids.shape[0]
        if not params.greedy and not (0 < params.top_k <= kept or kept >= logits.n_vocab):
            raise ValueError(f"a compact logits row of {kept} tokens cannot be sampled with top_k {params.top_k}; "
                             "ask for full rows")
        logits = dense(logits)
    x = _check_logits(logits)
    if np.isneginf(x).all():
        raise ValueError("all logits are -inf")
    out = np.zeros(x.size, dtype=np.float64)
    if params.greedy:
        out[int(np.argmax(x))] = 1.0
        return out
    x = x.astype(np.float64, copy=False)
    if params.top_k <= 0 and params.top_p >= 1.0:  # nothing filtered: no sort needed
        out[:] = _softmax(x / params.temperature)
        return out
    k = x.size if params.top_k <= 0 else min(params.top_k, x.size)
    if params.top_p < 1.0:
        kept = _top_p(x, k, params.top_p)
    else:
        kept = _top_k_sorted(x, k)
    out[kept] = _softmax(x[kept] / params.temperature)
    return out


def _top_p(x: np.ndarray, k: int, p: float) -> np.ndarray:
    """Top-k survivors (k largest of x), then the smallest prefix of them, by
    raw-logit softmax over the k survivors, whose cumulative mass is >= p.

    Sorting all survivors is avoided like llama.cpp's adaptive top-p: sort the
    best 256, double (up to 4096, then all) until the prefix reaches p. Exact,
    because the softmax denominator is taken over all k survivors and the tie
    order is the same for every prefix length."""
    if k < x.size:
        top = _top_k_sorted(x, k)
        x, idx = x[top], top
    else:
        idx = None
    m = x.max()
    denom = np.exp(x - m).sum()
    m_try = min(256, k)
    while True:
        order = _top_k_sorted(x, m_try)
        cum = np.cumsum(np.exp(x[order] - m) / denom)
        last = int(np.searchsorted(cum, p, side="left")) + 1
        if last <= m_try or m_try == k:
            order = order[: min(last, m_try)]
            return order if idx is None else idx[order]
        m_try = min(2 * m_try, k) if m_try < 4096 else k  # big nucleus: sort all


class Sampler:
    """Draws tokens according to :class:`SamplingParams`.

    ``rng`` is the ``np.random.Generator`` (seeded from ``params.seed``; None ->
    fresh entropy) used by every random draw; speculative verification should
    draw its uniforms from it too so a seeded run is reproducible end to end.
    Greedy sampling draws nothing from ``rng``.
    """

    def __init__(self, params: SamplingParams | None = None):
        self.params = (params or SamplingParams()).validate()
        self.rng = np.random.default_rng(self.params.seed)

    def sample(self, logits: np.ndarray | TopRow) -> int:
        """Token id for ``logits`` (shape (n_vocab,), or a compact row of a
        greedy run, ggpipe.logits): greedy -> ``argmax`` (first index among
        ties); else one draw from :func:`target_probs`.

        Raises:
            ValueError: a compact row holding fewer tokens than sampling
                keeps (see :func:`target_probs`)."""
        if self.params.greedy:
            return argmax(logits if isinstance(logits, TopRow) else _check_logits(logits))
        return self.sample_from(target_probs(logits, self.params))

    def sample_from(self, probs: np.ndarray) -> int:
        """One draw from ``probs`` (shape (n,), non-negative, need not be exactly
        normalised) by inverse CDF with one ``rng.random()``. Zero-probability
        entries are never returned. Raises ValueError for a bad vector."""
        p = np.asarray(probs, dtype=np.float64)
        if p.ndim != 1 or p.size == 0:
            raise ValueError(f"probs must have shape (n,), got {p.shape}")
        if not np.isfinite(p).all() or (p < 0).any():
            raise ValueError("probs must be finite and non-negative")
        cdf = np.cumsum(p)
        if cdf[-1] <= 0:
            raise ValueError("probs sum to zero")
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        if i >= p.size or p[i] == 0:  # only reachable through float rounding at the top
            i = int(np.flatnonzero(p)[-1])
        return i
