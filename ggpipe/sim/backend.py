"""Simulated model pipelines on a virtual clock: the verbs of
``ggpipe.pipeline.driver.Pipeline`` (submit, poll, wait, cancel, KV
operations), so the real decoding loops (``ggpipe.decoding``) and proposers
run against them unchanged. Logits come from toy language models
(:mod:`ggpipe.sim.toy`, :mod:`ggpipe.sim.lm`); *when* they come is a
discrete-event schedule of the job's stages and links, from measured or
described costs (:mod:`ggpipe.sim.profile`).

The schedule (PipeInfer section IV's pipeline, as ``ggpipe.pipeline``
runs it):

* each stage is one server (its rank's llama.cpp context) that evaluates
  runs in submission order: a run starts on stage i when its activations
  have arrived and the stage has finished the run before it;
* each hop is a FIFO link: a message starts when the previous one on the
  same link has been serialized, occupies it ``bytes / bandwidth`` and
  arrives ``latency`` later (the model of ``ggpipe.transport.link``);
  activations are n x n_embd float32, results n_out logit rows (full, or
  ``reply_k`` compact ones);
* the head's own stage is computed inside ``submit`` (the head is blocked:
  iterative and speculative modes) or on its executor thread (pipeinfer:
  ``async_local``), as ``Pipeline`` does;
* a cancel sent at time c reaches the head's stage at c and the others
  back up the pipeline (last stage first, ``ggpipe.cluster.roles``); a stage
  it reaches before starting the run skips it, one it reaches mid-run
  aborts at that moment (PipeInfer IV.D); later stages then skip it;
* a prune (``Pipeline.prune``: dead rows of a PipeDec layer) travels as a
  cancel does; a stage it reaches before starting the run evaluates (and
  sends on) only the rows not pruned there or upstream
  (ggpipe.pipeline.masking), and the result carries the rows that reached
  the last stage; one that has started computes every row;
* each result the head takes costs it ``overhead_s`` (the loop's own work).

Since a cancel only changes events after it arrives, the schedule of the
runs in flight is recomputed from the stages' state after the last taken
run whenever a run is submitted or cancelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggpipe.errors import RankTimeoutError
from ggpipe.pipeline.masking import rows_in
from ggpipe.runs import Run, RunResult
from ggpipe.pipeline.waiting import Wait
from ggpipe.sim.profile import LinkProfile
from ggpipe.sim.toy import ToyLM, ToyPipeline

HEADER_BYTES = 64          # a transaction's fixed header (ggpipe.transport.messages)
PER_TOKEN_BYTES = 13       # pos, n_seq_id, one seq id, output flag per token


class SimClock:
    """Virtual time (seconds), shared by every simulated pipeline of a job."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class SimStage:
    """One stage: the rank that runs it and its cost, ``cost(n_tokens,
    kv_cells, n_out) -> seconds`` (n_out logit rows on a last stage)."""

    rank: int
    cost: Callable[[int, int, int], float]


@dataclass
class _Entry:
    run: Run
    t_submit: float
    n_out: int
    kv: int
    cancel_at: float = math.inf
    prunes: list[tuple[float, frozenset[int]]] = field(default_factory=list)   # (sent at, pruned sequence ids)


@dataclass
class _Sched:
    due: float                       # the result reaches the head
    cancelled: bool
    spans: list[tuple[float, float, bool]]  # per stage: start, finish, computed (not skipped)
    free: list[float] = field(default_factory=list)   # stage free times after this run
    lfree: dict = field(default_factory=dict)         # link free times after this run
    dropped: frozenset[int] = frozenset()             # sequence ids pruned by the last stage's start


