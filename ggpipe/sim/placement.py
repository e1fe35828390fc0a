"""Balanced splits from a profile (``ggpipe plan --balance``): the target's
layers over its ranks so that no stage is the bottleneck and no rank runs out
of memory (ggpipe.cluster.balance), and, for the speculative modes, how many
ranks the draft gets, chosen by simulating each choice (ggpipe.sim.run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ggpipe.cluster.balance import balance_layers, stage_times
from ggpipe.cluster.split import parse_split
from ggpipe.errors import SplitError
from ggpipe.sim.model import ModelDesc
from ggpipe.sim.profile import Profile
from ggpipe.sim.run import simulate


@dataclass
class Placement:
    """Attributes:
        split: the ``--split`` text (layer counts as weights, e.g. ``22,18/1``).
        target: target layer ranges per target rank; draft: per draft rank.
        stage_s: predicted seconds per target stage at the balancing batch size.
        tokens_per_s: simulated speed (None when not simulated).
        tried: draft rank count -> simulated tokens/s (speculative modes).
    """

    split: str
    target: list[tuple[int, int]]
    draft: list[tuple[int, int]] | None
    stage_s: list[float]
    tokens_per_s: float | None = None
    tried: dict | None = None


def split_text(target: list[tuple[int, int]], draft: list[tuple[int, int]] | None = None) -> str:
    t = ",".join(str(b - a) for a, b in target)
    return t if draft is None else t + "/" + ",".join(str(b - a) for a, b in draft)


def balance_model(profile: Profile, model: ModelDesc, ranks: list[int], n_tokens: int,
                  fits: Callable[[int, int, int], bool] | None = None,
                  objective: str = "bottleneck") -> tuple[list[tuple[int, int]], list[float]]:
    """(layer ranges, stage seconds) of ``model`` over ``ranks`` (stage order),
    each layer costed on its rank's host at ``n_tokens`` tokens per run
    (``objective``: as ggpipe.cluster.balance.balance_layers).

    Raises:
        SplitError: more ranks than layers, or nothing fits in memory."""
    cost = [[profile.host(r).layer_cost(s, n_tokens) for s in model.layers] for r in ranks]
    head = [profile.host(r).head_cost(model.head, n_tokens) for r in ranks]
    ranges = balance_layers(cost, head, fits, objective)
    return ranges, stage_times(ranges, cost, head)


def place(profile: Profile, target: ModelDesc, draft: ModelDesc | None, n_ranks: int, mode: str,
          fits_target: Callable[[int, int, int, int], bool] | None = None, simulate_cfg=None) -> Placement:
    """The balanced placement of a job of ``n_ranks``.

    Args:
        fits_target: ``fits(rank, start, stop, n_stages)``: the rank can hold
            those target layers; None: unlimited memory.
        simulate_cfg: a ``ggpipe.sim.run.SimConfig`` used to compare draft
            rank counts (speculative modes with a draft); None: one draft rank.

    Raises:
        SplitError: no split fits."""
    n_tok = 1 if mode == "iterative" else 4
    # runs overlap only in pipeinfer: there the slowest stage sets the pace; else the stages' sum does
    objective = "bottleneck" if mode == "pipeinfer" else "latency"

    def balanced(n_target: int):
        ranks = list(range(n_target))
        fits = None if fits_target is None else (lambda s, a, b: fits_target(ranks[s], a, b, n_target))
        return balance_model(profile, target, ranks, n_tok, fits, objective)

    if draft is None or mode == "iterative" or n_ranks == 1:
        t, st = balanced(n_ranks)
        return Placement(split_text(t), t, None, st)
    best, tried = None, {}
    for n_draft in range(1, min(3, n_ranks - 1, draft.n_layer) + 1):
        n_target = n_ranks - n_draft
        try:
            t, st = balanced(n_target)
        except SplitError:
            continue
        d, _ = balance_model(profile, draft, list(range(n_target, n_ranks)), 1, objective="latency")
        cand = Placement(split_text(t, d), t, d, st)
        if simulate_cfg is None:
            return cand
        r = simulate(replace(simulate_cfg, ranks=n_ranks, split=parse_split(cand.split), mode=mode))
        cand.tokens_per_s = r["tokens_per_s"]
        tried[n_draft] = r["tokens_per_s"]
        if best is None or (cand.tokens_per_s or 0) > (best.tokens_per_s or 0):
            best = cand
    if best is None:
        raise SplitError(f"no split of the target over {n_ranks} ranks (with 1-3 draft ranks) fits their memory")
    best.tried = tried
    return best
