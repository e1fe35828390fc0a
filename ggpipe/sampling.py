"""Token sampling on the head rank (numpy only).

:func:`target_probs` is the single definition of "the target distribution": the
distribution :meth:`Sampler.sample` draws from, the one speculative
verification decides by (ggpipe.speculation.verify) and the one a sampling
drafter draws its proposals from. The
settings it draws by, their bounds and checks are ggpipe.sampling_params
(:class:`~ggpipe.sampling_params.SamplingParams`).

Filter order follows llama.cpp's default sampler chain (``common/common.h``
``common_params_sampling::samplers`` and ``common/sampling.cpp``
``common_sampler_init``: logit_bias, penalties, dry, top_k, typ_p, top_p,
min_p, xtc, temperature, dist) with the grammar applied first (llama.cpp's
``grammar_first``); ggpipe implements logit_bias -> penalties -> grammar ->
top_k -> top_p -> min_p -> temperature -> dist:

0. The *constraints*, which depend on the request and on the tokens before
   the position (:meth:`Sampler.constrain`; a row of a speculation tree is
   constrained by the tokens on its path): ``logit_bias`` adds a bias to
   chosen tokens (``llama_sampler_logit_bias_apply``); the repetition,
   frequency and presence penalties act on the tokens among the last
   ``repeat_last_n`` of the context, prompt included, as llama-server feeds
   the prompt to its sampler (``llama_sampler_penalties_apply``, in float32
   as llama.cpp: a logit <= 0 is multiplied by ``repeat_penalty``, a positive
   one divided, then ``count * frequency_penalty + presence_penalty`` is
   subtracted); a grammar (:class:`LogitMask`, llama.cpp's grammar sampler)
   sets the logits of tokens it does not allow next to -inf.
1. top-k (``llama_sampler_top_k_impl``): keep the ``top_k`` largest logits;
   ``top_k <= 0`` disables it. Ties at the cut are kept lowest token id first
   (llama.cpp uses an unstable partial sort, so its tie order is unspecified).
2. top-p (``llama_sampler_top_p_apply``): softmax of the *raw* logits (no
   temperature yet) over the top-k survivors, sorted descending; keep the
   smallest prefix whose cumulative probability is ``>= top_p`` (``top_p >= 1``
   disables it; if float error keeps the sum below ``top_p``, all are kept).
3. min-p (``llama_sampler_min_p_apply``): keep the survivors whose raw logit
   is at least the largest plus ``log(min_p)`` (probability at least
   ``min_p`` times the most likely token's); ``min_p == 0`` disables it.
4. temperature (``llama_sampler_temp_ext_apply``): divide the survivors' logits
   by ``temperature``.
5. dist (``llama_sampler_dist_apply``): softmax over the survivors, draw one.
   ggpipe draws by Gumbel-max with noise keyed by (the request's seed, the
   token's output index: 0 for the first generated token)
   (ggpipe.keyed_noise): an exact draw, and the same token for the same
   seed, index and distribution,
   whatever speculation drafted before it (llama.cpp draws from the slot's
   RNG in order, which one draw per position also keeps independent of
   the drafts).

Differences from llama.cpp: float64 arithmetic after the constraints
(llama.cpp uses float32, which can move the top-p cut when a cumulative sum
lands within ~1e-7 of ``top_p``); typical-p, DRY, XTC and mirostat are not
implemented; ``min_p`` defaults to 0 (llama.cpp's tools: 0.05) and
``repeat_penalty`` to 1 (off), as OpenAI's API has neither. ``temperature == 0`` is greedy:
``argmax`` of the constrained logits (first index among ties, like
``llama_sampler_greedy_apply``), and so is every temperature below
:data:`ggpipe.sampling_params.GREEDY_BELOW` (1e-6): there, dividing the
logits overflows or leaves the softmax one-hot in all but exact ties anyway
(``1e-320`` made them inf/NaN, and the draw raised), so such a temperature
is taken as 0.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter, deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.keyed_noise import gumbel_pick
from ggpipe.logits import TopRow, argmax, dense
from ggpipe.logits import top_k_sorted as _top_k_sorted
from ggpipe.sampling_params import SamplingParams

__all__ = ["target_probs", "Sampler", "LogitMask", "TokenLogprob"]


class LogitMask(Protocol):
    """A grammar's hold on the next token (ggpipe.runtime.grammar wraps
    llama.cpp's grammar sampler): :meth:`mask` sets the logits of tokens the
    grammar does not allow next to -inf; :meth:`accept` moves it past a
    decided token."""

    def mask(self, logits: np.ndarray, best: int = 0) -> np.ndarray:
        """float32 (n_vocab,) -> float32 (n_vocab,), disallowed tokens -inf;
        with ``best`` > 0 also every token outside the ``best`` most likely
        allowed ones (all a greedy choice or top-k filter reads)."""

    def accept(self, token: int) -> None:
        """The token was decided (raises ValueError if the grammar refuses it)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A decided token's log-probability under the model (log-softmax of its
    raw logits row, temperature 1, before any constraint or filter, as
    OpenAI's ``logprobs``), and the ``top`` most likely tokens': pairs
    (token id, log-probability), most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _as_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"logits must have shape (n_vocab,), got {x.shape}")
    return x


