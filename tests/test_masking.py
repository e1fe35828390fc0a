"""Row masking of PipeDec layer runs in flight (ggpipe.pipeline.masking): the
prune message, the header flags and the logits' row indices, a stage's
bookkeeping, the head's local stage, and the graph's side. No MPI, no model;
real ranks are in tests/test_speculation_modes.py (the wide-tree layout)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ggpipe.errors import ProtocolError
from ggpipe.pipeline.driver import Pipeline
from ggpipe.pipeline.masking import PruneBook, live_batch, returned_rows, rows_in
from ggpipe.runs import Run
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.graph import DEAD, Decision, SpecGraph
from ggpipe.transport import messages as m


def _header(seqs, outputs=None, run_id=5):
    n = len(seqs)
    return m.DecodeHeader(run_id, np.full(n, 30, np.int32), np.array([len(s) for s in seqs], np.int32),
                          np.array([x for s in seqs for x in s], np.int32),
                          np.ones(n, np.int8) if outputs is None else np.array(outputs, np.int8), m.PAYLOAD_EMBD)


# -- messages -----------------------------------------------------------------------

def test_prune_message_round_trip_and_validation():
    msg = m.encode_prune([(7, 3), (8, 1)])
    assert msg[1] == m.T_PRUNE
    assert m.decode_prune(msg, n_seq_max=4) == [(7, 3), (8, 1)]
    assert m.decode_prune(m.encode_prune([]), 4) == []
    with pytest.raises(ProtocolError, match="sequence id"):
        m.decode_prune(m.encode_prune([(7, 0)]), 4)        # sequence 0 holds accepted tokens
    with pytest.raises(ProtocolError, match="sequence id"):
        m.decode_prune(m.encode_prune([(7, 4)]), 4)
    with pytest.raises(ProtocolError, match="pairs"):
        m.decode_prune(m.encode_prune([(7, 3)])[:-1], 4)
    with pytest.raises(ProtocolError, match="negative"):
        m.decode_prune(m.encode_prune([(-2, 3)]), 4)


def test_decode_header_carries_dropped_rows():
    h = _header([(1,), (2,), (3,)], outputs=[1, m.OUT_DROPPED, 1])
    g = m.decode_decode(m.encode_decode(h), n_seq_max=4, max_tokens=8)
    assert g.n_tokens == 3 and g.n_live == 2 and g.n_outputs == 2
    every = _header([(1,), (2,)], outputs=[m.OUT_DROPPED, m.OUT_DROPPED])
    with pytest.raises(ProtocolError, match="every row"):
        m.decode_decode(m.encode_decode(every), n_seq_max=4, max_tokens=8)
    every.payload = m.PAYLOAD_NONE     # the placeholder of a run that died on the way is fine
    assert m.decode_decode(m.encode_decode(every), n_seq_max=4, max_tokens=8).n_live == 0


def test_logits_header_with_rows():
    lh = m.LogitsHeader(3, 2, 100, top_k=4, rows=np.array([0, 2], np.int32))
    got = m.decode_logits(m.encode_logits(lh), 100, 8)
    assert got == lh and list(got.rows) == [0, 2]
    assert m.decode_logits(m.encode_logits(m.LogitsHeader(3, 2, 100)), 100, 8).rows is None
    with pytest.raises(ProtocolError, match="increasing"):
        m.decode_logits(m.encode_logits(m.LogitsHeader(3, 2, 100, rows=np.array([2, 0], np.int32))), 100, 8)
    with pytest.raises(ProtocolError, match="ints"):
        m.decode_logits(m.encode_logits(lh)[:-1], 100, 8)


# -- a stage's view -------------------------------------------------------------------

def test_a_row_dies_only_when_all_its_sequences_are_pruned():
    h = _header([(1, 2), (1,), (2,), (3,)])
    assert list(rows_in(h.n_seq_id, h.seq_ids, {1})) == [False, True, False, False]
    assert list(rows_in(h.n_seq_id, h.seq_ids, {1, 2})) == [True, True, True, False]
    assert list(rows_in(h.n_seq_id, h.seq_ids, set())) == [False] * 4


def test_prune_book_drops_rows_and_builds_the_live_batch():
    book = PruneBook()
    book.add([(5, 2), (5, 4), (4, 1), (9, 3)], done_below=4)   # run 4 was evaluated here already
    assert len(book) == 2
    h = _header([(1,), (2,), (3,), (4,)], outputs=[1, 1, 1, 1])
    keep = book.apply(h)
    assert list(keep) == [True, False, True, False] and book.rows_masked == 2
    assert list(h.outputs) == [1, m.OUT_DROPPED, 1, m.OUT_DROPPED] and h.n_live == 2
    b = live_batch(h)
    assert list(b["seq_ids"]) == [1, 3] and list(b["outputs"]) == [1, 1] and list(b["n_seq_id"]) == [1, 1]
    assert list(returned_rows(h)) == [0, 2]
    # a later stage learns one more pair: the incoming payload has 2 rows, 1 stays
    book.add([(5, 3)])
    keep = book.apply(h)
    assert list(keep) == [True, False] and list(returned_rows(h)) == [0]
    book.forget_through(9)
    assert len(book) == 0
    assert returned_rows(_header([(1,), (2,)])) is None


# -- the head's own stage --------------------------------------------------------------

class _GatedStage:
    """A local stage whose decodes wait for ``gate``; records the batches it got."""

    class _Hooks:
        def cancel(self):
            pass

        def clear_cancel(self):
            pass

    def __init__(self):
        self.hooks = self._Hooks()
        self.gate = threading.Event()
        self.batches = []

    def decode(self, tokens, pos, n_seq_id, seq_ids, outputs):
        assert self.gate.wait(10)
        self.batches.append((list(tokens), list(seq_ids)))
        out = np.zeros((int(np.count_nonzero(outputs)), 8), np.float32)
        out[np.arange(out.shape[0]), np.asarray(tokens)[np.asarray(outputs) == 1] % 8] = 1.0
        return out

    def kv(self, *a):
        pass


def test_the_heads_stage_masks_a_queued_run_and_reports_its_rows():
    stage = _GatedStage()
    p = Pipeline(stage, None, [], 8, n_seq_max=8, max_outputs=8, async_local=True)
    try:
        first = Run.linear([1], 10, seq=0)
        layer = Run.layer([3, 4, 5], 11, [1, 2, 3], speculative=True)
        p.submit(first)
        p.submit(layer)
        p.prune([(layer.run_id, 2)])     # the layer is queued behind the gated run
        stage.gate.set()
        p.wait(10)
        res = p.wait(10)
        assert stage.batches[1] == ([3, 5], [1, 3])
        assert list(res.rows) == [0, 2] and res.logits.shape == (2, 8)
        assert p.stats["rows_masked"] == 1
        # every row pruned: it comes back cancelled (the decoder cancels such runs too)
        gone = Run.layer([6], 12, [4], speculative=True)
        stage.gate.clear()
        p.submit(Run.linear([2], 11, seq=0))
        p.submit(gone)
        p.prune([(gone.run_id, 4)])
        p.cancel(gone.run_id)
        stage.gate.set()
        p.wait(10)
        assert p.wait(10).cancelled
    finally:
        p.close()


# -- the head's graph ---------------------------------------------------------------------

def _onehot(t: int) -> np.ndarray:
    row = np.zeros((1, 8), np.float32)
    row[0, t] = 1.0
    return row


def test_graph_reports_dead_rows_of_partly_dead_layers_once():
    """Root r; layer run 2 = {a, b} below r; layer run 3 = {a1, a2, b1} below
    a, a, b; both in flight. The target picks b: a, a1 and a2 die, and their
    rows are masked (each run keeps a live node); results carrying only the
    live rows are read by their batch indices."""
    g = SpecGraph(Sampler(SamplingParams(temperature=0.0)))
    r = g.add_root(9, 20, run_id=1)
    a, b = g.add_layer(2, [r, r], [1, 2], [0.6, 0.4], [1, 2], partition=0)
    a1, a2, b1 = g.add_layer(3, [a, a, b], [3, 4, 5], [0.5, 0.5, 0.9], [3, 4, 5], partition=1)
    assert g.maskable_rows() == []
    g.set_result(1, _onehot(2))         # the target picks b
    assert g.advance() == [Decision(2, b)]
    assert g.dead_runs() == []
    assert sorted(g.maskable_rows()) == [(2, 1), (3, 3), (3, 4)]
    assert g.maskable_rows() == []      # reported once
    g.set_result(2, _onehot(5), rows=np.array([1], np.int32))
    g.set_result(3, _onehot(6), rows=np.array([2], np.int32))
    assert g.nodes[a1].state == DEAD and g.nodes[a2].state == DEAD
    assert g.advance() == [Decision(5, b1), Decision(6, None)]


def test_graph_refuses_rows_that_drop_a_live_node():
    g = SpecGraph(Sampler(SamplingParams(temperature=0.0)))
    r = g.add_root(9, 20, run_id=1)
    g.add_layer(2, [r, r], [1, 2], [0.6, 0.4], [1, 2], partition=0)
    with pytest.raises(ValueError, match="live node"):
        g.set_result(2, np.zeros((1, 8), np.float32), rows=np.array([0], np.int32))
