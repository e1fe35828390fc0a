"""What one micro-batch carries: one token budget per step, shared the way
stall-free schedulers share it. Pure: no pipeline, no MPI;
ggpipe.decoding.parallel.scheduler asks :func:`plan_step` for each
micro-batch and tells :class:`StepCost` what each one cost.

* **One budget** (``-b/--batch-size``, llama.cpp's ``n_batch``): the most
  tokens of one micro-batch. The generating slots' rows go first (their next
  token, and the drafted chain below it for a request alone), then chunks
  of waiting prompts, oldest request first, from as many slots as fit; a
  prompt longer than what is left goes on in the next micro-batch (chunked
  prefill: vLLM v1's scheduler, one ``max_num_batched_tokens`` per step;
  llama-server's one ``llama_batch`` of every slot's next token and as many
  prompt tokens as ``n_batch`` holds). Sixteen short prompts enter in one
  micro-batch.
* **A bound on the time between tokens** (Sarathi-Serve's stall-free
  batches, Agrawal et al., OSDI 2024): a prompt that arrived while other
  requests were already generating shares a micro-batch with their rows
  only up to the prompt tokens that keep its predicted cost within
  :data:`ITL_BOUND` times the cost of those rows alone (:class:`StepCost`,
  fitted to the micro-batches measured so far). Prompts that were waiting
  before a request began generating (a burst that arrived together) take
  the whole budget: they were there first. So a 4,000-token prompt never
  holds the running requests' next tokens much longer than their own
  micro-batch takes, and a burst of prompts is prefilled at the batched
  speed.
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

from collections import deque
from typing import Callable

import numpy as np

from ggpipe.decoding.parallel.slots import Slot, decode_groups
from ggpipe.pipeline.prefill import prefill_chunks

#: A micro-batch that holds rows of generating requests and tokens of a
#: prompt that arrived after they began is planned to cost at most this
#: many times those rows alone (their time between tokens), so that noise
#: keeps it under twice (docs/user-guide/parallel.md, Prompts).
ITL_BOUND = 1.5


class StepCost:
    """A micro-batch's service time against what it carries: a least-squares
    fit ``seconds = a + b * tokens + c * logit_rows`` with no term below
    zero, over the last ``window`` micro-batches measured (``a``: streaming
    the weights once; ``b``: computing one token; ``c``: one row of the
    output layer). Until three micro-batches of different shapes were
    measured, or when no fit has a cost per token above zero, cost is taken
    as proportional to tokens.

    Args:
        window: micro-batches the fit remembers.
    """

    def __init__(self, window: int = 64):
        self._obs: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float] | None = None
        self._stale = False
        self._last_finish = 0.0

    def finished(self, n_tokens: int, n_outputs: int, started_at: float, finished_at: float) -> None:
        """A micro-batch of ``n_tokens`` tokens with ``n_outputs`` logit
        rows, submitted at ``started_at`` and finished at ``finished_at``
        (seconds, the pipeline's clock), in the order they finish. Its
        service time runs from the later of its submission and the previous
        finish (one queued behind another waits for it; that is not its
        cost)."""
        seconds = finished_at - max(started_at, self._last_finish)
        self._last_finish = finished_at
        if seconds > 0 and n_tokens > 0 and started_at > 0:
            self._obs.append((n_tokens, n_outputs, seconds))
            self._stale = True

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(a, b, c)`` of the fit (seconds), or None (see the class)."""
        if self._stale:
            self._stale = False
            self._fit = None
            if len({(n, o) for n, o, _ in self._obs}) >= 3:
                self._fit = _nonnegative_fit(np.array([(1.0, n, o) for n, o, _ in self._obs]),
                                             np.array([s for _, _, s in self._obs]))
        return self._fit

    def extra_tokens(self, n_tokens: int, n_outputs: int, bound: float) -> int:
        """The most prompt tokens (one logit row among them) that a
        micro-batch of ``n_tokens`` tokens with ``n_outputs`` logit rows
        can take while its predicted cost stays within ``bound`` times its
        own; at least 1. A prompt's chunk beside other sequences' rows is
        mostly a ubatch of its own (llama.cpp's ``split_equal`` takes equal
        tokens per sequence), so it is charged one more pass over the
        weights (``a``) besides its tokens."""
        fit = self.coefficients()
        if fit is None:
            return max(1, int((bound - 1.0) * n_tokens))
        a, b, c = fit
        own = a + b * n_tokens + c * n_outputs
        return max(1, int(((bound - 1.0) * own - a - c) / b + 1e-9))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float] | None:
    """Least squares ``y ~ x @ (a, b, c)`` with every coefficient >= 0 and
    ``b`` > 0 (non-negative least squares, solved exactly by trying each
    subset of free terms: three terms, seven subsets); None if none fits."""
    best, best_err = None, np.inf
    for keep in ((0, 1, 2), (0, 1), (1, 2), (1,)):
        coef = np.zeros(3)
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        coef[list(keep)] = sol
        if (coef < 0).any() or coef[1] <= 0:
            continue
        err = float(np.sum((x @ coef - y) ** 2))
        if err < best_err:
            best, best_err = (float(coef[0]), float(coef[1]), float(coef[2])), err
    return best


