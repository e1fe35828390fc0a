"""Compact greedy results (ggpipe/logits.py): the k best of a row and its
log-sum-exp give the same greedy decisions as the full row, survive the
LOGITS message, and are refused where a full row is needed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggpipe.logits import MAX_REPLY_K, TopRow, argmax, best, pack, reply_k_for, top_k, unpack
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.verify import verify_step
from ggpipe.transport import messages as m


def rows(seed: int, n: int = 3, v: int = 300, ties: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (n, v)).astype(np.float32)
    if ties:  # few distinct values: ties everywhere, also at the maximum
        x = np.round(x).astype(np.float32)
    return x


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.booleans())
def test_top_k_is_the_argmax_then_the_best_by_logit_and_id(seed, k, ties):
    x = rows(seed, ties=ties)
    t = top_k(x, k)
    assert t.shape == x.shape and t.k == k and len(t) == 3
    for i in range(3):
        assert t.ids[i, 0] == np.argmax(x[i])  # first index among ties: llama_sampler_greedy_apply's choice
        assert argmax(t[i]) == argmax(x[i]) == int(np.argmax(x[i]))
        np.testing.assert_array_equal(t.values[i], x[i][t.ids[i]])
        assert len(set(t.ids[i].tolist())) == k
        # no token outside the k has a larger logit than one inside, and the rest are in order
        assert x[i][t.ids[i]].min() >= np.delete(x[i], t.ids[i]).max()
        rest = t.ids[i, 1:]
        assert all((x[i][a], -a) >= (x[i][b], -b) for a, b in zip(rest, rest[1:]))
        expect = np.log(np.exp(x[i].astype(np.float64)).sum())
        assert t.lse[i] == pytest.approx(expect, rel=1e-6, abs=1e-5)


def test_k_is_capped_at_the_vocabulary():
    x = rows(1, n=2, v=6)
    t = top_k(x, 50)
    assert t.k == 6 and sorted(t.ids[0].tolist()) == list(range(6))


def test_pack_unpack_round_trip_and_refusals():
    t = top_k(rows(2), 5)
    flat = pack(t)
    assert flat.dtype == np.float32 and flat.shape == (3 * 11,)
    u = unpack(flat, 3, 5, 300)
    np.testing.assert_array_equal(u.ids, t.ids)
    np.testing.assert_array_equal(u.values, t.values)
    np.testing.assert_array_equal(u.lse, t.lse)
    with pytest.raises(ValueError, match="expected 3 x 11"):
        unpack(flat[:-1], 3, 5, 300)
    bad = flat.copy()
    bad[0] = np.array([999], np.int32).view(np.float32)[0]
    with pytest.raises(ValueError, match="outside 0..299"):
        unpack(bad, 3, 5, 300)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 8))
def test_best_of_a_compact_row_equals_best_of_the_full_row(seed, k):
    x = rows(seed)[0]
    ids_full, p_full = best(x, k)
    ids_c, p_c = best(top_k(x[None], k)[0], k)
    np.testing.assert_array_equal(ids_full, ids_c)
    np.testing.assert_allclose(p_full, p_c, rtol=1e-5)
    full = np.exp(x.astype(np.float64) - x.max())
    np.testing.assert_allclose(p_full, full[ids_full] / full.sum(), rtol=1e-5)


def test_greedy_decisions_on_compact_rows_equal_full_rows():
    g = Sampler(SamplingParams(temperature=0.0))
    for seed in range(50):
        x = rows(seed, ties=seed % 2 == 0)[0]
        c = top_k(x[None], 1)[0]
        assert g.sample(c) == g.sample(x)
        kids = [int(np.argsort(-x)[j]) for j in (1, 0, 2)]
        assert verify_step(c, kids, g) == verify_step(x, kids, g)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 60), st.sampled_from([1.0, 0.95, 0.5]), st.booleans())
def test_top_k_sampling_of_a_compact_row_is_the_full_rows_distribution(seed, k, top_p, ties):
    """target_probs of the reply reply_k_for gives equals that of the full
    row, exactly (ties at the top-k cut included): the stochastic modes draw
    from the same distribution over the link's compact rows."""
    params = SamplingParams(temperature=0.7, top_k=k, top_p=top_p)
    x = rows(seed, ties=ties)[0]
    c = top_k(x[None], reply_k_for(False, k))[0]
    np.testing.assert_array_equal(target_probs(c, params), target_probs(x, params))


def test_sampling_refuses_a_compact_row_that_holds_too_little():
    s = Sampler(SamplingParams(temperature=0.8, top_k=10, seed=1))
    with pytest.raises(ValueError, match="ask for full rows"):
        s.sample(top_k(rows(3), 4)[0])
    assert reply_k_for(False, 0) == 0 and reply_k_for(False, MAX_REPLY_K + 1) == 0  # full rows then
    assert reply_k_for(True, 40) == 2 and reply_k_for(True, 40, width=3) == 4


def test_messages_carry_reply_k_and_top_k():
    h = m.DecodeHeader(5, np.arange(2, dtype=np.int32), np.ones(2, np.int32), np.zeros(2, np.int32),
                       np.array([0, 1], np.int8), m.PAYLOAD_EMBD, reply_k=3)
    assert m.decode_decode(m.encode_decode(h), n_seq_max=1, max_tokens=4).reply_k == 3
    lh = m.LogitsHeader(5, 1, 300, top_k=3)
    got = m.decode_logits(m.encode_logits(lh), 300, 4)
    assert got == lh and got.row_floats == 7
    assert m.LogitsHeader(5, 1, 300).row_floats == 300
    with pytest.raises(m.ProtocolError, match="top_k"):
        m.decode_logits(m.encode_logits(m.LogitsHeader(5, 1, 300, top_k=MAX_REPLY_K + 1)), 300, 4)
    with pytest.raises(m.ProtocolError, match="top_k"):
        m.decode_logits(m.encode_logits(m.LogitsHeader(5, 1, 10, top_k=11)), 10, 4)


def test_a_compact_row_is_small():
    """What the link carries per greedy token for SmolLM2 (n_vocab 49,152):
    a full row is 196,608 bytes; the target's argmax reply 12 bytes."""
    x = np.zeros((1, 49152), np.float32)
    assert pack(top_k(x, 1)).nbytes == 12 and x.nbytes == 196_608
    assert isinstance(top_k(x, 1)[0], TopRow)


def test_small_k_takes_argmaxes_and_keeps_the_order_of_ties():
    """Up to SMALL_K, top_k_sorted takes k argmaxes one by one: the same
    indices as the partition (value descending, ties by index), also with
    -inf in the row (where it falls back to the partition)."""
    import ggpipe.logits as L

    rng = np.random.default_rng(1)
    for trial in range(2000):
        n = int(rng.integers(2, 60))
        x = rng.integers(-3, 4, n).astype(np.float32)   # many ties
        if trial % 5 == 0:
            x[rng.integers(0, n, 2)] = -np.inf
        k = int(rng.integers(1, min(n, L.SMALL_K + 2) + 1))
        assert list(L.top_k_sorted(x, k)) == sorted(range(n), key=lambda i: (-x[i], i))[:k], (x, k)
