"""Speculation under ``--parallel`` for a request that generates alone
(ggpipe.decoding.parallel.scheduler forms and sends the micro-batches): the chain
drafted below its token, verified in a micro-batch of its own; in ``--mode
pipeinfer``, the look-ahead rows that follow its row through stages that
would idle (PipeInfer's continuation, paper §IV.A); the verification of
both and the cells of what the target refuses; the gate that decides
whether chains pay (ggpipe.speculation.gate), from the target's pass costs
measured here. Beside other generating requests nothing is drafted: a
chain needs a pass of its own, where a plain token rides in its group's
micro-batch almost for free. No MPI.

With a draft model (a drafter with ranks of its own) and look-ahead on,
the request's roots go plainly and the draft's chains travel only in
look-ahead rows, drafted without waiting (PipeInfer's continuous
speculation, §IV.A-B): while the request's row is in flight, the draft
drafts below every token sent so far; when its chain is there and the
request's row still waits, the chain goes as a look-ahead row. The draft's
ranks and the target's work at once, as in ``--mode pipeinfer`` one request
at a time, where a chain the head waits for costs the draft's steps in
full (docs/user-guide/parallel.md measures both against ``--parallel 1``).
"""

from __future__ import annotations

import os
from typing import Callable

from ggpipe.errors import ConfigError
from ggpipe.decoding.parallel.chain_draft import SlotDrafter, as_slot_drafter
from ggpipe.decoding.parallel.slots import SchedulerStats, Slot, _Row
from ggpipe.runs import RunResult
from ggpipe.speculation.adaptive import Calibration
from ggpipe.speculation.gate import DraftGate
from ggpipe.speculation.verify import walk_tree


#: Tokens a look-ahead row that a draft model is still drafting waits for
#: while the pipeline holds runs (the draft's whole chain goes, however
#: short, once it has stopped; to an empty pipeline a row goes at once): a
#: pass of 3 tokens costs a stage little more than one of 1, so fuller rows
#: carry the same tokens in fewer passes (docs/user-guide/parallel.md
#: measures it against rows sent token by token).
AHEAD_MIN_TOKENS = 3

#: The variable that turns pipeinfer's look-ahead rows under ``--parallel`` on or off.
LOOKAHEAD_ENV = "GGPIPE_LOOKAHEAD"


def lookahead_setting(env=None) -> str:
    """``GGPIPE_LOOKAHEAD`` in ``env`` (default: the process's): ``on``,
    ``off`` or ``auto`` (unset or empty: ``auto``).

    Raises:
        ConfigError: another value."""
    v = (os.environ if env is None else env).get(LOOKAHEAD_ENV, "").strip().lower() or "auto"
    if v not in ("on", "off", "auto"):
        raise ConfigError(f"{LOOKAHEAD_ENV}={v!r}: use on, off or auto")
    return v


def lookahead_wanted(target_hosts: list[str], draft_has_ranks: bool = False, env=None) -> bool:
    """Whether ``--mode pipeinfer`` under ``--parallel`` sends look-ahead
    rows for a request that generates alone (:class:`LoneDrafts`):
    ``GGPIPE_LOOKAHEAD`` = ``on``, ``off`` or ``auto`` (the default: on with
    a draft model, whose ranks draft the rows without the head waiting,
    ``draft_has_ranks``; with an instant draft, the n-gram lookup, on where
    the target's stages each have a host of their own, ``target_hosts``:
    the host of each target rank). Where stages share a host, two that
    compute at once slow each other, which an n-gram lookup's rows do not
    repay and a draft model's do (docs/benchmarks/batching.md,
    look-ahead rows; docs/user-guide/parallel.md).

    Raises:
        ConfigError: another value."""
    v = lookahead_setting(env)
    if v != "auto":
        return v == "on"
    return draft_has_ranks or len(set(target_hosts)) == len(target_hosts)


