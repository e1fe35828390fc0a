"""The speculative decoding loop (PipeInfer IV) and the proposers against
in-memory fake pipelines (ggpipe/sim/toy.py): no MPI, no model. Greedy
output must equal plain greedy decoding of the target, for every mode,
proposer, tree width, latency and ablation; the fake KV cache asserts that
every token of every run sees exactly its own context."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ggpipe.decoding.iterative import Iterative
from ggpipe.decoding.mode import mode_class
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.proposers.base import REGISTRY, Proposer, ProposerConfig, make_proposer, proposer_class
from ggpipe.speculation.proposers.draft_model import DraftModelProposer
from ggpipe.speculation.proposers.ngram import NgramProposer, ngram_lookup
from ggpipe.speculation.proposers.options import StrategyOptions

from ggpipe.sim.toy import FakePipeline, ToyLM

V = 48
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9]


def _decoder(spec: SpecSettings, spec_type: str, latency: int = 3, draft_latency: int = 1, flip: float = 0.3,
             n_seq_max: int = 64, period: int = 0, mode: str = "pipeinfer"):
    # chains: every token's cells must sit at index = position (docs/user-guide/exactness.md)
    target = FakePipeline(ToyLM(V, period=period), latency=latency, cell_order=spec.branches == 1)
    draft = FakePipeline(ToyLM(V, flip=flip, period=period), latency=draft_latency, name="draft")
    prop = make_proposer(spec_type, ProposerConfig(backend=draft, n_vocab=V, n_ubatch=8, p_split=spec.p_split,
                                                   width=spec.branches))
    dec = mode_class(mode).over(target, prop, spec, n_seq_max=n_seq_max, n_ubatch=8, is_eog=lambda t: False,
                               timeout_s=5)
    return dec, target, draft


def _ngram(n_min: int, n_max: int) -> StrategyOptions:
    return StrategyOptions(ngram=NgramProposer.Options(ngram_min=n_min, ngram_max=n_max))


def _reference(n: int, prompt=PROMPT, period: int = 0) -> list[int]:
    return ToyLM(V, period=period).greedy(list(prompt), n)


REPEATING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # with period=len: the text repeats


@pytest.mark.parametrize("mode,width,latency,continuous,cancel", [
    ("speculative", 1, 3, True, True), ("speculative", 3, 2, True, True),
    ("pipeinfer", 1, 3, True, True), ("pipeinfer", 1, 1, True, True), ("pipeinfer", 1, 6, True, True),
    ("pipeinfer", 2, 4, True, True), ("pipeinfer", 1, 4, False, True), ("pipeinfer", 1, 4, True, False),
])
@pytest.mark.parametrize("spec_type", ["draft", "ngram", "vote", "staged"])
def test_greedy_equals_reference(mode, width, latency, continuous, cancel, spec_type):
    spec = SpecSettings(spec_type=spec_type, branches=width, continuous=continuous, cancel=cancel, p_split=0.05)
    dec, target, _ = _decoder(spec, spec_type, latency=latency, mode=mode)
    out = dec.generate(np.array(PROMPT, np.int32), 40, Sampler(SamplingParams()))
    assert out == _reference(40)
    assert dec.stats["spec_type"] == spec_type
    assert dec.stats["verified_runs"] + dec.stats["returned_cancelled"] == dec.stats["target_runs"]
    assert not target.inflight


def test_iterative_equals_reference():
    target = FakePipeline(ToyLM(V))
    out = Iterative(target, 8, lambda t: False).generate(np.array(PROMPT, np.int32), 20,
                                                               Sampler(SamplingParams()))
    assert out == _reference(20)


def test_requests_share_the_draft_cache():
    """A second request on a longer context decodes only what the draft's KV lacks."""
    spec = SpecSettings()
    dec, target, draft = _decoder(spec, "draft")
    first = dec.generate(np.array(PROMPT, np.int32), 10, Sampler(SamplingParams()))
    decodes = dec.stats["draft_decodes"]
    hist = PROMPT + first[:-1]   # what sequence 0 of the target holds (the last token was never decoded)
    # the target keeps its sequence 0 (as the engine's prefix reuse does); the request adds two tokens
    second = dec.generate(np.array([first[-1], 7], np.int32), 10, Sampler(SamplingParams()), start_pos=len(hist),
                          history=hist)
    assert second == _reference(10, PROMPT + first + [7])
    assert dec.stats["draft_decodes"] - decodes < len(hist)   # no full re-prefill
    dec.reset()
    assert dec.proposer.cursor == []


