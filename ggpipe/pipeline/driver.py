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
the order they were issued in.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from ggpipe.errors import GGPipeError, ProtocolError, RankTimeoutError
from ggpipe.logits import unpack
from ggpipe.pipeline.masking import PruneBook, live_batch, returned_rows
from ggpipe.runtime.stage import KV_CLEAR, KV_SEQ_CP, KV_SEQ_RM, Cancelled, InvalidBatch, Stage
from ggpipe.runs import Run, RunResult
from ggpipe.trace import tracer
from ggpipe.transport import messages as m

_TR = tracer()  # per-rank event trace (GGPIPE_TRACE_DIR), None when off
SERVICE_MAX_TOKENS = 16  # runs up to this size time a pipeline's service (result_due); prompt chunks do not


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
        self._done: deque[RunResult] = deque()  # local (single-stage) results, in order
        self._done_cv = threading.Condition()
        self._cancelled: set[int] = set()
        self._pruned = PruneBook()            # the head's own stage's view
        self._pruned_lock = threading.Lock()  # prune() on the main thread, the stage on the executor
        self._current: int | None = None
        self._busy = False
        self.busy_s = 0.0  # time the head spent computing its own stage
        # the head's wait (ggpipe.pipeline.waiting): called by the executor after each job
        self.on_event: Callable[[], None] | None = None
        self.service_s: float | None = None  # EWMA of a remote result's service time (seconds)
        self._last_arrival = 0.0
        self.stats = {"cancelled_before_start": 0, "cancelled_mid_compute": 0, "dropped_after_cancel": 0,
                      "rows_masked": 0}
        self._jobs: queue.Queue | None = None
        self._error: BaseException | None = None
        if async_local and stage is not None:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._executor, name=f"{name}-stage0", daemon=True)
            self._thread.start()

    def head_idle(self) -> bool:
        """The head's own stage has nothing to compute (asynchronous head
        stage); always True otherwise, since submit() computes at once."""
        if self._jobs is None:
            return True
        return not self._busy and self._jobs.empty()

    @property
    def n_stages(self) -> int:
        """Stages of this model's pipeline (the head's own, if any, and the other ranks')."""
        return int(self.stage is not None) + len(self.ranks)

    @property
    def last_rank(self) -> int | None:
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
        if self.stage is None:
            header = m.DecodeHeader(run.run_id, run.pos, run.n_seq_id, run.seq_ids, run.outputs, m.PAYLOAD_TOKENS,
                                    run.reply_k)
            self._send_decode(header, run.tokens)
        elif self._jobs is not None:
            self._busy = True
            self._jobs.put(("decode", run))
        else:
            self._decode_local(run)

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
        prefill); with ``want_logits`` the last chunk asks for logits of its
        last token. Returns the number of runs started (nothing is waited for)."""
        n = len(tokens)
        for i in range(0, n, n_ubatch):
            last = i + n_ubatch >= n
            self.decode(tokens[i:i + n_ubatch], start_pos + i, seq=seq, logits_last=want_logits and last)
        return -(-n // n_ubatch)

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
        if self._jobs is not None:
            self._jobs.put(("kv", header))
        else:
            self._kv_local(header)

    def cancel(self, run_id: int) -> None:
        """Cancel a speculative run (PipeInfer IV.D.2): the head's stage skips
        it if not started or aborts it mid-compute; the cancellation travels
        back up the pipeline from its last stage. Its result still arrives,
        marked cancelled."""
        self._cancelled.add(run_id)
        if _TR:
            _TR.instant("cancel", "head", run=run_id, pipeline=self.name)
        if self._current == run_id and self.stage is not None:
            self.stage.hooks.cancel()
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
        if self.stage is not None:
            with self._pruned_lock:
                self._pruned.add(pairs)
        if _TR:
            _TR.instant("prune", "head", pairs=len(pairs), pipeline=self.name)
        if self.ranks:
            self.transport.send(self.last_rank, m.T_PRUNE, m.encode_prune(pairs))

    # -- head stage ------------------------------------------------------------------

    def _executor(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                self._busy = True
                kind, arg = job
                if kind == "decode":
                    self._decode_local(arg)
                else:
                    self._kv_local(arg)
                self._busy = not self._jobs.empty()
                if self.on_event is not None:
                    self.on_event()
        except BaseException as exc:  # surfaced on the main thread by _check()
            self._error = exc
            with self._done_cv:
                self._done_cv.notify_all()
            if self.on_event is not None:
                self.on_event()

    def _decode_local(self, run: Run) -> None:
        header = m.DecodeHeader(run.run_id, run.pos, run.n_seq_id, run.seq_ids, run.outputs.copy(), m.PAYLOAD_EMBD,
                                run.reply_k)
        with self._pruned_lock:
            keep = self._pruned.apply(header)
            self._pruned.forget_through(run.run_id)
            self.stats["rows_masked"] = self._pruned.rows_masked
        out = None
        if run.run_id in self._cancelled or not keep.any():   # every row pruned: it is cancelled as well
            self.stats["cancelled_before_start"] += 1
            if _TR:
                _TR.instant("skip", f"{self.name} stage", run=run.run_id)
        else:
            self._current = run.run_id
            self.stage.hooks.clear_cancel()
            if run.run_id in self._cancelled:  # raced with cancel()
                self.stage.hooks.cancel()
            t0 = time.perf_counter()
            try:
                if self.transport is not None:
                    with self.transport.computing():
                        out = self._stage_decode(run, header, keep)
                else:
                    out = self._stage_decode(run, header, keep)
            except Cancelled:
                self.stats["cancelled_mid_compute"] += 1
            except InvalidBatch:
                if not run.speculative:
                    raise
                # It builds on cells of a run aborted here before this run's own
                # cancel was registered (cancels are issued one at a time): it is
                # dead too. Dropped as the workers do (worker.py); the decoder
                # checks that it does cancel it when the result comes back.
                self.stats["dropped_after_cancel"] += 1
            finally:
                self._current = None
                self.busy_s += time.perf_counter() - t0
                if _TR:
                    _TR.span("run", t0, time.perf_counter(), f"{self.name} stage", run=run.run_id,
                             n=int(keep.sum()), spec=bool(run.speculative), cancelled=out is None,
                             pipeline=self.name)
        if self.ranks:
            if out is None:
                header.payload = m.PAYLOAD_NONE
                self.transport.send(self.ranks[0], m.T_DECODE, m.encode_decode(header))
            else:
                self._send_decode(header, out)
        else:
            rows = None if out is None else returned_rows(header)
            with self._done_cv:
                self._done.append(RunResult(run, out, cancelled=out is None, finished_at=time.perf_counter(),
                                            rows=rows))
                self._done_cv.notify_all()

    def _stage_decode(self, run: Run, header: m.DecodeHeader, keep: np.ndarray) -> np.ndarray:
        """The head's stage on the rows of ``run`` not masked (``header``'s
        live rows; ``keep`` selects their tokens)."""
        return self.stage.decode(tokens=run.tokens[keep], **live_batch(header))

    def _kv_local(self, header: m.KvHeader) -> None:
        if self.stage is not None:
            self.stage.kv(header.op, header.seq, header.seq_dst, header.p0, header.p1, header.delta)
        if self.ranks:
            self.transport.send(self.ranks[0], m.T_KV, m.encode_kv(header))

    def _send_decode(self, header: m.DecodeHeader, payload: np.ndarray) -> None:
        first = self.ranks[0]
        self.transport.send(first, m.T_DECODE, m.encode_decode(header))
        self.transport.send(first, m.T_DECODE, payload.reshape(-1))

    def _check(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, GGPipeError):
                raise err
            raise RuntimeError(f"the head's {self.name} stage failed: {err!r}") from err

    # -- results -------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """The oldest run's result if it has arrived, else None (never blocks)."""
        self._check()
        if not self.inflight:
            return None
        if not self.ranks:
            return self._pop_local() if self._done else None
        if self.transport.probe(self.last_rank, m.T_LOGITS) is None:
            self.transport.progress()
            return None
        return self._receive()

    def ready(self) -> bool:
        """True when :meth:`poll` would return a result."""
        if not self.inflight:
            return False
        if not self.ranks:
            return bool(self._done)
        return self.transport.probe(self.last_rank, m.T_LOGITS) is not None

    def result_due(self) -> tuple[float, float] | None:
        """When the oldest in-flight run's result from the last stage on
        another rank is expected: ``(time.perf_counter() seconds, service time
        in seconds)``, the later of its start and the previous result's
        arrival plus the measured service time (an EWMA over the results
        of runs of at most ``SERVICE_MAX_TOKENS`` tokens, since prompt
        chunks would inflate it; cancelled runs excluded). The time is "now"
        while nothing was measured yet. None: nothing in flight, or results come from the
        head's own stage (they signal ``on_event``)."""
        if not self.ranks or not self.inflight:
            return None
        if self.service_s is None:
            return time.perf_counter(), 0.0
        run = self.inflight[0]
        return max(run.started_at, self._last_arrival) + self.service_s, self.service_s

    def due_in(self) -> float | None:
        """:meth:`result_due` as seconds from now (<= 0: overdue), or None."""
        d = self.result_due()
        return None if d is None else d[0] - time.perf_counter()

    def _arrived(self, run: Run, cancelled: bool) -> None:
        now = time.perf_counter()
        if not cancelled and run.n_tokens <= SERVICE_MAX_TOKENS:
            dt = now - max(run.started_at, self._last_arrival)
            self.service_s = dt if self.service_s is None else self.service_s + 0.3 * (dt - self.service_s)
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
            with self._done_cv:
                if not self._done_cv.wait_for(lambda: self._done or self._error is not None, timeout=limit):
                    raise RankTimeoutError(f"the head's own {self.name} stage did not finish a run in {limit:.0f} s")
            self._check()
            return self._pop_local()
        return self._receive(timeout_s)

    def _pop_local(self) -> RunResult:
        with self._done_cv:
            res = self._done.popleft()
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
        if self._jobs is not None:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            self._jobs = None
