"""A micro-batch's rows come back from a stage in batch order, on real
weights, whatever ubatches llama.cpp splits it into on a KV cache of one
stream per sequence (the ``--parallel`` slots): llama.cpp computes the
rows ubatch by ubatch, sequence after sequence
(``llama_batch_allocr::split_equal``), the non-last stage captures them in
that order, and puts them back where the model the stage plans with says
they came from (:func:`ggpipe.runs.ubatch_order`). Each sequence's rows are
those it gets in a batch of its own, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.runs import ubatch_order
from ggpipe.runtime.stage import KV_CLEAR, Stage, StageSpec

HISTORY = {0: [504, 3575, 282], 1: [4649, 314, 2155], 3: [7042, 282, 504], 4: [314, 504]}   # slots that generate
NEXT = {0: 314, 1: 3575, 3: 2155, 4: 7042}                                                  # their next tokens
PROMPTS = {2: [504, 4649, 7042, 282], 5: [3575, 282, 314, 2155, 4649, 504, 7042], 6: [282, 2155]}  # slots' prompts


def _decode(stage, rows):
    """rows: (seq, pos, token) in batch order -> float32 (n, n_embd) hidden states as the stage returns them."""
    n = len(rows)
    return stage.decode(tokens=np.array([t for _, _, t in rows], np.int32),
                        pos=np.array([p for _, p, _ in rows], np.int32), n_seq_id=np.ones(n, np.int32),
                        seq_ids=np.array([s for s, _, _ in rows], np.int32), outputs=np.ones(n, np.int8))


def _history(stage, group):
    stage.kv(KV_CLEAR)
    for s in group:
        _decode(stage, [(s, p, t) for p, t in enumerate(HISTORY[s])])


@pytest.mark.parametrize("group,prompts", [((0, 1), (2,)), ((0, 3), (2,)), ((0, 1, 3), (2,)), ((1, 3), (2,)),
                                           ((0, 1, 3, 4), (2, 5, 6)), ((), (2, 5, 6)), ((0, 4), (6, 2, 5))])
def test_a_stage_returns_a_micro_batch_s_rows_in_batch_order(smollm2, group, prompts):
    """The next tokens of the generating slots of ``group``, then the prompts of ``prompts`` (several, of
    different lengths: llama.cpp splits them into several ubatches, some filling gaps among the group's ids,
    some out of batch order): every row is the one its sequence gets alone."""
    stage = Stage(StageSpec(model_path=smollm2, n_layer=12, first=True, last=False, n_ctx=1024, n_seq_max=8,
                            kv_unified=False))
    try:
        batch = [(s, len(HISTORY[s]), NEXT[s]) for s in group]
        batch += [(s, p, t) for s in prompts for p, t in enumerate(PROMPTS[s])]
        alone = []     # each sequence's rows in a batch of their own
        for s in group:
            _history(stage, group)
            alone.append(_decode(stage, [batch[group.index(s)]]))
        for s in prompts:
            _history(stage, group)
            alone.append(_decode(stage, [r for r in batch if r[0] == s]))
        alone = np.concatenate(alone)
        _history(stage, group)
        mixed = _decode(stage, batch)
        assert np.array_equal(mixed, alone)     # bit for bit, in batch order
        seqs = [s for s, _, _ in batch]
        # these batches do come out of llama.cpp in another order: the stage put them back
        assert (ubatch_order(seqs, 512) is not None) == (group not in ((0, 1), (0, 3)) or len(prompts) > 1)
    finally:
        stage.close()
