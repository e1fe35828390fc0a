"""The speculative modes' shared core (PipeInfer section IV): one request's
speculation graph, KV partitions, tree and layer submission, KV trimming,
results, buffer swaps, cancellation and retirement, and its statistics.

The mode policies (:mod:`~ggpipe.decoding.speculative`,
:mod:`~ggpipe.decoding.pipeinfer`, :mod:`~ggpipe.decoding.pipedec`) decide
*what* to submit next and talk to the target only through this core and
the declared :class:`~ggpipe.backend.TargetBackend`; the core decides
nothing about speculation. Its parts:

* results come back in order; :class:`~ggpipe.speculation.graph.SpecGraph`
  decides tokens as far as logits allow; accepted cells are copied into
  sequence 0 ("buffer swap", IV.C.1-2); a decided token no node carries is
  handed to the policy as a new *root* (``on_root``); dead runs are
  cancelled (IV.D) and dead rows of PipeDec layers masked; retired
  partitions are cleared and returned to the FIFO;
* before a run is placed, the cells dead runs left at and above its first
  position are removed on every stage (:meth:`SpecCore.trim_kv`), so a
  chain's cells sit at index = position as in a single-token loop and
  verification is bit-exact in every run (docs/user-guide/exactness.md);
* the adaptive-depth measurements (acceptance calibration, pass cost
  curve, decode rate) are learned across requests.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.backend import TargetBackend
from ggpipe.decoding.spec_core_stats import request_stats
from ggpipe.decoding.request import Emit, SpecRequest
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import GGPipeError, ProtocolError
from ggpipe.metrics import GenerationClock
from ggpipe.pipeline.waiting import Wait, poll_wait
from ggpipe.runs import Run, RunResult, next_run_id
from ggpipe.sampling import Sampler
from ggpipe.speculation.adaptive import Calibration
from ggpipe.speculation.graph import SpecGraph
from ggpipe.speculation.kv_room import CellBook
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.tree import SpecTree

ORPHAN = -2  # anchor of a tree cut from one that was never submitted
ROOT_RESERVE = 1  # KV cells a speculative run leaves free: the next root's (ggpipe.speculation.kv_room)


class SpecCore:
    """Args:
        target: the target pipeline (the head's stage may be asynchronous).
        settings: speculation knobs.
        pool: the KV partitions of speculative runs.
        n_ubatch: prefill chunk size (tokens).
        is_eog: token -> end of generation?
        timeout_s: bound of every wait for a result (seconds).
        idle: the wait when nothing has a result: ``idle(ready,
            timeout_s)`` returns when ``ready()`` may be true.
            :class:`ggpipe.pipeline.waiting.EventWait` for real pipelines,
            the simulator's clock for simulated ones; None:
            :func:`~ggpipe.pipeline.waiting.poll_wait`.
        cancels: dead runs are cancelled and dead rows masked (the
            asynchronous modes, unless ``--no-cancel``).
        n_cells: the target's KV cells (its ``n_cells``);
            None: unbounded. Speculative cells are admitted only where they
            fit (:meth:`spec_room`): a request whose prompt and ``-n`` fill
            the context still finishes, its trees shrinking near the end.

    Attributes:
        r: the request being generated (:class:`SpecRequest`).
        on_root: the policy's handler of a decided token no node carries.
        observe: the drafter's view of each decision (the context so far).
    """

    def __init__(self, target: TargetBackend, settings: SpecSettings, pool: PartitionPool, n_ubatch: int,
                 is_eog: Callable[[int], bool], timeout_s: float = 60.0, idle: Wait | None = None,
                 cancels: bool = False, n_cells: int | None = None):
        self.target = target
        self.n_cells = n_cells
        self.cells: CellBook | None = None
        self.s = settings
        self.pool = pool
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self.timeout_s = timeout_s
        self.idle = idle or poll_wait
        self.cancels = cancels
        self.r: SpecRequest | None = None
        self.on_root: Callable[[int], None] = lambda token: None
        self.observe: Callable[[list[int]], None] = lambda context: None
        # adaptive speculation depth (--p-accept auto): learnt across requests
        self.calibration = Calibration()
        self.acceptance = self.calibration.acceptance
        self.pass_cost = self.calibration.pass_cost
        self.decode_rate = self.calibration.decode_rate
        self._last_decision = 0.0     # when the request's last tokens were decided (the results' clock)

    # -- a request's start -----------------------------------------------------

    def begin(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, emit: Emit, clock: GenerationClock,
              history: list[int], cutoff) -> SpecRequest:
        """A new request (``self.r``) whose context is ``history + prompt``;
        the target answers with the top ``reply_k`` logits the sampler needs."""
        self.r = SpecRequest(n_predict=n_predict, emit=emit, clock=clock, is_eog=self.is_eog,
                             graph=SpecGraph(sampler), cutoff=cutoff,
                             context=history + [int(t) for t in prompt])
        self.r.graph.draft_stats.pass_cost = self.pass_cost     # reported beside the request's drafting
        self.target.reply_k = sampler.params.reply_k()  # greedy verification reads the argmax, top-k sampling the top k
        # the target's cells: sequence 0 holds the history (the engine removed the rest), nothing else does
        self.cells = CellBook(self.n_cells, seq0=len(history)) if self.n_cells else None
        return self.r

    def submit_prompt(self, n_prompt: int, start_pos: int) -> None:
        """The request's last ``n_prompt`` context tokens go down the target
        pipeline from ``start_pos`` (chunks of ``n_ubatch``; not waited for)."""
        r = self.r
        self.target.submit_prompt(r.context[len(r.context) - n_prompt:], start_pos, self.n_ubatch)
        r.kv_top = len(r.context)
        if self.cells is not None:
            self.cells.place(range(start_pos, len(r.context)), [[0]] * (len(r.context) - start_pos))

    def prompt_logits(self) -> np.ndarray:
        """Wait for the prompt's runs; the logits (n_vocab,) of its last token."""
        last = self.target.drain(self.timeout_s)[-1]
        self._last_decision = last.finished_at
        return last.logits[0]

    def first_token(self, sampler: Sampler, logits: np.ndarray) -> None:
        """Decide the first token from the prompt's ``logits``; it becomes a root."""
        self.r.clock.prompt_done()
        first = sampler.sample(logits)
        self.accept([first])
        if not self.r.done:
            self.on_root(first)

    @property
    def last_decision(self) -> float:
        """When the request's last tokens were decided: its last result's
        ``finished_at`` (the pipelines' clock: ``time.perf_counter`` on real
        ranks, virtual seconds in the simulator)."""
        return self._last_decision

    # -- decisions ---------------------------------------------------------------

    def accept(self, toks: list[int]) -> None:
        """Accept decided tokens (:meth:`Request.accept`); the drafter observes them."""
        if self.r.accept(toks):
            self.observe(self.r.context)

    def handle(self, res: RunResult) -> None:
        """A run's result: decide what its logits allow, swap accepted cells
        into sequence 0, hand a decided token no node carries to
        ``on_root``, cancel dead runs, retire finished ones.

        Raises:
            ProtocolError: a run came back cancelled that was not cancelled."""
        r = self.r
        g = r.graph
        self._take_result(res)
        self.pass_cost.finished(res.run.n_tokens, res.run.started_at, res.finished_at, counts=not res.cancelled)
        decisions = g.advance()
        for dp, ok in g.take_verified():
            self.acceptance.observe(dp, ok)
        if any(d.node is not None for d in decisions):
            r.cutoff.accepted()
        for seq, p0, p1 in g.take_swap_ops():           # buffer swap into sequence 0
            self.seq_cp(seq, 0, p0, p1)
        if decisions:
            if self._last_decision and res.finished_at:
                self.decode_rate.observe(len(decisions), res.finished_at - self._last_decision)
            self._last_decision = res.finished_at
            self.accept([d.token for d in decisions])
            last = decisions[-1]
            if last.node is None and not r.done:
                self.on_root(last.token)
        self.cancel_dead()
        for info in g.retirable():
            self.release(info)
        g.trim()    # nodes far behind the committed one: a long request's graph stays bounded

    def _take_result(self, res: RunResult) -> None:
        """Count a run's result (verified, or cancelled as the head asked)
        and give the graph its logits.

        Raises:
            ProtocolError: a run came back cancelled that was not cancelled."""
        r, rid = self.r, res.run.run_id
        if res.cancelled:
            info = r.graph.runs.get(rid)
            if info is None or not info.cancelled:
                raise ProtocolError(f"run {rid} came back cancelled, but the head did not cancel it")
            r.counts.returned_cancelled += 1
        else:
            r.counts.verified_runs += 1
        r.graph.set_result(rid, None if res.cancelled else res.logits, rows=res.rows)

    def wait_result(self) -> None:
        """Wait (bounded) for the oldest run in flight and handle it."""
        self.handle(self.target.wait(self.timeout_s))

    def cancel_dead(self) -> None:
        """Cancel every run the graph reports dead (marked even when
        cancellation is off, so each is reported once), then mask the dead
        rows of PipeDec layer runs that keep a live node (one prune message
        for all of them: ggpipe.pipeline.masking)."""
        g = self.r.graph
        dead = g.dead_runs()
        rows = g.maskable_rows()
        if self.cancels:
            for d in dead:
                self.target.cancel(d)
                self.r.counts.cancel_sent += 1
            if rows:
                self.target.prune(rows)
                self.r.counts.rows_mask_sent += len(rows)

    def release(self, info) -> None:
        """Clear a retired run's KV partition (pipelined behind its runs) and
        return it to the FIFO."""
        if info.partition is not None:
            for seq in info.seqs:
                self.seq_rm(seq)
            self.pool.release(info.partition)

    # -- KV cells (room for speculation: ggpipe.speculation.kv_room) ----------------

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``seq_cp`` on the target, counted."""
        self.target.seq_cp(src, dst, p0, p1)
        if self.cells is not None:
            self.cells.cp(src, dst, p0, p1)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """``seq_rm`` on the target, counted."""
        self.target.seq_rm(seq, p0, p1)
        if self.cells is not None:
            self.cells.rm(seq, p0, p1)

    def spec_room(self) -> int:
        """Speculative cells the target's KV cache takes now, leaving the
        next root's free (a large number when its size is unknown)."""
        if self.cells is None:
            return 1 << 30
        return max(0, self.cells.free() - ROOT_RESERVE)

    def make_room(self, n: int) -> None:
        """Before a root run is placed (every pending node is dead, so no
        result can decide a token): retire what can be, and wait for results
        of dead runs until ``n`` cells are free.

        Raises:
            GGPipeError: the cells are not free with nothing in flight (the
                request does not fit the context)."""
        if self.cells is None:
            return
        g = self.r.graph
        while self.cells.free() < n:
            for info in g.retirable():
                self.release(info)
            if self.cells.free() >= n:
                break
            if not self.target.inflight:
                raise GGPipeError(f"the KV cache is full ({self.cells.n_cells} cells, {self.cells.used} in use): "
                                  "raise --ctx-size or shorten the prompt/-n")
            res = self.target.wait(self.timeout_s)
            self._take_result(res)
            self.pass_cost.finished(res.run.n_tokens, res.run.started_at, res.finished_at, counts=False)
            self.r.counts.kv_room_waits += 1

    # -- submission --------------------------------------------------------------------

    def submit_tree(self, anchor: int | None, tree: SpecTree) -> list[int] | None:
        """Submit a drafted micro-batch below graph node ``anchor`` (None:
        below the pending root, which leads the batch in sequence 0 and every
        leaf sequence) as one run in a free KV partition whose sequences first
        receive the cells of the path to the anchor (IV.C.3). Returns the
        graph node ids of the tree's nodes, or None when nothing was sent."""
        r = self.r
        g = r.graph
        if anchor is not None and g.committed is None:
            return None  # everything it could build on was decided meanwhile
        self.trim_kv(tree.anchor_pos if anchor is None else tree.anchor_pos + 1)
        if anchor is None:
            self.make_room(1)       # a root is never dropped: it waits for cells if it must
        room = self.spec_room() - (anchor is None)
        if len(tree) > room:        # the context is nearly full: the tree shrinks (its first nodes stay)
            tree = tree.prefix(max(0, room))
            r.counts.kv_room_cuts += 1
            if anchor is not None and not len(tree):
                return None
        part = self.pool.acquire() if len(tree) else None
        if len(tree) and part is None:
            r.counts.no_partition += 1
            if anchor is not None:
                return None
            tree = SpecTree(anchor_pos=tree.anchor_pos)  # a root is never dropped: send it alone
        run_id = next_run_id()
        seqs = self.pool.seqs(part)[: len(tree.leaves())] if part is not None else []
        tokens, pos, n_seq_id, seq_ids, leaf_seq = tree.batch(seqs) if len(tree) else (
            np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), {})
        if anchor is None:
            root = r.pending_root
            r.pending_root = None
            rpos = tree.anchor_pos
            for sq in seqs:
                self.seq_cp(0, sq, 0, rpos)
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
                self.seq_cp(src, sq, 0, tree.anchor_pos + 1)
            ids = g.add_tree(anchor, tree, run_id, leaf_seq, part, seqs)
            speculative = True
        run = Run(run_id=run_id, tokens=tokens, pos=pos, n_seq_id=n_seq_id, seq_ids=seq_ids,
                  outputs=np.ones(tokens.shape[0], dtype=np.int8), speculative=speculative)
        self.submit(run)
        r.counts.spec_runs += int(speculative)
        r.counts.root_runs += int(anchor is None and not speculative)
        # a dead anchor means the tree was born dead: cancel at once
        if speculative and anchor is not None:
            self.cancel_dead()
        return ids

    def submit_layer(self, tokens: list[int], pos: int, parents: list[int], dps: list[float]) -> list[int]:
        """Submit one layer of a prediction tree (PipeDec) as a speculative
        run in a free KV partition (the caller checked there is one): node i
        (``tokens[i]`` at ``pos``, draft probability ``dps[i]``) in a sequence
        of its own, a copy of its parent's (graph node ``parents[i]``) up to
        the parent. Returns the new graph node ids."""
        g = self.r.graph
        part = self.pool.acquire()
        seqs = self.pool.seqs(part)[: len(tokens)]
        self.trim_kv(pos)
        for parent, s in zip(parents, seqs):
            self.seq_cp(g.nodes[parent].seq, s, 0, pos)
        rid = next_run_id()
        gids = g.add_layer(rid, parents, tokens, dps, seqs, part)
        self.submit(Run.layer(tokens, pos, seqs, run_id=rid, speculative=True))
        self.r.counts.spec_runs += 1
        return gids

    def submit(self, run: Run) -> None:
        """Start ``run`` on the target (its cells raise ``kv_top``)."""
        r = self.r
        r.kv_top = max(r.kv_top, int(run.pos.max()) + 1)
        if self.cells is not None:
            self.cells.place_run(run)
        self.target.submit(run)
        r.counts.target_runs += 1

    def trim_kv(self, p0: int) -> None:
        """Before a run whose first position is ``p0`` is placed: remove, on
        every stage and pipelined behind the runs already issued, the cells
        that dead runs left at positions >= p0 (``seq_rm(-1, p0, -1)``).

        llama.cpp's KV cache places a batch in the first free cells from its
        ``head``, and ``seq_rm`` lowers ``head`` to the first freed cell
        (llama-kv-cache.cpp ``find_slot``, ``seq_rm``). With no stale cell at
        or above ``p0``, the run's cells land at index = position, as a
        single-token loop puts them; attention then sums over the same cells
        in the same order, and (with a build whose batched and single-token
        matmuls agree, docs/user-guide/exactness.md) verified logits equal the
        single-node reference bit for bit, whatever the timing. Skipped while
        a pending node still lives at or above ``p0`` (a sibling branch of a
        tree), whose cells must stay."""
        r = self.r
        if r.kv_top > p0 and r.graph.pending_top() <= p0:
            self.seq_rm(-1, p0, -1)
            r.counts.kv_trims += 1
            r.kv_top = p0

    # -- the end -----------------------------------------------------------------

    def finish(self, drafter, adaptive: bool) -> dict:
        """The request is done: cancel the speculative runs still in flight
        (when cancelling), take every result, let ``drafter`` (a proposer or
        PipeDec's layer drafter) settle its own, retire every partition;
        returns the request's statistics (``--json``'s ``decoder``)."""
        r = self.r
        g = r.graph
        if self.cancels:
            for info in g.runs.values():
                if info.speculative and not info.returned and not info.cancelled:
                    info.cancelled = True
                    self.target.cancel(info.run_id)
                    r.counts.cancel_sent += 1
        while self.target.inflight:
            res = self.target.wait(self.timeout_s)
            g.set_result(res.run.run_id, None)
            r.counts.returned_cancelled += int(res.cancelled)
        drafter.settle(self.timeout_s)
        for info in list(g.runs.values()):
            self.release(info)
        g.runs.clear()
        return request_stats(self, drafter, adaptive)