class SimPipeline(ToyPipeline):
    """Args:
        model: the toy language model the logits come from.
        clock: the job's virtual clock.
        stages: the stages in order; ``stages[0].rank == 0`` means the head
            computes the first stage itself (a target pipeline).
        link: (src rank, dst rank) -> LinkProfile.
        n_embd: hidden size (activation bytes per token = 4 n_embd).
        n_vocab_real: the real model's vocabulary (full logit row bytes).
        async_local: the head's stage runs on an executor thread.
        overhead_s: head time per result taken (seconds).
        busy: rank -> seconds computed, accumulated as results are taken.
        name: "target" or "draft".
        trace: rank -> a list that receives that rank's events in the
            format of ``ggpipe.trace`` (``run`` spans per stage, ``skip``,
            ``submit`` and ``recv`` instants; virtual seconds), or None.
        streams: a KV stream per sequence (``--parallel``'s layout), else
            one unified cache.
    """

    def __init__(self, model: ToyLM, clock: SimClock, stages: list[SimStage],
                 link: Callable[[int, int], LinkProfile], n_embd: int, n_vocab_real: int,
                 async_local: bool = False, overhead_s: float = 0.0, busy: dict | None = None,
                 name: str = "target", trace: dict | None = None, streams: bool = False):
        super().__init__(model, name, streams=streams)
        self.clock = clock
        self.stages = stages
        self.link = link
        self.n_embd = n_embd
        self.n_vocab_real = n_vocab_real
        self.head_stage = stages[0].rank == 0
        self.async_local = async_local and self.head_stage
        self.overhead_s = overhead_s
        self.busy = busy if busy is not None else {}
        self.trace = trace
        self.stats["dropped_after_cancel"] = 0
        self.n_passes = 0
        self._entries: dict[int, _Entry] = {}
        self._free = [0.0] * len(stages)
        self._lfree: dict = {}
        self._sched: list[_Sched] | None = None

    # -- the schedule -------------------------------------------------------------

    def _send(self, lfree: dict, src: int, dst: int, t: float, nbytes: int) -> float:
        """Arrival time at ``dst`` of ``nbytes`` handed to the link at ``t``."""
        if src == dst:
            return t
        ln = self.link(src, dst)
        start = max(t, lfree.get((src, dst), 0.0))
        end = start + (nbytes / ln.bandwidth_Bps if ln.bandwidth_Bps > 0 else 0.0)
        lfree[(src, dst)] = end
        return end + ln.latency_s

    def _cancel_arrivals(self, c: float) -> list[float]:
        """When a cancel the head sends at ``c`` reaches each stage."""
        out = [math.inf] * len(self.stages)
        if math.isinf(c):
            return out
        t, prev = c, 0
        for i in range(len(self.stages) - 1, -1, -1):
            r = self.stages[i].rank
            if r == 0:
                out[i] = c
                continue
            t += self.link(prev, r).latency_s
            out[i] = t
            prev = r
        return out

    def _schedule(self) -> list[_Sched]:
        if self._sched is not None:
            return self._sched
        free, lfree = list(self._free), dict(self._lfree)
        out = []
        last = len(self.stages) - 1
        for e in self._entries.values():
            n = e.run.n_tokens
            t = e.t_submit
            if not self.head_stage:
                t = self._send(lfree, 0, self.stages[0].rank, t, HEADER_BYTES + PER_TOKEN_BYTES * n + 4 * n)
            cancels = self._cancel_arrivals(e.cancel_at)
            prunes = [(self._cancel_arrivals(at), seqs) for at, seqs in e.prunes]
            dropped: frozenset[int] = frozenset()
            n_live, n_out = n, e.n_out
            cancelled = False
            spans = []
            for i, st in enumerate(self.stages):
                start = max(t, free[i])
                if prunes and not cancelled:
                    dropped = dropped.union(*[seqs for arrive, seqs in prunes if arrive[i] <= start])
                    live = ~rows_in(e.run.n_seq_id, e.run.seq_ids, dropped)
                    n_live = int(live.sum())
                    n_out = int(np.count_nonzero(live & (e.run.outputs != 0)))
                    if n_live == 0:
                        cancelled = True   # every row pruned: a stage passes the placeholder on
                dur = 0.0 if cancelled else st.cost(n_live, e.kv, n_out if i == last else 0)
                if cancelled or cancels[i] <= start:
                    finish, computed, cancelled = start, False, True
                elif cancels[i] < start + dur:
                    finish, computed, cancelled = cancels[i], True, True
                else:
                    finish, computed = start + dur, True
                free[i] = finish
                spans.append((start, finish, computed))
                if i < last:
                    nbytes = HEADER_BYTES + (0 if cancelled else PER_TOKEN_BYTES * n + 4 * self.n_embd * n_live)
                    t = self._send(lfree, st.rank, self.stages[i + 1].rank, finish, nbytes)
                else:
                    row = 4 * (self.n_vocab_real if e.run.reply_k <= 0 else 2 * e.run.reply_k + 1)
                    nbytes = HEADER_BYTES + (0 if cancelled else n_out * row)
                    t = self._send(lfree, st.rank, 0, finish, nbytes)
            out.append(_Sched(t, cancelled, spans, list(free), dict(lfree), dropped))
        self._sched = out
        return out

    def next_due(self) -> float:
        """When the oldest run's result reaches the head (inf: none in flight)."""
        if not self.inflight:
            return math.inf
        return self._schedule()[0].due

    def due_in(self) -> float | None:
        """Simulated seconds until the oldest run's result reaches the head (None: none in flight)."""
        t = self.next_due()
        return None if math.isinf(t) else t - self.clock.now

    # -- ToyPipeline's timing hooks -------------------------------------------------

    def _event(self, rank: int, **ev) -> None:
        if self.trace is not None:
            self.trace.setdefault(rank, []).append(ev)

    def _scheduled(self, run: Run) -> None:
        run.started_at = self.clock.now
        self._event(0, ph="i", name="submit", ts=self.clock.now, dur=0.0, lane="head", run=run.run_id,
                    n=run.n_tokens, spec=bool(run.speculative), pipeline=self.name)
        kv = int(run.pos.max()) + 1 if run.n_tokens else 0
        self._entries[run.run_id] = _Entry(run, self.clock.now, int(run.outputs.sum()), kv)
        self._sched = None
        if self.head_stage and not self.async_local:
            # the head computes its own stage inside submit()
            mine = self._schedule()[len(self._entries) - 1]
            self.clock.now = max(self.clock.now, mine.spans[0][1])

    def cancel(self, run_id: int) -> None:
        """Cancel run ``run_id`` at the current virtual time: the cancel travels
        up the pipeline from now (see the module docstring) and the schedule is
        recomputed."""
        e = self._entries.get(run_id)
        if e is not None and math.isinf(e.cancel_at):
            e.cancel_at = self.clock.now
            self._sched = None
        super().cancel(run_id)

    def prune(self, pairs: list[tuple[int, int]]) -> None:
        """As ``Pipeline.prune``: the pairs travel back up the pipeline from
        now (see the module docstring)."""
        by_run: dict[int, set[int]] = {}
        for rid, seq in pairs:
            if rid in self._entries:
                by_run.setdefault(int(rid), set()).add(int(seq))
        for rid, seqs in by_run.items():
            self._entries[rid].prunes.append((self.clock.now, frozenset(seqs)))
        if by_run:
            self._sched = None

    def _in_time(self, run: Run) -> bool:
        return self._schedule()[0].cancelled

    def _pruned_seqs(self, run: Run) -> set[int]:
        return set(self._schedule()[0].dropped)

    def _taken(self, run: Run) -> None:
        s = self._schedule()[0]
        e = self._entries.pop(run.run_id)
        self._free, self._lfree = s.free, s.lfree
        self._sched = None
        for i, (st, (a, b, computed)) in enumerate(zip(self.stages, s.spans)):
            if computed:
                self.busy[st.rank] = self.busy.get(st.rank, 0.0) + (b - a)
                aborted = s.cancelled and (i + 1 == len(s.spans) or not s.spans[i + 1][2])
                self._event(st.rank, ph="X", name="run", ts=a, dur=b - a, lane=f"{self.name} stage", run=run.run_id,
                            n=run.n_tokens, spec=bool(run.speculative), pipeline=self.name,
                            **({"cancelled": True} if aborted else {}))
            else:
                self._event(st.rank, ph="i", name="skip", ts=a, dur=0.0, lane=f"{self.name} stage",
                            run=run.run_id, pipeline=self.name)
        self._event(0, ph="i", name="recv", ts=s.due, dur=0.0, lane="head", run=run.run_id, pipeline=self.name)
        if s.cancelled and not s.spans[0][2] and self.head_stage:
            self.stats["cancelled_before_start"] += 1
        if not math.isinf(e.cancel_at) and not s.cancelled:
            self.stats["dropped_after_cancel"] += 1
        if not s.cancelled:
            self.n_passes += 1
        self.clock.now = max(self.clock.now, s.due) + self.overhead_s
        self._last_due = s.due

    def _result(self, run: Run, logits, cancelled: bool, rows=None) -> RunResult:
        return RunResult(run, logits, cancelled=cancelled, finished_at=self._last_due, rows=rows)

    def ready(self) -> bool:
        """The oldest run's result has reached the head by the current virtual time."""
        return bool(self.inflight) and self.clock.now >= self.next_due()

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """The oldest run's result, the clock moved on to when it is due.

        Raises:
            RuntimeError: no run in flight."""
        if not self.inflight:
            raise RuntimeError(f"{self.name}: no run in flight")
        self.clock.now = max(self.clock.now, self.next_due())
        return self._take()

    def head_idle(self) -> bool:
        """The head's own stage has nothing left to compute at the current
        virtual time (always True when it computes inside ``submit``)."""
        if not self.async_local:
            return True
        return all(s.spans[0][1] <= self.clock.now for s in self._schedule())


def idle_until_next(clock: SimClock, pipes: list[SimPipeline]) -> Wait:
    """The decoding loop's wait for "any result" (``idle(ready, timeout_s)``,
    as :class:`ggpipe.pipeline.waiting.EventWait`): move the clock to the
    earliest result in flight; where ``ready()`` is false and a result is
    already due (one the loop takes later: a draft run that followed a
    request while the loop waits for the target's), to the earliest result
    due after now, as a real wait goes on until ``ready()``.

    Raises (from the returned function):
        RankTimeoutError: nothing is in flight (the loop would wait forever)."""
    def idle(ready: Callable[[], bool], timeout_s: float) -> None:
        dues = [p.next_due() for p in pipes]
        t = min(dues)
        if math.isinf(t):
            raise RankTimeoutError("simulation: the decoding loop waits for a result but no run is in flight")
        if t <= clock.now and not ready():
            t = min((d for d in dues if d > clock.now), default=t)
        clock.now = max(clock.now, t)
    return idle
