"""Layer split planning: which contiguous block of layers each pipeline stage runs.

The user-facing syntax is PipeInfer's ``--mpi-layer-split`` (exposed by ggpipe as
``--split``): comma-separated weights for the ranks that run the target model,
optionally followed by ``/`` and the weights for the ranks that run the draft
model, e.g. ``"0.3,0.7"`` or ``"0.5,0.5/1.0"``; with several draft models
(``-md a,b``, a vote), one ``/`` part per draft model in ``-md``'s order,
e.g. ``"1,1/1/1"`` (ggpipe's extension of PipeInfer's syntax).

Weights are relative: they are normalised by their sum, so ``"1,3"`` and
``"0.25,0.75"`` are the same split.

Without weights, the default split balances the weight bytes each stage
reads per token, the LM head counted on the last stage (decoding reads every
weight once per micro-batch, and every generated token needs the head).
``"prompts"`` in place of the target weights balances the blocks alone: a
prompt's tokens go through every block but only its last one through the
head, so where prompts are most of the tokens (long prompts, short answers)
the head's stage would otherwise idle while the others compute (SmolLM2-135M,
whose Q8_0 head weighs about 13 of its 30 blocks: 22/8 by default, 15/15
with ``prompts``). ``batch`` and ``generate`` choose ``prompts`` themselves
when their prompts are at least :data:`PROMPT_SHARE` of the job's tokens
and no ``--split`` is given (:func:`prompts_dominate`).

Boundaries are computed from the cumulative weight fractions with round half up
(see :func:`plan_layers`). PipeInfer's own ``ggml_mpi_split_range`` (ggml-mpi.c)
instead truncates ``weight * n_layer`` per node, which can leave the last node with
the accumulated rounding error; rounding the *cumulative* fraction keeps every
boundary within half a layer of the requested position.

Stages are numbered in pipeline order (stage 0 runs layers starting at 0). Which
MPI rank runs which stage is the caller's choice (PipeInfer's ring puts rank 0,
the head, last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ggpipe.errors import SplitError

__all__ = ["SplitSpec", "parse_split", "plan_layers", "describe_plan"]

OPTION = "--split"
PROMPTS = "prompts"   # --split prompts: the default split balanced without the LM head

#: ``batch`` and ``generate`` split for prompts (``--split prompts``) where their prompt tokens are at least this
#: share of prompt plus generated tokens (long prompts, short answers: 8 prompts of about 1,000 tokens and 64
#: generated are 94%; docs/benchmarks/prompts.md measures both splits there and on generation-heavy work).
PROMPT_SHARE = 0.9

# Added before rounding so that a cumulative fraction that should be exactly x.5
# but is computed as x.4999999999 still rounds up.
_ROUND_EPS = 1e-9


@dataclass(frozen=True)
class SplitSpec:
    """A parsed ``--split`` value.

    ``target``: weights (positive, finite floats, not normalised) for the ranks
    running the target model, in pipeline order, or None for an even split.
    ``draft``: the same for the (first) draft model's ranks, or None.
    ``more_drafts``: the same for each further draft model (``-md a,b``).
    ``head``: the default target split counts the LM head on the last stage
    (False for ``prompts``).
    """

    target: tuple[float, ...] | None = None
    draft: tuple[float, ...] | None = None
    more_drafts: tuple[tuple[float, ...], ...] = ()
    head: bool = True

    def counts_head(self, model: str) -> bool:
        """Whether ``model``'s ("target" or "draft") default split counts
        the LM head on its last stage: always for a draft model (it drafts
        token by token), for the target unless ``prompts``."""
        return self.head or model != "target"

    @property
    def drafts(self) -> list[tuple[float, ...]]:
        """Every draft model's weights, in ``-md`` order ([] when none is named)."""
        return [] if self.draft is None else [self.draft, *self.more_drafts]


