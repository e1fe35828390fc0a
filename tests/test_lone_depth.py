"""A lone request's chains under ``--parallel`` are cut as one request at a
time cuts them: ``--p-accept auto`` is adaptive depth over the scheduler's
own measurements (the draft's calibrated acceptance, the target's pass
costs, the request's decode rate), a fixed ``--p-accept`` a fixed cutoff.
Toy pipelines, no MPI."""

from __future__ import annotations

from ggpipe.decoding.factory import build_scheduler
from ggpipe.decoding.loop import Job
from ggpipe.decoding.parallel.chain_draft import ChainDrafter
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.adaptive import AcceptanceModel, AdaptiveCutoff
from ggpipe.speculation.cutoff import CutoffController
from ggpipe.speculation.proposers.base import ProposerConfig
from ggpipe.speculation.proposers.draft_model import DraftModelProposer
from ggpipe.speculation.tree import SpecTree

V = 48
PROMPT = [3, 9, 4, 3, 9, 5, 5, 2]


def _scheduler(mode: str, p_accept: float | None, lookahead: str = "auto", monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("GGPIPE_LOOKAHEAD", lookahead)
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True, pass_cost=(0.010, 0.005))
    draft = FakePipeline(ToyLM(V, flip=0.3), latency=1, name="draft")
    plan = DecodingPlan.resolve(mode, SpecSettings(p_accept=p_accept), slots=4)
    sched = build_scheduler(plan, target, [draft], n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, depth=2,
                            timeout_s=5, target_hosts=["a", "b"])
    return sched, lm


def test_p_accept_auto_cuts_a_lone_requests_chains_by_adaptive_depth_measured_in_the_scheduler():
    sched, lm = _scheduler("speculative", None)
    drafter = sched.spec.draft
    assert isinstance(drafter, ChainDrafter) and isinstance(drafter.cutoff, AdaptiveCutoff)
    assert drafter.cutoff.draft_step is not None       # the head waits for these chains: their steps are charged
    job = Job(list(PROMPT), 80, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(PROMPT, 80)    # lossless whatever the depth
    acceptance = drafter.acceptance
    assert acceptance is drafter.cutoff.acceptance and len(acceptance._q) > 0   # calibrated on verified tokens
    assert sched.spec.pass_cost is drafter.cutoff.cost and sched.spec.pass_cost.cost(2) is not None
    assert sched.spec.decode_rate.rate() is not None   # the lone request's tokens per second


def test_a_fixed_p_accept_is_a_fixed_cutoff_and_calibrates_nothing():
    sched, lm = _scheduler("speculative", 0.4)
    drafter = sched.spec.draft
    assert isinstance(drafter.cutoff, CutoffController) and drafter.acceptance is None
    assert drafter.cutoff.at(1.0) == drafter.cutoff.first_at(1.0) == 0.4
    job = Job(list(PROMPT), 40, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(PROMPT, 40)


def test_look_ahead_chains_drafted_without_waiting_are_not_charged_the_draft_step(monkeypatch):
    sched, lm = _scheduler("pipeinfer", None, "on", monkeypatch)
    assert sched.spec.continuous
    assert sched.spec.draft.cutoff.draft_step is None    # PipeInfer's rule: drafting overlaps verification
    job = Job(list(PROMPT), 40, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(PROMPT, 40)


def test_only_the_drafters_own_verified_tokens_calibrate_it():
    draft = FakePipeline(ToyLM(V), latency=1, name="draft")
    acceptance = AcceptanceModel()
    d = ChainDrafter(DraftModelProposer(ProposerConfig(backend=draft, n_vocab=V, n_ubatch=8)), 0.0, timeout_s=5,
                     acceptance=acceptance)
    t = SpecTree(anchor_pos=4)
    t.add(7, -1, 0.9)
    t.add(8, -1, 0.1)                   # a runner-up: not on the chain
    t.add(9, 0, 0.6)
    assert d._chain(t, [1, 2, 3, 4, 5]) == [7, 9]
    d.observe_verified(5, [7, 9], 1)    # 7 accepted at position 5, 9 refused at 6
    d.observe_verified(5, [8], 0)       # not what it drafted at 5: not observed
    d.observe_verified(9, [7], 1)       # nothing drafted there
    assert acceptance._q == [0.9, 0.6] and acceptance._a == [True, False]
