"""``ggpipe simulate``: a whole job on a virtual clock. The real decoding
loop of the mode (``ggpipe.decoding``, built by ``build_decoder`` exactly as
the engine builds it) drives simulated pipelines (:mod:`ggpipe.sim.backend`)
whose stages cost what a profile says, on a layer split planned as
``ggpipe generate`` plans it (``ggpipe.cluster``). Reports what ``ggpipe
bench`` reports: tokens/s, TTFT, ITL, tokens per target pass, acceptance,
per-rank busy share.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from ggpipe.cluster.roles import Roles
from ggpipe.cluster.split import SplitSpec, plan_layers
from ggpipe.decoding.factory import build_loop
from ggpipe.decoding.loop import Job
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.backend import SimClock, SimPipeline, SimStage, idle_until_next
from ggpipe.sim.lm import CalibratedDraft
from ggpipe.sim.model import ModelDesc
from ggpipe.sim.profile import LinkProfile, Profile, slowdown
from ggpipe.sim.toy import ToyLM
from ggpipe.transport.link import LinkSpec

TOY_VOCAB = 64


@dataclass
class SimConfig:
    """One simulated job.

    Attributes:
        profile: host and link costs.
        target, draft: model descriptions (draft None: no draft model).
        mode: "iterative", "speculative", "pipeinfer" or "pipedec".
        ranks: ranks in the job (mpiexec -n).
        split: layer split as --split parses it.
        spec: speculation knobs (as the CLI's).
        link: an emulated link added to every hop (GGPIPE_LINK's model), or None.
        acceptance: how often the draft's greedy token is the target's (0..1).
        confidence_exponent: k in P(agreement | draft confidence q) = q ** k
            (ggpipe.sim.lm.CalibratedDraft; 1: a calibrated draft).
        n_prompt: prompt tokens; n_predict: tokens to generate.
        prompts: requests simulated (each a different toy prompt).
        ubatch: prefill chunk (tokens).
        seed: toy models' seed.
        parallel: slots of the continuous-batching scheduler
            (``--parallel``); above 1 the ``prompts`` requests are submitted
            at once and run through ``ggpipe.decoding.parallel.scheduler``
            as ``serve``/``batch`` run them (a speculative mode drafts for a
            request that generates alone).
    """

    profile: Profile
    target: ModelDesc
    draft: ModelDesc | None = None
    mode: str = "iterative"
    ranks: int = 2
    split: SplitSpec = field(default_factory=lambda: SplitSpec(None, None))
    spec: SpecSettings = field(default_factory=SpecSettings)
    link: LinkSpec | None = None
    acceptance: float = 0.7
    confidence_exponent: float = 1.0
    n_prompt: int = 64
    n_predict: int = 128
    prompts: int = 3
    ubatch: int = 512
    seed: int = 0
    parallel: int = 1

    @cached_property
    def decoding(self) -> DecodingPlan:
        """The decoding plan of ``mode``, ``spec`` and ``parallel``, resolved
        once, as the CLI resolves a job's.

        Raises:
            ConfigError: an unknown mode, or settings it refuses."""
        return DecodingPlan.resolve(self.mode, self.spec, slots=self.parallel)


def _links(cfg: SimConfig):
    """(src, dst) -> the profile's link with ``cfg.link`` on top: an emulated
    link (ggpipe.transport.link) holds each message for latency +
    bytes/bandwidth before the real path carries it, so latencies add and
    per-byte times add."""
    extra_lat = cfg.link.latency_s if cfg.link else 0.0
    extra_s_per_byte = 8.0 / cfg.link.bandwidth_bps if cfg.link and cfg.link.bandwidth_bps else 0.0

    def link(src: int, dst: int) -> LinkProfile:
        base = cfg.profile.link(src, dst)
        s_per_byte = (1.0 / base.bandwidth_Bps if base.bandwidth_Bps > 0 else 0.0) + extra_s_per_byte
        return LinkProfile(src, dst, base.latency_s + extra_lat, 1.0 / s_per_byte if s_per_byte > 0 else 0.0)
    return link


def _stage_cost(profile: Profile, rank: int, model: ModelDesc, start: int, stop: int, last: bool,
                whole_draft: bool = False, factor: float = 1.0):
    host = profile.host(rank)
    layers = model.layers[start:stop]

    def cost(n: int, kv: int, n_out: int) -> float:
        if whole_draft:
            measured = host.draft_cost(n, n_out, model.head, model.name)
            if measured is not None:
                return factor * measured
        t = sum(host.layer_cost(s, n, kv) for s in layers)
        return factor * (t + (host.head_cost(model.head, n_out) if last else 0.0))
    return cost


def contention(cfg: SimConfig, busy_share: dict) -> dict:
    """rank -> factor on its compute costs from the other ranks of its host
    (mean field): with E_b the expected number of other ranks of the host
    computing (the sum of their busy shares) and E_w of them waiting (the
    rest; plus, in pipeinfer and pipedec, the head's loop thread, which
    polls while its stage computes on the executor), the factor is
    ``1 + (busy_slowdown(E_b) - 1) + (wait_slowdown(E_w) - 1)`` from the
    host's measured curves (ggpipe.sim.profile.slowdown)."""
    hosts = [cfg.profile.host(r).host for r in range(cfg.ranks)]
    out = {}
    for r in range(cfg.ranks):
        h = cfg.profile.host(r)
        same = [s for s in range(cfg.ranks) if s != r and hosts[s] == hosts[r]]
        e_b = sum(busy_share.get(s, 0.0) for s in same)
        e_w = len(same) - e_b + (1.0 if cfg.decoding.mode.asynchronous and hosts[0] == hosts[r] else 0.0)
        out[r] = 1.0 + (slowdown(h.busy_slowdown, e_b) - 1.0) + (slowdown(h.wait_slowdown, e_w) - 1.0)
    return out


def _roles(cfg: SimConfig) -> Roles:
    """Which rank runs which stage, as ``ggpipe generate`` plans it.

    Raises:
        ConfigError, SplitError: as ``ggpipe generate`` would for this job."""
    has_draft = cfg.draft is not None and cfg.decoding.speculates and cfg.spec.uses_draft_model
    roles = Roles.plan(cfg.ranks, cfg.split if has_draft or cfg.split.draft is None else SplitSpec(
        cfg.split.target, None), has_draft)
    if has_draft and roles.n_draft == 0:
        raise ConfigError("the simulator needs a rank for the draft model (a job of at least 2 ranks); "
                          "a draft on the head shares its cores, which it does not model")
    return roles


def build(cfg: SimConfig, factors: dict | None = None, trace: dict | None = None):
    """(clock, target pipeline, draft pipeline or None, busy dict, roles).

    Raises:
        ConfigError, SplitError: as ``ggpipe generate`` would for this job."""
    roles = _roles(cfg)
    has_draft = roles.has_draft
    clock = SimClock()
    busy: dict = {}
    link = _links(cfg)
    h0 = cfg.profile.host(0)
    overhead = h0.spec_overhead_s if cfg.decoding.speculates else h0.overhead_s
    tgt_ranges = plan_layers(cfg.target.n_layer, roles.n_target, cfg.split.target,
                             layer_bytes=[s.bytes for s in cfg.target.layers], head_bytes=cfg.target.head.bytes)
    f = factors or {}
    stages = [SimStage(r, _stage_cost(cfg.profile, r, cfg.target, a, b, r == roles.n_target - 1, factor=f.get(r, 1.0)))
              for r, (a, b) in enumerate(tgt_ranges)]
    lm = ToyLM(TOY_VOCAB, seed=cfg.seed)
    target = SimPipeline(lm, clock, stages, link, cfg.target.n_embd, cfg.target.n_vocab,
                         async_local=cfg.decoding.async_head, overhead_s=overhead,
                         busy=busy, name="target", streams=cfg.decoding.in_slots,
                         trace=trace)
    target.n_stages = roles.n_target   # pipedec keeps at most n_stages + 1 runs in flight
    draft = None
    if has_draft:
        d_ranges = plan_layers(cfg.draft.n_layer, roles.n_draft, cfg.split.draft, model="draft",
                               layer_bytes=[s.bytes for s in cfg.draft.layers], head_bytes=cfg.draft.head.bytes)
        dstages = [SimStage(r, _stage_cost(cfg.profile, r, cfg.draft, a, b, i == roles.n_draft - 1,
                                           whole_draft=roles.n_draft == 1, factor=f.get(r, 1.0)))
                   for i, (r, (a, b)) in enumerate(zip(roles.draft_ranks, d_ranges))]
        draft = SimPipeline(CalibratedDraft(lm, cfg.acceptance, seed=cfg.seed + 1,
                                                       exponent=cfg.confidence_exponent), clock, dstages, link,
                            cfg.draft.n_embd, cfg.draft.n_vocab, overhead_s=h0.overhead_s, busy=busy, name="draft",
                            trace=trace)
    return clock, target, draft, busy, roles


def simulate(cfg: SimConfig, rounds: int = 4, trace_dir: str | Path | None = None) -> dict:
    """Run ``cfg.prompts`` greedy requests; ranks sharing a host slow each
    other down by :func:`contention`, iterated ``rounds`` times from the
    busy shares of the previous round (no effect on a profile measured with
    one rank per host). Returns what :func:`_simulate_once` returns, plus
    ``contention`` (rank -> the factor used). ``trace_dir``: also write the
    returned round's first request as per-rank traces there (``rank<R>.jsonl``
    and ``meta.json``, the files ``ggpipe timeline`` draws; virtual time).

    Raises:
        ConfigError, SplitError: an impossible job (as ``ggpipe generate``)."""
    factors: dict = {}
    out = trace = None
    for _ in range(rounds):
        trace = {} if trace_dir is not None else None
        out = _simulate_once(cfg, factors, trace)
        new = contention(cfg, out["busy_share"])
        out["contention"] = factors or {r: 1.0 for r in range(cfg.ranks)}
        if all(abs(new[r] - factors.get(r, 1.0)) < 1e-3 for r in new):
            break
        factors = new
    if trace is not None:
        write_traces(cfg, trace, Path(trace_dir))
    return out


def write_traces(cfg: SimConfig, trace: dict, out: Path) -> None:
    """Per-rank traces in ggpipe.trace's files (virtual seconds, clock offset 0)."""
    out.mkdir(parents=True, exist_ok=True)
    roles = {}
    r = _roles(cfg)
    for rank in range(cfg.ranks):
        kind = r.model_of(rank)
        i, n = r.stage_of(rank)
        roles[rank] = f"{kind} stage {i + 1}/{n} (simulated)"
        lines = [json.dumps({"rank": rank, "pid": 0, "host": cfg.profile.host(rank).host, "wall_offset_s": 0.0})]
        lines += [json.dumps(e) for e in sorted(trace.get(rank, []), key=lambda e: e["ts"])]
        (out / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    (out / "meta.json").write_text(json.dumps({"roles": roles, "mode": cfg.mode, "simulated": True}))


def _simulate_once(cfg: SimConfig, factors: dict, trace: dict | None = None) -> dict:
    """One simulation with compute costs scaled by ``factors`` (rank -> factor),
    the first request's events going to ``trace`` (rank -> events) if given.
    The requests go through the loop ``serve`` and ``batch`` run
    (``ggpipe.decoding.factory.build_loop`` over ``cfg.decoding``): one at a
    time with one slot, submitted at once to the scheduler with more.
    Returns the per-request records and their means (the keys of ``ggpipe
    bench``'s results.csv where they exist): tokens_per_s, ttft_ms,
    itl_mean_ms, accepted_per_pass, acceptance_rate, busy_share (rank ->
    fraction of the generation's virtual wall time of the request, prompt
    included, spent computing), target_passes.

    Raises:
        ConfigError, SplitError: an impossible job (as ``ggpipe generate``)."""
    clock, target, draft, busy, roles = build(cfg, factors, trace)
    pipes = [p for p in (target, draft) if p is not None]
    plan = cfg.decoding
    loop = build_loop(plan, target, pipes[1:], n_ctx=1 << 30, n_batch=cfg.ubatch, n_seq_max=plan.seq_ids,
                      is_eog=lambda t: False, depth=None, timeout_s=3600.0, idle=idle_until_next(clock, pipes),
                      target_hosts=[cfg.profile.host(r).host for r in range(roles.n_target)], reuse_kv=False)
    rng = np.random.default_rng(cfg.seed)
    jobs = [Job([int(t) for t in rng.integers(0, TOY_VOCAB, cfg.n_prompt)], cfg.n_predict,
                Sampler(SamplingParams(temperature=0.0)), clock=GenerationClock(now=clock)) for _ in range(cfg.prompts)]
    if plan.in_slots:
        return _simulate_parallel(cfg, loop, jobs, clock, busy)
    records = []
    for i, job in enumerate(jobs):
        for p in pipes:
            p.clear()
        loop.reset()
        busy.clear()
        passes0 = target.n_passes
        _run(loop, [job])
        for p in pipes:
            p.trace = None  # ``trace`` holds the first request only
        d = job.clock.as_dict()
        span = max(job.clock.total_s or 0.0, 1e-12)
        st = loop.request_stats(job)
        records.append({
            "prompt": i,
            "tokens_per_s": d.get("tokens_per_s"),
            "ttft_ms": None if d.get("ttft_s") is None else 1e3 * d["ttft_s"],
            "itl_mean_ms": None if d.get("itl_mean_s") is None else 1e3 * d["itl_mean_s"],
            "accepted_per_pass": st.get("accepted_per_pass"),
            "acceptance_rate": st.get("acceptance_rate"),
            "target_passes": target.n_passes - passes0,
            "busy_share": {r: busy.get(r, 0.0) / span for r in range(cfg.ranks)},
            "wall_s": span,
        })
    return {"mode": cfg.mode, "ranks": cfg.ranks, "records": records, **_means(records, cfg.ranks)}


def _run(loop, jobs: list[Job]) -> None:
    """Submit ``jobs`` to ``loop`` and step it until every one has ended.

    Raises:
        the first job's own error (a simulated job has no client to tell)."""
    for job in jobs:
        loop.submit(job)
    while loop.busy:
        loop.step()
    for job in jobs:
        if job.error is not None:
            raise job.error


def _simulate_parallel(cfg: SimConfig, loop, jobs: list[Job], clock: SimClock, busy: dict) -> dict:
    """``jobs`` (greedy requests) submitted at once to ``loop``, the
    scheduler with ``cfg.parallel`` slots, as ``serve`` and ``batch`` run it
    (in a speculative mode a request that generates alone gets the mode's
    chains or look-ahead rows). Adds to the per-request figures
    ``aggregate_tokens_per_s`` (every request's tokens / virtual seconds
    from the first submission to the last token) and ``itl_p90_ms`` (the
    mean over requests of each one's 90th percentile gap)."""
    busy.clear()
    t0 = clock.now
    _run(loop, jobs)
    wall = max(clock.now - t0, 1e-12)
    records = []
    for i, j in enumerate(jobs):
        d = j.clock.as_dict()
        st = loop.request_stats(j)
        records.append({
            "prompt": i, "tokens_per_s": d.get("tokens_per_s"),
            "ttft_ms": None if d.get("ttft_s") is None else 1e3 * d["ttft_s"],
            "itl_mean_ms": None if d.get("itl_mean_s") is None else 1e3 * d["itl_mean_s"],
            "itl_p90_ms": None if d.get("itl_p90_s") is None else 1e3 * d["itl_p90_s"],
            "accepted_per_pass": st["accepted_per_pass"], "acceptance_rate": st["acceptance_rate"],
            "target_passes": st["target_passes"],
            "busy_share": {r: busy.get(r, 0.0) / wall for r in range(cfg.ranks)}, "wall_s": wall,
        })
    out = {"mode": cfg.mode, "ranks": cfg.ranks, "parallel": cfg.parallel, "records": records,
           **_means(records, cfg.ranks)}
    vals = [r["itl_p90_ms"] for r in records if r["itl_p90_ms"] is not None]
    out["itl_p90_ms"] = float(np.mean(vals)) if vals else None
    out["aggregate_tokens_per_s"] = sum(len(j.request.out) for j in jobs) / wall
    return out


def _means(records: list[dict], ranks: int) -> dict:
    out = {}
    for k in ("tokens_per_s", "ttft_ms", "itl_mean_ms", "accepted_per_pass", "acceptance_rate", "target_passes"):
        vals = [r[k] for r in records if r[k] is not None]
        out[k] = float(np.mean(vals)) if vals else None
    out["busy_share"] = {r: float(np.mean([rec["busy_share"][r] for rec in records])) for r in range(ranks)}
    return out
