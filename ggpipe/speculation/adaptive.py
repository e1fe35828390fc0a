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
* :func:`look_threshold` (synchronous speculation, once the loop's decode
  rate is measured, :class:`DecodeRate`): the draft step is charged where it
  is spent, on decoding the chain's tip to see the next token, whether that
  token is then kept or not. The tip is decoded only when the expected gain
  of the next token pays for ``rate * d``; a token is kept when its path
  probability reaches ``rate * (cost(2) - cost(1))``. Costs become tokens
  through the measured rate: maximising tokens per second is maximising
  tokens minus ``rate`` times seconds at the optimal rate (Dinkelbach), and
  ``1 / cost(1)`` above is the rate without speculation.

The path probability of a node is the product of calibrated acceptance along
its unverified ancestors and itself, so speculation far beyond the verified
tokens needs more confidence, as ``p_recovery`` approximated.
"""

from __future__ import annotations

from collections import deque
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

    def __init__(self, window: int = 512, refit_every: int = 16, looks: int = 256):
        self.window = window
        self.refit_every = refit_every
        self.k = 1.0
        self._q: list[float] = []
        self._a: list[bool] = []
        self._new = 0
        self._looked: deque[float] = deque(maxlen=looks)

    def p(self, q: float) -> float:
        """Estimated probability (0..1) that a draft token of draft
        probability ``q`` (0..1) is accepted."""
        return float(min(1.0, max(q, 1e-6)) ** self.k)

    def at_look(self, q: float) -> float:
        """:meth:`p` for a token the draft has just drafted (whether or not
        it goes into a tree); its draft probability is kept (the last
        ``looks``) for :meth:`looked`."""
        self._looked.append(min(1.0, max(float(q), 1e-6)))
        return self.p(q)

    def looked(self) -> np.ndarray:
        """Calibrated acceptance (float64 (n,), 0..1) of the last drafted
        tokens: what the draft's next token is likely to be worth."""
        return np.asarray(self._looked, dtype=np.float64) ** self.k

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
        self.k = fit_exponent(self._q, self._a, self.GRID)


def fit_exponent(q: Sequence[float], accepted: Sequence[bool], grid: np.ndarray = AcceptanceModel.GRID) -> float:
    """The exponent k of P(accepted | draft probability q) = q ** k that
    makes the observations most likely (maximum likelihood over ``grid``,
    by default 60 values from 0.1 to 4): ``q`` the draft's probabilities of
    its tokens (0..1), ``accepted`` whether each was the target's. 1.0 with
    no observations."""
    if len(q) == 0:
        return 1.0
    logq = np.log(np.clip(np.asarray(q, dtype=float), 1e-6, 1.0 - 1e-6))[None, :]   # (1, n)
    a = np.asarray(accepted, dtype=float)[None, :]
    pk = np.exp(grid[:, None] * logq)                                          # (grid, n)
    ll = (a * np.log(np.clip(pk, 1e-12, 1)) + (1 - a) * np.log(np.clip(1 - pk, 1e-12, 1))).sum(axis=1)
    return float(grid[int(np.argmax(ll))])


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
    _fit: tuple[float, float] | None = field(default=None, init=False, repr=False)  # (slope, intercept)
    _last_finish: float = field(default=0.0, init=False, repr=False)   # when the pass before finished

    def finished(self, n_tokens: int, started_at: float, finished_at: float, counts: bool = True) -> None:
        """A pass of ``n_tokens`` tokens, submitted at ``started_at`` and
        finished at ``finished_at`` (seconds, the pipelines' clock:
        ``RunResult.finished_at``), in the order the passes finish. Its
        service time runs from the later of its submission and the previous
        pass's finish (a pass queued behind another waits for it, which is
        not its cost); it is observed when ``counts`` (a cancelled pass, or
        one of another shape, only moves the previous finish)."""
        if counts:
            self.observe(n_tokens, finished_at - max(started_at, self._last_finish))
        self._last_finish = finished_at

    def observe(self, n_tokens: int, seconds: float) -> None:
        """A pass of ``n_tokens`` tokens took ``seconds`` of the target's time."""
        if seconds <= 0 or n_tokens <= 0:
            return
        n = min(n_tokens, self.max_tokens)
        old = self.mean.get(n)
        self.mean[n] = seconds if old is None else old + self.alpha * (seconds - old)
        self._fit = None

    def cost(self, n_tokens: int) -> float | None:
        """Estimated seconds of a pass of ``n_tokens`` (linear fit over the
        sizes seen, refitted only after a new observation; None until two
        sizes were seen)."""
        if len(self.mean) < 2:
            return None
        if self._fit is None:
            ns = np.array(sorted(self.mean), dtype=float)
            ts = np.array([self.mean[int(n)] for n in ns])
            slope, icpt = np.polyfit(ns, ts, 1)
            self._fit = float(slope), float(icpt)
        slope, icpt = self._fit
        return float(icpt + slope * n_tokens)


