"""Sampling settings: :class:`SamplingParams`, the bounds its
:meth:`~SamplingParams.validate` enforces (OpenAI's API's, and
:data:`REPEAT_LAST_N_MAX`), and :data:`GREEDY_BELOW`, the temperature below
which sampling is greedy.

What each setting does to a logits row, and in which order (llama.cpp's
sampler chain), is :mod:`ggpipe.sampling`'s module docstring; its
:class:`~ggpipe.sampling.Sampler` and :func:`~ggpipe.sampling.target_probs`
draw by these settings. Checks raise :class:`ggpipe.errors.ConfigError`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from ggpipe.errors import ConfigError
from ggpipe.logits import reply_k_for

__all__ = ["SamplingParams", "GREEDY_BELOW", "PENALTY_MAX", "BIAS_MAX", "TOP_LOGPROBS_MAX", "REPEAT_LAST_N_MAX"]

#: Temperatures below this are greedy. Above it, logits / temperature stays
#: finite for every float32 logit (|x| < 3.5e38, so < 3.5e44 in float64), and
#: logits 1e-5 apart already differ by a factor e^-10 in probability.
GREEDY_BELOW = 1e-6

#: Bounds of OpenAI's API: frequency and presence penalties in [-2, 2],
#: a logit bias in [-100, 100] (-100 bans the token in practice), at most 20
#: top log-probabilities per token; a repetition penalty in (0, PENALTY_MAX].
PENALTY_MAX = 10.0
BIAS_MAX = 100.0
TOP_LOGPROBS_MAX = 20
#: Most tokens a penalty window holds (``repeat_last_n``; -1: the whole context).
REPEAT_LAST_N_MAX = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings.

    ``temperature``: >= 0; 0 (or anything below :data:`GREEDY_BELOW`) means greedy (argmax). ``top_k``: keep the k most
    likely tokens, <= 0 disables. ``top_p``: nucleus mass in (0, 1], 1 disables.
    ``min_p``: in [0, 1], 0 disables. ``seed``: non-negative int for a
    reproducible generator, None for fresh OS entropy.

    The constraints (ggpipe.sampling's module docstring, step 0):
    ``repeat_penalty`` in (0, :data:`PENALTY_MAX`], 1 disables; ``frequency_penalty`` and
    ``presence_penalty`` in [-2, 2], 0 disables; ``repeat_last_n``: the
    tokens the penalties look back on (llama.cpp's ``penalty_last_n``,
    default 64; 0 disables, -1 the whole context); ``logit_bias``: pairs
    (token id, bias in [-100, 100]); ``grammar``: a GBNF grammar (llama.cpp's
    grammar syntax; its rule ``root`` is the start), built into a
    :class:`ggpipe.sampling.LogitMask` by the head (ggpipe.runtime.grammar).
    ``logprobs``: -1 none; k >= 0: record each decided token's log-probability
    and the k most likely tokens' (:class:`ggpipe.sampling.TokenLogprob`).

    Construction does not validate; call :meth:`validate`
    (:class:`ggpipe.sampling.Sampler` and :func:`ggpipe.sampling.target_probs` do).
    """

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int | None = None
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_last_n: int = 64
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    logprobs: int = -1

    def reply_k(self, width: int = 1) -> int:
        """How much of a logits row decides like the whole row for these
        settings (a run's ``reply_k``, ggpipe.logits.reply_k_for): greedy
        the argmax (a tree of ``width`` > 1: its width + 1 best), top-k
        sampling the top ``top_k``; 0 (full rows) otherwise, and whenever a
        constraint can reorder the row or log-probabilities are recorded."""
        if self.constrained or self.logprobs >= 0:
            return 0
        return reply_k_for(self.greedy, self.top_k, width)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: a temperature below :data:`GREEDY_BELOW` (0 included)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """The penalties act (llama.cpp's ``llama_sampler_penalties`` is not disabled)."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    @property
    def constrained(self) -> bool:
        """A constraint (bias, penalties, grammar) changes the logits before the filters."""
        return bool(self.logit_bias) or self.penalized or self.grammar is not None

    def validate(self) -> "SamplingParams":
        """Raise ConfigError (one line, naming the setting) for impossible settings; return self."""
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
        _real_in(self.min_p, "min_p", 0.0, 1.0, "0 disables it")
        _real_in(self.repeat_penalty, "repeat_penalty", 0.0, PENALTY_MAX, "1 disables it", low_open=True)
        _real_in(self.frequency_penalty, "frequency_penalty", -2.0, 2.0, "0 disables it")
        _real_in(self.presence_penalty, "presence_penalty", -2.0, 2.0, "0 disables it")
        n = self.repeat_last_n
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not -1 <= n <= REPEAT_LAST_N_MAX:
            raise ConfigError(f"repeat_last_n must be an integer in [-1, {REPEAT_LAST_N_MAX}]: the tokens the "
                              f"penalties look back on, 0 disables them, -1 the whole context (got {n!r})")
        for pair in self.logit_bias:
            tok, bias = pair
            if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                raise ConfigError(f"logit_bias: token ids are integers >= 0 (got {tok!r})")
            _real_in(bias, f"logit_bias of token {tok}", -BIAS_MAX, BIAS_MAX, "0 does nothing")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ConfigError("grammar must be a non-empty GBNF text")
        lp = self.logprobs
        if isinstance(lp, bool) or not isinstance(lp, numbers.Integral) or not -1 <= lp <= TOP_LOGPROBS_MAX:
            raise ConfigError(f"top log-probabilities per token must be in [0, {TOP_LOGPROBS_MAX}] (got {lp!r})")
        return self

    def check_vocabulary(self, n_vocab: int) -> "SamplingParams":
        """Raise ConfigError (one line) when a logit bias names a token
        outside a vocabulary of ``n_vocab`` tokens; return self."""
        bad = next((t for t, _ in self.logit_bias if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ConfigError(f"logit_bias: token {bad} is outside the vocabulary (0..{n_vocab - 1})")
        return self


def _real_in(v, name: str, lo: float, hi: float, off: str, low_open: bool = False) -> None:
    ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v) and (
        lo < v <= hi if low_open else lo <= v <= hi)
    if not ok:
        raise ConfigError(f"{name} must be a number in {'(' if low_open else '['}{lo:g}, {hi:g}], {off} "
                          f"(got {v!r})")
