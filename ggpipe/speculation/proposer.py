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

Use: ``begin(context, cutoff, max_nodes)`` starts (it submits a draft run);
each draft result goes to ``step(result)``, which submits the next draft run
and returns None, or returns the finished tree (possibly empty: the draft was
not confident enough). ``cut()`` hands over the tree drafted so far while a
draft decode of its tip is in flight, and keeps drafting a new micro-batch
below that tip (continuous speculation, PipeInfer IV.B.1).
"""

from __future__ import annotations

import numpy as np

from ggpipe.runtime.stage import KV_SEQ_RM
from ggpipe.scheduling.iterative import reusable_prefix, submit_prompt
from ggpipe.scheduling.pipeline import Pipeline
from ggpipe.scheduling.runs import Run, RunResult
from ggpipe.scheduling.sampling import SamplingParams, target_probs
from ggpipe.speculation.tree import SpecTree
from ggpipe.transport.messages import KvHeader


def softmax(logits: np.ndarray) -> np.ndarray:
    """float64 (n,) softmax of float32 (n,) logits."""
    x = logits.astype(np.float64)
    x -= x.max()
    np.exp(x, out=x)
    x /= x.sum()
    return x


class DraftProposer:
    """Args:
        pipe: the draft model's pipeline (head-driven).
        params: the sampling parameters of the request (greedy or not).
        rng: random generator for stochastic drafting.
        p_split: probability above which a runner-up becomes a sibling leaf.
        width: most leaves per tree (the partition width).
        n_ubatch: largest draft decode (catch-up decodes are chunked).
    """

    def __init__(self, pipe: Pipeline, params: SamplingParams, rng: np.random.Generator, p_split: float,
                 width: int, n_ubatch: int):
        self.pipe = pipe
        self.params = params
        self.rng = rng
        self.p_split = p_split
        self.width = width
        self.n_ubatch = n_ubatch
        self.cursor: list[int] = []      # tokens in the draft's KV, positions 0..len-1
        self.active = False
        self.tree: SpecTree | None = None
        self._parent = -1
        self._cutoff = 1.0
        self._max_nodes = 0
        self._pending_runs = 0
        self._last_logits: tuple[int, np.ndarray] | None = None  # (cursor length, logits of its last token)
        self.draft_decodes = 0

    # -- the draft's KV cache --------------------------------------------------

    def prefill(self, tokens: list[int]) -> None:
        """Start the draft's KV with ``tokens`` (runs submitted, not waited for)."""
        self._sync(list(tokens), want_logits=False)

    def _sync(self, context: list[int], want_logits: bool) -> int:
        """Make the draft's KV hold ``context`` (all of it when logits of its
        last token are wanted: that token is (re)decoded). Returns the number
        of draft runs submitted."""
        common = reusable_prefix(self.cursor, context, need_logits=want_logits)
        if common < len(self.cursor):
            self.pipe.kv(KvHeader(KV_SEQ_RM, seq=0, p0=common, p1=-1))
            del self.cursor[common:]
            self._last_logits = None  # they were for a prefix that no longer exists
        todo = context[common:]
        n = submit_prompt(self.pipe, todo, common, self.n_ubatch, want_logits=want_logits)
        self.cursor.extend(todo)
        self.draft_decodes += n
        return n

    # -- growing a tree --------------------------------------------------------

    def begin(self, context: list[int], cutoff: float, max_nodes: int) -> None:
        """Start a micro-batch below the last token of ``context`` (every token
        up to and including the anchor; the anchor is at position
        len(context) - 1)."""
        if self.active:
            raise RuntimeError("a micro-batch is already being drafted")
        self.tree = SpecTree(anchor_pos=len(context) - 1)
        self._parent = -1
        self._cutoff = cutoff
        self._max_nodes = max_nodes
        self.active = True
        self._cached = None
        if (self._last_logits is not None and self._last_logits[0] == len(context)
                and self.cursor == list(context)):
            self._cached = self._last_logits[1]   # logits of the anchor already known
            self._pending_runs = 0
        else:
            self._pending_runs = self._sync(list(context), want_logits=True)

    @property
    def has_cached(self) -> bool:
        """begin() found the anchor's logits cached: call step(None) at once."""
        return self.active and self._cached is not None

    def can_cut(self) -> bool:
        """A tree with nodes is being extended by an in-flight draft decode."""
        return self.active and self.tree is not None and len(self.tree) > 0 and self._pending_runs > 0

    def cut(self, cutoff: float, max_nodes: int) -> tuple[SpecTree, int]:
        """Hand over the tree drafted so far and its chain tip's index; keep
        drafting a new tree below the tip (whose draft decode is in flight)."""
        if not self.can_cut():
            raise RuntimeError("nothing to cut")
        tree, tip = self.tree, self._parent
        self.tree = SpecTree(anchor_pos=tree.pos(tip))
        self._parent = -1
        self._cutoff = cutoff
        self._max_nodes = max_nodes
        return tree, tip

    @property
    def tip(self) -> int:
        """Index of the chain tip in the tree being drafted (-1: the anchor)."""
        return self._parent

    def step(self, result: RunResult | None) -> SpecTree | None:
        """Consume one draft result (None: use the cached anchor logits);
        returns the finished tree, or None after submitting the next draft
        decode."""
        if result is None:
            logits, self._cached = self._cached, None
        else:
            self._pending_runs -= 1
            if self._pending_runs > 0:  # a chunk of a long catch-up
                return None
            logits = result.logits[0]
        self._last_logits = (len(self.cursor), logits)
        tree = self.tree
        greedy = self.params.greedy
        q = softmax(logits) if greedy else target_probs(logits, self.params)
        top = int(np.argmax(q))
        if q[top] < self._cutoff or len(tree) >= self._max_nodes:
            return self._finish()
        if greedy:
            tok = top
            node = tree.add(tok, self._parent, float(q[tok]))
            leaves = len(tree.leaves())
            if self.width > leaves and len(tree) < self._max_nodes:
                k = min(self.width - leaves + 1, q.shape[0] - 1)
                cand = np.argpartition(-q, k)[: k + 1]
                cand = cand[np.argsort(-q[cand], kind="stable")]
                for t in cand:
                    t = int(t)
                    if t == tok or q[t] < self.p_split:
                        continue
                    if len(tree.leaves()) >= self.width or len(tree) >= self._max_nodes:
                        break
                    tree.add(t, self._parent, float(q[t]))
        else:
            tok = int(self.rng.choice(q.shape[0], p=q))
            node = tree.add(tok, self._parent, float(q[tok]), probs=q)
        self._parent = node
        if len(tree) >= self._max_nodes:
            return self._finish()
        pos = tree.pos(node)
        if pos != len(self.cursor):
            raise RuntimeError("draft KV out of step")
        self.pipe.submit(Run.linear([tok], pos))
        self.cursor.append(tok)
        self._last_logits = None
        self.draft_decodes += 1
        self._pending_runs = 1
        return None

    def _finish(self) -> SpecTree:
        self.active = False
        tree, self.tree = self.tree, None
        return tree
