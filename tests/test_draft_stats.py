"""Draft statistics by position after a root (ggpipe.speculation.draft_stats),
the same in every speculating mode and in both of the engine's loops: one
request at a time through a mode's decoder (the speculation graph records
each verified position) and many through the scheduler (its chains and
look-ahead rows). Toy pipelines; no MPI."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.parallel.scheduler import Scheduler
from ggpipe.decoding.settings import SpecSettings
from ggpipe.decoding.loop import Job
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.adaptive import PassCost
from ggpipe.speculation.draft_stats import DraftStats
from ggpipe.speculation.proposers.ngram import ngram_lookup

V = 48
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


def _consistent(verified: list[int], accepted: list[int]) -> None:
    """A position is verified only where every one before it was accepted."""
    assert len(verified) == len(accepted) and verified and verified[0] > 0
    assert all(0 <= a <= v for a, v in zip(accepted, verified))
    assert all(verified[i + 1] <= accepted[i] for i in range(len(verified) - 1))


def test_a_chain_counts_its_accepted_tokens_and_the_first_refused_one():
    s = DraftStats()
    s.record_chain(0, 4, 2)     # positions 0, 1 accepted, 2 refused, 3 never verified
    s.record_chain(0, 3, 3)     # all three accepted
    s.record_chain(0, 2, 0)     # the first refused
    assert s.verified == [3, 2, 2] and s.accepted == [2, 2, 1]
    assert s.n_verified == 7 and s.n_accepted == 5
    assert s.as_dict()["acceptance_per_position"] == [round(2 / 3, 4), 1.0, 0.5]
    s.record_chain(3, 1, 1)     # a chain that starts after an accepted guess
    assert s.verified == [3, 2, 2, 1]
    for bad in [(0, 2, 3), (0, 2, -1)]:
        with pytest.raises(ValueError):
            s.record_chain(*bad)
    with pytest.raises(ValueError):
        s.record(-1, True)


def test_the_pass_costs_the_loop_measured_are_reported_beside_the_drafting():
    s = DraftStats()
    assert s.as_dict()["pass_cost_ms"] == {}
    s.pass_cost = PassCost()
    s.pass_cost.finished(1, 0.0, 0.020)
    s.pass_cost.finished(3, 0.010, 0.048)    # queued behind the first: its cost runs from 0.020
    s.pass_cost.finished(1, 0.050, 0.060, counts=False)
    assert s.as_dict()["pass_cost_ms"] == {1: 20.0, 3: 28.0}


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_one_request_at_a_time_counts_the_verified_positions(mode):
    lm = ToyLM(V, period=7)
    target = FakePipeline(lm, latency=2)
    spec = SpecSettings(spec_type="ngram")
    dec = build_decoder(DecodingPlan.resolve(mode, spec),
                        target, None, n_ubatch=16, n_seq_max=64, is_eog=lambda t: False, timeout_s=5)
    out = dec.generate(np.array(PROMPT, np.int32), 60, Sampler(SamplingParams()))
    assert out == lm.greedy(PROMPT, 60)
    st = dec.stats
    _consistent(st["verified_per_position"], st["accepted_per_position"])
    assert sum(st["accepted_per_position"]) == st["draft_accepted"]
    assert len(st["acceptance_per_position"]) == len(st["verified_per_position"])
    assert dec.r.graph.draft_stats.pass_cost is dec.core.pass_cost    # the pass costs the mode weighs drafts by


@pytest.mark.parametrize("lookahead", [False, True])
def test_the_scheduler_counts_chains_and_lookahead_guesses_by_position(lookahead):
    lm = ToyLM(V, period=7)
    target = FakePipeline(lm, latency=3, cell_order=True, streams=True)
    target.n_stages = 2
    sched = Scheduler(target, 2, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False,
                      draft=lambda ctx, k: ngram_lookup(ctx, 1, 4, k), draft_max=4, lookahead=lookahead)
    job = Job(list(PROMPT), 60, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(PROMPT, 60)
    st = job.draft_stats
    _consistent(st.verified, st.accepted)
    assert (st.drafted, st.n_accepted) == (sched.stats.drafted, sched.stats.draft_accepted)   # one request: all of it
    if lookahead:   # a kept guess continues the positions of the row before it
        assert sched.stats.lookahead_kept > 0 and len(st.verified) > 4
    assert st.pass_cost is sched.spec.pass_cost     # the pass costs the scheduler's gate weighs chains by


def test_the_slots_view_reports_the_requests_drafting_so_far():
    lm = ToyLM(V, period=7)
    target = FakePipeline(lm, latency=3, cell_order=True, streams=True)
    sched = Scheduler(target, 2, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False,
                      draft=lambda ctx, k: ngram_lookup(ctx, 1, 4, k), draft_max=4)
    job = Job(list(PROMPT), 60, Sampler(SamplingParams()))
    sched.submit(job)
    seen = []
    while sched.busy:
        sched.step()
        seen.append(sched.view())
    busy = [v[job.slot] for v in seen if v[job.slot]["is_processing"]]
    assert busy and busy[-1]["drafted"] > 0
    last = busy[-1]
    assert sum(last["accepted_per_position"]) == last["draft_accepted"] <= last["drafted"]
    _consistent(last["verified_per_position"], last["accepted_per_position"])
    idle = seen[-1][1 - job.slot]
    assert (idle["drafted"], idle["verified_per_position"], idle["acceptance_per_position"]) == (0, [], [])
    assert idle["pass_cost_ms"] == {}


def test_metrics_count_drafted_tokens_by_position():
    from types import SimpleNamespace
    from ggpipe.frontends.serve.metrics import ServeMetrics
    m = ServeMetrics(lambda: 0, lambda: 0)
    st = DraftStats()
    st.record_chain(0, 3, 2)
    st.record_chain(0, 2, 0)
    st.drafted = 5
    for _ in range(2):
        m.finished(SimpleNamespace(metrics={}, n_prompt=4, n_reused=0, tokens=[1, 2], decoder=st.as_dict()), 0.0)
    val = m.registry.get_sample_value
    assert [val("ggpipe_draft_tokens_verified_per_position_total", {"position": str(i)}) for i in range(3)] == [4, 2, 2]
    assert [val("ggpipe_draft_tokens_accepted_per_position_total", {"position": str(i)}) for i in range(3)] == [2, 2, 0]
    assert val("ggpipe_acceptance_rate") == 0.4
