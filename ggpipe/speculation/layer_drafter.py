"""PipeDec's draft side: the dynamic prediction tree, grown one layer per
draft run (PipeDec sections 3.3 and 3.4.3). No MPI, no model: the draft
model's pipeline is reached through
:class:`~ggpipe.backend.DecodeBackend`.

The tree's root is the last decided token (its target logits are pending).
A layer is formed from the draft logits of the layer above
(:func:`~ggpipe.speculation.prediction_tree.next_layer`: top ``width`` by
cumulative probability, at most ``max_children`` per node); the draft then
evaluates the new layer in one run, every node in its own KV sequence of the
draft context (a copy of its parent's sequence up to the parent: the paper's
tree-specific KV cache), which gives the logits that form the layer below.
The decoder (:mod:`ggpipe.decoding.pipedec`) sends each layer to the target
pipeline as soon as the layer above was sent, one layer per pipeline step.

When the target decides tokens (section 3.3.4, "Tree Pruning Process"):

* *hit* (:meth:`LayerDrafter.follow`): the decided token is a node of the
  tree; its draft cell joins the draft's accepted sequence 0 and only the
  subtree below it is kept; every other node's sequence is removed;
* a token that no node sent to the target carries, but a node not yet sent
  does (:meth:`LayerDrafter.reroot`), is a hit too: the subtree below that
  node is kept and grows on;
* *miss*: a new tree is planted at the decided token (:meth:`plant`).

Ggpipe's choices where the paper leaves room: the draft may evaluate a layer
``lead`` (1) layers deeper than the deepest layer sent to the target, so the
next layer is ready when the target's first stage frees up; nodes that find
no free draft KV sequence wait for one (the layer below them waits too).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ggpipe.logits import best
from ggpipe.runs import Run
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.graph import ACCEPTED, SpecGraph
from ggpipe.speculation.prediction_tree import next_layer
from ggpipe.backend import DecodeBackend
from ggpipe.speculation.proposers.base import sync_kv

HELD, DRAFTING, DRAFTED = 0, 1, 2   # formed / draft run in flight / draft logits known


@dataclass
class DraftNode:
    """A node of the prediction tree on the draft side.

    Attributes:
        token, pos: draft token and its position.
        parent: drafter node id (-1: the root).
        p: draft probability after its parent; logp: cumulative log-probability from the root.
        seq: draft KV sequence holding its cell (0 once it joined the accepted sequence).
        state: HELD, DRAFTING or DRAFTED.
        gid: the target graph's node id, once sent to the target (None before).
        branches: (token ids int64 (k,), probabilities float64 (k,)) of its draft row, once DRAFTED.
    """

    token: int
    pos: int
    parent: int
    p: float
    logp: float
    seq: int = 0
    state: int = HELD
    gid: int | None = None
    branches: tuple[np.ndarray, np.ndarray] | None = None
    children: list[int] = field(default_factory=list)


class LayerDrafter:
    """Args:
        backend: the draft model's pipeline (head-driven).
        n_seq_max: KV sequence ids of the draft context (sequence 0 holds
            the accepted tokens; 1..n_seq_max-1 hold tree nodes).
        width: most nodes per tree layer (``--tree-width``).
        max_children: most children per node (``--max-children``).
        n_ubatch: largest draft decode (catch-up decodes are chunked).
        lead: layers the draft may evaluate beyond the deepest one sent to
            the target.

    Raises:
        ValueError: ``n_seq_max`` < 2.

    Attributes:
        max_pos: deepest position worth a node (the decoder sets it from the
            tokens still to generate).
        n_cells: the draft's KV cells (the decoder sets it); a layer is
            evaluated only as far as they go, one cell left free for a
            merge (None: unbounded).
        stats: counters for ``--json``.
    """

    name = "pipedec"
    instant = False
    step_s = None

    def __init__(self, backend: DecodeBackend, n_seq_max: int, width: int, max_children: int, n_ubatch: int,
                 lead: int = 1):
        if n_seq_max < 2:
            raise ValueError(f"a prediction tree needs at least 2 KV sequence ids in the draft context, it has "
                             f"{n_seq_max}")
        self.pipe = backend
        self.n_seq_max = n_seq_max
        self.width = width
        self.max_children = max_children
        self.n_ubatch = n_ubatch
        self.lead = lead
        self.cursor: list[int] = []          # tokens in the draft's sequence 0, positions 0..len-1
        self.nodes: dict[int, DraftNode] = {}
        self.root: int | None = None
        self.sent_pos = -1                   # deepest position sent to the target
        self.max_pos = 1 << 30
        self.n_cells: int | None = None      # the draft's KV cells (None: unbounded; ggpipe.speculation.kv_room)
        self._ids = itertools.count()
        self._free: deque[int] = deque(range(1, n_seq_max))
        self._runs: deque[list[int]] = deque()   # per in-flight draft run: the nodes its rows belong to
        self.stats = {"draft_decodes": 0, "tree_layers": 0, "tree_nodes": 0, "new_trees": 0, "unsent_hits": 0,
                      "draft_seq_waits": 0, "draft_seqs_peak": 0, "draft_cell_waits": 0}

    # -- the proposer-like surface the decoding loop reads -----------------------

    def start(self, params: SamplingParams) -> None:
        """A new request (any sampling settings: the draft chooses its
        layers by draft probability alone): the draft's last stage returns
        the ``max_children`` best tokens of each row (ggpipe.logits)."""
        self.pipe.reply_k = self.max_children
        self.stats = dict.fromkeys(self.stats, 0)   # counters count this request's work

    def reset(self) -> None:
        """The draft's KV cache was cleared."""
        self.cursor.clear()
        self.nodes.clear()
        self.root = None
        self._free = deque(range(1, self.n_seq_max))

    def observe(self, context: list[int]) -> None:
        """Tokens decided so far: the tree follows the graph instead (:meth:`follow`)."""

    def prefill(self, tokens: list[int]) -> None:
        """Start the draft's KV with ``tokens`` (runs submitted, not waited for)."""
        n, _ = sync_kv(self.pipe, self.cursor, list(tokens), self.n_ubatch, want_logits=False)
        self._runs.extend([[] for _ in range(n)])
        self.stats["draft_decodes"] += n

    def ready(self) -> bool:
        """A draft result has arrived."""
        return self.pipe.ready()

    def busy(self) -> bool:
        """Draft runs are in flight."""
        return bool(self.pipe.inflight)

    def poll(self) -> None:
        """Take one draft result if there is one (never blocks): the rows of
        live nodes give their branches; a new layer forms when the deepest
        one is drafted; formed layers within reach are evaluated."""
        res = self.pipe.poll()
        if res is not None:
            self._take(res)

    def settle(self, timeout_s: float) -> None:
        """Consume every in-flight draft run (bounded waits) and drop the tree."""
        while self.pipe.inflight:
            self._take(self.pipe.wait(timeout_s))
        self._drop_tree()

    # -- planting and pruning (PipeDec 3.3.2, 3.3.4) --------------------------------

    def plant(self, context: list[int], gid: int) -> None:
        """A new tree at ``context[-1]`` (a decided token, graph node
        ``gid``): the draft's sequence 0 is brought to ``context`` and the
        root is evaluated there."""
        self._drop_tree()
        n, _ = sync_kv(self.pipe, self.cursor, list(context), self.n_ubatch, want_logits=True)
        rid = self._new(context[-1], len(context) - 1, -1, 1.0, 0.0)
        root = self.nodes[rid]
        root.state, root.gid = DRAFTING, gid
        self._runs.extend([[] for _ in range(n - 1)] + [[rid]])
        self.stats["draft_decodes"] += n
        self.stats["new_trees"] += 1
        self.root = rid
        self.sent_pos = root.pos

    def follow(self, graph: SpecGraph) -> None:
        """The target accepted nodes below the root: walk down them, move
        their draft cells into sequence 0, and keep only the subtree of the
        last one (PipeDec 3.3.4, a hit)."""
        if self.root is None:
            return
        cur, path = self.root, []
        while True:
            nxt = [c for c in self.nodes[cur].children
                   if self.nodes[c].gid is not None and graph.nodes[self.nodes[c].gid].state == ACCEPTED]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        if path:
            self._free_outside(path)
        for c in path:
            self._merge(c)
        if cur != self.root:
            self._keep_subtree(cur)
            self._grow()
            self._pump()

    def reroot(self, context: list[int], graph: SpecGraph, gid: int) -> None:
        """The target decided ``context[-1]``, which no node sent to it
        carries (graph node ``gid`` is the root run for it). If a node not
        yet sent carries it below the last accepted node, keep its subtree
        (a hit in the draft's part of the tree); otherwise plant a new tree."""
        self.follow(graph)
        tok, pos = int(context[-1]), len(context) - 1
        if self.root is not None and len(self.cursor) == pos:
            match = [c for c in self.nodes[self.root].children
                     if self.nodes[c].token == tok and self.nodes[c].pos == pos]
            if match:
                c = match[0]
                self._free_outside([c])
                self._merge(c)
                self._keep_subtree(c)
                self.nodes[c].gid = gid
                self.sent_pos = pos
                self.stats["unsent_hits"] += 1
                self._grow()
                self._pump()
                return
        self.plant(context, gid)

    # -- the target's side -------------------------------------------------------

    def layer_for_target(self) -> list[int]:
        """Live nodes of the layer below the deepest one sent to the target
        (their parents all were), best cumulative probability first; empty
        when that layer has not formed."""
        pos = self.sent_pos + 1
        if pos > self.max_pos:
            return []
        ids = [i for i, n in self.nodes.items() if n.pos == pos and n.gid is None]
        return sorted(ids, key=lambda i: -self.nodes[i].logp)

    def sent(self, ids: list[int], gids: list[int]) -> None:
        """``ids`` went to the target as graph nodes ``gids``; nodes of their
        layer not among them are dropped (no KV sequence was free)."""
        if not ids:
            return
        pos = self.nodes[ids[0]].pos
        for i, g in zip(ids, gids):
            self.nodes[i].gid = g
        for i in [i for i, n in self.nodes.items() if n.pos == pos and n.gid is None]:
            self._drop(i)
        self.sent_pos = pos
        self._pump()

    # -- internals ---------------------------------------------------------------

    def _new(self, token: int, pos: int, parent: int, p: float, logp: float) -> int:
        i = next(self._ids)
        self.nodes[i] = DraftNode(int(token), pos, parent, p, logp)
        if parent >= 0:
            self.nodes[parent].children.append(i)
        return i

    def _take(self, res) -> None:
        ids = self._runs.popleft() if self._runs else []
        if ids and res.logits is not None:
            for j, i in enumerate(ids):
                n = self.nodes.get(i)
                if n is not None:
                    n.branches = best(res.logits[j], self.max_children)
                    n.state = DRAFTED
        self._grow()
        self._pump()

    def _grow(self) -> None:
        """Form the layer below the deepest one once all its live nodes are
        drafted (and none has children yet)."""
        if self.root is None:
            return
        deepest = max(n.pos for n in self.nodes.values())
        if deepest + 1 > self.max_pos:
            return
        front = [i for i, n in self.nodes.items() if n.pos == deepest]
        if any(self.nodes[i].state != DRAFTED or self.nodes[i].children for i in front):
            return
        cands = next_layer([self.nodes[i].logp for i in front], [self.nodes[i].branches for i in front],
                           self.width, self.max_children)
        for c in cands:
            self._new(c.token, deepest + 1, front[c.parent], c.p, c.logp)
        if cands:
            self.stats["tree_layers"] += 1
            self.stats["tree_nodes"] += len(cands)

    def _pump(self) -> None:
        """Start the draft run of the formed layer, if it is within ``lead``
        of the deepest layer sent to the target."""
        held = [i for i, n in self.nodes.items() if n.state == HELD and n.pos <= self.sent_pos + self.lead]
        if not held:
            return
        pos = self.nodes[held[0]].pos
        held = [i for i in held if self.nodes[i].pos == pos]
        if len(held) > len(self._free):
            self.stats["draft_seq_waits"] += 1   # the rest waits for sequences to come free
            held = held[:len(self._free)]
        if self.n_cells is not None:
            # the draft's cells: sequence 0's (the cursor) and one per node holding a sequence
            room = self.n_cells - 1 - len(self.cursor) - sum(1 for n in self.nodes.values() if n.seq != 0)
            if len(held) > room:
                self.stats["draft_cell_waits"] += 1   # the rest waits for cells to come free
                held = held[:max(0, room)]
        if not held:
            return
        seqs = []
        for i in held:
            n = self.nodes[i]
            n.seq = self._free.popleft()
            self.stats["draft_seqs_peak"] = max(self.stats["draft_seqs_peak"], self.n_seq_max - 1 - len(self._free))
            self.pipe.seq_cp(self.nodes[n.parent].seq, n.seq, 0, n.pos)
            n.state = DRAFTING
            seqs.append(n.seq)
        self.pipe.submit(Run.layer([self.nodes[i].token for i in held], pos, seqs))
        self._runs.append(held)
        self.stats["draft_decodes"] += 1

    def _merge(self, i: int) -> None:
        """Node ``i`` was accepted: its cell joins the draft's sequence 0
        (decoded there if it was never evaluated)."""
        n = self.nodes[i]
        if len(self.cursor) != n.pos:
            raise RuntimeError(f"draft KV out of step: {len(self.cursor)} accepted tokens, node at {n.pos}")
        if n.state == HELD:
            self.pipe.decode([n.token], n.pos, seq=0)
            self._runs.append([i])
            n.state = DRAFTING
            self.stats["draft_decodes"] += 1
        elif n.seq != 0:
            self.pipe.seq_cp(n.seq, 0, n.pos, n.pos + 1)
            self._release(n)
        self.cursor.append(n.token)

    def _keep_subtree(self, i: int) -> None:
        """Node ``i`` becomes the root: every node outside its subtree goes."""
        keep, stack = set(), [i]
        while stack:
            j = stack.pop()
            keep.add(j)
            stack.extend(self.nodes[j].children)
        for j in [j for j in self.nodes if j not in keep]:
            self._release(self.nodes.pop(j))
        self.nodes[i].parent = -1
        self.root = i
        # the deepest layer sent may have had no node below ``i``
        self.sent_pos = max((n.pos for n in self.nodes.values() if n.gid is not None), default=self.nodes[i].pos)

    def _free_outside(self, path: list[int]) -> None:
        """Before the nodes of ``path`` (accepted, root first) are merged:
        free the draft cells of every node outside it and the subtree of
        its last node (they die with the merge), so a merge that decodes
        finds a free cell."""
        keep, stack = set(path), [path[-1]]
        while stack:
            j = stack.pop()
            keep.add(j)
            stack.extend(c for c in self.nodes[j].children if c in self.nodes)
        for j, n in self.nodes.items():
            if j not in keep and j != self.root:
                self._release(n)

    def _drop(self, i: int) -> None:
        """Node ``i`` and its subtree go."""
        n = self.nodes.pop(i)
        if n.parent in self.nodes:
            self.nodes[n.parent].children.remove(i)
        for c in n.children:
            if c in self.nodes:
                self._drop(c)
        self._release(n)

    def _drop_tree(self) -> None:
        for n in self.nodes.values():
            self._release(n)
        self.nodes.clear()
        self.root = None

    def _release(self, n: DraftNode) -> None:
        """Remove node ``n``'s sequence from the draft's KV (pipelined behind
        its run) and free the id."""
        if n.seq != 0:
            self.pipe.seq_rm(n.seq)
            self._free.append(n.seq)
            n.seq = 0
