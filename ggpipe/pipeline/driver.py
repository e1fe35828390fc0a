"""Head-side driver of one model's pipeline: start runs, send KV operations,
cancel runs, collect results. Every mode (iterative, speculative, pipeinfer)
drives the target model — and the speculation modes a draft model too —
through this one class; the modes differ only in which runs they start and
when.

Data flow for a pipeline of ranks [head, r1, ..., rk]:

    head: stage 0 of the model on `tokens`  --DECODE(embd)-->  r1  --> ... --> rk
    rk:   logits                            --LOGITS-->        head

When the head holds no stage of the model (a draft pipeline on other ranks),
the run's token ids travel as the DECODE payload to the pipeline's first rank.
With a single stage and no other ranks, runs complete locally.

With ``async_local`` the head's own stage runs on an executor thread: ``submit``
returns at once and the head can draft, verify and probe meanwhile (ctypes
calls into llama.cpp release the GIL). Runs, KV operations and their
downstream sends then all go through the executor's FIFO, so their order is
the order they were issued in. The head's own stage (that thread, the
masking of its queued runs) is ggpipe.pipeline.head_stage.HeadStage.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from ggpipe.errors import ProtocolError, RankTimeoutError
from ggpipe.logits import unpack
from ggpipe.pipeline.head_stage import HeadStage, send_decode
from ggpipe.pipeline.prefill import submit_chunks
from ggpipe.runtime.stage import KV_CLEAR, KV_SEQ_CP, KV_SEQ_RM, Stage
from ggpipe.runs import Run, RunResult
from ggpipe.trace import tracer
from ggpipe.transport import messages as m

_TR = tracer()  # per-rank event trace (GGPIPE_TRACE_DIR), None when off
SERVICE_MAX_TOKENS = 16  # runs up to this size time a pipeline's service (result_due); larger ones (prompt
# chunks) time its seconds per token instead


def _ewma(old: float | None, new: float, alpha: float = 0.3) -> float:
    """An exponentially weighted mean updated with ``new`` (``new`` itself first)."""
    return new if old is None else old + alpha * (new - old)


def _check_during_waits(transport, head: HeadStage) -> None:
    """Make every bounded wait of ``transport`` (a transaction's receive, a
    result from the last stage) end at once with the head stage's error when
    its executor thread fails: the run it was computing never reaches the
    next rank, so waiting for its result could only time out."""
    before = transport.interrupt

    def interrupt() -> None:
        if before is not None:
            before()
        head.check()

    transport.interrupt = interrupt


class Pipeline:
    """Args:
        stage: the head's own stage of this model (its first layers), or None.
        transport: the head's Transport, or None for a single-process pipeline.
        ranks: the other ranks of this pipeline, in stage order (may be empty).
        n_vocab: vocabulary size (logit row length).
        n_seq_max: KV sequence ids of the contexts.
        max_outputs: most logit rows one run may return.
        async_local: run the head's stage on an executor thread.
        name: "target" or "draft", for messages.

    Attributes:
        reply_k: what a last stage on another rank returns for the runs
            submitted from now on (the decoders set it per request): 0 full
            float32 logit rows; k > 0 per row the k best token ids, their
            logits and the row's log-sum-exp (ggpipe.logits.TopLogits):
            (2k + 1) floats instead of n_vocab on the link back. A pipeline
            whose last stage is the head's own returns full rows (nothing to
            send); consumers read either form (ggpipe.logits.argmax, best,
            ggpipe.sampling.target_probs).
    """

    def __init__(self, stage: Stage | None, transport, ranks: list[int], n_vocab: int,
                 n_seq_max: int = 1, max_outputs: int = 512, async_local: bool = False, name: str = "target"):
        if stage is None and not ranks:
            raise ValueError("a pipeline needs a local stage or other ranks")
        self.stage = stage
        self.transport = transport
        self.ranks = list(ranks)
        self.n_vocab = n_vocab
        self.n_seq_max = n_seq_max
        self.max_outputs = max_outputs
        self.name = name
        self.reply_k = 0
        self.inflight: deque[Run] = deque()
        self._cancelled: set[int] = set()
        # the head's wait (ggpipe.pipeline.waiting): called by the executor after each job
        self.on_event: Callable[[], None] | None = None
        self.service_s: float | None = None  # EWMA of a remote result's service time (seconds)
        self.token_s: float | None = None    # EWMA of a prompt chunk's service time per token (seconds)
        self._last_arrival = 0.0
        self.stats = {"cancelled_before_start": 0, "cancelled_mid_compute": 0, "dropped_after_cancel": 0,
                      "rows_masked": 0}
        self._head: HeadStage | None = None
        if stage is not None:
            self._head = HeadStage(stage, transport, self.ranks, name, self._cancelled, self.stats, self._notify,
                                   async_local=async_local)
            if async_local and transport is not None:
                _check_during_waits(transport, self._head)

    def _notify(self) -> None:
        if self.on_event is not None:
            self.on_event()

    @property
    def busy_s(self) -> float:
        """Time the head spent computing its own stage."""
        return self._head.busy_s if self._head is not None else 0.0

    def warm_up(self, timeout_s: float = 600.0) -> float:
        """Warm the head's own stage up on the thread that computes it
        (:meth:`~ggpipe.runtime.stage.Stage.warmup`, through
        :meth:`HeadStage.call`); returns its seconds (0 without a stage).

        Raises:
            GGPipeError: llama.cpp failed, or the executor did not answer
                within ``timeout_s`` seconds."""
        if self._head is None:
            return 0.0
        return self._head.call(self._head.stage.warmup, timeout_s)

    def head_idle(self) -> bool:
        """The head's own stage has nothing to compute (asynchronous head
        stage); always True otherwise, since submit() computes at once."""
        return self._head is None or self._head.idle()

    @property
    def n_stages(self) -> int:
        """Stages of this model's pipeline (the head's own, if any, and the other ranks')."""
        return int(self.stage is not None) + len(self.ranks)

    @property
    def n_cells(self) -> int | None:
        """KV cells of one sequence (the head's own stage's ``n_ctx_seq``:
        ``-c`` rounded up to 256), or None with no stage of this model on
        the head."""
        return self.stage.n_ctx_seq if self.stage is not None else None

    @property
    def last_rank(self) -> int | None:
        """The rank of the pipeline's last stage; None when it has no stage on
        another rank (the head's own stage is its only one)."""
        return self.ranks[-1] if self.ranks else None

    # -- issuing -----------------------------------------------------------------

    def submit(self, run: Run) -> None:
        """Start ``run``. Synchronous head stage: returns once the head's part
        is done; asynchronous: returns at once."""
        self._check()
        run.started_at = time.perf_counter()
        run.reply_k = self.reply_k
        self.inflight.append(run)
        if _TR:
            _TR.instant("submit", "head", run=run.run_id, n=int(run.pos.shape[0]), spec=bool(run.speculative),
                        pipeline=self.name)
        if self._head is None:
            header = m.DecodeHeader(run.run_id, run.pos, run.n_seq_id, run.seq_ids, run.outputs, m.PAYLOAD_TOKENS,
                                    run.reply_k)
            send_decode(self.transport, self.ranks[0], header, run.tokens)
        else:
            self._head.submit(run)

    def decode(self, tokens, start_pos: int, seq: int = 0, logits_last: bool = True,
               logits_all: bool = False) -> None:
        """Start one run of consecutive ``tokens`` (int (n,)) at positions
        ``start_pos``.. of sequence ``seq``, with logits of its last token
        (``logits_last``) or none, or of every token (``logits_all``)."""
        self.submit(Run.linear(tokens, start_pos, seq=seq, output_last=logits_last, output_all=logits_all))

    def submit_prompt(self, tokens, start_pos: int, n_ubatch: int, seq: int = 0, want_logits: bool = True) -> int:
        """Start ``tokens`` (int (n,)) at positions start_pos.. of sequence
        ``seq`` as runs of at most ``n_ubatch`` tokens, back to back, so stage
        k works on chunk i while stage k-1 works on chunk i+1 (pipelined
        prefill; the chunks' sizes: ggpipe.pipeline.prefill); with
        ``want_logits`` the last chunk asks for logits of its last token.
        Returns the number of runs started (nothing is waited for)."""
        return submit_chunks(self, tokens, start_pos, n_ubatch, seq, want_logits)

    def prefill(self, tokens, start_pos: int, n_ubatch: int, seq: int = 0) -> np.ndarray:
        """:meth:`submit_prompt`, then wait (bounded by the transport's
        time-out); returns float32 (n_vocab,) logits of the last token."""
        self.submit_prompt(tokens, start_pos, n_ubatch, seq)
        return self.drain()[-1].logits[0]

    # KV cache verbs (llama_memory_seq_rm / seq_cp / clear on every stage, in order)

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove the cells of sequence ``seq`` (-1: every sequence) at
        positions [p0, p1) (-1: open end) on every stage."""
        self.kv(m.KvHeader(KV_SEQ_RM, seq=seq, p0=p0, p1=p1))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Add sequence ``dst`` to the cells of ``src`` at positions [p0, p1)
        on every stage (metadata only: no tensor is copied)."""
        self.kv(m.KvHeader(KV_SEQ_CP, seq=src, seq_dst=dst, p0=p0, p1=p1))

    def clear(self) -> None:
        """Empty the KV cache of every stage."""
        self.kv(m.KvHeader(KV_CLEAR))

    def kv(self, header: m.KvHeader) -> None:
        """Apply a KV cache operation on the head's stage, then pipeline it to
        the other stages behind the runs already issued (PipeInfer IV.C.3)."""
        self._check()
        if self._head is not None:
            self._head.kv(header)
        else:
            self.transport.send(self.ranks[0], m.T_KV, m.encode_kv(header))

    def cancel(self, run_id: int) -> None:
        """Cancel a speculative run (PipeInfer IV.D.2): the head's stage skips
        it if not started or aborts it mid-compute; the cancellation travels
        back up the pipeline from its last stage. Its result still arrives,
        marked cancelled."""
        self._cancelled.add(run_id)
        if _TR:
            _TR.instant("cancel", "head", run=run_id, pipeline=self.name)
        if self._head is not None:
            self._head.cancel(run_id)
        if self.ranks:
            self.transport.send(self.last_rank, m.T_CANCEL, m.encode_simple(m.T_CANCEL, run_id))

    def prune(self, pairs: list[tuple[int, int]]) -> None:
        """Mask dead rows of speculative runs in flight (PipeDec 3.3.4,
        ggpipe.pipeline.masking): in run ``run_id`` the rows whose every
        sequence id is among the pairs' are dropped by every stage that has
        not started the run yet (the head's own at once, the others when the
        message reaches them, travelling back up the pipeline as
        cancellations do). The run's result then carries the surviving
        output rows and their batch indices (``RunResult.rows``). Pairs of
        one decision must go in one call. A run whose every row is pruned
        must also be cancelled."""
        if not pairs:
            return
        if self._head is not None:
            self._head.prune(pairs)
        if _TR:
            _TR.instant("prune", "head", pairs=len(pairs), pipeline=self.name)
        if self.ranks:
            self.transport.send(self.last_rank, m.T_PRUNE, m.encode_prune(pairs))

    def _check(self) -> None:
        if self._head is not None:
            self._head.check()

    # -- results -------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """The oldest run's result if it has arrived, else None (never blocks)."""
        self._check()
        if not self.inflight:
            return None
        if not self.ranks:
            return self._pop_local() if self._head.done else None
        if self.transport.probe(self.last_rank, m.T_LOGITS) is None:
            self.transport.progress()
            return None
        return self._receive()

    def ready(self) -> bool:
        """True when :meth:`poll` would return a result.

        Raises:
            StageFailedError: the head's own stage failed (at once, not after
                the wait's time-out).
        """
        self._check()
        if not self.inflight:
            return False
        if not self.ranks:
            return bool(self._head.done)
        # twice: an Iprobe's own progress may pull the message in and only the next call sees it (MPICH,
        # measured: a draft result waited a whole target pass for a loop that checks once per pass)
        t, src = self.transport, self.last_rank
        return t.probe(src, m.T_LOGITS) is not None or t.probe(src, m.T_LOGITS) is not None

    def result_due(self) -> tuple[float, float] | None:
        """When the oldest in-flight run's result from the last stage on
        another rank is expected: ``(time.perf_counter() seconds, service time
        in seconds)``, the later of its start and the previous result's
        arrival plus the measured service time (an EWMA over the results
        of runs of at most ``SERVICE_MAX_TOKENS`` tokens; for a larger run,
        a prompt chunk, its tokens times the EWMA of the larger runs'
        seconds per token; cancelled runs excluded). The time is "now"
        while nothing of the run's kind was measured yet. None: nothing in
        flight, or results come from the head's own stage (they signal
        ``on_event``)."""
        if not self.ranks or not self.inflight:
            return None
        run = self.inflight[0]
        if run.n_tokens > SERVICE_MAX_TOKENS and self.token_s is not None:
            service = self.token_s * run.n_tokens
        elif run.n_tokens <= SERVICE_MAX_TOKENS and self.service_s is not None:
            service = self.service_s
        else:
            return time.perf_counter(), 0.0
        return max(run.started_at, self._last_arrival) + service, service

    def due_in(self) -> float | None:
        """:meth:`result_due` as seconds from now (<= 0: overdue), or None."""
        d = self.result_due()
        return None if d is None else d[0] - time.perf_counter()

    def _arrived(self, run: Run, cancelled: bool) -> None:
        now = time.perf_counter()
        if not cancelled:
            dt = now - max(run.started_at, self._last_arrival)
            if run.n_tokens <= SERVICE_MAX_TOKENS:
                self.service_s = _ewma(self.service_s, dt)
            else:
                self.token_s = _ewma(self.token_s, dt / run.n_tokens)
        self._last_arrival = now

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """Block (bounded) for the oldest in-flight run's result.

        Raises:
            RankTimeoutError: the last stage (or the head's own stage) did not
                answer in time.
            ProtocolError: a result for another run, or malformed logits.
        """
        if not self.inflight:
            raise RuntimeError("no run in flight")
        if not self.ranks:
            limit = 600.0 if timeout_s is None else timeout_s
            head = self._head
            with head.done_cv:
                if not head.done_cv.wait_for(lambda: head.done or head.error is not None, timeout=limit):
                    raise RankTimeoutError(f"the head's own {self.name} stage did not finish a run in {limit:.0f} s")
            self._check()
            return self._pop_local()
        return self._receive(timeout_s)

    def _pop_local(self) -> RunResult:
        with self._head.done_cv:
            res = self._head.done.popleft()
        run = self.inflight.popleft()
        self._cancelled.discard(res.run.run_id)  # as _receive does: the set stays bounded for a serve job
        if run.run_id != res.run.run_id:
            raise ProtocolError(f"local result order broken: run {res.run.run_id} before {run.run_id}")
        return res

    def _receive(self, timeout_s: float | None = None) -> RunResult:
        t = self.transport
        src = self.last_rank
        run = self.inflight[0]
        _, start = t.recv(src, m.T_LOGITS, np.int32, f"the {self.name} logits of run {run.run_id}", timeout_s,
                          max_items=m.LOGITS_FIXED + self.max_outputs)
        h = m.decode_logits(start, self.n_vocab, self.max_outputs)
        if h.run_id != run.run_id:
            raise ProtocolError(f"expected the result of run {run.run_id}, {t.name(src)} sent run {h.run_id}")
        if h.n_outputs and h.top_k != min(run.reply_k, self.n_vocab):  # a cancelled run's header carries no rows
            raise ProtocolError(f"logits of run {run.run_id}: top_k {h.top_k}, asked for {run.reply_k}")
        logits = None
        if h.n_outputs:
            _, flat = t.recv(src, m.T_LOGITS, np.float32, f"the {self.name} logits of run {run.run_id}", timeout_s,
                             max_items=h.n_outputs * h.row_floats)
            if flat.shape[0] != h.n_outputs * h.row_floats:
                raise ProtocolError(f"logits of run {run.run_id}: {flat.shape[0]} floats, "
                                    f"expected {h.n_outputs} x {h.row_floats}")
            if h.top_k:
                try:
                    logits = unpack(flat, h.n_outputs, h.top_k, self.n_vocab)
                except ValueError as e:
                    raise ProtocolError(f"logits of run {run.run_id}: {e}") from None
            else:
                logits = flat.reshape(h.n_outputs, self.n_vocab)
        self.inflight.popleft()
        self._cancelled.discard(run.run_id)
        self._arrived(run, bool(h.cancelled))
        if _TR:
            _TR.instant("recv", "head", run=run.run_id, cancelled=bool(h.cancelled), pipeline=self.name)
        if h.rows is not None and (h.rows.size and int(h.rows[-1]) >= run.n_tokens):
            raise ProtocolError(f"logits of run {run.run_id}: row index {int(h.rows[-1])} beyond its "
                                f"{run.n_tokens} tokens")
        return RunResult(run, logits, cancelled=bool(h.cancelled), finished_at=time.perf_counter(), rows=h.rows)

    def drain(self, timeout_s: float | None = None) -> list[RunResult]:
        """Wait for every in-flight run."""
        return [self.wait(timeout_s) for _ in range(len(self.inflight))]

    def close(self) -> None:
        """Stop the executor thread (after the jobs already queued)."""
        if self._head is not None:
            self._head.close()