def test_eog_and_emit_stop():
    spec = SpecSettings(spec_type="ngram")
    ref = _reference(30)
    eog = ref[12]
    dec, target, _ = _decoder(spec, "ngram")
    dec.is_eog = lambda t: t == eog
    out = dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams()))
    assert out == ref[:ref.index(eog) + 1]
    target.seq_rm(-1, 0, -1)  # as the engine does before a request that reuses no prefix
    got = []
    dec.is_eog = lambda t: False
    out = dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams()),
                       emit=lambda toks: got.extend(toks) or len(got) >= 5)
    assert got == out and out == ref[:len(out)] and 5 <= len(out) <= 5 + spec.draft_max


def test_ngram_drafts_make_long_passes_on_repetitive_text():
    """On text the prompt already contains, n-gram drafting needs far fewer
    target passes than tokens (the toy model continues the prompt's cycle)."""
    prompt, period = REPEATING + [1, 2], len(REPEATING)
    spec = SpecSettings(spec_type="ngram", draft_max=8)
    dec, target, _ = _decoder(spec, "ngram", period=period, mode="speculative")
    out = dec.generate(np.array(prompt, np.int32), 40, Sampler(SamplingParams()))
    assert out == _reference(40, prompt, period)
    assert dec.stats["accepted_per_pass"] > 3
    assert dec.stats["ngram_hits"] > 0


# -- proposers alone ----------------------------------------------------------------


def test_registry_and_protocol():
    assert set(REGISTRY) >= {"draft", "ngram", "vote", "staged"}
    for name in REGISTRY:
        cls = proposer_class(name)
        assert cls.name == name
    draft = FakePipeline(ToyLM(V), name="draft")
    assert isinstance(make_proposer("draft", ProposerConfig(backend=draft, n_vocab=V)), Proposer)
    assert isinstance(make_proposer("ngram", ProposerConfig(n_vocab=V)), Proposer)
    with pytest.raises(ValueError, match="unknown speculation type"):
        make_proposer("nope", ProposerConfig())
    with pytest.raises(ValueError, match="needs a draft model"):
        make_proposer("draft", ProposerConfig())
    with pytest.raises(ValueError, match="n-gram sizes"):
        make_proposer("ngram", ProposerConfig(options=_ngram(3, 2)))


@pytest.mark.parametrize("context,n_min,n_max,k,expected", [
    ([5, 6, 7, 8, 5, 6], 1, 3, 3, [7, 8, 5]),
    ([1, 2, 3], 1, 3, 4, []),
    ([1, 2, 1, 3, 1], 1, 1, 2, [3, 1]),           # most recent occurrence of the 1-gram
    ([1, 2, 9, 1, 2, 8, 2], 1, 2, 1, [8]),         # "2" alone: most recent earlier "2" is followed by 8
    ([4, 1, 2, 7, 9, 1, 2], 2, 2, 3, [7, 9, 1]),
    ([4, 1, 2, 7, 9, 1, 2], 3, 3, 3, []),           # no earlier 3-gram
    ([7, 7, 7], 1, 2, 5, [7]),                      # the continuation stops at the context's end
    ([5], 1, 3, 3, []),
])
def test_ngram_lookup(context, n_min, n_max, k, expected):
    assert ngram_lookup(context, n_min, n_max, k) == expected


