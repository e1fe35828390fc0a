"""``--parallel 1``'s loop (ggpipe/decoding/one_at_a_time.py) against the
in-memory toy pipeline: requests run in order, each to its end through the
mode's own decoder; its one slot reads as the scheduler's slots do
(``/slots``: state, tokens, drafting by position) while a request runs."""

from __future__ import annotations

import pytest

from ggpipe.decoding.mode import mode_class
from ggpipe.decoding.one_at_a_time import OneAtATime
from ggpipe.decoding.loop import Job
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer

V = 48
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


def _pipeinfer():
    lm = ToyLM(V, period=7)
    target = FakePipeline(lm, latency=3, cell_order=True)
    spec = SpecSettings(spec_type="ngram")
    prop = make_proposer("ngram", ProposerConfig(backend=None, n_vocab=V, n_ubatch=8, p_split=spec.p_split,
                                                 width=spec.branches))
    dec = mode_class("pipeinfer").over(target, prop, spec, n_seq_max=64, n_ubatch=8, is_eog=lambda t: False,
                                       timeout_s=5)
    return dec, lm, target


def _job(n_predict: int, seen: list, loop: OneAtATime, done: list) -> Job:
    def emit(new):
        seen.append(loop.view()[0])
        return False
    return Job(list(PROMPT), n_predict, Sampler(SamplingParams()), emit=emit, on_done=done.append)


def test_requests_run_in_order_and_the_slot_shows_each_while_it_runs():
    dec, lm, target = _pipeinfer()
    loop = OneAtATime(dec, n_ctx=256, target=target)
    seen, done = [], []
    assert loop.view()[0]["state"] == "idle" and not loop.busy
    jobs = [_job(n, seen, loop, done) for n in (30, 5, 12)]
    for j in jobs:
        loop.submit(j)
    jobs[1].cancelled = True
    assert loop.n_queued == 2 and loop.n_busy == 1 and loop.busy
    while loop.busy:
        loop.step()
    assert done == jobs and jobs[1].request is None
    for j in (jobs[0], jobs[2]):
        assert j.error is None and j.request.out == lm.greedy(PROMPT, j.n_predict)
    # the second request reuses the first one's cells: all of its prompt but the last token
    assert (jobs[0].n_reused, jobs[2].n_reused) == (0, len(PROMPT) - 1)
    assert loop.kv == PROMPT + jobs[2].request.out[:-1]
    first = [v for v in seen if v["n_prompt_tokens"] == len(PROMPT)]
    assert all(v["is_processing"] and v["state"] == "generating" for v in first)
    # the running request's drafting, live: the n-gram's drafts on text that repeats itself
    assert max(v["drafted"] for v in seen) > 0 and max(v["draft_accepted"] for v in seen) > 0
    assert any(v["verified_per_position"] for v in seen)
    assert [v["n_decoded"] for v in seen][:3] == sorted([v["n_decoded"] for v in seen][:3])
    assert loop.view()[0]["state"] == "idle" and loop.view()[0]["n_decoded"] == 0
    assert loop.tokens_per_s() == pytest.approx((30 + 12) / loop.rate.window_s)


def test_a_request_that_does_not_fit_is_refused_at_submit():
    dec, _, _ = _pipeinfer()
    loop = OneAtATime(dec, n_ctx=16)
    with pytest.raises(ConfigError, match="context holds 16"):
        loop.submit(Job(list(PROMPT), 10, None))
    with pytest.raises(ConfigError, match="empty"):
        loop.submit(Job([], 1, None))
    assert not loop.busy


def test_a_failing_request_is_reported_alone_after_recovery_and_leaves_the_slot_idle():
    dec, lm, target = _pipeinfer()
    recovered = []
    loop = OneAtATime(dec, n_ctx=256, target=target, recover=lambda: recovered.append(True))
    done = []

    class Broken(Sampler):
        def sample(self, logits):
            raise ValueError("probs must be finite")

    bad = Job(list(PROMPT), 4, Broken(SamplingParams()), on_done=done.append)
    good = Job(list(PROMPT), 6, Sampler(SamplingParams()), on_done=done.append)
    loop.submit(bad)
    loop.submit(good)
    loop.step()
    assert isinstance(bad.error, ValueError) and recovered == [True] and done == [bad]
    assert loop.current is None and loop.view()[0]["state"] == "idle"
    target.clear()
    loop.reset()     # as the engine's recovery clears every cache
    loop.step()
    assert good.error is None and good.request.out == lm.greedy(PROMPT, 6) and not loop.busy


def test_both_loops_speak_the_one_interface_front_ends_use():
    from ggpipe.decoding.parallel.scheduler import Scheduler
    from ggpipe.decoding.loop import RequestLoop
    dec, _, target = _pipeinfer()
    assert isinstance(OneAtATime(dec, n_ctx=64), RequestLoop)
    assert isinstance(Scheduler(FakePipeline(ToyLM(V), latency=2, streams=True), 2, 64, 8, lambda t: False),
                      RequestLoop)
