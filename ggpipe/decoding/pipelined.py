"""Speculative modes: ``speculative`` (synchronous pipeline-parallel
speculative inference, PipeInfer's baseline) and ``pipeinfer`` (PipeInfer
section IV: asynchronous + continuous speculation, pipelined KV cache
multibuffering, early inference cancellation; each switchable for ablations).

Both are one event loop on the head over the target pipeline and a
:class:`~ggpipe.speculation.proposers.base.Proposer` (the draft model on its
own ranks, n-gram lookup, ...: the loop never learns which):

* a decided token that no node carries becomes a *root*; ``pipeinfer`` starts
  a non-speculative run for it at once in sequence 0 (IV.A), ``speculative``
  puts it at the root of the next tree instead;
* speculation: the proposer grows a micro-batch below the frontier of the
  speculation graph; it becomes a speculative run in a free KV partition
  whose sequences first receive, by pipelined copies, every cell of the path
  to its anchor (IV.C.3: a run anchored at a non-speculative run reuses that
  run's cell);
* results come back in order; :class:`SpecGraph` decides tokens as far as
  logits allow; accepted cells are copied into sequence 0 ("buffer swap",
  IV.C.1-2), dead runs are cancelled (IV.D), retired partitions are cleared
  and returned to the FIFO;
* before a run is placed, the cells dead runs left at and above its first
  position are removed on every stage (:meth:`SpeculativeDecoder._trim_kv`),
  so a chain's cells sit at index = position as in a single-token loop and
  verification is bit-exact in every run (README "Exactness").

``speculative``: one run in flight; draft a tree, verify it, repeat.
``pipeinfer``: while no target logits are waiting, keep speculating
(continuous, IV.B) subject to the confidence cutoff, free partitions and
``max_inflight``; ``--no-continuous`` allows one speculative run per accepted
root (asynchronous speculation alone); ``--no-cancel`` lets dead runs finish.

The per-request state lives in :class:`~ggpipe.decoding.request.SpecRequest`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.decoding.request import SpecRequest
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ProtocolError
from ggpipe.metrics import GenerationClock
from ggpipe.runs import Run, RunResult, next_run_id
from ggpipe.pipeline.waiting import Wait, poll_wait
from ggpipe.sampling import Sampler
from ggpipe.speculation.adaptive import AcceptanceModel, AdaptiveCutoff, DecodeRate, PassCost, wait_pays
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.graph import ACCEPTED, DEAD, SpecGraph
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.proposers.base import Proposer
from ggpipe.speculation.tree import SpecTree

ORPHAN = -2  # anchor of a tree cut from one that was never submitted

__all__ = ["SpecSettings", "SpeculativeDecoder"]


class SpeculativeDecoder:
    """Args:
        target: the target pipeline (``ggpipe.pipeline.driver.Pipeline``, or
            a fake with the same verbs; the head's stage may be asynchronous).
        proposer: the drafting strategy.
        settings: speculation knobs.
        n_seq_max: KV sequence ids of the target contexts.
        n_ubatch: prefill chunk size (tokens).
        is_eog: token -> end of generation?
        timeout_s: bound of every wait for a result (seconds).
        idle: the wait when neither the target nor the proposer has a result:
            ``idle(ready, timeout_s)`` returns when ``ready()`` may be true
            (the loop checks again). Real pipelines:
            :class:`ggpipe.pipeline.waiting.EventWait` (woken by the head's own
            stages, probing other ranks around the time their results are
            due); None: :func:`~ggpipe.pipeline.waiting.poll_wait` (sleeps of
            20-200 us between checks). The simulator (ggpipe.sim) passes one
            that moves its virtual clock to the next event.

    Raises:
        ValueError: stochastic sampling with a proposer whose trees are not
            i.i.d. draws (raised by :meth:`generate`).
    """

    def __init__(self, target, proposer: Proposer, settings: SpecSettings, n_seq_max: int, n_ubatch: int,
                 is_eog: Callable[[int], bool], timeout_s: float = 60.0, idle: Wait | None = None):
        self.target = target
        self._idle = idle or poll_wait
        self.proposer = proposer
        self.s = settings
        self.name = settings.mode
        self.pool = PartitionPool(n_seq_max, settings.branches)
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self.timeout_s = timeout_s
        self.stats: dict = {}
        self.r: SpecRequest | None = None  # the request being generated
        # adaptive speculation depth (--p-accept auto): learnt across requests
        self.acceptance = AcceptanceModel()
        self.pass_cost = PassCost()
        self.decode_rate = DecodeRate()
        self._last_finish = 0.0
        self._last_decision = 0.0     # when the request's last tokens were decided (the results' clock)

    @property
    def adaptive(self) -> bool:
        return self.s.p_accept is None

    def _calib(self, q: float) -> float:
        return self.acceptance.p(q) if self.adaptive else 1.0

    def reset(self) -> None:
        """The KV caches were cleared (target and draft)."""
        self.proposer.reset()

    # -- the event loop --------------------------------------------------------

    def generate(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int = 0,
                 emit: Callable[[list[int]], bool | None] = lambda toks: None,
                 clock: GenerationClock | None = None, history: list[int] | None = None) -> list[int]:
        """Generate up to ``n_predict`` tokens after ``prompt`` (int32 (n,));
        same contract as IterativeDecoder.generate. ``history`` (the tokens
        at positions 0..start_pos-1, already in sequence 0 of the target's
        KV) is required when ``start_pos`` > 0: the proposer is brought to
        the same context (a draft model decodes only what it lacks).

        Raises:
            ValueError: ``history`` does not have ``start_pos`` tokens.
            RankTimeoutError, ProtocolError: from the pipelines."""
        self._open(prompt, n_predict, sampler, start_pos, emit, clock, history)
        r, s, p = self.r, self.s, self.proposer
        while not r.done:
            if self.target.ready():
                self._handle(self.target.poll())
            elif p.active:
                if p.ready():
                    tree = p.poll()
                    if tree is not None:
                        self._speculated(tree)
                elif (s.asynchronous and (s.continuous or r.pending_root is not None)
                      and p.can_cut() and self.target.head_idle() and not self._wait_for_draft()):
                    # the head's target stage would idle: hand it what is drafted, keep drafting below it
                    tree, tip = p.cut(r.cutoff.at(r.spec_path), self._room)
                    ids = self._speculated(tree)
                    r.spec_anchor = ids.get(tip, ORPHAN) if ids else ORPHAN
                else:
                    self._wait_any()
            elif p.busy():  # results of drafting that was abandoned
                p.drain_one(self.timeout_s)
            elif self._may_speculate():
                self._begin_speculation()
            else:
                self._handle(self.target.wait(self.timeout_s))
        self._finish()
        r.clock.finish()
        return r.out

    # the proposer's prefill runs are consumed before the first token (a proposer
    # that takes its results as they come, in its own loop, sets this False)
    _settle_after_prefill = True

    def _open(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int,
              emit: Callable[[list[int]], bool | None], clock: GenerationClock | None,
              history: list[int] | None) -> None:
        """Start a request (arguments as :meth:`generate`): its state
        (``self.r``), the proposer, the target's and the proposer's prefill,
        and the first token, a new root.

        Raises:
            ValueError: ``history`` does not have ``start_pos`` tokens."""
        history = list(history or [])
        if len(history) != start_pos:
            raise ValueError(f"history has {len(history)} tokens, start_pos is {start_pos}")
        clock = clock or GenerationClock()
        clock.start()
        tokens = [int(t) for t in prompt]
        r = self.r = SpecRequest(n_predict=n_predict, emit=emit, clock=clock, graph=SpecGraph(sampler),
                                 cutoff=self._cutoff(), context=history + tokens)
        self.target.reply_k = sampler.params.reply_k()  # greedy verification reads the argmax, top-k sampling the top k
        self._start_proposer(sampler.params)

        # prefill target and proposer, back to back (their pipelines work in parallel)
        self.target.submit_prompt(tokens, start_pos, self.n_ubatch)
        r.kv_top = len(r.context)
        self.proposer.prefill(r.context[:-1])
        last = self.target.drain(self.timeout_s)[-1]
        logits = last.logits[0]
        self._last_decision = last.finished_at
        if self._settle_after_prefill:
            self.proposer.settle(self.timeout_s)
        clock.prompt_done()
        first = sampler.sample(logits)
        self._accept_tokens([first])
        if not r.done:
            self._new_root(first)

    def _cutoff(self):
        """The request's confidence cutoff (PipeInfer IV.B.2), adaptive with ``--p-accept auto``."""
        s = self.s
        serial = None if s.asynchronous else (lambda: self.proposer.step_s)  # speculative: the target waits
        return (AdaptiveCutoff(self.acceptance, self.pass_cost, s.default_threshold, serial, self.decode_rate.rate)
                if self.adaptive
                else CutoffController(s.p_accept, s.p_recovery, s.p_decay))

    def _start_proposer(self, params) -> None:
        """The proposer's start of a request: its sampling parameters, a
        drafting RNG seeded from the request's seed, and the acceptance
        calibration (``--p-accept auto``)."""
        self.proposer.start(params, np.random.default_rng(None if params.seed is None else params.seed + 1),
                            self.acceptance.at_look if self.adaptive else None)

    def _wait_for_draft(self) -> bool:
        """The head's target stage is idle and the proposer can hand over
        what it drafted: rather wait for its next token? (``wait_draft``;
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
        chain = [self.acceptance.p(tree.draft_p[i]) for i in tree.path(tip)]
        n_pass = len(tree) + (self.r.pending_root is not None)
        if not wait_pays(chain, wait_s, n_pass, self.pass_cost):
            return False
        self.r.counts["waited_for_draft"] += 1
        return True

    def _wait_any(self) -> None:
        """Wait (bounded by ``timeout_s``) until the target or the proposer has a result."""
        t, p = self.target, self.proposer
        self._idle(lambda: t.ready() or p.ready(), self.timeout_s)

    # -- decisions -----------------------------------------------------------------

    def _accept_tokens(self, toks: list[int]) -> None:
        """Emit accepted tokens (up to n_predict, stopping after end of generation)."""
        r = self.r
        toks = toks[:r.n_predict - len(r.out)]
        for i, t in enumerate(toks):
            if self.is_eog(t):
                toks = toks[:i + 1]
                r.done = True
                break
        if not toks:
            r.done = True
            return
        r.out.extend(toks)
        r.context.extend(toks)
        self.proposer.observe(r.context)
        r.clock.token(len(toks))
        if r.emit(toks) or len(r.out) >= r.n_predict:
            r.done = True

    def _new_root(self, token: int) -> None:
        """A decided token no node carries (context[-1] == token).
        speculative: it leads the next tree. pipeinfer: a run starts for it at
        once (IV.A), carrying the subtree the proposer already drafted below
        it, if any (the proposer keeps drafting below that subtree's tip); an
        instant proposer drafts below the root first, so the root and its
        draft share one target pass."""
        r = self.r
        r.pending_root = token
        r.cutoff.rerooted()
        if not self.s.asynchronous:
            return
        sub, tip = self._salvage()
        if sub is not None and len(sub) == 0 and tip == -1 and self.proposer.active:
            # the draft is decoding this very token: send the root together with the
            # first draft token below it (one target pass for two tokens)
            r.spec_anchor = None
            r.counts["deferred_roots"] += 1
            return
        if sub is None and self.proposer.instant and self._may_speculate():
            self._begin_speculation()
            return
        run_nodes = self._submit_spec(None, sub if sub is not None else SpecTree(anchor_pos=len(r.context) - 1))
        if sub is not None:
            # the proposer goes on below its tip: a node of this run, or the root itself
            r.spec_anchor = r.graph.committed if tip == -1 else (run_nodes[tip] if run_nodes else ORPHAN)
            r.counts["salvaged_drafts"] += 1

    def _salvage(self) -> tuple[SpecTree | None, int]:
        """Cut the proposer's tree if the tokens decided since its anchor lead
        into it; return the part below them and the new index of its tip.
        Otherwise abandon the proposer's work (its draft results are dropped)."""
        r, p = self.r, self.proposer
        a = r.spec_anchor
        if not p.active:
            return None, -1
        if a is not None and a != ORPHAN and r.graph.nodes[a].state == ACCEPTED:
            found = p.salvage(r.context[r.graph.nodes[a].pos + 1:])
            if found is not None:
                sub, new_tip = found
                p.cut(r.cutoff.at(r.spec_path), self._room)
                if not self.s.continuous:
                    p.abandon()
                return sub, new_tip
        p.abandon()
        return None, -1

    def _handle(self, res: RunResult) -> None:
        r = self.r
        g = r.graph
        rid = res.run.run_id
        if res.cancelled:
            info = g.runs.get(rid)
            if info is None or not info.cancelled:
                raise ProtocolError(f"run {rid} came back cancelled, but the head did not cancel it")
            r.counts["returned_cancelled"] += 1
        else:
            r.counts["verified_runs"] += 1
        g.set_result(rid, None if res.cancelled else res.logits, rows=res.rows)
        if not res.cancelled:
            self.pass_cost.observe(res.run.n_tokens, res.finished_at - max(res.run.started_at, self._last_finish))
        self._last_finish = res.finished_at
        decisions = g.advance()
        for dp, ok in g.take_verified():
            self.acceptance.observe(dp, ok)
        if any(d.node is not None for d in decisions):
            r.cutoff.accepted()
        for seq, p0, p1 in g.take_swap_ops():           # buffer swap into sequence 0
            self.target.seq_cp(seq, 0, p0, p1)
        if decisions:
            if self._last_decision and res.finished_at:
                self.decode_rate.observe(len(decisions), res.finished_at - self._last_decision)
            self._last_decision = res.finished_at
            self._accept_tokens([d.token for d in decisions])
            last = decisions[-1]
            if last.node is None and not r.done:
                self._new_root(last.token)
        self._cancel_dead()
        for info in g.retirable():
            self._release(info)

    def _cancel_dead(self) -> None:
        """Cancel every run the graph reports dead (marked even when
        cancellation is off, so each is reported once), then mask the dead
        rows of PipeDec layer runs that keep a live node (one prune message
        for all of them: ggpipe.pipeline.masking)."""
        g = self.r.graph
        dead = g.dead_runs()
        rows = g.maskable_rows()
        if self.s.cancel and self.s.asynchronous:
            for d in dead:
                self.target.cancel(d)
                self.r.counts["cancel_sent"] += 1
            if rows:
                self.target.prune(rows)
                self.r.counts["rows_mask_sent"] += len(rows)

    def _release(self, info) -> None:
        """Clear a retired run's KV partition (pipelined behind its runs) and
        return it to the FIFO."""
        if info.partition is not None:
            for seq in info.seqs:
                self.target.seq_rm(seq)
            self.pool.release(info.partition)

    # -- speculation -------------------------------------------------------------

    def _may_speculate(self) -> bool:
        r = self.r
        if r.done or self.pool.n_free == 0:
            return False
        if not self.s.asynchronous:
            return r.pending_root is not None and not self.target.inflight and not r.cutoff.exhausted_at(1.0)
        if r.pending_root is not None:
            return not r.cutoff.exhausted_at(1.0)
        if r.graph.committed is None:
            return False
        if r.cutoff.exhausted_at(r.graph.path_p(r.graph.frontier(), self._calib)):
            return False
        inflight = r.graph.pending_runs(speculative_only=True)
        if inflight >= self.s.max_inflight:
            return False
        if not self.s.continuous:
            # asynchronous speculation alone: one tree below each root
            return inflight == 0 and not r.graph.nodes[r.graph.committed].children
        return True

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
        """Most nodes a tree anchored at ``anchor_pos`` may have: --draft, and
        no deeper than the tokens still to generate."""
        return self.r.room(anchor_pos, self.s.draft_max)

    def _begin_speculation(self) -> None:
        r = self.r
        anchor, ctx = self._anchor()
        max_nodes = self._room(len(ctx) - 1)
        if max_nodes <= 0:
            if r.pending_root is not None:
                self._submit_spec(None, SpecTree(anchor_pos=len(ctx) - 1))
            else:
                self._handle(self.target.wait(self.timeout_s))
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
            r.counts["stale_drafts"] += 1
            return None
        if anchor is not None and len(tree):
            node = g.nodes[anchor]
            if node.state == DEAD or (node.state == ACCEPTED and anchor != g.committed and g.committed is None):
                r.counts["stale_drafts"] += 1
                return None
            if node.state == ACCEPTED and anchor != g.committed:
                tree, mp = tree.reanchor(r.context[node.pos + 1:])
                if not tree:
                    r.counts["stale_drafts"] += 1
                    return None
                anchor = g.committed
                r.counts["reanchored_drafts"] += 1
        if len(tree) == 0:
            r.counts["failed_drafts"] += 1
            if r.pending_root is not None:
                self._submit_spec(None, tree)       # verify the root alone
            elif not self.target.ready():
                r.cutoff.failed_while_idle()
                if self.target.inflight:
                    self._handle(self.target.wait(self.timeout_s))
            return None
        if r.pending_root is None and anchor != g.committed:
            r.cutoff.continued()
        ids = self._submit_spec(anchor, tree)
        return {old: ids[new] for old, new in mp.items()} if ids else None

    def _submit_spec(self, anchor: int | None, tree: SpecTree) -> list[int] | None:
        r = self.r
        g = r.graph
        if anchor is not None and g.committed is None:
            return None  # everything it could build on was decided meanwhile
        part = self.pool.acquire() if len(tree) else None
        if len(tree) and part is None:
            r.counts["no_partition"] += 1
            if anchor is not None:
                return None
            tree = SpecTree(anchor_pos=tree.anchor_pos)  # a root is never dropped: send it alone
        self._trim_kv(tree.anchor_pos if anchor is None else tree.anchor_pos + 1)
        run_id = next_run_id()
        seqs = self.pool.seqs(part)[: len(tree.leaves())] if part is not None else []
        tokens, pos, n_seq_id, seq_ids, leaf_seq = tree.batch(seqs) if len(tree) else (
            np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), {})
        if anchor is None:
            # synchronous: the decided root token leads the batch, in seq 0 and every leaf sequence
            root = r.pending_root
            r.pending_root = None
            rpos = tree.anchor_pos
            for sq in seqs:
                self.target.seq_cp(0, sq, 0, rpos)
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
                self.target.seq_cp(src, sq, 0, tree.anchor_pos + 1)
            ids = g.add_tree(anchor, tree, run_id, leaf_seq, part, seqs)
            speculative = True
        run = Run(run_id=run_id, tokens=tokens, pos=pos, n_seq_id=n_seq_id, seq_ids=seq_ids,
                  outputs=np.ones(tokens.shape[0], dtype=np.int8), speculative=speculative)
        r.kv_top = max(r.kv_top, int(pos.max()) + 1)
        self.target.submit(run)
        r.counts["target_runs"] += 1
        r.counts["spec_runs"] += int(speculative)
        r.counts["root_runs"] += int(anchor is None and not speculative)
        # a dead anchor means the tree was born dead: cancel at once
        if speculative and anchor is not None:
            self._cancel_dead()
        return ids

    def _trim_kv(self, p0: int) -> None:
        """Before a run whose first position is ``p0`` is placed: remove, on
        every stage and pipelined behind the runs already issued, the cells
        that dead runs left at positions >= p0 (``seq_rm(-1, p0, -1)``).

        llama.cpp's KV cache places a batch in the first free cells from its
        ``head``, and ``seq_rm`` lowers ``head`` to the first freed cell
        (llama-kv-cache.cpp ``find_slot``, ``seq_rm``). With no stale cell at
        or above ``p0``, the run's cells land at index = position, as a
        single-token loop puts them; attention then sums over the same cells
        in the same order, and (with a build whose batched and single-token
        matmuls agree, README "Exactness") verified logits equal the
        single-node reference bit for bit, whatever the timing. Skipped while
        a pending node still lives at or above ``p0`` (a sibling branch of a
        tree), whose cells must stay."""
        r = self.r
        if r.kv_top > p0 and r.graph.pending_top() <= p0:
            self.target.seq_rm(-1, p0, -1)
            r.counts["kv_trims"] += 1
            r.kv_top = p0

    # -- the end -----------------------------------------------------------------

    def _finish(self) -> None:
        r = self.r
        g = r.graph
        if self.s.cancel and self.s.asynchronous:
            for info in g.runs.values():
                if info.speculative and not info.returned and not info.cancelled:
                    info.cancelled = True
                    self.target.cancel(info.run_id)
                    r.counts["cancel_sent"] += 1
        while self.target.inflight:
            res = self.target.wait(self.timeout_s)
            g.set_result(res.run.run_id, None)
            r.counts["returned_cancelled"] += int(res.cancelled)
        self.proposer.settle(self.timeout_s)
        for info in list(g.runs.values()):
            self._release(info)
        g.runs.clear()
        drafted = g.n_drafted
        passes = max(1, r.counts["verified_runs"])
        self.stats = dict(r.counts)
        self.stats.update(self.proposer.stats)
        self.stats.update(
            spec_type=self.proposer.name,
            drafted=drafted, draft_accepted=g.n_draft_accepted,
            acceptance_rate=(g.n_draft_accepted / drafted) if drafted else None,
            accepted_per_pass=(len(r.out) - 1) / passes if len(r.out) > 1 else None,
            draft_threshold=r.cutoff.threshold if self.adaptive else None,
            look_threshold=_finite_or(r.cutoff.look_threshold, "never") if self.adaptive else None,
            decode_rate=None if self.decode_rate.rate() is None else round(self.decode_rate.rate(), 2),
            acceptance_exponent=self.acceptance.k if self.adaptive else None,
            pass_cost_ms={n: round(1e3 * t, 2) for n, t in sorted(self.pass_cost.mean.items())},
            draft_step_ms=None if self.proposer.step_s is None else round(1e3 * self.proposer.step_s, 3),
            head_cancelled_before_start=self.target.stats["cancelled_before_start"],
            head_cancelled_mid_compute=self.target.stats["cancelled_mid_compute"],
            head_dropped_after_cancel=self.target.stats.get("dropped_after_cancel", 0),
            head_rows_masked=self.target.stats.get("rows_masked", 0),
        )


def _finite_or(x: float, word: str) -> float | str:
    """``x`` rounded for ``--json`` (strict JSON has no infinity), else ``word``."""
    return round(x, 4) if np.isfinite(x) else word
