"""Minions' majority-voted speculator: the pure vote and weight learning
(ggpipe/speculation/majority.py) and the vote proposer against in-memory fake
pipelines (no MPI, no model). Real-weight exactness: tests/test_speculation_modes.py."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.proposers.base import Proposer, ProposerConfig, make_proposer
from ggpipe.speculation.proposers.options import StrategyOptions
from ggpipe.speculation.proposers.vote import VoteProposer
from ggpipe.speculation.majority import WeightedMajority, majority_path, support
from ggpipe.sim.toy import FakePipeline, ToyLM

sys.path.insert(0, str(Path(__file__).parent))
from test_decoding_loop import PROMPT, REPEATING, V, _decoder, _reference  # noqa: E402
from test_spec_statistics import chi2, critical  # noqa: E402


# -- the vote --------------------------------------------------------------------


def test_majority_path_follows_the_heaviest_child_to_a_leaf():
    # the paper's Figure 5: "like" (w1 + w2) beats "likes" (w3); "apple" (w1) beats "pear" (w2)
    like, likes, apple, pear, i = 1, 2, 3, 4, 9
    seqs = [[i, like, apple], [i, like, pear], [i, likes]]
    assert majority_path(seqs, [0.5, 0.4, 0.8]) == ([i, like, apple], 0)
    assert majority_path(seqs, [0.3, 0.4, 0.8]) == ([i, likes], 2)       # 0.7 < 0.8
    assert majority_path(seqs, [0.3, 0.4, 0.6]) == ([i, like, pear], 1)
    # a sequence that stops where another goes on: the path goes on to a leaf
    assert majority_path([[5], [5, 6, 7]], [1.0, 0.1]) == ([5, 6, 7], 1)
    # ties go to the lowest member index; nothing drafted: no vote
    assert majority_path([[5, 6], [5, 8]], [1.0, 1.0]) == ([5, 6], 0)
    assert majority_path([[5, 8], [5, 6]], [1.0, 1.0]) == ([5, 8], 0)
    assert majority_path([[], []], [1.0, 1.0]) == ([], -1)
    assert majority_path([[], [4]], [1.0, 0.01]) == ([4], 1)
    with pytest.raises(ValueError):
        majority_path([[1]], [1.0, 1.0])
    assert support([[5, 6], [5, 8], [5]], [5, 6], 0) == [0, 1, 2]
    assert support([[5, 6], [5, 8], [5]], [5, 6], 1) == [0]


def test_weighted_majority_penalises_the_losers_of_each_trial():
    wm = WeightedMajority(["a", "b", "c"], beta=0.5)
    wm.start()
    ctx = [1, 2, 3]
    wm.observe(ctx)
    # below anchor 3: a says 4 5 6, b says 4 7, c says 8
    wm.record(ctx, [[4, 5, 6], [4, 7], [8]], voted=0)
    wm.observe(ctx + [4])          # level 1 is not known yet: nothing scored
    assert wm.proposed == [0, 0, 0]
    wm.observe(ctx + [4, 5])       # a right so far, b wrong at level 1, c wrong at level 0; a's 6 unknown
    assert wm.proposed == [0, 0, 0]
    wm.observe(ctx + [4, 5, 9])
    assert wm.proposed == [3, 2, 1] and wm.accepted == [2, 1, 0]
    # trials: level 0 (a, b: 4 vs c: 8; c loses), level 1 (a: 5 vs b: 7; b loses);
    # level 2: a alone (no trial, though a was wrong)
    assert wm.trials == [2, 2, 1] and wm.lost == [0, 1, 1]
    assert wm.weights == [1.0, 0.5, 0.5]
    assert wm.acceptance(0) == pytest.approx(2 / 3) and wm.voted == [1, 0, 0]
    st = wm.stats()
    assert st["vote_a_weight"] == 1.0 and st["vote_b_lost"] == 1 and st["vote_c_acceptance"] == 0.0


def test_weighted_majority_scores_only_votes_below_decided_tokens():
    wm = WeightedMajority(["a", "b"])
    wm.start()
    wm.observe([1, 2])
    wm.record([1, 2, 7], [[3], [4]], voted=0)     # anchored below 7, not decided yet (pipeinfer)
    wm.record([1, 2, 8], [[3], [4]], voted=1)
    wm.observe([1, 2, 7, 4])
    assert wm.proposed == [1, 1] and wm.lost == [1, 0]   # the vote below 8 was dropped, not scored
    wm.observe([1, 2, 7, 4, 5])
    assert wm.proposed == [1, 1]
    assert wm.weights == [0.5, 1.0]
    with pytest.raises(ValueError):
        WeightedMajority(["a"], beta=1.0)


# -- the proposer ----------------------------------------------------------------


def _members(members) -> StrategyOptions:
    return StrategyOptions(vote=VoteProposer.Options(vote=tuple(members)))


def _vote(members=("draft", "ngram"), latency=1, flip=0.0, width=3):
    draft = FakePipeline(ToyLM(V, flip=flip), latency=latency, name="draft")
    p = make_proposer("vote", ProposerConfig(backend=draft, n_vocab=V, n_ubatch=8, width=width, options=_members(members)))
    return p, draft


def _run(p, *args):
    p.begin(*args)
    tree = None
    while tree is None:
        if p.ready():
            tree = p.poll()
        elif p.busy():
            p.drain_one(5)
    return tree


def test_vote_proposer_is_a_proposer_and_refuses_bad_members():
    p, _ = _vote()
    assert isinstance(p, Proposer) and p.name == "vote" and not p.instant
    assert [m.name for m in p.members] == ["draft", "ngram"]
    assert p.members[0].width == 1                       # chains only
    with pytest.raises(ValueError, match="two or more distinct"):
        make_proposer("vote", ProposerConfig(options=_members(("ngram",))))
    with pytest.raises(ValueError, match="two or more distinct"):
        make_proposer("vote", ProposerConfig(options=_members(("ngram", "ngram"))))
    with pytest.raises(ValueError, match="needs a draft model"):
        make_proposer("vote", ProposerConfig(options=_members(("draft", "ngram"))))


def test_vote_agreement_raises_confidence_and_ngram_extends_the_draft():
    """The draft (exact toy model) and the n-gram lookup agree on the
    repeating text: each node's confidence is the noisy-OR of both; the
    n-gram continues where the draft stopped."""
    period = len(REPEATING)
    ctx = REPEATING + [1, 2, 3]
    draft = FakePipeline(ToyLM(V, period=period), latency=1, name="draft")
    p = make_proposer("vote", ProposerConfig(backend=draft, n_vocab=V, n_ubatch=8, options=_members(("draft", "ngram"))))
    p.start(SamplingParams(), 0)
    draft_only = make_proposer("draft", ProposerConfig(backend=FakePipeline(ToyLM(V, period=period), latency=1,
                                                                            name="d2"), n_vocab=V, n_ubatch=8))
    draft_only.start(SamplingParams(), 0)
    alone = _run(draft_only, ctx, 0.34, 6, 0.3)
    tree = _run(p, ctx, 0.34, 6, 0.3)
    assert tree.tokens == [4, 5, 6, 7, 8, 9]
    assert alone.tokens == [4]                           # the draft alone stops at its cutoff
    assert all(a >= b for a, b in zip(tree.draft_p, alone.draft_p))
    assert p.stats["vote_extended"] == 1 and p.stats["ngram_lookups"] == 1


def test_vote_overrules_the_draft_as_soon_as_it_is_outvoted():
    """With the draft's weight below the n-gram's, a disagreement at level 0
    ends the micro-batch at once: the draft's decode in flight is abandoned
    and the n-gram chain is what the target gets."""
    ctx = REPEATING + [1, 2, 3]
    p, draft = _vote(flip=1.0, latency=3)                   # a draft that is always wrong
    p.start(SamplingParams(), 0)
    p.book.weights = [0.25, 1.0]
    tree = _run(p, ctx, 0.0, 4)
    assert tree.tokens == [4, 5, 6, 7]
    assert p.stats["vote_overruled"] == 1 and p.stats["vote_ngram_voted"] == 1
    assert p.stats["draft_decodes"] == 3 + 1             # the catch-up (20 tokens, ubatch 8) and one level
    p.settle(5)
    assert not draft.inflight


def test_vote_cut_hands_over_the_drafts_chain():
    p, draft = _vote(latency=1)
    p.start(SamplingParams(), 0)
    ctx = list(PROMPT)
    p.begin(ctx, 0.0, 6)
    while not p.can_cut():
        if p.ready():
            assert p.poll() is None
    toks = list(p.lead.partial().tokens)
    tree, tip = p.cut(0.0, lambda pos: 4)
    assert tree.tokens == toks and tip == len(toks) - 1 and tree.anchor_pos == len(ctx) - 1
    rest = None
    while rest is None:
        if p.ready():
            rest = p.poll()
    assert rest.anchor_pos == len(ctx) - 1 + len(toks) and len(rest) <= 4
    p.settle(5)


# -- in the loop -----------------------------------------------------------------


@pytest.mark.parametrize("period", [0, len(REPEATING)])
def test_vote_learns_whom_to_follow_and_stays_exact(period):
    """Greedy output equals the reference; the vote's tokens per target pass
    are at least 80% of the better proposer's alone (speculative mode, the
    toy pair), and on repeating text the n-gram wins the weight."""
    prompt = PROMPT if not period else REPEATING + [1, 2]
    tpp = {}
    for st in ("draft", "ngram", "vote"):
        dec, _, _ = _decoder(SpecSettings(spec_type=st), st, period=period, flip=0.3, mode="speculative")
        out = dec.generate(np.array(prompt, np.int32), 60, Sampler(SamplingParams()))
        assert out == _reference(60, prompt, period)
        tpp[st] = dec.stats["accepted_per_pass"]
        if st == "vote":
            stats = dec.stats
    assert tpp["vote"] >= 0.8 * max(tpp["draft"], tpp["ngram"])
    assert stats["vote_draft_proposed"] > 0 and stats["vote_ngram_proposed"] > 0
    if period:
        assert stats["vote_ngram_weight"] > stats["vote_draft_weight"]


def test_stochastic_vote_preserves_the_target_distribution():
    """Sampling at temperature 1 through the vote (one-hot draft
    distributions): the marginal law of the second generated token equals
    the target's, sum over t1 of p(t1) p(t2 | t1) (chi-square, p = 0.001)."""
    lm = ToyLM(V, margin=1.0)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    ctx = list(PROMPT)
    p1 = target_probs(lm.logits(ctx), params)
    p2 = sum(p1[t] * target_probs(lm.logits(ctx + [t]), params) for t in range(V))
    counts = np.zeros(V)
    n, drafted = 1500, 0
    dec, target, _ = _decoder(SpecSettings(spec_type="vote", p_accept=0.0), "vote", flip=0.3, mode="speculative")
    target.model = lm
    for s in range(n):
        target.seq_rm(-1, 0, -1)   # as the engine does before a request that reuses no prefix
        out = dec.generate(np.array(ctx, np.int32), 2, Sampler(SamplingParams(temperature=1.0, top_k=0,
                                                                             top_p=1.0, seed=s)))
        counts[out[1]] += 1
        drafted += dec.stats["drafted"]
    assert drafted > n / 2          # the second token went through verification of voted drafts
    stat, df = chi2(counts, p2)
    assert stat < critical(df), (stat, df)


