"""What the modes that draft with a proposer share (``--mode speculative``,
:mod:`ggpipe.decoding.speculative`, and ``pipeinfer``,
:mod:`ggpipe.decoding.pipeinfer`): a
:class:`~ggpipe.speculation.proposers.base.Proposer` (the draft model on its
own ranks, n-gram lookup, ...: the policy never learns which) drafting
micro-batches that the core (:class:`~ggpipe.decoding.spec_core.SpecCore`)
submits, and the loop's turn (:meth:`Drafting.step`).
"""

from __future__ import annotations

import numpy as np

from ggpipe.decoding.spec_core import ORPHAN, SpecCore
from ggpipe.decoding.mode import BuildContext, Mode
from ggpipe.decoding.request import Emit, SpecRequest
from ggpipe.decoding.settings import SpecSettings, check_draft_models
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler
from ggpipe.speculation.graph import ACCEPTED, DEAD
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.proposers.base import Proposer
from ggpipe.speculation.tree import SpecTree


class Drafting(Mode):
    """A mode that drafts with a proposer (speculative, pipeinfer).

    Args:
        core: the speculative core over the target pipeline.
        proposer: the drafting strategy.

    Raises:
        ValueError: stochastic sampling with a proposer whose trees are not
            i.i.d. draws (raised by :meth:`generate`).
    """

    def __init__(self, core: SpecCore, proposer: Proposer):
        super().__init__()
        self.proposer = proposer
        self.timeout_s = core.timeout_s
        self._drive(core, proposer.observe)

    # -- declarations ---------------------------------------------------------------

    speculates = True
    tokens_per_pass = 4  # a root and its drafted tokens (--draft-max 4 drafts about this many on average)

    @classmethod
    def may_cancel(cls, spec: SpecSettings) -> bool:
        """Early cancellation (PipeInfer section IV.C): only where runs
        overlap (asynchronous modes) and ``--no-cancel`` is not given."""
        return cls.asynchronous and spec.cancel

    @classmethod
    def seq_ids(cls, spec: SpecSettings) -> int:
        """Sequence 0 plus one partition of ``--branches`` ids per speculative
        run that can be in flight (at most 256)."""
        return min(256, 1 + spec.branches * cls.runs_in_flight(spec))

    @classmethod
    def runs_in_flight(cls, spec: SpecSettings) -> int:  # pragma: no cover - abstract
        """The most speculative runs the mode keeps in flight at once under
        ``spec``: each may hold a KV partition of ``--branches`` sequence ids
        (:meth:`seq_ids`)."""
        raise NotImplementedError

    @classmethod
    def check(cls, spec: SpecSettings, n_draft_models: int) -> None:
        check_draft_models(n_draft_models, spec)

    @classmethod
    def build(cls, ctx: BuildContext) -> "Drafting":
        """The mode over ``ctx.target`` with the proposer ``--spec-type``
        names (:meth:`~ggpipe.decoding.mode.BuildContext.proposer`).

        Raises:
            ConfigError: a draft-model proposer without a draft model; a
                proposer that cannot be built from these settings."""
        return cls.over(ctx.target, ctx.proposer(cls.name), ctx.spec, n_seq_max=ctx.n_seq_max,
                        n_ubatch=ctx.n_ubatch, is_eog=ctx.is_eog, timeout_s=ctx.timeout_s, idle=ctx.idle,
                        n_cells=ctx.n_cells)

    @classmethod
    def over(cls, target, proposer: Proposer, spec: SpecSettings, *, n_seq_max: int, n_ubatch: int, is_eog,
             timeout_s: float = 60.0, idle=None, n_cells: int | None = None) -> "Drafting":
        """The mode over ``target`` drafting with ``proposer`` (its own
        core; the KV partitions of ``--branches`` ids each out of
        ``n_seq_max``; ``n_cells``: the target's KV cells, by default
        what the target declares, ``target.n_cells``)."""
        core = SpecCore(target, spec, PartitionPool(n_seq_max, spec.branches), n_ubatch, is_eog,
                        timeout_s=timeout_s, idle=idle, cancels=cls.may_cancel(spec),
                        n_cells=target.n_cells if n_cells is None else n_cells)
        return cls(core, proposer)

    # -- the core's measurements, for tests and --json ---------------------------------

    @property
    def adaptive(self) -> bool:
        """``--p-accept auto``: depth from measured costs."""
        return self.s.p_accept is None

    @property
    def acceptance(self):
        """The core's :class:`~ggpipe.speculation.adaptive.AcceptanceModel`: P(a
        draft token is accepted) against the draft's probability, learnt across
        requests."""
        return self.core.acceptance

    @property
    def pass_cost(self):
        """The core's :class:`~ggpipe.speculation.adaptive.PassCost`: target
        seconds per pass against tokens per pass, learnt across requests."""
        return self.core.pass_cost

    @property
    def decode_rate(self):
        """The core's :class:`~ggpipe.speculation.adaptive.DecodeRate`: tokens
        decided per second of decoding, learnt across requests."""
        return self.core.decode_rate

    @property
    def is_eog(self):
        """token -> end of generation? (settable between requests)"""
        return self.core.is_eog

    @is_eog.setter
    def is_eog(self, f) -> None:
        self.core.is_eog = f

    def _calib(self, q: float) -> float:
        return self.core.acceptance.p(q) if self.adaptive else 1.0

    def reset(self) -> None:
        """The KV caches were cleared (target and draft)."""
        self.proposer.reset()

    # -- a request -------------------------------------------------------------------

    def open(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int, emit: Emit,
             clock: GenerationClock, history: list[int]) -> SpecRequest:
        """The request's state, the proposer, the target's and the proposer's
        prefill (their pipelines work in parallel), and the first token, a
        new root."""
        core = self.core
        r = self.r = core.begin(prompt, n_predict, sampler, emit, clock, history, self._cutoff())
        # the draft draws with the sampler's noise: output index i is the token at position len(context) + i
        self.proposer.start(sampler.params, sampler.key, core.acceptance.at_look if self.adaptive else None,
                            first_pos=len(r.context) - sampler.index)
        core.submit_prompt(len(prompt), start_pos)
        self.proposer.prefill(r.context[:-1])
        logits = core.prompt_logits()
        self.proposer.settle(self.timeout_s)
        core.first_token(sampler, logits)
        return r

    def _cutoff(self):
        """The request's confidence cutoff (PipeInfer IV.B.2), adaptive with ``--p-accept auto``."""
        serial = None if self.asynchronous else (lambda: self.proposer.step_s)  # speculative: the target waits
        return self.s.cutoff(self.core.calibration, serial)

    def step(self) -> None:
        """One turn: a target result first; else the proposer's progress, a
        hand-over (:meth:`_hand_over`) or a wait; else results of abandoned
        drafting; else a new micro-batch; else the target's next result."""
        t, p = self.target, self.proposer
        if t.ready():
            self.core.handle(t.poll())
        elif p.active:
            if p.ready():
                tree = p.poll()
                if tree is not None:
                    self._speculated(tree)
            elif not self._hand_over():
                self.core.idle(lambda: t.ready() or p.ready(), self.timeout_s)
        elif p.busy():  # results of drafting that was abandoned
            p.drain_one(self.timeout_s)
        elif self._may_speculate():
            self._begin_speculation()
        else:
            self.core.wait_result()

    def close(self) -> None:
        self.stats = self.core.finish(self.proposer, self.adaptive)

    # -- policy hooks ------------------------------------------------------------------

    def _hand_over(self) -> bool:
        """While the proposer drafts and has no result: hand what it drafted
        to the target now? (continuous speculation; True if it did)."""
        return False

    def _new_root(self, token: int) -> None:  # pragma: no cover - abstract
        """A decided token no node carries (``context[-1] == token``)."""
        raise NotImplementedError

    def _may_speculate(self) -> bool:  # pragma: no cover - abstract
        """Start a new micro-batch now?"""
        raise NotImplementedError

    # -- drafting ----------------------------------------------------------------------

    def _anchor(self) -> tuple[int | None, list[int]]:
        """(anchor node or None for a pending root, tokens of the context up
        to and including the anchor)."""
        r = self.r
        if r.pending_root is not None:
            return None, list(r.context)
        a = r.graph.frontier()
        chain = r.graph.chain(a)
        return a, r.context + [r.graph.nodes[j].token for j in chain]

    def _room(self, anchor_pos: int) -> int:
        """Most nodes a tree anchored at ``anchor_pos`` may have: --draft-max,
        no deeper than the tokens still to generate, and no more than the
        target's KV cache has cells for (beside a pending root's)."""
        r = self.r
        return min(r.room(anchor_pos, self.s.draft_max), self.core.spec_room() - (r.pending_root is not None))

    def _begin_speculation(self) -> None:
        r = self.r
        anchor, ctx = self._anchor()
        max_nodes = self._room(len(ctx) - 1)
        if max_nodes <= 0:
            if r.pending_root is not None:
                self.core.submit_tree(None, SpecTree(anchor_pos=len(ctx) - 1))
            else:
                self.core.wait_result()
            return
        r.spec_anchor = anchor
        r.spec_path = 1.0 if anchor is None else r.graph.path_p(anchor, self._calib)
        self.proposer.begin(ctx, r.cutoff.at(r.spec_path), max_nodes, first_cutoff=r.cutoff.first_at(r.spec_path),
                            look_cutoff=r.cutoff.look_at(r.spec_path))
        if self.proposer.instant:
            self._speculated(self.proposer.poll())

    def _speculated(self, tree: SpecTree) -> dict[int, int] | None:
        """A drafted micro-batch: submit it, re-anchored at the committed node
        if the target decided tokens below its anchor meanwhile. Returns the
        map tree index -> node id of what was submitted, or None."""
        r = self.r
        anchor = r.spec_anchor
        g = r.graph
        mp = {j: j for j in range(len(tree))}
        if anchor == ORPHAN:
            r.counts.stale_drafts += 1
            return None
        if anchor is not None and len(tree):
            node = g.nodes.get(anchor)
            if node is None:    # trimmed: decided long ago (SpecGraph.trim)
                r.counts.stale_drafts += 1
                return None
            if node.state == DEAD or (node.state == ACCEPTED and anchor != g.committed and g.committed is None):
                r.counts.stale_drafts += 1
                return None
            if node.state == ACCEPTED and anchor != g.committed:
                tree, mp = tree.reanchor(r.context[node.pos + 1:])
                if not tree:
                    r.counts.stale_drafts += 1
                    return None
                anchor = g.committed
                r.counts.reanchored_drafts += 1
        if len(tree) == 0:
            r.counts.failed_drafts += 1
            if r.pending_root is not None:
                self.core.submit_tree(None, tree)       # verify the root alone
            elif not self.target.ready():
                r.cutoff.failed_while_idle()
                if self.target.inflight:
                    self.core.wait_result()
            return None
        if r.pending_root is None and anchor != g.committed:
            r.cutoff.continued()
        ids = self.core.submit_tree(anchor, tree)
        # (the core may have sent only the tree's first nodes: the KV cache was nearly full)
        return {old: ids[new] for old, new in mp.items() if new < len(ids)} if ids else None
