"""The draft-model proposer: grows speculation micro-batches (trees) with the
draft pipeline, one draft decode per level (PipeInfer IV.B; tree shape as in
llama.cpp's speculative example that PipeInfer builds on).

Shape of a tree, level by level below its anchor:

* the draft's most likely token (greedy) or a token sampled from the draft's
  sampling distribution q (stochastic) extends the main chain, if the
  draft's confidence max(q) reaches the cutoff;
* greedy only: other candidates with q >= ``p_split`` become leaf siblings
  (up to ``width`` leaves in all). Stochastic trees stay chains, so every
  child is an unconditioned draw from q, as multi-step speculative sampling
  requires;
* at most ``max_nodes`` nodes.

The proposer keeps the draft's KV cache (sequence 0 of the draft context) in
step with the tokens it has decoded (``cursor``) and only re-decodes what
changed, so a micro-batch that continues the previous one costs one draft
decode per level.

It implements :class:`~ggpipe.speculation.proposers.base.Proposer` and
both capabilities, ``Cuttable`` and ``Draining`` (``--spec-type draft``):
``begin`` submits a draft run; each draft result that :meth:`poll` takes
submits the next draft decode, until the tree is finished (possibly empty:
the draft was not confident enough). ``cut()``
hands over the tree drafted so far while a draft decode of its tip is in
flight, and keeps drafting a new micro-batch below that tip (continuous
speculation, PipeInfer IV.B.1). The draft model's pipeline is reached only
through :class:`~ggpipe.backend.DecodeBackend`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.keyed_noise import gumbel_pick
from ggpipe.logits import best
from ggpipe.sampling import target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.backend import DecodeBackend, DraftResult
from ggpipe.speculation.proposers.base import ProposerBase, ProposerConfig, sync_kv
from ggpipe.speculation.tree import SpecTree


PER_REQUEST = ("draft_decodes", "guesses_made", "guesses_accepted", "guesses_held", "looks_skipped")


class DraftModelProposer(ProposerBase):
    """Args:
        cfg: ``backend`` (the draft model's pipeline, head-driven), ``p_split``
            (probability above which a runner-up becomes a sibling leaf),
            ``width`` (most leaves per tree) and ``n_ubatch`` (largest draft
            decode; catch-up decodes are chunked) are read.

    Raises:
        ValueError: ``cfg.backend`` is None (the job has no draft model).
    """

    name = "draft"
    summary = "the draft model, -md"
    aliases = ("draft-simple",)           # llama.cpp's name
    needs_draft_model = True
    p_accept_auto_in = ("speculative",)   # auto 6% faster there, 3% slower in pipeinfer (docs/user-guide/speculative.md)
    instant = False

    def __init__(self, cfg: ProposerConfig):
        if cfg.backend is None:
            raise ValueError("--spec-type draft needs a draft model: give one with -md (e.g. -md smollm2-135m)")
        self.pipe: DecodeBackend = cfg.backend
        self.params = SamplingParams()
        self.key = 0                     # the request's sampler key (keyed noise, ggpipe.keyed_noise)
        self.first_pos = 0               # the position of the request's first generated token
        self.p_split = cfg.p_split
        self.timeout_s = cfg.timeout_s
        self.width = cfg.width
        self.n_ubatch = cfg.n_ubatch
        self.cursor: list[int] = []      # tokens in the draft's KV, positions 0..len-1 (kept across requests)
        self.active = False
        self.tree: SpecTree | None = None
        self._parent = -1
        self._cutoff = 1.0
        self._first_cutoff = 1.0
        self._look_cutoff = 0.0
        self._max_nodes = 0
        self._pending_runs = 0
        self._cached: np.ndarray | None = None
        self._last_logits: tuple[int, np.ndarray] | None = None  # (cursor length, logits of its last token)
        self._guesses: list[int] = []    # guessed tokens decoded after the tip in the run in flight
        self.stats = {"draft_decodes": 0}
        self.acceptance: Callable[[float], float] | None = None
        self._path = 1.0
        self.step_s: float | None = None  # EWMA of a one-token draft decode's round trip (seconds)

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None = None, *, first_pos: int = 0) -> None:
        """A new request: its sampling parameters and its sampler's key
        (stochastic drafts are drawn with the target's keyed noise). With
        ``acceptance`` (draft probability -> estimated acceptance), drafting
        goes on while the product of estimated acceptance along the path
        since :meth:`begin` stays at or above the cutoff; without it, while
        each token's draft probability does (PipeInfer's fixed cutoff)."""
        self.params = params
        self.key, self.first_pos = key, first_pos
        self.acceptance = acceptance
        self.active = False
        self.tree = None
        for k in PER_REQUEST:   # counters count this request's work (--json, serve's per-request stats)
            if k in self.stats:
                self.stats[k] = 0
        # greedy drafting reads the best width+1 tokens of a row, top-k sampling the
        # top k: the draft's last stage sends those instead of the whole row (ggpipe.logits)
        reply_k = params.reply_k(self.width)
        if reply_k != self.pipe.reply_k:
            self._last_logits = None  # the cached anchor row may be of the other form
        self.pipe.reply_k = reply_k

    def reset(self) -> None:
        """The draft's KV cache was cleared."""
        self.cursor.clear()
        self._last_logits = None
        self._guesses = []
        self.active = False

    # -- the draft's KV cache --------------------------------------------------

    def prefill(self, tokens: list[int]) -> None:
        """Start the draft's KV with ``tokens`` (runs submitted, not waited for)."""
        self._sync(list(tokens), want_logits=False)

    def _sync(self, context: list[int], want_logits: bool) -> int:
        """Make the draft's KV hold ``context`` (all of it when logits of its
        last token are wanted: that token is (re)decoded). Returns the number
        of draft runs submitted."""
        n, cut = sync_kv(self.pipe, self.cursor, context, self.n_ubatch, want_logits)
        if cut:
            self._last_logits = None  # they were for a prefix that no longer exists
        self.stats["draft_decodes"] += n
        return n

    # -- growing a tree --------------------------------------------------------

    def begin(self, context: list[int], cutoff: float, max_nodes: int,
              first_cutoff: float | None = None, look_cutoff: float = 0.0) -> None:
        """Start a micro-batch below the last token of ``context`` (every token
        up to and including the anchor; the anchor is at position
        len(context) - 1). ``first_cutoff`` (default ``cutoff``) applies to
        the first token below the anchor. With a calibration, the chain's tip
        is decoded for the next token only while the path probability is at
        least ``look_cutoff`` (adaptive depth's look-ahead rule)."""
        if self.active:
            raise RuntimeError("a micro-batch is already being drafted")
        self.tree = SpecTree(anchor_pos=len(context) - 1)
        self._parent = -1
        self._path = 1.0
        self._cutoff = cutoff
        self._first_cutoff = cutoff if first_cutoff is None else first_cutoff
        self._look_cutoff = look_cutoff
        self._max_nodes = max_nodes
        self.active = True
        self._cached = None
        if (self._last_logits is not None and self._last_logits[0] == len(context)
                and self.cursor == list(context)):
            self._cached = self._last_logits[1]   # logits of the anchor already known
            self._pending_runs = 0
        else:
            self._pending_runs = self._sync(list(context), want_logits=True)

    def ready(self) -> bool:
        """:meth:`poll` would make progress now: the anchor's logits were
        cached, or a draft result has arrived."""
        return self.active and (self._cached is not None or self.pipe.ready())

    def poll(self) -> SpecTree | None:
        """Take one draft result if there is one (never blocks); returns the
        finished tree, or None (drafting goes on, or nothing arrived)."""
        if not self.active:
            return None
        if self._cached is not None:
            return self.step(None)
        res = self.pipe.poll()
        return None if res is None else self.step(res)

    def due_in(self) -> float | None:
        """Seconds until the draft decode in flight returns its token (the
        backend's estimate), or None (nothing being drafted, or no estimate)."""
        if not self.active or self._cached is not None or not self.pipe.inflight:
            return None
        return self.pipe.due_in()

    def salvage(self, decided: list[int]) -> tuple[SpecTree, int] | None:
        """The target decided ``decided`` below the anchor of the tree being
        drafted. If they lead into it and its tip is still below them: the
        subtree below them and the tip's index in it (-1: the subtree's
        anchor). Changes nothing; :meth:`cut` then hands the tree over."""
        if not self.can_cut():
            return None
        sub, mp = self.tree.reanchor(decided)
        if sub is None or self._parent not in mp:
            return None
        return sub, mp[self._parent]

    def partial(self) -> SpecTree | None:
        """The tree being drafted, as far as it has grown (read only), or None."""
        return self.tree if self.active else None

    def observe(self, context: list[int]) -> None:
        """Tokens decided so far: not needed here (the loop calibrates the draft)."""

    def abandon(self) -> None:
        """Drop the micro-batch being drafted (its in-flight results are
        consumed later by :meth:`drain_one` / :meth:`settle`)."""
        self.active = False

    def busy(self) -> bool:
        """Draft runs are in flight."""
        return bool(self.pipe.inflight)

    def drain_one(self, timeout_s: float) -> None:
        """Wait (bounded) for the oldest in-flight draft run and consume it."""
        res = self.pipe.wait(timeout_s)
        if not self.active:
            # the result of an abandoned run: its guesses stay in the KV and cursor, and tell nothing
            self.guessed(len(self._guesses), 0, None)
            self._guesses = []
        elif self.step(res) is not None:
            self.active = False

    def drain_ready(self) -> None:
        """Consume the results of abandoned drafting that have already
        arrived (never blocks; nothing while a micro-batch is drafted)."""
        while not self.active and self.pipe.inflight and self.pipe.ready():
            self.drain_one(self.timeout_s)   # returns at once: the result is there (a 0 s bound would expire first)

    def settle(self, timeout_s: float) -> None:
        """Consume every in-flight draft run; the micro-batch, if any, is dropped."""
        while self.pipe.inflight:
            self.drain_one(timeout_s)
        self.active = False

    def can_cut(self) -> bool:
        """A tree with nodes is being extended by an in-flight draft decode."""
        return self.active and self.tree is not None and len(self.tree) > 0 and self._pending_runs > 0

    def cut(self, cutoff: float, room: Callable[[int], int]) -> tuple[SpecTree, int]:
        """Hand over the tree drafted so far and its chain tip's index; keep
        drafting a new tree below the tip (whose draft decode is in flight),
        of at most ``room(tip position)`` nodes. The path probability goes on
        from the tip (it is not reset).

        Raises:
            RuntimeError: nothing to cut (see :meth:`can_cut`)."""
        if not self.can_cut():
            raise RuntimeError("nothing to cut")
        tree, tip = self.tree, self._parent
        self.tree = SpecTree(anchor_pos=tree.pos(tip))
        self._parent = -1
        self._cutoff = self._first_cutoff = cutoff  # the new tree goes on below a drafted tip
        self._look_cutoff = 0.0
        self._max_nodes = room(self.tree.anchor_pos)
        return tree, tip

    def step(self, result: DraftResult | None) -> SpecTree | None:
        """Consume one draft result (None: use the cached anchor logits);
        returns the finished tree, or None after submitting the next draft
        decode.

        A result may carry several rows: the run decoded the chain's tip and
        guesses of the tokens below it (:meth:`guesses`, Staged SD's
        draft-of-draft). Row j holds the logits after the run's j-th token;
        while the token drafted from row j is the next guess, row j + 1
        already holds the logits below it, so one draft round trip yields
        several levels. The cells of guesses that were not drafted are
        removed from the draft's KV."""
        if result is None:
            rows, self._cached = [self._cached], None
        else:
            self._pending_runs -= 1
            if self._pending_runs > 0:  # a chunk of a long catch-up
                return None
            rows = result.logits
            self._observe_step(result)
        guesses, self._guesses = self._guesses, []
        base = len(self.cursor) - 1 - len(guesses)   # position of the row 0 token
        for j in range(len(guesses) + 1):
            logits = rows[j]
            guess = guesses[j] if j < len(guesses) else None
            tok = self._draft_one(logits)
            if tok is None or tok != guess:
                break
            self.stats["guesses_accepted"] = self.stats.get("guesses_accepted", 0) + 1
        self.guessed(len(guesses), j, tok)
        keep = base + j + 1        # the cursor up to the token whose logits row j holds
        if keep < len(self.cursor):
            self.pipe.seq_rm(0, keep, -1)
            del self.cursor[keep:]
        self._last_logits = (len(self.cursor), logits)
        if tok is None or len(self.tree) >= self._max_nodes:
            return self._finish()
        if self.acceptance is not None and self._path < self._look_cutoff:
            self.stats["looks_skipped"] = self.stats.get("looks_skipped", 0) + 1
            return self._finish()   # the next token is not worth a draft step: tok is the tip, not decoded
        pos = self.tree.pos(self._parent)
        if pos != len(self.cursor):
            raise RuntimeError("draft KV out of step")
        # the guesses stand for the levels below tok; the deepest level a tree may reach is never decoded
        self._guesses = self.guesses(self.cursor + [tok], max(0, self._max_nodes - len(self.tree) - 1))
        batch = [tok] + self._guesses
        self.pipe.decode(batch, pos, logits_all=True)
        self.cursor.extend(batch)
        self._last_logits = None
        self.stats["draft_decodes"] += 1
        self._pending_runs = 1
        return None

    def guesses(self, context: list[int], room: int) -> list[int]:
        """Tokens to decode, after the chain's new tip ``context[-1]``, in the
        same draft run as it (at most ``room``): none here; Staged SD's
        draft-of-draft (``--spec-type staged``) guesses them by n-gram lookup."""
        return []

    def guessed(self, sent: int, taken: int, drafted: int | None) -> None:
        """After a draft result: ``sent`` guesses were decoded after the tip,
        the first ``taken`` of them were drafted, and ``drafted`` is the token
        drafted from the row after the last one taken (None: the tree ended
        there). No-op here; the draft-of-draft learns its guesses' accuracy."""

    def _draft_one(self, logits) -> int | None:
        """Draft one level from one row of logits: add the node (and, greedy,
        its sibling leaves) below the chain's tip and return its token; None
        when the cutoff or ``max_nodes`` ends the tree. Stochastic: the token
        is the draw from q with the noise the target's sampler uses at that
        position (Gumbel-max, ggpipe.keyed_noise: an exact draw from q,
        coupled to the target's pick, so it is accepted about as often as
        multi-step speculative sampling would accept a draw)."""
        tree = self.tree
        greedy = self.params.greedy
        if greedy:
            # the draft's confidence only shapes the tree (verification is the
            # target's argmax): the reply_k best tokens and their probabilities
            cand, cand_q = best(logits, self.pipe.reply_k)
            top, q_top = int(cand[0]), float(cand_q[0])
        else:
            q = target_probs(logits, self.params)
            top = int(np.argmax(q))
            q_top = float(q[top])
        prev_path = self._path
        path = 1.0 if self.acceptance is None else prev_path * self.acceptance(q_top)
        cutoff = self._first_cutoff if len(tree) == 0 else self._cutoff
        if (q_top if self.acceptance is None else path) < cutoff or len(tree) >= self._max_nodes:
            return None
        self._path = path
        if greedy:
            tok = top
            node = tree.add(tok, self._parent, q_top)
            leaves = len(tree.leaves())
            if self.width > leaves and len(tree) < self._max_nodes:
                k = self.width - leaves + 1
                for t, qt in zip(cand[: k + 1], cand_q[: k + 1]):
                    t, qt = int(t), float(qt)
                    if t == tok or qt < self.p_split:
                        continue
                    if len(tree.leaves()) >= self.width or len(tree) >= self._max_nodes:
                        break
                    tree.add(t, self._parent, qt)
        else:
            pos = (tree.anchor_pos if self._parent == -1 else tree.pos(self._parent)) + 1
            tok = gumbel_pick(q, self.key, pos - self.first_pos)
            node = tree.add(tok, self._parent, float(q[tok]))
            if self.acceptance is not None:  # the path goes on through the drawn token
                self._path = prev_path * self.acceptance(float(q[tok]))
        self._parent = node
        return tok

    def _observe_step(self, result: DraftResult) -> None:
        """Time a draft decode from submission to result (``run.started_at``
        to ``finished_at``; a result without both times is skipped) and pass
        it to :meth:`timed`."""
        run, t1 = result.run, result.finished_at
        if not t1 or not run.started_at or t1 < run.started_at:
            return
        self.timed(run.n_tokens, t1 - run.started_at)

    def timed(self, n_tokens: int, seconds: float) -> None:
        """A draft run of ``n_tokens`` took ``seconds`` from submission to
        result: one-token runs update ``step_s`` (an exponentially weighted
        mean, weight 0.2)."""
        if n_tokens == 1:
            self.step_s = seconds if self.step_s is None else self.step_s + 0.2 * (seconds - self.step_s)

    def _finish(self) -> SpecTree:
        self.active = False
        tree, self.tree = self.tree, None
        return tree
