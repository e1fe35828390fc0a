"""In-memory model pipelines (no MPI, no model), for the unit tests of the
decoding loop and the proposers, and for the simulator (ggpipe.sim.backend).
Not a mock of llama.cpp's numerics: a toy language model whose logits depend
only on the token sequence, and a KV cache that tracks which token each
sequence holds at each position, so a wrong KV operation of the loop (a
missing copy, a stale cell) shows up as an assertion or as a token that
differs from the reference (the KV cache model: ggpipe.sim.kv_model).

:class:`ToyPipeline` has the verbs of ``ggpipe.pipeline.driver.Pipeline``
and leaves *when* a result is ready to a subclass: :class:`FakePipeline`
counts calls (unit tests), ``ggpipe.sim.backend.SimPipeline`` runs a virtual
clock against measured costs.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ggpipe.logits import TopLogits, top_k
from ggpipe.pipeline.masking import rows_in
from ggpipe.pipeline.prefill import submit_chunks
from ggpipe.runs import Run, RunResult
from ggpipe.sim.kv_model import KvCells, KvStreams


class ToyLM:
    """Logits over ``n_vocab`` tokens from the last two tokens. ``flip``:
    positions where the model prefers another token (a worse "draft").
    ``period``: the preferred token repeats the one ``period`` positions back
    (text that repeats itself, where n-gram drafting shines)."""

    def __init__(self, n_vocab: int = 48, seed: int = 0, flip: float = 0.0, margin: float = 2.0,
                 period: int = 0):
        self.n_vocab = n_vocab
        self.seed = seed
        self.flip = flip
        self.margin = margin
        self.period = period

    def logits(self, context: list[int]) -> np.ndarray:
        """float32 (n_vocab,) logits of the next token: normal noise seeded from
        the last two tokens, the context length and ``seed``, with one preferred
        token raised by ``margin + 2`` (a function of the last two tokens, or the
        token ``period`` positions back; another one with probability ``flip``)."""
        a = context[-1]
        b = context[-2] if len(context) > 1 else 0
        rng = np.random.default_rng((a * 131 + b * 17 + len(context) * 7 + self.seed) % (2**32))
        x = rng.normal(0.0, 1.0, self.n_vocab).astype(np.float32)
        best = (5 * a + 3 * b + 1) % self.n_vocab
        if self.period and len(context) >= self.period:
            best = context[-self.period]
        if self.flip and rng.random() < self.flip:
            best = (best + 1 + len(context)) % self.n_vocab
        x[best] += self.margin + 2.0
        return x

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """The ``n`` tokens greedy (argmax) decoding generates after ``prompt``:
        the reference output of the toy model."""
        ctx = list(prompt)
        out = []
        for _ in range(n):
            t = int(np.argmax(self.logits(ctx)))
            out.append(t)
            ctx.append(t)
        return out


class ToyPipeline:
    """The verbs of :class:`ggpipe.pipeline.driver.Pipeline` over a
    :class:`ToyLM`: logits are computed at submit time from the cells the
    run's sequences hold (KV operations apply in issue order, as on a real
    pipeline). Subclasses decide when a result is ready (:meth:`ready`,
    :meth:`wait`) and whether a cancel came in time (:meth:`_in_time`):
    a run cancelled in time comes back cancelled, without cells (as
    llama.cpp removes an aborted ubatch's cells)."""

    def __init__(self, model: ToyLM, name: str = "target", cell_order: bool = False, streams: bool = False):
        self.model = model
        self.kv_cells = KvStreams() if streams else KvCells()
        self.cell_order = cell_order  # assert every token's cells sit at index = position
        self.n_vocab = model.n_vocab
        self.name = name
        self.reply_k = 0  # as Pipeline.reply_k: k > 0 gives compact rows (ggpipe.logits)
        self.inflight: deque[Run] = deque()
        self._cancelled: set[int] = set()
        self._pruned: dict[int, set[int]] = {}
        self._pending_cells: dict[int, list[tuple[int, int, int]]] = {}
        self.cells: dict[int, dict[int, int]] = {}   # seq -> pos -> token
        self.stats = {"cancelled_before_start": 0, "cancelled_mid_compute": 0, "rows_masked": 0}
        self.n_runs = 0
        self.run_sizes: list[int] = []
        self.n_stages = 1     # as Pipeline.n_stages (pipedec bounds its runs in flight by it)
        self.n_seq_max = 256

    @property
    def n_cells(self) -> int:
        """KV cells of one sequence (its stream's, with ``streams``)."""
        return self.kv_cells.n_cells

    # -- timing (subclasses) -----------------------------------------------------

    def _scheduled(self, run: Run) -> None:
        """``run`` was just appended to ``inflight``."""

    def _in_time(self, run: Run) -> bool:
        """A cancel of ``run`` reached it before its result was complete."""
        raise NotImplementedError

    def _taken(self, run: Run) -> None:
        """``run``'s result was just taken."""

    def ready(self) -> bool:
        """The oldest run's result has arrived (a subclass decides when)."""
        raise NotImplementedError

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """The oldest run's result (a subclass decides how long that takes)."""
        raise NotImplementedError

    # -- issuing ---------------------------------------------------------------

    def submit(self, run: Run) -> None:
        """Start ``run``: its logit rows are computed now from the cells its
        sequences hold (full float32 rows, or compact ones with ``reply_k``) and
        its cells are added; a subclass schedules when the result is ready.

        Raises:
            AssertionError: a wrong KV state: a missing position below a token,
                sequences of one token that disagree, a cell holding another
                token, a full cache, cells out of order (``cell_order``), or
                rows llama.cpp would compute out of batch order (``streams``)."""
        run.reply_k = self.reply_k
        self.inflight.append(run)
        self.n_runs += 1
        self.run_sizes.append(run.n_tokens)
        run.tag = self._evaluate(run)
        self._scheduled(run)

    def decode(self, tokens, start_pos: int, seq: int = 0, logits_last: bool = True,
               logits_all: bool = False) -> None:
        """Start one run of consecutive tokens of sequence ``seq`` from
        ``start_pos`` (:meth:`ggpipe.runs.Run.linear`), with logits of its last
        token, or of every token (``logits_all``)."""
        self.submit(Run.linear(tokens, start_pos, seq=seq, output_last=logits_last, output_all=logits_all))

    def submit_prompt(self, tokens, start_pos: int, n_ubatch: int, seq: int = 0, want_logits: bool = True) -> int:
        """Start ``tokens`` at positions ``start_pos``.. of sequence ``seq`` as
        the runs ``ggpipe.pipeline.prefill.prefill_chunks`` sizes (at most
        ``n_ubatch`` tokens each), the last with its last token's logits when
        ``want_logits``; returns the number of runs."""
        return submit_chunks(self, tokens, start_pos, n_ubatch, seq, want_logits)

    def prefill(self, tokens, start_pos: int, n_ubatch: int, seq: int = 0) -> np.ndarray:
        """:meth:`submit_prompt`, then wait for every run; float32 (n_vocab,)
        logits of the last token."""
        self.submit_prompt(tokens, start_pos, n_ubatch, seq)
        return self.drain()[-1].logits[0]

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove the cells of sequence ``seq`` (-1: every sequence) at positions
        [p0, p1) (-1: open end)."""
        self.kv_cells.rm(seq, p0, p1)
        hi = p1 if p1 >= 0 else 1 << 30
        lo = max(p0, 0)
        for s, cells in self.cells.items():
            if seq in (-1, s):
                for p in [p for p in cells if lo <= p < hi]:
                    del cells[p]

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Add sequence ``dst`` to the cells of ``src`` at positions [p0, p1)
        (-1: open end).

        With a stream per sequence, the whole stream of ``src`` replaces
        that of ``dst`` (llama.cpp's copy of a stream's buffers).

        Raises:
            AssertionError: ``dst`` holds another token at one of those
                positions; with a stream per sequence, a partial range."""
        self.kv_cells.cp(src, dst, p0, p1)
        if self.kv_cells.copies_whole_streams:
            self.cells[dst] = dict(self.cells.get(src, {}))
            return
        hi = p1 if p1 >= 0 else 1 << 30
        lo = max(p0, 0)
        dcells = self.cells.setdefault(dst, {})
        for p, t in self.cells.get(src, {}).items():
            if lo <= p < hi:
                if p in dcells and dcells[p] != t:
                    raise AssertionError(f"seq_cp {src}->{dst}: position {p} already holds another token")
                dcells[p] = t

    def clear(self) -> None:
        """Empty the KV cache."""
        self.cells.clear()
        self.kv_cells.clear()

    def cancel(self, run_id: int) -> None:
        """Cancel run ``run_id``: its result still comes, marked cancelled if the
        cancel came in time (:meth:`_in_time`), without its cells."""
        self._cancelled.add(run_id)

    def prune(self, pairs: list[tuple[int, int]]) -> None:
        """As ``Pipeline.prune``: a run pruned in time (:meth:`_prune_in_time`,
        asked now) comes back without the rows whose every sequence is
        pruned, and without their cells."""
        runs = {r.run_id: r for r in self.inflight}
        for rid, seq in pairs:
            if rid in runs and self._prune_in_time(runs[rid]):
                self._pruned.setdefault(int(rid), set()).add(int(seq))

    def head_idle(self) -> bool:
        """Always True: the head computes nothing outside ``submit``."""
        return True

    def due_in(self) -> float | None:
        """No time estimate (the simulator's pipelines have one)."""
        return None

    # -- the toy model ----------------------------------------------------------

    def _evaluate(self, run: Run):
        """Logit rows of the run, computed now from the cells its sequences
        hold (KV operations issued later must not change them); its own cells
        are added now as well."""
        rows = []
        new: list[tuple[int, int, int]] = []
        ends = np.cumsum(run.n_seq_id)
        run_seqs = [[int(s) for s in run.seq_ids[end - n:end]] for n, end in zip(run.n_seq_id, ends)]
        self.kv_cells.place([int(p) for p in run.pos], run_seqs)
        if self.cell_order:
            for i in range(run.n_tokens):
                self.kv_cells.check_in_order(run.run_id, run_seqs[i], int(run.pos[i]))
        for i, seqs in enumerate(run_seqs):
            tok, pos = int(run.tokens[i]), int(run.pos[i])
            contexts = []
            for s in seqs:
                cells = dict(self.cells.get(s, {}))
                cells.update({p: t for (ss, p, t) in new if ss == s})
                ctx = [cells.get(p) for p in range(pos)]
                if None in ctx:
                    raise AssertionError(f"run {run.run_id}: sequence {s} lacks position {ctx.index(None)} "
                                         f"below position {pos}")
                contexts.append(ctx + [tok])
            if any(c != contexts[0] for c in contexts):
                raise AssertionError(f"run {run.run_id}: sequences {seqs} disagree below position {pos}")
            for s in seqs:
                new.append((s, pos, tok))
            if run.outputs[i]:
                rows.append(self.model.logits(contexts[0]))
        for s, p, t in new:
            cells = self.cells.setdefault(s, {})
            if p in cells and cells[p] != t:
                raise AssertionError(f"run {run.run_id}: sequence {s} already holds another token at {p}")
            cells[p] = t
        self._pending_cells[run.run_id] = new
        if not rows:
            return None
        return top_k(np.stack(rows), run.reply_k) if run.reply_k else np.stack(rows)

    # -- results ----------------------------------------------------------------

    def poll(self) -> RunResult | None:
        """The oldest run's result if :meth:`ready`, else None."""
        return self._take() if self.ready() else None

    def drain(self, timeout_s: float | None = None) -> list[RunResult]:
        """The results of every run in flight, in order."""
        return [self.wait(timeout_s) for _ in range(len(self.inflight))]

    def _take(self) -> RunResult:
        run = self.inflight.popleft()
        new = self._pending_cells.pop(run.run_id)
        cancelled = run.run_id in self._cancelled and self._in_time(run)
        pruned = self._pruned_seqs(run)
        self._cancelled.discard(run.run_id)
        self._taken(run)
        dead = rows_in(run.n_seq_id, run.seq_ids, pruned)
        cancelled = cancelled or bool(dead.all())
        if cancelled:
            self.stats["cancelled_mid_compute"] += 1
            self._drop_cells(new)      # an aborted run leaves no cells
            return self._result(run, None, True)
        if not any(dead):
            return self._result(run, run.tag, False)
        # ``new`` holds each row's cells in batch order, n_seq_id[i] of them
        self._drop_cells([c for c, d in zip(new, np.repeat(dead, run.n_seq_id)) if d])
        self.stats["rows_masked"] += int(dead.sum())
        out_rows = [i for i in range(run.n_tokens) if run.outputs[i]]
        keep = [j for j, i in enumerate(out_rows) if not dead[i]]
        logits = run.tag
        if isinstance(logits, TopLogits):
            logits = TopLogits(logits.ids[keep], logits.values[keep], logits.lse[keep], logits.n_vocab)
        elif logits is not None:
            logits = logits[keep]
        return self._result(run, logits, False, np.array([i for i in out_rows if not dead[i]], dtype=np.int32))

    def _pruned_seqs(self, run: Run) -> set[int]:
        """Sequence ids pruned in time for ``run``, taken now (before :meth:`_taken`)."""
        return self._pruned.pop(run.run_id, set())

    def _prune_in_time(self, run: Run) -> bool:
        """A prune of ``run`` sent now reaches it before it is evaluated
        (here: when a cancel sent now would)."""
        return self._in_time(run)

    def _drop_cells(self, cells) -> None:
        for s, p, t in cells:
            if self.cells.get(s, {}).get(p) == t:
                del self.cells[s][p]

    def _result(self, run: Run, logits, cancelled: bool, rows=None) -> RunResult:
        return RunResult(run, logits, cancelled=cancelled, rows=rows)


class FakePipeline(ToyPipeline):
    """A :class:`ToyPipeline` on a virtual clock that counts calls: a run's
    result is ready ``latency`` calls of ready()/poll() after it was
    submitted; ``wait`` returns it at once. With ``pass_cost`` (seconds per
    pass, seconds per token), each result also carries its run's
    ``started_at`` and ``finished_at`` on a wall clock of passes computed
    back to back (``wall``, seconds), as a real pipeline's do."""

    def __init__(self, model: ToyLM, latency: int = 3, name: str = "target", cell_order: bool = False,
                 streams: bool = False, pass_cost: tuple[float, float] | None = None):
        super().__init__(model, name, cell_order, streams)
        self.latency = latency
        self.clock = 0
        self.pass_cost = pass_cost
        self.wall = 0.0
        self._due: dict[int, int] = {}

    def _result(self, run: Run, logits, cancelled: bool, rows=None) -> RunResult:
        res = super()._result(run, logits, cancelled, rows)
        if self.pass_cost is not None:
            per_pass, per_token = self.pass_cost
            run.started_at = self.wall
            res.finished_at = self.wall = run.started_at + per_pass + per_token * run.n_tokens
        return res

    def _scheduled(self, run: Run) -> None:
        self._due[run.run_id] = self.clock + self.latency

    def _in_time(self, run: Run) -> bool:
        return self.clock < self._due[run.run_id]

    def _taken(self, run: Run) -> None:
        del self._due[run.run_id]

    def ready(self) -> bool:
        """Advance the call-counting clock by one; True when the oldest run has
        been in flight ``latency`` calls."""
        self.clock += 1
        return bool(self.inflight) and self.clock >= self._due[self.inflight[0].run_id]

    def wait(self, timeout_s: float | None = None) -> RunResult:
        """The oldest run's result, at once.

        Raises:
            RuntimeError: no run in flight."""
        if not self.inflight:
            raise RuntimeError("no run in flight")
        return self._take()
