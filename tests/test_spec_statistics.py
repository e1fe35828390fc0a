"""Stochastic token-tree verification (PipeInfer IV.E; llama.cpp's
``common_sampler_sample_and_accept_n``: the target's own keyed draw at each
position, a draft accepted when it carries it) reproduces the target's
sampling distribution whatever the drafts, and a drafter that draws with the
same keyed noise (Gumbel-max coupling) is accepted about as often as
SpecInfer's multi-step speculative sampling would accept its draws.

Chi-square goodness of fit at significance 0.001 with fixed seeds (so every
run is deterministic); scipy is not a dependency, so critical values are a
table (checked against the regularised incomplete gamma function). Negative
controls show the tests have power against plausible implementation slips.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ggpipe.keyed_noise import gumbel_pick
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams
from ggpipe.speculation.graph import SpecGraph
from ggpipe.speculation.tree import SpecTree
from ggpipe.speculation.verify import verify_step

# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
            9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697,
            16: 39.252, 17: 40.790, 18: 42.312, 19: 43.820, 20: 45.315, 21: 46.797, 22: 48.268,
            23: 49.728, 24: 51.179, 25: 52.620, 26: 54.052, 27: 55.476, 28: 56.892, 29: 58.301,
            30: 59.703, 31: 61.098, 32: 62.487, 33: 63.870, 34: 65.247, 35: 66.619, 36: 67.985,
            37: 69.347, 38: 70.703, 39: 72.055, 40: 73.402}


def test_critical_value_table():
    """The table is the 0.999 quantile: survival function by the series of
    the regularised lower incomplete gamma function."""
    import math

    def sf(df, x):
        a, x = df / 2, x / 2
        term = total = 1 / a
        n = 0
        while term > 1e-17 * total:
            n += 1
            term *= x / (a + n)
            total += term
        return 1 - total * math.exp(-x + a * math.log(x) - math.lgamma(a))

    for df, c in CHI2_999.items():
        assert sf(df, c) == pytest.approx(1e-3, rel=2e-3), df


def critical(df: int) -> float:
    """The chi-square 0.999 quantile: the table, or above it Wilson and
    Hilferty's cube-root normal approximation."""
    if df in CHI2_999:
        return CHI2_999[df]
    z = 3.0902   # the 0.999 normal quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; bins with expected count
    below ``min_expected`` are pooled into one (dropped if that is still
    small). Tokens of probability 0 must never occur."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, f"impossible tokens drawn: {np.flatnonzero((probs == 0) & (counts > 0))}"
    exp = n * probs
    big = exp >= min_expected
    obs_b, exp_b = list(counts[big]), list(exp[big])
    rest_o, rest_e = counts[~big & (probs > 0)].sum(), exp[~big & (probs > 0)].sum()
    if rest_e >= min_expected:
        obs_b.append(rest_o)
        exp_b.append(rest_e)
    else:  # fold the tiny rest into the smallest bin
        i = int(np.argmin(exp_b))
        obs_b[i] += rest_o
        exp_b[i] += rest_e
    o, e = np.array(obs_b), np.array(exp_b)
    return float(((o - e) ** 2 / e).sum()), len(o) - 1


def assert_fits(counts, probs, label=""):
    stat, df = chi2(counts, probs)
    assert df >= 1
    assert stat < CHI2_999[df], f"{label}: chi2 = {stat:.1f} >= {CHI2_999[df]} (df {df})"
    return stat, df


def assert_rejects(counts, probs, label=""):
    stat, df = chi2(counts, probs)
    assert stat > CHI2_999[df], f"{label}: the test has no power (chi2 = {stat:.1f}, df {df})"


