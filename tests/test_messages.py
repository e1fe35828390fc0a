"""Message layouts: round trips, validation, and fuzzing (no MPI)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ggpipe.errors import ProtocolError
from ggpipe.transport import messages as m


def _header(n=3, seqs=((0,), (0, 1), (2,)), run_id=7, payload=m.PAYLOAD_EMBD):
    n_seq_id = np.array([len(s) for s in seqs], dtype=np.int32)
    return m.DecodeHeader(
        run_id=run_id,
        pos=np.arange(10, 10 + n, dtype=np.int32),
        n_seq_id=n_seq_id,
        seq_ids=np.array([x for s in seqs for x in s], dtype=np.int32),
        outputs=np.array([0, 1, 1], dtype=np.int8),
        payload=payload,
    )


def test_decode_round_trip():
    h = _header()
    msg = m.encode_decode(h)
    assert msg.dtype == np.int32 and msg[0] == m.MAGIC and msg[1] == m.T_DECODE
    g = m.decode_decode(msg, n_seq_max=4, max_tokens=8)
    assert g.run_id == 7 and g.payload == m.PAYLOAD_EMBD and g.n_outputs == 2
    for a in ("pos", "n_seq_id", "seq_ids", "outputs"):
        np.testing.assert_array_equal(getattr(g, a), getattr(h, a))


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda a: a.__setitem__(0, 1), "magic"),
        (lambda a: a.__setitem__(1, m.T_KV), "tag"),
        (lambda a: a.__setitem__(3, 99), "tokens"),
        (lambda a: a.__setitem__(5, 7), "payload"),
        (lambda a: a.__setitem__(6, -1), "reply_k"),
        (lambda a: a.__setitem__(6, 100_000), "reply_k"),
        (lambda a: a.__setitem__(m.DECODE_FIXED, -1), "negative"),
        (lambda a: a.__setitem__(m.DECODE_FIXED + 3 + 1, 9), "sequence"),
        (lambda a: a.__setitem__(-1, 3), "output flags"),
    ],
)
def test_decode_rejects_bad_fields(mutate, needle):
    msg = m.encode_decode(_header()).copy()
    mutate(msg)
    with pytest.raises(ProtocolError, match=needle):
        m.decode_decode(msg, n_seq_max=4, max_tokens=8)


def test_decode_rejects_sequence_ids_beyond_n_seq_max():
    with pytest.raises(ProtocolError, match="sequence id"):
        m.decode_decode(m.encode_decode(_header()), n_seq_max=2, max_tokens=8)


def test_logits_kv_simple_round_trips():
    lh = m.LogitsHeader(run_id=3, n_outputs=2, n_vocab=100)
    assert m.decode_logits(m.encode_logits(lh), 100, 4) == lh
    with pytest.raises(ProtocolError, match="n_vocab"):
        m.decode_logits(m.encode_logits(lh), 101, 4)
    with pytest.raises(ProtocolError, match="rows"):
        m.decode_logits(m.encode_logits(lh), 100, 1)
    kh = m.KvHeader(op=2, seq=0, seq_dst=3, p0=0, p1=12, run_id=9)
    assert m.decode_kv(m.encode_kv(kh), 4) == kh
    with pytest.raises(ProtocolError, match="sequence id"):
        m.decode_kv(m.encode_kv(kh), 3)
    assert m.decode_simple(m.encode_simple(m.T_SHUTDOWN, 5), m.T_SHUTDOWN) == 5


decoders = [
    lambda a: m.decode_decode(a, 4, 64),
    lambda a: m.decode_logits(a, 100, 8),
    lambda a: m.decode_kv(a, 4),
    lambda a: m.decode_simple(a, m.T_SHUTDOWN),
    lambda a: m.decode_prune(a, 4),
]


@settings(max_examples=300, deadline=None)
@given(arrays(np.int32, st.integers(0, 80), elements=st.integers(-(2**31), 2**31 - 1)), st.sampled_from(range(5)))
def test_fuzz_random_frames_give_protocol_errors_only(frame, which):
    try:
        decoders[which](frame)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6), st.integers(0, 200), st.data())
def test_fuzz_truncated_and_mutated_valid_frames(n, cut, data):
    seqs = [tuple(sorted(set(data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))))) for _ in range(n)]
    h = m.DecodeHeader(
        run_id=data.draw(st.integers(0, 2**31 - 1)),
        pos=np.array(data.draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n)), dtype=np.int32),
        n_seq_id=np.array([len(s) for s in seqs], dtype=np.int32),
        seq_ids=np.array([x for s in seqs for x in s], dtype=np.int32),
        outputs=np.array(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.int8),
        payload=m.PAYLOAD_TOKENS,
    )
    msg = m.encode_decode(h)
    g = m.decode_decode(msg, 4, 64)
    np.testing.assert_array_equal(g.seq_ids, h.seq_ids)
    bad = msg[: min(cut, msg.shape[0] - 1)].copy()
    with pytest.raises(ProtocolError):
        m.decode_decode(bad, 4, 64)
    if msg.shape[0] > 6:
        i = data.draw(st.integers(6, msg.shape[0] - 1))
        mutated = msg.copy()
        mutated[i] = data.draw(st.integers(-(2**31), 2**31 - 1))
        try:
            m.decode_decode(mutated, 4, 64)
        except ProtocolError:
            pass


# -- the native batch filler never writes out of bounds ------------------------

@pytest.fixture(scope="module")
def batch():
    from ggpipe.runtime import llama

    L = llama.lib()
    native = llama.native()
    b = L.llama_batch_init(8, 0, 4)
    import ctypes

    yield native, ctypes.addressof(b), b
    L.llama_batch_free(b)


def _arrays(n, nseq=1):
    return (
        np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.int32),
        np.full(n, nseq, dtype=np.int32),
        np.zeros(n * nseq, dtype=np.int32),
        np.ones(n, dtype=np.int8),
    )


def test_fill_batch_writes_a_valid_tree_batch(batch):
    native, addr, b = batch
    tok = np.array([5, 6, 7], dtype=np.int32)
    pos = np.array([3, 4, 4], dtype=np.int32)
    nseq = np.array([2, 1, 1], dtype=np.int32)
    seq = np.array([1, 2, 1, 2], dtype=np.int32)
    out = np.array([0, 1, 1], dtype=np.int8)
    assert native.fill_batch(addr, 8, 0, 4, tok, None, pos, nseq, seq, out) == 3
    assert b.n_tokens == 3
    assert [b.token[i] for i in range(3)] == [5, 6, 7]
    assert [b.seq_id[0][j] for j in range(2)] == [1, 2]
    assert b.seq_id[2][0] == 2 and b.logits[0] == 0


@pytest.mark.parametrize(
    "case,needle",
    [
        ("too_many", "capacity"),
        ("seq_range", "sequence id"),
        ("nseq_range", "sequences"),
        ("seq_count", "seq_ids"),
        ("neg_pos", "negative"),
        ("len_mismatch", "tokens"),
        ("both", "exactly one"),
        ("dtype", "byte items"),
    ],
)
def test_fill_batch_rejects_bad_input(batch, case, needle):
    native, addr, _ = batch
    tok, pos, nseq, seq, out = _arrays(3)
    embd = None
    if case == "too_many":
        tok, pos, nseq, seq, out = _arrays(9)
    elif case == "seq_range":
        seq[1] = 4
    elif case == "nseq_range":
        nseq[0] = 5
    elif case == "seq_count":
        seq = seq[:2]
    elif case == "neg_pos":
        pos[2] = -1
    elif case == "len_mismatch":
        tok = tok[:2]
    elif case == "both":
        embd = np.zeros(3, dtype=np.float32)
    elif case == "dtype":
        pos = pos.astype(np.int64)
    with pytest.raises(ValueError, match=needle):
        native.fill_batch(addr, 8, 0, 4, tok, embd, pos, nseq, seq, out)