class LoneDrafts:
    """Args:
        target: the target pipeline (``seq_rm`` of refused cells, pipelined
            behind the runs sent).
        draft: a :class:`~ggpipe.decoding.parallel.chain_draft.SlotDrafter` (a plain
            ``draft(context, k) -> tokens`` is an instant lookup), or None.
        draft_max: most drafted tokens per chain.
        lookahead: send look-ahead rows (a ``draft`` with ranks of its own,
            ``has_ranks``: drafted without waiting, and no chain below a
            root).
        n_ctx_slot: KV cells of one slot.
        stats: the scheduler's counters
            (:class:`~ggpipe.decoding.parallel.slots.SchedulerStats`): its
            drafting ones are counted here.
        calibration: what adaptive depth measures
            (:class:`~ggpipe.speculation.adaptive.Calibration`, shared with
            the drafter's cutoff, :meth:`SpecSettings.cutoff
            <ggpipe.decoding.settings.SpecSettings.cutoff>`): the target's
            pass costs and the lone request's decode rate are measured here,
            the draft's acceptance where its chains are verified; None: a
            calibration of its own.

    Attributes:
        gate: whether a chain pays (:class:`~ggpipe.speculation.gate.DraftGate`).
        pass_cost: the target's measured seconds per pass size.
        decode_rate: the lone request's tokens per second, its chains' and
            plain roots' together.
        clock: when the result being handled finished (seconds; the
            scheduler sets it).
    """

    def __init__(self, target, draft: SlotDrafter | Callable[[list[int], int], list[int]] | None, draft_max: int,
                 lookahead: bool, n_ctx_slot: int, stats: SchedulerStats, calibration: Calibration | None = None):
        self.target = target
        self.draft, self.draft_max = as_slot_drafter(draft), draft_max
        self.lookahead = lookahead and self.draft is not None
        # with a draft model: its chains drafted without waiting, carried by the look-ahead rows alone
        self.continuous = self.lookahead and self.draft.has_ranks
        self.n_ctx_slot = n_ctx_slot
        self.stats = stats
        self.gate = DraftGate()
        calibration = calibration or Calibration()
        self.pass_cost, self.decode_rate = calibration.pass_cost, calibration.decode_rate
        self.clock = 0.0
        self._drafting = None    # the request whose last planned root the gate let draft a chain
        self._alone: tuple[object, int, float] | None = None   # (request alone, its tokens, when): its decode rate

    def ahead(self, slot: Slot) -> tuple[_Row, list[int]] | None:
        """A look-ahead row for ``slot``, whose request generates alone and
        whose row waits for logits with nothing else to send: (the row, its
        tokens), or None (a draft with ranks still drafting it, while the
        target holds runs: with fewer than :data:`AHEAD_MIN_TOKENS` tokens
        so far). The drafted guess of the token the target will
        decide once everything in flight is accepted, and the drafted chain
        below it, at the next positions of the slot's stream; it counts only
        if the row before it is accepted whole and the guess is the target's
        token (:meth:`settle`). An instant draft's rows go only while chains
        pay: where the gate let the request's last planned root draft; a
        draft with ranks drafts the row without waiting
        (:meth:`~ggpipe.decoding.parallel.chain_draft.ChainDrafter.take`: None until
        its chain is there). A look-ahead row is speculation
        too, and where stages share a host's cores, two that compute at
        once slow each other (docs/benchmarks/batching.md, look-ahead
        rows)."""
        r = slot.job.request
        if not self.lookahead or self._drafting is not slot.job:   # (set by below() for a request alone)
            return None
        beyond = len(slot.kv) - len(r.context)      # drafted tokens in flight, not yet decided
        room = min(self.draft_max + 1, r.n_predict - len(r.out) - beyond - 1, self.n_ctx_slot - len(slot.kv) - 2)
        if room < 1:
            return None
        guess = self.draft.take(list(slot.kv), room, AHEAD_MIN_TOKENS if self.target.inflight else 1)
        if not guess:
            return None
        row = _Row(slot, slot.job, True, guess[1:], p0=len(slot.kv), guess=guess[0])
        slot.ahead.append(row)
        self.stats.lookahead += 1
        self.stats.drafted += len(guess)
        slot.job.draft_stats.drafted += len(guess)
        return row, guess

    def verify(self, row: _Row, logits: list) -> list[int]:
        """The tokens a row decides: its sampled token, or for a chain the
        drafted tokens the target's decisions agree with and the target's
        token after them (the chain walked as a tree of one branch,
        :func:`~ggpipe.speculation.verify.walk_tree`: greedy, the target's
        argmax; sampled, the target's keyed draw at each position, as
        decoding without a draft draws: lossless, and a seeded request
        decides the tokens it decides alone wherever the rows agree bit for
        bit). The cells of the drafted tokens it refuses are removed by
        :meth:`settle`."""
        chain = row.chain     # node i: the row's token (0) or drafted token i; node i's logits decide node i + 1
        decided, _, _ = walk_tree(lambda i: [i + 1] if i < len(chain) else [], lambda i: chain[i - 1],
                                  logits.__getitem__, 0, row.job.sampler)
        if row.chain:
            matched = len(decided) - 1
            self.draft.observe_verified(row.root + 1, row.chain, matched)
            self.gate.observe(matched, len(row.chain))
            self.stats.draft_accepted += matched
            row.job.draft_stats.record_chain(row.first, len(row.chain), matched)
        return decided

    def settle(self, row: _Row, decided: list[int]) -> bool:
        """After ``row``'s tokens were decided: the slot's next look-ahead row
        becomes its row when ``row`` was accepted whole and the target's
        next token is that row's guess (True); otherwise every look-ahead
        row of the slot is dropped, and the cells after the tokens the
        target took (``row``'s refused drafted tokens, the look-ahead rows')
        are removed (``seq_rm``, pipelined behind the runs sent)."""
        slot = row.slot
        if slot.ahead and len(decided) == len(row.chain) + 1:   # the guess is verified: it follows the row's chain
            at = row.first + len(row.chain)
            kept = slot.ahead[0].guess == decided[-1]
            self.draft.observe_verified(slot.ahead[0].p0, [slot.ahead[0].guess], int(kept))
            row.job.draft_stats.record(at, kept)
            if kept:
                nxt = slot.ahead.pop(0)
                nxt.guess, nxt.first = None, at + 1
                self.stats.lookahead_kept += 1
                self.stats.draft_accepted += 1
                return True
        for a in slot.ahead:
            a.stale = True
        slot.ahead = []
        cut = row.root + len(decided)   # through the row's token and the drafted tokens the target agrees with
        if cut < len(slot.kv):
            self.target.seq_rm(slot.seq, cut, -1)
            del slot.kv[cut:]
        return False

    def below(self, slot: Slot, alone: bool) -> list[int]:
        """Drafted tokens to send below the slot's next token: only for a
        request that generates alone, greedy or sampled (``alone``: no other slot's
        request generates; beside other generating slots a
        chain travels in a micro-batch of its own, a whole pass, where its
        plain token rides in its group's batch almost for free), only while
        a chain pays (:class:`~ggpipe.speculation.gate.DraftGate`: the
        tokens per second of the request's drafted and plain roots as
        measured while it generates alone, and before both are, the accepted
        tokens per chain against the draft's steps and the bigger pass).
        None with a draft with ranks and look-ahead on: its chains go in
        look-ahead rows (:meth:`ahead`), drafted without waiting."""
        r = slot.job.request
        self._rate(slot.job, alone)
        room = 0
        if self.continuous:                 # a draft with ranks, look-ahead on: its chains go in look-ahead rows
            if alone:
                self.gate.forget_root()
                self._drafting = slot.job
                return []
            self.draft.drop()               # beside others: nothing drafted
        if self.draft is not None and alone:
            room = min(self.draft_max, r.n_predict - len(r.out), self.n_ctx_slot - len(slot.kv) - 2)
        if room <= 0:                       # no draft, beside other generating slots, or no room
            self.gate.forget_root()
            self._drafting = None
            return []
        now = self.clock
        self.gate.root(slot.job, now, len(r.out))     # the request's last root, alone: its tokens per second
        chain = []
        attempt = self.gate.pays_at(self.draft.step_s, self.pass_cost)
        if attempt and not self.draft.caught_up(r.context):
            attempt = False                 # the draft is still decoding the context: this root goes plainly
        if attempt:
            chain = self.draft(r.context, room)
        else:
            self.stats.draft_skipped += 1
            self.draft.follow(r.context)    # a draft with ranks follows the request meanwhile, not waited for
        self.gate.rooted(slot.job, now, len(r.out), attempt)
        if attempt and not chain:
            self.gate.observe(0, 0)         # the draft declined (it cost the draft's step; after rooted(): see observe)
        self._drafting = slot.job if attempt else None
        self.stats.drafted += len(chain)
        slot.job.draft_stats.drafted += len(chain)
        return chain

    def _rate(self, job, alone: bool) -> None:
        """The lone request's decode rate (adaptive depth's synchronous
        rule): the tokens it decided since its last planned root, over the
        time since then (the pipeline's clock), while it stays alone."""
        if not alone:
            self._alone = None
            return
        n = len(job.request.out)
        if self._alone is not None and self._alone[0] is job:
            self.decode_rate.observe(n - self._alone[1], self.clock - self._alone[2])
        self._alone = (job, n, self.clock)

    def started(self, prompt: list[int]) -> None:
        """A request starts alone with ``prompt`` (token ids): a draft with
        ranks of its own decodes the prompt now, beside the target's
        prefill, without being waited for
        (:meth:`~ggpipe.decoding.parallel.chain_draft.ChainDrafter.follow`),
        so that its first chains do not wait for that prefill (as
        ``--parallel 1``'s speculative modes start the draft's prefill with
        the target's)."""
        if self.draft is not None and self.draft.has_ranks:
            self.draft.follow(prompt)

    def arrived(self) -> bool:
        """A draft result that a look-ahead row may wait for has arrived
        (the scheduler stops waiting for the target's)."""
        return self.continuous and self.draft.arrived()

    def timed(self, res: RunResult) -> None:
        """The target's pass cost per size, from the service times of
        micro-batches of one sequence with a logit row per token (a slot's
        token, alone or with its chain; not prompt chunks)."""
        run = res.run
        self.pass_cost.finished(run.n_tokens, run.started_at, res.finished_at,
                                counts=bool(res.finished_at and run.started_at and run.n_outputs == run.n_tokens
                                            and len(set(run.seq_ids.tolist())) == 1))

    def finish(self) -> None:
        """Shutdown: the draft's runs that followed a request are waited for."""
        if self.draft is not None:
            self.draft.settle()
