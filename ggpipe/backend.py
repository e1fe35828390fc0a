"""What the decoding layer asks of a model's pipeline: two declared
protocols, no MPI.

* :class:`DecodeBackend`: what a drafting strategy (a proposer,
  ``ggpipe.speculation.proposers``) may ask of the draft model's pipeline.
* :class:`TargetBackend`: what the decoding core, its mode policies and the
  continuous-batching scheduler (``ggpipe.decoding``) ask of the target
  model's pipeline; a superset of :class:`DecodeBackend`.

Three classes implement both: ``ggpipe.pipeline.driver.Pipeline`` (real
ranks over MPI), ``ggpipe.sim.toy.ToyPipeline`` (in memory, for the unit
tests) and ``ggpipe.sim.backend.SimPipeline`` (a virtual clock, for
``ggpipe simulate``). ``tests/test_backend_protocol.py`` checks each against
these protocols member by member, so a backend that drifts fails a test.

Runs complete in the order they were started (every stage handles
transactions in order, PipeInfer IV.A.2); KV operations are applied in order
with them on every stage.
"""

from __future__ import annotations

from typing import Protocol, Sequence, Sized

import numpy as np

from ggpipe.logits import TopLogits
from ggpipe.runs import Run, RunResult


class DraftResult(Protocol):
    """A finished run: float32 (n_outputs, n_vocab) ``logits`` (with the
    backend's ``reply_k`` > 0 their compact form, ggpipe.logits.TopLogits),
    or None (no row was asked for, or the run was cancelled); the ``run``
    it is the result of (``run.started_at``: submission, seconds of
    ``time.perf_counter``) and ``finished_at`` (its arrival, same clock; 0:
    not timed)."""

    logits: np.ndarray | TopLogits | None
    run: Run
    finished_at: float


class DecodeBackend(Protocol):
    """What a proposer may ask of a model's pipeline."""

    inflight: Sized  # runs started whose results were not taken yet
    reply_k: int     # results of runs started from now on: 0 full logit rows, k the k best (ggpipe.logits)

    @property
    def n_cells(self) -> int | None:
        """KV cells one sequence may fill (llama.cpp's ``n_ctx_seq``: ``-c``
        rounded up to 256; with one stream per sequence, one stream's), or
        None where the head does not know (no stage of this model on it)."""

    def decode(self, tokens: Sequence[int], start_pos: int, seq: int = 0, logits_last: bool = True,
               logits_all: bool = False) -> None:
        """Start one run of consecutive tokens of sequence ``seq``, with logits
        of its last token (``logits_last``), or of every token (``logits_all``)."""

    def submit_prompt(self, tokens: Sequence[int], start_pos: int, n_ubatch: int, seq: int = 0,
                      want_logits: bool = True) -> int:
        """Start ``tokens`` as chunks of at most ``n_ubatch``; returns the number of runs."""

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove cells of sequence ``seq`` (-1: every sequence) at positions [p0, p1) (-1: open end)."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Add sequence ``dst`` to the cells of ``src`` at positions [p0, p1) (metadata only)."""

    def submit(self, run: Run) -> None:
        """Start a :class:`~ggpipe.runs.Run` (any tokens, positions and sequence ids)."""

    def ready(self) -> bool:
        """The oldest run's result has arrived."""

    def poll(self) -> DraftResult | None:
        """The oldest run's result, or None if it has not arrived (never blocks)."""

    def wait(self, timeout_s: float | None = None) -> DraftResult:
        """The oldest run's result (bounded wait; raises RankTimeoutError)."""

    def due_in(self) -> float | None:
        """Seconds until the oldest run's result is expected (<= 0: overdue),
        from the measured service time; None: nothing in flight, or no
        estimate."""


class TargetBackend(DecodeBackend, Protocol):
    """What the decoding core, the mode policies and the scheduler ask of the
    target model's pipeline.

    Attributes:
        n_vocab: vocabulary size (logit row length, tokens).
        n_stages: stages of the pipeline (PipeDec bounds its runs in flight
            by it; the scheduler keeps at least this many micro-batches in
            flight).
        stats: counters the head's own stage keeps ("cancelled_before_start",
            "cancelled_mid_compute", "rows_masked", ...), reported in
            ``--json``.
    """

    n_vocab: int
    n_stages: int
    stats: dict

    def prefill(self, tokens: Sequence[int], start_pos: int, n_ubatch: int, seq: int = 0) -> np.ndarray:
        """:meth:`submit_prompt`, then wait for every run; float32 (n_vocab,)
        logits of the last token."""

    def drain(self, timeout_s: float | None = None) -> list[RunResult]:
        """Wait for every run in flight, in order."""

    def poll(self) -> RunResult | None:
        """The oldest run's result, or None if it has not arrived (never blocks)."""

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """The oldest run's result (bounded wait; raises RankTimeoutError)."""

    def cancel(self, run_id: int) -> None:
        """Cancel a speculative run (PipeInfer IV.D): its result still
        comes, marked cancelled (or complete, if the cancel came too late)."""

    def prune(self, pairs: list[tuple[int, int]]) -> None:
        """Mask the rows of runs in flight whose every sequence is among the
        (run id, sequence id) pairs (PipeDec 3.3.4, ggpipe.pipeline.masking)."""

    def head_idle(self) -> bool:
        """The head's own stage has nothing to compute (True when it computes inside submit)."""

    def clear(self) -> None:
        """Empty the KV cache of every stage."""
