"""The toy pipelines' KV cache (ggpipe.sim.toy): which position and
sequences each cell of a stage holds, placed where llama.cpp would place
them, so that a decoding loop's wrong KV operation (a missing copy, a stale
cell, a token among another sequence's cells) fails an assertion.
:class:`KvCells` is the unified cache, :class:`KvStreams` one stream of cells
per sequence (``kv_unified = false``)."""

from __future__ import annotations


class KvCells:
    """Where llama.cpp's unified KV cache puts each cell (llama-kv-cache.cpp of
    llama-cpp-python 0.3.36): a batch takes the first free cells from
    ``head`` on (``find_slot``, non-contiguous; restarting from 0 when head
    is far above the used count), ``head`` then moves past the last one;
    ``seq_rm`` frees cells and lowers ``head`` to the first freed one;
    ``seq_cp`` adds a sequence id to existing cells. A run cancelled after it
    was placed keeps its cells, as on a stage that finished it before its
    cancel arrived."""

    #: ``seq_cp`` adds a sequence to cells (metadata); it copies nothing
    copies_whole_streams = False

    def __init__(self, size: int = 4096):
        self.pos = [-1] * size
        self.seqs: list[set[int]] = [set() for _ in range(size)]
        self.head = 0
        self.used = 0

    def place(self, pos: list[int], seqs: list[list[int]]) -> list[int]:
        """Put tokens at positions ``pos`` of sequences ``seqs`` (one list of ids
        per token) in free cells, as llama.cpp's ``find_slot`` would; returns the
        cell indices.

        Raises:
            AssertionError: no free cell left ("KV cache full")."""
        n, size = len(pos), len(self.pos)
        head = 0 if self.head > self.used + 2 * n else self.head
        idxs: list[int] = []
        tested = 0
        while len(idxs) < n:
            if tested >= size:
                raise AssertionError("KV cache full")
            if head >= size:
                head = 0
            if not self.seqs[head]:
                idxs.append(head)
            head += 1
            tested += 1
        for i, p, s in zip(idxs, pos, seqs):
            self.pos[i], self.seqs[i] = p, set(s)
        self.used += n
        self.head = idxs[-1] + 1
        return idxs

    def rm(self, seq: int, p0: int, p1: int) -> None:
        """``seq_rm``: remove sequence ``seq`` (-1: every sequence) from the cells
        at positions [p0, p1) (-1: open end); a cell left without sequences is
        freed and ``head`` lowered to the first freed one."""
        hi = p1 if p1 >= 0 else 1 << 30
        lo = max(p0, 0)
        first = None
        for i, p in enumerate(self.pos):
            if not self.seqs[i] or not lo <= p < hi or (seq >= 0 and seq not in self.seqs[i]):
                continue
            if seq >= 0:
                self.seqs[i].discard(seq)
            else:
                self.seqs[i].clear()
            if not self.seqs[i]:
                self.pos[i] = -1
                self.used -= 1
                first = i if first is None else first
        if first is not None and first < self.head:
            self.head = first

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``seq_cp``: add sequence ``dst`` to the cells of ``src`` at positions
        [p0, p1) (-1: open end)."""
        hi = p1 if p1 >= 0 else 1 << 30
        for i, p in enumerate(self.pos):
            if src in self.seqs[i] and max(p0, 0) <= p < hi:
                self.seqs[i].add(dst)

    @property
    def n_cells(self) -> int:
        """Cells of the cache."""
        return len(self.pos)

    def clear(self) -> None:
        """Free every cell."""
        self.__init__(len(self.pos))

    def check_in_order(self, run_id: int, seqs: list[int], pos: int) -> None:
        """The cells a token at ``pos`` of ``seqs`` attends to must sit at
        index = position, as in a single-token loop, with no other cell
        among them: then llama.cpp sums attention in the reference's order."""
        for k in range(pos + 1):
            if self.pos[k] != k or not self.seqs[k] & set(seqs):
                raise AssertionError(
                    f"run {run_id}: the token at position {pos} (sequences {seqs}) finds cell {k} holding "
                    f"{'nothing' if self.pos[k] < 0 else f'position {self.pos[k]} of {sorted(self.seqs[k])}'}")


class KvStreams:
    """llama.cpp's KV cache with ``kv_unified = false``: one stream of
    cells per sequence (each a :class:`KvCells`), so a sequence's cells never
    sit among another's. A token belongs to one sequence (llama.cpp refuses
    coupled sequences there), and ``seq_cp`` copies a whole stream or is
    refused ("only supported for full KV buffers")."""

    #: ``seq_cp`` replaces the destination's cells with a copy of the source's
    copies_whole_streams = True

    def __init__(self, size: int = 4096):
        self.size = size
        self.streams: dict[int, KvCells] = {}

    @property
    def n_cells(self) -> int:
        """Cells of one stream (one sequence's)."""
        return self.size

    def _stream(self, seq: int) -> KvCells:
        return self.streams.setdefault(seq, KvCells(self.size))

    def place(self, pos: list[int], seqs: list[list[int]]) -> list[int]:
        """Put each token in its sequence's stream (:meth:`KvCells.place`);
        returns the cell indices, each within its stream.

        Raises:
            AssertionError: a token of several sequences, or a stream is full."""
        if any(len(s) != 1 for s in seqs):
            raise AssertionError("a token of several sequences in a KV cache of one stream per sequence")
        idxs = [0] * len(pos)
        for seq in {s[0] for s in seqs}:
            rows = [i for i, s in enumerate(seqs) if s[0] == seq]
            for i, j in zip(rows, self._stream(seq).place([pos[i] for i in rows], [[seq]] * len(rows))):
                idxs[i] = j
        return idxs

    def rm(self, seq: int, p0: int, p1: int) -> None:
        """``seq_rm`` in the stream of ``seq`` (-1: in every stream), positions
        [p0, p1) (-1: open end)."""
        for s, cells in self.streams.items():
            if seq in (-1, s):
                cells.rm(s, p0, p1)

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``seq_cp`` between streams, as llama.cpp's ``llama_kv_cache::seq_cp``
        does it: over the whole stream (``p0`` and ``p1`` open, or spanning
        every cell), the destination's cells become those of the source, at
        the same indices, relabelled; its head follows.

        Raises:
            AssertionError: a partial range ("only supported for full KV
                buffers"), as llama.cpp asserts."""
        if (0 < p0 and p0 + 1 < self.size) or (0 < p1 and p1 + 1 < self.size):
            raise AssertionError("seq_cp() is only supported for full KV buffers (kv_unified = false)")
        if src == dst:
            return
        a, b = self._stream(src), KvCells(self.size)
        for i, (p, seqs) in enumerate(zip(a.pos, a.seqs)):
            if src in seqs:
                b.pos[i], b.seqs[i] = p, {dst}
                b.used += 1
        b.head = a.head
        self.streams[dst] = b

    def clear(self) -> None:
        """Drop every stream."""
        self.streams.clear()

    def check_in_order(self, run_id: int, seqs: list[int], pos: int) -> None:
        """:meth:`KvCells.check_in_order` in the stream of the token's sequence."""
        self._stream(seqs[0]).check_in_order(run_id, seqs, pos)
