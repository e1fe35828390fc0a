"""Balanced layer splits for heterogeneous ranks. Pure.

A pipeline with several runs in flight (PipeInfer section IV) runs as fast
as its slowest stage: every stage works at once and the bottleneck sets the
pace. With one run in flight (iterative, synchronous speculation) the
stages' sum does. Given what each layer costs on each rank's host,
:func:`balance_layers` chooses contiguous layer ranges that minimise the
one (then the other), subject to each rank's memory.

The optimum comes from dynamic programming over (stages, layers covered):
``best[s][j]`` is the least bottleneck for stages 0..s holding layers
[0, j); a second pass keeps only stages within that bottleneck and minimises
the sum. O(stages x layers^2) evaluations of prefix sums each (a 137-layer
model on 32 ranks: ~600,000). The classic linear-partition recurrence,
generalised to a different cost per rank.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ggpipe.errors import SplitError


def balance_layers(layer_cost: Sequence[Sequence[float]], last_extra: Sequence[float] | None = None,
                   fits: Callable[[int, int, int], bool] | None = None,
                   objective: str = "bottleneck") -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, every stage at least one layer.

    Args:
        layer_cost: ``layer_cost[s][l]``: seconds stage s's rank takes for
            layer l (every row the same length: the model's layers).
        last_extra: seconds the last stage adds on each rank (the output
            head), ``last_extra[s]`` when stage s is last.
        fits: ``fits(s, start, stop)``: stage s's rank can hold layers
            [start, stop) (memory); None: every range fits.
        objective: "bottleneck": least slowest stage, then least sum (runs
            overlap in the pipeline: pipeinfer); "latency": least sum, then
            least slowest stage (one run at a time: iterative, speculative).

    Returns:
        ``[(start, stop), ...]`` for stages 0..S-1, covering every layer.

    Raises:
        SplitError: more stages than layers, or no split fits in memory.
    """
    n_stages = len(layer_cost)
    n_layer = len(layer_cost[0]) if n_stages else 0
    if n_stages < 1:
        raise SplitError("no ranks to balance the layers over")
    if n_stages > n_layer:
        raise SplitError(f"{n_stages} stages but the model has only {n_layer} layers; use at most {n_layer} ranks")
    if any(len(row) != n_layer for row in layer_cost):
        raise ValueError("every rank needs a cost for every layer")
    pre = []
    for row in layer_cost:
        acc, p = 0.0, [0.0]
        for c in row:
            acc += c
            p.append(acc)
        pre.append(p)
    extra = list(last_extra) if last_extra is not None else [0.0] * n_stages
    ok = fits or (lambda s, a, b: True)

    def stage_cost(s: int, i: int, j: int) -> float:
        return pre[s][j] - pre[s][i] + (extra[s] if s == n_stages - 1 else 0.0)

    if objective == "bottleneck":
        best = _solve(n_stages, n_layer, stage_cost, ok, max)
    elif objective == "latency":  # lexicographic (sum, max): a larger prefix sum never wins
        best = _solve(n_stages, n_layer, lambda s_, i, j: _Lat(stage_cost(s_, i, j), stage_cost(s_, i, j)), ok,
                      lambda v, c: _Lat(v.total + c.total, max(v.worst, c.worst)))
    else:
        raise ValueError(f"objective must be 'bottleneck' or 'latency', not {objective!r}")
    if best is None:
        raise SplitError(f"no split of {n_layer} layers over {n_stages} ranks fits their memory: "
                         "use more ranks or hosts with more memory, or a smaller -c")
    if objective == "latency":
        return best[1]
    # among the splits with the least bottleneck, the least sum
    cap = best[0] * (1 + 1e-12) + 1e-15
    return _solve(n_stages, n_layer, stage_cost, lambda s_, i, j: ok(s_, i, j) and stage_cost(s_, i, j) <= cap,
                  lambda x, y: x + y)[1]


class _Lat:
    """(sum, max) of stage times, ordered by sum, then max; sums that differ
    only by rounding (the same layers added in another order) count as
    equal, so the tie-break on the slowest stage is not lost to float noise."""

    __slots__ = ("total", "worst")

    def __init__(self, total: float, worst: float):
        self.total, self.worst = total, worst

    def __lt__(self, other: "_Lat") -> bool:
        if abs(self.total - other.total) <= 1e-9 * max(abs(self.total), abs(other.total)):
            return self.worst < other.worst
        return self.total < other.total


def _solve(n_stages, n_layer, stage_cost, ok, combine):
    """Least (by ``<``) ``combine``-folded stage costs over contiguous splits
    allowed by ``ok``: (value, ranges), or None when none is allowed."""
    best: list[list] = [[None] * (n_layer + 1) for _ in range(n_stages)]
    arg = [[-1] * (n_layer + 1) for _ in range(n_stages)]
    for j in range(1, n_layer - n_stages + 2):
        if ok(0, 0, j):
            best[0][j], arg[0][j] = stage_cost(0, 0, j), 0
    for s in range(1, n_stages):
        last = s == n_stages - 1
        for j in range(s + 1, n_layer - (n_stages - 1 - s) + 1):
            if last and j != n_layer:
                continue
            bj, aj = None, -1
            for i in range(s, j):
                prev = best[s - 1][i]
                if prev is None or not ok(s, i, j):
                    continue
                cand = combine(prev, stage_cost(s, i, j))
                if bj is None or cand < bj:
                    bj, aj = cand, i
            best[s][j], arg[s][j] = bj, aj
    if best[n_stages - 1][n_layer] is None:
        return None
    ranges, j = [], n_layer
    for s in range(n_stages - 1, -1, -1):
        i = arg[s][j]
        ranges.append((i, j))
        j = i
    v = best[n_stages - 1][n_layer]
    return (v.total if isinstance(v, _Lat) else v), ranges[::-1]


def stage_times(ranges: Sequence[tuple[int, int]], layer_cost: Sequence[Sequence[float]],
                last_extra: Sequence[float] | None = None) -> list[float]:
    """Seconds of each stage of a split (as :func:`balance_layers` counts them)."""
    out = []
    for s, (a, b) in enumerate(ranges):
        t = sum(layer_cost[s][a:b])
        if s == len(ranges) - 1 and last_extra is not None:
            t += last_extra[s]
        out.append(t)
    return out
