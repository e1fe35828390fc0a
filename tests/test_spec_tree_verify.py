"""SpecTree (positions, paths, leaves, the one-sequence-per-leaf batch) and
token-tree verification (greedy verify_step, walk_tree). MPI-free, fast.
The distribution of stochastic verification is in test_spec_statistics.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.tree import SpecTree
from ggpipe.speculation.verify import verify_step, walk_tree

V = 16


def onehot(t: int, hi: float = 5.0, n: int = V) -> np.ndarray:
    x = np.zeros(n, dtype=np.float32)
    x[t] = hi
    return x


def greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0.0))


def example_tree(anchor_pos: int = 10) -> SpecTree:
    """      anchor(10)
             /       \\
           a0(11)    e4(11)
           |
           b1(12)
          /     \\
        c2(13)  d3(13)
    """
    t = SpecTree(anchor_pos)
    a = t.add(1, -1, p=0.6)
    b = t.add(2, a, p=0.5)
    t.add(3, b, p=0.4)
    t.add(4, b, p=0.3)
    t.add(5, -1, p=0.2)
    return t


# ---- SpecTree --------------------------------------------------------------

def test_positions_depth_paths_leaves():
    t = example_tree()
    assert len(t) == 5
    assert [t.depth(i) for i in range(5)] == [1, 2, 3, 3, 1]
    assert [t.pos(i) for i in range(5)] == [11, 12, 13, 13, 11]
    assert t.leaves() == [2, 3, 4]
    assert t.path(2) == [0, 1, 2] and t.path(3) == [0, 1, 3] and t.path(4) == [4]
    assert t.path_tokens(3) == [1, 2, 4]
    assert t.children(-1) == [0, 4] and t.children(1) == [2, 3] and t.children(2) == []
    assert t.max_pos() == 13
    assert t.draft_p == [0.6, 0.5, 0.4, 0.3, 0.2]


def test_empty_tree():
    t = SpecTree(7)
    assert len(t) == 0 and t.leaves() == [] and t.max_pos() == 7
    toks, pos, nsid, sids, leaf_seq = t.batch([])
    assert toks.size == pos.size == nsid.size == sids.size == 0 and leaf_seq == {}


def test_add_rejects_missing_parent():
    t = SpecTree(0)
    with pytest.raises(ValueError):
        t.add(1, 0)        # no node 0 yet
    t.add(1, -1)
    with pytest.raises(ValueError):
        t.add(2, -2)
    with pytest.raises(ValueError):
        t.add(2, 1)


def test_add_keeps_draft_probability():
    t = SpecTree(0)
    i = t.add(np.int64(3), -1, p=np.float32(0.25))
    assert t.draft_p[i] == 0.25
    assert type(t.tokens[i]) is int and type(t.draft_p[i]) is float


def test_batch_one_sequence_per_leaf():
    t = example_tree()
    toks, pos, nsid, sids, leaf_seq = t.batch([5, 6, 7, 8])   # one spare id
    assert toks.dtype == pos.dtype == nsid.dtype == sids.dtype == np.int32
    assert toks.tolist() == [1, 2, 3, 4, 5]
    assert pos.tolist() == [11, 12, 13, 13, 11]
    assert leaf_seq == {2: 5, 3: 6, 4: 7}
    # a0 and b1 lie on the two branches c2 and d3: both sequences
    assert nsid.tolist() == [2, 2, 1, 1, 1]
    per_node = np.split(sids, np.cumsum(nsid)[:-1])
    assert [sorted(s.tolist()) for s in per_node] == [[5, 6], [5, 6], [5], [6], [7]]
    assert int(nsid.sum()) == sids.size


def test_batch_too_few_sequences():
    with pytest.raises(ValueError):
        example_tree().batch([1, 2])


@st.composite
def trees(draw):
    n = draw(st.integers(1, 12))
    t = SpecTree(draw(st.integers(0, 100)))
    for i in range(n):
        t.add(draw(st.integers(0, V - 1)), draw(st.integers(-1, i - 1)))
    return t


@settings(max_examples=150, deadline=None)
@given(trees())
def test_batch_is_tree_attention(t):
    """Every node's sequences are exactly those of the leaves below it; a node
    shares a sequence with another node iff one is an ancestor of the other
    (so the per-sequence causal mask is tree attention); parents come first
    and positions are the parent's + 1."""
    leaves = t.leaves()
    seq_ids = [100 + 3 * i for i in range(len(leaves))]
    toks, pos, nsid, sids, leaf_seq = t.batch(seq_ids)
    n = len(t)
    assert toks.tolist() == t.tokens
    assert set(leaf_seq) == set(leaves) and sorted(leaf_seq.values()) == seq_ids
    per_node = [set(s.tolist()) for s in np.split(sids, np.cumsum(nsid)[:-1])] if n else []
    assert all(len(s) == k for s, k in zip(per_node, nsid.tolist()))  # no duplicate ids within a node

    def ancestors_or_self(i):
        return set(t.path(i))

    for i in range(n):
        below = {leaf_seq[leaf] for leaf in leaves if i in t.path(leaf)}
        assert per_node[i] == below and below
        p = t.parent[i]
        assert p < i
        assert pos[i] == (t.anchor_pos + 1 if p == -1 else pos[p] + 1)
        for j in range(n):
            related = i in ancestors_or_self(j) or j in ancestors_or_self(i)
            assert bool(per_node[i] & per_node[j]) == related, (i, j)


