"""Head-side driver of one model's pipeline: start runs, send KV operations,
collect results. Every mode (iterative, speculative, pipeinfer) drives the
target model — and the speculation modes a draft model too — through this one
class; the modes differ only in which runs they start and when.

Data flow for a pipeline of ranks [head, r1, ..., rk]:

    head: stage 0 of the model on `tokens`  --DECODE(embd)-->  r1  --> ... --> rk
    rk:   logits                            --LOGITS-->        head

When the head holds no stage of the model (a draft pipeline on other ranks),
the run's token ids travel as the DECODE payload to the pipeline's first rank.
With a single stage and no other ranks, runs complete locally.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ggpipe.errors import ProtocolError
from ggpipe.runtime.stage import Stage
from ggpipe.scheduling.runs import Run, RunResult
from ggpipe.transport import messages as m


class Pipeline:
    """Args:
        stage: the head's own stage of this model (its first layers), or None.
        transport: the head's Transport, or None for a single-process pipeline.
        ranks: the other ranks of this pipeline, in stage order (may be empty).
        n_vocab: vocabulary size (logit row length).
        n_seq_max: KV sequence ids of the contexts (bounds checked on results).
        max_outputs: most logit rows one run may return.
    """

    def __init__(self, stage: Stage | None, transport, ranks: list[int], n_vocab: int,
                 n_seq_max: int = 1, max_outputs: int = 512):
        if stage is None and not ranks:
            raise ValueError("a pipeline needs a local stage or other ranks")
        self.stage = stage
        self.transport = transport
        self.ranks = list(ranks)
        self.n_vocab = n_vocab
        self.n_seq_max = n_seq_max
        self.max_outputs = max_outputs
        self.inflight: deque[Run] = deque()
        self._done: deque[RunResult] = deque()  # single-process results
        self.runs_started = 0
        self.busy_s = 0.0  # time the head spent computing its own stage

    @property
    def last_rank(self) -> int | None:
        return self.ranks[-1] if self.ranks else None

    # -- runs ----------------------------------------------------------------

    def submit(self, run: Run) -> None:
        """Start ``run``: evaluate the head's stage (if any) and send the
        activations down the pipeline. Returns once the head's part is done."""
        run.started_at = time.perf_counter()
        self.inflight.append(run)
        self.runs_started += 1
        header = m.DecodeHeader(run.run_id, run.pos, run.n_seq_id, run.seq_ids, run.outputs, m.PAYLOAD_TOKENS)
        if self.stage is None:
            self._send_decode(header, run.tokens)
            return
        t0 = time.perf_counter()
        if self.transport is not None:
            with self.transport.computing():
                out = self.stage.decode(tokens=run.tokens, pos=run.pos, n_seq_id=run.n_seq_id,
                                        seq_ids=run.seq_ids, outputs=run.outputs)
        else:
            out = self.stage.decode(tokens=run.tokens, pos=run.pos, n_seq_id=run.n_seq_id,
                                    seq_ids=run.seq_ids, outputs=run.outputs)
        self.busy_s += time.perf_counter() - t0
        if self.ranks:
            header.payload = m.PAYLOAD_EMBD
            self._send_decode(header, out)
        else:
            self._done.append(RunResult(run, out, finished_at=time.perf_counter()))

    def _send_decode(self, header: m.DecodeHeader, payload: np.ndarray) -> None:
        first = self.ranks[0]
        self.transport.send(first, m.T_DECODE, m.encode_decode(header))
        self.transport.send(first, m.T_DECODE, payload.reshape(-1))

    def kv(self, header: m.KvHeader) -> None:
        """Apply a KV cache operation on the head's stage, then pipeline it to
        the other stages behind the runs already sent (PipeInfer IV.C.3)."""
        if self.stage is not None:
            self.stage.kv(header.op, header.seq, header.seq_dst, header.p0, header.p1, header.delta)
        if self.ranks:
            self.transport.send(self.ranks[0], m.T_KV, m.encode_kv(header))

    # -- results -------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """The oldest run's result if it has arrived, else None (never blocks)."""
        if not self.inflight:
            return None
        if not self.ranks:
            return self._pop_local()
        if self.transport.probe(self.last_rank, m.T_LOGITS) is None:
            self.transport.progress()
            return None
        return self._receive()

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """Block (bounded) for the oldest in-flight run's result.

        Raises:
            RankTimeoutError: the last stage did not answer in time.
            ProtocolError: a result for another run, or malformed logits.
        """
        if not self.inflight:
            raise RuntimeError("no run in flight")
        if not self.ranks:
            return self._pop_local()
        return self._receive(timeout_s)

    def _pop_local(self) -> RunResult:
        self.inflight.popleft()
        return self._done.popleft()

    def _receive(self, timeout_s: float | None = None) -> RunResult:
        t = self.transport
        src = self.last_rank
        run = self.inflight[0]
        _, start = t.recv(src, m.T_LOGITS, np.int32, f"the logits of run {run.run_id}", timeout_s, max_items=16)
        h = m.decode_logits(start, self.n_vocab, self.max_outputs)
        if h.run_id != run.run_id:
            raise ProtocolError(f"expected the result of run {run.run_id}, {t.name(src)} sent run {h.run_id}")
        logits = None
        if h.n_outputs:
            _, flat = t.recv(src, m.T_LOGITS, np.float32, f"the logits of run {run.run_id}", timeout_s,
                             max_items=h.n_outputs * self.n_vocab)
            if flat.shape[0] != h.n_outputs * self.n_vocab:
                raise ProtocolError(f"logits of run {run.run_id}: {flat.shape[0]} floats, "
                                    f"expected {h.n_outputs} x {self.n_vocab}")
            logits = flat.reshape(h.n_outputs, self.n_vocab)
        self.inflight.popleft()
        return RunResult(run, logits, cancelled=bool(h.cancelled), finished_at=time.perf_counter())

    def drain(self, timeout_s: float | None = None) -> list[RunResult]:
        """Wait for every in-flight run."""
        return [self.wait(timeout_s) for _ in range(len(self.inflight))]
