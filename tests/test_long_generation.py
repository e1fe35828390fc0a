"""A long request keeps its head-side state bounded: the
speculation graph is trimmed behind the committed prefix in every
speculative mode, greedy and sampled, so memory stays flat however many
tokens one request generates (scripts/soak_memory.py runs 20,000 tokens on
real ranks). The toy pipelines (ggpipe/sim/toy.py) stand in for the ranks."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.graph import TRIM_LAG

V = 48
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9]
N = 2000


def _peaks(dec) -> dict:
    """Wrap ``dec.step`` to record the largest graph (nodes, runs) of the request."""
    peak = {"nodes": 0, "runs": 0}
    step = dec.step

    def recording():
        step()
        g = dec.r.graph
        peak["nodes"] = max(peak["nodes"], len(g.nodes))
        peak["runs"] = max(peak["runs"], len(g.runs))

    dec.step = recording
    return peak


@pytest.mark.parametrize("mode,extra", [("speculative", {"branches": 2}), ("pipeinfer", {"branches": 2}),
                                        ("pipedec", {"tree_width": 3})])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_graph_stays_bounded_over_a_long_request(mode, extra, temperature):
    target = FakePipeline(ToyLM(V), latency=4)
    target.n_stages = 3
    draft = FakePipeline(ToyLM(V, flip=0.3), latency=1, name="draft")
    spec = SpecSettings(spec_type="draft", p_split=0.05, **extra)
    dec = build_decoder(DecodingPlan.resolve(mode, spec), target, draft, n_ubatch=8, n_seq_max=64,
                        is_eog=lambda t: False, timeout_s=5)
    peak = _peaks(dec)
    params = SamplingParams(temperature=temperature, seed=7 if temperature else None)
    out = dec.generate(np.array(PROMPT, np.int32), N, Sampler(params))
    assert len(out) == N
    if temperature == 0.0:
        assert out == ToyLM(V).greedy(PROMPT, N)
    assert dec.stats["drafted"] > N // 10
    # nodes within TRIM_LAG positions of the committed one, a few trees' worth of width each
    assert peak["nodes"] <= 4 * TRIM_LAG, peak
    assert peak["runs"] <= 64, peak


DRAFTERS = [("speculative", {"spec_type": "draft"}), ("pipeinfer", {"spec_type": "draft"}),
            ("pipeinfer", {"spec_type": "draft", "branches": 2}), ("speculative", {"spec_type": "ngram"}),
            ("pipeinfer", {"spec_type": "ngram"}), ("pipedec", {"tree_width": 3})]


@pytest.mark.parametrize("mode,extra", DRAFTERS, ids=[f"{m}-{'-'.join(map(str, e.values()))}" for m, e in DRAFTERS])
def test_a_seed_fixes_the_text_whatever_was_drafted(mode, extra):
    """Drafter invariance: with a seed, every speculative mode and strategy
    decides the tokens iterative sampling decides with that seed, whatever
    the draft proposes and whenever the target's results arrive (draft
    models that disagree with the target 30% and 60% of the time, the
    target's results after 4 or 3 polls); the toy pipelines' rows are exact,
    as the exact build's."""
    params = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=123)
    it = build_decoder(DecodingPlan.resolve("iterative", SpecSettings()),
                       FakePipeline(ToyLM(V), latency=2), None, n_ubatch=8,
                       n_seq_max=64, is_eog=lambda t: False, timeout_s=5)
    want = it.generate(np.array(PROMPT, np.int32), 200, Sampler(params))
    for flip, latency in ((0.3, 4), (0.6, 3)):
        target = FakePipeline(ToyLM(V), latency=latency)
        target.n_stages = 3
        draft = FakePipeline(ToyLM(V, flip=flip), latency=1, name="draft")
        spec = SpecSettings(p_split=0.05, **extra)
        dec = build_decoder(DecodingPlan.resolve(mode, spec),
                            target, draft, n_ubatch=8, n_seq_max=64, is_eog=lambda t: False,
                            timeout_s=5)
        got = dec.generate(np.array(PROMPT, np.int32), 200, Sampler(params))
        assert got == want, (mode, extra, flip)
        assert dec.stats["drafted"] > 0
