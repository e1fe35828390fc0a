"""Staged SD's draft-of-draft (--spec-type staged) against in-memory fake
pipelines: the draft verifies n-gram guesses in the run that decodes each
new tip, builds the trees the plain draft builds, in fewer draft runs where
the text repeats; stochastic drafts stay exact draws from q."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.proposers.base import ProposerConfig, make_proposer
from ggpipe.speculation.proposers.options import StrategyOptions
from ggpipe.speculation.proposers.staged import StagedProposer, guess_budget
from ggpipe.sim.toy import FakePipeline, ToyLM

sys.path.insert(0, str(Path(__file__).parent))
from test_decoding_loop import REPEATING, V, _decoder, _reference  # noqa: E402
from test_spec_statistics import chi2, critical  # noqa: E402


def _grow(name, ctx, period, cutoff=0.0, n=6, params=SamplingParams(), seed=0):
    pipe = FakePipeline(ToyLM(V, period=period), latency=1, name="draft", cell_order=True)
    p = make_proposer(name, ProposerConfig(backend=pipe, n_vocab=V, n_ubatch=64))
    p.start(params, seed)
    p.begin(list(ctx), cutoff, n)
    tree = None
    while tree is None:
        if p.ready():
            tree = p.poll()
    return tree, p, pipe


@pytest.mark.parametrize("period", [0, len(REPEATING)])
def test_staged_builds_the_drafts_tree_in_fewer_runs(period):
    ctx = REPEATING + [1, 2, 3]
    plain, p0, d0 = _grow("draft", ctx, period)
    staged, p1, d1 = _grow("staged", ctx, period)
    assert staged.tokens == plain.tokens and staged.draft_p == pytest.approx(plain.draft_p)
    assert p1.cursor == p0.cursor == ctx + plain.tokens[:-1]   # the deepest level is never decoded
    # the draft's KV holds exactly its cursor (rejected guesses removed)
    assert sorted(d1.cells.get(0, {})) == list(range(len(p1.cursor)))
    assert [d1.cells[0][i] for i in range(len(p1.cursor))] == p1.cursor
    if period:   # the repeating text: the guesses are right, one run drafts the whole chain
        assert d1.n_runs < d0.n_runs and p1.stats["guesses_accepted"] >= 4
    else:
        assert d1.n_runs == d0.n_runs


def test_staged_draws_are_exact_draws_from_q():
    """Stochastic staged trees: level 1 comes from the anchor's row; level 2
    from the row of a run that also carried the n-gram guess 5 (taken with
    probability q(5), else a draw from q without 5); level 3, below an
    accepted guess, from that run's second row. Each level is distributed
    as q given the levels above it (chi-square, p = 0.001)."""
    ctx = REPEATING + [1, 2, 3]            # the n-gram guesses 4 5 6 ...
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    lm = ToyLM(V, period=len(REPEATING))
    q = {k: target_probs(lm.logits(ctx + list(k)), params) for k in [(), (4,), (4, 5)]}
    counts = {k: np.zeros(V) for k in q}
    guessed = 0
    for s in range(3000):
        tree, p, _ = _grow("staged", ctx, len(REPEATING), n=3, params=params, seed=s)
        t = tree.tokens
        counts[()][t[0]] += 1
        if t[0] == 4:
            counts[(4,)][t[1]] += 1
            if t[1] == 5:
                counts[(4, 5)][t[2]] += 1
        guessed += p.stats["guesses_accepted"]
    assert guessed > 100
    for k in q:
        assert counts[k].sum() > 100, k
        stat, df = chi2(counts[k], q[k])
        assert stat < critical(df), (k, stat, df)


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_staged_in_the_loop_is_exact(mode):
    prompt, period = REPEATING + [1, 2], len(REPEATING)
    dec, _, draft = _decoder(SpecSettings(spec_type="staged"), "staged", period=period, mode=mode)
    out = dec.generate(np.array(prompt, np.int32), 40, Sampler(SamplingParams()))
    assert out == _reference(40, prompt, period)
    assert dec.stats["spec_type"] == "staged" and dec.stats["guesses_accepted"] > 0


# -- how many guesses a run carries: measured costs and the learned acceptance -----------------

def test_guess_budget_keeps_guesses_while_the_saving_pays():
    assert guess_budget(5, 0.9, None, 0.001) == 5 and guess_budget(5, 0.9, 0.01, None) == 5  # costs unknown
    assert guess_budget(5, 0.0, 0.01, -0.001) == 5        # a batch that looks free (noise)
    assert guess_budget(5, 1.0, 0.01, 0.01) == 5          # sure guesses that cost a step each
    assert guess_budget(5, 0.99, 0.01, 0.01) == 0
    assert guess_budget(5, 0.5, 0.01, 0.001) == 3         # 0.5, 0.25, 0.125 >= 0.1 > 0.0625
    assert guess_budget(0, 1.0, 0.01, 0.0) == 0


def _guesses(most: int | None) -> StrategyOptions:
    return StrategyOptions(staged=StagedProposer.Options(guesses=most))


def _grow_timed(ctx, period, step_s, marginal_s, n=6, trees=1, guesses=None):
    """Like _grow, after the draft's run cost has been timed at 1 and 2 tokens;
    ``trees`` trees in a row, each below the last one's chain."""
    pipe = FakePipeline(ToyLM(V, period=period), latency=1, name="draft", cell_order=True)
    p = make_proposer("staged", ProposerConfig(backend=pipe, n_vocab=V, n_ubatch=64, options=_guesses(guesses)))
    p.start(SamplingParams(), 0)
    p.timed(1, step_s)
    p.timed(2, step_s + marginal_s)
    ctx = list(ctx)
    for _ in range(trees):
        p.begin(ctx, 0.0, n)
        tree = None
        while tree is None:
            if p.ready():
                tree = p.poll()
        ctx += tree.tokens
    return ctx, p, pipe


