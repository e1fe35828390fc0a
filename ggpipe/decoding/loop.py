"""What every request loop speaks (the continuous-batching scheduler,
ggpipe.decoding.parallel.scheduler, and ``--parallel 1``'s one slot,
ggpipe.decoding.one_at_a_time): a request handed to it (:class:`Job`), the
interface front ends drive (:class:`RequestLoop`), a slot's state
(:class:`SlotState`, its transitions) and a slot as ``/slots`` shows it
(:func:`slot_view`). No pipeline, no MPI."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Protocol, runtime_checkable

from ggpipe.decoding.request import Emit, Request, _never_stop
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler
from ggpipe.speculation.draft_stats import DraftStats


@dataclass
class PromptSteps:
    """How a request's prompt went through the micro-batches: how many
    carried its chunks, and what they carried in all (generating requests'
    next tokens, drafted tokens, prompt tokens: its own and others').

    Attributes:
        steps: micro-batches that carried a chunk of the prompt.
        decode, draft, prompt: tokens of each kind in them, summed.
    """

    steps: int = 0
    decode: int = 0
    draft: int = 0
    prompt: int = 0

    def add(self, decode: int, draft: int, prompt: int) -> None:
        """One more micro-batch carried a chunk, with these tokens in all."""
        self.steps += 1
        self.decode += decode
        self.draft += draft
        self.prompt += prompt

    def as_dict(self) -> dict:
        """``{"prompt_steps", "step_tokens": {"decode", "draft", "prompt"}}``:
        the micro-batches, and their mean tokens of each kind (tokens per
        micro-batch; zeros for a prompt that needed none)."""
        n = max(self.steps, 1)
        return {"prompt_steps": self.steps,
                "step_tokens": {k: round(getattr(self, k) / n, 1) for k in ("decode", "draft", "prompt")}}


def _never(*_: object) -> bool:
    return False


@dataclass(eq=False)
class Job:
    """One request handed to the :class:`Scheduler`.

    Attributes:
        tokens: the prompt's token ids (history included: the whole context).
        n_predict: most tokens to generate.
        sampler: the request's own sampler (settings and random stream).
        emit: called with each accepted token list; a true return ends the
            request (a stop string, a client that left).
        on_done: called once with the job when the request has ended.
        cancelled: set by another thread to drop the job: one that waits in
            the queue is dropped (its ``on_done`` is still called, with
            ``request`` None); one in a slot ends at the next step.
        should_stop: polled at every step while the request's prompt is
            processed (its client left: it ends then, freeing its slot;
            once it generates, ``emit``'s return says the same).
        clock: TTFT / ITL clock (restarted when the job gets a slot).
        request: the running request (:class:`~ggpipe.decoding.request.Request`), once started.
        slot: its slot, once started.
        n_reused: prompt tokens whose cells the slot already held.
        queue_s: seconds spent waiting for a slot.
        draft_stats: tokens drafted below this request's tokens, and those
            the target verified and accepted per position after a root
            (ggpipe.speculation.draft_stats).
        error: what ended this request alone (its sampling raised), or None.
        arrival: its order among the requests submitted to the loop (0, 1, ...).
        prompt_steps: how its prompt went through the micro-batches.
        target_passes: micro-batches that carried a row of its generation
            asking for logits (its next token, a chain below it, a
            look-ahead row), once its prompt was processed.
    """

    tokens: list[int]
    n_predict: int
    sampler: Sampler
    emit: Emit = _never_stop
    on_done: Callable[["Job"], None] = lambda job: None
    cancelled: bool = False
    clock: GenerationClock = field(default_factory=GenerationClock)
    request: Request | None = None
    slot: int | None = None
    n_reused: int = 0
    queue_s: float = 0.0
    draft_stats: DraftStats = field(default_factory=DraftStats)
    t_queued: float = field(default_factory=time.monotonic)
    error: Exception | None = None
    should_stop: Callable[[], bool] = _never
    arrival: int = 0
    prompt_steps: PromptSteps = field(default_factory=PromptSteps)
    target_passes: int = 0


@runtime_checkable
class RequestLoop(Protocol):
    """The one interface of the loop requests go through
    (ggpipe.decoding.factory.build_loop): the continuous-batching scheduler
    (:class:`~ggpipe.decoding.parallel.scheduler.Scheduler`) or ``--parallel
    1``'s one slot (:class:`~ggpipe.decoding.one_at_a_time.OneAtATime`). The
    engine holds one and never asks which.

    Attributes:
        depth: micro-batches the loop keeps in flight.
    """

    depth: int

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        """Raise ConfigError when a prompt of ``n_prompt`` tokens plus
        ``n_predict`` do not fit a request's cells, or it is empty."""

    def submit(self, job: Job) -> None:
        """Queue ``job``; ``job.on_done(job)`` is called when it has ended
        (``job.request`` None for one cancelled while queued, ``job.error``
        for one that failed alone).

        Raises:
            ConfigError: it does not fit."""

    @property
    def n_queued(self) -> int:
        """Requests waiting for the slot(s)."""

    @property
    def n_busy(self) -> int:
        """Slots holding a request."""

    @property
    def busy(self) -> bool:
        """Requests queued or running."""

    def step(self, wake: Callable[[], bool] = lambda: False) -> None:
        """One turn of the loop (``wake``: stop a wait early when true)."""

    def reset(self) -> None:
        """The KV caches were cleared with nothing in flight: no slot holds cells."""

    def request_stats(self, job: Job) -> dict:
        """A finished request's statistics (``--json``'s ``decoder``): at
        least :func:`common_stats`' keys, in every loop and mode."""

    def view(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots``)."""

    def tokens_per_s(self) -> float:
        """Tokens generated per second over the last 10 seconds."""

    def step_tokens(self) -> dict:
        """What the micro-batches carried since the loop started:
        ``{"micro_batches", "decode", "draft", "prompt"}`` (counts of
        micro-batches and of tokens of each kind); any thread."""

    def drain(self) -> None:
        """Wait for every micro-batch in flight (before a shutdown)."""


def common_stats(job: Job, drafting: DraftStats, target_passes: int) -> dict:
    """The statistics every loop reports for a finished request, whatever
    the mode: its drafting (:meth:`~ggpipe.speculation.draft_stats.DraftStats.as_dict`;
    zeros where nothing was drafted), ``target_passes`` (the target's passes
    that carried its generation after the prompt) and ``accepted_per_pass``
    (its tokens after the first per such pass; None before a second token),
    and how its prompt went through the micro-batches
    (:meth:`PromptSteps.as_dict`)."""
    n_out = len(job.request.out) if job.request is not None else 0
    return {**drafting.as_dict(), "target_passes": target_passes,
            "accepted_per_pass": (n_out - 1) / target_passes if target_passes and n_out > 1 else None,
            **job.prompt_steps.as_dict()}


class SlotState(str, Enum):
    """A slot's state (``/slots``' ``state``; llama-server's slot states).

    Transitions (ggpipe.decoding.parallel.scheduler):

    * ``idle`` -> ``prompt``: a queued request takes the free slot; the
      cells of the longest common prefix with what the slot held are kept,
      the rest removed, and the prompt's other tokens go in chunks.
    * ``prompt`` -> ``generating``: the last chunk's logits arrive and the
      request's first token is sampled.
    * ``prompt`` or ``generating`` -> ``done``: the request ends
      (end-of-generation token, ``n_predict``, a stop string, a client that
      left, its own sampling error); its rows still in flight are dropped
      as they return.
    * ``done`` -> ``idle``: the request has left the slot and no
      micro-batch holding its rows is in flight; its cells stay for the
      next request's common prefix.
    """

    IDLE = "idle"
    PROMPT = "prompt"
    GENERATING = "generating"
    DONE = "done"


def slot_view(seq: int, n_ctx: int, job: Job | None, state: SlotState, n_decoded: int, n_cached: int,
              drafting: DraftStats | None) -> dict:
    """One slot as llama-server's ``/slots`` shows it (every loop's
    ``view``): id, KV cells, busy, state (its value), prompt tokens, tokens
    generated, cells cached, the request's wait for the slot (``queue_s``,
    seconds) and its prompt's micro-batches so far
    (:meth:`PromptSteps.as_dict`), and its drafting so far
    (:meth:`~ggpipe.speculation.draft_stats.DraftStats.as_dict`: tokens
    drafted and accepted, their rate, per position after a root, and the
    target's pass costs; zeros, None and empty lists and dicts for
    ``drafting`` None)."""
    return {"id": seq, "n_ctx": n_ctx, "is_processing": job is not None, "state": state.value,
            "n_prompt_tokens": len(job.tokens) if job is not None else 0, "n_decoded": n_decoded,
            "n_cached": n_cached, "queue_s": round(job.queue_s, 4) if job is not None else None,
            **(job.prompt_steps if job is not None else PromptSteps()).as_dict(),
            **(drafting or DraftStats()).as_dict()}