def mss_accept(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """Probability that SpecInfer's multi-step speculative sampling accepts
    one of k i.i.d. children from q (the acceptance it would reach)."""
    reject = 1.0
    for _ in range(k):
        a = np.minimum(p, q).sum()
        reject *= 1 - a
        r = np.maximum(p - q, 0)
        if r.sum() <= 0:
            break
        p = r / r.sum()
    return 1 - reject


def independent_accept(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """Probability that one of k children drawn from q independently of the
    target's draw carries it: sum_y p(y) (1 - (1 - q(y))^k)."""
    return float((p * (1 - (1 - q) ** k)).sum())


def coupled_bound(p: np.ndarray, q: np.ndarray) -> float:
    """Gumbel-max coupling's guarantee (Daliri, Musco, Suresh 2024): a draw
    from q with the target's noise equals the target's draw with probability
    at least (1 - TV) / (1 + TV)."""
    tv = 0.5 * np.abs(p - q).sum()
    return (1 - tv) / (1 + tv)


# ---- synthetic ------------------------------------------------------------------

V = 8
N = 40_000


def _verify_accept_first(logits, kids, sampler):
    """Bug: the first child is accepted unconditionally."""
    if kids:
        sampler.accept(int(kids[0]))
        return int(kids[0]), 0
    return verify_step(logits, kids, sampler)


def _verify_position_not_keyed(logits, kids, sampler):
    """Bug: the noise is keyed by the seed only (every position draws the
    same), so repeated positions are not independent draws."""
    t = sampler.sample_from(target_probs(sampler.constrain(logits), sampler.params))
    return t, (kids.index(t) if t in kids else None)


def draw_children(q, sampler, rng, k, how):
    """k children: ``independent`` draws from q, the ``coupled`` draw (q with
    the target's keyed noise at the position, then independent draws), or
    the draft's ``best`` k tokens by q (chosen, as PipeDec's layers)."""
    if how == "best":
        return np.argsort(-q, kind="stable")[:k].tolist()
    kids = rng.choice(q.size, size=k, p=q).tolist()
    if how == "coupled" and k:
        kids[0] = gumbel_pick(q, sampler.key, sampler.index)
    return kids


def verify_counts(logits, q, params, n, seed, kmin=1, kmax=3, how="independent", verify=verify_step):
    """n verifications with kmin..kmax children (:func:`draw_children`).
    Returns (token counts, accepted count per number of children, trials
    per number of children)."""
    sampler = Sampler(replace(params, seed=seed))
    rng = np.random.default_rng(seed + 1000)
    ks = rng.integers(kmin, kmax + 1, size=n)
    counts = np.zeros(logits.size, dtype=np.int64)
    acc = np.zeros(kmax + 1, dtype=np.int64)
    tries = np.bincount(ks, minlength=kmax + 1)
    for i in range(n):
        k = int(ks[i])
        row = draw_children(q, sampler, rng, k, how)
        t, j = verify(logits, row, sampler)
        if j is not None:
            assert row[j] == t
            acc[k] += 1
        counts[t] += 1
    return counts, acc, tries


CASES = {
    # plain sampling, draft with full support
    "T1": dict(params=SamplingParams(temperature=1.0, top_k=0, top_p=1.0), logit_seed=1, draft="dirichlet"),
    # filtered target; the draft is another filtered distribution with zeros
    # where the target has mass, and mass where the target has none
    "T0.7-k5-p0.9": dict(params=SamplingParams(temperature=0.7, top_k=5, top_p=0.9), logit_seed=2,
                         draft="filtered"),
}


def case(name):
    c = CASES[name]
    rng = np.random.default_rng(c["logit_seed"])
    logits = rng.normal(0, 1.2, V).astype(np.float32)
    if c["draft"] == "dirichlet":
        q = rng.dirichlet(np.full(V, 1.0))
    else:
        q = target_probs(rng.normal(0, 1.2, V).astype(np.float32), SamplingParams(temperature=1.3, top_k=5, top_p=1.0))
    p = target_probs(logits, c["params"])
    return logits, q, p, c["params"]


def accept_rate_ok(acc, tries, want, k, label):
    sd = np.sqrt(max(want * (1 - want), 1e-12) / tries[k])
    assert abs(acc[k] / tries[k] - want) < 5 * sd + 1e-9, (label, k, acc[k] / tries[k], want)


@pytest.mark.parametrize("how", ["independent", "coupled", "best"])
@pytest.mark.parametrize("name", list(CASES))
def test_verification_reproduces_target_distribution(name, how):
    """Whatever the children (drawn from q independently, coupled to the
    target's noise, or the draft's best tokens), the decided token is
    distributed as p; a child is accepted exactly when it carries the
    target's draw."""
    logits, q, p, params = case(name)
    tv = 0.5 * np.abs(p - q).sum()
    assert tv > 0.2                               # the draft really differs
    if name != "T1":
        assert ((p > 0) & (q == 0)).any() and ((p == 0) & (q > 0)).any()
    counts, acc, tries = verify_counts(logits, q, params, N, seed=11, how=how)
    assert_fits(counts, p, f"{name} {how}")
    for k in range(1, 4):
        if how == "independent":
            accept_rate_ok(acc, tries, independent_accept(p, q, k), k, how)
        elif how == "best":
            accept_rate_ok(acc, tries, float(p[np.argsort(-q, kind="stable")[:k]].sum()), k, how)
        else:   # the coupled child is accepted at least as the coupling guarantees
            assert acc[k] / tries[k] > coupled_bound(p, q) - 5 * np.sqrt(0.25 / tries[k]), (k, acc[k] / tries[k])


def test_coupled_drafts_are_accepted_about_as_often_as_mss_would():
    """One coupled child against one MSS draw on a draft near the target
    (the case speculation lives in): within a few points of MSS's
    acceptance, and far above an independent draw's."""
    rng = np.random.default_rng(5)
    params = SamplingParams(temperature=0.8, top_k=0, top_p=1.0)
    logits = rng.normal(0, 2.0, 64).astype(np.float32)
    q = target_probs(logits + rng.normal(0, 0.5, 64).astype(np.float32), params)
    p = target_probs(logits, params)
    _, acc, tries = verify_counts(logits, q, params, 20_000, seed=3, kmin=1, kmax=1, how="coupled")
    rate = acc[1] / tries[1]
    assert rate > mss_accept(p, q, 1) - 0.08, (rate, mss_accept(p, q, 1))
    assert rate > independent_accept(p, q, 1) + 0.1, (rate, independent_accept(p, q, 1))


def test_no_children_is_plain_sampling():
    logits, q, p, params = case("T0.7-k5-p0.9")
    counts, acc, _ = verify_counts(logits, q, params, 10_000, seed=5, kmin=0, kmax=0)
    assert acc.sum() == 0
    assert_fits(counts, p, "no children")


@pytest.mark.parametrize("bug", [_verify_accept_first, _verify_position_not_keyed],
                         ids=["accept-first", "position-not-keyed"])
def test_negative_controls_fail_chi_square(bug):
    """The same test rejects wrong verifiers: it has power."""
    logits, q, p, params = case("T1")
    counts, _, _ = verify_counts(logits, q, params, N // 4, seed=11, verify=bug)
    assert_rejects(counts, p, bug.__name__)


def test_two_levels_through_spec_graph():
    """SpecGraph.advance over a two-level tree (1-2 children from q1, 0-2
    grandchildren each from q2(.|child)) decides a token pair distributed as
    p1(t1) p2(t2 | t1); when the first level is rejected the second token
    comes from a root run (plain sampling)."""
    v = 6
    params = SamplingParams(temperature=0.9, top_k=4, top_p=1.0)
    rng = np.random.default_rng(3)
    l1 = rng.normal(0, 1.0, v).astype(np.float32)
    l2 = rng.normal(0, 1.0, (v, v)).astype(np.float32)          # target logits after t1
    dparams = SamplingParams(temperature=1.2, top_k=0, top_p=1.0)
    q1 = target_probs(rng.normal(0, 1.0, v).astype(np.float32), dparams)
    q2 = np.stack([target_probs(rng.normal(0, 1.0, v).astype(np.float32), dparams) for _ in range(v)])
    p1 = target_probs(l1, params)
    joint = np.concatenate([p1[a] * target_probs(l2[a], params) for a in range(v)])
    sampler = Sampler(replace(params, seed=17))
    n = 15_000
    counts = np.zeros(v * v, dtype=np.int64)
    n_two = 0
    for _ in range(n):
        t1, t2, both = two_level_pair(sampler, l1, l2, q1, q2, rng)
        n_two += both
        counts[t1 * v + t2] += 1
    assert n_two > n // 4
    assert_fits(counts, joint, "two levels")


def two_level_pair(sampler, l1, l2, q1, q2, draws) -> tuple[int, int, bool]:
    """One trial: a two-level tree (1-2 children drawn from ``q1``, 0-2
    grandchildren each from ``q2[child]``, the first of each drawn with the
    target's keyed noise as a sampling drafter draws, the others by
    ``draws``) verified through
    SpecGraph.advance with the target's logits ``l1`` (first position) and
    ``l2[t1]`` (after t1). Returns (t1, t2, both decided by the tree); when
    the first level is rejected a root run for t1 decides t2."""
    v = l1.size
    g = SpecGraph(sampler)
    root = g.add_root(0, 5, run_id=1)
    t = SpecTree(5)
    for n in range(draws.integers(1, 3)):
        c = gumbel_pick(q1, sampler.key, sampler.index) if n == 0 else int(draws.choice(v, p=q1))
        i = t.add(c, -1, p=q1[c])
        for m in range(draws.integers(0, 3)):
            gc = gumbel_pick(q2[c], sampler.key, sampler.index + 1) if m == 0 else int(draws.choice(v, p=q2[c]))
            t.add(gc, i, p=q2[c][gc])
    *_, leaf_seq = t.batch(list(range(1, 1 + len(t))))
    g.add_tree(root, t, 2, leaf_seq, 0, list(range(1, 1 + len(t))))
    g.set_result(1, l1[None, :])
    # a node's logits: the target's next-token logits after its token
    # (grandchildren's rows are never read for the pair)
    g.set_result(2, np.stack([l2[t.tokens[i]] if t.parent[i] == -1 else np.zeros(v, np.float32)
                              for i in range(len(t))]))
    d = g.advance()
    t1 = d[0].token
    if d[0].node is None:
        return t1, sampler.sample(l2[t1]), False
    return t1, d[1].token, True


def test_two_layers_through_add_layer():
    """SpecGraph.add_layer: a layer of the draft's 2 best tokens below the
    root, and the best child of each below them; advance decides a pair
    distributed as p1(t1) p2(t2 | t1)."""
    v = 6
    params = SamplingParams(temperature=0.9, top_k=5, top_p=1.0)
    rng = np.random.default_rng(4)
    l1 = rng.normal(0, 1.0, v).astype(np.float32)
    l2 = rng.normal(0, 1.0, (v, v)).astype(np.float32)
    near = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)   # a draft that roughly agrees with the target
    q1 = target_probs(l1 + rng.normal(0, 0.7, v).astype(np.float32), near)
    q2 = np.stack([target_probs(l2[a] + rng.normal(0, 0.7, v).astype(np.float32), near) for a in range(v)])
    p1 = target_probs(l1, params)
    joint = np.concatenate([p1[a] * target_probs(l2[a], params) for a in range(v)])
    sampler = Sampler(replace(params, seed=23))
    n = 15_000
    counts = np.zeros(v * v, dtype=np.int64)
    n_two = 0
    top1 = np.argsort(-q1, kind="stable")[:2].tolist()
    for _ in range(n):
        g = SpecGraph(sampler)
        root = g.add_root(0, 5, run_id=1)
        a = g.add_layer(2, [root, root], top1, [q1[t] for t in top1], [1, 2], 0)
        kids = [int(np.argmax(q2[t])) for t in top1]
        g.add_layer(3, a, kids, [q2[t][c] for t, c in zip(top1, kids)], [3, 4], 1)
        g.set_result(1, l1[None, :])
        g.set_result(2, np.stack([l2[t] for t in top1]))
        d = g.advance()
        t1 = d[0].token
        if d[0].node is None:
            t2 = sampler.sample(l2[t1])               # the root run for t1 decides t2
        else:
            t2 = d[1].token
            n_two += 1
        counts[t1 * v + t2] += 1
    assert n_two > n // 3
    assert_fits(counts, joint, "two layers")


# ---- real weights ---------------------------------------------------------------------

PROMPT = "Once upon a time, a warrior named Goliath"


def _next_logits(path, n_layer, prompt):
    from ggpipe.runtime.stage import Stage, StageSpec
    from ggpipe.runtime.vocab import Vocab
    from ggpipe.runs import Run

    s = Stage(StageSpec(model_path=path, n_layer=n_layer, first=True, last=True, n_ctx=256))
    try:
        toks = Vocab(s.model, s.vocab).tokenize(prompt)
        r = Run.linear(toks, 0)
        out = s.decode(tokens=r.tokens, pos=r.pos, n_seq_id=r.n_seq_id, seq_ids=r.seq_ids, outputs=r.outputs)
        assert out.shape == (1, s.n_vocab)
        return toks, out[0]
    finally:
        s.close()


@pytest.mark.full  # real weights: 13 s
def test_real_draft_target_pair(goliath, smollm2):
    """Target smollm2-goliath-40l, draft smollm2-135m, same prompt: children
    drawn from the draft's sampling distribution with the target's keyed
    noise (and independent siblings) leave the decided tokens distributed as
    the target's sampling distribution (temperature 0.8, top_k 40, top_p
    0.95), and the coupled child is accepted at least as the coupling
    guarantees; printed beside multi-step speculative sampling's rate."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    toks_t, lt = _next_logits(goliath, 40, PROMPT)
    toks_d, ld = _next_logits(smollm2, 30, PROMPT)
    assert toks_t.tolist() == toks_d.tolist()
    p = target_probs(lt, params)
    q = target_probs(ld, params)
    tv = 0.5 * np.abs(p - q).sum()
    assert 0.1 < tv < 0.95, tv                      # a real, imperfect draft
    n = 20_000
    sampler = Sampler(replace(params, seed=2024))
    rng = np.random.default_rng(7)
    ks = rng.integers(1, 4, size=n)
    counts = np.zeros(p.size, dtype=np.int64)
    acc1 = 0
    firsts = np.zeros(p.size, dtype=np.int64)
    for i in range(n):
        kids = draw_children(q, sampler, rng, int(ks[i]), "coupled")
        firsts[kids[0]] += 1
        t, j = verify_step(lt, kids, sampler)
        counts[t] += 1
        acc1 += j == 0
    assert counts[p == 0].sum() == 0
    # bins: tokens with p > 0.5 %, plus one for the rest
    big = p > 0.005
    obs = np.append(counts[big], counts[~big].sum())
    exp = n * np.append(p[big], p[~big].sum())
    assert exp.min() >= 5
    df = obs.size - 1
    stat = float(((obs - exp) ** 2 / exp).sum())
    rate = acc1 / n
    print(f"real weights: TV(p, q) = {tv:.3f}, {big.sum()} bins + rest, chi2 = {stat:.1f} (df {df}), "
          f"coupled child accepted {rate:.3f} (multi-step speculative sampling: {mss_accept(p, q, 1):.3f}, "
          f"an independent draw: {independent_accept(p, q, 1):.3f})")
    assert stat < CHI2_999[df], f"chi2 = {stat:.1f} >= {CHI2_999[df]} (df {df})"
    # and the draft's own distribution is clearly rejected by the same test
    obs_q = np.append(firsts[big], firsts[~big].sum())
    assert float(((obs_q - exp) ** 2 / exp).sum()) > CHI2_999[df]
    assert rate > coupled_bound(p, q) - 5 * np.sqrt(0.25 / n)