def test_guesses_not_worth_their_cost_are_held_back_and_still_learned():
    """A run that costs 5x a step per extra token carries no guess (but for one
    exploring run in EXPLORE_EVERY); the draft's own tokens, compared with the
    guesses held back, still teach the proposer that the guesses are right."""
    ctx = REPEATING + [1, 2, 3]
    out, p, pipe = _grow_timed(ctx, len(REPEATING), 0.01, 0.05, trees=4)
    plain, _, d0 = _grow("draft", ctx, len(REPEATING))
    assert out[len(ctx):len(ctx) + len(plain.tokens)] == plain.tokens
    assert p.stats["guesses_made"] == 0 and p.stats["guesses_held"] > 0
    assert p.stats["guesses_accepted"] == 0
    assert p.accept > 0.75           # from the prior 0.5: every held-back guess was what the draft drafted


@pytest.mark.parametrize("most", [0, 2])
def test_spec_guesses_replaces_the_budget(most):
    """--spec-guesses N: up to N guesses in every run that found some, even
    where the budget would hold them all back (a 5x-step cost per token);
    the trees stay those of the plain draft."""
    ctx = REPEATING + [1, 2, 3]
    out, p, pipe = _grow_timed(ctx, len(REPEATING), 0.01, 0.05, trees=4, guesses=most)
    plain, _, _ = _grow("draft", ctx, len(REPEATING))
    assert out[len(ctx):len(ctx) + len(plain.tokens)] == plain.tokens
    assert p.stats["guesses_held"] > 0                     # more were found than N
    if most:   # four trees, each at least one run with N guesses, right ones (the text repeats)
        assert p.stats["guesses_made"] >= 4 * most and p.stats["guesses_accepted"] >= 4
    else:
        assert p.stats["guesses_made"] == 0


def test_a_negative_guess_count_is_refused():
    with pytest.raises(ValueError, match="--spec-guesses"):
        make_proposer("staged", ProposerConfig(backend=FakePipeline(ToyLM(V), name="draft"), n_vocab=V, options=_guesses(-1)))


def test_sure_cheap_guesses_are_sent():
    ctx = REPEATING + [1, 2, 3]
    _, p, pipe = _grow_timed(ctx, len(REPEATING), 0.01, 0.001)
    plain, _, d0 = _grow("draft", ctx, len(REPEATING))
    # at the prior 0.5, three guesses pay (0.5, 0.25, 0.125 of 10 ms >= 1 ms); they are right, so more do
    assert p.stats["guesses_made"] >= 3 and p.stats["guesses_accepted"] >= 3 and pipe.n_runs < d0.n_runs
    assert p.accept > 0.5


def test_the_rate_follows_the_text():
    """Where the text does not repeat (the toy with period 0, for its first 30
    tokens) the guesses are wrong: the rate falls from the prior and cheap
    guesses stop being sent. The toy's text then falls into a cycle of 6
    tokens; the held-back guesses turn right and the rate climbs again."""
    ctx = REPEATING + [1, 2, 3]
    _, p, _ = _grow_timed(ctx, 0, 0.01, 0.004, trees=5)   # one guess pays at the prior (5 ms >= 4 ms)
    assert p.stats["guesses_made"] >= 1 and p.stats["guesses_accepted"] == 0
    assert p.accept < 0.4 and guess_budget(4, p.accept, 0.01, 0.004) == 0
    assert p.stats["guesses_held"] > p.stats["guesses_made"]
    out, p, _ = _grow_timed(ctx, 0, 0.01, 0.004, trees=12)
    assert out[-12:] == out[-6:] * 2 and p.accept > 0.5
