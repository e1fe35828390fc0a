"""Per-request state of the speculative decoding loop. Pure data.

The loop object (:class:`ggpipe.decoding.pipelined.SpeculativeDecoder`) lives
as long as the job; one :class:`SpecRequest` lives for one ``generate`` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ggpipe.metrics import GenerationClock
from ggpipe.speculation.graph import SpecGraph

COUNTERS = ("target_runs", "spec_runs", "root_runs", "cancel_sent", "returned_cancelled", "failed_drafts",
            "verified_runs", "stale_drafts", "reanchored_drafts", "no_partition", "salvaged_drafts", "deferred_roots",
            "kv_trims", "waited_for_draft", "rows_mask_sent")


@dataclass
class SpecRequest:
    """Attributes:
        n_predict: most tokens to generate.
        emit: called with each accepted token list; a true return stops.
        clock: TTFT / ITL clock of the request.
        graph: the speculation graph (PipeInfer IV.A state tracking).
        cutoff: the confidence cutoff controller (IV.B.2).
        context: every accepted token, position i at index i (history,
            prompt, generated); the draft's KV follows it.
        out: the generated tokens.
        done: generation has ended.
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

    n_predict: int
    emit: Callable[[list[int]], bool | None]
    clock: GenerationClock
    graph: SpecGraph
    cutoff: object  # CutoffController or AdaptiveCutoff
    context: list[int]
    out: list[int] = field(default_factory=list)
    done: bool = False
    pending_root: int | None = None
    spec_anchor: int | None = None
    spec_path: float = 1.0
    kv_top: int = 0
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def room(self, anchor_pos: int, draft: int) -> int:
        """Most nodes a tree anchored at ``anchor_pos`` may have: ``draft``,
        and no deeper than the tokens still to generate."""
        left = self.n_predict - len(self.out) - (anchor_pos + 1 - len(self.context))
        return min(draft, max(left, 0))
