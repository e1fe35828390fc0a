"""Row masking of runs in flight (PipeDec section 3.3.4: after a hit, "prune
every in-flight layer"). Pure numpy, no MPI.

A PipeDec layer run carries nodes below several parents, each node in a KV
sequence of its own. When the target accepts one node, the nodes below its
siblings die while their layers are still travelling down the pipeline. A run
whose every node died is cancelled (PipeInfer IV.D); one that lost only some
is *masked*: the head sends (run id, sequence id) pairs backwards through the
pipeline (``T_PRUNE``, the way cancellations travel), and every stage that
has not yet evaluated the run drops the rows whose every sequence id is
pruned. A dropped row is flagged ``OUT_DROPPED`` in the decode header the
stage passes on, and the payload carries no row for it; the last stage
returns logits for the surviving output rows with their batch indices
(``LogitsHeader.rows``).

Why this is safe: a row is dropped only when every sequence it belongs to
is dead, so no surviving row attends to it (a surviving row's ancestors
carry its sequence); the pairs of one decision travel in one message, so a
stage never drops a parent's row and keeps its dead child's (whose sequence
would then lack the parent's position, a batch llama.cpp rejects).
"""

from __future__ import annotations

import numpy as np

from ggpipe.runs import run_id_after
from ggpipe.transport.messages import OUT_DROPPED, OUT_LOGITS, DecodeHeader


class PruneBook:
    """Pruned sequence ids per run not yet evaluated here.

    Attributes:
        rows_masked: rows this stage dropped (a statistic).
    """

    def __init__(self):
        self._by_run: dict[int, set[int]] = {}
        self.rows_masked = 0

    def add(self, pairs, done_below: int | None = None) -> None:
        """Record (run id, sequence id) pairs; runs issued no later than
        ``done_below`` (None or negative: no run was) were evaluated here
        already and are ignored. Run ids are compared as serial numbers
        (ggpipe.runs.run_id_after): right across their wrap-around."""
        if done_below is not None and done_below < 0:
            done_below = None
        for run_id, seq in pairs:
            if run_id_after(run_id, done_below):
                self._by_run.setdefault(int(run_id), set()).add(int(seq))

    def take(self, run_id: int) -> set[int]:
        """The pruned sequence ids of ``run_id`` (forgotten here: the run is
        being evaluated now)."""
        return self._by_run.pop(run_id, set())

    def forget_through(self, run_id: int) -> None:
        """Drop the entries of runs up to ``run_id`` (evaluated or skipped)."""
        for r in [r for r in self._by_run if not run_id_after(r, run_id)]:
            del self._by_run[r]

    def __len__(self) -> int:
        return len(self._by_run)

    def apply(self, h: DecodeHeader) -> np.ndarray:
        """Flag the rows of ``h`` whose every sequence id is pruned as
        OUT_DROPPED (in place). Returns bool (n_live_before,) the rows of
        the incoming payload that stay (the payload holds only the rows not
        dropped upstream)."""
        pruned = self.take(h.run_id)
        live = h.outputs != OUT_DROPPED
        if not pruned:
            return np.ones(int(live.sum()), dtype=bool)
        dead = rows_in(h.n_seq_id, h.seq_ids, pruned) & live
        self.rows_masked += int(dead.sum())
        keep = ~dead[live]
        h.outputs[dead] = OUT_DROPPED
        return keep


def rows_in(n_seq_id: np.ndarray, seq_ids: np.ndarray, seqs) -> np.ndarray:
    """bool (n,): the rows of a batch (``n_seq_id`` int (n,) sequence ids
    per row, ``seq_ids`` int (sum n_seq_id,) them, row by row) whose every
    sequence id is in ``seqs``: the rows a prune of ``seqs`` kills. The one
    rule of masking, shared by the stages and the simulated pipelines."""
    n = int(np.asarray(n_seq_id).shape[0])
    if not seqs or n == 0:
        return np.zeros(n, dtype=bool)
    member = np.isin(seq_ids, np.fromiter(seqs, dtype=np.int64, count=len(seqs)))
    starts = np.concatenate([[0], np.cumsum(n_seq_id)[:-1]]).astype(np.intp)
    # a row is dead when none of its sequence ids is outside ``seqs``
    return np.add.reduceat((~member).astype(np.int32), starts) == 0


def live_batch(h: DecodeHeader) -> dict:
    """The micro-batch a stage evaluates: the rows of ``h`` not flagged
    OUT_DROPPED, as keyword arguments of ``Stage.decode`` (``pos``,
    ``n_seq_id``, ``seq_ids``, ``outputs``; int32 / int8 arrays)."""
    live = h.outputs != OUT_DROPPED
    if live.all():
        return {"pos": h.pos, "n_seq_id": h.n_seq_id, "seq_ids": h.seq_ids, "outputs": h.outputs}
    per_seq = np.repeat(live, h.n_seq_id)
    return {"pos": h.pos[live], "n_seq_id": h.n_seq_id[live], "seq_ids": h.seq_ids[per_seq],
            "outputs": h.outputs[live]}


def returned_rows(h: DecodeHeader) -> np.ndarray | None:
    """int32 batch indices of the rows whose logits the last stage returns,
    when rows were masked; None when none was (every output row returns)."""
    if not (h.outputs == OUT_DROPPED).any():
        return None
    return np.flatnonzero(h.outputs == OUT_LOGITS).astype(np.int32)
