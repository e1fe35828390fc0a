"""The vote proposer: Minions' majority-voted speculator over several
proposers (Minions section 3.2; ``--spec-type vote --spec-vote draft,ngram``).

Every member drafts a chain below the same anchor; the chain the target
verifies is the majority-approved one (:func:`ggpipe.speculation.majority.majority_path`),
and the members' weights are learnt from the decided tokens
(:class:`ggpipe.speculation.majority.WeightedMajority`, fed by ``observe``).

Members: *leads* that draft on a model pipeline (``draft``, the draft model
on its own ranks; with several draft models, ``-md a,b``, ``draft`` stands
for one member per model: ``draft``, ``draft2``, ...) and any number of
instant ones (``ngram``), which draft on the head in microseconds. With one
lead, its chain grows one draft decode at a time, and the vote is taken as
it grows:

* as soon as an instant member outvotes the lead at some level (a decision
  the lead's later tokens cannot change), the lead's micro-batch is
  abandoned and the voted chain goes to the target at once;
* when the lead finishes, the vote over the finished chains is final (an
  instant member that agrees with the lead and goes on further extends it);
* PipeInfer's continuous speculation (``cut``) hands over the lead's chain
  while no member has outvoted it, and the vote starts again below its tip.

With several leads (each on its own ranks, drafting at the same time) the
vote is final when every lead has finished its chain. Continuous
speculation votes over the chains as far as they have grown and hands over
the longest lead chain the majority path runs through; the leads that drafted
exactly that chain go on below its tip, the others sit out until the
next cut finds them idle (their abandoned results consumed), and then
draft below the new tip with the others.

Node confidence (``SpecTree.draft_p``): the probability that at least one
of the members passing through the node is right, taking theirs as
independent, 1 - prod(1 - p_member) (a noisy-OR: agreement raises it), with
p_member the draft model's probability of its token, and for an instant
member its measured accuracy (right tokens among those judged, from the
decided text), since its own confidence is only a rule of thumb. The
voted chain is cut where that confidence (or with ``--p-accept auto`` the
product of its calibrated acceptance along the chain) falls below the cutoff.

Chains only (every member drafts with one branch). Stochastic sampling stays
exact: each node carries a one-hot draft distribution on its token, as the
n-gram proposer does; multi-step speculative sampling then accepts token x
with probability p(x) and otherwise samples from p without x, which yields
exactly p whatever the law of x was, as long as x does not depend on the
target's random draws.

The members themselves (building them, their chains below the anchor, what
is asked of every member or lead) are kept by
:class:`ggpipe.speculation.proposers.vote_members.VoteMembers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.cutoff import confident_depth
from ggpipe.speculation.majority import WeightedMajority, check_members, expand_members, majority_path, support
from ggpipe.speculation.proposers.base import (REGISTRY, ProposerBase, ProposerConfig, canonical_name,
                                               proposer_class)
from ggpipe.speculation.proposers.options import StrategyOptions, option
from ggpipe.speculation.proposers.vote_members import VoteMembers, chain_of
from ggpipe.speculation.tree import SpecTree


def parse_members(text: str) -> tuple[str, ...]:
    """``--spec-vote``: comma-separated registered proposer names (aliases
    allowed), distinct; ``draft`` alone stands for every draft model of
    ``-md a,b`` (at least two members once expanded: checked with -md,
    :meth:`VoteProposer.check_options`).

    Raises:
        ValueError: an unknown name or the vote itself, fewer than two
            members, or one named twice."""
    names = tuple(canonical_name(v.strip()) for v in text.split(",") if v.strip())
    bad = [n for n in names if n not in REGISTRY or n == VoteProposer.name]
    if bad:
        raise ValueError(f"unknown proposer {bad[0]!r}: choose from "
                         f"{', '.join(t for t in REGISTRY if t != VoteProposer.name)}")
    return names if names == ("draft",) else tuple(check_members(names))


class VoteProposer(ProposerBase):
    """Args:
        cfg: this strategy's :class:`Options` (member names, >= 2, distinct,
            in tie-break order) and whatever the members read (``backend``
            for ``draft``, the n-gram sizes for ``ngram``); ``width`` is
            forced to 1 (chains).

    Raises:
        ValueError: fewer than two members, a repeated or nested member, an
            unknown name, more than one member on the same model pipeline, or
            a member that cannot be built (``draft`` without a draft model).
    """

    name = "vote"
    summary = "Minions' weighted majority vote of the --spec-vote proposers"
    bench_variants = {"vote": ["--mode", "pipeinfer", "--spec-type", "vote"]}

    @dataclass(frozen=True)
    class Options:
        """The members, in tie-break order."""

        vote: tuple[str, ...] = option(
            ("draft", "ngram"), flag="--spec-vote", parse=parse_members, text=",".join,
            help="Proposers --spec-type vote merges, comma-separated, ties going to the first "
                 "(at most one that drafts with the draft model: draft or staged).")

    @classmethod
    def draft_model_wanted_by(cls, mode: str) -> str:
        return "--spec-vote with a draft-model proposer"

    @classmethod
    def _members(cls, options: StrategyOptions) -> list[type]:
        """The classes of the registered members (others are refused when built)."""
        return [proposer_class(m) for m in options.of(cls).vote if m in REGISTRY and m != cls.name]

    @classmethod
    def uses_draft_model(cls, options: StrategyOptions) -> bool:
        """A member drafts with the draft model."""
        return any(m.uses_draft_model(options) for m in cls._members(options))

    @classmethod
    def p_accept_auto(cls, mode: str, options: StrategyOptions) -> bool:
        """Auto only without a draft-model member (the fixed cutoff measured
        better with one, docs/user-guide/speculative.md, Knobs)."""
        return not cls.uses_draft_model(options)

    @classmethod
    def several_draft_models(cls, options: StrategyOptions) -> bool:
        """With a ``draft`` member, which stands for one member per model."""
        return "draft" in options.of(cls).vote

    @classmethod
    def check_options(cls, options: StrategyOptions, n_models: int) -> None:
        """At least two distinct members once ``draft`` stands for each of
        the ``n_models`` draft models (:func:`expand_members`).

        Raises:
            ValueError: a vote of one member."""
        expand_members(options.of(cls).vote, max(n_models, 1))

    def __init__(self, cfg: ProposerConfig):
        self.crew = VoteMembers(cfg, cfg.options.of(VoteProposer).vote)
        self.labels, self.members, self.leads = self.crew.labels, self.crew.members, self.crew.leads
        self.lead = self.crew.lead
        self.instant = self.crew.instant
        self.book = WeightedMajority(self.labels)
        self.acceptance: Callable[[float], float] | None = None
        self.active = False
        self._ctx: list[int] = []
        self._cutoff = 1.0
        self._first_cutoff = 1.0
        self._max_nodes = 0
        self._result: SpecTree | None = None
        self._counts = {"vote_overruled": 0, "vote_extended": 0}

    @property
    def step_s(self) -> float | None:
        """The slowest lead's (the vote waits for every lead); 0 without one."""
        return self.crew.step_s

    @property
    def stats(self) -> dict:
        """Counters for ``--json``: every member's, this request's vote counters
        (``vote_overruled``, ``vote_extended``) and each member's weight and
        vote counts (:meth:`WeightedMajority.stats`)."""
        out = self.crew.stats()
        out.update(self._counts)
        out.update(self.book.stats())
        return out

    # -- life of a request ----------------------------------------------------

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None = None, *, first_pos: int = 0) -> None:
        """A new request: every member starts (each with the request's ``key``: a
        member that samples draws with the target's keyed noise; ``acceptance``
        only for the leads), the weights'
        pending votes are dropped (the weights are kept), this request's counters
        reset."""
        self.acceptance = acceptance
        self.crew.start(params, key, acceptance, first_pos=first_pos)
        self.book.start()
        self._counts = dict.fromkeys(self._counts, 0)   # this request's (the members reset their own)
        self.active = False
        self._result = None

    def prefill(self, context: list[int]) -> None:
        """The prompt is known: every member's :meth:`Proposer.prefill`."""
        self.crew.prefill(context)

    def observe(self, context: list[int]) -> None:
        """The tokens decided so far: score the votes they settle (the members'
        weights, :meth:`WeightedMajority.observe`), then every member observes them."""
        self.book.observe(context)
        self.crew.observe(context)

    def reset(self) -> None:
        """The KV caches were cleared: every member resets; the micro-batch is dropped."""
        self.crew.reset()
        self.active = False
        self._result = None

    # -- one micro-batch ------------------------------------------------------

    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None, look_cutoff: float = 0.0) -> None:
        """Start a micro-batch below ``context[-1]``: the instant members draft
        their chains now; without a lead the vote is taken at once, otherwise
        the leads begin drafting (arguments as :meth:`Proposer.begin`).

        Raises:
            RuntimeError: a micro-batch is already being drafted."""
        if self.active:
            raise RuntimeError("a micro-batch is already being drafted")
        self._start_tree(list(context), cutoff, cutoff if first_cutoff is None else first_cutoff, max_nodes)
        self.active = True
        if self.instant:
            self._result = self._close()
        else:
            self.crew.begin(context, cutoff, max_nodes, first_cutoff, look_cutoff)

    def _start_tree(self, ctx: list[int], cutoff: float, first_cutoff: float, max_nodes: int) -> None:
        self._ctx = ctx
        self._cutoff, self._first_cutoff, self._max_nodes = cutoff, first_cutoff, max_nodes
        self.crew.new_chains(ctx, max_nodes)
        self._result = None

    def _probs(self) -> list[list[float]]:
        """Per member, the confidence of each of its tokens (:meth:`VoteMembers.probs`)."""
        return self.crew.probs(self.book.accuracy)

    def ready(self) -> bool:
        """A micro-batch is active and its voted chain is ready or a lead still
        drafting has a result to take."""
        return self.active and (self._result is not None or self.crew.ready())

    def poll(self) -> SpecTree | None:
        """Make progress without blocking: the voted chain (cut at the cutoff):
        at once without a lead, else once the leads have finished, or as soon
        as an instant member outvotes the one lead at a level its later tokens
        cannot change (the lead's micro-batch is then abandoned); None while
        drafting goes on."""
        if not self.active:
            return None
        if self._result is not None:
            tree, self._result = self._result, None
            self.active = False
            return tree
        if self.lead is None:
            return self._poll_leads()
        li = self.leads[0]
        done = self.lead.poll()
        if done is not None:
            self.active = False
            self.crew.chains[li] = chain_of(done)
            return self._close()
        self.crew.chains[li] = chain_of(self.lead.partial())
        toks = self.crew.chains[li][0]
        path, _ = majority_path(self.crew.seqs(), self.book.weights)
        if path[:len(toks)] != toks:   # outvoted at a level the lead's later tokens cannot change
            self._counts["vote_overruled"] += 1
            self.lead.abandon()
            self.active = False
            return self._close()
        return None

    def _poll_leads(self) -> SpecTree | None:
        """Several leads: take what each has; the vote once all have finished."""
        if not self.crew.take_finished():
            return None
        self.active = False
        return self._close()

    def _close(self) -> SpecTree:
        """Vote over the chains, record the vote, return the voted chain cut
        at the cutoff."""
        seqs = self.crew.seqs()
        path, voted = majority_path(seqs, self.book.weights)
        self.book.record(self._ctx, seqs, voted)
        if self.lead is not None:
            lead_tokens = seqs[self.leads[0]]
            if voted >= 0 and self.members[voted] is not self.lead and path[:len(lead_tokens)] == lead_tokens:
                self._counts["vote_extended"] += 1
        tree = self._tree(path, seqs, self._probs())
        keep = confident_depth(tree.draft_p, self._cutoff, self._first_cutoff, self.acceptance)
        return tree.prefix(keep) if keep < len(tree) else tree

    def _tree(self, path: list[int], seqs: list[list[int]], probs: list[list[float]]) -> SpecTree:
        tree = SpecTree(anchor_pos=len(self._ctx) - 1)
        parent = -1
        for level, tok in enumerate(path[:self._max_nodes]):
            miss = 1.0
            for i in support(seqs, path, level):
                miss *= 1.0 - probs[i][level]
            parent = tree.add(tok, parent, 1.0 - miss)
        return tree

    # -- continuous speculation (the lead keeps drafting below its tip) --------

    def _cut_plan(self) -> tuple[list[int], list[list[int]], int, list[int]] | None:
        """What a cut would hand over: the longest chain of a lead that can
        be cut and that the majority path (over every chain as far as it has
        grown) runs through; (its tokens, every member's sequence, that lead,
        the leads whose chain is exactly it), or None."""
        if not (self.active and self._result is None):
            return None
        live = self.crew.cuttable()
        if not live:
            return None
        self.crew.grow_chains()
        seqs = self.crew.seqs()
        path, _ = majority_path(seqs, self.book.weights)
        aligned = [i for i in live if seqs[i] and path[:len(seqs[i])] == seqs[i]]
        if not aligned:
            return None
        best = max(aligned, key=lambda i: len(seqs[i]))   # ties: the first lead
        return seqs[best], seqs, best, [i for i in aligned if seqs[i] == seqs[best]]

    def can_cut(self) -> bool:
        """A lead still drafting can be cut and the majority path (over every
        chain as far as it has grown) runs through its chain."""
        return self._cut_plan() is not None

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        """Hand over the longest cuttable lead chain the majority path runs
        through, and its tip's index; the leads that drafted exactly that chain
        go on below its tip, the others abandon their micro-batch and, once idle,
        begin below the new tip (a busy one sits out until a later cut).

        Raises:
            RuntimeError: nothing to cut (:meth:`can_cut` is False)."""
        plan = self._cut_plan()
        if plan is None:
            raise RuntimeError("nothing to cut")
        toks, seqs, best, cutters = plan
        tree = self._tree(toks, seqs, self._probs())
        self.book.record(self._ctx, seqs, best)
        for i in self.leads:
            if i in cutters:
                self.members[i].cut(cutoff, room)
            elif self.members[i].active:
                self.members[i].abandon()   # its chain left the vote's path: it sits out the micro-batch
        ctx = self._ctx + toks
        self._start_tree(ctx, cutoff, cutoff, room(len(ctx) - 1))
        for i in self.leads:
            m = self.members[i]
            if i in cutters:
                continue
            m.drain_ready()
            if m.busy():
                self.crew.done.add(i)   # sits out until a cut finds it idle
            else:
                m.begin(ctx, cutoff, self._max_nodes)
        return tree, len(tree) - 1

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        """The chain :meth:`cut` would hand over, re-anchored below the decided
        tokens ``decided``, and its tip's index there; None when there is
        nothing to cut or ``decided`` does not lead into the chain above its tip.
        Changes nothing."""
        plan = self._cut_plan()
        if plan is None:
            return None
        toks, seqs, _, _ = plan
        tree = self._tree(toks, seqs, self._probs())
        sub, mp = tree.reanchor(decided)
        tip = len(tree) - 1
        if sub is None or tip not in mp:
            return None
        return sub, mp[tip]

    def abandon(self) -> None:
        """Drop the micro-batch: every lead still drafting abandons its own (its
        in-flight results are consumed later)."""
        self.crew.abandon()
        self.active = False
        self._result = None

    def busy(self) -> bool:
        """A lead has draft runs in flight."""
        return self.crew.busy()

    def due_in(self) -> float | None:
        """None: the vote hands over what the majority path has at once
        (its merged tree exists only when cut)."""
        return None

    def partial(self) -> SpecTree | None:
        """None (see :meth:`due_in`)."""
        return None

    def drain_ready(self) -> None:
        """Consume the leads' results that have already arrived, never blocking."""
        self.crew.drain_ready()

    def drain_one(self, timeout_s: float) -> None:
        """Consume one in-flight result of an abandoned (or finished) lead."""
        self.crew.drain_one(timeout_s)

    def settle(self, timeout_s: float) -> None:
        """The request ends: every lead settles (in-flight work consumed, each
        wait at most ``timeout_s`` seconds); the micro-batch is dropped."""
        self.crew.settle(timeout_s)
        self.active = False
        self._result = None
