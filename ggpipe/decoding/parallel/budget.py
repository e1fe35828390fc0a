"""What one micro-batch carries: one token budget per step, shared the way
stall-free schedulers share it. Pure: no pipeline, no MPI;
ggpipe.decoding.parallel.scheduler asks :func:`plan_step` or
:func:`plan_late` for each micro-batch and tells :class:`LateShare` what
each one cost.

* **One budget** (``-b/--batch-size``, llama.cpp's ``n_batch``): the most
  tokens of one micro-batch. The generating slots' rows go first (their next
  token, and the drafted chain below it for a request alone), then chunks
  of waiting prompts, from as many slots as fit, the shortest remaining
  prompt first among those that arrived together (:data:`BURST_S`), the
  older arrivals before the later ones; a
  prompt longer than what is left goes on in the next micro-batch (chunked
  prefill: vLLM v1's scheduler, one ``max_num_batched_tokens`` per step;
  llama-server's one ``llama_batch`` of every slot's next token and as many
  prompt tokens as ``n_batch`` holds). Sixteen short prompts enter in one
  micro-batch.
* **A bound on the time between tokens** (Sarathi-Serve's stall-free
  batches, Agrawal et al., OSDI 2024): a prompt that arrived while other
  requests were already generating (:func:`late_prompts`) goes in
  micro-batches of its own, one after each micro-batch of generating rows,
  each measured to take at most ``ITL_BOUND - 1`` times as long as that
  one (:class:`LateShare`): the running requests' time between tokens
  stays within :data:`ITL_BOUND` times its value without the prompt. Apart,
  because llama.cpp attends every sequence of a ubatch over as many cells
  as its longest one holds: a long prompt's first token among the
  generating rows would make each of them attend over the whole prompt.
  Prompts that were waiting before a request began generating (a burst
  that arrived together) take the whole budget beside the generating rows:
  they were there first. So a 4,000-token prompt never holds the running
  requests' next tokens much longer than their own micro-batch takes, and a
  burst of prompts is prefilled at the batched speed.
* **Uniform micro-batches under a pipeline**: with several stages, the
  prompt tokens of one micro-batch are the first of the chunks that
  :func:`~ggpipe.pipeline.prefill.prefill_chunks` cuts the waiting prompts
  into, so every micro-batch in flight carries about as many tokens and no
  stage waits for a large one (Sarathi-Serve's uniform batches; one long
  prompt alone goes in the pipelined chunks of ggpipe.pipeline.prefill).

A micro-batch's rows go in slot id order: llama.cpp splits a batch on a
cache of one KV stream per sequence into ubatches of consecutive ascending
sequence ids (``llama_batch_allocr::split_equal``), so ascending order
gives it the fewest ubatches; every stage puts the rows it computed back in
batch order (:func:`ggpipe.runs.ubatch_order`).
"""

from __future__ import annotations

from typing import Callable

from ggpipe.decoding.parallel.slots import Slot, decode_groups
from ggpipe.pipeline.prefill import prefill_chunks

#: Prompts that arrived within this many seconds after the oldest one waiting
#: count as one burst: inside it the shortest remaining prompt goes first
#: (shortest remaining processing time, which gives the earliest median first
#: token for the same last one), and a burst goes before every prompt that
#: arrived after it, so no prompt waits behind later ones (seconds).
BURST_S = 1.0

#: The time between a generating request's tokens while a prompt that
#: arrived after it is processed, as a multiple of that time without it;
#: planned below twice, so that noise keeps it under
#: (docs/user-guide/parallel.md, Prompts).
ITL_BOUND = 1.4


class LateShare:
    """How many tokens of late prompts go in one micro-batch of their own:
    as many as keep its measured service time within ``bound - 1`` times
    that of the micro-batches of generating rows. A multiplicative
    controller on measurements, not a model: each late micro-batch's time
    against the recent generating ones' scales the next one's tokens (at
    most by 2, at least by 1/2, per micro-batch), so the share follows the
    prompt's attention cost as its context grows and any machine's balance
    of weight streaming and compute. Before any measurement: ``bound - 1``
    times the tokens of a micro-batch of generating rows.

    Args:
        bound: :data:`ITL_BOUND`.
        alpha: weight of a new measurement of the generating micro-batches'
            time (an exponentially weighted mean).
    """

    def __init__(self, bound: float = ITL_BOUND, alpha: float = 0.3):
        self.bound = bound
        self.alpha = alpha
        self.decode_s: float | None = None   # recent service time of a micro-batch of generating rows
        self._tokens: float | None = None
        self._last_finish = 0.0

    def service(self, started_at: float, finished_at: float) -> float:
        """A micro-batch's service time (seconds): from the later of its
        submission and the previous one's finish (one queued behind another
        waits for it; that is not its cost). Called for every micro-batch,
        in the order they finish."""
        s = finished_at - max(started_at, self._last_finish)
        self._last_finish = finished_at
        return s

    def decoded(self, seconds: float) -> None:
        """A micro-batch of generating rows took ``seconds``."""
        if seconds > 0:
            self.decode_s = seconds if self.decode_s is None else \
                self.decode_s + self.alpha * (seconds - self.decode_s)

    def late(self, n_tokens: int, seconds: float) -> None:
        """A micro-batch of ``n_tokens`` late prompt tokens took ``seconds``:
        the next one's tokens are scaled by the bound's room over it."""
        if seconds <= 0 or self.decode_s is None:
            return
        scale = min(2.0, max(0.5, (self.bound - 1.0) * self.decode_s / seconds))
        self._tokens = max(1.0, n_tokens * scale)

    def tokens(self, n_decode: int, budget: int) -> int:
        """Late prompt tokens for the next micro-batch (1..``budget``);
        ``n_decode``: the tokens of a micro-batch of generating rows (the
        first guess)."""
        if self._tokens is None:
            self._tokens = max(1.0, (self.bound - 1.0) * n_decode)
        return max(1, min(budget, int(self._tokens)))


