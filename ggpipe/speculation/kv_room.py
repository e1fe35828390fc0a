"""Room in a KV cache for speculative cells near the end of the context.
Pure logic, no MPI.

llama.cpp's unified KV cache holds ``n_ctx`` cells (``-c``, rounded up to a
multiple of 256); a batch needs one free cell per token, or ``llama_decode``
fails ("the KV cache is full"). A request whose prompt and ``-n`` fill the
context leaves no cell to spare near its end, while speculative trees place
cells beside the accepted ones: wide trees (pipeinfer ``--branches``,
pipedec ``--tree-width``), several runs in flight, and the dead cells of
runs not yet retired.

:class:`CellBook` is the head's count of the cells a cache holds, kept in
the order the head issues runs and KV operations, which is the order every
stage applies them in (MPI's non-overtaking rule): the accepted sequence 0
(a prefix of positions) plus every other cell one by one, with its
sequences. It is an upper bound: a run the head cancelled or pruned is
counted as placed. A run the book admits (:meth:`CellBook.free` >= its
tokens) therefore fits on every stage.
"""

from __future__ import annotations


class CellBook:
    """Cells of one KV cache, as the head issued them.

    Args:
        n_cells: the cache's cells.
        seq0: cells of sequence 0 at positions 0..seq0-1 (a request's
            history), nothing else.
    """

    def __init__(self, n_cells: int, seq0: int = 0):
        self.n_cells = n_cells
        self.seq0 = seq0                        # sequence 0 holds positions 0..seq0-1 (one cell each)
        self._cells: dict[int, tuple[int, set[int]]] = {}   # other cells: key -> (position, sequences)
        self._key = 0

    @property
    def used(self) -> int:
        """Cells held: sequence 0's prefix and every other cell placed and not removed."""
        return self.seq0 + len(self._cells)

    def free(self) -> int:
        """Cells left (``n_cells`` - :attr:`used`)."""
        return self.n_cells - self.used

    def place(self, pos, seq_lists) -> None:
        """A batch: token i at ``pos[i]`` in the sequences ``seq_lists[i]``."""
        for p, seqs in zip(pos, seq_lists):
            p = int(p)
            if 0 in seqs:
                self.seq0 = max(self.seq0, p + 1)
            else:
                self._cells[self._key] = (p, {int(s) for s in seqs})
                self._key += 1

    def place_run(self, run) -> None:
        """A :class:`ggpipe.runs.Run`'s tokens."""
        seq_lists, o = [], 0
        for n in run.n_seq_id:
            seq_lists.append([int(s) for s in run.seq_ids[o:o + int(n)]])
            o += int(n)
        self.place(run.pos, seq_lists)

    def rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """``seq_rm(seq, p0, p1)``: ``seq`` (-1: every sequence) leaves the
        cells at positions in [p0, p1) (-1: open); cells left without a
        sequence are freed."""
        lo, hi = max(p0, 0), (p1 if p1 >= 0 else 1 << 62)
        if seq == -1 and hi >= self.seq0:
            self.seq0 = min(self.seq0, lo)
        # seq 0 alone leaving cells: other sequences may share them; they stay counted (an upper bound)
        for k in [k for k, (p, s) in self._cells.items() if lo <= p < hi and (seq == -1 or seq in s)]:
            _, s = self._cells[k]
            if seq == -1:
                del self._cells[k]
            else:
                s.discard(seq)
                if not s:
                    del self._cells[k]

    def cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``seq_cp(src, dst, p0, p1)``: the cells of ``src`` in [p0, p1)
        join ``dst`` (no new cell). Cells joining sequence 0 count as its
        (the buffer swap of accepted cells: always at its next positions)."""
        if src == 0:
            return          # sequence 0's cells keep it: they stay counted as its
        lo, hi = max(p0, 0), (p1 if p1 >= 0 else 1 << 62)
        for k in [k for k, (p, s) in self._cells.items() if lo <= p < hi and src in s]:
            p, s = self._cells[k]
            if dst == 0:
                del self._cells[k]
                self.seq0 = max(self.seq0, p + 1)
            else:
                s.add(dst)

