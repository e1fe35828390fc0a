"""SpecGraph scenarios with hand-made logits (greedy verification): accepting
along a tree, rejection, buffer-swap ops, dead/retirable runs, frontier,
continuous speculation across runs. MPI-free, fast."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.graph import ACCEPTED, DEAD, PENDING, Decision, SpecGraph
from ggpipe.speculation.partitions import PartitionPool
from ggpipe.speculation.tree import SpecTree

V = 16
P = 20            # position of the root token
R, A, B, C, D, E, X, Y, Z = 9, 1, 2, 3, 4, 5, 6, 7, 8


def oh(t: int) -> np.ndarray:
    """Target logits whose argmax is ``t`` (one-hot-ish float32)."""
    x = np.linspace(-1.0, 0.0, V, dtype=np.float32)
    x[t] = 4.0
    return x


def rows(*ts: int) -> np.ndarray:
    return np.stack([oh(t) for t in ts])


def greedy_graph() -> SpecGraph:
    return SpecGraph(Sampler(SamplingParams(temperature=0.0)))


def attach(g: SpecGraph, pool: PartitionPool, anchor: int, tree: SpecTree, run_id: int):
    part = pool.acquire()
    assert part is not None
    seqs = pool.seqs(part)
    *_, leaf_seq = tree.batch(seqs)
    ids = g.add_tree(anchor, tree, run_id, leaf_seq, part, seqs)
    return ids, leaf_seq, part


def chain_tree(anchor_pos, tokens, dps=None):
    t = SpecTree(anchor_pos)
    parent = -1
    for i, tok in enumerate(tokens):
        parent = t.add(tok, parent, p=1.0 if dps is None else dps[i])
    return t


class Scenario:
    """root r (run 1, pos P) -> run 2: tree a -> b -> {c, d}, plus e beside a.

                 r (R, P)
               /          \\
        a (A, P+1) .9    e (E, P+1) .1
             |
        b (B, P+2) .8
          /        \\
    c (C, P+3) .7   d (D, P+3) .2
    """

    def __init__(self):
        self.g = greedy_graph()
        self.pool = PartitionPool(n_seq_max=17, width=4)
        g = self.g
        self.r = g.add_root(R, P, run_id=1)
        t = SpecTree(P)
        a = t.add(A, -1, p=0.9)
        b = t.add(B, a, p=0.8)
        t.add(C, b, p=0.7)
        t.add(D, b, p=0.2)
        t.add(E, -1, p=0.1)
        self.tree = t
        ids, self.leaf_seq, self.part = attach(g, self.pool, self.r, t, run_id=2)
        self.a, self.b, self.c, self.d, self.e = ids

    def state(self, *nids):
        return [self.g.nodes[n].state for n in nids]


def test_add_root_commits():
    g = greedy_graph()
    r = g.add_root(R, P, run_id=1)
    assert g.committed == r and g.nodes[r].state == ACCEPTED and g.nodes[r].parent == -1
    assert g.nodes[r].seq == 0 and not g.runs[1].speculative
    assert g.frontier() == r and g.chain(r) == []
    assert g.advance() == []          # no logits yet
    assert g.pending_runs() == 1


def test_add_tree_structure_and_seqs():
    s = Scenario()
    g = s.g
    n = g.nodes
    assert [n[i].token for i in (s.a, s.b, s.c, s.d, s.e)] == [A, B, C, D, E]
    assert [n[i].pos for i in (s.a, s.b, s.c, s.d, s.e)] == [P + 1, P + 2, P + 3, P + 3, P + 1]
    assert n[s.r].children == [s.a, s.e] and n[s.a].children == [s.b] and n[s.b].children == [s.c, s.d]
    assert [n[i].parent for i in (s.a, s.b, s.c, s.d, s.e)] == [s.r, s.a, s.b, s.b, s.r]
    assert all(n[i].state == PENDING and n[i].run_id == 2 for i in (s.a, s.b, s.c, s.d, s.e))
    # each node's seq is one of the sequences of the leaves below it
    seqs = s.pool.seqs(s.part)
    assert s.leaf_seq == {2: seqs[0], 3: seqs[1], 4: seqs[2]}
    assert n[s.c].seq == seqs[0] and n[s.d].seq == seqs[1] and n[s.e].seq == seqs[2]
    assert n[s.a].seq in (seqs[0], seqs[1]) and n[s.b].seq in (seqs[0], seqs[1])
    info = g.runs[2]
    assert info.speculative and info.partition == s.part and info.seqs == seqs
    assert info.nodes == [s.a, s.b, s.c, s.d, s.e]
    assert g.draft_stats.drafted == 5 and g.pending_runs() == 2


def test_add_tree_wrong_anchor_position():
    g = greedy_graph()
    r = g.add_root(R, P, run_id=1)
    with pytest.raises(ValueError):
        g.add_tree(r, chain_tree(P + 1, [A]), 2, {0: 1}, 0, [1])


def test_frontier_follows_highest_draft_probability():
    s = Scenario()
    assert s.g.frontier() == s.c
    assert s.g.chain(s.c) == [s.a, s.b, s.c]
    assert s.g.chain(s.e) == [s.e]


def test_accept_two_then_disagree():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(A))                      # root run: the target picks a
    assert g.advance() == [Decision(A, s.a)]
    assert g.committed == s.a and s.state(s.a, s.e) == [ACCEPTED, DEAD]
    assert g.frontier() == s.c and g.chain(s.c) == [s.b, s.c]
    # run 2: logits at a pick b, at b pick X (neither c nor d)
    g.set_result(2, rows(B, X, Z, Z, Z))
    assert g.advance() == [Decision(B, s.b), Decision(X, None)]
    assert g.committed is None and g.frontier() is None
    assert s.state(s.a, s.b, s.c, s.d, s.e) == [ACCEPTED, ACCEPTED, DEAD, DEAD, DEAD]
    assert all(g.nodes[i].logits is None for i in (s.c, s.d, s.e))  # dead: no logits kept
    # a and b copied into sequence 0 as one range of b's sequence
    sq = g.nodes[s.b].seq
    assert g.nodes[s.a].seq == sq
    assert g.take_swap_ops() == [(sq, P + 1, P + 3)]
    assert g.take_swap_ops() == []
    assert g.draft_stats.drafted == 5 and g.draft_stats.n_accepted == 2
    # the caller adds a root for X
    x = g.add_root(X, P + 3, run_id=3)
    assert g.committed == x and g.advance() == []


def test_logits_before_parent_decided_are_kept():
    """Run 2 returns before the root run (possible in a pipeline only through
    separate bookkeeping, but advance must not care about arrival order)."""
    s = Scenario()
    g = s.g
    g.set_result(2, rows(B, C, Y, Z, Z))
    assert g.advance() == []                      # root's logits unknown
    g.set_result(1, rows(A))
    assert g.advance() == [Decision(A, s.a), Decision(B, s.b), Decision(C, s.c), Decision(Y, None)]
    sq = g.nodes[s.c].seq
    assert g.take_swap_ops() == [(sq, P + 1, P + 4)]


def test_reject_at_first_level_kills_whole_tree():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(X))
    assert g.advance() == [Decision(X, None)]
    assert s.state(s.a, s.b, s.c, s.d, s.e) == [DEAD] * 5
    assert g.take_swap_ops() == []
    assert g.draft_stats.n_accepted == 0
    # run 2 in flight, every node dead: cancel it, once
    assert g.dead_runs() == [2]
    assert g.dead_runs() == []
    assert g.runs[2].cancelled


def test_accept_sibling_branch():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(E))
    g.set_result(2, rows(Z, Z, Z, Z, Y))
    assert g.advance() == [Decision(E, s.e), Decision(Y, None)]
    assert s.state(s.a, s.b, s.c, s.d, s.e) == [DEAD, DEAD, DEAD, DEAD, ACCEPTED]
    assert g.take_swap_ops() == [(g.nodes[s.e].seq, P + 1, P + 2)]


def test_dead_runs_reports_run_below_dead_node_once():
    s = Scenario()
    g = s.g
    # run 3 anchored at c (continuous speculation, in flight), run 4 at b
    ids3, _, _ = attach(g, s.pool, s.c, chain_tree(P + 3, [Y, Z]), run_id=3)
    t4 = SpecTree(P + 2)
    t4.add(Y, -1, p=0.05)
    ids4, _, _ = attach(g, s.pool, s.b, t4, run_id=4)
    assert g.dead_runs() == []
    g.set_result(1, rows(A))
    g.advance()
    assert g.dead_runs() == []                    # e died, but run 2 has live nodes
    g.set_result(2, rows(B, X, Z, Z, Z))
    g.advance()
    assert all(g.nodes[i].state == DEAD for i in ids3)
    assert all(g.nodes[i].state == DEAD for i in ids4)
    assert g.dead_runs() == [3, 4]                # run 2 returned: not reported
    assert g.dead_runs() == []
    assert g.runs[3].cancelled and g.runs[4].cancelled and not g.runs[2].cancelled


def test_pending_run_with_live_nodes_not_cancelled():
    s = Scenario()
    g = s.g
    ids3, _, _ = attach(g, s.pool, s.c, chain_tree(P + 3, [Y]), run_id=3)
    g.set_result(1, rows(A))
    g.set_result(2, rows(B, C), output_nodes=[s.a, s.b])  # no logits at c yet
    assert g.advance() == [Decision(A, s.a), Decision(B, s.b), Decision(C, s.c)]
    assert g.committed == s.c
    assert g.dead_runs() == []
    assert g.nodes[ids3[0]].state == PENDING


def test_root_run_never_cancelled():
    g = greedy_graph()
    r = g.add_root(R, P, run_id=1)
    g.nodes[r].state = DEAD                       # even if it somehow died
    assert g.dead_runs() == []


def test_tree_anchored_at_dead_node_is_born_dead():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(A))
    g.advance()                                   # e is dead now
    ids, _, _ = attach(g, s.pool, s.e, chain_tree(P + 1, [Y, Z]), run_id=3)
    assert all(g.nodes[i].state == DEAD for i in ids)
    assert g.frontier() == s.c                    # never speculates below dead nodes
    assert g.dead_runs() == [3]
    # its logits, if they come anyway, are dropped
    g.set_result(3, rows(Z, Z))
    assert all(g.nodes[i].logits is None for i in ids)


def test_retirable_only_when_nothing_committed_or_pending():
    s = Scenario()
    g = s.g
    assert g.retirable() == []                    # nothing returned
    g.set_result(1, rows(A))
    assert g.retirable() == []                    # root still committed
    g.advance()                                   # committed: a (run 2, not returned)
    done = g.retirable()
    assert [i.run_id for i in done] == [1] and done[0].partition is None
    assert 1 not in g.runs
    assert g.retirable() == []                    # reported once
    g.set_result(2, rows(B, C), output_nodes=[s.a, s.b])   # c's logits not asked for
    assert g.retirable() == []                    # a committed, b..d pending
    assert g.advance() == [Decision(B, s.b), Decision(C, s.c)]
    assert g.committed == s.c
    assert g.retirable() == []                    # c is committed: its run's cells still matter
    (y,), _, _ = attach(g, s.pool, s.c, chain_tree(P + 3, [Y]), run_id=3)
    g.set_result(3, rows(Z))
    # run 3 returned with y pending below c: nothing retirable yet
    assert g.retirable() == []
    g.kill_all_pending()                          # e.g. a new root replaces the chain
    g.add_root(X, P + 4, run_id=4)
    assert sorted(i.run_id for i in g.retirable()) == [2, 3]
    assert sorted(g.runs) == [4]


def test_retirable_after_rejection():
    s = Scenario()
    g = s.g
    ids3, _, part3 = attach(g, s.pool, s.c, chain_tree(P + 3, [Y]), run_id=3)
    g.set_result(1, rows(A))
    g.set_result(2, rows(B, X, Z, Z, Z))
    g.advance()
    assert g.committed is None
    got = g.retirable()
    assert sorted(i.run_id for i in got) == [1, 2]
    assert [i.partition for i in got if i.run_id == 2] == [s.part]
    assert g.dead_runs() == [3]
    assert g.retirable() == []                    # cancelled but not returned yet
    g.set_result(3, None)                         # came back cancelled
    got = g.retirable()
    assert [i.run_id for i in got] == [3] and got[0].partition == part3
    assert g.runs == {}
    for info in [*got]:
        s.pool.release(info.partition)


def test_continuous_speculation_accepts_across_runs():
    """Run 2: a -> b below the root; run 3: c -> d below b (run 2's leaf),
    launched before run 2 returned; results arrive in order."""
    g = greedy_graph()
    pool = PartitionPool(n_seq_max=5, width=2)
    r = g.add_root(R, P, run_id=1)
    (a, b), ls2, p2 = attach(g, pool, r, chain_tree(P, [A, B], [0.9, 0.9]), run_id=2)
    assert g.frontier() == b
    (c, d), ls3, p3 = attach(g, pool, b, chain_tree(P + 2, [C, D], [0.8, 0.8]), run_id=3)
    assert g.frontier() == d and g.chain(d) == [a, b, c, d]
    assert p2 != p3
    s2, s3 = ls2[1], ls3[1]
    assert g.nodes[a].seq == g.nodes[b].seq == s2 and g.nodes[c].seq == g.nodes[d].seq == s3
    out = []
    g.set_result(1, rows(A))
    out += g.advance()
    g.set_result(2, rows(B, C))
    out += g.advance()
    assert g.committed == c
    assert g.take_swap_ops() == [(s2, P + 1, P + 3), (s3, P + 3, P + 4)]
    g.set_result(3, rows(D, Y))
    out += g.advance()
    assert out == [Decision(A, a), Decision(B, b), Decision(C, c), Decision(D, d), Decision(Y, None)]
    assert g.take_swap_ops() == [(s3, P + 4, P + 5)]
    assert g.draft_stats.n_accepted == 4 and g.dead_runs() == []
    assert sorted(i.run_id for i in g.retirable()) == [1, 2, 3]


def test_swap_ops_merge_only_contiguous_same_sequence():
    """a is first put in the sequence of the d-branch (first leaf), b and c in
    the c-branch's: accepting a, b, c gives one range per sequence."""
    g = greedy_graph()
    r = g.add_root(R, P, run_id=1)
    t = SpecTree(P)
    a = t.add(A, -1)
    t.add(D, a)        # leaf 1
    b = t.add(B, a)
    t.add(C, b)        # leaf 3
    *_, leaf_seq = t.batch([1, 2])
    assert leaf_seq == {1: 1, 3: 2}
    na, nd, nb, nc = g.add_tree(r, t, 2, leaf_seq, 0, [1, 2])
    assert [g.nodes[i].seq for i in (na, nd, nb, nc)] == [1, 1, 2, 2]
    g.set_result(1, rows(A))
    g.set_result(2, rows(B, Z, C, Y))
    assert [x.token for x in g.advance()] == [A, B, C, Y]
    assert g.take_swap_ops() == [(1, P + 1, P + 2), (2, P + 2, P + 4)]


def test_set_result_row_count_and_output_nodes():
    s = Scenario()
    g = s.g
    with pytest.raises(ValueError):
        g.set_result(2, rows(B, C))
    # only a and b asked for logits
    g.set_result(2, rows(B, X), output_nodes=[s.a, s.b])
    assert g.nodes[s.c].logits is None and g.nodes[s.a].logits is not None
    g.set_result(1, rows(A))
    assert g.advance() == [Decision(A, s.a), Decision(B, s.b), Decision(X, None)]


def test_synchronous_speculative_run_carries_root():
    """The root token and its tree in one run: rows for root first."""
    g = greedy_graph()
    r = g.add_root(R, P, run_id=7)
    (a, b), ls, _ = attach(g, PartitionPool(3, 2), r, chain_tree(P, [A, B]), run_id=7)
    info = g.runs[7]
    assert info.speculative and info.nodes == [r, a, b]
    g.set_result(7, rows(A, B, Y))
    assert g.advance() == [Decision(A, a), Decision(B, b), Decision(Y, None)]
    g.kill_all_pending()
    assert g.dead_runs() == []                    # carries the root: never cancelled
    assert [i.run_id for i in g.retirable()] == [7]


def test_kill_all_pending():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(A))
    g.advance()
    g.kill_all_pending()
    assert s.state(s.a, s.b, s.c, s.d, s.e) == [ACCEPTED, DEAD, DEAD, DEAD, DEAD]
    assert g.frontier() == s.a


