"""The members of a vote (ggpipe.speculation.proposers.vote): the proposers
``--spec-vote`` names, built for it (``draft`` once per draft model, every
one drafting chains), which of them are *leads* (drafting on a model
pipeline) and which instant, the chain each has drafted below the current
anchor, and what the vote asks of all of them or of its leads (start,
observe, begin, poll, abandon, drain, settle)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.majority import expand_members, member_of
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer
from ggpipe.speculation.tree import SpecTree


def chain_of(tree: SpecTree | None) -> tuple[list[int], list[float]]:
    """Tokens and draft probabilities of a chain (index order)."""
    if tree is None:
        return [], []
    return list(tree.tokens), list(tree.draft_p)


class VoteMembers:
    """Args:
        cfg: the vote's configuration (the members read theirs from it;
            ``width`` is forced to 1: chains).
        names: the ``--spec-vote`` members, in tie-break order.

    Attributes:
        labels: the members' names in stats and in the weights (``draft``,
            ``draft2``, ..., ``ngram``).
        members: the member proposers, in label order.
        leads: the indices of the members that draft on a model pipeline.
        lead: the lead when there is exactly one, else None.
        instant: no lead (every member drafts on the head at once).
        chains: per member, its chain below the anchor (a lead's: as far as
            known).
        done: several leads: those that finished this micro-batch.

    Raises:
        ValueError: a vote of one member, more than one member on the same
            model pipeline, or a member that cannot be built.
    """

    def __init__(self, cfg: ProposerConfig, names: tuple[str, ...]):
        backends = [cfg.backend, *cfg.more_backends]
        self.labels = expand_members(names, len(backends))
        mcfg = replace(cfg, width=1, more_backends=())
        self.members = []
        for label in self.labels:
            name, k = member_of(label)
            self.members.append(make_proposer(name, replace(mcfg, backend=backends[k]) if name == "draft" else mcfg))
        on_models = [n for n in names if not self.members[self.labels.index(n)].instant]
        if len(on_models) > 1:
            raise ValueError("--spec-vote takes at most one proposer that drafts on the draft model "
                             f"({', '.join(on_models)}); several draft models: -md a,b with one draft member")
        self.leads = [i for i, m in enumerate(self.members) if not m.instant]
        self.lead = self.members[self.leads[0]] if len(self.leads) == 1 else None
        self.instant = not self.leads
        self.chains: list[tuple[list[int], list[float]]] = []
        self.done: set[int] = set()

    @property
    def step_s(self) -> float | None:
        """The slowest lead's (the vote waits for every lead); 0 without one."""
        steps = [self.members[i].step_s for i in self.leads]
        if not steps:
            return 0.0
        return None if None in steps else max(steps)

    def stats(self) -> dict:
        """Every member's counters (a second draft model's under its own label)."""
        out = {}
        for m, label in zip(self.members, self.labels):
            extra = member_of(label)[1] > 0   # draft2, ...: its counters under its own name
            out.update({f"{label}_{k}" if extra else k: v for k, v in m.stats.items()})
        return out

    # -- every member ---------------------------------------------------------

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None, *, first_pos: int = 0) -> None:
        """Start every member for a new request, each with the request's
        ``key`` (keyed noise has no stream to share: what each member draws
        does not depend on the order in which several draft models' results
        arrive); ``acceptance`` only for the leads."""
        for m in self.members:
            m.start(params, key, None if m.instant else acceptance, first_pos=first_pos)

    def prefill(self, context: list[int]) -> None:
        """Every member's :meth:`Proposer.prefill`."""
        for m in self.members:
            m.prefill(context)

    def observe(self, context: list[int]) -> None:
        """Every member's :meth:`Proposer.observe`."""
        for m in self.members:
            m.observe(context)

    def reset(self) -> None:
        """Every member's :meth:`Proposer.reset`."""
        for m in self.members:
            m.reset()

    # -- the chains below one anchor ------------------------------------------

    def new_chains(self, ctx: list[int], max_nodes: int) -> None:
        """The instant members' chains below ``ctx``; the leads' empty."""
        self.chains = [([], []) if not m.instant else chain_of(m.propose(ctx, max_nodes)) for m in self.members]
        self.done = set()

    def seqs(self) -> list[list[int]]:
        """Each member's chain tokens below the anchor (as far as known)."""
        return [toks for toks, _ in self.chains]

    def probs(self, accuracy: Callable[[int], float]) -> list[list[float]]:
        """Per member, the confidence of each of its tokens: a lead's draft
        model's own probability; for an instant member (whose own confidence
        is a rule of thumb, e.g. the n-gram's n / (n + 1)) its measured
        ``accuracy`` (``WeightedMajority.accuracy``)."""
        return [ps if not m.instant else [accuracy(i)] * len(toks)
                for i, (m, (toks, ps)) in enumerate(zip(self.members, self.chains))]

    # -- the leads ------------------------------------------------------------

    def begin(self, context: list[int], cutoff: float, max_nodes: int, first_cutoff: float | None,
              look_cutoff: float) -> None:
        """Every lead begins a micro-batch below ``context[-1]`` (arguments as
        :meth:`Proposer.begin`)."""
        for i in self.leads:
            self.members[i].begin(context, cutoff, max_nodes, first_cutoff, look_cutoff)

    def ready(self) -> bool:
        """A lead still drafting has a result to take."""
        return any(self.members[i].ready() for i in self.leads if i not in self.done)

    def take_finished(self) -> bool:
        """Several leads: take the chain of each that has finished; True once all have."""
        for i in self.leads:
            m = self.members[i]
            if i not in self.done and m.ready():
                done = m.poll()
                if done is not None:
                    self.chains[i] = chain_of(done)
                    self.done.add(i)
        return len(self.done) == len(self.leads)

    def cuttable(self) -> list[int]:
        """The leads still drafting whose chain can be cut."""
        return [i for i in self.leads if i not in self.done and self.members[i].can_cut()]

    def grow_chains(self) -> None:
        """The chains of the leads still drafting, as far as they have grown."""
        for i in self.leads:
            if i not in self.done:
                self.chains[i] = chain_of(self.members[i].partial())

    def abandon(self) -> None:
        """Every lead still drafting abandons its micro-batch."""
        for i in self.leads:
            if self.members[i].active:
                self.members[i].abandon()

    def busy(self) -> bool:
        """A lead has results in flight."""
        return any(self.members[i].busy() for i in self.leads)

    def drain_ready(self) -> None:
        """Every lead consumes the results that have already arrived (never blocks)."""
        for i in self.leads:
            self.members[i].drain_ready()

    def drain_one(self, timeout_s: float) -> None:
        """Consume one in-flight result of an abandoned (or finished) lead."""
        for i in self.leads:
            if self.members[i].busy():
                self.members[i].drain_one(timeout_s)
                return
        raise RuntimeError("nothing in flight")

    def settle(self, timeout_s: float) -> None:
        """Every lead settles (:meth:`Proposer.settle`: in-flight work consumed,
        each wait at most ``timeout_s`` seconds)."""
        for i in self.leads:
            self.members[i].settle(timeout_s)
