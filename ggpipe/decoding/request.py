"""Per-request state of the decoding layer. Pure data and the one rule for
accepting tokens, shared by every mode and by the continuous-batching
scheduler.

A mode's policy object lives as long as the job; one :class:`Request` (or
:class:`SpecRequest`, for the modes that speculate) lives for one request.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

from ggpipe.metrics import GenerationClock
from ggpipe.speculation.graph import SpecGraph


@dataclass
class RequestCounts:
    """A speculative request's event counters, reported by name in
    ``--json``'s ``decoder`` (:meth:`as_dict`).

    Attributes:
        target_runs: runs submitted to the target.
        spec_runs: of them, speculative (drafted tokens, may be cancelled).
        root_runs: of them, a decided token alone with no draft below it.
        cancel_sent: cancellations sent for dead runs (PipeInfer IV.D).
        returned_cancelled: results that came back cancelled.
        verified_runs: results that came back computed (target passes).
        rows_mask_sent: rows of runs in flight masked as dead (PipeDec 3.3.4).
        failed_drafts: drafting attempts that gave no tree.
        stale_drafts: drafted trees dropped because their anchor died meanwhile.
        reanchored_drafts: drafted trees moved onto the verified tokens.
        salvaged_drafts: drafted subtrees carried by a new root's run.
        deferred_roots: roots held back to share a pass with the first
            token drafted below them.
        waited_for_draft: times the head waited for the draft's next token
            because it paid (ggpipe.speculation.adaptive.wait_pays).
        draft_skipped: roots the gate sent without drafting (a chain would
            not pay).
        no_partition: trees not sent for want of a free KV partition.
        kv_trims: dead cells removed above the accepted tokens.
        kv_room_cuts: trees shortened to the KV cells left (speculation/kv_room.py).
        kv_room_waits: waits for cells to be freed before a root could go.
    """

    target_runs: int = 0
    spec_runs: int = 0
    root_runs: int = 0
    cancel_sent: int = 0
    returned_cancelled: int = 0
    verified_runs: int = 0
    rows_mask_sent: int = 0
    failed_drafts: int = 0
    stale_drafts: int = 0
    reanchored_drafts: int = 0
    salvaged_drafts: int = 0
    deferred_roots: int = 0
    waited_for_draft: int = 0
    draft_skipped: int = 0
    no_partition: int = 0
    kv_trims: int = 0
    kv_room_cuts: int = 0
    kv_room_waits: int = 0

    def as_dict(self) -> dict:
        """Every counter by name."""
        return asdict(self)


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
        counts: its event counters (:class:`RequestCounts`).
    """

    graph: SpecGraph
    cutoff: object  # CutoffController or AdaptiveCutoff
    pending_root: int | None = None
    spec_anchor: int | None = None
    spec_path: float = 1.0
    kv_top: int = 0
    counts: RequestCounts = field(default_factory=RequestCounts)

    def room(self, anchor_pos: int, draft_max: int) -> int:
        """Most nodes a tree anchored at ``anchor_pos`` may have: ``draft_max``,
        and no deeper than the tokens still to generate."""
        left = self.n_predict - len(self.out) - (anchor_pos + 1 - len(self.context))
        return min(draft_max, max(left, 0))
