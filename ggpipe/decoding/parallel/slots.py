"""The scheduler's pure parts: its counters (:class:`SchedulerStats`), a
slot (:class:`Slot`: a KV sequence and the request that holds it, in one of
the states of :class:`~ggpipe.decoding.loop.SlotState`), the groups of
generating slots that take turns (:func:`decode_groups`) and a micro-batch's
run from its rows (:func:`pack_micro_batch`); what one micro-batch carries
is ggpipe.decoding.parallel.budget's. No pipeline, no MPI;
ggpipe.decoding.parallel.scheduler drives them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggpipe.decoding.loop import Job, SlotState, slot_view
from ggpipe.runs import Run, next_run_id


@dataclass
class SchedulerStats:
    """The scheduler's counters since it started (cumulative).

    Attributes:
        micro_batches: micro-batches sent.
        rows: tokens in them.
        decode_tokens: of them, generating requests' next tokens.
        prompt_tokens: of them, prompt tokens (chunks of prompts being
            processed); the others are drafted (``drafted``).
        generated: tokens the requests accepted.
        finished: requests ended.
        reused_tokens: prompt tokens whose cells a slot held or borrowed
            (not decoded).
        borrowed_tokens: of them, copied from another slot's stream.
        drafted: drafted tokens sent (chains and look-ahead rows).
        draft_accepted: of them, the target's.
        draft_skipped: roots of a request alone sent without a chain (the
            gate said a chain would not pay).
        lookahead: look-ahead rows sent.
        lookahead_kept: of them, built on what the target then decided.
    """

    micro_batches: int = 0
    rows: int = 0
    decode_tokens: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    finished: int = 0
    reused_tokens: int = 0
    borrowed_tokens: int = 0
    drafted: int = 0
    draft_accepted: int = 0
    draft_skipped: int = 0
    lookahead: int = 0
    lookahead_kept: int = 0

    def add_micro_batch(self, rows: list[tuple["_Row", list[int]]]) -> tuple[int, int, int]:
        """Count a micro-batch of ``rows`` (each a row and the tokens it
        sends); returns its (decode, draft, prompt) tokens."""
        decode = draft = prompt = 0
        for row, chunk in rows:
            if not row.job.request.out:
                prompt += len(chunk)
            elif row.guess is not None:     # a look-ahead row: a guessed token and the chain below it
                draft += len(chunk)
            else:
                decode += 1
                draft += len(chunk) - 1
        self.micro_batches += 1
        self.rows += decode + draft + prompt
        self.decode_tokens += decode
        self.prompt_tokens += prompt
        return decode, draft, prompt

    def step_tokens(self) -> dict:
        """Micro-batches sent and their tokens by kind (decode, draft, prompt)."""
        return {"micro_batches": self.micro_batches, "decode": self.decode_tokens, "draft": self.drafted,
                "prompt": self.prompt_tokens}


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
        last_sent: the scheduler's count of micro-batches when the last one
            holding a row of this slot was formed (-1: none yet).
        ahead: look-ahead rows in flight behind the slot's row that waits
            for logits, oldest first (each built on the one before it being
            accepted whole; ggpipe.decoding.parallel.lone_drafts ``LoneDrafts.ahead``).
        generating_since: requests submitted to the scheduler when its
            request sampled its first token (a prompt submitted later
            arrived while this one was generating), or None.
    """

    seq: int
    kv: list[int] = field(default_factory=list)
    job: Job | None = None
    todo: list[int] = field(default_factory=list)
    waiting: bool = False
    in_flight: int = 0
    last_sent: int = -1
    ahead: list["_Row"] = field(default_factory=list)
    generating_since: int | None = None

    @property
    def generating(self) -> bool:
        """A request past its prompt holds the slot (it has sampled a token)."""
        return self.job is not None and self.job.request is not None and bool(self.job.request.out)

    @property
    def free(self) -> bool:
        """No request, and nothing of an earlier one in flight."""
        return self.job is None and self.in_flight == 0

    @property
    def state(self) -> SlotState:
        """The slot's :class:`SlotState`."""
        job = self.job
        if job is None:
            return SlotState.IDLE if self.in_flight == 0 else SlotState.DONE
        r = job.request
        if r is not None and r.done:
            return SlotState.DONE
        return SlotState.GENERATING if r is not None and r.out else SlotState.PROMPT