def late_prompts(slots: list[Slot]) -> set[int]:
    """The slot ids whose prompt arrived while another request was already
    generating (its ``arrival`` at or after that request's
    ``generating_since``): their chunks go apart, in :func:`plan_late`. Pure."""
    since = [s.generating_since for s in slots if s.generating and s.generating_since is not None]
    if not since:
        return set()
    first = min(since)
    return {s.seq for s in slots if s.job is not None and s.todo and not s.generating and s.job.arrival >= first}


def _ready_prompts(slots: list[Slot], defer: Callable[[Slot], bool] | None) -> list[Slot]:
    """Prompts with tokens to send (``defer``: held back this time), in the
    order they get the budget: by burst (:data:`BURST_S` windows of their
    ``t_queued`` from the oldest one's), then shortest remaining prompt,
    then arrival."""
    ready = [s for s in slots if s.job is not None and s.todo and not s.waiting and not s.generating
             and not (defer and defer(s))]
    if not ready:
        return ready
    t0 = min(s.job.t_queued for s in ready)
    return sorted(ready, key=lambda s: (int((s.job.t_queued - t0) // BURST_S), len(s.todo), s.job.arrival))


def plan_step(slots: list[Slot], budget: int, depth: int, n_stages: int,
              defer: Callable[[Slot], bool] | None = None, late: set[int] = frozenset()) \
        -> list[tuple[Slot, int, bool]]:
    """Which slots send what in the next micro-batch: (slot, tokens, wants
    the logits of its last token), in slot id order. Pure.

    The generating slots' rows come first: the slots of one group of
    :func:`~ggpipe.decoding.parallel.slots.decode_groups` (fixed ranges of
    slot ids taking turns, one per micro-batch in flight), a group going
    only when none of its slots waits for logits, the one sent least
    recently first; each slot sends its next token and any drafted chain
    below it (every row's logits). Then chunks of the prompts being
    processed, in :func:`_ready_prompts`' order (a burst's shortest
    remaining prompt first), in the tokens the budget leaves; with
    several stages, at most the first of the pipelined chunks of everything
    waiting (:func:`~ggpipe.pipeline.prefill.prefill_chunks`). A prompt's
    last chunk asks for logits. Slots waiting for logits send nothing, nor
    prompts that ``defer`` holds back (one waiting to borrow a prefix
    another request is computing:
    :func:`~ggpipe.decoding.parallel.prefix_cache.awaits_donor`) or that
    are ``late`` (they go apart: :func:`plan_late`).

    Args:
        slots: every slot, in slot id order.
        budget: most tokens in the micro-batch (``-b``).
        depth: micro-batches the scheduler keeps in flight (>= 1).
        n_stages: the target pipeline's stages.
        defer: slot -> its prompt waits this time, or None.
        late: slot ids of late prompts (:func:`late_prompts`).
    """
    gen = [s for s in slots if s.job is not None and s.todo and not s.waiting and s.generating]
    group: list[Slot] = []
    if gen:
        ids = {id(s) for s in gen}
        sendable = [[s for s in g if id(s) in ids] for g in decode_groups(slots, depth, budget)
                    if not any(s.waiting for s in g)]
        group = min((g for g in sendable if g), key=lambda g: min(s.last_sent for s in g), default=[])
    plan = [(s, len(s.todo), True) for s in group]     # a chain fits: the scheduler drafts at most budget - 1
    prompts = [s for s in _ready_prompts(slots, defer) if s.seq not in late]
    left = budget - sum(len(s.todo) for s in group)
    if prompts and left > 0:
        if n_stages > 1:   # uniform micro-batches: the first pipelined chunk of all that waits
            left = min(left, prefill_chunks(sum(len(s.todo) for s in prompts), budget, n_stages)[0])
        for s in prompts:
            if left <= 0:
                break
            n = min(left, len(s.todo))
            plan.append((s, n, n == len(s.todo)))
            left -= n
    return sorted(plan, key=lambda p: p[0].seq)


def plan_late(slots: list[Slot], tokens: int, late: set[int],
              defer: Callable[[Slot], bool] | None = None) -> list[tuple[Slot, int, bool]]:
    """A micro-batch of late prompts' chunks alone: at most ``tokens``
    tokens, in :func:`_ready_prompts`' order, sent in slot id order (as
    :func:`plan_step`'s tuples). Pure."""
    plan, left = [], tokens
    for s in _ready_prompts(slots, defer):
        if left <= 0:
            break
        if s.seq in late:
            n = min(left, len(s.todo))
            plan.append((s, n, n == len(s.todo)))
            left -= n
    return sorted(plan, key=lambda p: p[0].seq)
