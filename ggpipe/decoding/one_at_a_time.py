"""One request at a time (``--parallel 1``) behind the interface of the
continuous-batching scheduler (ggpipe.decoding.parallel.scheduler):
requests queue, :meth:`OneAtATime.step` runs the next one to its end
through the mode's own decoder, and a front end, ``/slots`` and the
aggregate tokens/s read its one slot as they read the scheduler's.

The mode runs in full here (PipeInfer's trees and early cancellation,
PipeDec's tree): its speculative sequences share KV cells
(``llama_memory_seq_cp``) in one unified KV buffer, which the scheduler's
one KV stream per slot does not allow (docs/user-guide/parallel.md).

Slot states (:class:`~ggpipe.decoding.parallel.slots.SlotState`), as the
scheduler's: ``idle`` with nothing running; ``prompt`` from the moment
:meth:`~OneAtATime.step` takes a request until its first token;
``generating`` until it ends; then ``idle`` again (a request leaves the
slot when the decoder returns, with nothing of it in flight). No MPI.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ggpipe.decoding.mode import Mode
from ggpipe.decoding.parallel.slots import Job, SlotState
from ggpipe.metrics import TokenRate
from ggpipe.runtime.vocab import check_prompt_fits
from ggpipe.speculation.draft_stats import DraftStats


class OneAtATime:
    """Args:
        decoder: the mode's decoder (:class:`~ggpipe.decoding.mode.Mode`).
        n_ctx: KV cells a request's prompt and generation may fill.
        cached: -> tokens whose cells sequence 0 holds now (``n_cached``).

    Attributes:
        current: the request running now (during :meth:`step`), or None.
        rate: tokens generated lately (:meth:`generated` counts them).
        depth: micro-batches the loop keeps in flight as the scheduler
            counts them: 1 (the mode itself keeps its own runs in flight).
    """

    depth = 1

    def __init__(self, decoder: Mode, n_ctx: int, cached: Callable[[], int] = lambda: 0):
        self.decoder = decoder
        self.n_ctx = n_ctx
        self._cached = cached
        self._pending: deque[tuple[Job, Callable[[Job], None]]] = deque()   # (request, what runs it), oldest first
        self.current: Job | None = None
        self._before = None      # the decoder's request before the current one started (until open() replaces it)
        self.rate = TokenRate()

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        """Raise ConfigError when the prompt (tokens) plus ``n_predict`` do
        not fit the context, or the prompt is empty."""
        check_prompt_fits(n_prompt, n_predict, self.n_ctx)

    def submit(self, job: Job, run: Callable[[Job], None]) -> None:
        """Queue ``job``; :meth:`step` calls ``run(job)`` when its turn comes
        (it runs the request to its end, or reports a cancelled one).

        Raises:
            ConfigError: it does not fit (:meth:`check_fits`)."""
        self.check_fits(len(job.tokens), job.n_predict)
        job.t_queued = time.monotonic()
        self._pending.append((job, run))

    @property
    def n_queued(self) -> int:
        """Requests waiting, cancelled ones left out."""
        return sum(1 for job, _ in list(self._pending) if not job.cancelled)

    @property
    def n_busy(self) -> int:
        """1 while a request runs, or waits to run at the next :meth:`step`."""
        return 1 if self.current is not None or self._pending else 0

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        return self.n_busy > 0

    def step(self, wake: Callable[[], bool] = lambda: False) -> None:
        """Run the next queued request to its end (``wake`` is not read:
        nothing else runs meanwhile)."""
        if not self._pending:
            return
        job, run = self._pending.popleft()
        self._before = self.decoder.r
        self.current = job
        try:
            run(job)
        finally:
            self.current = None

    def generated(self, n: int) -> None:
        """Count ``n`` tokens the running request accepted now."""
        self.rate.add(n)

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last 10 seconds."""
        return self.rate.per_s()

    def drain(self) -> None:
        """Nothing stays in flight between requests."""

    def view(self) -> list[dict]:
        """The one slot as the scheduler's ``view`` gives each
        (llama-server's ``/slots``): id, KV cells, busy, state, prompt
        tokens, tokens generated, cells cached, and the running request's
        drafting so far (:meth:`~ggpipe.decoding.mode.Mode.drafting`)."""
        job = self.current
        r = self.decoder.r if job is not None else None
        started = r is not None and r is not self._before     # open() has made the current request the decoder's
        out = list(r.out) if started else []
        if job is None:
            state = SlotState.IDLE
        else:
            state = SlotState.GENERATING if out else SlotState.PROMPT
        drafting = self.decoder.drafting() if started else DraftStats()
        return [{"id": 0, "n_ctx": self.n_ctx, "is_processing": job is not None, "state": state.value,
                 "n_prompt_tokens": len(job.tokens) if job is not None else 0, "n_decoded": len(out),
                 "n_cached": self._cached(), **drafting.as_dict()}]
