"""The vote proposer: Minions' majority-voted speculator over several
proposers (Minions section 3.2; ``--spec-type vote --spec-vote draft,ngram``).

Every member drafts a chain below the same anchor; the chain the target
verifies is the majority-approved one (:func:`ggpipe.speculation.vote.majority_path`),
and the members' weights are learnt from the decided tokens
(:class:`ggpipe.speculation.vote.WeightedMajority`, fed by ``observe``).

Members: at most one *lead* that drafts on a model pipeline (``draft``, the
draft model on its own ranks) and any number of instant ones (``ngram``),
which draft on the head in microseconds. The lead's chain grows one draft
decode at a time, and the vote is taken as it grows:

* as soon as an instant member outvotes the lead at some level (a decision
  the lead's later tokens cannot change), the lead's micro-batch is
  abandoned and the voted chain goes to the target at once;
* when the lead finishes, the vote over the finished chains is final (an
  instant member that agrees with the lead and goes on further extends it);
* PipeInfer's continuous speculation (``cut``) hands over the lead's chain
  while no member has outvoted it, and the vote starts again below its tip.

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
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import numpy as np

from ggpipe.sampling import SamplingParams
from ggpipe.speculation.cutoff import confident_depth
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer
from ggpipe.speculation.tree import SpecTree
from ggpipe.speculation.vote import WeightedMajority, check_members, majority_path, support


def _chain(tree: SpecTree | None) -> tuple[list[int], list[float]]:
    """Tokens and draft probabilities of a chain (index order)."""
    if tree is None:
        return [], []
    return list(tree.tokens), list(tree.draft_p)


class VoteProposer:
    """Args:
        cfg: ``vote`` (member names, >= 2, distinct, in tie-break order) and
            whatever the members read (``backend`` for ``draft``, the n-gram
            sizes for ``ngram``); ``width`` is forced to 1 (chains).

    Raises:
        ValueError: fewer than two members, a repeated or nested member, an
            unknown name, more than one member on a model pipeline, or a
            member that cannot be built (``draft`` without a draft model).
    """

    name = "vote"
    iid_children = True

    def __init__(self, cfg: ProposerConfig):
        names = check_members(cfg.vote)
        mcfg = replace(cfg, width=1)
        self.members = [make_proposer(n, mcfg) for n in names]
        leads = [m for m in self.members if not m.instant]
        if len(leads) > 1:
            raise ValueError("--spec-vote takes at most one proposer that drafts on a model "
                             f"({', '.join(m.name for m in leads)}): a job has one draft model")
        self.lead = leads[0] if leads else None
        self.instant = self.lead is None
        self.n_vocab = cfg.n_vocab
        self.book = WeightedMajority(names)
        self.params = SamplingParams()
        self.acceptance: Callable[[float], float] | None = None
        self.active = False
        self._ctx: list[int] = []
        self._cutoff = 1.0
        self._first_cutoff = 1.0
        self._max_nodes = 0
        self._others: list[tuple[list[int], list[float]]] = []  # per member (lead's slot empty)
        self._result: SpecTree | None = None
        self._counts = {"vote_overruled": 0, "vote_extended": 0}

    @property
    def step_s(self) -> float | None:
        return self.lead.step_s if self.lead is not None else 0.0

    @property
    def stats(self) -> dict:
        out = {}
        for m in self.members:
            out.update(m.stats)
        out.update(self._counts)
        out.update(self.book.stats())
        return out

    # -- life of a request ----------------------------------------------------

    def start(self, params: SamplingParams, rng: np.random.Generator,
              acceptance: Callable[[float], float] | None = None) -> None:
        self.params = params
        self.acceptance = acceptance
        for m in self.members:
            m.start(params, rng, acceptance if m is self.lead else None)
        self.book.start()
        self.active = False
        self._result = None

    def prefill(self, context: list[int]) -> None:
        for m in self.members:
            m.prefill(context)

    def observe(self, context: list[int]) -> None:
        self.book.observe(context)
        for m in self.members:
            m.observe(context)

    def reset(self) -> None:
        for m in self.members:
            m.reset()
        self.active = False
        self._result = None

    # -- one micro-batch ------------------------------------------------------

    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None) -> None:
        if self.active:
            raise RuntimeError("a micro-batch is already being drafted")
        self._start_tree(list(context), cutoff, cutoff if first_cutoff is None else first_cutoff, max_nodes)
        self.active = True
        if self.lead is None:
            self._result = self._close([], [])
        else:
            self.lead.begin(context, cutoff, max_nodes, first_cutoff)

    def _start_tree(self, ctx: list[int], cutoff: float, first_cutoff: float, max_nodes: int) -> None:
        self._ctx = ctx
        self._cutoff, self._first_cutoff, self._max_nodes = cutoff, first_cutoff, max_nodes
        self._others = [([], []) if m is self.lead else _chain(m.propose(ctx, max_nodes)) for m in self.members]
        self._result = None

    def _seqs(self, lead_tokens: list[int]) -> list[list[int]]:
        return [lead_tokens if m is self.lead else self._others[i][0] for i, m in enumerate(self.members)]

    def _probs(self, lead_p: list[float]) -> list[list[float]]:
        """Per member, the confidence of each of its tokens: the draft model's
        own probability for the lead; for an instant member (whose own
        confidence is a rule of thumb, e.g. the n-gram's n / (n + 1)) its
        measured accuracy (``WeightedMajority.accuracy``)."""
        return [lead_p if m is self.lead else [self.book.accuracy(i)] * len(self._others[i][0])
                for i, m in enumerate(self.members)]

    def ready(self) -> bool:
        return self.active and (self._result is not None or self.lead.ready())

    def poll(self) -> SpecTree | None:
        if not self.active:
            return None
        if self._result is not None:
            tree, self._result = self._result, None
            self.active = False
            return tree
        done = self.lead.poll()
        if done is not None:
            self.active = False
            return self._close(*_chain(done))
        toks, ps = _chain(self.lead.partial())
        path, _ = majority_path(self._seqs(toks), self.book.weights)
        if path[:len(toks)] != toks:   # outvoted at a level the lead's later tokens cannot change
            self._counts["vote_overruled"] += 1
            self.lead.abandon()
            self.active = False
            return self._close(toks, ps)
        return None

    def _close(self, lead_tokens: list[int], lead_p: list[float]) -> SpecTree:
        """Vote over the chains, record the vote, return the voted chain cut
        at the cutoff."""
        seqs = self._seqs(lead_tokens)
        path, voted = majority_path(seqs, self.book.weights)
        self.book.record(self._ctx, seqs, voted)
        if voted >= 0 and self.members[voted] is not self.lead and self.lead is not None and \
                path[:len(lead_tokens)] == lead_tokens:
            self._counts["vote_extended"] += 1
        tree = self._tree(path, seqs, self._probs(lead_p))
        keep = confident_depth(tree.draft_p, self._cutoff, self._first_cutoff, self.acceptance)
        return tree.prefix(keep) if keep < len(tree) else tree

    def _tree(self, path: list[int], seqs: list[list[int]], probs: list[list[float]]) -> SpecTree:
        tree = SpecTree(anchor_pos=len(self._ctx) - 1)
        parent = -1
        for level, tok in enumerate(path[:self._max_nodes]):
            miss = 1.0
            for i in support(seqs, path, level):
                miss *= 1.0 - probs[i][level]
            q = None
            if not self.params.greedy:
                q = np.zeros(self.n_vocab, dtype=np.float64)
                q[tok] = 1.0
            parent = tree.add(tok, parent, 1.0 - miss, probs=q)
        return tree

    # -- continuous speculation (the lead keeps drafting below its tip) --------

    def can_cut(self) -> bool:
        return self.active and self._result is None and self.lead is not None and self.lead.can_cut()

    def _lead_tree(self) -> tuple[list[int], list[list[int]], SpecTree]:
        """The lead's chain so far as the voted tree (it has not been
        outvoted): its tokens, every member's sequence, the tree."""
        toks, ps = _chain(self.lead.partial())
        seqs = self._seqs(toks)
        return toks, seqs, self._tree(toks, seqs, self._probs(ps))

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        if not self.can_cut():
            raise RuntimeError("nothing to cut")
        toks, seqs, tree = self._lead_tree()
        self.book.record(self._ctx, seqs, self.members.index(self.lead))
        self.lead.cut(cutoff, room)
        ctx = self._ctx + toks
        self._start_tree(ctx, cutoff, cutoff, room(len(ctx) - 1))
        return tree, len(tree) - 1

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        if not self.can_cut():
            return None
        tree = self._lead_tree()[2]
        sub, mp = tree.reanchor(decided)
        tip = len(tree) - 1
        if sub is None or tip not in mp:
            return None
        return sub, mp[tip]

    def abandon(self) -> None:
        if self.lead is not None and self.lead.active:
            self.lead.abandon()
        self.active = False
        self._result = None

    def busy(self) -> bool:
        return self.lead is not None and self.lead.busy()

    def drain_one(self, timeout_s: float) -> None:
        if self.lead is None:
            raise RuntimeError("nothing in flight")
        self.lead.drain_one(timeout_s)

    def settle(self, timeout_s: float) -> None:
        if self.lead is not None:
            self.lead.settle(timeout_s)
        self.active = False
        self._result = None