# ---- verify_step, greedy ----------------------------------------------------

def test_greedy_accepts_child_with_argmax():
    s = greedy()
    assert verify_step(onehot(7), [3, 7, 9], s) == (7, 1)
    assert verify_step(onehot(3), [3, 7, 9], s) == (3, 0)


def test_greedy_no_matching_child():
    assert verify_step(onehot(4), [3, 7], greedy()) == (4, None)
    assert verify_step(onehot(4), [], greedy()) == (4, None)


def test_greedy_duplicates_pick_first_and_tie_first_index():
    s = greedy()
    assert verify_step(onehot(5), [1, 5, 5], s) == (5, 1)
    x = np.zeros(V, dtype=np.float32)
    x[[2, 9]] = 3.0                    # tie: first index, like llama.cpp's greedy
    assert verify_step(x, [9, 2], s) == (2, 1)


def test_greedy_advances_the_output_index_by_one():
    s = greedy()
    for i in range(10):
        assert verify_step(onehot(6), [6, 1], s) == (6, 0)
        assert s.index == i + 1
    assert isinstance(verify_step(onehot(6), [6], s)[0], int)


def test_greedy_matches_plain_argmax_on_random_logits():
    rng = np.random.default_rng(0)
    s = greedy()
    for _ in range(200):
        x = rng.normal(0, 2, V).astype(np.float32)
        kids = rng.integers(0, V, size=rng.integers(0, 4)).tolist()
        t, k = verify_step(x, kids, s)
        assert t == int(np.argmax(x))
        assert k == (kids.index(t) if t in kids else None)


# ---- verify_step, stochastic: edge cases ----------------------------------------

def stoch(seed=0, **kw) -> Sampler:
    kw = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, **kw}
    return Sampler(SamplingParams(seed=seed, **kw))


def test_stochastic_no_children_samples_target():
    s = stoch(seed=3, temperature=0.5)
    x = np.random.default_rng(1).normal(0, 1, V).astype(np.float32)
    ref = stoch(seed=3, temperature=0.5)
    for _ in range(20):
        t, k = verify_step(x, [], s)
        assert k is None and t == ref.sample(x)


def test_stochastic_decides_what_plain_sampling_decides_whatever_was_drafted():
    """Drafter invariance: the decided token is the sampler's own keyed draw
    at the position, so any children (none, the right one, wrong ones, many)
    leave the decided tokens those of plain sampling with the same seed."""
    rng = np.random.default_rng(2)
    rows = [rng.normal(0, 2, V).astype(np.float32) for _ in range(300)]
    plain = stoch(seed=11, top_k=6)
    expected = [plain.sample(x) for x in rows]
    for offer in (lambda t: [], lambda t: [t], lambda t: [(t + 1) % V], lambda t: rng.integers(0, V, 3).tolist()):
        s = stoch(seed=11, top_k=6)
        got = []
        for x, want in zip(rows, expected):
            kids = offer(want)
            t, k = verify_step(x, kids, s)
            got.append(t)
            assert k == (kids.index(t) if t in kids else None)
        assert got == expected


