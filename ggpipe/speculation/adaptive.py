"""Adaptive speculation depth from measured costs and acceptance. Pure.

PipeInfer's confidence cutoff (IV.B.2) stops drafting when the draft's
probability of its next token falls below a fixed ``p_accept``, raised by a
fixed ``p_recovery`` per micro-batch speculated beyond unverified ones. Both
numbers encode the machine and the model pair of the day they were tuned on.
Here they come from measurements instead (in the spirit of Minions' adaptive
speculation length, section 3.3):

* :class:`AcceptanceModel`: P(a draft token is accepted | the draft's
  probability q of it), calibrated online per bin of q, with a prior that
  believes the draft (P = q) until the bin has data;
* :class:`PassCost`: the target's cost per pass against the number of tokens
  in it, from the spacing of returned results (seconds);
* :func:`draft_threshold`: a token is worth putting in a pass when the
  probability that it is reached and accepted is at least the cost it adds to
  the pass relative to a one-token pass: ``(cost(2) - cost(1)) / cost(1)``.
  A token one pass decides costs ``cost(1)``; a drafted token that is
  accepted saves that, and costs the marginal ``cost(2) - cost(1)`` either way.
  When drafting and verifying alternate (synchronous speculation), drafting
  the token also holds up the target for one draft step ``d``, so the cost
  it adds is ``cost(2) - cost(1) + d``; in pipeinfer the draft works while the
  target does, and ``d`` is not charged.

The path probability of a node is the product of calibrated acceptance along
its unverified ancestors and itself, so speculation far beyond the verified
tokens needs more confidence, as ``p_recovery`` approximated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


class AcceptanceModel:
    """P(a draft token is accepted | the draft's probability q of it),
    calibrated online as ``q ** k``: one exponent, fitted by maximum
    likelihood (a grid over [0.1, 4]) to the last ``window`` verified draft
    tokens. k < 1 for an under-confident draft (SmolLM2-135M drafting for its
    self-merge accepts tokens of q = 0.25 about half the time), k > 1 for an
    over-confident one. One parameter, so tokens of a confidence the cutoff
    never lets through are still estimated from the others.

    Args:
        window: observations kept (most recent).
        refit_every: observations between fits.
    """

    GRID = np.geomspace(0.1, 4.0, 60)

    def __init__(self, window: int = 512, refit_every: int = 16):
        self.window = window
        self.refit_every = refit_every
        self.k = 1.0
        self._q: list[float] = []
        self._a: list[bool] = []
        self._new = 0

    def p(self, q: float) -> float:
        """Estimated probability (0..1) that a draft token of draft
        probability ``q`` (0..1) is accepted."""
        return float(min(1.0, max(q, 1e-6)) ** self.k)

    def observe(self, q: float, accepted: bool) -> None:
        """A draft token of probability ``q`` was verified: accepted or not."""
        self._q.append(min(1.0 - 1e-6, max(float(q), 1e-6)))
        self._a.append(bool(accepted))
        if len(self._q) > self.window:
            del self._q[0], self._a[0]
        self._new += 1
        if self._new >= self.refit_every:
            self._new = 0
            self._fit()

    def _fit(self) -> None:
        logq = np.log(np.asarray(self._q))[None, :]                  # (1, n)
        a = np.asarray(self._a, dtype=float)[None, :]
        pk = np.exp(self.GRID[:, None] * logq)                          # (grid, n)
        ll = (a * np.log(np.clip(pk, 1e-12, 1)) + (1 - a) * np.log(np.clip(1 - pk, 1e-12, 1))).sum(axis=1)
        self.k = float(self.GRID[int(np.argmax(ll))])


@dataclass
class PassCost:
    """Target cost per pass against tokens per pass, as an exponentially
    weighted mean per size (seconds).

    Attributes:
        alpha: weight of a new observation.
        max_tokens: sizes above it are pooled with it.
    """

    alpha: float = 0.2
    max_tokens: int = 16
    mean: dict = field(default_factory=dict)

    def observe(self, n_tokens: int, seconds: float) -> None:
        """A pass of ``n_tokens`` tokens took ``seconds`` of the target's time."""
        if seconds <= 0 or n_tokens <= 0:
            return
        n = min(n_tokens, self.max_tokens)
        old = self.mean.get(n)
        self.mean[n] = seconds if old is None else old + self.alpha * (seconds - old)

    def cost(self, n_tokens: int) -> float | None:
        """Estimated seconds of a pass of ``n_tokens`` (linear fit over the
        sizes seen; None until two sizes were seen)."""
        if len(self.mean) < 2:
            return None
        ns = np.array(sorted(self.mean), dtype=float)
        ts = np.array([self.mean[int(n)] for n in ns])
        slope, icpt = np.polyfit(ns, ts, 1)
        return float(icpt + slope * n_tokens)


def draft_threshold(cost: PassCost, default: float, lo: float = 0.05, hi: float = 0.6,
                    draft_step_s: float = 0.0) -> float:
    """The least path probability (0..1) that makes a drafted token worth its
    place in a target pass: ``(cost(2) - cost(1) + draft_step_s) / cost(1)``
    (``draft_step_s``: seconds the target waits for the draft per drafted
    token; 0 when drafting overlaps verification), clipped to [lo, hi];
    ``default`` until the cost curve is known."""
    c1, c2 = cost.cost(1), cost.cost(2)
    if c1 is None or c2 is None or c1 <= 0:
        return default
    return float(min(hi, max(lo, (c2 - c1 + draft_step_s) / c1)))


def wait_pays(chain_p: Sequence[float], wait_s: float, n_pass: int, cost: PassCost) -> bool:
    """The per-pass decision of the pipelined loop (issue "Speculation that
    pays", part 2): the head's target stage is idle and could take the
    ``n_pass`` tokens drafted so far now, or idle ``wait_s`` seconds more for
    the draft's next token and take ``n_pass + 1``. Waiting pays when it
    gives more expected tokens per second of the target:

        (1 + E + P * p) / (wait_s + cost(n + 1))  >  (1 + E) / cost(n)

    with ``chain_p`` the calibrated acceptance of each drafted token of the
    chain, E the expected accepted tokens of the chain (sum of its prefix
    products), P the probability the whole chain is accepted, p the next
    token's (estimated as the tip's), and 1 the token the pass decides in
    any case (the correction or the bonus token).

    Args:
        chain_p: calibrated acceptance (0..1) per drafted token, anchor
            first; non-empty.
        wait_s: seconds until the next drafted token is expected.
        n_pass: tokens the pass would carry now (>= 1).
        cost: the target's pass cost curve.

    Returns:
        False while the cost curve is unknown (send now, as before)."""
    c_now, c_next = cost.cost(n_pass), cost.cost(n_pass + 1)
    if c_now is None or c_next is None or c_now <= 0 or not chain_p:
        return False
    prefix, expected = 1.0, 0.0
    for p in chain_p:
        prefix *= p
        expected += prefix
    gain = prefix * chain_p[-1]
    return (1.0 + expected + gain) * c_now > (1.0 + expected) * (max(wait_s, 0.0) + c_next)


class AdaptiveCutoff:
    """The cutoff controller of adaptive speculation, with the interface of
    :class:`~ggpipe.speculation.cutoff.CutoffController`: :meth:`at` is the
    least path probability a drafted node needs, given the path probability
    ``path_p`` of its anchor (1 for a verified anchor).

    Args:
        acceptance: the calibration, shared across requests.
        cost: the pass cost curve, shared across requests.
        default: the threshold until the cost curve is known.
        draft_step: seconds per drafted token the target waits for (None:
            drafting overlaps verification; or the proposer's measured step
            cost, which may be None until measured).
    """

    def __init__(self, acceptance: AcceptanceModel, cost: PassCost, default: float,
                 draft_step: Callable[[], float | None] | None = None):
        self.acceptance = acceptance
        self.cost = cost
        self.default = default
        self.draft_step = draft_step

    @property
    def threshold(self) -> float:
        """Least path probability of a drafted token beyond the first below
        an anchor: to reach it the draft decodes the token before it, one
        draft step (charged when the target waits for it)."""
        d = self.draft_step() if self.draft_step is not None else None
        return draft_threshold(self.cost, self.default, draft_step_s=d or 0.0)

    @property
    def first_threshold(self) -> float:
        """The same for the first token below an anchor: the draft decodes
        the anchor in any case, so no draft step is charged."""
        return draft_threshold(self.cost, self.default)

    def at(self, path_p: float) -> float:
        """Cutoff (compared with the path probability accumulated below the
        anchor) for an anchor of path probability ``path_p``."""
        return self.threshold / max(path_p, 1e-9)

    def first_at(self, path_p: float) -> float:
        """:meth:`at` for the first token below the anchor."""
        return self.first_threshold / max(path_p, 1e-9)

    def exhausted_at(self, path_p: float) -> bool:
        """No node below such an anchor can be worth drafting."""
        return self.at(path_p) >= 1.0

    def continued(self) -> None:
        """(the path probability already accounts for depth)"""

    def failed_while_idle(self) -> None:
        """(nothing to adapt: the threshold follows measured costs)"""

    def accepted(self) -> None:
        """(acceptance is observed per token, see AcceptanceModel.observe)"""

    def rerooted(self) -> None:
        """(the path probability restarts at the new root by itself)"""
