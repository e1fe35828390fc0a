"""KV sequence partitions for speculative runs (PipeInfer IV.C.1). Pure.

Sequence 0 is the canonical sequence (accepted tokens only). The other ids
1..n_seq_max-1 are cut into partitions of ``width`` ids (one per leaf of a
speculation tree); a speculative run takes a partition from a FIFO of free
ones and gives it back once retired, after its sequences were cleared.
"""

from __future__ import annotations

from collections import deque

from ggpipe.errors import ConfigError


class PartitionPool:
    """Args:
        n_seq_max: sequence ids of the contexts (1..256).
        width: sequence ids per partition (most leaves of a tree).

    Raises:
        ConfigError: fewer than one partition fits.
    """

    def __init__(self, n_seq_max: int, width: int):
        if width < 1:
            raise ConfigError("a partition needs at least one sequence id")
        n = (n_seq_max - 1) // width
        if n < 1:
            raise ConfigError(
                f"--n-seq-max {n_seq_max} leaves no room for one speculation partition of {width} sequence ids "
                f"(need at least {width + 1})")
        self.width = width
        self.n_partitions = n
        self._free: deque[int] = deque(range(n))
        self._used: set[int] = set()

    def seqs(self, index: int) -> list[int]:
        """Sequence ids of partition ``index``."""
        start = 1 + index * self.width
        return list(range(start, start + self.width))

    def acquire(self) -> int | None:
        """Oldest free partition, or None when all are in use."""
        if not self._free:
            return None
        i = self._free.popleft()
        self._used.add(i)
        return i

    def release(self, index: int) -> None:
        """Give partition ``index`` back (to the end of the FIFO of free ones).

        Raises:
            ValueError: the partition is not in use."""
        if index not in self._used:
            raise ValueError(f"partition {index} is not in use")
        self._used.remove(index)
        self._free.append(index)

    @property
    def n_free(self) -> int:
        """Partitions free to acquire."""
        return len(self._free)