# -- several draft models (-md a,b), each on its own pipeline ---------------------------


def _two_drafts(mode: str, latency: int, lat2: int, flip2: float, members=("draft", "ngram"), **spec):
    from ggpipe.decoding.factory import build_decoder

    target = FakePipeline(ToyLM(V), latency=latency, cell_order=True)
    good = FakePipeline(ToyLM(V, flip=0.1), latency=1, name="draft")
    poor = FakePipeline(ToyLM(V, flip=flip2, seed=5), latency=lat2, name="draft2")
    plan = DecodingPlan.resolve(mode, SpecSettings(spec_type="vote", strategy_options=_members(members), **spec),
                                n_draft_models=2)
    dec = build_decoder(plan, target, good, more_drafts=[poor], n_ubatch=8, n_seq_max=64, is_eog=lambda t: False,
                        timeout_s=5)
    return dec, target, good, poor


@pytest.mark.parametrize("mode,latency,lat2,flip2", [
    ("speculative", 3, 1, 0.7), ("pipeinfer", 3, 2, 0.7), ("pipeinfer", 6, 1, 0.0), ("pipeinfer", 4, 2, 0.5),
])
def test_a_vote_over_two_draft_models_stays_exact_and_learns_the_better_one(mode, latency, lat2, flip2):
    """Two draft models on pipelines of their own (``draft``, ``draft2``)
    and the n-gram: greedy output equals the reference; both drafts drafted
    every micro-batch; the better draft ends with the larger weight."""
    dec, target, good, poor = _two_drafts(mode, latency, lat2, flip2)
    out = dec.generate(np.array(PROMPT, np.int32), 60, Sampler(SamplingParams()))
    assert out == _reference(60)
    st = dec.stats
    assert st["draft_decodes"] > 0 and st["draft2_draft_decodes"] > 0
    assert st["vote_draft_proposed"] > 0 and st["vote_draft2_proposed"] > 0
    if flip2 >= 0.5:
        assert st["vote_draft_weight"] > st["vote_draft2_weight"], st
    assert not target.inflight and not good.inflight and not poor.inflight
    # requests in a row (the engine first trims the target's KV to the common prefix): the drafts' caches follow
    hist = PROMPT + out[:-1]
    target.seq_rm(-1, len(hist), -1)
    again = dec.generate(np.array([out[-1], 7], np.int32), 20, Sampler(SamplingParams()), start_pos=len(hist),
                         history=hist)
    assert again == ToyLM(V).greedy(hist + [out[-1], 7], 20)


