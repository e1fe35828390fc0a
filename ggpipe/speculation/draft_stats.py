"""Typed draft statistics of one request, the same in every speculating mode
and in both of the engine's loops (one request at a time through a mode's
decoder, many through the scheduler): drafted tokens the target verified
and accepted, by their *position* after the last token the target produced
itself (as vLLM v1's ``SpecDecodingStats``: drafts, drafted and accepted
tokens, accepted tokens per position).

Position 0 is the first drafted token after such a token (a root), position
1 the one after it, and so on. A drafted token is *verified* at its position
when the target decides that position (every drafted token before it was
accepted): it is then accepted or refused. Tokens never verified (below a
refused one, or cancelled before their logits came back) are not counted,
so ``acceptance_per_position[i]`` is the chance that a drafted token at
position ``i`` is accepted once the target gets to it, and the product of
the first ``i + 1`` rates the chance that a chain is accepted that far.
Beside them, the target's pass costs by pass size as the request's loop
measured them (what its decisions to draft were weighed against). No MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ggpipe.speculation.adaptive import PassCost


@dataclass
class DraftStats:
    """Drafted tokens, and per position those verified and accepted (counts).

    Attributes:
        drafted: tokens drafted for the request and sent to the target,
            verified or not (tokens).
        verified: ``verified[i]``: drafted tokens the target verified at
            position ``i`` (tokens).
        accepted: ``accepted[i]``: of those, the ones it accepted (tokens).
        pass_cost: the target's pass costs as the request's loop measures
            them (:class:`~ggpipe.speculation.adaptive.PassCost`, seconds
            per pass size; shared by the loop's requests, read when the
            statistics are), or None (nothing measured).
    """

    drafted: int = 0
    verified: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    pass_cost: PassCost | None = field(default=None, repr=False, compare=False)

    def record(self, position: int, accepted: bool) -> None:
        """One drafted token verified at ``position`` (>= 0).

        Raises:
            ValueError: a negative position."""
        if position < 0:
            raise ValueError(f"position {position} < 0")
        while len(self.verified) <= position:
            self.verified.append(0)
            self.accepted.append(0)
        self.verified[position] += 1
        self.accepted[position] += bool(accepted)

    def record_chain(self, first: int, n_chain: int, n_accepted: int) -> None:
        """A chain of ``n_chain`` drafted tokens at positions ``first``,
        ``first + 1``, ... of which the target accepted the first
        ``n_accepted``: those are verified and accepted, the next one (if
        any) verified and refused, the rest never verified.

        Raises:
            ValueError: ``n_accepted`` outside [0, n_chain] or a negative ``first``."""
        if not 0 <= n_accepted <= n_chain:
            raise ValueError(f"{n_accepted} accepted of a chain of {n_chain}")
        for i in range(min(n_accepted + 1, n_chain)):
            self.record(first + i, i < n_accepted)

    @property
    def n_verified(self) -> int:
        """Drafted tokens verified, over every position."""
        return sum(self.verified)

    @property
    def n_accepted(self) -> int:
        """Drafted tokens accepted, over every position."""
        return sum(self.accepted)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafted tokens per drafted token, or None before any
        was drafted."""
        return self.n_accepted / self.drafted if self.drafted else None

    def acceptance_per_position(self) -> list[float]:
        """``accepted[i] / verified[i]`` per position (every position in
        the lists has at least one verified token)."""
        return [a / v for a, v in zip(self.accepted, self.verified)]

    def as_dict(self) -> dict:
        """``--json``'s, batch records', ``/slots``' and ``/metrics``' view:
        ``drafted``, ``draft_accepted``, ``acceptance_rate``, the counts per
        position and the rates (rounded to 4 places), and ``pass_cost_ms``:
        milliseconds per pass of n tokens, by n ({} before any is measured)."""
        cost = self.pass_cost.mean if self.pass_cost is not None else {}
        return {"drafted": self.drafted, "draft_accepted": self.n_accepted, "acceptance_rate": self.acceptance_rate,
                "verified_per_position": list(self.verified), "accepted_per_position": list(self.accepted),
                "acceptance_per_position": [round(r, 4) for r in self.acceptance_per_position()],
                "pass_cost_ms": {n: round(1e3 * t, 2) for n, t in sorted(cost.items())}}
