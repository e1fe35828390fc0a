"""Whether drafting pays at all: the per-step decision of synchronous
speculation (``--mode speculative``). Pure, no MPI.

In speculative mode the target waits while the draft works, so every
drafting attempt costs the draft's step (its decode of the anchor: the
draft's distribution of the first token below it, ``d`` seconds), and a
verification batch of k + 1 tokens costs the target ``c(k+1) - c(1)`` more
than the root alone. It gains the target passes its accepted tokens save,
``c(1)`` each. Where the draft is seldom right (a prompt unlike its
training, a weak draft), attempts lose: measured on three prompts outside
the bench set, speculative mode with its defaults ran at 0.83x iterative.
The adaptive cutoff (ggpipe.speculation.adaptive) sets how deep a chain
goes once the anchor is decoded; this gate decides before that step:

    draft  iff  y * c(1) >= k * d + max(0, c(k + 1) - c(1))

with ``y`` the accepted draft tokens per attempt and ``k`` the drafted
tokens per attempt (at least 1), exponentially weighted means over the
attempts so far, ``c`` the target's pass cost curve and ``d`` the draft's
measured step: an attempt as deep as attempts have been costs a draft step
per drafted token (the first token's step decodes the anchor, each further
one the token before it) and a verification pass of its tokens and the
root. Until ``k`` is known (or where the caller has no cost for that pass)
the rule is the one-token chain's, ``d + max(0, c(2) - c(1))``, which
under-counts a deep chain: measured on a 2-core host with the
SmolLM2-135M draft (18 ms a step) for the F32 goliath (31 ms a token), it
kept drafting 4-token chains that took 170 ms for 4 tokens. An attempt is made anyway after
``explore_every`` roots in a row without one (the wait doubles after each
such exploration, up to ``explore_max``, and resets once drafting pays), so
``y`` follows text where the draft becomes right again. Until ``y`` and
``c(1)`` are known every root is drafted (an
unknown ``c(2)`` counts as ``c(1)``), except that when every pass carried a
chain for ``explore_every`` attempts, one root goes alone so ``c(1)`` is
measured. An attempt the draft declines (it drafts nothing: its first token
falls under the confidence cutoff) verifies nothing, so where it was made to
learn (an exploration, or before the yield is known) it is neither counted
nor timed, and the next root attempts again, up to ``explore_retries`` times
in a row: otherwise a few positions where the draft is unsure would keep
drafting off at the positions where it is right. The continuous-batching
scheduler asks the same rule of a request that generates alone
(ggpipe.decoding.parallel.scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftGate:
    """Attributes:
        alpha: weight of a new attempt in the yield's mean.
        explore_every: after this many roots in a row without an attempt, make
            one; each such attempt that does not bring the yield above the
            cost doubles the wait, up to ``explore_max`` (an exploration costs
            a draft step and a bigger pass; where the draft stays wrong,
            they become rare), and an attempt that pays resets it.
        explore_max: the longest wait between explorations (roots).
        yield_: accepted draft tokens per attempt (None before the first).
        depth: drafted tokens per attempt (None until an attempt reports them).
        skipped: roots sent without drafting (``draft_skipped`` in ``--json``).
        explored: attempts made only to keep measuring.
        explore_retries: declined attempts in a row that are made again at
            the next root instead of counting (:meth:`observe`).

    The wall-time arms (:meth:`timed`) age by roots, not by their own
    samples: an arm's sums decay by ``decay`` for every timed root of either
    kind since its last sample, so an exploration after a run of plain roots
    outweighs the drafted roots measured before that run (the first roots of
    a request, timed while the weights and the draft were still cold, no
    longer keep a draft that pays below the plain arm). Whether an arm is
    measured at all counts its tokens without decay. They are fed root by
    root: :meth:`root` at
    each new root of a request times the last one, :meth:`rooted` remembers
    this one once the decision is made, :meth:`forget_root` drops it (the
    request no longer decides alone: the scheduler's other slots filled).
    """

    alpha: float = 0.25
    explore_every: int = 8
    explore_max: int = 64
    explore_retries: int = 3
    yield_: float | None = None
    depth: float | None = None
    skipped: int = 0
    explored: int = 0
    _run: int = 0    # roots in a row without an attempt
    _blind: int = 0  # attempts in a row made without knowing c(1)
    _wait: int = 0   # roots between explorations now (0: explore_every)
    _learning: int | None = None  # the last attempt was made to learn: the wait before it (0: none yet)
    _declined: int = 0            # learning attempts declined in a row
    rates: dict = None  # "draft" / "plain" -> (tokens, seconds), sums decayed by the roots timed since
    _timed: int = 0     # roots timed so far (either arm)
    _arm: dict = None   # "draft" / "plain" -> (tokens measured, undecayed; _timed at its last sample)
    _root: tuple | None = None  # the last root: (its request, when, tokens out then, drafted)

    def root(self, owner: object, now: float, tokens_out: int) -> None:
        """A new root of ``owner`` (a request) at ``now`` (seconds, the
        pipelines' clock) with ``tokens_out`` tokens generated: the last
        root, when it was ``owner``'s, gave ``tokens_out`` minus its count in
        ``now`` minus its time (:meth:`timed`, drafted or plain)."""
        last, self._root = self._root, None
        if last is not None and last[0] is owner:
            self.timed(last[3], tokens_out - last[2], now - last[1])

    def rooted(self, owner: object, now: float, tokens_out: int, drafted: bool) -> None:
        """This root of ``owner`` went with an attempt (``drafted``) or
        without: timed at its next root (:meth:`root`)."""
        self._root = (owner, now, tokens_out, drafted)

    def forget_root(self) -> None:
        """The last root is not timed (its request stopped deciding alone)."""
        self._root = None

    def timed(self, drafted: bool, tokens: int, seconds: float, decay: float = 0.9) -> None:
        """A root's outcome in wall time: ``tokens`` decided in ``seconds``
        from the root being handed to the target (``drafted``: with an
        attempt below it) to the next root. The arm's sums are decayed by
        ``decay`` per root timed since its last sample (this one included),
        then the root is added."""
        if seconds <= 0:
            return
        if self.rates is None:
            self.rates, self._arm = {}, {}
        self._timed += 1
        arm = "draft" if drafted else "plain"
        t, sec = self.rates.get(arm, (0.0, 0.0))
        seen, at = self._arm.get(arm, (0, self._timed - 1))
        age = decay ** (self._timed - at)
        self.rates[arm] = (age * t + tokens, age * sec + seconds)
        self._arm[arm] = (seen + tokens, self._timed)

    def measured(self) -> bool | None:
        """Whether drafting gave more tokens per second than plain roots so
        far (each arm measured over at least 3 tokens), or None."""
        r, seen = self.rates or {}, self._arm or {}
        if any(k not in r or seen[k][0] < 3 for k in ("draft", "plain")):
            return None
        (td, sd), (tp, sp) = r["draft"], r["plain"]
        return td / sd >= tp / sp

    def observe(self, accepted: int, drafted: int | None = None) -> None:
        """An attempt's outcome: ``accepted`` of its ``drafted`` draft tokens
        (None: not reported) were accepted. ``drafted`` 0 is an attempt the
        draft declined: where it was made to learn (an exploration, or
        before the yield was known) and fewer than ``explore_retries``
        were declined in a row, it is not counted, its root is not timed
        (call this before :meth:`root` times it, or after :meth:`rooted`),
        and the next root attempts again."""
        if drafted == 0 and self._learning is not None and self._declined < self.explore_retries:
            self._declined += 1
            self._root = None
            if self._learning:                  # an exploration: made again at the next root, the wait as it was
                self._wait, self._run = self._learning, self._learning - 1
            return
        self._declined = 0                      # counted: the row of declines, if any, ends
        y = float(accepted)
        self.yield_ = y if self.yield_ is None else self.yield_ + self.alpha * (y - self.yield_)
        if drafted is not None:
            k = float(drafted)
            self.depth = k if self.depth is None else self.depth + self.alpha * (k - self.depth)

    def chain_size(self) -> int | None:
        """Tokens of the verification pass of an attempt as deep as attempts
        have been (``round(depth) + 1``), or None before one reported."""
        return None if self.depth is None else max(1, round(self.depth)) + 1

    def pays_at(self, step_s: float | None, cost) -> bool:
        """:meth:`pays` with the target's costs read from ``cost`` (a
        :class:`~ggpipe.speculation.adaptive.PassCost`): ``c(1)`` (while one
        size only was seen, its mean), ``c(2)`` and ``c(chain_size())``."""
        c1 = cost.cost(1) if len(cost.mean) > 1 else cost.mean.get(1)
        k = self.chain_size()
        return self.pays(step_s, c1, cost.cost(2), None if k is None else cost.cost(k))

    def pays(self, step_s: float | None, c1: float | None, c2: float | None, c_chain: float | None = None) -> bool:
        """Draft at this root? ``step_s``: the draft's seconds per step
        (0 for an instant proposer); ``c1``, ``c2``: the target's seconds
        for a pass of 1 and 2 tokens (None while unmeasured; an unknown
        ``c2`` counts as ``c1``: no batch was sent yet, so none cost more);
        ``c_chain``: the target's seconds for a pass of :meth:`chain_size`
        tokens (None: the one-token chain's rule, with ``c2``)."""
        if c1 is None and self.yield_ is not None and self._blind + 1 >= self.explore_every:
            self._blind = 0              # every pass had a chain: send one token alone, to learn c(1)
            self.skipped += 1
            return False
        if self.yield_ is None or step_s is None or c1 is None:
            self._blind += c1 is None
            return self._attempt(learning=0 if self.yield_ is None else None)
        deep = c_chain is not None and self.depth is not None
        c_pass = c_chain if deep else c2
        extra = 0.0 if c_pass is None else max(0.0, c_pass - c1)
        steps = max(1.0, self.depth) if deep else 1.0
        measured = self.measured()
        if measured if measured is not None else self.yield_ * c1 >= steps * step_s + extra:
            self._wait = 0
            return self._attempt()
        wait = self._wait or self.explore_every
        if self._run + 1 >= wait:
            self.explored += 1
            self._wait = min(2 * wait, self.explore_max)
            return self._attempt(learning=wait)
        self._run += 1
        self.skipped += 1
        return False

    def _attempt(self, learning: int | None = None) -> bool:
        """An attempt; ``learning``: made to learn (the exploration's wait,
        0 before the yield is known), else None."""
        self._run, self._learning = 0, learning
        return True
