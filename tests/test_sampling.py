import numpy as np
import pytest

from ggpipe.errors import ConfigError
from ggpipe.sampling import Sampler, target_probs
from ggpipe.sampling_params import SamplingParams


def _softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def _logits(n=50, seed=0):
    return np.random.default_rng(seed).normal(0, 2, n).astype(np.float32)


# ---- params --------------------------------------------------------------

def test_defaults_greedy():
    p = SamplingParams()
    assert p.greedy and p.validate() is p
    assert not SamplingParams(temperature=0.8).greedy


@pytest.mark.parametrize("kw", [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(top_k=-1), dict(top_k=2.5), dict(top_k=True),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.2), dict(top_p=float("nan")),
    dict(seed=-1), dict(seed=1.5), dict(temperature="hot"),
])
def test_bad_params(kw):
    with pytest.raises(ConfigError):
        SamplingParams(**kw).validate()
    with pytest.raises(ConfigError):
        Sampler(SamplingParams(**kw))


def test_numpy_scalars_accepted():
    SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
                   seed=np.int32(1)).validate()


# ---- greedy --------------------------------------------------------------

def test_greedy_is_argmax_first_tie():
    s = Sampler(SamplingParams(temperature=0.0))
    x = np.array([0.1, 3.0, -1.0, 3.0], dtype=np.float32)
    assert s.sample(x) == 1
    p = target_probs(x, SamplingParams())
    assert p.dtype == np.float64 and p.shape == (4,)
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    x = _logits(1000)
    assert s.sample(x) == int(np.argmax(x))


def test_top_k_1_is_greedy():
    x = _logits(200, seed=3)
    s = Sampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, seed=0))
    assert all(s.sample(x) == int(np.argmax(x)) for _ in range(50))
    p = target_probs(x, s.params)
    assert p[np.argmax(x)] == 1.0 and p.sum() == 1.0


# ---- target_probs --------------------------------------------------------

def test_temperature_only_is_softmax_over_T():
    x = _logits(64)
    for t in (0.3, 1.0, 2.5):
        p = target_probs(x, SamplingParams(temperature=t, top_k=0, top_p=1.0))
        np.testing.assert_allclose(p, _softmax(x.astype(np.float64) / t), rtol=1e-12)
        assert abs(p.sum() - 1) < 1e-12


def test_top_k_keeps_k_largest_renormalised():
    x = _logits(100)
    p = target_probs(x, SamplingParams(temperature=0.7, top_k=5, top_p=1.0))
    top = np.argsort(-x)[:5]
    assert set(np.flatnonzero(p)) == set(top)
    np.testing.assert_allclose(p[top], _softmax(x[top].astype(np.float64) / 0.7), rtol=1e-12)


def test_top_k_ties_keep_lowest_ids():
    x = np.array([1.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    p = target_probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=1.0))
    assert np.flatnonzero(p).tolist() == [1, 2]


def test_top_p_smallest_prefix_reaching_p():
    # raw softmax probs 0.5, 0.25, 0.15, 0.1 (shuffled ids)
    probs = np.array([0.15, 0.5, 0.1, 0.25])
    x = np.log(probs).astype(np.float32)
    kept = lambda p: sorted(np.flatnonzero(target_probs(
        x, SamplingParams(temperature=1.0, top_k=0, top_p=p))).tolist())
    assert kept(0.4) == [1]            # 0.5 >= 0.4
    assert kept(0.6) == [1, 3]         # 0.75 >= 0.6
    assert kept(0.8) == [0, 1, 3]      # 0.9 >= 0.8
    assert kept(0.95) == [0, 1, 2, 3]
    assert kept(1.0) == [0, 1, 2, 3]


def test_top_p_uses_raw_logits_then_temperature():
    probs = np.array([0.5, 0.3, 0.2])
    x = np.log(probs)
    # at T=10 the tempered distribution is nearly flat; the cut must still be
    # computed on the raw softmax (0.5+0.3 >= 0.7 -> keep 2)
    p = target_probs(x, SamplingParams(temperature=10.0, top_k=0, top_p=0.7))
    assert np.flatnonzero(p).tolist() == [0, 1]
    np.testing.assert_allclose(p[:2], _softmax(x[:2] / 10.0), rtol=1e-12)