@dataclass
class DecodeRate:
    """Tokens decided per second of decoding (the loop's own throughput),
    as a ratio of exponentially decayed sums: each observation weighs
    ``1 - alpha`` times the one after it.

    Attributes:
        alpha: decay per observation.
    """

    alpha: float = 0.1
    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, n_tokens: int, seconds: float) -> None:
        """``n_tokens`` tokens were decided ``seconds`` after the previous decision."""
        if seconds <= 0:
            return
        self.tokens = (1.0 - self.alpha) * self.tokens + n_tokens
        self.seconds = (1.0 - self.alpha) * self.seconds + seconds

    def rate(self) -> float | None:
        """Tokens per second, or None before the first decision."""
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens > 0 else None


@dataclass
class Calibration:
    """What adaptive depth learns of a target and draft pair, kept by the
    loop that drafts and shared across its requests: the draft's
    calibrated acceptance, the target's pass cost curve and the loop's
    decode rate (:class:`AdaptiveCutoff` reads all three)."""

    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    pass_cost: PassCost = field(default_factory=PassCost)
    decode_rate: DecodeRate = field(default_factory=DecodeRate)


def look_threshold(accept: np.ndarray, gain_bar: float, look_cost: float) -> float:
    """The least path probability P of a chain's tip at which decoding the
    tip, to see the draft's next token, pays for itself: the next token is
    worth ``max(0, P a - gain_bar)`` (kept in the tree only when its path
    probability P a reaches ``gain_bar``), and the look costs ``look_cost``
    in the same unit (tokens: seconds times the decode rate), so

        mean over a of max(0, P a - gain_bar)  >=  look_cost

    with ``a`` the calibrated acceptance of recently drafted tokens (an
    optimal-stopping rule with one step of look-ahead; the ratio of tokens
    to time is maximised by comparing gains with ``rate`` times costs,
    Dinkelbach's method for fractional programs).

    Args:
        accept: calibrated acceptance samples (0..1), float (n,).
        gain_bar: the least path probability a token needs to be kept.
        look_cost: the look's cost in tokens (>= 0).

    Returns:
        P in (0, 1]; ``inf`` when even P = 1 does not pay; 0 with no
        samples (look, as before)."""
    a = np.asarray(accept, dtype=np.float64)
    if a.size == 0 or look_cost <= 0:
        return 0.0

    def gain(pp: float) -> float:
        return float(np.maximum(pp * a - gain_bar, 0.0).mean())

    if gain(1.0) < look_cost:
        return float("inf")
    lo, hi = 0.0, 1.0
    for _ in range(30):              # gain is increasing in P: bisection
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gain(mid) < look_cost else (lo, mid)
    return hi


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
    """The per-pass decision of the pipelined loop: the head's target stage
    is idle and could take the ``n_pass`` tokens drafted so far now, or idle
    ``wait_s`` seconds more for the draft's next token and take
    ``n_pass + 1``. Waiting pays when it gives more expected tokens per
    second of the target:

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
    ``path_p`` of its anchor (1 for a verified anchor); :meth:`look_at` the
    least path probability of a chain's tip worth decoding to see the token
    after it.

    Synchronous speculation (``draft_step`` given), once the decode rate
    ``rate`` (tokens/s) and the draft step ``d`` are measured: a drafted
    token is kept when its path probability reaches ``rate * (cost(2) -
    cost(1))`` (what it adds to the target's pass, in tokens), and the tip is
    decoded to see one more token only when :func:`look_threshold` says the
    expected gain pays for ``rate * d``. A confidence cutoff alone pays that
    draft step for the token it then drops, once per micro-batch. Until then
    (and in pipeinfer, where drafting overlaps verification):
    :func:`draft_threshold`, and every tip is decoded.

    Args:
        acceptance: the calibration, shared across requests.
        cost: the pass cost curve, shared across requests.
        default: the threshold until the cost curve is known.
        draft_step: seconds per drafted token the target waits for (None:
            drafting overlaps verification; or the proposer's measured step
            cost, which may be None until measured).
        rate: the decode loop's measured tokens per second (None until
            measured), for the synchronous rule.
    """

    def __init__(self, acceptance: AcceptanceModel, cost: PassCost, default: float,
                 draft_step: Callable[[], float | None] | None = None,
                 rate: Callable[[], float | None] | None = None):
        self.acceptance = acceptance
        self.cost = cost
        self.default = default
        self.draft_step = draft_step
        self.rate = rate

    def _serial(self, lo: float = 0.05, hi: float = 0.6) -> tuple[float, float] | None:
        """When the synchronous rule applies: (the least path probability a
        token needs, ``rate * (cost(2) - cost(1))`` clipped to [lo, hi]; a
        look's cost in tokens, ``rate * d``)."""
        if self.draft_step is None or self.rate is None:
            return None
        d, lam = self.draft_step(), self.rate()
        c1, c2 = self.cost.cost(1), self.cost.cost(2)
        if d is None or lam is None or c1 is None or c2 is None:
            return None
        return float(min(hi, max(lo, lam * (c2 - c1)))), lam * d

    @property
    def threshold(self) -> float:
        """Least path probability of a drafted token beyond the first below
        an anchor: to reach it the draft decodes the token before it, one
        draft step (charged when the target waits for it, unless
        :attr:`look_threshold` charges it)."""
        serial = self._serial()
        if serial is not None:
            return serial[0]
        d = self.draft_step() if self.draft_step is not None else None
        return draft_threshold(self.cost, self.default, draft_step_s=d or 0.0)

    @property
    def first_threshold(self) -> float:
        """The same for the first token below an anchor: the draft decodes
        the anchor in any case, so no draft step is charged."""
        serial = self._serial()
        if serial is not None:
            return serial[0]
        return draft_threshold(self.cost, self.default)

    @property
    def look_threshold(self) -> float:
        """Least path probability of a chain's tip worth a draft step to see
        the next token (synchronous speculation; 0: always)."""
        serial = self._serial()
        return 0.0 if serial is None else look_threshold(self.acceptance.looked(), *serial)

    def at(self, path_p: float) -> float:
        """Cutoff (compared with the path probability accumulated below the
        anchor) for an anchor of path probability ``path_p``."""
        return self.threshold / max(path_p, 1e-9)

    def first_at(self, path_p: float) -> float:
        """:meth:`at` for the first token below the anchor."""
        return self.first_threshold / max(path_p, 1e-9)

    def look_at(self, path_p: float) -> float:
        """The tip's least path probability below an anchor of path
        probability ``path_p`` worth decoding it for the next token."""
        return self.look_threshold / max(path_p, 1e-9)

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
