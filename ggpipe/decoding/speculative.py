"""``--mode speculative``: synchronous pipeline-parallel speculative
inference, PipeInfer's baseline: the proposer drafts a speculation tree below
the last decided token, the target verifies it in one batch, then the next
tree starts; one run in flight. What it shares with ``pipeinfer`` is
:class:`~ggpipe.decoding.drafting.Drafting`.
"""

from __future__ import annotations

from ggpipe.decoding.spec_core import SpecCore
from ggpipe.decoding.drafting import Drafting
from ggpipe.decoding.request import SpecRequest
from ggpipe.decoding.settings import SpecSettings
from ggpipe.speculation.gate import DraftGate
from ggpipe.speculation.proposers.base import Proposer
from ggpipe.speculation.tree import SpecTree


class Speculative(Drafting):
    """``--mode speculative``: draft a tree below the pending root, verify
    it, repeat (one run in flight; the target waits while the draft works).
    A root is drafted below only while drafting pays
    (:class:`~ggpipe.speculation.gate.DraftGate`: the tokens per second of
    drafted and of plain roots as measured, and before both are, the accepted
    tokens per attempt against the draft's step and the bigger verification
    pass); otherwise it goes to the target alone, as in iterative mode."""

    name = "speculative"

    def __init__(self, core: SpecCore, proposer: Proposer):
        super().__init__(core, proposer)
        self.gate = DraftGate()
        self._accepted_at_attempt: tuple[int, int] | None = None   # the graph's (accepted, drafted) then

    def open(self, *args) -> SpecRequest:
        self.gate.forget_root()
        self._accepted_at_attempt = None
        return super().open(*args)

    def _begin_speculation(self) -> None:
        r, core = self.r, self.core
        if r.pending_root is not None:
            d, now = r.graph.draft_stats, core.last_decision    # the pipelines' clock (virtual in the simulator)
            if self._accepted_at_attempt is not None:    # (before root(): a declined attempt's root is not timed)
                accepted0, drafted0 = self._accepted_at_attempt
                self.gate.observe(d.n_accepted - accepted0, d.drafted - drafted0)
                self._accepted_at_attempt = None
            self.gate.root(r, now, len(r.out))    # the last root's tokens per second, drafted or plain
            drafting = self.gate.pays_at(self.proposer.step_s, core.pass_cost)
            self.gate.rooted(r, now, len(r.out), drafting)
            if not drafting:
                r.counts.draft_skipped += 1
                # the draft follows the context meanwhile (its pipeline works beside the target's), so
                # the next attempt decodes only its root, not every token skipped since the last one
                self.proposer.prefill(r.context[:-1])
                core.submit_tree(None, SpecTree(anchor_pos=len(r.context) - 1))
                return
            self._accepted_at_attempt = d.n_accepted, d.drafted
        super()._begin_speculation()

    @classmethod
    def runs_in_flight(cls, spec: SpecSettings) -> int:
        """1: synchronous speculation verifies one tree at a time."""
        return 1

    def _new_root(self, token: int) -> None:
        """The decided token leads the next tree."""
        r = self.r
        r.pending_root = token
        r.cutoff.rerooted()

    def _may_speculate(self) -> bool:
        r = self.r
        if r.done or self.core.pool.n_free == 0:
            return False
        return r.pending_root is not None and not self.target.inflight and not r.cutoff.exhausted_at(1.0)