def test_stochastic_never_accepts_zero_probability_token():
    s = stoch(seed=5, top_k=3)
    x = np.arange(V, dtype=np.float32)          # top-3: tokens 13..15
    for _ in range(200):
        t, k = verify_step(x, [0, 0], s)        # the draft insists on token 0
        assert k is None and t in (13, 14, 15)


def test_stochastic_reproducible_with_seed_and_keyed_by_position():
    rng = np.random.default_rng(9)
    x = rng.normal(0, 1, V).astype(np.float32)
    kids = rng.integers(0, V, size=(100, 3)).tolist()
    runs = []
    for _ in range(2):
        s = stoch(seed=42)
        runs.append([verify_step(x, k, s) for k in kids])
    assert runs[0] == runs[1]
    assert all(isinstance(t, int) for t, _ in runs[0])
    assert len({t for t, _ in runs[0]}) > 1        # the same row, other positions: other draws
    later = Sampler(SamplingParams(seed=42, temperature=1.0, top_k=0, top_p=1.0), history=range(50))
    for _ in range(50):
        later.accept(0)                        # 50 tokens decided (the prompt before them does not count)
    assert [later.sample(x) for _ in range(50)] == [t for t, _ in runs[0][50:]]   # the output index keys the draw


# ---- walk_tree ------------------------------------------------------------------

class Toy:
    """Nodes 0 (start), 1.. with tokens/children/logits in dicts."""

    def __init__(self, tokens, children, logits):
        self.tokens, self.kids, self.logits = tokens, children, logits

    def walk(self, start, sampler):
        return walk_tree(lambda n: self.kids.get(n, []), lambda n: self.tokens[n], lambda n: self.logits.get(n),
                         start, sampler)


def test_walk_tree_stops_when_logits_missing():
    # 0 -> {1:a=3, 2:b=4}; 1 -> {3:c=5}; logits at 0 and 1 pick 3 then 5; 3's missing
    toy = Toy({0: 0, 1: 3, 2: 4, 3: 5}, {0: [1, 2], 1: [3]}, {0: onehot(3), 1: onehot(5)})
    assert toy.walk(0, greedy()) == ([3, 5], [1, 3], False)


def test_walk_tree_ends_on_rejection():
    toy = Toy({0: 0, 1: 3, 2: 4, 3: 5}, {0: [1, 2], 1: [3]},
              {0: onehot(4), 2: onehot(9), 3: onehot(0)})
    assert toy.walk(0, greedy()) == ([4, 9], [2], True)
    toy.logits[0] = onehot(8)
    assert toy.walk(0, greedy()) == ([8], [], True)


def test_walk_tree_missing_start_logits():
    toy = Toy({0: 0}, {}, {})
    assert toy.walk(0, greedy()) == ([], [], False)


def test_walk_tree_leaf_with_logits_samples_bonus_token():
    toy = Toy({0: 0, 1: 3}, {0: [1]}, {0: onehot(3), 1: onehot(11)})
    assert toy.walk(0, greedy()) == ([3, 11], [1], True)


def test_walk_tree_under_sampling_decides_what_plain_sampling_decides():
    """Under sampling each position is decided by the sampler's keyed draw,
    so the walk decides the tokens plain sampling with the same seed decides."""
    toy = Toy({0: 0, 1: 3, 2: 5}, {0: [1], 1: [2]}, {0: onehot(3, 1.0), 1: onehot(5, 1.0), 2: onehot(7, 1.0)})
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=4)
    tokens, nodes, complete = toy.walk(0, Sampler(params))
    plain = Sampler(params)
    expected = []
    for n in [0, 1, 2]:
        expected.append(plain.sample(toy.logits[n]))
        if n + 1 > 2 or expected[-1] != toy.tokens[n + 1]:
            break
    assert complete and tokens == expected and nodes == [1, 2][:len(tokens) - 1]