@pytest.mark.parametrize("mode,members", [("speculative", ("draft",)), ("pipeinfer", ("draft", "ngram"))])
def test_stochastic_vote_over_two_draft_models_preserves_the_target_distribution(mode, members):
    """Sampling at temperature 1 through a vote of two draft models on
    pipelines of their own (each drawing its chain from its own q, the
    merged chain verified with one-hot q): the marginal law of the third
    generated token equals the target's, sum over t1, t2 of
    p(t1) p(t2 | t1) p(t3 | t1 t2) (chi-square, p = 0.001)."""
    lm = ToyLM(V, margin=1.0)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    ctx = list(PROMPT)
    p1 = target_probs(lm.logits(ctx), params)
    p3 = np.zeros(V)
    for t1 in range(V):
        p2 = target_probs(lm.logits(ctx + [t1]), params)
        for t2 in range(V):
            p3 += p1[t1] * p2[t2] * target_probs(lm.logits(ctx + [t1, t2]), params)
    dec, target, good, poor = _two_drafts(mode, 6, 1, 0.5, members=members, p_accept=0.0)
    target.model = lm
    good.model, poor.model = ToyLM(V, margin=1.0, flip=0.1), ToyLM(V, margin=1.0, flip=0.5, seed=5)
    counts = np.zeros(V)
    n, drafted = 1500, 0
    for s in range(n):
        target.seq_rm(-1, 0, -1)   # as the engine does before a request that reuses no prefix
        out = dec.generate(np.array(ctx, np.int32), 3, Sampler(replace(params, seed=s)))
        counts[out[2]] += 1
        drafted += dec.stats["drafted"]
    st = dec.stats
    assert drafted > n / 2 and st["vote_draft_proposed"] > 0 and st["vote_draft2_proposed"] > 0, (drafted, st)
    stat, df = chi2(counts, p3)
    assert stat < critical(df), (stat, df)