def test_ngram_proposer_chain():
    p = NgramProposer(ProposerConfig(n_vocab=V, options=_ngram(1, 3)))
    p.start(SamplingParams(temperature=0.8, seed=1), 0)
    p.begin([5, 6, 7, 8, 5, 6], cutoff=0.5, max_nodes=2)
    assert p.ready() and p.active
    tree = p.poll()
    assert not p.active and tree.tokens == [7, 8] and tree.parent == [-1, 0] and tree.anchor_pos == 5
    assert p.stats == {"ngram_lookups": 1, "ngram_hits": 1}
    assert not p.busy() and not p.can_cut() and p.salvage([7]) is None


def test_draft_model_proposer_grows_a_greedy_chain_and_cuts():
    model = ToyLM(V)
    draft = FakePipeline(model, latency=1, name="draft")
    p = DraftModelProposer(ProposerConfig(backend=draft, n_vocab=V, n_ubatch=4, p_split=1.0, width=1))
    p.start(SamplingParams(), 0)
    ctx = list(PROMPT)
    p.prefill(ctx[:-1])
    p.settle(5)
    p.begin(ctx, cutoff=0.0, max_nodes=5)
    tree = None
    for _ in range(100):
        if p.ready():
            tree = p.poll()
            if tree is not None:
                break
    assert tree.tokens == model.greedy(ctx, 5) and tree.parent == [-1, 0, 1, 2, 3]
    assert p.cursor == ctx + tree.tokens[:-1]       # the last node's logits were never needed
    # cut: begin again; after two levels hand them over and keep drafting below the tip
    p.begin(ctx, cutoff=0.0, max_nodes=6)
    while not (p.can_cut() and len(p.tree) == 2):
        if p.ready():
            assert p.poll() is None
    got = p.salvage([tree.tokens[0]])
    assert got is not None and got[0].tokens == tree.tokens[1:2] and got[1] == 0
    first, tip = p.cut(0.0, lambda pos: 3)
    assert first.tokens == tree.tokens[:2] and tip == 1
    rest = None
    while rest is None:
        if p.ready():
            rest = p.poll()
    assert rest.anchor_pos == first.pos(tip) and rest.tokens == tree.tokens[2:5]
    p.settle(5)
    assert not p.busy()
    # the tree a cut starts is held to the cut's cutoff from its first node on (not to the
    # first_cutoff its begin() was given): no draft probability reaches 1.01
    p.begin(ctx, cutoff=0.0, max_nodes=6, first_cutoff=0.0)
    while not (p.can_cut() and len(p.tree) == 2):
        if p.ready():
            assert p.poll() is None
    p.cut(1.01, lambda pos: 3)
    rest = None
    while rest is None:
        if p.ready():
            rest = p.poll()
    assert len(rest) == 0
    p.settle(5)


@pytest.mark.parametrize("spec_type", ["draft", "ngram", "vote", "staged"])
def test_sampled_output_is_reproducible_with_a_seed(spec_type):
    outs = []
    for _ in range(2):
        dec, _, _ = _decoder(SpecSettings(spec_type=spec_type), spec_type, mode="pipeinfer")
        outs.append(dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams(temperature=0.9, seed=7))))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_sampled_drafts_are_accepted(mode):
    """Stochastic verification takes drafts, counted on the virtual clock
    (deterministic): tests/test_speculation_modes.py's sampled pipeinfer run
    on real ranks does not count them, since there how many follows timing.
    (Latency 6: at the default 3, pipeinfer drafts nothing here, greedy or
    sampled.)"""
    dec, _, _ = _decoder(SpecSettings(spec_type="draft"), "draft", latency=6, mode=mode)
    dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams(temperature=0.9, seed=7)))
    assert dec.stats["drafted"] > 0 and dec.stats["draft_accepted"] > 0, dec.stats