def test_chain_rejects_non_descendant():
    s = Scenario()
    g = s.g
    g.set_result(1, rows(A))
    g.advance()
    assert g.chain(s.a) == []
    with pytest.raises(ValueError):
        g.chain(s.e)                              # sibling branch of the committed node
    with pytest.raises(ValueError):
        g.chain(s.r)                              # above it


def test_tree_anchored_at_decided_node_is_born_dead():
    """The engine drafts below frontier() = b; before it attaches the tree,
    results arrive and advance() decides past b (here: b's logits pick C, no
    node carried it, a new root follows). The late tree at b can never be
    verified: like a tree anchored at a dead node it must be born dead, so
    that dead_runs() cancels it and retirable() frees its partition."""
    g = greedy_graph()
    pool = PartitionPool(n_seq_max=9, width=2)
    r = g.add_root(R, P, run_id=1)
    (a, b), _, _ = attach(g, pool, r, chain_tree(P, [A, B]), run_id=2)
    assert g.frontier() == b
    g.set_result(1, rows(A))
    g.set_result(2, rows(B, C))
    assert g.advance() == [Decision(A, a), Decision(B, b), Decision(C, None)]
    g.add_root(C, P + 3, run_id=3)
    ids, _, part = attach(g, pool, b, chain_tree(P + 2, [C, D]), run_id=4)   # stale anchor b
    assert all(g.nodes[i].state == DEAD for i in ids)
    assert g.dead_runs() == [4]
    g.set_result(4, None)
    assert 4 in [i.run_id for i in g.retirable()]


