"""N-gram proposer: prompt-lookup drafting from the request's own tokens
(llama.cpp ``--spec-type ngram-simple`` / prompt lookup decoding, vLLM's
``NgramProposer``; the lowest stage of Staged Speculative Decoding, Spector &
Re 2023, section 3.2). No draft model: drafting costs a few microseconds on
the head, so ``--mode pipeinfer`` on a single model works.

Drafting: take the last n tokens of the context (prompt + accepted tokens +
the speculative chain below the anchor), for n from ``ngram_max`` down to
``ngram_min``; find their most recent earlier occurrence; propose the tokens
that followed it, as a chain of at most ``max_nodes``.

Each drafted token carries the confidence n / (n + 1) of the suffix length n
it was found with (``SpecTree.draft_p``); with ``--p-accept auto`` the loop
calibrates it against verified outcomes and drafts only as deep as pays
(ggpipe.speculation.adaptive); with a numeric ``--p-accept`` the whole
continuation up to ``--draft`` is proposed.

Stochastic sampling stays exact: each drafted token carries a one-hot
"draft distribution" q (the proposal is deterministic given the context), so
SpecInfer's multi-step speculative sampling accepts it with probability
p(x) and otherwise samples from p with x removed (renormalised): exactly p.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.proposers.base import EVERY_MODE, InstantProposer, ProposerConfig
from ggpipe.speculation.proposers.options import option
from ggpipe.speculation.tree import SpecTree


def ngram_lookup(context: Sequence[int], n_min: int, n_max: int, k: int) -> list[int]:
    """The proposed tokens of :func:`ngram_match` (see there).

    Example::

        >>> ngram_lookup([5, 6, 7, 8, 5, 6], 1, 3, 3)
        [7, 8, 5]
        >>> ngram_lookup([1, 2, 3], 1, 3, 4)
        []
    """
    return ngram_match(context, n_min, n_max, k)[0]


def ngram_match(context: Sequence[int], n_min: int, n_max: int, k: int) -> tuple[list[int], int]:
    """Prompt lookup: the up to ``k`` tokens that followed the most recent
    earlier occurrence of the longest suffix of ``context`` (length n_max down
    to n_min) that occurred before.

    Args:
        context: token ids, oldest first.
        n_min, n_max: suffix lengths tried, longest first (tokens, >= 1).
        k: most tokens proposed.

    Returns:
        (the proposed token ids, the length n of the suffix matched); ([], 0)
        when no suffix occurred before.

    Example::

        >>> ngram_match([5, 6, 7, 8, 5, 6], 1, 3, 3)
        ([7, 8, 5], 2)
    """
    a = np.asarray(context, dtype=np.int64)
    n_ctx = a.shape[0]
    if k <= 0 or n_ctx < 2:
        return [], 0
    for n in range(min(n_max, n_ctx - 1), max(n_min, 1) - 1, -1):
        # windows a[i:i+n] with i + n <= n_ctx - 1: each has a continuation, and
        # the suffix itself (i = n_ctx - n) is not among them
        win = np.lib.stride_tricks.sliding_window_view(a[:n_ctx - 1], n)
        hits = np.flatnonzero((win == a[n_ctx - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return a[start:start + k].tolist(), n
    return [], 0


def check_sizes(n_min: int, n_max: int) -> None:
    """Refuse n-gram sizes that match nothing.

    Raises:
        ValueError: unless 1 <= ``n_min`` <= ``n_max``."""
    if not 1 <= n_min <= n_max:
        raise ValueError(f"n-gram sizes must satisfy 1 <= --spec-ngram-min <= --spec-ngram-max, "
                         f"got {n_min} and {n_max}")


class NgramProposer(InstantProposer):
    """Args:
        cfg: this strategy's :class:`Options` are read.

    Raises:
        ValueError: invalid n-gram sizes (:func:`check_sizes`)."""

    name = "ngram"
    summary = "prompt lookup in the request's own tokens, no draft model"
    aliases = ("ngram-simple",)    # llama.cpp's name
    p_accept_auto_in = EVERY_MODE  # auto measured 7% faster (docs/benchmarks/one-stream.md)

    @dataclass(frozen=True)
    class Options:
        """Suffix lengths the lookup tries, longest first (tokens)."""

        ngram_min: int = option(1, flag="--spec-ngram-min", range=(1, 64),
                                help="Shortest suffix the n-gram proposer matches (tokens).")
        ngram_max: int = option(4, flag="--spec-ngram-max", range=(1, 64),
                                help="Longest suffix the n-gram proposer matches (tokens).")

    @classmethod
    def chain_lookup(cls, options):
        """Prompt lookup (:func:`ngram_lookup`) with these n-gram sizes."""
        opts = options.of(cls)
        return lambda context, k: ngram_lookup(context, opts.ngram_min, opts.ngram_max, k)

    def __init__(self, cfg: ProposerConfig):
        super().__init__()
        opts = cfg.options.of(NgramProposer)
        check_sizes(opts.ngram_min, opts.ngram_max)
        self.n_min = opts.ngram_min
        self.n_max = opts.ngram_max
        self.stats = {"ngram_lookups": 0, "ngram_hits": 0}

    def start(self, params: SamplingParams, key: int,
              acceptance: Callable[[float], float] | None = None, *, first_pos: int = 0) -> None:
        """A new request: as :meth:`InstantProposer.start`, and reset this
        request's lookup counters."""
        super().start(params, key, acceptance, first_pos=first_pos)
        self.stats.update(ngram_lookups=0, ngram_hits=0)   # this request's lookups

    def propose(self, context: list[int], max_nodes: int) -> SpecTree:
        """A chain below ``context[-1]`` (see :func:`ngram_lookup`)."""
        tree = SpecTree(anchor_pos=len(context) - 1)
        toks, n = ngram_match(context, self.n_min, self.n_max, max_nodes)
        self.stats["ngram_lookups"] += 1
        self.stats["ngram_hits"] += int(bool(toks))
        conf = n / (n + 1)   # a longer matched suffix predicts better (calibrated by --p-accept auto)
        parent = -1
        for t in toks:
            parent = tree.add(t, parent, conf)
        return tree