def test_ngram_stochastic_verification_preserves_the_target_distribution():
    """A deterministic (n-gram) proposal, verified by the target's keyed
    draw, yields tokens distributed exactly as the target's p (chi-square)."""
    from ggpipe.speculation.verify import verify_step

    logits = np.array([1.0, 0.2, -0.5, 0.7, 0.0], np.float32)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=3)
    sampler = Sampler(params)
    from ggpipe.sampling import target_probs

    p = target_probs(logits, params)
    n = 20000
    counts = np.zeros(5)
    for _ in range(n):
        t, _ = verify_step(logits, [3], sampler)
        counts[t] += 1
    chi2 = float((((counts - n * p) ** 2) / (n * p)).sum())
    assert chi2 < 18.5   # 4 degrees of freedom, p = 0.001


def test_instant_root_carries_its_draft():
    """pipeinfer with an instant proposer sends a new root together with the
    n-gram draft below it: no one-token root runs when a draft exists."""
    prompt, period = REPEATING + [1, 2], len(REPEATING)
    dec, target, _ = _decoder(SpecSettings(spec_type="ngram"), "ngram", period=period, mode="pipeinfer")
    out = dec.generate(np.array(prompt, np.int32), 30, Sampler(SamplingParams()))
    assert out == _reference(30, prompt, period)
    assert dec.stats["root_runs"] <= 1


def test_all_settings_combinations_stay_exact():
    """A coarse sweep of knobs over both proposers (fast: no model)."""
    for spec_type, draft_n, p_accept, latency in itertools.product(["draft", "ngram", "vote", "staged"], [1, 3, 8], [0.0, 0.5],
                                                                   [1, 5]):
        spec = SpecSettings(spec_type=spec_type, draft_max=draft_n, p_accept=p_accept)
        dec, _, _ = _decoder(spec, spec_type, latency=latency, draft_latency=2)
        assert dec.generate(np.array(PROMPT, np.int32), 25, Sampler(SamplingParams())) == _reference(25)


def test_adaptive_depth_stays_exact_and_learns():
    """--p-accept auto: the calibration and cost curve adapt; output is exact."""
    from ggpipe.speculation.adaptive import AcceptanceModel, PassCost, draft_threshold

    for mode in ("pipeinfer", "speculative"):
        dec, _, _ = _decoder(SpecSettings(p_accept=None), "draft", flip=0.2, mode=mode)
        assert dec.adaptive
        out = dec.generate(np.array(PROMPT, np.int32), 60, Sampler(SamplingParams()))
        assert out == _reference(60)
    # calibration: an under-confident draft (accepted far more often than q says) gets k < 1
    m = AcceptanceModel(refit_every=8)
    rng = np.random.default_rng(0)
    for _ in range(400):
        q = float(rng.uniform(0.1, 0.9))
        m.observe(q, rng.random() < q ** 0.4)
    assert 0.25 < m.k < 0.6 and m.p(0.25) > 0.4
    # threshold: marginal over single-pass cost, clipped; default until two sizes are known
    c = PassCost()
    assert draft_threshold(c, 0.3) == 0.3
    c.observe(1, 0.020)
    c.observe(4, 0.035)
    assert abs(c.cost(2) - 0.025) < 1e-9 and abs(draft_threshold(c, 0.3) - 0.25) < 1e-9
    # the target waiting for each drafted token (synchronous speculation) charges the draft step too,
    # except for the first token below an anchor: the draft decodes the anchor in any case
    assert abs(draft_threshold(c, 0.3, draft_step_s=0.004) - 0.45) < 1e-9
    from ggpipe.speculation.adaptive import AdaptiveCutoff

    cut = AdaptiveCutoff(m, c, 0.3, draft_step=lambda: 0.004)
    assert abs(cut.at(0.9) - 0.45 / 0.9) < 1e-9 and abs(cut.first_at(0.9) - 0.25 / 0.9) < 1e-9
    assert AdaptiveCutoff(m, c, 0.3).at(1.0) == AdaptiveCutoff(m, c, 0.3).first_at(1.0)


