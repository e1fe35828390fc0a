"""Staged speculative decoding's draft-of-draft (Spector & Re 2023, section
3.2; ``--spec-type staged``): the draft model drafts as ``draft`` does, but
each draft run decodes the chain's new tip together with n-gram guesses of
the tokens below it (prompt lookup in the request's own tokens,
ggpipe.speculation.proposers.ngram). The draft then verifies the guesses
as a target would: while the token it drafts from a row is the next guess,
the row after it already holds the logits below that token, so one draft
round trip yields several tree levels where the text repeats itself.

Trees are those the draft alone would build (the same tokens in greedy
mode; the same law in stochastic mode, where a guess g is taken with
probability q(g) and otherwise a draw from q without g: an exact draw from
q, so multi-step speculative sampling at the target stays exact). What
changes is how many draft round trips a tree costs. ``--json`` adds
``guesses_accepted``: levels that came from a guess.
"""

from __future__ import annotations

from ggpipe.speculation.proposers.base import ProposerConfig
from ggpipe.speculation.proposers.draft_model import DraftModelProposer
from ggpipe.speculation.proposers.ngram import ngram_lookup


class StagedProposer(DraftModelProposer):
    """Args:
        cfg: as :class:`DraftModelProposer`, plus ``ngram_min`` / ``ngram_max``
            (the suffix lengths the guesses are looked up with).

    Raises:
        ValueError: no draft model, or invalid n-gram sizes."""

    name = "staged"

    def __init__(self, cfg: ProposerConfig):
        super().__init__(cfg)
        if not 1 <= cfg.ngram_min <= cfg.ngram_max:
            raise ValueError(f"n-gram sizes must satisfy 1 <= --spec-ngram-min <= --spec-ngram-max, "
                             f"got {cfg.ngram_min} and {cfg.ngram_max}")
        self.n_min, self.n_max = cfg.ngram_min, cfg.ngram_max
        self.stats.update(guesses_made=0, guesses_accepted=0)

    def guesses(self, context: list[int], room: int) -> list[int]:
        """Up to ``room`` tokens that followed the latest earlier occurrence of
        the context's longest matching suffix."""
        g = ngram_lookup(context, self.n_min, self.n_max, room) if room > 0 else []
        self.stats["guesses_made"] += len(g)
        return g
