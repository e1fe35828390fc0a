"""Confidence cutoff of continuous speculation (PipeInfer IV.B.2). Pure.

Drafting stops when the draft model's confidence in its next token falls
below the cutoff. Starting from ``p_accept``, the cutoff rises by
``p_recovery`` for every further micro-batch speculated beyond the accepted
tokens (deeper speculation needs more confidence), falls by ``p_decay`` each
time speculation fails while no target logits are waiting (use the idle
pipeline anyway), and resets when a run's tokens are accepted; the rise also
resets when the target decides a token no speculation carried (a new root:
nothing speculated survives it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


def confident_depth(draft_p: Sequence[float], cutoff: float, first_cutoff: float | None = None,
                    acceptance: Callable[[float], float] | None = None) -> int:
    """How many nodes of a chain to keep: the longest prefix whose every node
    passes ``cutoff`` (``first_cutoff``, default ``cutoff``, for the first).
    With ``acceptance`` (a calibration, draft probability -> P(accepted)) a
    node passes while the product of calibrated acceptance along the chain
    down to it does; without, while its own ``draft_p`` does.

    Example::

        >>> confident_depth([0.9, 0.5, 0.2, 0.9], 0.3)
        2
    """
    first = cutoff if first_cutoff is None else first_cutoff
    path = 1.0
    for i, p in enumerate(draft_p):
        if acceptance is not None:
            path *= acceptance(p)
            p = path
        if p < (first if i == 0 else cutoff):
            return i
    return len(draft_p)


@dataclass
class CutoffController:
    """Attributes:
        p_accept: base cutoff (probability, 0..1).
        p_recovery: added per continued micro-batch.
        p_decay: subtracted per failed attempt while idle.
        floor: the cutoff never goes below this.
    """

    p_accept: float = 0.5
    p_recovery: float = 0.05
    p_decay: float = 0.05
    floor: float = 0.0
    _continued: int = 0
    _failed: int = 0

    @property
    def cutoff(self) -> float:
        """The current cutoff: ``p_accept`` plus ``p_recovery`` per continued
        micro-batch, minus ``p_decay`` per failed attempt, at least ``floor``."""
        return max(self.floor, self.p_accept + self._continued * self.p_recovery - self._failed * self.p_decay)

    @property
    def exhausted(self) -> bool:
        """True when no draft token can pass (cutoff >= 1): stop speculating."""
        return self.cutoff >= 1.0

    def continued(self) -> None:
        """A micro-batch was speculated on top of earlier unverified ones."""
        self._continued += 1

    def failed_while_idle(self) -> None:
        """Drafting produced nothing and no logits are waiting."""
        self._failed += 1

    def rerooted(self) -> None:
        """The target decided a token no speculation carried: every run
        speculated beyond the verified tokens is dead, so nothing is
        speculated beyond unverified ones any more. Without this, a request
        whose drafts all fail would keep a cutoff of 1 (no speculation, so
        no acceptance to reset it) for the rest of its tokens."""
        self._continued = 0

    def accepted(self) -> None:
        """Tokens of a run were accepted: back to ``p_accept``."""
        self._continued = 0
        self._failed = 0

    def at(self, path_p: float) -> float:
        """The cutoff, whatever the anchor's path probability (the fixed
        controller raises it per continued micro-batch instead)."""
        return self.cutoff

    def first_at(self, path_p: float) -> float:
        """The cutoff of the first token below the anchor: the same."""
        return self.cutoff

    def look_at(self, path_p: float) -> float:
        """Least path probability of a chain's tip worth decoding for the
        next token: 0 (the cutoff alone ends a chain)."""
        return 0.0

    def exhausted_at(self, path_p: float) -> bool:
        """:attr:`exhausted`, whatever the anchor's path probability."""
        return self.exhausted