def prompts_dominate(n_prompt: int, n_generated: int) -> bool:
    """Whether a workload of ``n_prompt`` prompt tokens and at most
    ``n_generated`` generated tokens is mostly prompts: the prompt tokens
    are at least :data:`PROMPT_SHARE` of both (False for no tokens)."""
    total = n_prompt + n_generated
    return total > 0 and n_prompt >= PROMPT_SHARE * total


def _parse_weights(part: str, what: str, text: str) -> tuple[float, ...]:
    if not part.strip():
        raise SplitError(f'{OPTION} "{text}": the {what} weights are empty')
    weights = []
    for i, item in enumerate(part.split(",")):  # i: the stage, counted from 0 as in every message
        item = item.strip()
        if not item:
            raise SplitError(f'{OPTION} "{text}": the weight of {what} stage {i} is empty')
        try:
            w = float(item)
        except ValueError:
            hint = f' (weights, or "{PROMPTS}")' if what == "target" and "," not in part else ""
            raise SplitError(f'{OPTION} "{text}": {what} stage {i}: "{item}" is not a number{hint}') from None
        if not math.isfinite(w) or w <= 0:
            raise SplitError(
                f'{OPTION} "{text}": {what} stage {i}: weight "{item}" must be a positive finite number'
            )
        weights.append(w)
    return tuple(weights)


def parse_split(text: str | None) -> SplitSpec:
    """Parse PipeInfer's ``--mpi-layer-split`` syntax.

    ``"0.3,0.7"`` -> ``SplitSpec(target=(0.3, 0.7), draft=None)``;
    ``"0.5,0.5/1.0"`` -> ``SplitSpec(target=(0.5, 0.5), draft=(1.0,))``;
    ``"1,1/1/1"`` -> ``SplitSpec((1.0, 1.0), (1.0,), more_drafts=((1.0,),))``;
    None, ``""`` or blanks -> ``SplitSpec(None, None)`` (the default split, decided later);
    ``"prompts"`` (or ``"prompts/1.0"``) -> ``SplitSpec(None, ..., head=False)`` (the
    default split without the LM head). Whitespace around items is ignored.

    Raises SplitError (one line, naming the bad part) for: an item that is not a
    number, an empty item (``"0.5,,0.5"``, a trailing comma, an empty side of
    ``/``), a zero, negative, NaN or infinite weight. (Whether the number of
    ``/`` parts matches the draft models is checked with them:
    ``ggpipe.cluster.roles.Roles.plan``.)
    """
    if text is None or not text.strip():
        return SplitSpec(None, None)
    parts = text.split("/")
    prompts = parts[0].strip() == PROMPTS
    target = None if prompts else _parse_weights(parts[0], "target", text)
    drafts = [_parse_weights(p, "draft" if i == 0 else f"draft {i + 1}", text) for i, p in enumerate(parts[1:])]
    return SplitSpec(target, drafts[0] if drafts else None, tuple(drafts[1:]), head=not prompts)


