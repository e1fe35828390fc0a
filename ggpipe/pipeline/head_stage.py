"""The head's own stage of one model's pipeline (its first layers), as
ggpipe.pipeline.driver.Pipeline runs it: each run's part on the head, with
the masking of its queued runs' pruned rows and the skipping or aborting of
cancelled ones, KV operations, and the send of both to the pipeline's next
rank; a single-stage pipeline's results are kept here for the Pipeline.

With ``async_local`` the stage runs on an executor thread: runs, KV
operations and their downstream sends all go through the executor's FIFO, so
their order is the order they were issued in (ctypes calls into llama.cpp
release the GIL, so the head can draft, verify and probe meanwhile).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from ggpipe.errors import GGPipeError, NonFiniteError, StageFailedError
from ggpipe.pipeline.masking import PruneBook, live_batch, returned_rows
from ggpipe.runtime.stage import Cancelled, InvalidBatch, Stage
from ggpipe.runs import Run, RunResult
from ggpipe.trace import tracer
from ggpipe.transport import messages as m

_TR = tracer()  # per-rank event trace (GGPIPE_TRACE_DIR), None when off


def send_decode(transport, rank: int, header: m.DecodeHeader, payload: np.ndarray) -> None:
    """Send a run (its DECODE header, then its payload) to ``rank``."""
    transport.send(rank, m.T_DECODE, m.encode_decode(header))
    transport.send(rank, m.T_DECODE, payload.reshape(-1))


class HeadStage:
    """Args:
        stage: the head's stage of this model.
        transport: the head's Transport, or None for a single-process pipeline.
        ranks: the pipeline's other ranks, in stage order (may be empty:
            results are then kept in :attr:`done`).
        name: the pipeline's name, for messages.
        cancelled: the pipeline's set of cancelled run ids (read here).
        stats: the pipeline's counters, updated here ("cancelled_before_start",
            "cancelled_mid_compute", "dropped_after_cancel", "rows_masked").
        notify: called by the executor after each job, and when it fails.
        async_local: run the stage on an executor thread.

    Attributes:
        busy_s: time spent computing the stage.
        done: a single-stage pipeline's results, in order (under ``done_cv``).
        error: what stopped the executor, or None.
    """

    def __init__(self, stage: Stage, transport, ranks: list[int], name: str, cancelled: set[int], stats: dict,
                 notify: Callable[[], None], async_local: bool = False):
        self.stage = stage
        self.transport = transport
        self.ranks = ranks
        self.name = name
        self._cancelled = cancelled
        self.stats = stats
        self._notify = notify
        self.done: deque[RunResult] = deque()
        self.done_cv = threading.Condition()
        self._pruned = PruneBook()            # the head's own stage's view
        self._pruned_lock = threading.Lock()  # prune() on the main thread, the stage on the executor
        self._current: int | None = None
        self._busy = False
        self.busy_s = 0.0
        self.error: BaseException | None = None
        self._jobs: queue.Queue | None = None
        if async_local:
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._executor, name=f"{name}-stage0", daemon=True)
            self._thread.start()

    def idle(self) -> bool:
        """Nothing to compute (asynchronous stage); always True otherwise,
        since :meth:`submit` computes at once."""
        if self._jobs is None:
            return True
        return not self._busy and self._jobs.empty()

    def submit(self, run: Run) -> None:
        """Compute the head's part of ``run`` now, or queue it (asynchronous)."""
        if self._jobs is not None:
            self._busy = True
            self._jobs.put(("decode", run))
            return
        try:
            self._decode_local(run)
        except GGPipeError as exc:  # the run never reached the next rank: out of step, as on the executor
            raise self.failure(exc) from exc

    def kv(self, header: m.KvHeader) -> None:
        """Apply a KV cache operation here, then send it on (or queue it)."""
        if self._jobs is not None:
            self._jobs.put(("kv", header))
        else:
            self._kv_local(header)

    def call(self, fn: Callable[[], object], timeout_s: float) -> object:
        """``fn()`` on the thread that computes this stage (the executor's,
        after the jobs queued before it; this thread otherwise), and its
        result.

        Raises:
            what ``fn`` raised; GGPipeError: no answer within ``timeout_s``
                seconds (the stage's executor is stuck or gone)."""
        if self._jobs is None:
            return fn()
        done, box = threading.Event(), []
        self._jobs.put(("call", (fn, box, done)))
        if not done.wait(timeout_s):
            raise GGPipeError(f"the head's own {self.name} stage did not answer within {timeout_s:g} s")
        result, err = box[0]
        if err is not None:
            raise err
        return result

    def cancel(self, run_id: int) -> None:
        """Abort ``run_id`` if it is being computed now."""
        if self._current == run_id:
            self.stage.hooks.cancel()

    def prune(self, pairs: list[tuple[int, int]]) -> None:
        """Mask these (run id, sequence id) pairs' rows in runs not started here yet."""
        with self._pruned_lock:
            self._pruned.add(pairs)

    def check(self) -> None:
        """Raise what stopped the executor, if anything did.

        Raises:
            StageFailedError: the executor thread ended on an error (the
                run it was computing never reached the next rank, so the
                pipeline is out of step: the job must end).
        """
        if self.error is not None:
            raise self.failure(self.error)

    def failure(self, err: BaseException) -> StageFailedError:
        """``err``, raised by this stage, as the error that ends the job."""
        if isinstance(err, StageFailedError):
            return err
        if isinstance(err, NonFiniteError):  # names the stage already
            exc = StageFailedError(str(err))
        else:
            what = str(err) if isinstance(err, GGPipeError) else f"{type(err).__name__}: {err}"
            where = self.stage.spec.label or f"the head's own {self.name} stage"
            exc = StageFailedError(f"{where}: {what}")
        exc.__cause__ = err
        return exc

    def close(self) -> None:
        """Stop the executor thread (after the jobs already queued)."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._thread.join(timeout=60)
            self._jobs = None

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
                elif kind == "call":
                    _call(*arg)
                else:
                    self._kv_local(arg)
                self._busy = not self._jobs.empty()
                self._notify()
        except BaseException as exc:  # surfaced on the main thread by check()
            self.error = exc
            with self.done_cv:
                self.done_cv.notify_all()
            self._notify()

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
                send_decode(self.transport, self.ranks[0], header, out)
        else:
            rows = None if out is None else returned_rows(header)
            with self.done_cv:
                self.done.append(RunResult(run, out, cancelled=out is None, finished_at=time.perf_counter(),
                                           rows=rows))
                self.done_cv.notify_all()

    def _stage_decode(self, run: Run, header: m.DecodeHeader, keep: np.ndarray) -> np.ndarray:
        """The head's stage on the rows of ``run`` not masked (``header``'s
        live rows; ``keep`` selects their tokens)."""
        return self.stage.decode(tokens=run.tokens[keep], **live_batch(header))

    def _kv_local(self, header: m.KvHeader) -> None:
        self.stage.kv(header.op, header.seq, header.seq_dst, header.p0, header.p1, header.delta)
        if self.ranks:
            self.transport.send(self.ranks[0], m.T_KV, m.encode_kv(header))


def _call(fn: Callable[[], object], box: list, done: threading.Event) -> None:
    """``fn()``'s result or error into ``box`` as (result, error), then ``done`` set."""
    try:
        box.append((fn(), None))
    except BaseException as exc:  # handed to the caller, which raises it
        box.append((None, exc))
    finally:
        done.set()