def test_graph_is_trimmed_behind_the_committed_prefix():
    """A long request keeps a bounded graph. Nodes far
    behind the committed node that no run still holds are dropped
    (:meth:`SpecGraph.trim`, called by the core after each result); node
    ids stay unique and the recent nodes stay readable."""
    from ggpipe.speculation.graph import TRIM_LAG

    g = greedy_graph()
    pool = PartitionPool(n_seq_max=9, width=2)
    committed = g.add_root(R, 0, run_id=1)
    g.set_result(1, rows(A))
    peak, seen = 0, set()
    for rid in range(2, 3002):
        t = SpecTree(g.nodes[committed].pos)
        t.add(A, -1, p=0.6)
        t.add(B, -1, p=0.3)
        ids, _, _ = attach(g, pool, committed, t, run_id=rid)
        assert not seen & set(ids)
        seen |= set(ids)
        assert g.advance() == [Decision(A, ids[0])]
        g.set_result(rid, rows(A, B))      # A's logits: A again below it
        for info in g.retirable():
            if info.partition is not None:
                pool.release(info.partition)
        g.trim()
        committed = g.committed
        peak = max(peak, len(g.nodes))
    assert g.nodes[committed].pos == 3000
    assert peak <= 2 * (TRIM_LAG + TRIM_LAG // 4) + 8, peak   # two nodes a position
    assert g.frontier() == committed and g.chain(committed) == []
    assert g.nodes.get(0) is None           # the first root is long gone
