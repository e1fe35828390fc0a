"""Many requests through one target pipeline: continuous batching with
slots, chunked prefill and several micro-batches in flight.

The anchors are llama.cpp's server (``-np N`` slots, one ``llama_batch`` per
step holding the next token of every generating slot plus a chunk of a
prompt being processed, a slot freed on stop or disconnect) and vLLM's
pipeline-parallel engine (a queue of micro-batches in flight, one per
stage, each scheduled from requests not already in flight).

* **Slots.** Slot ``s`` is KV sequence ``s`` on every stage. The target's
  contexts keep one KV stream per sequence (llama.cpp ``kv_unified =
  false``; ``-c`` is shared among the slots, ``n_ctx / n_slots`` cells each,
  as llama-server without ``--kv-unified``), so a slot's cells sit at index =
  position in a stream of its own and never among another request's: every
  request's logits are bit-identical to the same request run alone
  (docs/user-guide/parallel.md). A request takes the free slot whose
  cached tokens share the longest prefix with its prompt (the lowest id on
  a tie); the cells after that prefix are removed and the rest of the prompt
  is decoded (llama-server's prompt cache). When its first chunk goes,
  another slot may hold a longer prefix of its prompt (a chat template's
  system prompt, the requests of one burst): that slot's stream is copied
  into its own (``llama_memory_seq_cp`` of a whole stream, which llama.cpp
  does as a copy of the stream's K and V buffers in order with the runs
  before it on every stage) and only the rest is decoded
  (:func:`~ggpipe.decoding.parallel.prefix_cache.borrow_prefix`; vLLM's
  prefix caching across requests). A prompt whose longer shared prefix an
  earlier request is still sending waits for it instead of computing it
  again (:func:`~ggpipe.decoding.parallel.prefix_cache.awaits_donor`).
* **Micro-batches.** Each holds the rows of one group of generating slots
  (their next tokens, in slot order) and then chunks of waiting prompts,
  up to one token budget (``-b``, llama.cpp's ``n_batch``); a prompt that
  arrived while others were generating goes in micro-batches of its own,
  one after each of theirs, measured to keep their time between tokens
  bounded (:func:`~ggpipe.decoding.parallel.budget.plan_step`,
  :func:`~ggpipe.decoding.parallel.budget.plan_late`,
  :class:`~ggpipe.decoding.parallel.budget.LateShare`). A slot whose next
  token waits for logits is in one micro-batch at a time; prompt chunks of
  one slot may follow each other without waiting. With ``depth``
  micro-batches in flight (default: the pipeline's stages, so every stage
  works at once; the service passes ``--micro-batches``, by default as many
  as can compute at once), the generating slots fall into ``depth`` groups
  of consecutive slot ids that take turns
  (:func:`~ggpipe.decoding.parallel.slots.decode_groups`: consecutive, so
  that each stage evaluates a group in one ubatch, streaming its weights
  once).
* **Results** come back in order; each slot's row is sampled with the
  request's own sampler (its own random stream), so a seeded request gives
  the same tokens whatever runs beside it. A request that ends (end of
  generation, ``n_predict``, a stop string, its client gone) frees its slot
  at once; a new request starts at the next micro-batch.

No MPI here: the pipeline is a :class:`~ggpipe.backend.TargetBackend`
(``tests/test_scheduler.py`` runs this against the in-memory toy pipeline,
checking every slot's cells stream by stream).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ggpipe.backend import TargetBackend
from ggpipe.decoding.parallel.budget import ITL_BOUND, LateShare, late_prompts, plan_late, plan_step
from ggpipe.decoding.parallel.chain_draft import SlotDrafter
from ggpipe.decoding.parallel.lone_drafts import LoneDrafts
from ggpipe.decoding.parallel.prefix_cache import awaits_donor, borrow_prefix, pick_slot
from ggpipe.decoding.request import Request
from ggpipe.decoding.loop import Job, common_stats
from ggpipe.decoding.parallel.slots import SchedulerStats, Slot, _Row, pack_micro_batch, slots_view
from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.metrics import TokenRate
from ggpipe.pipeline.waiting import Wait, poll_wait
from ggpipe.runs import RunResult
from ggpipe.speculation.adaptive import Calibration


class Scheduler:
    """Args:
        target: the target pipeline (its contexts: one KV stream per slot).
        n_slots: slots (``--parallel``), KV sequences 0..n_slots-1.
        n_ctx_slot: KV cells of one slot (tokens a request's prompt and
            generation may fill).
        n_batch: most tokens per micro-batch (the token budget, ``-b``).
        is_eog: token -> end of generation?
        depth: micro-batches in flight (default: the pipeline's stages).
        timeout_s: bound of every wait for a result (seconds).
        idle: the wait when nothing is ready (``idle(ready, timeout_s)``);
            None: back-off polling.
        draft: a :class:`~ggpipe.decoding.parallel.chain_draft.SlotDrafter`: up to
            ``k`` drafted tokens that may follow ``context`` (a
            :class:`~ggpipe.decoding.parallel.chain_draft.LookupDrafter`, instant,
            or a :class:`~ggpipe.decoding.parallel.chain_draft.ChainDrafter` over
            the draft model, waited for; its ``step_s``, seconds per
            drafted token, is what the gate charges; a plain function
            ``draft(context, k) -> tokens`` is an instant lookup), or None:
            no speculation. Used while one request is generating
            (:class:`~ggpipe.decoding.parallel.lone_drafts.LoneDrafts`).
        draft_max: most drafted tokens per chain (at most ``n_batch - 1``).
        calibration: what adaptive depth measures, shared with ``draft``'s cutoff, or None.
        lookahead: PipeInfer's continuation for a request that generates
            alone (``--mode pipeinfer``; with ``depth`` >= 2): while its row
            waits for logits, up to ``depth - 1`` look-ahead rows built on
            it follow through the pipeline (:meth:`_send_ahead`; with a
            draft model ``depth``, the last one queued at the first stage,
            to compute the moment the stage frees), looked up
            on the spot by an instant ``draft`` (the n-gram lookup) or
            drafted without waiting by a draft with ranks
            (:class:`~ggpipe.decoding.parallel.lone_drafts.LoneDrafts`).
        partial_reuse: a slot's cells can be kept up to any position, and a
            request may start from another slot's cells
            (:func:`~ggpipe.decoding.parallel.prefix_cache.borrow_prefix`).
            False for a model whose state cannot be cut at a position
            (recurrent or hybrid: llama.cpp keeps or drops a sequence's
            state whole): a request keeps its slot's cells only where its
            prompt goes on after all of them, and borrows nothing.
        doing: ``doing(text)`` tells what the job is doing (the liveness
            messages': "answering 3 requests (1 queued, --parallel 4)"), or None.

    A lone request's speculation (its chains, look-ahead rows, their
    verification, the gate) is ``spec``, a
    :class:`~ggpipe.decoding.parallel.lone_drafts.LoneDrafts`.

    Attributes:
        stats: the counters (:class:`~ggpipe.decoding.parallel.slots.SchedulerStats`).
        share: how many tokens of prompts that arrived while others
            generate go in a micro-batch of their own
            (:class:`~ggpipe.decoding.parallel.budget.LateShare`; its
            ``bound``: the bound on the generating requests' time between
            tokens meanwhile, a factor of its value without them).
    """

    def __init__(self, target: TargetBackend, n_slots: int, n_ctx_slot: int, n_batch: int,
                 is_eog: Callable[[int], bool], depth: int | None = None, timeout_s: float = 60.0,
                 idle: Wait | None = None, draft: SlotDrafter | Callable[[list[int], int], list[int]] | None = None,
                 draft_max: int = 6, lookahead: bool = False, partial_reuse: bool = True,
                 doing: Callable[..., None] | None = None, calibration: Calibration | None = None):
        if n_slots < 1:
            raise ConfigError(f"--parallel must be at least 1, got {n_slots}")
        if n_batch < 1:
            raise ConfigError(f"--batch-size must be at least 1 token, got {n_batch}")
        self.target = target
        self.slots = [Slot(s) for s in range(n_slots)]
        self.n_ctx_slot = n_ctx_slot
        self.n_batch = n_batch
        self.is_eog = is_eog
        self.partial_reuse = partial_reuse
        self._doing = doing
        self.depth = max(1, depth if depth is not None else target.n_stages)
        self.timeout_s = timeout_s
        self.idle = idle or poll_wait
        self.queue: deque[Job] = deque()
        self._rows: dict[int, list[_Row]] = {}
        self._arrivals = 0           # requests submitted so far
        self._kind: dict[int, str] = {}   # run id -> "decode" (generating rows only), "late", or "step"
        self._late_turn = False      # a late prompt's micro-batch goes next (one after each with generating rows)
        self.stats = SchedulerStats()
        self.share = LateShare(ITL_BOUND)
        self.rate = TokenRate()      # the acceptances of the last 10 s (tokens_per_s)
        # a lone request's chains and look-ahead rows, their verification and the gate
        # (look-ahead rows follow a row in flight: with one micro-batch in flight there is no room for them)
        self.spec = LoneDrafts(target, draft if n_batch > 1 else None, min(draft_max, n_batch - 1),
                               lookahead and self.depth >= 2, n_ctx_slot, self.stats, calibration)

    # -- requests ------------------------------------------------------------------

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        """Raise ConfigError when a prompt of ``n_prompt`` tokens plus
        ``n_predict`` do not fit one slot's cells."""
        if n_prompt < 1:
            raise ConfigError("the prompt is empty")
        if n_prompt + n_predict > self.n_ctx_slot:
            raise ConfigError(f"the prompt ({n_prompt} tokens) plus -n {n_predict} do not fit one slot's context of "
                              f"{self.n_ctx_slot} KV cells (-c is shared among the --parallel slots: raise -c or "
                              "lower --parallel, -n or the prompt)")

    def submit(self, job: Job) -> None:
        """Queue a request (it starts when a slot is free).

        Raises:
            ConfigError: it does not fit a slot."""
        self.check_fits(len(job.tokens), job.n_predict)
        job.t_queued = time.monotonic()
        job.arrival = self._arrivals
        self._arrivals += 1
        self.queue.append(job)

    @property
    def n_queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self.queue)

    @property
    def n_busy(self) -> int:
        """Slots holding a request."""
        return sum(s.job is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        """Requests running or queued, or micro-batches in flight."""
        return bool(self.queue) or bool(self._rows) or self.n_busy > 0

    def _start_queued(self) -> None:
        """Give free slots to queued requests (longest cached prefix first),
        those that get slots at once shortest prompt first: a burst's prompts
        then lie in ascending length by slot id, and llama.cpp's ubatches of
        consecutive slots with equal tokens each (``split_equal``) are one per
        distinct length (16 prompts of 6-11 tokens: 6 instead of 13)."""
        n_free = sum(s.free for s in self.slots)
        if n_free > 1 and len(self.queue) > 1:
            starting = [self.queue.popleft() for _ in range(min(n_free, len(self.queue)))]
            self.queue.extendleft(reversed(sorted(starting, key=lambda j: len(j.tokens))))
        while self.queue:
            free = [s for s in self.slots if s.free]
            if not free:
                return
            job = self.queue.popleft()
            if job.cancelled:
                job.on_done(job)
                continue
            keep, slot = pick_slot(free, job.tokens, self.partial_reuse)
            self._start(slot, job, keep)

    def _start(self, slot: Slot, job: Job, keep: int) -> None:
        if keep < len(slot.kv):
            self.target.seq_rm(slot.seq, keep, -1)     # pipelined behind the runs already sent
            del slot.kv[keep:]
        job.slot, job.n_reused = slot.seq, keep
        job.draft_stats.pass_cost = self.spec.pass_cost     # reported beside the request's drafting
        job.queue_s = time.monotonic() - job.t_queued
        job.clock.start()     # TTFT and ITL from the start in a slot (the queue wait is queue_s)
        job.request = Request(n_predict=job.n_predict, emit=job.emit, clock=job.clock, is_eog=self.is_eog,
                              context=list(job.tokens))
        slot.job, slot.todo, slot.waiting = job, list(job.tokens[keep:]), False
        slot.generating_since = None
        self.stats.reused_tokens += keep
        if self.n_busy == 1 and not self.queue:
            self.spec.started(job.tokens)    # a request alone: the draft decodes its prompt beside the target

    def _end(self, slot: Slot) -> None:
        job = slot.job
        slot.job, slot.todo, slot.waiting = None, [], False
        slot.ahead = []     # look-ahead rows still in flight are dropped (their job has ended)
        job.clock.finish()
        self.stats.finished += 1
        job.on_done(job)

    # -- micro-batches --------------------------------------------------------------

    def _submit_next(self) -> bool:
        """Form and submit the next micro-batch, if any slot has something
        to send (or a look-ahead row, :meth:`_send_ahead`): after a
        micro-batch of generating rows, while prompts that arrived late
        wait, one of their chunks alone
        (:func:`~ggpipe.decoding.parallel.budget.plan_late`, as many tokens
        as :class:`~ggpipe.decoding.parallel.budget.LateShare` allows);
        otherwise the generating rows and the other prompts' chunks
        (:func:`~ggpipe.decoding.parallel.budget.plan_step`)."""
        defer = (lambda s: awaits_donor(self.slots, s)) if self.partial_reuse else None
        late = late_prompts(self.slots)
        plan, kind = [], "step"
        if late and self._late_turn:
            n_gen = sum(s.generating for s in self.slots)
            plan = plan_late(self.slots, self.share.tokens(-(-n_gen // self.depth), self.n_batch), late, defer)
            kind = "late"
        self._late_turn = False
        if not plan:
            plan = plan_step(self.slots, self.n_batch, self.depth, self.target.n_stages, defer, late)
            kind = "decode" if plan and all(slot.generating for slot, _, _ in plan) else "step"
            self._late_turn = bool(late) and any(slot.generating for slot, _, _ in plan)
        if not plan:
            return self._send_ahead()
        for i, (slot, n, _) in enumerate(plan):
            if self.partial_reuse and borrow_prefix(self.target, self.slots, slot, self.stats):
                # a shorter rest: this chunk may now be the prompt's last
                n = min(n, len(slot.todo))
                plan[i] = (slot, n, n == len(slot.todo))
        rows = []
        for slot, n, wants in plan:
            chunk = slot.todo[:n]
            del slot.todo[:n]
            chain = chunk[1:] if slot.job.request.out else []   # drafted tokens below a generating slot's token
            rows.append((_Row(slot, slot.job, wants, chain, p0=len(slot.kv)), chunk))
        self._submit(rows, kind)
        return True

    def _send_ahead(self) -> bool:
        """A look-ahead row (:meth:`LoneDrafts.ahead`) for a request
        that is the only one in the slots, with nothing queued, while its
        row waits for logits: up to ``depth - 1`` of them in flight (a
        draft model's: ``depth``), each built on the one before; while
        the pipeline holds runs, one that a draft model is still drafting
        goes once it has
        :data:`~ggpipe.decoding.parallel.lone_drafts.AHEAD_MIN_TOKENS`
        tokens. Returns whether one was sent."""
        if not self.spec.lookahead or self.queue:
            return False
        busy = [s for s in self.slots if s.job is not None]
        if len(busy) != 1 or not (busy[0].generating and busy[0].waiting and not busy[0].todo):
            return False
        made = self.spec.ahead(busy[0])
        if made is None:
            return False
        self._submit([made])
        return True

    def _submit(self, rows: list[tuple[_Row, list[int]]], kind: str = "decode") -> None:
        """Send one micro-batch (:func:`~ggpipe.decoding.parallel.slots.pack_micro_batch`)."""
        run, reply = pack_micro_batch(rows, self.stats)
        # the rows' samplers read the k best of each row (greedy: the argmax), or whole rows
        self.target.reply_k = 0 if not reply or 0 in reply else max(reply)
        self._rows[run.run_id] = [row for row, _ in rows]
        self._kind[run.run_id] = kind
        self.target.submit(run)

    def _handle(self, res: RunResult) -> None:
        """A micro-batch's logits: each row's request decides its next
        token (a chain: the drafted tokens the target agrees with, and one
        more)."""
        rows = self._rows.pop(res.run.run_id)
        kind = self._kind.pop(res.run.run_id)
        self.spec.timed(res)
        if res.run.started_at and res.finished_at:     # (the toy pipelines keep no time)
            took = self.share.service(res.run.started_at, res.finished_at)
            if kind == "decode":
                self.share.decoded(took)
            elif kind == "late":
                self.share.late(res.run.n_tokens, took)
        self.spec.clock = res.finished_at or time.perf_counter()   # the pipeline's clock (the toy's, in tests)
        k = 0
        for row in rows:
            slot = row.slot
            slot.in_flight -= 1
            if not row.logits:
                continue
            logits = [res.logits[k + i] for i in range(len(row.chain) + 1)]
            k += len(logits)
            if row.stale:                    # a look-ahead row built on tokens the target refused
                continue
            slot.waiting = False
            if slot.job is not row.job:      # the request ended while this row was in flight
                continue
            r = row.job.request
            if not r.out:
                r.clock.prompt_done()
                slot.generating_since = self._arrivals   # prompts submitted from now on arrive while it generates
            try:
                decided = self.spec.verify(row, logits)
            except Exception as e:   # this request's sampling failed (a bug): it ends alone, the others go on
                if isinstance(e, GGPipeError) and e.abort_job:
                    raise
                row.job.error = e
                self._end(slot)
                continue
            ahead = self.spec.settle(row, decided)
            n_out = len(r.out)
            r.accept(decided)
            self._generated(len(r.out) - n_out)
            if r.done:
                self._end(slot)
            elif ahead:
                slot.waiting = True          # the look-ahead row built on these tokens is the slot's row now
            else:
                slot.todo = [r.out[-1]] + self.spec.below(slot, sum(s.generating for s in self.slots) <= 1)

    def _end_stopped(self) -> None:
        """End the running requests that were cancelled or whose
        ``should_stop`` is true (a client that left while its prompt is
        processed): each frees its slot now; its rows still in flight are
        dropped as they return, and the cells its chunks filled stay as the
        slot's cached prefix, as any ended request's."""
        for slot in self.slots:
            job = slot.job
            if job is not None and (job.cancelled or job.should_stop()):
                job.request.done = True
                self._end(slot)

    def _generated(self, n: int) -> None:
        self.stats.generated += n    # tokens generated now
        self.rate.add(n)

    def reset(self) -> None:
        """The KV caches were cleared (target and draft), with nothing in
        flight: no slot holds cells."""
        for s in self.slots:
            s.kv = []

    def request_stats(self, job: Job) -> dict:
        """A finished request's statistics (``--json``'s ``decoder``):
        :func:`~ggpipe.decoding.loop.common_stats` of its drafting and of
        the micro-batches that carried it."""
        return common_stats(job, job.draft_stats, job.target_passes)

    # -- views (any thread) ----------------------------------------------------------

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last 10 seconds, every request together."""
        return self.rate.per_s()

    def step_tokens(self) -> dict:
        """Micro-batches sent and their tokens by kind (:meth:`SchedulerStats.step_tokens`)."""
        return self.stats.step_tokens()

    def view(self) -> list[dict]:
        """One dict per slot (:func:`~ggpipe.decoding.parallel.slots.slots_view`)."""
        return slots_view(self.slots, self.n_ctx_slot)

    # -- the loop ------------------------------------------------------------------

    def step(self, wake: Callable[[], bool] = lambda: False) -> None:
        """One turn: take every result that has arrived, start queued
        requests in free slots, fill the pipeline up to ``depth``
        micro-batches; then, if nothing could be done, wait (bounded) for a
        result, or until ``wake()`` is true (new requests from another
        thread).

        Raises:
            RankTimeoutError, ProtocolError: from the pipeline."""
        t = self.target
        if self._doing is not None:     # (the simulator's steps tell no one)
            self._doing(f"answering {self.n_busy} requests ({self.n_queued} queued, --parallel {len(self.slots)})")
        progressed = False
        while t.ready():
            self._handle(t.poll())
            progressed = True
        self._end_stopped()
        self._start_queued()
        while len(t.inflight) < self.depth and self._submit_next():
            progressed = True
        # a lone request's look-ahead rows drafted by a draft model: one more in flight than the micro-batches of
        # groups, queued at the first stage to compute the moment it frees (docs/user-guide/parallel.md)
        if self.spec.continuous and len(t.inflight) == self.depth and self._send_ahead():
            progressed = True
        if not progressed and t.inflight:
            self.idle(lambda: t.ready() or self.spec.arrived() or wake(), self.timeout_s)

    def run(self) -> None:
        """Step until every queued and running request has ended (a front
        end that must stop early ends its requests through their ``emit``
        and ``cancelled``), then drain the pipeline."""
        while self.busy:
            self.step()
        self.drain()

    def drain(self) -> None:
        """Wait for every micro-batch in flight (shutdown; results of
        requests still running are handled)."""
        while self.target.inflight:
            self._handle(self.target.wait(self.timeout_s))
        self.spec.finish()   # the draft's runs that followed a request
