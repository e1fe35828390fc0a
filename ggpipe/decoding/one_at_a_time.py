"""One request at a time (``--parallel 1``) behind the interface every
request loop speaks (:class:`~ggpipe.decoding.loop.RequestLoop`, as the
continuous-batching scheduler, ggpipe.decoding.parallel.scheduler):
requests are the same :class:`~ggpipe.decoding.loop.Job`, they
queue, :meth:`OneAtATime.step` runs the next one to its end through the
mode's own decoder, and a front end, ``/slots`` and the aggregate tokens/s
read its one slot as they read the scheduler's.

The mode runs in full here (PipeInfer's trees and early cancellation,
PipeDec's tree): its speculative sequences share KV cells
(``llama_memory_seq_cp``) in one unified KV buffer, which the scheduler's
one KV stream per slot does not allow (docs/user-guide/parallel.md).

Prefix reuse (as llama.cpp's server and llama-cpp-python's ``Llama`` do):
the slot remembers the tokens held in sequence 0 of the KV cache
(:attr:`OneAtATime.kv`). A new request whose tokens start with some of them
(the next chat turn, a shared system prompt) keeps those cells; every cell
from the first difference on is removed (``llama_memory_seq_rm`` on every
stage) and only the rest of the prompt goes down the pipeline. The draft
model's KV follows the same context (the proposer decodes only what it
lacks).

Slot states (:class:`~ggpipe.decoding.loop.SlotState`), as the
scheduler's: ``idle`` with nothing running; ``prompt`` from the moment
:meth:`~OneAtATime.step` takes a request until its first token;
``generating`` until it ends; then ``idle`` again (a request leaves the
slot when the decoder returns, with nothing of it in flight). No MPI.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from ggpipe.decoding.mode import Mode
from ggpipe.decoding.loop import Job, PromptSteps, SlotState, common_stats, slot_view
from ggpipe.errors import GGPipeError
from ggpipe.speculation.draft_stats import DraftStats
from ggpipe.kv_reuse import reusable_prefix
from ggpipe.metrics import TokenRate
from ggpipe.pipeline.prefill import prefill_chunks
from ggpipe.runtime.vocab import check_prompt_fits


class OneAtATime:
    """Args:
        decoder: the mode's decoder (:class:`~ggpipe.decoding.mode.Mode`).
        n_ctx: KV cells a request's prompt and generation may fill.
        target: the target pipeline (``seq_rm`` of the cells after a
            reused prefix), or None: nothing is removed (the caller clears
            the caches).
        reuse_kv: keep the cells of the longest prefix a request shares with
            the tokens sequence 0 holds.
        partial_reuse: the cells can be kept up to any position; False for a
            recurrent or hybrid model (llama.cpp keeps or drops its state
            whole): only a prompt that goes on after all of them keeps them.
        recover: called after a request failed unexpectedly, before it is
            reported (the engine waits for the runs in flight and clears
            every cache; it raises when the pipeline is out of step).
        doing: ``doing(text, clock)`` tells what the job is doing (the
            liveness messages': "answering a request ...", "idle between
            requests"), or None.
        n_batch: the decoder's prefill chunk (tokens; the prompt's steps
            reported in ``request_stats``).

    Attributes:
        kv: the tokens whose cells sequence 0 holds (position i at index i).
        current: the request running now (during :meth:`step`), or None.
        rate: tokens generated lately.
        depth: micro-batches the loop keeps in flight as the scheduler
            counts them: 1 (the mode itself keeps its own runs in flight).
    """

    depth = 1

    def __init__(self, decoder: Mode, n_ctx: int, target=None, reuse_kv: bool = True, partial_reuse: bool = True,
                 recover: Callable[[], None] = lambda: None, doing: Callable[..., None] | None = None,
                 n_batch: int = 512):
        self.decoder = decoder
        self.n_batch = n_batch
        self._n_stages = getattr(target, "n_stages", 1) if target is not None else 1
        self.n_ctx = n_ctx
        self.target = target
        self.reuse_kv, self.partial_reuse = reuse_kv, partial_reuse
        self._recover, self._doing = recover, doing or (lambda text, clock=None: None)
        self.kv: list[int] = []
        self._pending: deque[Job] = deque()     # oldest first
        self.current: Job | None = None
        self._n_out = 0          # tokens the current request has emitted (0: its prompt is processed)
        self.rate = TokenRate()
        self._steps = PromptSteps()          # every request's prompt chunks
        self._generated = 0

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        """Raise ConfigError when the prompt (tokens) plus ``n_predict`` do
        not fit the context, or the prompt is empty."""
        check_prompt_fits(n_prompt, n_predict, self.n_ctx)

    def submit(self, job: Job) -> None:
        """Queue ``job``; :meth:`step` runs it when its turn comes, then
        calls ``job.on_done(job)`` (``job.request`` None for one cancelled
        while it waited; ``job.error`` set for one that failed).

        Raises:
            ConfigError: it does not fit (:meth:`check_fits`)."""
        self.check_fits(len(job.tokens), job.n_predict)
        job.t_queued = time.monotonic()
        self._pending.append(job)

    @property
    def n_queued(self) -> int:
        """Requests waiting, cancelled ones left out."""
        return sum(1 for job in list(self._pending) if not job.cancelled)

    @property
    def n_busy(self) -> int:
        """1 while a request runs, or waits to run at the next :meth:`step`."""
        return 1 if self.current is not None or self._pending else 0

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        return self.n_busy > 0

    def step(self, wake: Callable[[], bool] = lambda: False) -> None:
        """Run the next queued request to its end and report it (``wake``
        is not read: nothing else runs meanwhile). A failure of the request
        alone is its ``job.error``: its own settings
        (:class:`~ggpipe.errors.GGPipeError`, nothing run), or an
        unexpected error, after which ``recover`` ran.

        Raises:
            GGPipeError: the pipeline is out of step (``abort_job``); what
                ``recover`` raises; MPI's own errors."""
        if not self._pending:
            return
        job = self._pending.popleft()
        if not job.cancelled:
            self._n_out = 0
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None
        job.on_done(job)

    def _run(self, job: Job) -> None:
        """``job`` through the decoder, after the cells of its reusable
        prefix (:meth:`_keep_prefix`); its failure as :meth:`step` says."""
        job.queue_s = time.monotonic() - job.t_queued
        job.slot = 0
        self._doing(f"answering a request ({len(job.tokens)} prompt tokens, {self.decoder.name})", job.clock)

        def emit(new: list[int]) -> bool:
            self._n_out += len(new)
            self.rate.add(len(new))
            self._generated += len(new)
            return job.emit(new)

        try:
            start = job.n_reused = self._keep_prefix(job.tokens)
            for n in prefill_chunks(len(job.tokens) - start, self.n_batch, self._n_stages):
                job.prompt_steps.add(0, 0, n)      # its chunks carry its own tokens alone
                self._steps.add(0, 0, n)
            out = self.decoder.generate(np.asarray(job.tokens[start:], dtype=np.int32), job.n_predict, job.sampler,
                                        start_pos=start, emit=emit, clock=job.clock, history=job.tokens[:start])
            job.request = self.decoder.r
            self.kv = job.tokens + out[:-1]     # every generated token but the last has its cells
        except GGPipeError as e:
            if e.abort_job:
                raise
            job.error = e
        except Exception as e:
            if type(e).__module__.startswith("mpi4py"):
                raise
            self._recover()
            job.error = e
        finally:
            self._doing("idle between requests")

    def _keep_prefix(self, tokens: list[int]) -> int:
        """Keep the longest prefix of ``tokens`` whose cells sequence 0
        holds (at least one token is left to decode, for its logits);
        remove every cell after it on every stage. Returns the prefix
        length (tokens)."""
        common = reusable_prefix(self.kv, tokens, partial=self.partial_reuse) if self.reuse_kv else 0
        if self.target is not None:
            # every sequence: speculation partitions are released after each request, but a cell past the
            # prefix in any sequence must not survive; a recurrent or hybrid model (no speculation: sequence 0
            # alone) refuses seq_rm of sequence -1 (llama_memory_recurrent::seq_rm), so its sequence 0 goes
            self.target.seq_rm(-1 if self.partial_reuse else 0, common, -1)
        del self.kv[common:]
        return common

    def reset(self) -> None:
        """The KV caches were cleared (target and draft): nothing is cached."""
        self.decoder.reset()
        self.kv = []

    def request_stats(self, job: Job) -> dict:
        """The finished request's statistics (``--json``'s ``decoder``):
        :func:`~ggpipe.decoding.loop.common_stats` (its drafting, the
        target passes the mode counted, its prompt's chunks), then the
        mode's own (:attr:`~ggpipe.decoding.mode.Mode.stats`)."""
        own = self.decoder.stats
        common = common_stats(job, self.decoder.drafting() if job.request is not None else DraftStats(),
                              own.get("target_passes") or 0)
        return {**common, **own}

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last 10 seconds."""
        return self.rate.per_s()

    def step_tokens(self) -> dict:
        """The prompts' chunks (``micro_batches``, ``prompt`` tokens) and
        the tokens generated (``decode``); the mode's own runs (its drafts,
        its trees) are its statistics' (``request_stats``): ``draft`` 0."""
        return {"micro_batches": self._steps.steps, "decode": self._generated, "draft": 0,
                "prompt": self._steps.prompt}

    def drain(self) -> None:
        """Nothing stays in flight between requests."""

    def view(self) -> list[dict]:
        """The one slot as the scheduler's ``view`` gives each
        (:func:`~ggpipe.decoding.loop.slot_view`): idle, its prompt
        processed until it has emitted a token, then generating with its
        drafting so far (:meth:`~ggpipe.decoding.mode.Mode.drafting`)."""
        job = self.current
        n_out = self._n_out if job is not None else 0
        state = SlotState.IDLE if job is None else SlotState.GENERATING if n_out else SlotState.PROMPT
        return [slot_view(0, self.n_ctx, job, state, n_out, len(self.kv),
                          self.decoder.drafting() if n_out else None)]
