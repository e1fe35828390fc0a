"""The serve loop of a non-head rank: take transactions from the previous
rank in order, run them on this rank's stage, pass them on.

    DECODE   evaluate the micro-batch; a middle stage forwards hidden states,
             the last stage returns logits to the head (always one LOGITS
             transaction per run, with zero rows when none were asked for, so
             the head's FIFO of runs stays in step).
    KV       apply the cache operation, forward it (pipelined, not broadcast).
    CANCEL   (PipeInfer IV.D.2) travels back up the target pipeline: from the
             head to the last stage, then stage by stage towards the first.
             A stage skips a cancelled run it has not started and aborts one
             it is computing (native cancellation flag polled by llama.cpp's
             abort callback); either way it sends an empty placeholder
             downstream so the order of messages holds.
    PRUNE    travels as CANCEL does: (run, sequence) pairs whose rows are
             dead (PipeDec 3.3.4). A stage that has not started such a run
             drops those rows from it (ggpipe.pipeline.masking) and flags
             them in the header it passes on.
    SHUTDOWN forward it, and stop.

Every wait is bounded: ``timeout_s`` inside a transaction; between
transactions (the head may be idle for days, waiting for a user) by the
head's heartbeats (ggpipe.transport.liveness), which stop the job when the
head dies or hangs.
"""

from __future__ import annotations

import time

import numpy as np

from ggpipe.errors import ProtocolError
from ggpipe.logits import pack, top_k
from ggpipe.pipeline.masking import PruneBook, live_batch, returned_rows
from ggpipe.runs import latest_run_id, run_id_after
from ggpipe.runtime.stage import Cancelled, InvalidBatch, Stage
from ggpipe.trace import tracer
from ggpipe.transport import messages as m
from ggpipe.transport import rank_guard

_TR = tracer()  # per-rank event trace (GGPIPE_TRACE_DIR), None when off


