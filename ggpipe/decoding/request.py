"""Per-request state of the decoding layer. Pure data and the one rule for
accepting tokens, shared by every mode and by the continuous-batching
scheduler.

A mode's policy object lives as long as the job; one :class:`Request` (or
:class:`SpecRequest`, for the modes that speculate) lives for one request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ggpipe.metrics import GenerationClock
from ggpipe.speculation.graph import SpecGraph

COUNTERS = ("target_runs", "spec_runs", "root_runs", "cancel_sent", "returned_cancelled", "failed_drafts",
            "verified_runs", "stale_drafts", "reanchored_drafts", "no_partition", "salvaged_drafts", "deferred_roots",
            "kv_trims", "waited_for_draft", "rows_mask_sent", "draft_skipped", "kv_room_cuts", "kv_room_waits")

Emit = Callable[[list[int]], "bool | None"]


def _never_stop(toks: list[int]) -> None:
    return None


@dataclass(kw_only=True)
class Request:
    """One request's tokens and where they go.

    Attributes:
        n_predict: most tokens to generate.
        emit: called with each accepted token list; a true return stops
            the request there (a stop string, Ctrl-C, a client that left).
        clock: TTFT / ITL clock of the request.
        is_eog: token -> end of generation?
        context: every accepted token, position i at index i (history,
            prompt, generated).
        out: the generated tokens.
        done: generation has ended.
    """

    n_predict: int
    emit: Emit = _never_stop
    clock: GenerationClock = field(default_factory=GenerationClock)
    is_eog: Callable[[int], bool] = lambda t: False
    context: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    done: bool = False

    def accept(self, toks: list[int]) -> list[int]:
        """Accept decided tokens: at most the ``n_predict`` left, none after
        an end-of-generation token (it is kept); extend ``out`` and
        ``context``, tick the clock, emit. Sets ``done`` when the request
        ends (end of generation, ``n_predict`` reached, or ``emit``
        returned true). Returns the tokens accepted (maybe none)."""
        toks = toks[:self.n_predict - len(self.out)]
        for i, t in enumerate(toks):
            if self.is_eog(t):
                toks = toks[:i + 1]
                self.done = True
                break
        if not toks:
            self.done = True
            return toks
        self.out.extend(toks)
        self.context.extend(toks)
        self.clock.token(len(toks))
        if self.emit(toks) or len(self.out) >= self.n_predict:
            self.done = True
        return toks


@dataclass(kw_only=True)
class SpecRequest(Request):
    """A request of a speculative mode (speculative, pipeinfer, pipedec).

    Attributes:
        graph: the speculation graph (PipeInfer IV.A state tracking).
        cutoff: the confidence cutoff controller (IV.B.2).
        pending_root: a decided token to put at the root of the next run.
        spec_anchor: the node the proposer drafts below (None: the pending
            root; ``ORPHAN``: a node that was never submitted).
        spec_path: estimated probability that the spec anchor is reached
            and accepted (1.0 for a verified anchor or the pending root).
        kv_top: one past the highest position any run of this request
            (or its prompt) placed in the target's KV cache: cells may exist
            below it, none above.
        counts: event counters reported in ``stats``.
    """

    graph: SpecGraph
    cutoff: object  # CutoffController or AdaptiveCutoff
    pending_root: int | None = None
    spec_anchor: int | None = None
    spec_path: float = 1.0
    kv_top: int = 0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def room(self, anchor_pos: int, draft_max: int) -> int:
        """Most nodes a tree anchored at ``anchor_pos`` may have: ``draft_max``,
        and no deeper than the tokens still to generate."""
        left = self.n_predict - len(self.out) - (anchor_pos + 1 - len(self.context))
        return min(draft_max, max(left, 0))
