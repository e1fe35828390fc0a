"""``--parallel 1``'s loop (ggpipe/decoding/one_at_a_time.py) against the
in-memory toy pipeline: requests run in order, each to its end through the
mode's own decoder; its one slot reads as the scheduler's slots do
(``/slots``: state, tokens, drafting by position) while a request runs."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.mode import mode_class
from ggpipe.decoding.one_at_a_time import OneAtATime
from ggpipe.decoding.parallel.slots import Job
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
    spec = SpecSettings(mode="pipeinfer", spec_type="ngram")
    prop = make_proposer("ngram", ProposerConfig(backend=None, n_vocab=V, n_ubatch=8, p_split=spec.p_split,
                                                 width=spec.branches))
    dec = mode_class("pipeinfer").over(target, prop, spec, n_seq_max=64, n_ubatch=8, is_eog=lambda t: False,
                                       timeout_s=5)
    return dec, lm, target


def test_requests_run_in_order_and_the_slot_shows_each_while_it_runs():
    dec, lm, target = _pipeinfer()
    loop = OneAtATime(dec, n_ctx=256, cached=lambda: 7)
    seen, order = [], []

    def run(job: Job) -> None:
        if job.cancelled:
            order.append(("cancelled", job.n_predict))
            return

        def emit(new):
            loop.generated(len(new))
            seen.append(loop.view()[0])
            return False

        target.clear()                       # as the engine keeps no prefix: every cell removed
        dec.reset()
        out = dec.generate(np.asarray(job.tokens, np.int32), job.n_predict, Sampler(SamplingParams()), emit=emit)
        order.append(("ran", job.n_predict))
        assert out == lm.greedy(job.tokens, job.n_predict)

    assert loop.view()[0]["state"] == "idle" and not loop.busy
    jobs = [Job(list(PROMPT), n, None) for n in (30, 5, 12)]
    for j in jobs:
        loop.submit(j, run)
    jobs[1].cancelled = True
    assert loop.n_queued == 2 and loop.n_busy == 1 and loop.busy
    while loop.busy:
        loop.step()
    assert order == [("ran", 30), ("cancelled", 5), ("ran", 12)]
    first = [v for v in seen if v["n_prompt_tokens"] == len(PROMPT)]
    assert all(v["is_processing"] and v["state"] == "generating" and v["n_cached"] == 7 for v in first)
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
        loop.submit(Job(list(PROMPT), 10, None), lambda j: None)
    with pytest.raises(ConfigError, match="empty"):
        loop.submit(Job([], 1, None), lambda j: None)
    assert not loop.busy


def test_a_failing_request_leaves_the_slot_idle():
    dec, _, _ = _pipeinfer()
    loop = OneAtATime(dec, n_ctx=256)

    def boom(job):
        raise RuntimeError("boom")

    loop.submit(Job(list(PROMPT), 4, None), boom)
    with pytest.raises(RuntimeError):
        loop.step()
    assert loop.current is None and not loop.busy and loop.view()[0]["state"] == "idle"
