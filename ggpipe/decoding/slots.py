"""The scheduler's pure parts: a request handed to it (:class:`Job`), a
slot (:class:`Slot`: a KV sequence and the request that holds it), and which
slots send what in the next micro-batch (:func:`plan_microbatch`). No
pipeline, no MPI; ggpipe.decoding.scheduler drives them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ggpipe.decoding.request import Emit, Request, _never_stop
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler


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
        cancelled: set by another thread to drop a job that waits in the
            queue (its ``on_done`` is still called, with ``request`` None).
        clock: TTFT / ITL clock (restarted when the job gets a slot).
        request: the running request (:class:`~ggpipe.decoding.request.Request`), once started.
        slot: its slot, once started.
        n_reused: prompt tokens whose cells the slot already held.
        queue_s: seconds spent waiting for a slot.
        drafted, draft_accepted: tokens drafted below this request's tokens,
            and how many of them the target took.
        error: what ended this request alone (its sampling raised), or None.
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
    drafted: int = 0
    draft_accepted: int = 0
    t_queued: float = field(default_factory=time.monotonic)
    error: Exception | None = None


@dataclass(eq=False)
class Slot:
    """A KV sequence and the request that holds it.

    Attributes:
        seq: its KV sequence id (= slot id).
        kv: the tokens whose cells this sequence holds or will hold once the
            micro-batches in flight are placed (position i at index i).
        job: the request in it, or None (free).
        todo: tokens to send next: a prompt's rest, or the last sampled token.
        waiting: a row that asks for logits is in flight.
        in_flight: micro-batches in flight holding rows of this slot.
    """

    seq: int
    kv: list[int] = field(default_factory=list)
    job: Job | None = None
    todo: list[int] = field(default_factory=list)
    waiting: bool = False
    in_flight: int = 0

    @property
    def free(self) -> bool:
        """No request, and nothing of an earlier one in flight."""
        return self.job is None and self.in_flight == 0


@dataclass
class _Row:
    slot: Slot
    job: Job
    logits: bool   # this row asked for logits
    chain: list[int] = field(default_factory=list)   # drafted tokens after the row's token (a logit row each)


def plan_microbatch(slots: list[Slot], budget: int, max_decode: int,
                    prefer_prompt: bool = False) -> list[tuple[Slot, int, bool]]:
    """Which slots send what in the next micro-batch: (slot, tokens, wants
    logits of its last token), in batch order. Pure.

    A micro-batch is either the next token of generating slots (at most
    ``max_decode`` and ``budget`` of them, the lowest ids, in id order), or
    one sequence's chunk: a chunk of the earliest-queued prompt (at most
    ``budget`` tokens; its last chunk asks for the logits of its last token)
    or a generating slot's token with a drafted chain below it (every row's
    logits). With one KV stream per sequence, llama.cpp splits a batch into
    ubatches of consecutive sequence ids and equal tokens per sequence
    (``llama_batch_allocr::split_equal``), and only these shapes come out of
    it in batch order, which the stages' hidden-state capture relies on.
    A chunk goes first when ``prefer_prompt`` (the scheduler alternates
    while both wait) or when no slot waits with one token. Slots waiting
    for logits send nothing."""
    ready = [s for s in slots if s.job is not None and s.todo and not s.waiting]
    decode = [s for s in ready if s.job.request is not None and s.job.request.out and len(s.todo) == 1]
    chunks = sorted((s for s in ready if s not in decode), key=lambda s: s.job.t_queued)
    if decode and not (chunks and prefer_prompt):
        return [(s, 1, True) for s in decode[:min(max_decode, budget)]]
    if chunks:
        s = chunks[0]
        n = min(budget, len(s.todo))
        return [(s, n, n == len(s.todo))]
    return []