def _check_logits(logits: np.ndarray) -> np.ndarray:
    x = _as_row(logits)
    if np.isnan(x).any() or np.isposinf(x).any():
        raise ValueError("logits contain NaN or +inf")
    return x


def _greedy_token(logits: np.ndarray) -> int:
    """The argmax of a full row (first index among ties), refusing what
    :func:`_check_logits` refuses in one pass over the row instead of three:
    ``np.argmax`` returns the first NaN's index when the row holds one, and
    otherwise the first ``+inf``'s, so the row is bad exactly when the value
    at the returned index is NaN or ``+inf``.

    Raises:
        ValueError: not a non-empty 1-D row; NaN or ``+inf`` in it."""
    x = _as_row(logits)
    t = int(np.argmax(x))
    if np.isnan(x[t]) or x[t] == np.inf:
        raise ValueError("logits contain NaN or +inf")
    return t


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
    if params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0:  # nothing filtered: no sort needed
        out[:] = _softmax(x / params.temperature)
        return out
    k = x.size if params.top_k <= 0 else min(params.top_k, x.size)
    if params.top_p < 1.0:
        kept = _top_p(x, k, params.top_p)
    else:
        kept = _top_k_sorted(x, k)
    if params.min_p > 0.0:   # the survivors' best is the row's best; at least it survives
        kept = kept[x[kept] >= x[kept[0]] + math.log(params.min_p)]
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
    """Draws tokens according to :class:`~ggpipe.sampling_params.SamplingParams`, for one sequence.

    Every random draw is keyed (ggpipe.keyed_noise): ``key`` is
    ``params.seed`` (None: 63 bits of fresh entropy) and ``index`` the
    output index of the token decided next (0 for the first generated
    token, one more per accepted token), so the token at output index i is
    a function of (seed, i, its distribution) alone: a seeded request gives
    the same text whatever a speculative mode drafted and whenever.
    Greedy sampling draws nothing.

    A sampler follows its sequence: every decided token goes through
    :meth:`accept` (:meth:`sample` does it; speculative verification,
    ggpipe.speculation.verify, calls it), in order, so that the penalties'
    window and the grammar's state are those of the position decided next.
    ``history``: the context before the first decided token (the prompt),
    which the penalties see as llama-server's sampler does. ``grammar``: the
    :class:`LogitMask` built from ``params.grammar`` (required with it).
    With ``params.logprobs >= 0``, :attr:`logprobs` gets one
    :class:`TokenLogprob` per accepted token.

    Raises:
        ConfigError: invalid params; a grammar in the params but none given.
    """

    def __init__(self, params: SamplingParams | None = None, history=(), grammar: LogitMask | None = None):
        self.params = (params or SamplingParams()).validate()
        self.key = self.params.seed if self.params.seed is not None else secrets.randbits(63)
        self.index = 0    # the output index of the token decided next (the keyed noise's counter)
        if self.params.grammar is not None and grammar is None:
            raise ConfigError("a grammar needs the model's vocabulary: build the sampler on the head")
        self.grammar = grammar
        p = self.params
        self._bias = None
        if p.logit_bias:
            ids = np.array([t for t, _ in p.logit_bias], dtype=np.int64)
            self._bias = (ids, np.array([b for _, b in p.logit_bias], dtype=np.float32))
        self._window: deque | None = None
        self._counts: Counter = Counter()
        if p.penalized:
            self._window = deque(maxlen=None if p.repeat_last_n < 0 else p.repeat_last_n)
            for t in history:
                self._push(int(t))
        self.logprobs: list[TokenLogprob] = []
        self._row = None   # the raw row of the last constrained position (its log-probabilities)

    def _push(self, token: int) -> None:
        w = self._window
        if w.maxlen is not None and len(w) == w.maxlen:
            old = w.popleft()
            self._counts[old] -= 1
            if not self._counts[old]:
                del self._counts[old]
        w.append(token)
        self._counts[token] += 1

    def constrain(self, logits: np.ndarray | TopRow) -> np.ndarray | TopRow:
        """The logits the filters see at the next position: ``logits``
        (float32 (n_vocab,)) after the logit bias, the penalties and the
        grammar (module docstring, step 0); ``logits`` itself (not copied)
        when the params have no constraint. Remembers the raw row for
        :attr:`logprobs`.

        Raises:
            ValueError: a compact row (ggpipe.logits.TopRow) with a
                constraint (a constrained run asks for full rows), or every
                token ruled out (the grammar allows none).
        """
        p = self.params
        if p.logprobs >= 0:
            self._row = logits
        if not p.constrained:
            return logits
        if isinstance(logits, TopRow):
            raise ValueError("a constrained sampler needs full logit rows (reply_k 0)")
        x = np.array(logits, dtype=np.float32, copy=True)
        if self._bias is not None:
            ids, bias = self._bias
            if ids.size and int(ids.max()) >= x.size:
                raise ValueError(f"logit_bias names token {int(ids.max())}, outside the vocabulary of {x.size}")
            np.add.at(x, ids, bias)
        if self._counts:
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            ids = ids[ids < x.size]
            counts = np.array([self._counts[int(i)] for i in ids], dtype=np.float32)
            v = x[ids]
            rp = np.float32(p.repeat_penalty)
            v = np.where(v <= 0, v * rp, v / rp).astype(np.float32)
            v -= counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
            x[ids] = v
        if self.grammar is not None:
            # greedy reads the best allowed token, top-k sampling the k best: the grammar is asked about those first
            x = self.grammar.mask(x, best=1 if p.greedy else max(p.top_k, 0))
            if np.isneginf(x).all():
                raise ValueError("the grammar allows no token here")
        return x

    def accept(self, token: int) -> None:
        """``token`` was decided at the next position: advance the
        penalties' window and the grammar, record its log-probabilities."""
        token = int(token)
        self.index += 1
        if self.params.logprobs >= 0 and self._row is not None:
            self.logprobs.append(_logprob(self._row, token, self.params.logprobs))
            self._row = None
        if self._window is not None:
            self._push(token)
        if self.grammar is not None:
            self.grammar.accept(token)

    def sample(self, logits: np.ndarray | TopRow) -> int:
        """Decide the next token from its ``logits`` (shape (n_vocab,), or a
        compact row of an unconstrained greedy run, ggpipe.logits) and
        :meth:`accept` it: greedy -> ``argmax`` of the constrained row
        (first index among ties); else one draw from :func:`target_probs`
        of it.

        Raises:
            ValueError: a compact row holding fewer tokens than sampling
                keeps (see :func:`target_probs`); see :meth:`constrain`."""
        x = self.constrain(logits)
        if self.params.greedy:
            t = argmax(x) if isinstance(x, TopRow) else _greedy_token(x)
        else:
            t = self.sample_from(target_probs(x, self.params))
        self.accept(t)
        return t

    def sample_from(self, probs: np.ndarray) -> int:
        """The draw from ``probs`` (shape (n,), non-negative, need not be
        exactly normalised) at the next output index: Gumbel-max with the
        noise of (``key``, ``index``) (:func:`ggpipe.keyed_noise.gumbel_pick`);
        not accepted. Zero-probability entries are never returned.

        Raises:
            ValueError: a bad vector (not 1-D, negative, not finite, all zero)."""
        return gumbel_pick(probs, self.key, self.index)


def _logprob(row, token: int, k: int) -> TokenLogprob:
    """``token``'s log-probability in the raw row, and the ``k`` best tokens'."""
    x = dense(row) if isinstance(row, TopRow) else np.asarray(row, dtype=np.float64)
    x = x.astype(np.float64, copy=False)
    m = x.max()
    lse = m + math.log(np.exp(x - m).sum())
    top = _top_k_sorted(x, k) if k else np.empty(0, dtype=np.int64)
    return TokenLogprob(token, float(x[token] - lse), tuple((int(i), float(x[i] - lse)) for i in top))