def test_several_draft_models_are_refused_outside_a_vote():
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.errors import ConfigError

    t, a, b = (FakePipeline(ToyLM(V), name=n) for n in ("target", "draft", "draft2"))
    for mode, st in (("pipeinfer", "draft"), ("pipedec", "draft"), ("speculative", "staged")):
        with pytest.raises(ConfigError, match="draft only in a vote"):
            build_decoder(DecodingPlan.resolve(mode, SpecSettings(spec_type=st), n_draft_models=2), t, a,
                          more_drafts=[b], n_ubatch=8, n_seq_max=64, is_eog=lambda x: False, timeout_s=5)
    with pytest.raises(ConfigError, match="draft only in a vote"):
        build_decoder(DecodingPlan.resolve("pipeinfer", SpecSettings(
            spec_type="vote", strategy_options=_members(("staged", "ngram"))), n_draft_models=2),
                      t, a, more_drafts=[b], n_ubatch=8, n_seq_max=64, is_eog=lambda x: False, timeout_s=5)


def test_draft_stands_for_every_draft_model():
    from ggpipe.speculation.majority import expand_members, member_of

    assert expand_members(["draft", "ngram"], 3) == ["draft", "draft2", "draft3", "ngram"]
    assert expand_members(["draft"], 2) == ["draft", "draft2"]       # two draft models vote alone
    with pytest.raises(ValueError, match="two or more"):
        expand_members(["draft"], 1)
    assert [member_of(x) for x in ("draft", "draft2", "ngram")] == [("draft", 0), ("draft", 1), ("ngram", 0)]