@dataclass
class _Row:
    slot: Slot
    job: Job
    logits: bool   # this row asked for logits
    chain: list[int] = field(default_factory=list)   # drafted tokens after the row's token (a logit row each)
    p0: int = 0    # the position of the row's first token in the slot's stream
    n: int = 0     # the tokens it sent (set when its micro-batch goes): a prompt chunk, or a token and its chain
    guess: int | None = None   # a look-ahead row: its first token, a guess of the target's next token
    first: int = 0             # the position of its chain's first drafted token after the request's last root
    stale: bool = False        # a look-ahead row whose guess or base was refused: its logits are dropped

    @property
    def root(self) -> int:
        """The position of its last token before the chain (whose logits decide the next token)."""
        return self.p0 + self.n - 1 - len(self.chain)


def decode_groups(slots: list[Slot], depth: int, max_size: int | None = None) -> list[list[Slot]]:
    """The generating slots (a request past its prompt) in the groups that
    take turns through the pipeline, each in slot order. Pure.

    Each stage evaluates a micro-batch of one token per sequence as one
    ubatch only when its sequence ids are consecutive (a non-unified KV
    cache: ``llama_batch_allocr::split_equal`` takes a run of ids
    ``s, s+1, ...`` per ubatch, and every ubatch streams the stage's weights
    once more). So the groups are fixed ranges of slot ids: slot ``i`` of
    ``n`` is in range ``i * depth // n``, which a slot keeps while its
    request runs (its row waits for the rest of its range and then goes with
    it, so the ranges stay whole). Ranges with no generating slot leave
    fewer than ``depth`` groups; then the largest group is cut in two
    (halves in slot order) until there are ``depth`` groups, or each holds
    one slot, so ``depth`` micro-batches stay in flight whenever enough
    requests generate.

    Args:
        slots: every slot, in slot id order.
        depth: micro-batches the scheduler keeps in flight (>= 1).
        max_size: most slots in a group (a micro-batch's tokens,
            ``n_ubatch``); a larger range goes as several groups.
    """
    n = len(slots)
    ranges: list[list[Slot]] = [[] for _ in range(depth)]
    for i, s in enumerate(slots):
        if s.generating:
            ranges[i * depth // n].append(s)
    groups = []
    for g in ranges:   # a range of more than max_size slots goes as consecutive parts of at most max_size
        parts = -(-len(g) // max_size) if max_size else 1
        groups += [g[len(g) * k // parts:len(g) * (k + 1) // parts] for k in range(parts) if g]
    while groups and len(groups) < depth:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups[i]
        if len(g) < 2:
            break
        groups[i:i + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def pack_micro_batch(rows: list[tuple[_Row, list[int]]], stats: SchedulerStats) -> tuple[Run, list[int]]:
    """The run of one micro-batch of ``rows`` (each a row and the tokens it
    sends): each row's tokens at the next positions of its slot's stream
    (sequence id = slot id), a logit row for every token of a row with a
    chain, else for its last token when it asks. The slots advance as the
    rows go (their streams' tokens, runs in flight, the micro-batch they
    last sent in, waiting for logits; a prompt's micro-batches in its job's
    ``prompt_steps``), and ``stats`` counts the micro-batch. Returns the run
    and the reply size each logit row's sampler asks
    (:meth:`~ggpipe.sampling_params.SamplingParams.reply_k`, 0: whole rows)."""
    tokens, pos, seqs, outputs, reply = [], [], [], [], []
    mix = stats.add_micro_batch(rows)
    for row, chunk in rows:
        slot, n = row.slot, len(chunk)
        row.n = n
        tokens += chunk
        pos += range(row.p0, row.p0 + n)
        seqs += [slot.seq] * n
        outputs += [int(bool(row.chain))] * (n - 1) + [int(row.logits)]
        slot.kv += chunk
        slot.in_flight += 1
        slot.last_sent = stats.micro_batches
        slot.waiting = slot.waiting or row.logits
        if row.logits:
            reply.append(slot.job.sampler.params.reply_k())
        if not slot.generating:
            slot.job.prompt_steps.add(*mix)
        elif row.logits:
            slot.job.target_passes += 1
    n = len(tokens)
    run = Run(run_id=next_run_id(), tokens=np.asarray(tokens, np.int32), pos=np.asarray(pos, np.int32),
              n_seq_id=np.ones(n, np.int32), seq_ids=np.asarray(seqs, np.int32), outputs=np.asarray(outputs, np.int8))
    return run, reply


def slots_view(slots: list[Slot], n_ctx_slot: int) -> list[dict]:
    """One dict per slot (:func:`~ggpipe.decoding.loop.slot_view`; ``/slots``)."""
    return [slot_view(s.seq, n_ctx_slot, s.job, s.state,
                      len(s.job.request.out) if s.job is not None and s.job.request is not None else 0,
                      len(s.kv), s.job.draft_stats if s.job is not None else None) for s in list(slots)]