def test_top_p_after_top_k_renormalises_survivors():
    # raw probs 0.4, 0.3, 0.2, 0.1; top_k=2 -> survivors renormalised 4/7, 3/7
    x = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    p = target_probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.55))
    assert np.flatnonzero(p).tolist() == [0]  # 4/7 = 0.571 >= 0.55
    p = target_probs(x, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert np.flatnonzero(p).tolist() == [0, 1]


def test_neg_inf_logits_never_kept():
    x = np.array([-np.inf, 1.0, 0.5, -np.inf], dtype=np.float32)
    p = target_probs(x, SamplingParams(temperature=1.0, top_k=0, top_p=1.0))
    assert p[0] == 0 and p[3] == 0 and abs(p.sum() - 1) < 1e-12


@pytest.mark.parametrize("x", [np.zeros((2, 3)), np.zeros(0), np.array([1.0, np.nan]),
                               np.array([-np.inf, -np.inf]), np.array([np.inf, 0.0])])
def test_bad_logits(x):
    with pytest.raises(ValueError):
        target_probs(x, SamplingParams(temperature=1.0))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("at", [0, 1, 4095, 49151])
def test_greedy_refuses_nan_and_inf_anywhere_in_a_full_row(bad, at):
    x = np.random.default_rng(at).standard_normal(49152).astype(np.float32)
    x[at] = bad
    x[100] = np.inf if np.isnan(bad) else x[100]     # a NaN is refused beside a +inf too
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        Sampler(SamplingParams(temperature=0.0)).sample(x)


def test_greedy_takes_the_first_of_tied_best_and_allows_masked_tokens():
    assert Sampler(SamplingParams(temperature=0.0)).sample(np.array([-np.inf, 2.0, 2.0, -np.inf],
                                                                    dtype=np.float32)) == 1
    assert Sampler(SamplingParams(temperature=0.0)).sample(np.full(5, -np.inf, dtype=np.float32)) == 0


def _reference(x, t, k, top_p):
    """Straightforward full-sort implementation of top_k -> top_p -> temperature."""
    order = np.lexsort((np.arange(x.size), -x.astype(np.float64)))
    if k > 0:
        order = order[:k]
    z = x[order].astype(np.float64)
    if top_p < 1:
        cum = np.cumsum(_softmax(z))
        hit = np.flatnonzero(cum >= top_p)
        last = hit[0] + 1 if hit.size else z.size
        order, z = order[:last], z[:last]
    ref = np.zeros(x.size)
    ref[order] = _softmax(z / t)
    return ref


@pytest.mark.parametrize("scale, k, top_p", [
    (2.0, 300, 0.8), (0.5, 0, 0.9), (0.05, 0, 0.95), (0.05, 7000, 0.97),
    (3.0, 0, 0.5), (3.0, 0, 1.0), (0.5, 20000, 0.3),
])
def test_large_vocab_matches_full_sort(scale, k, top_p):
    # rounded -> many ties; small scale -> nucleus of thousands of tokens
    x = np.round(np.random.default_rng(7).normal(0, scale, 20000), 2).astype(np.float32)
    p = target_probs(x, SamplingParams(temperature=0.9, top_k=k, top_p=top_p))
    np.testing.assert_allclose(p, _reference(x, 0.9, k, top_p), rtol=1e-10, atol=1e-15)


# ---- Sampler -------------------------------------------------------------

def test_seeded_reproducible():
    x = _logits(100)
    prm = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234)
    a = [Sampler(prm).sample(x) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    s1, s2 = Sampler(prm), Sampler(prm)
    assert [s1.sample(x) for _ in range(100)] == [s2.sample(x) for _ in range(100)]
    assert s1.key == 1234 and s1.index == 100
    assert isinstance(s1.sample(x), int)


def test_sample_from_skips_zero_mass():
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert len({s.sample_from(p) for _ in range(20)}) == 1     # one position, one draw
    seen = set()
    for _ in range(500):
        seen.add(s.sample_from(p))
        s.accept(0)                                             # the next position
    assert seen == {1, 3}
    with pytest.raises(ValueError):
        s.sample_from(np.zeros(3))
    with pytest.raises(ValueError):
        s.sample_from(np.array([0.5, -0.1]))


def test_chi_square_matches_target_probs():
    x = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5], dtype=np.float32)
    prm = SamplingParams(temperature=0.8, top_k=6, top_p=0.97, seed=42)
    p = target_probs(x, prm)
    s = Sampler(prm)
    n = 20_000
    counts = np.bincount([s.sample(x) for _ in range(n)], minlength=x.size)
    support = p > 0
    assert counts[~support].sum() == 0
    expected = n * p[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    try:
        from scipy.stats import chi2
        crit = float(chi2.ppf(0.999, dof))
    except ImportError:
        # chi-square 0.999 quantiles for dof 1..7
        crit = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322][dof - 1]
    assert stat < crit, (stat, crit, dof)


