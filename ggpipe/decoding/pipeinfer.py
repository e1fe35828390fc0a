"""``--mode pipeinfer``: PipeInfer section IV over the speculative core.

* **Asynchronous speculation** (IV.A): the head's target stage runs on its
  own thread; a decided token that no node carries becomes a root, and a
  non-speculative run starts for it at once in sequence 0, while the
  proposer keeps drafting.
* **Continuous speculation** (IV.B): while no target logits are waiting,
  keep speculating, subject to the confidence cutoff, free KV partitions and
  ``--max-inflight``; when the head's target stage would idle, what the
  proposer drafted so far is handed over and it keeps drafting below it
  (unless waiting for its next token pays: :meth:`PipeInfer._wait_for_draft`).
  ``--no-continuous`` allows one speculative run per accepted root
  (asynchronous speculation alone).
* **KV multibuffering** and **early cancellation** (IV.C, IV.D) are the
  core's (:class:`~ggpipe.decoding.spec_core.SpecCore`); ``--no-cancel`` lets
  dead runs finish.
"""

from __future__ import annotations

from ggpipe.decoding.spec_core import ORPHAN
from ggpipe.decoding.settings import SpecSettings
from ggpipe.decoding.drafting import Drafting
from ggpipe.speculation.adaptive import wait_pays
from ggpipe.speculation.graph import ACCEPTED
from ggpipe.speculation.tree import SpecTree


class PipeInfer(Drafting):
    """``--mode pipeinfer``: asynchronous, continuous speculation."""

    name = "pipeinfer"
    asynchronous = True
    pace = "bottleneck"  # runs overlap: the slowest stage sets the pace (section IV)
    lookahead_in_slots = True

    @classmethod
    def in_slots(cls, spec: SpecSettings) -> str | None:
        """Chains as every speculating mode (:meth:`Mode.in_slots`), sent
        while the request's row is in flight (look-ahead rows: PipeInfer's
        continuation; a draft model drafts them without the head waiting;
        ``GGPIPE_LOOKAHEAD``); its trees of several sequences and early
        cancellation run one request at a time only, since its speculative
        sequences share their cells with ``llama_memory_seq_cp``, which the
        slots' separate KV streams do not allow."""
        return (f"--mode {cls.name} under --parallel: a request that generates alone gets chains drafted with "
                f"--spec-type {spec.spec_type}, sent while its row is in flight where look-ahead is on "
                "(GGPIPE_LOOKAHEAD; a draft model drafts them without the head waiting), else verified in a "
                "micro-batch of their own; beside other generating requests it decodes plainly; PipeInfer's trees "
                "and early cancellation run only with --parallel 1 (its speculative sequences share KV cells, "
                "which the slots' separate KV streams do not allow)")

    @classmethod
    def bench_variants(cls) -> dict[str, list[str]]:
        """Itself, and without early cancellation or continuous speculation
        (the ablations of section V)."""
        return {"pipeinfer": ["--mode", "pipeinfer"], "pipeinfer-no-cancel": ["--mode", "pipeinfer", "--no-cancel"],
                "pipeinfer-no-continuous": ["--mode", "pipeinfer", "--no-continuous"]}

    @classmethod
    def runs_in_flight(cls, spec: SpecSettings) -> int:
        """``--max-inflight`` + 2: the speculative runs ``--max-inflight``
        allows, plus two partitions of headroom (a run's partition returns to the
        pool only once the run is retired)."""
        return spec.max_inflight + 2

    def _may_speculate(self) -> bool:
        r, s = self.r, self.s
        if r.done or self.core.pool.n_free == 0:
            return False
        if r.pending_root is not None:
            return not r.cutoff.exhausted_at(1.0)
        if r.graph.committed is None:
            return False
        if r.cutoff.exhausted_at(r.graph.path_p(r.graph.frontier(), self._calib)):
            return False
        inflight = r.graph.pending_runs(speculative_only=True)
        if inflight >= s.max_inflight:
            return False
        if not s.continuous:
            # asynchronous speculation alone: one tree below each root
            return inflight == 0 and not r.graph.nodes[r.graph.committed].children
        return True

    def _hand_over(self) -> bool:
        """The head's target stage would idle: hand it what is drafted, keep
        drafting below it (IV.B.1)."""
        r, p = self.r, self.proposer
        if not ((self.s.continuous or r.pending_root is not None) and p.can_cut() and self.target.head_idle()
                and not self._wait_for_draft()):
            return False
        tree, tip = p.cut(r.cutoff.at(r.spec_path), self._room)
        ids = self._speculated(tree)
        r.spec_anchor = ids.get(tip, ORPHAN) if ids else ORPHAN
        return True

    def _wait_for_draft(self) -> bool:
        """The head's target stage is idle and the proposer can hand over
        what it drafted: rather wait for its next token? (``--wait-draft``;
        :func:`~ggpipe.speculation.adaptive.wait_pays` from the calibrated
        acceptance of the chain drafted so far, the proposer's time to its
        next token and the target's pass cost curve.)"""
        if not self.s.wait_draft:
            return False
        wait_s = self.proposer.due_in()
        tree = self.proposer.partial()
        if wait_s is None or not tree:
            return False
        tip = max(range(len(tree)), key=tree.depth)
        chain = [self.core.acceptance.p(tree.draft_p[i]) for i in tree.path(tip)]
        n_pass = len(tree) + (self.r.pending_root is not None)
        if not wait_pays(chain, wait_s, n_pass, self.core.pass_cost):
            return False
        self.r.counts.waited_for_draft += 1
        return True

    def _new_root(self, token: int) -> None:
        """A decided token no node carries: a run starts for it at once
        (IV.A), carrying the subtree the proposer already drafted below it,
        if any (the proposer keeps drafting below that subtree's tip); an
        instant proposer drafts below the root first, so the root and its
        draft share one target pass."""
        r = self.r
        r.pending_root = token
        r.cutoff.rerooted()
        sub, tip = self._salvage()
        if sub is not None and len(sub) == 0 and tip == -1 and self.proposer.active:
            # the draft is decoding this very token: send the root together with the
            # first draft token below it (one target pass for two tokens)
            r.spec_anchor = None
            r.counts.deferred_roots += 1
            return
        if sub is None and self.proposer.instant and self._may_speculate():
            self._begin_speculation()
            return
        run_nodes = self.core.submit_tree(None, sub if sub is not None else SpecTree(anchor_pos=len(r.context) - 1))
        if sub is not None:
            # the proposer goes on below its tip: a node of this run, or the root itself
            r.spec_anchor = r.graph.committed if tip == -1 else (
                run_nodes[tip] if run_nodes and tip < len(run_nodes) else ORPHAN)
            r.counts.salvaged_drafts += 1

    def _salvage(self) -> tuple[SpecTree | None, int]:
        """Cut the proposer's tree if the tokens decided since its anchor lead
        into it; return the part below them and the new index of its tip.
        Otherwise abandon the proposer's work (its draft results are dropped)."""
        r, p = self.r, self.proposer
        a = r.spec_anchor
        if not p.active:
            return None, -1
        if a is not None and a != ORPHAN and a in r.graph.nodes and r.graph.nodes[a].state == ACCEPTED:
            found = p.salvage(r.context[r.graph.nodes[a].pos + 1:])
            if found is not None:
                sub, new_tip = found
                p.cut(r.cutoff.at(r.spec_path), self._room)
                if not self.s.continuous:
                    p.abandon()
                return sub, new_tip
        p.abandon()
        return None, -1
