"""Per-request statistics: the proposers' counters
(``draft_decodes``, ``ngram_lookups``, ``tree_layers``, ...) count one
request's work, not every request's since the job started, so that
``serve``/``chat``/``batch`` report each request on its own."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.mode import mode_class
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer

V = 48
PROMPTS = [[3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9], [7, 1, 7, 2, 7, 1, 7, 2, 5]]


def _two_requests(dec, target, draft):
    """Stats of two requests in a row (the caches cleared between them) and
    the draft runs each submitted."""
    out = []
    for prompt in PROMPTS:
        target.clear()
        draft.clear()
        dec.reset()
        runs0 = draft.n_runs
        dec.generate(np.array(prompt, np.int32), 30, Sampler(SamplingParams()))
        out.append((dict(dec.stats), draft.n_runs - runs0))
    return out


@pytest.mark.parametrize("mode,spec_type", [("speculative", "draft"), ("pipeinfer", "draft"),
                                            ("pipeinfer", "ngram"), ("pipeinfer", "staged"),
                                            ("pipeinfer", "vote")])
def test_proposer_counters_are_per_request(mode, spec_type):
    spec = SpecSettings(spec_type=spec_type, p_split=0.05)
    target = FakePipeline(ToyLM(V), latency=3)
    draft = FakePipeline(ToyLM(V, flip=0.3), latency=1, name="draft")
    prop = make_proposer(spec_type, ProposerConfig(backend=draft, n_vocab=V, n_ubatch=8, p_split=spec.p_split,
                                                   width=spec.branches))
    lookups = []
    ngram = getattr(prop, "propose", None)
    if spec_type == "ngram":
        def counting(context, max_nodes):
            lookups.append(1)
            return ngram(context, max_nodes)
        prop.propose = counting
    dec = mode_class(mode).over(target, prop, spec, n_seq_max=64, n_ubatch=8, is_eog=lambda t: False, timeout_s=5)
    (first, runs1), (second, runs2) = _two_requests(dec, target, draft)
    if spec_type == "ngram":
        assert second["ngram_lookups"] == len(lookups) - first["ngram_lookups"]
        assert second["ngram_hits"] <= second["ngram_lookups"]
    else:
        assert first["draft_decodes"] == runs1
        assert second["draft_decodes"] == runs2, (first, second)
    if spec_type == "staged":
        assert second["guesses_made"] <= 30 * 8
    if spec_type == "vote":
        assert second["vote_overruled"] + second["vote_extended"] <= second["verified_runs"] + 1


def test_pipedec_counters_are_per_request():
    target = FakePipeline(ToyLM(V), latency=4)
    target.n_stages = 3
    draft = FakePipeline(ToyLM(V, flip=0.3), latency=1, name="draft")
    dec = build_decoder(DecodingPlan.resolve("pipedec", SpecSettings(tree_width=3)), target, draft, n_ubatch=8,
                        n_seq_max=64, is_eog=lambda t: False, timeout_s=5)
    (first, runs1), (second, runs2) = _two_requests(dec, target, draft)
    for stats, runs in ((first, runs1), (second, runs2)):
        assert stats["draft_decodes"] == runs, (first, second)
        assert stats["tree_layers"] <= runs
        assert stats["new_trees"] <= stats["target_runs"]


COMMON = {"drafted", "draft_accepted", "acceptance_rate", "verified_per_position", "accepted_per_position",
          "acceptance_per_position", "pass_cost_ms", "target_passes", "accepted_per_pass", "prompt_steps",
          "step_tokens"}


@pytest.mark.parametrize("mode,spec_type", [("iterative", "draft"), ("speculative", "draft"), ("pipeinfer", "ngram"),
                                            ("pipedec", "draft")])
@pytest.mark.parametrize("slots", [1, 4])
def test_every_loop_reports_the_same_statistics(mode, spec_type, slots):
    """--parallel 1 (the mode's decoder in one slot) and the scheduler give
    every request at least the same keys (ggpipe.decoding.loop.common_stats),
    with the target's passes that carried its generation counted and its
    tokens after the first per pass."""
    from ggpipe.decoding.factory import build_loop
    from ggpipe.decoding.loop import Job

    target = FakePipeline(ToyLM(V, period=7), latency=2, cell_order=True, streams=slots > 1)
    draft = FakePipeline(ToyLM(V, flip=0.2), latency=1, name="draft")
    plan = DecodingPlan.resolve(mode, SpecSettings(spec_type=spec_type), slots=slots)
    loop = build_loop(plan, target, [draft], n_ctx=256, n_batch=16, n_seq_max=64 if slots == 1 else slots,
                      is_eog=lambda t: False, depth=None, timeout_s=5)
    job = Job(list(PROMPTS[0]), 20, Sampler(SamplingParams()))
    loop.submit(job)
    while loop.busy:
        loop.step()
    stats = loop.request_stats(job)
    assert COMMON <= set(stats), COMMON - set(stats)
    assert stats["target_passes"] > 0 and stats["accepted_per_pass"] >= 1.0, stats
    if mode == "iterative":
        assert stats["drafted"] == 0 and stats["target_passes"] == 19 and stats["accepted_per_pass"] == 1.0