def test_look_ahead_rule_of_synchronous_adaptive_depth():
    """look_threshold: the least tip path probability P with
    mean(max(0, P a - bar)) >= cost; DecodeRate: a decayed ratio of sums;
    AdaptiveCutoff in synchronous speculation (draft step and decode rate
    measured): keep a token at rate x marginal pass cost, charge the draft
    step to the look; in pipeinfer (no draft step) every tip is decoded."""
    from ggpipe.speculation.adaptive import AcceptanceModel, AdaptiveCutoff, DecodeRate, PassCost, look_threshold

    a = np.array([0.2, 0.6, 1.0])
    assert look_threshold(np.array([]), 0.2, 0.1) == 0.0                  # nothing known yet: look
    assert look_threshold(a, 0.2, 0.0) == 0.0
    assert look_threshold(a, 0.2, 0.5) == float("inf")                   # mean((a - 0.2)+) = 0.4 < 0.5
    pp = look_threshold(a, 0.2, 0.2)
    gain = lambda x: float(np.maximum(x * a - 0.2, 0).mean())             # noqa: E731
    assert abs(gain(pp) - 0.2) < 1e-6 and 0 < pp < 1
    assert look_threshold(a, 0.2, 0.1) < pp < look_threshold(a, 0.2, 0.3)  # dearer looks need surer tips
    r = DecodeRate(alpha=0.5)
    assert r.rate() is None
    r.observe(2, 0.1)
    r.observe(4, 0.1)
    r.observe(9, 0.0)                       # no time: ignored
    assert abs(r.rate() - (0.5 * 2 + 4) / (0.5 * 0.1 + 0.1)) < 1e-9
    m, c = AcceptanceModel(), PassCost()
    c.observe(1, 0.040)
    c.observe(3, 0.060)                     # 10 ms per token in a pass
    for q in (0.9, 0.8, 0.3, 0.95):
        assert m.at_look(q) == m.p(q)
    assert np.allclose(m.looked(), [0.9, 0.8, 0.3, 0.95])
    cut = AdaptiveCutoff(m, c, 0.3, draft_step=lambda: 0.012, rate=lambda: 20.0)
    assert abs(cut.at(1.0) - 0.2) < 1e-9 and abs(cut.first_at(1.0) - 0.2) < 1e-9    # 20/s x 10 ms
    assert abs(cut.look_threshold - look_threshold(m.looked(), 0.2, 20.0 * 0.012)) < 1e-12
    assert abs(cut.look_at(0.5) - cut.look_threshold / 0.5) < 1e-12
    assert AdaptiveCutoff(m, c, 0.3, draft_step=lambda: 0.040, rate=lambda: 20.0).look_threshold == float("inf")
    assert AdaptiveCutoff(m, c, 0.3, rate=lambda: 20.0).look_threshold == 0.0                # pipeinfer
    unmeasured = AdaptiveCutoff(m, c, 0.3, draft_step=lambda: 0.012, rate=lambda: None)     # the old rule
    assert unmeasured.look_threshold == 0.0 and abs(unmeasured.at(1.0) - (0.01 + 0.012) / 0.04) < 1e-9


@pytest.mark.parametrize("mode,spec_type,vote,want", [
    ("speculative", "draft", ("draft", "ngram"), None), ("pipeinfer", "draft", ("draft", "ngram"), 0.3),
    ("speculative", "ngram", ("draft", "ngram"), None), ("pipeinfer", "ngram", ("draft", "ngram"), None),
    ("speculative", "vote", ("draft", "ngram"), 0.3), ("speculative", "staged", ("draft", "ngram"), None),
    ("pipeinfer", "staged", ("draft", "ngram"), 0.3),
])
def test_p_accept_default_is_auto_where_it_measured_better(mode, spec_type, vote, want):
    """The CLI's --p-accept default (docs/user-guide/speculative.md, Knobs)."""
    from ggpipe.cli.options import _spec_settings

    o = {"mode": mode, "spec_type": spec_type, "n_draft": 8, "p_split": 0.1, "spec_vote": vote}
    assert _spec_settings(dict(o, p_accept="default")).p_accept == want
    assert _spec_settings(dict(o, p_accept=0.5)).p_accept == 0.5