def plan_layers(
    n_layer: int,
    n_stages: int,
    weights: Sequence[float] | None,
    *,
    model: str = "target",
    layer_bytes: Sequence[int] | None = None,
    head_bytes: int = 0,
) -> list[tuple[int, int]]:
    """Assign contiguous layer ranges to pipeline stages.

    Returns ``n_stages`` half-open ranges ``(start, stop)``: stage 0 starts at 0,
    each stage starts where the previous one stopped, the last stops at
    ``n_layer``, and every stage has at least one layer.

    ``weights`` None: as even as possible, the first ``n_layer % n_stages`` stages
    get one extra layer (30 layers / 4 stages -> 8, 8, 7, 7). With
    ``layer_bytes`` (weight bytes of each block, ``ggpipe.models.sizes``)
    whose largest block is more than 2% above the smallest (MoE models with
    leading dense blocks, hybrids, mixed quantizations), or with
    ``head_bytes`` (the output norm and LM head the last stage reads for
    every token: ``ModelSizes.head_bytes``) of at least half a block: the
    contiguous ranges whose largest stage reads the fewest weight bytes per
    token, the head counted on the last stage (:func:`balance_bytes`).
    Decoding is bound by reading the weights, so a stage's bytes stand for
    its time: with a pipeline full of micro-batches (``--parallel``,
    pipeinfer) the busiest stage sets the pace (docs/clusters/planning.md, The default split:
    SmolLM2-goliath F32, whose head weighs 8 of its 40 blocks, splits 24/16
    on 2 stages).

    ``weights`` given: normalised by their sum; the boundary after stage i is
    ``floor(cumsum(w)[i] / sum(w) * n_layer + 0.5)`` (round half up, with a 1e-9
    tolerance against float error), and the last boundary is exactly ``n_layer``.
    (30 layers, weights 1,1,1,1 -> boundaries 7.5, 15, 22.5 -> 8, 7, 8, 7.)

    ``model`` ("target" or "draft") is only used in error messages.

    Raises SplitError: ``n_stages < 1``; ``n_stages > n_layer``;
    ``len(weights) != n_stages``; a weight that is not positive and finite; a
    stage that would get zero layers (the message names the stage, its weight
    and a fix).
    """
    if n_stages < 1:
        raise SplitError(f"no ranks run the {model} model (need at least 1 stage)")
    if n_stages > n_layer:
        raise SplitError(
            f"{n_stages} stages but the {model} model has only {n_layer} layers; "
            f"use at most {n_layer} ranks for it"
        )
    if weights is None and layer_bytes is not None and len(layer_bytes) == n_layer and n_layer and \
            (max(layer_bytes) > 1.02 * max(1, min(layer_bytes)) or head_bytes >= 0.5 * max(layer_bytes)):
        return balance_bytes(layer_bytes, n_stages, head_bytes)
    if weights is None:
        base, extra = divmod(n_layer, n_stages)
        ranges, start = [], 0
        for i in range(n_stages):
            stop = start + base + (1 if i < extra else 0)
            ranges.append((start, stop))
            start = stop
        return ranges

    weights = [float(w) for w in weights]
    if len(weights) != n_stages:
        s = "" if n_stages == 1 else "s"
        verb = "runs" if n_stages == 1 else "run"
        raise SplitError(
            f"{OPTION} has {len(weights)} weights but {n_stages} rank{s} {verb} "
            f"the {model} model"
        )
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w <= 0:
            raise SplitError(
                f"{OPTION}: {model} stage {i}'s weight ({w}) must be a positive finite number"
            )
    top = max(weights)  # only ratios matter: scaled, 1e308,1e308 cannot overflow the sum
    scaled = [w / top for w in weights]
    total = math.fsum(scaled)
    bounds, acc = [0], 0.0
    for w in scaled[:-1]:
        acc += w
        bounds.append(int(math.floor(acc / total * n_layer + 0.5 + _ROUND_EPS)))
    bounds.append(n_layer)
    ranges = list(zip(bounds[:-1], bounds[1:]))
    for i, (start, stop) in enumerate(ranges):
        if stop <= start:
            need = 1.0 / n_layer
            raise SplitError(
                f"{OPTION}: {model} stage {i} (weight {weights[i]:g}, "
                f"{scaled[i] / total:.1%} of the total) gets no layers of {n_layer}; "
                f"give it at least {need:.1%} of the total weight or use fewer ranks"
            )
    return ranges