class Worker:
    """Args:
        stage: this rank's stage.
        transport: this rank's Transport.
        prev: rank the transactions come from.
        next: rank to forward to, or None for the pipeline's last stage.
        head: rank the logits go to.
        max_tokens: largest micro-batch accepted (the context's n_ubatch).
        cancel_src: rank cancellations come from (the next stage, or the head
            for the last stage); None: this pipeline is never cancelled.
        cancel_fwd: rank to pass cancellations on to (the previous stage),
            or None.
        mid_run_cancels: probe for cancellations while a run computes (a
            helper thread, every 1 ms: PipeInfer's early cancellation,
            §IV.C), so that a cancelled run stops at its next layer. False
            where the head never cancels a run (iterative decoding, the
            ``--parallel`` scheduler): cancellations and prunes are still
            taken before each run, and the helper's wake-ups do not
            take time from the computation on a host whose cores the
            stages fill (docs/design/how-it-works.md, KV operations, cancellations
            and prunes).
    """

    def __init__(self, stage: Stage, transport, prev: int, next: int | None, head: int, max_tokens: int,
                 cancel_src: int | None = None, cancel_fwd: int | None = None, mid_run_cancels: bool = True):
        self.stage = stage
        self.t = transport
        self.prev = prev
        self.next = next
        self.head = head
        self.max_tokens = max_tokens
        self.cancel_src = cancel_src
        self.cancel_fwd = cancel_fwd
        self.mid_run_cancels = mid_run_cancels
        self.cancelled: set[int] = set()
        self.pruned = PruneBook()
        self.current: int | None = None
        self.idle_doing = f"waiting for the next transaction from rank {prev}"
        self.last_run: int | None = None   # the latest run done here (run ids wrap: ggpipe.runs.run_id_after)
        self.stats = {"runs": 0, "tokens": 0, "busy_s": 0.0, "kv_ops": 0,
                      "cancelled_before_start": 0, "cancelled_mid_compute": 0, "dropped_after_cancel": 0,
                      "rows_masked": 0}

    # -- cancellation ------------------------------------------------------------

    def _take_cancels(self) -> None:
        """Receive every waiting cancellation and prune message (non-blocking)."""
        if self.cancel_src is None:
            return
        while self.t.probe(self.cancel_src, m.T_CANCEL) is not None:
            _, msg = self.t.recv(self.cancel_src, m.T_CANCEL, np.int32, "a cancellation", max_items=3)
            self._register_cancel(msg)
        while self.t.probe(self.cancel_src, m.T_PRUNE) is not None:
            _, msg = self.t.recv(self.cancel_src, m.T_PRUNE, np.int32, "a prune message",
                                 max_items=4 + 2 * self.stage.spec.n_seq_max)
            self._register_prune(msg)

    def _register_prune(self, msg: np.ndarray) -> None:
        pairs = m.decode_prune(msg, self.stage.spec.n_seq_max)
        if _TR:
            _TR.instant("prune", "stage", pairs=len(pairs))
        if self.cancel_fwd is not None:
            self.t.send(self.cancel_fwd, m.T_PRUNE, msg)
        self.pruned.add([(r, s) for r, s in pairs if r != self.current], done_below=self.last_run)

    def _register_cancel(self, msg: np.ndarray) -> None:
        run_id = m.decode_simple(msg, m.T_CANCEL)
        if _TR:
            _TR.instant("cancel", "stage", run=run_id)
        if self.cancel_fwd is not None:
            self.t.send(self.cancel_fwd, m.T_CANCEL, msg)
        if not run_id_after(run_id, self.last_run) and run_id != self.current:
            return  # already done here
        self.cancelled.add(run_id)
        if run_id == self.current:
            self.stage.hooks.cancel()

    def _mid_run_poll(self):
        """What the transport's helper calls while a run computes: the
        cancellation probe, or None (nothing but pending sends)."""
        return self._take_cancels if self.cancel_src is not None and self.mid_run_cancels else None

    # -- loop ------------------------------------------------------------------

    def serve(self) -> dict:
        """Serve until SHUTDOWN; returns this rank's statistics. The wait
        between transactions has no time-out: the heartbeats watch the head."""
        MPI = self.t.MPI
        max_items = m.DECODE_FIXED + 3 * self.max_tokens + self.max_tokens * self.stage.spec.n_seq_max
        separate_cancels = self.cancel_src is not None and self.cancel_src != self.prev

        def ready():
            if separate_cancels:
                self._take_cancels()
            return self.t.probe(self.prev, MPI.ANY_TAG)

        rank_guard.set_doing(self.idle_doing)
        while True:
            t_idle = time.perf_counter()
            self.t._wait(ready, float("inf"), "the next transaction", self.prev)
            if _TR:
                _TR.span("idle", t_idle, time.perf_counter(), "stage")
            tag, start = self.t.recv(self.prev, MPI.ANY_TAG, np.int32, "the next transaction", max_items=max_items)
            if tag == m.T_DECODE:
                self._decode(start)
            elif tag == m.T_KV:
                self._kv(start)
            elif tag == m.T_CANCEL:
                self._register_cancel(start)
            elif tag == m.T_PRUNE:
                self._register_prune(start)
            elif tag == m.T_SHUTDOWN:
                m.decode_simple(start, m.T_SHUTDOWN)
                if self.next is not None:
                    self.t.send(self.next, m.T_SHUTDOWN, start)
                self.t.flush(what="the last sends before shutdown")
                return self.stats
            else:
                raise ProtocolError(f"unexpected {self.t.describe_tag(tag)} transaction from {self.t.name(self.prev)}")

    def _decode(self, start: np.ndarray) -> None:
        spec = self.stage.spec
        h = m.decode_decode(start, spec.n_seq_max, self.max_tokens)
        if h.payload == m.PAYLOAD_NONE:  # cancelled upstream: pass the placeholder on
            self._finish_cancelled(h)
            return
        inputs = self._receive_payload(h)
        self._take_cancels()
        if h.run_id in self.cancelled:
            self.stats["cancelled_before_start"] += 1
            if _TR:
                _TR.instant("skip", "stage", run=h.run_id)
            self._finish_cancelled(h)
            return
        keep = self.pruned.apply(h)
        self.stats["rows_masked"] = self.pruned.rows_masked
        if not keep.all():
            inputs = {k: v.reshape(keep.shape[0], -1)[keep].reshape(-1) for k, v in inputs.items()}
            if not keep.any():   # every row died: its cancel is on the way
                self.stats["cancelled_before_start"] += 1
                self._finish_cancelled(h)
                return
        batch = live_batch(h)
        n_live = int(batch["pos"].shape[0])
        self.current = h.run_id
        self.stage.hooks.clear_cancel()
        rank_guard.set_doing(f"decoding run {h.run_id} ({n_live} tokens at positions {int(batch['pos'][0])}..)")
        t0 = time.perf_counter()
        aborted = False
        try:
            with self.t.computing(self._mid_run_poll()):
                out = self.stage.decode(**batch, **inputs)
        except Cancelled:
            self.stats["cancelled_mid_compute"] += 1
            aborted = True
            self._finish_cancelled(h)
            return
        except InvalidBatch:
            if not _speculative(h.seq_ids):
                raise
            # It builds on cells of a run cancelled here before its own cancel
            # arrived: it is dead too (its cancel is on the way). The head
            # checks that it did cancel it.
            self.stats["dropped_after_cancel"] += 1
            self._finish_cancelled(h)
            return
        finally:
            self.current = None
            rank_guard.set_doing(self.idle_doing)
            self.stats["busy_s"] += time.perf_counter() - t0
            if _TR:
                _TR.span("run", t0, time.perf_counter(), "stage", run=h.run_id, n=n_live,
                         spec=_speculative(h.seq_ids), cancelled=aborted)
        self.last_run = latest_run_id(h.run_id, self.last_run)
        self.cancelled = {r for r in self.cancelled if run_id_after(r, self.last_run)}
        self.pruned.forget_through(self.last_run)
        self.stats["runs"] += 1
        self.stats["tokens"] += n_live
        if self.next is not None:
            h.payload = m.PAYLOAD_EMBD
            self.t.send(self.next, m.T_DECODE, m.encode_decode(h))
            self.t.send(self.next, m.T_DECODE, out.reshape(-1))
        else:
            n_out, n_vocab = out.shape
            k = min(h.reply_k, n_vocab)  # greedy: the k best of each row and its log-sum-exp (ggpipe/logits.py)
            self.t.send(self.head, m.T_LOGITS, m.encode_logits(
                m.LogitsHeader(h.run_id, n_out, n_vocab, top_k=k, rows=returned_rows(h))))
            if n_out:
                self.t.send(self.head, m.T_LOGITS, out.reshape(-1) if k == 0 else pack(top_k(out, k)))

    def _receive_payload(self, h: m.DecodeHeader) -> dict:
        spec = self.stage.spec
        what = f"the payload of run {h.run_id}"
        if h.payload == m.PAYLOAD_TOKENS:
            if not spec.first:
                raise ProtocolError(f"run {h.run_id}: token ids sent to a stage that takes hidden states")
            _, tokens = self.t.recv(self.prev, m.T_DECODE, np.int32, what, max_items=h.n_live)
            if tokens.shape[0] != h.n_live:
                raise ProtocolError(f"run {h.run_id}: {tokens.shape[0]} token ids for {h.n_live} positions")
            return {"tokens": tokens}
        if spec.first:
            raise ProtocolError(f"run {h.run_id}: hidden states sent to a stage that takes token ids")
        n_embd = self.stage.n_embd
        _, flat = self.t.recv(self.prev, m.T_DECODE, np.float32, what, max_items=h.n_live * n_embd)
        if flat.shape[0] != h.n_live * n_embd:
            raise ProtocolError(f"run {h.run_id}: {flat.shape[0]} floats for {h.n_live} x {n_embd}")
        return {"embd": flat}

    def _finish_cancelled(self, h: m.DecodeHeader) -> None:
        self.last_run = latest_run_id(h.run_id, self.last_run)
        self.cancelled.discard(h.run_id)
        self.pruned.forget_through(self.last_run)
        if self.next is not None:
            h.payload = m.PAYLOAD_NONE
            self.t.send(self.next, m.T_DECODE, m.encode_decode(h))
        else:
            self.t.send(self.head, m.T_LOGITS,
                        m.encode_logits(m.LogitsHeader(h.run_id, 0, self.stage.n_vocab, cancelled=1)))

    def _kv(self, start: np.ndarray) -> None:
        h = m.decode_kv(start, self.stage.spec.n_seq_max)
        self.stage.kv(h.op, h.seq, h.seq_dst, h.p0, h.p1, h.delta)
        self.stats["kv_ops"] += 1
        if self.next is not None:
            self.t.send(self.next, m.T_KV, start)


def _speculative(seq_ids: np.ndarray) -> bool:
    """A speculative run uses partition sequences only (never sequence 0)."""
    return bool((seq_ids != 0).all())
