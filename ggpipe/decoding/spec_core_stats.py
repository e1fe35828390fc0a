"""A speculative request's statistics (``--json``'s ``decoder``), assembled
from the decoding core's counters, its graph, the drafter's own counters and
the adaptive models when they are on. Kept beside ggpipe.decoding.spec_core so
the core stays about deciding nothing but running the request."""

from __future__ import annotations

import numpy as np


def request_stats(core, drafter, adaptive: bool) -> dict:
    """The finished request's statistics: the request's counters, the
    drafter's (a proposer or PipeDec's layer drafter), drafted and accepted
    tokens, acceptance rate, tokens per verification pass, the adaptive
    thresholds and cost models (``adaptive``), the head stage's
    cancellation counters, and the drafted tokens verified and accepted per
    position after a root (ggpipe.speculation.draft_stats). ``core``: the ggpipe.decoding.spec_core.SpecCore."""
    r, g = core.r, core.r.graph
    passes = max(1, r.counts.verified_runs)
    stats = r.counts.as_dict()
    stats.update(drafter.stats)
    stats.update(
        spec_type=drafter.name,
        **g.draft_stats.as_dict(),
        # greedy: how close an accepted draft token came to a tie (docs/user-guide/exactness.md)
        min_accepted_margin=None if g.min_accepted_margin is None else round(g.min_accepted_margin, 6),
        target_passes=r.counts.verified_runs,
        accepted_per_pass=(len(r.out) - 1) / passes if len(r.out) > 1 else None,
        draft_threshold=r.cutoff.threshold if adaptive else None,
        look_threshold=_finite_or(r.cutoff.look_threshold, "never") if adaptive else None,
        decode_rate=None if core.decode_rate.rate() is None else round(core.decode_rate.rate(), 2),
        acceptance_exponent=core.acceptance.k if adaptive else None,
        draft_step_ms=None if drafter.step_s is None else round(1e3 * drafter.step_s, 3),
        head_cancelled_before_start=core.target.stats["cancelled_before_start"],
        head_cancelled_mid_compute=core.target.stats["cancelled_mid_compute"],
        head_dropped_after_cancel=core.target.stats.get("dropped_after_cancel", 0),
        head_rows_masked=core.target.stats.get("rows_masked", 0),
    )
    return stats


def _finite_or(x: float, word: str) -> float | str:
    """``x`` rounded for ``--json`` (strict JSON has no infinity), else ``word``."""
    return round(x, 4) if np.isfinite(x) else word