@pytest.mark.parametrize("t", [1e-320, 5e-324, 1e-300, 1e-12, 0.999e-6])
def test_tiny_temperature_is_greedy(t):
    """Below GREEDY_BELOW a temperature is greedy (first index among ties):
    "temperature": 1e-320 would divide the logits into inf/NaN, and
    sample_from's ValueError would end the server's MPI job."""
    from ggpipe.sampling_params import GREEDY_BELOW

    x = np.array([30.0, -2.0, 30.0, 12.5, -np.inf], dtype=np.float32)
    for kw in ({}, {"top_k": 0, "top_p": 1.0}, {"top_k": 2, "top_p": 0.5}):
        p = SamplingParams(temperature=t, seed=1, **kw)
        assert p.greedy and t < GREEDY_BELOW
        assert Sampler(p).sample(x) == 0
        probs = target_probs(x, p)
        assert np.isfinite(probs).all() and probs[0] == 1.0
    # at the threshold and above: sampled, finite probabilities (no overflow for any float32 logit)
    big = np.array([3e38, -3e38, 1.0], dtype=np.float32)
    probs = target_probs(big, SamplingParams(temperature=GREEDY_BELOW, top_k=0, top_p=1.0))
    assert np.isfinite(probs).all() and probs[0] == 1.0


# ---- keyed noise -----------------------------------------------------------------

def test_keyed_uniforms_are_uniform_and_a_function_of_key_position_and_token():
    from ggpipe.keyed_noise import uniforms

    ids = np.arange(50_000)
    u = uniforms(7, 3, ids)
    assert u.dtype == np.float64 and ((u > 0) & (u < 1)).all()
    counts = np.bincount((u * 20).astype(int), minlength=20)
    assert (np.abs(counts - 2500) < 5 * 50).all(), counts       # 20 equal bins
    np.testing.assert_array_equal(u, uniforms(7, 3, ids))        # no state
    np.testing.assert_array_equal(u[[5, 17]], uniforms(7, 3, np.array([5, 17])))   # random access
    for other in (uniforms(8, 3, ids), uniforms(7, 4, ids)):     # another key, another position
        assert abs(np.corrcoef(u, other)[0, 1]) < 0.02 and (u != other).mean() > 0.999
    assert uniforms(2**63 - 1, 2**40, ids[:3]).shape == (3,)


def test_gumbel_pick_is_an_exact_draw_over_positions():
    from ggpipe.keyed_noise import gumbel_pick

    p = np.array([0.5, 0.0, 0.2, 0.3])
    n = 20_000
    counts = np.bincount([gumbel_pick(p, 99, pos) for pos in range(n)], minlength=4)
    assert counts[1] == 0
    expected = n * p[[0, 2, 3]]
    stat = float(((counts[[0, 2, 3]] - expected) ** 2 / expected).sum())
    assert stat < 13.82     # chi-square, 2 degrees of freedom, p = 0.001
    assert gumbel_pick(p, 99, 5) == gumbel_pick(p * 3, 99, 5)    # unnormalised: the same draw