def plan_step(slots: list[Slot], budget: int, depth: int, n_stages: int, cost: StepCost,
              bound: float = ITL_BOUND, defer: Callable[[Slot], bool] | None = None) -> list[tuple[Slot, int, bool]]:
    """Which slots send what in the next micro-batch: (slot, tokens, wants
    the logits of its last token), in slot id order. Pure.

    The generating slots' rows come first: the slots of one group of
    :func:`~ggpipe.decoding.parallel.slots.decode_groups` (fixed ranges of
    slot ids taking turns, one per micro-batch in flight), a group going
    only when none of its slots waits for logits, the one sent least
    recently first; each slot sends its next token and any drafted chain
    below it (every row's logits). Then chunks of the prompts being
    processed, oldest request first, in the tokens the budget leaves; a
    prompt that arrived after a request began generating takes only what
    keeps the micro-batch within ``bound`` times the cost of its generating
    rows (:meth:`StepCost.extra_tokens`; with no generating row in this
    micro-batch, of one group's rows); with several stages, at most the
    first of the pipelined chunks of everything waiting
    (:func:`~ggpipe.pipeline.prefill.prefill_chunks`). A prompt's last
    chunk asks for logits. Slots waiting for logits send nothing, nor
    prompts that ``defer`` holds back (one waiting to borrow a prefix
    another request is computing:
    :func:`~ggpipe.decoding.parallel.prefix_cache.awaits_donor`).

    Args:
        slots: every slot, in slot id order.
        budget: most tokens in the micro-batch (``-b``).
        depth: micro-batches the scheduler keeps in flight (>= 1).
        n_stages: the target pipeline's stages.
        cost: the measured cost of micro-batches.
        bound: the time bound above (a factor >= 1).
        defer: slot -> its prompt waits this time, or None.
    """
    ready = [s for s in slots if s.job is not None and s.todo and not s.waiting]
    gen = [s for s in ready if s.generating]
    prompts = sorted((s for s in ready if not s.generating and not (defer and defer(s))), key=lambda s: s.job.arrival)
    group: list[Slot] = []
    groups = decode_groups(slots, depth, budget) if any(s.generating for s in slots) else []
    if gen:
        ids = {id(s) for s in gen}
        sendable = [[s for s in g if id(s) in ids] for g in groups if not any(s.waiting for s in g)]
        group = min((g for g in sendable if g), key=lambda g: min(s.last_sent for s in g), default=[])
    plan = [(s, len(s.todo), True) for s in group]     # a chain fits: the scheduler drafts at most budget - 1
    used = sum(len(s.todo) for s in group)
    if prompts and used < budget:
        left = budget - used
        if n_stages > 1:   # uniform micro-batches: the first pipelined chunk of all that waits
            left = min(left, prefill_chunks(sum(len(s.todo) for s in prompts), budget, n_stages)[0])
        since = [s.generating_since for s in slots if s.generating and s.generating_since is not None]
        late_left = None
        if since:
            ref = used if group else max(1, round(np.mean([len(g) for g in groups])) if groups else 1)
            late_left = cost.extra_tokens(ref, ref, bound)
        for s in prompts:
            if left <= 0:
                break
            take = left
            if late_left is not None and s.job.arrival >= min(since):
                take = min(take, late_left)
                if take <= 0:
                    break
                late_left -= min(take, len(s.todo))
            n = min(take, len(s.todo))
            plan.append((s, n, n == len(s.todo)))
            left -= n
    return sorted(plan, key=lambda p: p[0].seq)