def test_draft_model_proposer_skips_looks_below_the_look_cutoff():
    """With a calibration, the chain's tip is decoded for the next token only
    while the path probability reaches ``look_cutoff``; the tip it stops at
    is kept, undecoded."""
    model = ToyLM(V)
    draft = FakePipeline(model, latency=1, name="draft")
    p = DraftModelProposer(ProposerConfig(backend=draft, n_vocab=V, n_ubatch=4, p_split=1.0, width=1))
    ctx = list(PROMPT)
    skipped = 0
    for look, n_nodes in ((0.6, 1), (0.4, 2), (0.0, 5)):
        p.start(SamplingParams(), 0, acceptance=lambda q: 0.5)
        p.settle(5)
        p.prefill(ctx[:-1])
        p.settle(5)
        p.begin(ctx, cutoff=0.0, max_nodes=5, look_cutoff=look)
        tree = None
        while tree is None:
            if p.ready():
                tree = p.poll()
        assert tree.tokens == model.greedy(ctx, n_nodes), look
        assert p.cursor == ctx + tree.tokens[:-1]          # the tip was not decoded
        skipped += p.stats.get("looks_skipped", 0)         # counted per request (start)
    assert skipped == 2


def test_ngram_confidence_and_calibrated_truncation():
    """Drafts carry n/(n+1) for a matched suffix of n tokens; with a
    calibration, the chain stops where its path probability falls below the
    cutoff; without one (numeric --p-accept) the whole continuation is kept."""
    p = NgramProposer(ProposerConfig(n_vocab=V, options=_ngram(1, 3)))
    ctx = [5, 6, 7, 8, 9, 10, 5, 6]          # suffix [5, 6] matched (n = 2): confidence 2/3
    p.start(SamplingParams(), 0)
    p.begin(ctx, cutoff=0.9, max_nodes=5)
    tree = p.poll()
    assert tree.tokens == [7, 8, 9, 10, 5] and abs(tree.draft_p[0] - 2 / 3) < 1e-12
    p.start(SamplingParams(), 0, acceptance=lambda q: q)
    p.begin(ctx, cutoff=0.3, max_nodes=5)     # (2/3)^k >= 0.3 for k <= 2
    tree = p.poll()
    assert tree.tokens == [7, 8] and tree.parent == [-1, 0]
    p.begin(ctx, cutoff=0.9, max_nodes=5)
    assert len(p.poll()) == 0


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_adaptive_ngram_stays_exact(mode):
    prompt, period = REPEATING + [1, 2], len(REPEATING)
    dec, _, _ = _decoder(SpecSettings(spec_type="ngram", p_accept=None), "ngram", period=period, mode=mode)
    out = dec.generate(np.array(prompt + PROMPT, np.int32), 50, Sampler(SamplingParams()))
    assert out == _reference(50, prompt + PROMPT, period)


def test_chains_place_every_cell_at_its_position():
    """Bit-exact verification needs each verified token's cells at index =
    position, as a single-token loop places them (docs/user-guide/exactness.md). The
    fake KV cache places cells as llama.cpp does and asserts that for every
    token of every run (``cell_order``), over many timings, draft qualities
    and ablations; dead runs' cells are trimmed before a run re-roots."""
    trims = 0
    for mode, spec_type, latency, draft_latency, flip, cancel, continuous in itertools.product(
            ["pipeinfer", "speculative"], ["draft", "ngram"], [1, 2, 5], [1, 3], [0.1, 0.5], [True, False],
            [True, False]):
        if mode == "speculative" and not (cancel and continuous):
            continue
        spec = SpecSettings(spec_type=spec_type, cancel=cancel, continuous=continuous, p_split=0.05)
        dec, _, _ = _decoder(spec, spec_type, latency=latency, draft_latency=draft_latency, flip=flip, mode=mode)
        assert dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams())) == _reference(30)
        trims += dec.stats["kv_trims"]
    assert trims > 0
