"""Speculation trees (token trees, SpecInfer / PipeInfer IV.B). Pure data.

A tree hangs below an *anchor*: a token whose position is ``anchor_pos`` and
whose logits predict the tree's first level (the anchor itself is either the
last accepted token, evaluated by a non-speculative run, or a node of an
earlier tree in flight). Node ``i`` holds a draft token at position
``anchor_pos + depth[i]``; ``parent[i]`` is -1 for the first level.

For the batch sent to the target, every root-to-leaf path is one KV sequence:
a node belongs to the sequences of all leaves below it, so llama.cpp's
per-sequence causal mask gives exactly tree attention (a node sees its
ancestors and itself, never a sibling branch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecTree:
    """Attributes:
        anchor_pos: position of the anchor token (int).
        tokens: draft token of each node.
        parent: parent node index, -1 below the anchor.
        draft_p: per node, the draft probability of its own token.
    """

    anchor_pos: int
    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    draft_p: list[float] = field(default_factory=list)

    def add(self, token: int, parent: int, p: float = 1.0) -> int:
        """Append a node: draft ``token`` below node ``parent`` (-1: below the
        anchor), with its draft probability ``p``; returns the new node's index.

        Raises:
            ValueError: ``parent`` is not an existing node or -1."""
        if parent >= len(self.tokens) or parent < -1:
            raise ValueError(f"parent {parent} does not exist")
        self.tokens.append(int(token))
        self.parent.append(int(parent))
        self.draft_p.append(float(p))
        return len(self.tokens) - 1

    def prefix(self, n: int) -> "SpecTree":
        """The first ``n`` nodes (whose parents all come before them, as
        :meth:`add` builds trees) as a tree of their own."""
        return SpecTree(self.anchor_pos, self.tokens[:n], self.parent[:n], self.draft_p[:n])

    def __len__(self) -> int:
        return len(self.tokens)

    def depth(self, i: int) -> int:
        """Depth of node ``i``: 1 for the first level below the anchor."""
        d = 1
        while self.parent[i] != -1:
            i = self.parent[i]
            d += 1
        return d

    def pos(self, i: int) -> int:
        """Position of node ``i``'s token (``anchor_pos`` + its depth)."""
        return self.anchor_pos + self.depth(i)

    def children(self, i: int) -> list[int]:
        """Children of node ``i`` (-1: of the anchor), in insertion order."""
        return [j for j, p in enumerate(self.parent) if p == i]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        has_child = set(self.parent)
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def path(self, i: int) -> list[int]:
        """Node indices from the first level down to ``i``."""
        out = []
        while i != -1:
            out.append(i)
            i = self.parent[i]
        return out[::-1]

    def path_tokens(self, i: int) -> list[int]:
        """Draft tokens from the first level down to node ``i``."""
        return [self.tokens[j] for j in self.path(i)]

    def max_pos(self) -> int:
        """The deepest node's position (``anchor_pos`` for an empty tree)."""
        return max((self.pos(i) for i in range(len(self))), default=self.anchor_pos)

    def batch(self, seq_ids: list[int]):
        """The target batch for this tree with one sequence per leaf.

        Args:
            seq_ids: sequence ids for the leaves (at least ``len(leaves())``).

        Returns:
            (tokens int32 (n,), pos int32 (n,), n_seq_id int32 (n,),
            seq_ids int32 (sum,), leaf_seq: dict leaf node -> sequence id).
            Nodes are in index order (a parent always precedes its children).
        """
        leaves = self.leaves()
        if len(seq_ids) < len(leaves):
            raise ValueError(f"tree has {len(leaves)} leaves but only {len(seq_ids)} sequence ids")
        node_seqs: list[list[int]] = [[] for _ in self.tokens]
        leaf_seq = {}
        for leaf, s in zip(leaves, seq_ids):
            leaf_seq[leaf] = s
            for j in self.path(leaf):
                node_seqs[j].append(int(s))
        n = len(self.tokens)
        return (
            np.array(self.tokens, dtype=np.int32),
            np.array([self.pos(i) for i in range(n)], dtype=np.int32),
            np.array([len(s) for s in node_seqs], dtype=np.int32),
            np.array([s for ss in node_seqs for s in ss], dtype=np.int32),
            leaf_seq,
        )

    def reanchor(self, decided: list[int]) -> tuple["SpecTree | None", dict[int, int]]:
        """The subtree that remains once ``decided`` tokens (the tokens at
        positions anchor_pos+1, anchor_pos+2, ... decided meanwhile) are
        followed down from the anchor: a new tree anchored at the last of
        them, and the map old node index -> new index (the node carrying the
        last decided token maps to -1, the new anchor). (None, {}) when they
        leave the tree; an empty tree when nothing remains below. Draft
        probabilities are kept."""
        cur = -1
        for t in decided:
            nxt = [j for j in self.children(cur) if self.tokens[j] == t]
            if not nxt:
                return None, {}
            cur = nxt[0]
        if cur == -1:
            return self, {j: j for j in range(len(self.tokens))}
        keep = [j for j in range(len(self.tokens)) if cur in self.path(j) and j != cur]
        out = SpecTree(anchor_pos=self.anchor_pos + len(decided))
        new_index = {cur: -1}
        for j in keep:  # index order: parents first
            new_index[j] = out.add(self.tokens[j], new_index[self.parent[j]], self.draft_p[j])
        return out, new_index
