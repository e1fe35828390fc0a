"""Which part of a KV cache a new token sequence can keep. Pure.

Used by the engine (keep a conversation's common prefix between requests,
as llama.cpp's server and llama-cpp-python do) and by the draft-model
proposer (bring the draft's cache to a new context, decoding only what
changed).
"""

from __future__ import annotations

from typing import Sequence


def reusable_prefix(cached: Sequence[int], tokens: Sequence[int], need_logits: bool = True,
                    partial: bool = True) -> int:
    """How many leading ``tokens`` a KV cache holding ``cached`` (positions
    0..) already has, so only the rest need decoding. With ``need_logits``
    the last token never counts: its logits are not kept, so it is decoded
    again. The caller removes every cell from that position on.

    ``partial`` False: the cache cannot be cut at a position (a recurrent or
    hybrid model: llama.cpp keeps or drops a sequence's state whole, and
    ``llama_memory_seq_rm`` refuses a cut), so either all of ``cached``
    counts, where ``tokens`` go on after it, or nothing (the caller then
    removes every cell).

    Example: ``reusable_prefix([1, 2, 3, 4], [1, 2, 9]) == 2``;
    ``reusable_prefix([1, 2, 3], [1, 2, 3]) == 2`` (3's logits are wanted);
    ``reusable_prefix([1, 2, 3], [1, 2, 9], partial=False) == 0``."""
    n, limit = 0, min(len(cached), len(tokens))
    while n < limit and cached[n] == tokens[n]:
        n += 1
    n = n - 1 if need_logits and n == len(tokens) else n
    return n if partial or n == len(cached) else 0
