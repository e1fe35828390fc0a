"""The head's view of everything speculated and not yet decided. Pure logic.

Nodes are tokens at positions, each evaluated by one target run; a node's
parent is the node whose logits decide it. Runs come in two kinds:

* a *root* run (non-speculative, PipeInfer IV.A): one decided token that no
  node carried (the prompt's first sampled token, or a token the target chose
  against every draft), evaluated in the canonical sequence 0. Never
  cancelled (IV.D.3).
* a *speculative* run: a tree of draft tokens below an existing node (its
  anchor), in its own partition of KV sequence ids (IV.C.1), one per leaf.
  A synchronous speculative run may also carry the decided root token itself.

The *committed* node carries the last accepted token. When its logits are
known, :meth:`SpecGraph.advance` decides the next token among its children
(:func:`~ggpipe.speculation.verify.verify_step`) and walks down as far as
logits allow. Accepting a speculative node emits a "buffer swap" KV op that
copies its cell into sequence 0 (IV.C.1-2); nodes off the accepted path die,
and so do runs holding only dead nodes (invalidated or superfluous: IV.D.1),
which the engine cancels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggpipe.sampling import Sampler
from ggpipe.speculation.draft_stats import DraftStats
from ggpipe.speculation.tree import SpecTree
from ggpipe.logits import top2_margin
from ggpipe.speculation.verify import verify_step

PENDING, ACCEPTED, DEAD = 0, 1, 2

# Nodes more than this many positions behind the committed node, held by no
# run the graph still tracks, are dropped (SpecGraph.trim): a request's graph
# stays bounded however long it runs. Far above any tree's depth
# (--draft-max <= 64), so a proposer's anchor is never dropped while it drafts.
TRIM_LAG = 128


@dataclass
class Node:
    """A token at a position, evaluated by one target run.

    Attributes:
        token, pos: the token and its position.
        parent: the node whose logits decide it (-1: a root).
        run_id: the run that evaluates it.
        seq: a KV sequence id holding its cell.
        dp: the draft's probability of ``token``.
        state: PENDING, ACCEPTED or DEAD.
        logits: its logit row once its run returned (float32 (n_vocab,), or
            a compact :class:`~ggpipe.logits.TopRow`; dropped once consumed).
        children: node ids below it."""

    token: int
    pos: int
    parent: int            # node id, -1 for a root node
    run_id: int
    seq: int               # a KV sequence id holding this node's cell
    dp: float = 1.0        # draft probability of this token
    state: int = PENDING
    logits: np.ndarray | None = None
    children: list[int] = field(default_factory=list)


@dataclass
class RunInfo:
    """A target run the graph tracks.

    Attributes:
        run_id: the run's id.
        nodes: the ids of the nodes it evaluates.
        speculative: a speculative run (else a root run, never cancelled).
        partition: its KV partition index (speculative runs), or None.
        seqs: the sequence ids it uses.
        returned: its result came back.
        cancelled: a cancel was sent for it.
        layer: a PipeDec layer (one node per row, each in a sequence of its own).
        masked: node ids whose rows a prune message masked."""

    run_id: int
    nodes: list[int]
    speculative: bool
    partition: int | None = None        # partition index (speculative runs)
    seqs: list[int] = field(default_factory=list)
    returned: bool = False
    cancelled: bool = False             # a cancel was sent
    layer: bool = False                 # a PipeDec layer: one node per row, each in a sequence of its own
    masked: set[int] = field(default_factory=set)   # node ids whose rows a prune message masked


@dataclass
class Decision:
    """One decided position: the token, and the node that carries it (None:
    no node did; a root run must evaluate it)."""

    token: int
    node: int | None


class SpecGraph:
    """Args:
        sampler: the head's sampler (greedy or stochastic verification).
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.nodes: dict[int, Node] = {}   # by node id (ids are never reused; old ones are trimmed)
        self._next_id = 0
        self._decided_pos = 0              # position of the latest committed node
        self._trimmed_at = 0               # _decided_pos at the last trim
        self.runs: dict[int, RunInfo] = {}
        self.committed: int | None = None
        self.swap_ops: list[tuple[int, int, int]] = []   # (seq, p0, p1) to copy into seq 0
        self.min_accepted_margin: float | None = None  # greedy: smallest top-1 minus top-2 logit of an accepted draft
        self.verified: list[tuple[float, bool]] = []   # (draft probability, accepted) per verified child
        self.draft_stats = DraftStats()    # drafted tokens, verified and accepted ones by position after a root
        self._position = 0                 # the position after the last root of the committed node's children

    # -- building --------------------------------------------------------------

    def add_root(self, token: int, pos: int, run_id: int, seq: int = 0) -> int:
        """A decided token that no node carried; it becomes the committed node."""
        nid = self._new_id()
        self.nodes[nid] = Node(token, pos, -1, run_id, seq, state=ACCEPTED)
        self.runs.setdefault(run_id, RunInfo(run_id, [], speculative=False)).nodes.append(nid)
        self._commit(nid)
        self._position = 0
        return nid

    def add_tree(self, anchor: int, tree: SpecTree, run_id: int, leaf_seq: dict[int, int],
                 partition: int | None, seqs: list[int]) -> list[int]:
        """Attach ``tree`` below node ``anchor`` as (part of) run ``run_id``.
        Returns the new node ids, in tree order."""
        a = self.nodes[anchor]
        if tree.anchor_pos != a.pos:
            raise ValueError(f"tree anchored at position {tree.anchor_pos}, node {anchor} is at {a.pos}")
        info = self.runs.setdefault(run_id, RunInfo(run_id, [], speculative=True))
        info.speculative = True
        info.partition = partition
        info.seqs = list(seqs)
        seq_of = {}
        for leaf, s in leaf_seq.items():
            for j in tree.path(leaf):
                seq_of.setdefault(j, s)
        ids = []
        for i in range(len(tree)):
            parent = anchor if tree.parent[i] == -1 else ids[tree.parent[i]]
            nid = self._new_id()
            self.nodes[nid] = Node(tree.tokens[i], tree.pos(i), parent, run_id, seq_of[i], dp=tree.draft_p[i])
            self.nodes[parent].children.append(nid)
            info.nodes.append(nid)
            ids.append(nid)
        self.draft_stats.drafted += len(tree)
        if self._closed(anchor):
            for nid in ids:
                self.nodes[nid].state = DEAD
        return ids

    def _closed(self, nid: int) -> bool:
        """Nothing below node ``nid`` can be accepted any more: it is dead
        (invalidated), or its children were already decided (superfluous)."""
        n = self.nodes[nid]
        return n.state == DEAD or (n.state == ACCEPTED and nid != self.committed)

    def add_layer(self, run_id: int, parents: list[int], tokens: list[int], dps: list[float],
                  seqs: list[int], partition: int | None) -> list[int]:
        """Attach one layer of a PipeDec prediction tree as run ``run_id``:
        node i is ``tokens[i]`` below node ``parents[i]`` (nodes of several
        parents share the run), in KV sequence ``seqs[i]``, drawn with draft
        probability ``dps[i]``; the sequences belong to KV
        partition ``partition``. Nodes below a dead parent, or below one
        whose children were already decided, are dead from birth. Returns
        the new node ids."""
        if not len(parents) == len(tokens) == len(dps) == len(seqs):
            raise ValueError("a layer needs one parent, token, probability and sequence per node")
        info = self.runs.setdefault(run_id, RunInfo(run_id, [], speculative=True))
        info.speculative = True
        info.layer = True
        info.seqs = list(seqs)
        info.partition = partition
        ids = []
        for parent, tok, dp, s in zip(parents, tokens, dps, seqs):
            pn = self.nodes[parent]
            nid = self._new_id()
            node = Node(int(tok), pn.pos + 1, parent, run_id, int(s), dp=float(dp))
            if self._closed(parent):
                node.state = DEAD
            self.nodes[nid] = node
            pn.children.append(nid)
            info.nodes.append(nid)
            ids.append(nid)
        self.draft_stats.drafted += len(ids)
        return ids

    # -- results ---------------------------------------------------------------

    def set_result(self, run_id: int, logits: np.ndarray | None, output_nodes: list[int] | None = None,
                   rows: np.ndarray | None = None) -> None:
        """Store a returned run's logits (float32 (n_out, n_vocab), one row per
        node of ``output_nodes``, default: every node of the run), or mark it
        returned without logits (cancelled). ``rows``: the batch indices of
        the rows when stages masked some (ggpipe.pipeline.masking; a layer
        run's row i is its node i).

        Raises:
            ValueError: row counts or indices that do not fit the run, or a
                masked row of a node that is not dead."""
        info = self.runs[run_id]
        info.returned = True
        if logits is None:
            return
        nodes = info.nodes if output_nodes is None else output_nodes
        if rows is not None:
            if not info.layer or int(np.max(rows, initial=-1)) >= len(info.nodes):
                raise ValueError(f"run {run_id}: masked rows {list(rows)} do not fit its {len(info.nodes)} nodes")
            nodes = [info.nodes[int(i)] for i in rows]
            missing = set(info.nodes) - set(nodes)
            if any(self.nodes[j].state != DEAD for j in missing):
                raise ValueError(f"run {run_id}: a live node's row was masked")
        if logits.shape[0] != len(nodes):
            raise ValueError(f"run {run_id}: {logits.shape[0]} logit rows for {len(nodes)} nodes")
        for row, nid in enumerate(nodes):
            if self.nodes[nid].state != DEAD:
                self.nodes[nid].logits = logits[row]

    def advance(self) -> list[Decision]:
        """Decide tokens from the committed node down, as far as logits are
        known. Accepted speculative nodes queue a buffer-swap op
        (:attr:`swap_ops`); siblings off the path die."""
        out: list[Decision] = []
        while self.committed is not None:
            c = self.nodes[self.committed]
            if c.logits is None:
                break
            kids = [k for k in c.children if self.nodes[k].state != DEAD]
            t, k = verify_step(c.logits, [self.nodes[j].token for j in kids], self.sampler)
            c_logits, c.logits = c.logits, None  # consumed; frees memory
            chosen = kids[k] if k is not None else None
            if kids:
                self.draft_stats.record(self._position, chosen is not None)
            for j in kids:
                self.verified.append((self.nodes[j].dp, j == chosen))
                if j != chosen:
                    self._kill(j)
            out.append(Decision(t, chosen))
            if chosen is None:
                self.committed = None  # the caller adds a root for t
                break
            n = self.nodes[chosen]
            n.state = ACCEPTED
            self._position += 1
            if self.sampler.params.greedy:
                m = top2_margin(c_logits)
                if m is not None and (self.min_accepted_margin is None or m < self.min_accepted_margin):
                    self.min_accepted_margin = m
            self.swap_ops.append((n.seq, n.pos, n.pos + 1))
            self._commit(chosen)
        return out

    def _new_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def _commit(self, nid: int) -> None:
        self.committed = nid
        self._decided_pos = max(self._decided_pos, self.nodes[nid].pos)

    def trim(self, lag: int = TRIM_LAG) -> int:
        """Drop the nodes more than ``lag`` positions behind the latest
        committed node that no run the graph still tracks holds (decided, or
        dead and retired), other than the committed one: nothing reads them
        again. Runs every ``lag // 4`` positions the committed node advances
        (a pass over the nodes, few: those within ``lag`` positions and the
        runs in flight). Returns the nodes dropped."""
        top = self._decided_pos
        if top - self._trimmed_at < max(1, lag // 4):
            return 0
        self._trimmed_at = top
        cut = top - lag
        held = {j for info in self.runs.values() for j in info.nodes}
        old = [j for j, n in self.nodes.items() if n.pos < cut and j not in held and j != self.committed]
        for j in old:
            del self.nodes[j]
        return len(old)

    def _kill(self, nid: int) -> None:
        stack = [nid]
        while stack:
            j = stack.pop()
            n = self.nodes.get(j)
            if n is None or n.state == DEAD:
                continue
            n.state = DEAD
            n.logits = None
            stack.extend(n.children)

    def kill_all_pending(self) -> None:
        """Every pending node dies (e.g. the committed chain was replaced by a
        new root)."""
        for j, n in list(self.nodes.items()):
            if n.state == PENDING:
                self._kill(j)

    def take_verified(self) -> list[tuple[float, bool]]:
        """(draft probability, accepted) of every draft child verified since
        the last call, for calibrating the draft's confidence."""
        out, self.verified = self.verified, []
        return out

    def path_p(self, nid: int, p_of) -> float:
        """Product of ``p_of(dp)`` over the pending nodes from ``nid`` up to
        the committed node (1.0 for the committed node itself): the estimated
        probability that ``nid`` is reached and accepted."""
        p = 1.0
        while nid != self.committed and nid >= 0:
            n = self.nodes[nid]
            if n.state != PENDING:
                break
            p *= p_of(n.dp)
            nid = n.parent
        return p

    def take_swap_ops(self) -> list[tuple[int, int, int]]:
        """Buffer-swap copies to send, merged into ranges per sequence:
        (seq, p0, p1) = copy seq's cells [p0, p1) into sequence 0."""
        ops, self.swap_ops = self.swap_ops, []
        merged: list[list[int]] = []
        for s, p0, p1 in ops:
            if merged and merged[-1][0] == s and merged[-1][2] == p0:
                merged[-1][2] = p1
            else:
                merged.append([s, p0, p1])
        return [tuple(m) for m in merged]

    # -- run bookkeeping (cancellation, partitions) ------------------------------

    def dead_runs(self) -> list[int]:
        """In-flight speculative runs whose every node is dead: invalidated
        (their prefix contradicts the accepted tokens) or superfluous; cancel
        them (PipeInfer IV.D.1). Each run is reported once."""
        out = []
        for rid, info in self.runs.items():
            if info.speculative and not info.returned and not info.cancelled and info.nodes and all(
                    self.nodes[j].state == DEAD for j in info.nodes):
                info.cancelled = True
                out.append(rid)
        return out

    def maskable_rows(self) -> list[tuple[int, int]]:
        """(run id, sequence id) of every dead node, not yet reported, in
        the PipeDec layer runs still in flight that keep a live node: rows
        the stages need not evaluate (PipeDec 3.3.4; ggpipe.pipeline.masking).
        Wholly dead runs are :meth:`dead_runs`' instead; call this after it."""
        out = []
        for rid, info in self.runs.items():
            if not info.layer or info.returned or info.cancelled:
                continue
            for j in info.nodes:
                if j not in info.masked and self.nodes[j].state == DEAD:
                    info.masked.add(j)
                    out.append((rid, self.nodes[j].seq))
        return out

    def retirable(self) -> list[RunInfo]:
        """Returned runs no node of which can matter any more (no node is the
        committed one or pending): their partitions can be freed. Each run is
        reported once and forgotten."""
        out = []
        for rid in list(self.runs):
            info = self.runs[rid]
            if not info.returned:
                continue
            if any(j == self.committed or self.nodes[j].state == PENDING for j in info.nodes):
                continue
            out.append(self.runs.pop(rid))
        return out

    def frontier(self) -> int | None:
        """Where to speculate next: the deepest pending node on the most
        probable path below the committed node (following, at each level, the
        child with the highest draft probability), or the committed node."""
        cur = self.committed
        if cur is None:
            return None
        while True:
            kids = [k for k in self.nodes[cur].children if self.nodes[k].state != DEAD]
            if not kids:
                return cur
            cur = max(kids, key=lambda k: self.nodes[k].dp)

    def chain(self, nid: int) -> list[int]:
        """Node ids strictly below the committed node down to ``nid``
        (``nid`` must descend from it)."""
        out = []
        while nid != self.committed:
            if nid == -1:
                raise ValueError("node does not descend from the committed node")
            out.append(nid)
            nid = self.nodes[nid].parent
        return out[::-1]

    def pending_top(self) -> int:
        """One past the highest position of a pending node (0 when none is
        pending): KV cells at positions from there on belong to no path that
        can still be accepted."""
        top = 0
        for info in self.runs.values():
            for j in info.nodes:
                n = self.nodes[j]
                if n.state == PENDING:
                    top = max(top, n.pos + 1)
        return top

    def pending_runs(self, speculative_only: bool = False) -> int:
        """Runs started and not yet returned (only speculative ones, if asked)."""
        return sum(1 for r in self.runs.values() if not r.returned and (r.speculative or not speculative_only))
