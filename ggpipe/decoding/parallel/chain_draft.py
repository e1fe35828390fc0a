"""A drafting strategy as the continuous-batching scheduler asks for one:
``draft(context, k) -> tokens``, a chain drafted below the last token of a
request that generates alone, waited for (synchronous speculation: the
target has nothing else to compute for that request meanwhile).

The scheduler (ggpipe.decoding.parallel.scheduler) runs one request's tokens beside
many; while a request generates alone it may send a drafted chain below
its next token, verified in a micro-batch of its own (the draft drafts
greedily: its chain is a function of the context, verified as tokens the
draft chose, for greedy and sampled requests alike). What it asks of
a drafter is :class:`SlotDrafter`: a lookup from the context alone (an
n-gram lookup: ``chain_lookup`` of its strategy) is instant and wrapped in
:class:`LookupDrafter`; any other ``--spec-type`` strategy, the draft model
among them, speaks the :class:`~ggpipe.speculation.proposers.base.Proposer`
protocol (``begin`` / ``ready`` / ``poll``), and :class:`ChainDrafter` drives
it: ``begin`` below the context, wait (bounded) for the proposer's results,
take the tree's first-child chain (a tree's first child of a node is the
draft's best token: llama.cpp ``common_speculative_draft``'s chain), and
consume whatever the proposer still has in flight (``settle``) so that the
draft's pipeline is idle between chains. The proposer keeps its KV across
calls and across requests: ``begin`` decodes only what its KV lacks
(``sync_kv``: the common prefix is kept, the rest removed and decoded).
While the scheduler sends a request's roots without a chain, the draft
follows its context without being waited for (:meth:`ChainDrafter.follow`,
as speculative mode's skipped roots do: the draft's ranks work beside the
target's), and a chain is drafted only once the draft has caught up
(:meth:`ChainDrafter.caught_up`): a request that starts, or is left alone
when the others end, has its prompt decoded by the draft while its first
tokens go plainly, instead of the head waiting for that prefill.

No MPI here; the waits are the head's (``ggpipe.pipeline.waiting``).
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

from ggpipe.kv_reuse import reusable_prefix
from ggpipe.pipeline.waiting import Wait, poll_wait
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.adaptive import AcceptanceModel
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.proposers.base import Cuttable, Proposer, implements
from ggpipe.speculation.tree import SpecTree

__all__ = ["CATCH_UP_MAX", "ChainDrafter", "LookupDrafter", "SlotDrafter", "as_slot_drafter", "first_child_nodes"]

CATCH_UP_MAX = 8   # tokens the draft may lack when a chain starts: one short batch, about a draft step


def first_child_nodes(tree: SpecTree) -> list[int]:
    """The node indices of ``tree`` along the first child of each node, from
    the anchor down (the draft's greedy chain; siblings are the runner-ups)."""
    out, node = [], -1
    while True:
        kids = tree.children(node)
        if not kids:
            return out
        node = kids[0]
        out.append(node)


@runtime_checkable
class SlotDrafter(Protocol):
    """What the scheduler asks of a drafter (ggpipe.decoding.parallel.lone_drafts).

    Attributes:
        has_ranks: drafts on ranks of its own (a draft model's pipeline),
            so a chain is waited for and the draft follows the request
            between chains; False: instant, from the context alone.
        step_s: seconds per drafted token (None until measured; 0.0 for an
            instant drafter), what the scheduler's gate charges.
    """

    has_ranks: bool

    @property
    def step_s(self) -> float | None:
        """Seconds per drafted token: None until measured, 0.0 for an instant drafter."""

    def __call__(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``context`` (token ids)."""

    def follow(self, context: list[int]) -> None:
        """Let the draft's KV follow ``context`` without waiting."""

    def caught_up(self, context: list[int]) -> bool:
        """A chain below ``context`` would wait for little more than its own steps."""

    def settle(self) -> None:
        """Consume the draft's work still in flight (before a shutdown)."""

    def take(self, context: list[int], k: int, least: int = 1) -> list[int]:
        """Without waiting: up to ``k`` tokens drafted below ``context`` as
        far as they are drafted (while drafting goes on, at least
        ``least``); else [] (and drafting below ``context`` starts, when the
        draft is free)."""

    def arrived(self) -> bool:
        """A result of the drafting :meth:`take` started has arrived (consumed
        by the call: True once per result)."""

    def drop(self) -> None:
        """Abandon the drafting :meth:`take` started (its runs are consumed later)."""

    def observe_verified(self, at: int, chain: list[int], n_accepted: int) -> None:
        """The target verified ``chain`` (drafted tokens, the first at
        position ``at``): its first ``n_accepted`` tokens were accepted and
        the one after them, if any, refused (what adaptive depth
        calibrates the draft's confidence on)."""


def _below(begun: list[int], chain: list[int], context: list[int]) -> list[int] | None:
    """What of ``chain``, drafted below ``begun``, lies below ``context``:
    where ``context`` is ``begun`` followed by the chain's first tokens, the
    chain's rest ([] when all of it is in ``context``, or ``context`` goes
    on beyond it along it); None where ``context`` does not go on from
    ``begun`` along the chain."""
    n = len(begun)
    if len(context) < n or context[:n] != begun:
        return None
    extra = context[n:]
    m = min(len(extra), len(chain))
    if extra[:m] != chain[:m]:
        return None
    return chain[len(extra):]


class LookupDrafter:
    """An instant :class:`SlotDrafter` over ``lookup(context, k) -> tokens``
    (prompt lookup: ``NgramProposer.chain_lookup``): no ranks, nothing to
    follow or settle."""

    has_ranks = False
    step_s = 0.0

    def __init__(self, lookup: Callable[[list[int], int], list[int]]):
        self.lookup = lookup

    def __call__(self, context: list[int], k: int) -> list[int]:
        return self.lookup(context, k)

    def follow(self, context: list[int]) -> None:
        """Nothing to follow."""

    def caught_up(self, context: list[int]) -> bool:
        """Always True: a lookup has no KV to catch up."""
        return True

    def settle(self) -> None:
        """Nothing in flight."""

    def take(self, context: list[int], k: int, least: int = 1) -> list[int]:
        """The lookup itself: it is instant."""
        return self.lookup(context, k)

    def arrived(self) -> bool:
        """Nothing is ever in flight."""
        return False

    def drop(self) -> None:
        """Nothing in flight."""

    def observe_verified(self, at: int, chain: list[int], n_accepted: int) -> None:
        """Nothing to calibrate: a lookup has no confidence."""


def as_slot_drafter(draft) -> SlotDrafter | None:
    """``draft`` as a :class:`SlotDrafter`: None stays None, a plain
    function ``draft(context, k)`` is an instant :class:`LookupDrafter`."""
    if draft is None or isinstance(draft, SlotDrafter):
        return draft
    return LookupDrafter(draft)


class ChainDrafter:
    """``draft(context, k)``: up to ``k`` tokens that may follow ``context``
    (list of token ids; ``context[-1]`` is the anchor, at position
    ``len(context) - 1``), drafted greedily by ``proposer`` (for greedy and
    sampled requests alike: the chain is the draft's choice, verified as
    such, :func:`~ggpipe.speculation.verify.verify_step`).

    Args:
        proposer: the strategy (started here once, greedy; its KV follows
            each call's context).
        cutoff: the confidence cutoff (PipeInfer IV.B.2): a fixed
            probability (a draft-model chain stops where the draft's
            probability of its next token falls below it), or the controller
            :meth:`SpecSettings.cutoff <ggpipe.decoding.settings.SpecSettings.cutoff>`
            makes (with ``--p-accept auto``, adaptive depth, read at each
            chain's start, as one request at a time drafts).
        idle: the head's wait (``wait(ready, timeout_s)``); None: polling.
        timeout_s: bound of each wait for the proposer (seconds).
        acceptance: with adaptive depth, the draft's calibrated acceptance
            (:class:`~ggpipe.speculation.adaptive.AcceptanceModel`): the
            cutoff applies to the product of calibrated acceptance along a
            chain, and :meth:`observe_verified` calibrates it; None: to
            each token's draft probability.

    Attributes:
        step_s: the proposer's measured seconds per drafted token (its first
            token's cost, what a chain costs before the target gains
            anything; None until measured, 0 for an instant proposer). The
            scheduler's gate (ggpipe.speculation.gate) charges it.

    Raises (from a call):
        RankTimeoutError: the proposer's pipeline did not answer within
            ``timeout_s`` (the wait names it); errors of the draft's ranks
            (ProtocolError, RankFailedError) as its pipeline raises them.
    """

    has_ranks = True

    def __init__(self, proposer: Proposer, cutoff, idle: Wait | None = None, timeout_s: float = 60.0,
                 acceptance: AcceptanceModel | None = None):
        self.proposer = proposer
        self.cutoff = CutoffController(float(cutoff), 0.0, 0.0) if isinstance(cutoff, (int, float)) else cutoff
        self.acceptance = acceptance
        self.idle = idle or poll_wait
        self.timeout_s = timeout_s
        self._started = False
        self._drafted: dict[int, tuple[int, float]] = {}   # position -> (drafted token, its draft probability)
        self._begun: list[int] | None = None     # the context below which take() drafts now
        self._done: tuple[list[int], list[int]] | None = None   # (context, chain) drafted, not taken yet

    def _start(self) -> None:
        """Start the proposer once, greedy (its chains are the draft's choice, whatever the request samples)."""
        if not self._started:
            self.proposer.start(SamplingParams(), 0, self.acceptance.at_look if self.acceptance is not None else None)
            self._started = True

    def _begin(self, context: list[int], k: int) -> None:
        """Drafting of up to ``k`` tokens below ``context`` starts, cut where
        :attr:`cutoff` says (the anchor is verified or taken as such: path
        probability 1)."""
        c = self.cutoff
        self.proposer.begin(list(context), c.at(1.0), k, first_cutoff=c.first_at(1.0), look_cutoff=c.look_at(1.0))

    def _chain(self, tree: SpecTree, context: list[int]) -> list[int]:
        """The first-child chain of ``tree``, drafted below ``context``;
        each token's draft probability is kept by position for
        :meth:`observe_verified`."""
        nodes = first_child_nodes(tree)
        if self.acceptance is not None:
            if len(self._drafted) > 1024:      # positions far behind this chain are verified long ago
                self._drafted = {p: v for p, v in self._drafted.items() if p >= len(context) - 64}
            for i, j in enumerate(nodes):
                self._drafted[len(context) + i] = (tree.tokens[j], tree.draft_p[j])
        return [tree.tokens[j] for j in nodes]

    def observe_verified(self, at: int, chain: list[int], n_accepted: int) -> None:
        """Calibrate the acceptance model (adaptive depth) on the verified
        tokens of ``chain`` (the first at position ``at``) that this drafter
        drafted: the first ``n_accepted`` accepted, the next one refused."""
        if self.acceptance is None:
            return
        for i, token in enumerate(chain[:n_accepted + 1]):
            drafted = self._drafted.get(at + i)
            if drafted is not None and drafted[0] == token:
                self.acceptance.observe(drafted[1], i < n_accepted)

    @property
    def step_s(self) -> float | None:
        """0.0 for an instant proposer; otherwise the proposer's measured seconds
        per drafted token (None until measured)."""
        return 0.0 if self.proposer.instant else self.proposer.step_s

    def __call__(self, context: list[int], k: int) -> list[int]:
        p = self.proposer
        if k <= 0:
            return []
        self._start()
        if self._begun is not None:     # drafting that take() started: dropped, its runs consumed first
            self.drop()
            p.settle(self.timeout_s)
        p.observe(list(context))
        self._begin(context, k)
        try:
            tree = p.poll()
            while tree is None and p.active:
                if not p.ready():
                    self.idle(p.ready, self.timeout_s)
                tree = p.poll()
        finally:
            p.settle(self.timeout_s)   # consume draft runs still in flight: the draft's pipeline idles between chains
        return self._chain(tree, context)[:k] if tree is not None else []

    def follow(self, context: list[int]) -> None:
        """Let the draft's KV follow ``context`` without waiting: results
        that have arrived are consumed, the tokens it lacks (all but the
        anchor, whose logits the next chain asks for) are submitted
        (``Proposer.prefill``). Nothing for an instant proposer."""
        p = self.proposer
        if p.instant:
            return
        self._start()
        self.drop()
        p.drain_ready()
        p.prefill(list(context[:-1]))

    def caught_up(self, context: list[int]) -> bool:
        """No draft work in flight (what :meth:`follow` submitted has been
        decoded and consumed), and the draft's KV lacks at most
        ``CATCH_UP_MAX`` tokens of ``context`` before its anchor (a proposer
        that keeps no KV of the context, ``cursor`` None, counts as holding
        it): a chain now waits for little more than its own steps."""
        p = self.proposer
        p.drain_ready()
        if p.busy():
            return False
        return p.cursor is None or len(context) - 1 - reusable_prefix(p.cursor, context[:-1], False) <= CATCH_UP_MAX

    def settle(self) -> None:
        """Consume every draft run still in flight (bounded by ``timeout_s``
        each): the scheduler drains before a shutdown."""
        self._begun = self._done = None
        self.proposer.settle(self.timeout_s)

    # -- drafting without waiting (PipeInfer's continuation, IV.A) ------------------

    def _pump(self) -> None:
        """Consume the draft results that have arrived (never blocks): those
        of the drafting :meth:`take` started (a finished chain is kept for
        it), and those of abandoned drafting or of :meth:`follow`."""
        p = self.proposer
        while self._begun is not None and p.active and p.ready():
            tree = p.poll()
            if tree is not None:
                self._done, self._begun = (self._begun, self._chain(tree, self._begun)), None
        if self._begun is not None and not p.active:
            self._begun = None
        p.drain_ready()

    def take(self, context: list[int], k: int, least: int = 1) -> list[int]:
        """Without waiting: up to ``k`` tokens drafted below ``context``
        (its last token the anchor), as far as the draft has drafted them:
        the drafting started by an earlier call goes on below the context it
        began with as long as ``context`` follows its chain, and what it has
        drafted beyond ``context`` (the tree so far, of a proposer that shows
        it: ``Cuttable.partial``) is returned while it goes on, once it is
        ``least`` tokens or more (a finished chain, however short); otherwise []
        and drafting below ``context`` starts where the draft is free
        (drafting below a context that ``context`` leaves is abandoned). The
        draft's ranks work meanwhile beside the target's: nothing is waited
        for (PipeInfer's continuous speculation, IV.A-B)."""
        if k <= 0:
            return []
        self._start()
        self._pump()
        done, self._done = self._done, None
        if done is not None:
            rest = _below(done[0], done[1], context)
            if rest:
                return rest[:k]
        p = self.proposer
        if self._begun is not None:          # still drafting: what it has drafted beyond ``context`` goes now
            tree = p.partial() if implements(p, Cuttable) else None
            rest = _below(self._begun, self._chain(tree, self._begun) if tree is not None else [], context)
            if rest is not None:
                return rest[:k] if len(rest) >= min(least, k) else []
            self.drop()     # the context left the drafting's chain: drafting below it again
        if self._begun is None and not p.active and not p.busy():
            p.observe(list(context))
            self._begun = list(context)
            self._begin(context, k)
            self._pump()     # a cached anchor's logits: the first level at once
        return []

    def arrived(self) -> bool:
        """A result of the drafting :meth:`take` started has arrived; it is
        consumed now (never blocks), so the draft's next step starts at once
        and the call is True once per result: a wait that wakes on it while
        no look-ahead row can go (the pipeline full, no room left in the
        request) waits for the next result, not spinning on this one."""
        if self._begun is None or not self.proposer.ready():
            return False
        self._pump()
        return True

    def drop(self) -> None:
        """Abandon the drafting :meth:`take` started (its runs in flight
        are consumed later, by :meth:`take`, :meth:`follow` or :meth:`settle`)."""
        if self._begun is not None:
            self.proposer.abandon()
        self._begun = self._done = None
