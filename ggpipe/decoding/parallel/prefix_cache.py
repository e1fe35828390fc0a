"""The slots' prompt cache: which free slot a request takes, the prefix
it borrows from another slot's stream before its first chunk goes, and
whether it waits for another request's prompt to fill that prefix first
(llama-server's prompt cache per slot; vLLM's prefix caching across
requests, which shares a prefix still being computed once it is). Pure bookkeeping over :class:`~ggpipe.decoding.parallel.slots.Slot`
plus the target's ``seq_cp`` / ``seq_rm``, pipelined behind the runs sent.
No MPI; ggpipe.decoding.parallel.scheduler calls it.
"""

from __future__ import annotations

from ggpipe.decoding.parallel.slots import SchedulerStats, Slot
from ggpipe.kv_reuse import reusable_prefix

#: The fewest tokens worth a stream copy: copying a slot's stream moves
#: ``n_ctx_slot`` cells of K and V per layer, far less than computing a
#: token, but not nothing.
BORROW_MIN_TOKENS = 8


def pick_slot(free: list[Slot], tokens: list[int], partial: bool) -> tuple[int, Slot]:
    """The free slot whose cached tokens share the longest prefix with
    ``tokens`` (the lowest id on a tie), and that prefix's length (tokens
    whose cells it keeps; ``partial`` False: only where ``tokens`` go on
    after all of them, :func:`~ggpipe.kv_reuse.reusable_prefix`)."""
    keep, _, slot = max((reusable_prefix(s.kv, tokens, partial=partial), -s.seq, s) for s in free)
    return keep, slot


def borrow_prefix(target, slots: list[Slot], slot: Slot, stats: SchedulerStats) -> bool:
    """Before the first chunk of ``slot``'s prompt goes: when another
    slot's tokens (sent or held: ``Slot.kv``) share a longer prefix with
    the prompt than ``slot``'s own cells, by :data:`BORROW_MIN_TOKENS` or
    more, copy that slot's whole stream into ``slot``'s
    (``target.seq_cp``), remove the copied cells after the common prefix
    (``seq_rm``), and leave only the rest of the prompt to decode
    (``slot.todo``). Both operations go in order behind the micro-batches
    already sent, so every stage copies the other slot's cells as they are
    once those are computed. The cells are those the same tokens at the
    same positions left, at the same indices (position order), as a slot's
    own prompt cache. Counts the tokens in ``stats`` and the job's
    ``n_reused``. Returns whether it copied. Only for a model whose cells
    can be cut at a position (the scheduler's ``partial_reuse``; a
    recurrent state is kept or dropped whole): the caller checks."""
    job = slot.job
    if job.request.out or len(slot.kv) != job.n_reused:
        return False     # not a prompt whose first chunk is still to go
    best, src = len(slot.kv), None
    for other in slots:
        if other is not slot:
            k = reusable_prefix(other.kv, job.tokens)
            if k > best:
                best, src = k, other
    if src is None or best - len(slot.kv) < BORROW_MIN_TOKENS:
        return False
    target.seq_cp(src.seq, slot.seq, -1, -1)
    target.seq_rm(slot.seq, best, -1)
    slot.kv = src.kv[:best]
    slot.todo = list(job.tokens[best:])
    stats.reused_tokens += best - job.n_reused
    stats.borrowed_tokens += best - job.n_reused
    job.n_reused = best
    return True


def awaits_donor(slots: list[Slot], slot: Slot) -> bool:
    """Before the first chunk of ``slot``'s prompt goes: whether a request
    that arrived earlier, whose prompt is still being sent, shares a longer
    prefix with this prompt than any slot's cells hold now, by
    :data:`BORROW_MIN_TOKENS` or more. Then this prompt waits until that
    prefix has been sent and borrows it (:func:`borrow_prefix`) instead of
    computing it a second time: a burst of requests behind one system
    prompt computes it once. The earliest such request never waits, so
    every prompt goes in the end. Pure."""
    job = slot.job
    if job is None or job.request is None or job.request.out or len(slot.kv) != job.n_reused:
        return False
    have = max([len(slot.kv)] + [reusable_prefix(o.kv, job.tokens) for o in slots if o is not slot])
    for other in slots:
        o = other.job
        if other is slot or o is None or o.request is None or o.request.out or not other.todo \
                or o.arrival > job.arrival:
            continue
        k = reusable_prefix(o.tokens, job.tokens)
        if k - have >= BORROW_MIN_TOKENS and len(other.kv) < k:
            return True
    return False
