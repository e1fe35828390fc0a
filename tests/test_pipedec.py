"""PipeDec (``--mode pipedec``): the prediction tree's layer rule, and the
decoding loop against in-memory fake pipelines (ggpipe/sim/toy.py): no MPI,
no model. Greedy output must equal plain greedy decoding of the target for
every tree shape, pipeline depth and latency; the fake KV cache asserts that
every token of every run sees exactly its own ancestors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.prediction_tree import next_layer

V = 48
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9]


def test_next_layer_takes_the_best_cumulative_probabilities():
    a = (np.array([5, 6, 7]), np.array([0.6, 0.3, 0.1]))
    b = (np.array([8, 9]), np.array([0.9, 0.1]))
    # parent 0 has cumulative 0.5, parent 1 has 0.5: children 0.3 / 0.15 / 0.05 and 0.45 / 0.05
    out = next_layer([math.log(0.5), math.log(0.5)], [a, b], width=3, max_children=3)
    assert [(c.parent, c.token) for c in out] == [(0, 5), (0, 6), (1, 8)]   # BFS order
    assert out[2].logp == pytest.approx(math.log(0.45))
    # at most max_children per node, never a zero-probability branch
    out = next_layer([0.0], [(np.array([1, 2, 3]), np.array([0.5, 0.5, 0.0]))], width=8, max_children=2)
    assert [c.token for c in out] == [1, 2]
    assert next_layer([0.0], [(np.array([1]), np.array([0.0]))], 4, 4) == []
    with pytest.raises(ValueError):
        next_layer([0.0], [a], width=0, max_children=1)


def _decoder(width: int, children: int, stages: int, latency: int, draft_latency: int = 1, flip: float = 0.3,
             n_seq_max: int = 64):
    target = FakePipeline(ToyLM(V), latency=latency, cell_order=width == 1)
    target.n_stages = stages
    draft = FakePipeline(ToyLM(V, flip=flip), latency=draft_latency, name="draft")
    spec = SpecSettings(tree_width=width, max_children=children)
    dec = build_decoder(DecodingPlan.resolve("pipedec", spec), target, draft, n_ubatch=8, n_seq_max=n_seq_max,
                        is_eog=lambda t: False, timeout_s=5)
    return dec, target, draft


@pytest.mark.parametrize("width,children,stages,latency,draft_latency,flip", [
    (1, 1, 1, 3, 1, 0.3), (1, 1, 4, 4, 1, 0.3), (1, 1, 4, 2, 3, 0.0),
    (4, 4, 2, 3, 1, 0.3), (4, 2, 4, 5, 1, 0.5), (8, 4, 3, 2, 2, 0.3), (3, 3, 4, 6, 1, 0.9),
])
def test_greedy_equals_reference(width, children, stages, latency, draft_latency, flip):
    dec, target, draft = _decoder(width, children, stages, latency, draft_latency, flip)
    out = dec.generate(np.array(PROMPT, np.int32), 40, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(list(PROMPT), 40)
    st = dec.stats
    assert st["spec_type"] == "pipedec"
    assert st["verified_runs"] + st["returned_cancelled"] == st["target_runs"]
    assert not target.inflight and not draft.inflight
    if width > 1:
        assert max(target.run_sizes) > 1   # layers with several nodes


@pytest.mark.parametrize("width,children,stages,latency,flip", [(4, 2, 4, 5, 0.5), (3, 3, 4, 6, 0.9)])
def test_dead_rows_of_layers_in_flight_are_masked(width, children, stages, latency, flip):
    """After a hit, the nodes below the rejected siblings die while their
    layers are in flight: those rows are masked (PipeDec 3.3.4,
    ggpipe.pipeline.masking), and the output stays exact."""
    dec, target, draft = _decoder(width, children, stages, latency, 1, flip)
    out = dec.generate(np.array(PROMPT, np.int32), 40, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(list(PROMPT), 40)
    assert dec.stats["rows_mask_sent"] > 0 and target.stats["rows_masked"] > 0


def test_a_good_draft_makes_one_token_per_layer_and_few_roots():
    """A perfect draft that keeps up with a 4-stage pipeline (a run's round
    trip is 8 ticks, a draft run's 1): one root run, then every layer hits,
    each layer run deciding one token while 4 more are in flight."""
    dec, target, _ = _decoder(2, 2, 4, 8, flip=0.0)
    out = dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(list(PROMPT), 30)
    assert dec.stats["root_runs"] == 1 and dec.stats["new_trees"] == 1
    assert dec.stats["draft_accepted"] == 28


def test_requests_in_a_row_share_the_draft_cache():
    dec, target, draft = _decoder(3, 3, 2, 3)
    first = dec.generate(np.array(PROMPT, np.int32), 10, Sampler(SamplingParams()))
    hist = PROMPT + first[:-1]
    second = dec.generate(np.array([first[-1], 7], np.int32), 10, Sampler(SamplingParams()),
                          start_pos=len(hist), history=hist)
    assert second == ToyLM(V).greedy(hist + [first[-1], 7], 10)


def _sampled(prompt: list[int], n: int, params: SamplingParams) -> list[int]:
    """Plain autoregressive sampling of the toy target: one Sampler.sample per token."""
    lm, sampler, ctx = ToyLM(V), Sampler(params), list(prompt)
    for _ in range(n):
        ctx.append(sampler.sample(lm.logits(ctx)))
    return ctx[len(prompt):]


@pytest.mark.parametrize("width,children,stages,latency", [(1, 1, 3, 4), (4, 3, 2, 3), (8, 4, 4, 6)])
def test_sampling_gives_plain_sampling_tokens_for_the_seed(width, children, stages, latency):
    """With a temperature each position is one draw from the target's
    distribution (the draft's children are chosen, not drawn: point masses,
    ggpipe.speculation.verify), so for every seed the tokens are those of
    plain sampling with that seed, whatever the tree and timing; and drafts
    are still accepted."""
    accepted = 0
    for seed in range(12):
        params = SamplingParams(temperature=0.9, top_k=8, top_p=0.95, seed=seed)
        dec, _, _ = _decoder(width, children, stages, latency, flip=0.2)
        assert dec.generate(np.array(PROMPT, np.int32), 30, Sampler(params)) == _sampled(PROMPT, 30, params)
        accepted += dec.stats["draft_accepted"]
    assert accepted > 12 * 30 // 10


def test_refuses_a_missing_draft():
    with pytest.raises(ConfigError, match="needs a draft model"):
        build_decoder(DecodingPlan.resolve("pipedec", SpecSettings()), FakePipeline(ToyLM(V)), None, n_ubatch=8,
                      n_seq_max=16, is_eog=lambda t: False, timeout_s=5)


def test_few_sequences_still_exact():
    """With few KV sequences a layer is cut to the best nodes that fit."""
    dec, _, _ = _decoder(8, 4, 3, 3, n_seq_max=6)
    out = dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(list(PROMPT), 30)


class _Jitter(FakePipeline):
    """Results come back in order, each 1..latency ticks after it was sent."""

    def __init__(self, *a, rng, **k):
        super().__init__(*a, **k)
        self.rng = rng

    def _scheduled(self, run):
        prev = max(self._due.values(), default=0)
        self._due[run.run_id] = max(prev, self.clock + self.rng.randint(1, self.latency))


def test_random_timing_tree_shapes_and_sequence_budgets_stay_exact():
    """Hits below a node the deepest sent layer had no child of, unsent hits,
    cancelled layers, few sequences, requests in a row: exact every time."""
    import random

    rng = random.Random(2)
    for _ in range(150):
        w, c, stages = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 4])
        target = _Jitter(ToyLM(V), latency=rng.randint(1, 16), cell_order=w == 1, rng=rng)
        target.n_stages = stages
        draft = _Jitter(ToyLM(V, flip=rng.choice([0.0, 0.1, 0.3, 0.6])), latency=rng.randint(1, 6), name="draft",
                        rng=rng)
        dec = build_decoder(DecodingPlan.resolve("pipedec", SpecSettings(tree_width=w, max_children=c)), target, draft,
                            n_ubatch=8, n_seq_max=rng.choice([3, 4, 8, 45]), is_eog=lambda t: False, timeout_s=5)
        prompt = [rng.randrange(V) for _ in range(rng.randint(2, 15))]
        out = dec.generate(np.array(prompt, np.int32), 40, Sampler(SamplingParams()))
        assert out == ToyLM(V).greedy(prompt, 40)
        hist, more = prompt + out[:-1], [out[-1], rng.randrange(V)]
        out2 = dec.generate(np.array(more, np.int32), 20, Sampler(SamplingParams()), start_pos=len(hist), history=hist)
        assert out2 == ToyLM(V).greedy(hist + more, 20)