def balance_bytes(layer_bytes: Sequence[int], n_stages: int, last_extra: int = 0) -> list[tuple[int, int]]:
    """Contiguous ranges of ``layer_bytes`` (one entry per block) over
    ``n_stages`` stages (each at least one block) whose largest stage holds
    the fewest bytes possible, ``last_extra`` bytes (the LM head) counted
    on the last stage; among those, each boundary as near its even share of
    the bytes as that allows (so no stage is left light).

    The least feasible maximum comes from a binary search over a greedy
    front-to-back fill; boundaries are then placed front to back at the block
    whose cumulative bytes are nearest ``i / n_stages`` of the total, among
    those that keep every stage within that maximum and leave the rest
    coverable. Requires ``1 <= n_stages <= len(layer_bytes)``."""
    sizes = [int(b) for b in layer_bytes]
    sizes[-1] += max(0, int(last_extra))   # the head stays with the last block, on the last stage
    n = len(sizes)
    prefix = [0]
    for b in sizes:
        prefix.append(prefix[-1] + b)

    def stages_needed(start: int, cap: int) -> int:
        count, acc = 1, 0
        for b in sizes[start:]:
            if acc and acc + b > cap:
                count, acc = count + 1, 0
            acc += b
        return count

    lo, hi = max(sizes), prefix[-1]
    while lo < hi:
        mid = (lo + hi) // 2
        if stages_needed(0, mid) <= n_stages:
            hi = mid
        else:
            lo = mid + 1
    ranges, start = [], 0
    for i in range(n_stages - 1):
        left = n_stages - 1 - i  # stages after this one
        target = prefix[-1] * (i + 1) / n_stages
        ok = [j for j in range(start + 1, n - left + 1)
              if prefix[j] - prefix[start] <= lo and stages_needed(j, lo) <= left]
        stop = min(ok, key=lambda j: (abs(prefix[j] - target), j))
        ranges.append((start, stop))
        start = stop
    ranges.append((start, n))
    return ranges


def repair_ranges(ranges: list[tuple[int, int]], valid: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """The ranges nearest ``ranges`` (least total boundary movement, in
    blocks) whose every stage satisfies ``valid(start, stop)``, or
    ``ranges`` unchanged when they already do or when no such split exists
    (the stage's own refusal then says why). Dynamic programming over the
    boundaries: O(stages x blocks^2) calls of ``valid``, each pair once."""
    n, k = ranges[-1][1], len(ranges)
    if all(valid(a, b) for a, b in ranges):
        return ranges
    memo: dict[tuple[int, int], bool] = {}

    def ok(a: int, b: int) -> bool:
        if (a, b) not in memo:
            memo[(a, b)] = bool(valid(a, b))
        return memo[(a, b)]

    want = [b for _, b in ranges]
    inf = float("inf")
    cost = {0: 0.0}
    back: list[dict[int, int]] = []
    for i in range(k):
        nxt: dict[int, float] = {}
        frm: dict[int, int] = {}
        ends = [n] if i == k - 1 else range(1, n)
        for b in ends:
            best, arg = inf, None
            for a, c in cost.items():
                if a < b and c + abs(b - want[i]) < best and ok(a, b):
                    best, arg = c + abs(b - want[i]), a
            if arg is not None:
                nxt[b], frm[b] = best, arg
        cost, back = nxt, back + [frm]
    if n not in cost:
        return ranges
    bounds, b = [n], n
    for i in range(k - 1, -1, -1):
        b = back[i][b]
        bounds.append(b)
    bounds.reverse()
    return list(zip(bounds[:-1], bounds[1:]))


def describe_plan(
    ranges: Sequence[tuple[int, int]], labels: Sequence[str] | None = None
) -> str:
    """A small text table of a plan: one row per stage with the inclusive layer
    span and the layer count. ``labels`` (e.g. ``"rank 1"``) replace the stage
    numbers when given (must have one per range)::

        stage  layers  count
        0      0-7         8
        1      8-15        8
    """
    if labels is not None and len(labels) != len(ranges):
        raise ValueError("describe_plan: need one label per range")
    rows = []
    for i, (start, stop) in enumerate(ranges):
        name = str(i) if labels is None else str(labels[i])
        span = f"{start}-{stop - 1}" if stop - start > 1 else f"{start}"
        rows.append((name, span, str(stop - start)))
    header = ("stage", "layers", "count")
    w0 = max(len(header[0]), *(len(r[0]) for r in rows)) if rows else len(header[0])
    w1 = max(len(header[1]), *(len(r[1]) for r in rows)) if rows else len(header[1])
    w2 = max(len(header[2]), *(len(r[2]) for r in rows)) if rows else len(header[2])
    lines = [f"{header[0]:<{w0}}  {header[1]:<{w1}}  {header[2]:>{w2}}"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c:>{w2}}" for a, b, c in rows]
    return "\n".join(lines)
