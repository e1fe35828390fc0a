"""The order in which llama.cpp computes a micro-batch's rows on a KV cache
of one stream per sequence (the ``--parallel`` slots), checked on real
weights against the model the scheduler plans with
(:func:`ggpipe.runs.ubatches`, ``llama_batch_allocr::split_equal``): a
non-last stage's hidden states come out ubatch after ubatch, so a
micro-batch of slot tokens followed by a prompt chunk is passed on in batch
order only where the model says so."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.runs import in_batch_order, ubatches
from ggpipe.runtime.stage import KV_CLEAR, Stage, StageSpec

HISTORY = {0: [504, 3575, 282], 1: [4649, 314, 2155], 3: [7042, 282, 504]}   # slots that generate
NEXT = {0: 314, 1: 3575, 3: 2155}                                             # their next tokens
PROMPT = [504, 4649, 7042, 282]                                               # slot 2's prompt


def _decode(stage, rows):
    """rows: (seq, pos, token) in batch order -> float32 (n, n_embd) hidden states as captured."""
    n = len(rows)
    return stage.decode(tokens=np.array([t for _, _, t in rows], np.int32),
                        pos=np.array([p for _, p, _ in rows], np.int32), n_seq_id=np.ones(n, np.int32),
                        seq_ids=np.array([s for s, _, _ in rows], np.int32), outputs=np.ones(n, np.int8))


def _history(stage, group):
    stage.kv(KV_CLEAR)
    for s in group:
        _decode(stage, [(s, p, t) for p, t in enumerate(HISTORY[s])])


@pytest.mark.parametrize("group,in_order", [((0, 1), True), ((0, 3), True), ((0, 1, 3), False), ((1, 3), False)])
def test_llama_cpp_computes_the_rows_in_the_order_ggpipe_models(smollm2, group, in_order):
    """Slot 2's prompt after the tokens of ``group``: it joins their ubatch after their ids (0, 1), goes apart
    (0, 3), or fills a gap among them (0, 1, 3 and 1, 3: its first row is computed before slot 3's)."""
    stage = Stage(StageSpec(model_path=smollm2, n_layer=12, first=True, last=False, n_ctx=1024, n_seq_max=4,
                            kv_unified=False))
    try:
        batch = [(s, len(HISTORY[s]), NEXT[s]) for s in group] + [(2, p, t) for p, t in enumerate(PROMPT)]
        alone = []     # each sequence's rows in a batch of their own
        for s in group:
            _history(stage, group)
            alone.append(_decode(stage, [batch[group.index(s)]]))
        _history(stage, group)
        alone.append(_decode(stage, batch[len(group):]))
        alone = np.concatenate(alone)
        _history(stage, group)
        mixed = _decode(stage, batch)
        seqs = [s for s, _, _ in batch]
        order = [i for u in ubatches(seqs, 512) for i in u]
        assert np.array_equal(mixed, alone[order])      # rows as the model says llama.cpp computes them, bit for bit
        assert in_batch_order(seqs, 512) == in_order
    finally:
        stage.close()
