"""The serve loop of a non-head rank: take transactions from the previous
rank in order, run them on this rank's stage, pass them on.

    DECODE   evaluate the micro-batch; a middle stage forwards hidden states,
             the last stage returns logits to the head (always one LOGITS
             transaction per run, with zero rows when none were asked for, so
             the head's FIFO of runs stays in step).
    KV       apply the cache operation, forward it (pipelined, not broadcast).
    SHUTDOWN forward it, and stop.

Every wait is bounded: ``idle_timeout_s`` between transactions (the head may
be idle, e.g. waiting for a user), ``timeout_s`` inside one.
"""

from __future__ import annotations

import time

import numpy as np

from ggpipe.errors import ProtocolError
from ggpipe.runtime.stage import Stage
from ggpipe.transport import messages as m


class Worker:
    """Args:
        stage: this rank's stage.
        transport: this rank's Transport.
        prev: rank the transactions come from.
        next: rank to forward to, or None for the pipeline's last stage.
        head: rank the logits go to.
        max_tokens: largest micro-batch accepted (the context's n_ubatch).
    """

    def __init__(self, stage: Stage, transport, prev: int, next: int | None, head: int, max_tokens: int):
        self.stage = stage
        self.t = transport
        self.prev = prev
        self.next = next
        self.head = head
        self.max_tokens = max_tokens
        self.stats = {"runs": 0, "tokens": 0, "busy_s": 0.0, "kv_ops": 0}

    def serve(self, idle_timeout_s: float) -> dict:
        """Serve until SHUTDOWN; returns this rank's statistics."""
        MPI = self.t.MPI
        while True:
            tag, start = self.t.recv(self.prev, MPI.ANY_TAG, np.int32, "the next transaction", idle_timeout_s,
                                     max_items=6 + 3 * self.max_tokens + self.max_tokens * self.stage.spec.n_seq_max)
            if tag == m.T_DECODE:
                self._decode(start)
            elif tag == m.T_KV:
                self._kv(start)
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
        what = f"the payload of run {h.run_id}"
        if h.payload == m.PAYLOAD_TOKENS:
            if not spec.first:
                raise ProtocolError(f"run {h.run_id}: token ids sent to a stage that takes hidden states")
            _, tokens = self.t.recv(self.prev, m.T_DECODE, np.int32, what, max_items=h.n_tokens)
            if tokens.shape[0] != h.n_tokens:
                raise ProtocolError(f"run {h.run_id}: {tokens.shape[0]} token ids for {h.n_tokens} positions")
            inputs = {"tokens": tokens}
        elif h.payload == m.PAYLOAD_EMBD:
            if spec.first:
                raise ProtocolError(f"run {h.run_id}: hidden states sent to a stage that takes token ids")
            n_embd = self.stage.n_embd
            _, flat = self.t.recv(self.prev, m.T_DECODE, np.float32, what, max_items=h.n_tokens * n_embd)
            if flat.shape[0] != h.n_tokens * n_embd:
                raise ProtocolError(f"run {h.run_id}: {flat.shape[0]} floats for {h.n_tokens} x {n_embd}")
            inputs = {"embd": flat}
        else:  # cancelled upstream: pass the placeholder on
            self._forward_cancelled(h)
            return
        t0 = time.perf_counter()
        with self.t.computing():
            out = self.stage.decode(pos=h.pos, n_seq_id=h.n_seq_id, seq_ids=h.seq_ids, outputs=h.outputs, **inputs)
        self.stats["busy_s"] += time.perf_counter() - t0
        self.stats["runs"] += 1
        self.stats["tokens"] += h.n_tokens
        if self.next is not None:
            h.payload = m.PAYLOAD_EMBD
            self.t.send(self.next, m.T_DECODE, m.encode_decode(h))
            self.t.send(self.next, m.T_DECODE, out.reshape(-1))
        else:
            self.t.send(self.head, m.T_LOGITS, m.encode_logits(m.LogitsHeader(h.run_id, out.shape[0], out.shape[1])))
            if out.shape[0]:
                self.t.send(self.head, m.T_LOGITS, out.reshape(-1))

    def _forward_cancelled(self, h: m.DecodeHeader) -> None:
        if self.next is not None:
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
