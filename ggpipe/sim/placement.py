"""Balanced splits from a profile (``ggpipe plan --balance``, ``--split auto:PROFILE``): the target's
layers over its ranks so that no stage is the bottleneck and no rank runs out
of memory (ggpipe.cluster.balance), and, for the speculative modes, how many
ranks the draft gets, chosen by simulating each choice (ggpipe.sim.run).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ggpipe.cluster.balance import balance_layers, stage_times
from ggpipe.cluster.split import parse_split
from ggpipe.decoding.mode import mode_class
from ggpipe.errors import ConfigError, SplitError
from ggpipe.models.sizes import model_sizes
from ggpipe.sim.model import ModelDesc, from_gguf
from ggpipe.sim.profile import Profile
from ggpipe.sim.run import SimConfig, simulate


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
    """The ``--split`` text of layer ranges: the layer count of each target
    range, comma-separated, then ``/`` and the draft's (e.g. ``22,18/30``)."""
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
    declared = mode_class(mode)  # what the mode's target passes carry and what sets their pace
    n_tok, objective = declared.tokens_per_pass, declared.pace

    def balanced(n_target: int):
        ranks = list(range(n_target))
        fits = None if fits_target is None else (lambda s, a, b: fits_target(ranks[s], a, b, n_target))
        return balance_model(profile, target, ranks, n_tok, fits, objective)

    if draft is None or not declared.speculates or n_ranks == 1:
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


# -- balanced splits (--balance PROFILE) ------------------------------------------------


def balanced_placement(profile_path, params: dict, n_ranks: int, hosts: list[str] | None, mem_per_node: int | None,
                       acceptance: float, simulate_draft: bool = True):
    """The balanced placement (ggpipe.sim.placement) of the job ``params``
    (the job command's parsed options) on ``n_ranks`` ranks placed on
    ``hosts`` (None: the profile's hosts). A rank may use its host's memory
    (the profile's, else ``mem_per_node``, else unlimited) divided by the
    ranks placed there. ``simulate_draft``: compare draft rank counts by
    simulation (else one draft rank).

    Raises:
        ConfigError: unreadable profile; SplitError: nothing fits."""

    prof = Profile.load(profile_path)
    hosts = hosts or [prof.host(r).host for r in range(n_ranks)]
    mode = params.get("mode") or "iterative"
    target = from_gguf(params["model"])
    if params.get("draft_model") and "," in params["draft_model"]:
        raise ConfigError("--balance plans one draft model; with several (-md a,b) give --split yourself")
    draft = from_gguf(params["draft_model"]) if params.get("draft_model") else None
    sizes = model_sizes(params["model"])
    ctx = int(params.get("ctx_size") or 2048)
    kv_types = (params.get("cache_type_k") or "f16", params.get("cache_type_v") or "f16")
    v_trans = (params.get("flash_attn") or "off") == "off"
    on_host = {h: hosts.count(h) for h in hosts}

    def fits(rank: int, start: int, stop: int, n_stages: int) -> bool:
        mem = prof.host(rank).mem_bytes or mem_per_node or 0
        if mem <= 0:
            return True
        need = (sizes.slice_bytes(start, stop, start == 0, stop == sizes.n_layer)
                + sizes.kv_bytes(start, stop, ctx, *kv_types, v_trans=v_trans))
        return need <= mem / on_host.get(hosts[rank], 1)

    cfg = None
    if draft is not None and mode_class(mode).speculates and simulate_draft:
        k = prof.confidence_exponent_for(params["model"], params["draft_model"]) or 1.0
        cfg = SimConfig(prof, target, draft, mode=mode, ranks=n_ranks, acceptance=acceptance, prompts=1,
                        n_predict=64, confidence_exponent=k)
    return place(prof, target, draft, n_ranks, mode, fits, cfg)


def balance_summary(p) -> dict:
    """The :class:`Placement` ``p`` as JSON-ready data: ``split``,
    ``target_layers``, ``draft_layers``, ``stage_ms`` (ms per target stage),
    ``tokens_per_s``, ``draft_ranks_tried`` (draft ranks -> tokens/s)."""
    return {"split": p.split, "target_layers": p.target, "draft_layers": p.draft,
            "stage_ms": [round(1e3 * t, 3) for t in p.stage_s], "tokens_per_s": p.tokens_per_s,
            "draft_ranks_tried": p.tried}


def format_balance(b: dict) -> str:
    """A :func:`balance_summary` as text: the balanced ``--split`` with each
    target stage's time (ms per run), and the simulated tokens/s of each draft
    rank count tried."""
    lines = [f"balanced split: --split {b['split']}  (target stage times: "
             + ", ".join(f"{t:.2f}" for t in b["stage_ms"]) + " ms per run)"]
    if b.get("draft_ranks_tried"):
        lines.append("draft ranks, simulated tokens/s: "
                     + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(b["draft_ranks_tried"].items())))
    return "\n".join(lines)


def auto_split(text: str, params: dict, n_ranks: int) -> str:
    """``--split auto:PROFILE``: the balanced split of this job from the
    profile (every rank computes the same one from the same file; one draft
    rank in the speculative modes), as ``--split`` text; other text unchanged.

    Raises:
        ConfigError: no profile named, or an unreadable one; SplitError: nothing fits."""
    if not text.startswith("auto"):
        return text
    path = text[5:] if text.startswith("auto:") else ""
    if not path:
        raise ConfigError("--split auto needs the profile to balance with: --split auto:PROFILE.json "
                          "(made by ggpipe calibrate)")
    return balanced_placement(path, params, n_ranks, None, None, 0.7, simulate_draft=False).split
