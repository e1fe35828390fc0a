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
  (README "Many requests at once"). A request takes the free slot whose
  cached tokens share the longest prefix with its prompt (the lowest id on
  a tie); the cells after that prefix are removed and the rest of the prompt
  is decoded (llama-server's prompt cache).
* **Micro-batches.** Each holds either the next token of generating slots
  (in slot order: llama.cpp evaluates consecutive sequence ids of a
  non-unified cache in one ubatch) or one chunk of one prompt (chunked
  prefill, at most ``n_ubatch`` tokens); while both wait, they take turns
  (:func:`plan_microbatch` says why they are not mixed). A slot whose next
  token waits for logits is in one micro-batch at a time; prompt chunks of
  one slot may follow each other without waiting. With ``depth`` micro-batches in
  flight (default: the pipeline's stages, so every stage works at once; the
  service passes ``--micro-batches``, by default as many as can compute at once), the
  generating slots fall into ``depth`` groups of consecutive slot ids that
  take turns (:func:`~ggpipe.decoding.slots.decode_groups`: consecutive, so
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

import numpy as np

from ggpipe.backend import TargetBackend
from ggpipe.decoding.request import Request
from ggpipe.decoding.slots import Job, Slot, _Row, plan_microbatch
from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.kv_reuse import reusable_prefix
from ggpipe.pipeline.waiting import Wait, poll_wait
from ggpipe.runs import Run, RunResult, next_run_id
from ggpipe.speculation.adaptive import PassCost
from ggpipe.speculation.gate import DraftGate

RATE_WINDOW_S = 10.0   # the window of tokens_per_s()


class Scheduler:
    """Args:
        target: the target pipeline (its contexts: one KV stream per slot).
        n_slots: slots (``--parallel``), KV sequences 0..n_slots-1.
        n_ctx_slot: KV cells of one slot (tokens a request's prompt and
            generation may fill).
        n_ubatch: most tokens per micro-batch.
        is_eog: token -> end of generation?
        depth: micro-batches in flight (default: the pipeline's stages).
        timeout_s: bound of every wait for a result (seconds).
        idle: the wait when nothing is ready (``idle(ready, timeout_s)``);
            None: back-off polling.
        draft: ``draft(context, k) -> tokens``: up to ``k`` drafted tokens
            that may follow ``context`` (an n-gram lookup, instant, or a
            :class:`~ggpipe.decoding.chain_draft.ChainDrafter` over the
            draft model, waited for; its ``step_s``, seconds per drafted
            token, is what the gate charges, 0 when absent), or None: no
            speculation. Used while one greedy request is generating
            (:meth:`_draft_below`).
        draft_max: most drafted tokens per chain.
        lookahead: PipeInfer's continuation for a request that generates
            alone (``--mode pipeinfer``; an instant ``draft`` only, e.g. the
            n-gram lookup): while its row waits for logits, up to
            ``depth - 1`` look-ahead rows built on it follow through the
            pipeline (:meth:`_send_ahead`).

    Attributes:
        stats: "micro_batches", "rows", "prefill_tokens", "generated",
            "finished", "reused_tokens", "drafted", "draft_accepted",
            "draft_skipped", "lookahead" (look-ahead rows sent),
            "lookahead_kept" (of them, built on what the target then
            decided) (cumulative).
    """

    def __init__(self, target: TargetBackend, n_slots: int, n_ctx_slot: int, n_ubatch: int,
                 is_eog: Callable[[int], bool], depth: int | None = None, timeout_s: float = 60.0,
                 idle: Wait | None = None, draft: Callable[[list[int], int], list[int]] | None = None,
                 draft_max: int = 6, lookahead: bool = False):
        if n_slots < 1:
            raise ConfigError(f"--parallel must be at least 1, got {n_slots}")
        self.target = target
        self.slots = [Slot(s) for s in range(n_slots)]
        self.n_ctx_slot = n_ctx_slot
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self.depth = max(1, depth if depth is not None else getattr(target, "n_stages", 1))
        self.timeout_s = timeout_s
        self.idle = idle or poll_wait
        self.queue: deque[Job] = deque()
        self._rows: dict[int, list[_Row]] = {}
        self._prompt_turn = False    # a prompt chunk goes next, when both prompts and tokens wait
        self.draft, self.draft_max = draft, draft_max
        self.lookahead = lookahead and draft is not None and getattr(draft, "follow", None) is None
        self._drafting = None    # the request whose last planned root the gate let draft a chain
        self.gate = DraftGate()      # whether a chain pays (speculation.gate), from the passes' measured costs
        self.pass_cost = PassCost()
        self._last_finish = 0.0
        self._clock = 0.0                 # when the result being handled finished (seconds)
        self.stats = dict.fromkeys(("micro_batches", "rows", "prefill_tokens", "generated", "finished",
                                    "reused_tokens", "drafted", "draft_accepted", "draft_skipped",
                                    "lookahead", "lookahead_kept"), 0)
        self._recent: deque[tuple[float, int]] = deque()   # (when, tokens) of the acceptances of the last RATE_WINDOW_S

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
        self.queue.append(job)

    @property
    def n_busy(self) -> int:
        """Slots holding a request."""
        return sum(s.job is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        """Requests running or queued, or micro-batches in flight."""
        return bool(self.queue) or bool(self._rows) or self.n_busy > 0

    def _start_queued(self) -> None:
        """Give free slots to queued requests (longest cached prefix first)."""
        while self.queue:
            free = [s for s in self.slots if s.free]
            if not free:
                return
            job = self.queue.popleft()
            if job.cancelled:
                job.on_done(job)
                continue
            slot = max(free, key=lambda s: (reusable_prefix(s.kv, job.tokens), -s.seq))
            self._start(slot, job)

    def _start(self, slot: Slot, job: Job) -> None:
        keep = reusable_prefix(slot.kv, job.tokens)
        if keep < len(slot.kv):
            self.target.seq_rm(slot.seq, keep, -1)     # pipelined behind the runs already sent
            del slot.kv[keep:]
        job.slot, job.n_reused = slot.seq, keep
        job.queue_s = time.monotonic() - job.t_queued
        job.clock.start()     # TTFT and ITL from the start in a slot (the queue wait is queue_s)
        job.request = Request(n_predict=job.n_predict, emit=job.emit, clock=job.clock, is_eog=self.is_eog,
                              context=list(job.tokens))
        slot.job, slot.todo, slot.waiting = job, list(job.tokens[keep:]), False
        self.stats["reused_tokens"] += keep

    def _end(self, slot: Slot) -> None:
        job = slot.job
        slot.job, slot.todo, slot.waiting = None, [], False
        slot.ahead = []     # look-ahead rows still in flight are dropped (their job has ended)
        job.clock.finish()
        self.stats["finished"] += 1
        job.on_done(job)

    # -- micro-batches --------------------------------------------------------------

    def _submit_next(self) -> bool:
        """Form and submit the next micro-batch, if any slot has something to
        send (or a look-ahead row, :meth:`_send_ahead`)."""
        plan = plan_microbatch(self.slots, self.n_ubatch, self.depth, self._prompt_turn)
        if not plan:
            return self._send_ahead()
        self._prompt_turn = bool(plan[0][0].job.request.out)   # tokens now: a prompt's turn next
        rows = []
        for slot, n, wants in plan:
            chunk = slot.todo[:n]
            del slot.todo[:n]
            chain = chunk[1:] if slot.job.request.out else []   # drafted tokens below a generating slot's token
            rows.append((_Row(slot, slot.job, wants, chain, p0=len(slot.kv)), chunk))
            if not wants:
                self.stats["prefill_tokens"] += n
        self._submit(rows)
        return True

    def _send_ahead(self) -> bool:
        """PipeInfer's continuation (paper §IV.A, asynchronous speculation),
        for a greedy request that is the only one in the slots, with nothing
        queued: while its row waits for logits, a look-ahead row follows it
        through the stages that would idle: the drafted guess of the token
        the target will decide after everything in flight is accepted, and
        the drafted chain below that guess, placed at the next positions of
        the slot's own KV stream. Its logits count only if the row before it
        is accepted whole and the target's next token is the guess
        (:meth:`_settle_ahead`); otherwise its cells are removed (a
        ``seq_rm`` that every stage applies after it, in order) and its
        logits dropped. At most ``depth`` micro-batches are in flight, so
        up to ``depth - 1`` look-ahead rows, each built on the one before.

        Only while chains pay: where the gate
        (:class:`~ggpipe.speculation.gate.DraftGate`) let the request's last
        planned root draft. A look-ahead row is speculation too, and where
        stages share a host's cores, two that compute at once slow each
        other (docs/BENCHMARKS.md §25: guesses sent at every root lost up to
        0.90x on this project's 2-core VM on prompts whose guesses were
        seldom kept). Returns whether one was sent."""
        if not self.lookahead or self.depth < 2 or self.queue:
            return False
        busy = [s for s in self.slots if s.job is not None]
        if len(busy) != 1:
            return False
        slot = busy[0]
        r = slot.job.request
        if not (slot.generating and slot.waiting and not slot.todo and slot.job.sampler.params.greedy):
            return False
        beyond = len(slot.kv) - len(r.context)      # drafted tokens in flight, not yet decided
        if self._drafting is not slot.job:          # the gate did not let the request's last planned root draft
            return False
        room = min(self.draft_max + 1, r.n_predict - len(r.out) - beyond - 1, self.n_ctx_slot - len(slot.kv) - 2)
        guess = self.draft(list(slot.kv), room) if room >= 1 else []
        if not guess:
            return False
        row = _Row(slot, slot.job, True, guess[1:], p0=len(slot.kv), guess=guess[0])
        slot.ahead.append(row)
        self.stats["lookahead"] += 1
        self.stats["drafted"] += len(guess)
        slot.job.drafted += len(guess)
        self._submit([(row, guess)])
        return True

    def _submit(self, rows: list[tuple[_Row, list[int]]]) -> None:
        """Send one micro-batch: each row's tokens at the next positions of
        its slot's stream (a logit row for every token of a row with a
        chain, else for its last token when it asks)."""
        tokens, pos, seqs, outputs, reply = [], [], [], [], []
        for row, chunk in rows:
            slot, n = row.slot, len(chunk)
            row.root = row.p0 + n - 1 - len(row.chain)
            tokens += chunk
            pos += range(row.p0, row.p0 + n)
            seqs += [slot.seq] * n
            outputs += [int(bool(row.chain))] * (n - 1) + [int(row.logits)]
            slot.kv += chunk
            slot.in_flight += 1
            slot.last_sent = self.stats["micro_batches"]
            slot.waiting = slot.waiting or row.logits
            if row.logits:
                reply.append(slot.job.sampler.params.reply_k())
        n = len(tokens)
        run = Run(run_id=next_run_id(), tokens=np.asarray(tokens, np.int32), pos=np.asarray(pos, np.int32),
                  n_seq_id=np.ones(n, np.int32), seq_ids=np.asarray(seqs, np.int32),
                  outputs=np.asarray(outputs, np.int8))
        # the rows' samplers read the k best of each row (greedy: the argmax), or whole rows
        self.target.reply_k = 0 if not reply or 0 in reply else max(reply)
        self._rows[run.run_id] = [row for row, _ in rows]
        self.target.submit(run)
        self.stats["micro_batches"] += 1
        self.stats["rows"] += n

    def _handle(self, res: RunResult) -> None:
        """A micro-batch's logits: each row's request decides its next
        token (a chain: the drafted tokens the target agrees with, and one
        more)."""
        rows = self._rows.pop(res.run.run_id)
        self._timed(res)
        self._clock = res.finished_at or time.perf_counter()   # the pipeline's clock (the toy's, in tests)
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
            try:
                decided = self._verify(row, logits)
            except Exception as e:   # this request's sampling failed (a bug): it ends alone, the others go on
                if isinstance(e, GGPipeError) and e.abort_job:
                    raise
                row.job.error = e
                self._end(slot)
                continue
            ahead = self._settle_ahead(row, decided)
            n_out = len(r.out)
            r.accept(decided)
            self._generated(len(r.out) - n_out)
            if r.done:
                self._end(slot)
            elif ahead:
                slot.waiting = True          # the look-ahead row built on these tokens is the slot's row now
            else:
                slot.todo = [r.out[-1]] + self._draft_below(slot)

    def _verify(self, row: _Row, logits: list) -> list[int]:
        """The tokens a row decides: its sampled token, or for a chain (greedy
        requests only) the drafted tokens the target's argmax agrees with and
        the target's token after them; the cells of the drafted tokens it
        refuses are removed by :meth:`_settle_ahead`."""
        sampler = row.job.sampler
        decided = [sampler.sample(logits[0])]
        for t, lg in zip(row.chain, logits[1:]):
            if t != decided[-1]:
                break
            decided.append(sampler.sample(lg))
        if row.chain:
            matched = len(decided) - 1
            self.gate.observe(matched, len(row.chain))
            self.stats["draft_accepted"] += matched
            row.job.draft_accepted += matched
        return decided

    def _settle_ahead(self, row: _Row, decided: list[int]) -> bool:
        """After ``row``'s tokens were decided: the slot's next look-ahead row
        becomes its row when ``row`` was accepted whole and the target's
        next token is that row's guess (True); otherwise every look-ahead
        row of the slot is dropped, and the cells after the tokens the
        target took (``row``'s refused drafted tokens, the look-ahead rows')
        are removed (``seq_rm``, pipelined behind the runs sent)."""
        slot = row.slot
        if slot.ahead and len(decided) == len(row.chain) + 1 and slot.ahead[0].guess == decided[-1]:
            slot.ahead.pop(0).guess = None
            self.stats["lookahead_kept"] += 1
            self.stats["draft_accepted"] += 1
            row.job.draft_accepted += 1
            return True
        for a in slot.ahead:
            a.stale = True
        slot.ahead = []
        cut = row.root + len(decided)   # through the row's token and the drafted tokens the target agrees with
        if cut < len(slot.kv):
            self.target.seq_rm(slot.seq, cut, -1)
            del slot.kv[cut:]
        return False

    def _draft_below(self, slot: Slot) -> list[int]:
        """Drafted tokens to send below the slot's next token: only for a
        greedy request that generates alone (beside other generating slots a
        chain travels in a micro-batch of its own, a whole pass, where its
        plain token rides in its group's batch almost for free), only while
        a chain pays (:class:`~ggpipe.speculation.gate.DraftGate`: the
        tokens per second of the request's drafted and plain roots as
        measured while it generates alone, and before both are, the accepted
        tokens per chain against the draft's steps and the bigger pass)."""
        r = slot.job.request
        room = 0
        if (self.draft is not None and slot.job.sampler.params.greedy
                and sum(1 for s in self.slots if s.generating) <= 1):
            room = min(self.draft_max, r.n_predict - len(r.out), self.n_ctx_slot - len(slot.kv) - 2)
        if room <= 0:                       # no draft, sampled, beside other generating slots, or no room
            self.gate.forget_root()
            self._drafting = None
            return []
        now = self._clock
        self.gate.root(slot.job, now, len(r.out))     # the request's last root, alone: its tokens per second
        chain = []
        follow = getattr(self.draft, "follow", None)      # a drafter with ranks of its own (ChainDrafter)
        attempt = self.gate.pays_at(getattr(self.draft, "step_s", 0.0), self.pass_cost)
        if attempt and follow is not None and not self.draft.caught_up(r.context):
            attempt = False                 # the draft is still decoding the context: this root goes plainly
        if attempt:
            chain = self.draft(r.context, room)
            if not chain:
                self.gate.observe(0, 0)     # an attempt that drafted nothing (it cost the draft's step)
        else:
            self.stats["draft_skipped"] += 1
            if follow is not None:
                follow(r.context)           # the draft follows the request meanwhile, not waited for
        self.gate.rooted(slot.job, now, len(r.out), attempt)
        self._drafting = slot.job if attempt else None
        self.stats["drafted"] += len(chain)
        slot.job.drafted += len(chain)
        return chain

    def _generated(self, n: int) -> None:
        """Count ``n`` tokens generated now; forget those older than the
        rate window here, on the loop's thread (the window stays bounded
        whether or not anyone reads :meth:`tokens_per_s`)."""
        self.stats["generated"] += n
        now = time.monotonic()
        self._recent.append((now, n))
        while self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def _timed(self, res: RunResult) -> None:
        """The target's pass cost per size, from the service times of
        micro-batches of one sequence with a logit row per token (a slot's
        token, alone or with its chain; not prompt chunks)."""
        run = res.run
        if (res.finished_at and run.started_at and run.n_outputs == run.n_tokens
                and len(set(run.seq_ids.tolist())) == 1):
            self.pass_cost.observe(run.n_tokens, res.finished_at - max(run.started_at, self._last_finish))
        self._last_finish = res.finished_at

    # -- views (any thread) ----------------------------------------------------------

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last ``RATE_WINDOW_S`` seconds, every request together."""
        since = time.monotonic() - RATE_WINDOW_S
        return sum(n for t, n in list(self._recent) if t >= since) / RATE_WINDOW_S   # a copy: the loop appends meanwhile

    def view(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots``): id, KV cells, busy,
        prompt tokens, tokens generated, cells cached."""
        out = []
        for s in list(self.slots):
            job = s.job
            r = job.request if job is not None else None
            out.append({"id": s.seq, "n_ctx": self.n_ctx_slot, "is_processing": job is not None,
                        "n_prompt_tokens": len(job.tokens) if job is not None else 0,
                        "n_decoded": len(r.out) if r is not None else 0, "n_cached": len(s.kv)})
        return out

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
        progressed = False
        while t.ready():
            self._handle(t.poll())
            progressed = True
        self._start_queued()
        while len(t.inflight) < self.depth and self._submit_next():
            progressed = True
        if not progressed and t.inflight:
            self.idle(lambda: t.ready() or wake(), self.timeout_s)

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
        settle = getattr(self.draft, "settle", None)   # the draft's runs that followed a request
        if settle is not None:
            settle()
