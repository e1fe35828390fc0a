"""Speculative modes: ``speculative`` (synchronous pipeline-parallel
speculative inference, PipeInfer's baseline) and ``pipeinfer`` (PipeInfer
section IV: asynchronous + continuous speculation, pipelined KV cache
multibuffering, early inference cancellation; each switchable for ablations).

Both are one event loop on the head over two pipelines (target, draft):

* a decided token that no node carries becomes a *root*; ``pipeinfer`` starts
  a non-speculative run for it at once in sequence 0 (IV.A), ``speculative``
  puts it at the root of the next tree instead;
* speculation: the draft proposer grows a micro-batch below the frontier of
  the speculation graph; it becomes a speculative run in a free KV partition
  whose sequences first receive, by pipelined copies, every cell of the path
  to its anchor (IV.C.3: a run anchored at a non-speculative run reuses that
  run's cell);
* results come back in order; :class:`SpecGraph` decides tokens as far as
  logits allow; accepted cells are copied into sequence 0 ("buffer swap",
  IV.C.1-2), dead runs are cancelled (IV.D), retired partitions are cleared
  and returned to the FIFO.

``speculative``: one run in flight; draft a tree, verify it, repeat.
``pipeinfer``: while no target logits are waiting, keep speculating
(continuous, IV.B) subject to the confidence cutoff, free partitions and
``max_inflight``; ``--no-continuous`` allows one speculative run per accepted
root (asynchronous speculation alone); ``--no-cancel`` lets dead runs finish.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggpipe.errors import ProtocolError, RankTimeoutError
from ggpipe.metrics import GenerationClock
from ggpipe.runtime.stage import KV_SEQ_CP, KV_SEQ_RM
from ggpipe.scheduling.iterative import submit_prompt
from ggpipe.scheduling.pipeline import Pipeline
from ggpipe.scheduling.runs import Run, RunResult, next_run_id
from ggpipe.scheduling.sampling import Sampler
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.graph import ACCEPTED, DEAD, SpecGraph
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.proposer import DraftProposer
from ggpipe.speculation.tree import SpecTree
from ggpipe.transport.messages import KvHeader


_ORPHAN = -2  # anchor of a tree cut from one that was never submitted


@dataclass(frozen=True)
class SpecSettings:
    """Speculation knobs (CLI names in brackets).

    Attributes:
        mode: "speculative" or "pipeinfer".
        draft: most draft tokens per tree / micro-batch [--draft].
        p_accept: confidence cutoff [--p-accept].
        p_split: runner-up probability that adds a sibling leaf [--p-split].
        p_recovery: cutoff increase per continued micro-batch [--p-recovery].
        p_decay: cutoff decrease per failed idle attempt [--p-decay].
        width: leaves (KV sequences) per tree [--branches].
        continuous: continuous speculation (pipeinfer) [--no-continuous].
        cancel: early inference cancellation (pipeinfer) [--no-cancel].
        max_inflight: most speculative runs in flight (pipeinfer).
    """

    mode: str = "pipeinfer"
    draft: int = 6
    p_accept: float = 0.3
    p_split: float = 0.2
    p_recovery: float = 0.05
    p_decay: float = 0.05
    width: int = 1
    continuous: bool = True
    cancel: bool = True
    max_inflight: int = 8

    @property
    def asynchronous(self) -> bool:
        return self.mode == "pipeinfer"


class SpeculativeDecoder:
    """Args:
        target: the target pipeline (the head's stage may be asynchronous).
        draft: the draft pipeline.
        settings: speculation knobs.
        n_seq_max: KV sequence ids of the target contexts.
        n_ubatch: prefill chunk size (tokens).
        is_eog: token -> end of generation?
        timeout_s: bound of every wait for a result.
    """

    def __init__(self, target: Pipeline, draft: Pipeline, settings: SpecSettings, n_seq_max: int, n_ubatch: int,
                 is_eog: Callable[[int], bool], timeout_s: float = 60.0):
        self.target = target
        self.draft = draft
        self.s = settings
        self.name = settings.mode
        self.pool = PartitionPool(n_seq_max, settings.width)
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self.timeout_s = timeout_s
        self.stats: dict = {}
        self.draft_cursor: list[int] = []  # tokens in the draft's KV (sequence 0), kept across requests

    # -- the event loop --------------------------------------------------------

    def generate(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int = 0,
                 emit: Callable[[list[int]], bool | None] = lambda toks: None,
                 clock: GenerationClock | None = None, history: list[int] | None = None) -> list[int]:
        """Generate up to ``n_predict`` tokens after ``prompt`` (int32 (n,));
        same contract as IterativeDecoder.generate. ``history`` (the tokens
        at positions 0..start_pos-1, already in sequence 0 of the target's
        KV) is required when ``start_pos`` > 0: the draft model's KV is
        brought to the same context (only what it lacks is decoded).

        Raises:
            ValueError: ``history`` does not have ``start_pos`` tokens.
            RankTimeoutError, ProtocolError: from the pipelines."""
        history = list(history or [])
        if len(history) != start_pos:
            raise ValueError(f"history has {len(history)} tokens, start_pos is {start_pos}")
        clock = clock or GenerationClock()
        clock.start()
        s = self.s
        self.graph = SpecGraph(sampler)
        self.cutoff = CutoffController(s.p_accept, s.p_recovery, s.p_decay)
        self.proposer = DraftProposer(self.draft, sampler.params, np.random.default_rng(
            None if sampler.params.seed is None else sampler.params.seed + 1), s.p_split, s.width, self.n_ubatch)
        self.proposer.cursor = self.draft_cursor  # the draft's KV outlives one request
        self.out: list[int] = []
        self.n_predict = n_predict
        self.done = False
        self.pending_root: int | None = None   # a decided token to put at the root of the next run
        self._spec_anchor: int | None = None
        self.emit = emit
        self.clock = clock
        self.counts = {"target_runs": 0, "spec_runs": 0, "root_runs": 0, "cancel_sent": 0, "returned_cancelled": 0,
                       "failed_drafts": 0, "verified_runs": 0, "stale_drafts": 0, "reanchored_drafts": 0,
                       "no_partition": 0, "salvaged_drafts": 0, "deferred_roots": 0}

        # prefill both models, back to back (their pipelines work in parallel)
        tokens = [int(t) for t in prompt]
        submit_prompt(self.target, tokens, start_pos, self.n_ubatch)
        self.context = history + tokens  # every accepted token, position i at index i; draft KV follows it
        self.proposer.prefill(self.context[:-1])
        logits = self.target.drain(self.timeout_s)[-1].logits[0]
        self._drain_draft()
        clock.prompt_done()
        first = sampler.sample(logits)
        self._accept_tokens([first])
        if not self.done:
            self._new_root(first)

        while not self.done:
            if self.target.ready():
                self._handle(self.target.poll())
            elif self.proposer.active:
                if self.proposer.has_cached or self.draft.ready():
                    tree = self.proposer.step(None if self.proposer.has_cached else self.draft.poll())
                    if tree is not None:
                        self._speculated(tree)
                elif (self.s.asynchronous and (self.s.continuous or self.pending_root is not None)
                      and self.proposer.can_cut() and self.target.head_idle()):
                    # the head's target stage would idle: hand it what is drafted, keep drafting below it
                    tree, tip = self.proposer.cut(self.cutoff.cutoff, self._room(self.proposer.tree.anchor_pos))
                    ids = self._speculated(tree)
                    self._spec_anchor = ids.get(tip, _ORPHAN) if ids else _ORPHAN
                else:
                    self._wait_any()
            elif self.draft.inflight:  # results of drafting that was abandoned
                self.draft.wait(self.timeout_s)
            elif self._may_speculate():
                self._begin_speculation()
            else:
                self._handle(self.target.wait(self.timeout_s))
        self._finish()
        clock.finish()
        return self.out

    def _wait_any(self) -> None:
        t0 = time.monotonic()
        delay = 20e-6
        while not (self.target.ready() or self.draft.ready()):
            if time.monotonic() - t0 > self.timeout_s:
                raise RankTimeoutError(f"no target or draft result for {self.timeout_s:.0f} s")
            time.sleep(delay)
            delay = min(delay * 1.5, 200e-6)

    # -- decisions -----------------------------------------------------------------

    def _accept_tokens(self, toks: list[int]) -> None:
        """Emit accepted tokens (up to n_predict, stopping after end of generation)."""
        room = self.n_predict - len(self.out)
        toks = toks[:room]
        for i, t in enumerate(toks):
            if self.is_eog(t):
                toks = toks[:i + 1]
                self.done = True
                break
        if not toks:
            self.done = True
            return
        self.out.extend(toks)
        self.context.extend(toks)
        self.clock.token(len(toks))
        if self.emit(toks) or len(self.out) >= self.n_predict:
            self.done = True

    def _new_root(self, token: int) -> None:
        """A decided token no node carries (context[-1] == token).
        speculative: it leads the next tree. pipeinfer: a run starts for it at
        once (IV.A), carrying the subtree the proposer already drafted below
        it, if any (the proposer keeps drafting below that subtree's tip)."""
        self.pending_root = token
        if not self.s.asynchronous:
            return
        sub, tip = self._salvage()
        if sub is not None and len(sub) == 0 and tip == -1 and self.proposer.active:
            # the draft is decoding this very token: send the root together with the
            # first draft token below it (one target pass for two tokens)
            self._spec_anchor = None
            self.counts["deferred_roots"] += 1
            return
        run_nodes = self._submit_spec(None, sub if sub is not None else SpecTree(anchor_pos=len(self.context) - 1))
        if sub is not None:
            # the proposer goes on below its tip: a node of this run, or the root itself
            self._spec_anchor = self.graph.committed if tip == -1 else (run_nodes[tip] if run_nodes else _ORPHAN)
            self.counts["salvaged_drafts"] += 1

    def _salvage(self) -> tuple[SpecTree | None, int]:
        """Cut the proposer's tree if the tokens decided since its anchor lead
        into it; return the part below them and the new index of its tip.
        Otherwise abandon the proposer's work (its draft results are dropped)."""
        p = self.proposer
        a = self._spec_anchor
        if not p.active:
            return None, -1
        if a is not None and a != _ORPHAN and p.can_cut() and self.graph.nodes[a].state == ACCEPTED:
            decided = self.context[self.graph.nodes[a].pos + 1:]
            sub, mp = p.tree.reanchor(decided)
            if sub is not None and p.tip in mp:
                new_tip = mp[p.tip]
                tip_pos = sub.anchor_pos if new_tip == -1 else sub.pos(new_tip)
                p.cut(self.cutoff.cutoff, self._room(tip_pos))
                if not self.s.continuous:
                    p.active = False
                return sub, new_tip
        p.active = False
        return None, -1

    def _handle(self, res: RunResult) -> None:
        g = self.graph
        rid = res.run.run_id
        if res.cancelled:
            info = g.runs.get(rid)
            if info is None or not info.cancelled:
                raise ProtocolError(f"run {rid} came back cancelled, but the head did not cancel it")
            self.counts["returned_cancelled"] += 1
        else:
            self.counts["verified_runs"] += 1
        g.set_result(rid, None if res.cancelled else res.logits)
        decisions = g.advance()
        if any(d.node is not None for d in decisions):
            self.cutoff.accepted()
        for op in g.take_swap_ops():                     # buffer swap into sequence 0
            seq, p0, p1 = op
            self.target.kv(KvHeader(KV_SEQ_CP, seq=seq, seq_dst=0, p0=p0, p1=p1))
        if decisions:
            self._accept_tokens([d.token for d in decisions])
            last = decisions[-1]
            if last.node is None and not self.done:
                self._new_root(last.token)
        self._cancel_dead()
        for info in g.retirable():
            self._release(info)

    def _cancel_dead(self) -> None:
        """Cancel every run the graph reports dead (marked even when
        cancellation is off, so each is reported once)."""
        dead = self.graph.dead_runs()
        if self.s.cancel and self.s.asynchronous:
            for d in dead:
                self.target.cancel(d)
                self.counts["cancel_sent"] += 1

    def _release(self, info) -> None:
        """Clear a retired run's KV partition (pipelined behind its runs) and
        return it to the FIFO."""
        if info.partition is not None:
            for seq in info.seqs:
                self.target.kv(KvHeader(KV_SEQ_RM, seq=seq, p0=-1, p1=-1))
            self.pool.release(info.partition)

    # -- speculation -------------------------------------------------------------

    def _may_speculate(self) -> bool:
        if self.done or self.cutoff.exhausted or self.pool.n_free == 0:
            return False
        if not self.s.asynchronous:
            return self.pending_root is not None and not self.target.inflight
        if self.graph.committed is None:
            return False
        inflight = self.graph.pending_runs(speculative_only=True)
        if inflight >= self.s.max_inflight:
            return False
        if not self.s.continuous:
            # asynchronous speculation alone: one tree below each root
            return inflight == 0 and not self.graph.nodes[self.graph.committed].children
        return True

    def _anchor(self) -> tuple[int | None, list[int]]:
        """(anchor node or None for a pending root, tokens of the context up
        to and including the anchor)."""
        if self.pending_root is not None:
            return None, list(self.context)
        a = self.graph.frontier()
        chain = self.graph.chain(a)
        return a, self.context + [self.graph.nodes[j].token for j in chain]

    def _room(self, anchor_pos: int) -> int:
        """Most nodes a tree anchored at ``anchor_pos`` may have: --draft, and
        no deeper than the tokens still to generate."""
        room = self.n_predict - len(self.out) - (anchor_pos + 1 - len(self.context))
        return min(self.s.draft, max(room, 0))

    def _begin_speculation(self) -> None:
        anchor, ctx = self._anchor()
        max_nodes = self._room(len(ctx) - 1)
        if max_nodes <= 0:
            if self.pending_root is not None:
                self._submit_spec(None, SpecTree(anchor_pos=len(ctx) - 1))
            else:
                self._handle(self.target.wait(self.timeout_s))
            return
        self._spec_anchor = anchor
        self.proposer.begin(ctx, self.cutoff.cutoff, max_nodes)

    def _speculated(self, tree: SpecTree) -> dict[int, int] | None:
        """A drafted micro-batch: submit it, re-anchored at the committed node
        if the target decided tokens below its anchor meanwhile. Returns the
        map tree index -> node id of what was submitted, or None."""
        anchor = self._spec_anchor
        g = self.graph
        mp = {j: j for j in range(len(tree))}
        if anchor == _ORPHAN:
            self.counts["stale_drafts"] += 1
            return None
        if anchor is not None and len(tree):
            node = g.nodes[anchor]
            if node.state == DEAD or (node.state == ACCEPTED and anchor != g.committed and g.committed is None):
                self.counts["stale_drafts"] += 1
                return None
            if node.state == ACCEPTED and anchor != g.committed:
                tree, mp = tree.reanchor(self.context[node.pos + 1:])
                if not tree:
                    self.counts["stale_drafts"] += 1
                    return None
                anchor = g.committed
                self.counts["reanchored_drafts"] += 1
        if len(tree) == 0:
            self.counts["failed_drafts"] += 1
            if self.pending_root is not None:
                self._submit_spec(None, tree)       # verify the root alone
            elif not self.target.ready():
                self.cutoff.failed_while_idle()
                if self.target.inflight:
                    self._handle(self.target.wait(self.timeout_s))
            return None
        if self.pending_root is None and anchor != self.graph.committed:
            self.cutoff.continued()
        ids = self._submit_spec(anchor, tree)
        return {old: ids[new] for old, new in mp.items()} if ids else None

    def _submit_spec(self, anchor: int | None, tree: SpecTree) -> list[int] | None:
        g = self.graph
        if anchor is not None and g.committed is None:
            return None  # everything it could build on was decided meanwhile
        part = self.pool.acquire() if len(tree) else None
        if len(tree) and part is None:
            self.counts["no_partition"] += 1
            if anchor is not None:
                return None
            tree = SpecTree(anchor_pos=tree.anchor_pos)  # a root is never dropped: send it alone
        run_id = next_run_id()
        seqs = self.pool.seqs(part)[: len(tree.leaves())] if part is not None else []
        tokens, pos, n_seq_id, seq_ids, leaf_seq = tree.batch(seqs) if len(tree) else (
            np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), {})
        if anchor is None:
            # synchronous: the decided root token leads the batch, in seq 0 and every leaf sequence
            root = self.pending_root
            self.pending_root = None
            rpos = tree.anchor_pos
            for sq in seqs:
                self.target.kv(KvHeader(KV_SEQ_CP, seq=0, seq_dst=sq, p0=0, p1=rpos))
            tokens = np.concatenate([[root], tokens]).astype(np.int32)
            pos = np.concatenate([[rpos], pos]).astype(np.int32)
            n_seq_id = np.concatenate([[1 + len(seqs)], n_seq_id]).astype(np.int32)
            seq_ids = np.concatenate([[0] + seqs, seq_ids]).astype(np.int32)
            root_node = g.add_root(root, rpos, run_id, seq=0)
            ids = g.add_tree(root_node, tree, run_id, leaf_seq, part, seqs) if len(tree) else []
            speculative = bool(len(tree))
        else:
            src = g.nodes[anchor].seq
            for sq in seqs:
                self.target.kv(KvHeader(KV_SEQ_CP, seq=src, seq_dst=sq, p0=0, p1=tree.anchor_pos + 1))
            ids = g.add_tree(anchor, tree, run_id, leaf_seq, part, seqs)
            speculative = True
        run = Run(run_id=run_id, tokens=tokens, pos=pos, n_seq_id=n_seq_id, seq_ids=seq_ids,
                  outputs=np.ones(tokens.shape[0], dtype=np.int8), speculative=speculative)
        self.target.submit(run)
        self.counts["target_runs"] += 1
        self.counts["spec_runs"] += int(speculative)
        self.counts["root_runs"] += int(anchor is None and not speculative)
        # a dead anchor means the tree was born dead: cancel at once
        if speculative and anchor is not None:
            self._cancel_dead()
        return ids

    # -- the end -----------------------------------------------------------------

    def _drain_draft(self) -> None:
        while self.draft.inflight:
            res = self.draft.wait(self.timeout_s)
            if self.proposer.active:
                tree = self.proposer.step(res)
                if tree is not None:
                    self.proposer.active = False

    def _finish(self) -> None:
        g = self.graph
        if self.s.cancel and self.s.asynchronous:
            for info in g.runs.values():
                if info.speculative and not info.returned and not info.cancelled:
                    info.cancelled = True
                    self.target.cancel(info.run_id)
                    self.counts["cancel_sent"] += 1
        while self.target.inflight:
            res = self.target.wait(self.timeout_s)
            g.set_result(res.run.run_id, None)
            self.counts["returned_cancelled"] += int(res.cancelled)
        self.proposer.active = False
        self._drain_draft()
        for info in list(g.runs.values()):
            self._release(info)
        g.runs.clear()
        drafted = g.n_drafted
        passes = max(1, self.counts["verified_runs"])
        self.stats = dict(self.counts)
        self.stats.update(
            drafted=drafted, draft_accepted=g.n_draft_accepted,
            acceptance_rate=(g.n_draft_accepted / drafted) if drafted else None,
            accepted_per_pass=(len(self.out) - 1) / passes if len(self.out) > 1 else None,
            draft_decodes=self.proposer.draft_decodes,
            head_cancelled_before_start=self.target.stats["cancelled_before_start"],
            head_cancelled_mid_compute=self.target.stats["cancelled_mid_compute"],
        )
