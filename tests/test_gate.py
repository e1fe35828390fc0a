"""Whether drafting pays at all in synchronous speculation
(ggpipe/speculation/gate.py): the rule alone, and the real speculative loop
on the simulator's virtual clock, where a draft that is seldom right must
cost (almost) nothing against not drafting, and a good draft is never
held back."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.backend import idle_until_next
from ggpipe.sim.model import ModelDesc
from ggpipe.sim.profile import LayerShape, LinkProfile, Profile
from ggpipe.sim.run import SimConfig, build
from ggpipe.speculation.gate import DraftGate
from ggpipe.sim.toy import ToyLM
from tests.test_sim import MS, flat_host, toy_model


def test_the_rule():
    g = DraftGate(explore_every=3)
    assert g.pays(None, None, None)                         # nothing measured: draft
    g.observe(0)
    assert g.pays(None, 0.020, 0.024)                       # the draft's step unknown: draft
    assert not g.pays(0.006, 0.020, None)                   # 0 tokens per attempt cannot pay a 6 ms step
    assert not g.pays(0.006, 0.020, 0.024)
    assert g.pays(0.006, 0.020, 0.024) and g.explored == 1  # the third root in a row: explore
    assert g.skipped == 2
    assert [g.pays(0.006, 0.020, 0.024) for _ in range(6)] == [False] * 5 + [True]   # the wait doubled: 6
    for _ in range(8):
        g.observe(2)                                        # the draft became right: 2 tokens per attempt
    assert g.pays(0.006, 0.020, 0.024)                      # 2 x 20 ms >= 6 + 4 ms
    assert DraftGate(yield_=0.1).pays(0.0, 0.020, 0.024) is False   # an instant draft still pays the batch
    assert DraftGate(yield_=0.1).pays(0.0, 0.020, 0.021)
    blind = DraftGate(yield_=0.1, explore_every=3)          # every pass so far carried a chain: c(1) unknown
    assert [blind.pays(0.0, None, 0.030) for _ in range(6)] == [True, True, False, True, True, False]


def test_a_deep_chain_is_charged_a_step_per_drafted_token():
    """An attempt costs as deep as attempts have been: k draft steps and a
    pass of k + 1 tokens (the one-token rule under-counted: with 18 ms draft
    steps for a 31 ms target it kept 4-token chains that lost)."""
    g = DraftGate()
    for _ in range(4):
        g.observe(3, 4)
    assert g.chain_size() == 5
    assert g.pays(0.018, 0.031, 0.043)                           # one-token rule: 93 >= 18 + 12 ms
    assert not g.pays(0.018, 0.031, 0.043, 0.075)                 # 93 < 4 x 18 + 44 ms
    assert DraftGate(yield_=3.0, depth=4.0).pays(0.0, 0.031, 0.043, 0.075)   # an instant draft: 93 >= 44 ms
    assert DraftGate(yield_=3.0).pays(0.018, 0.031, 0.043, 0.075)            # depth unknown: one-token rule
    from ggpipe.speculation.adaptive import PassCost                        # the callers' form: costs read from
    cost = PassCost()                                                        # the measured pass costs
    for n, t in [(1, 0.031), (2, 0.043), (5, 0.075)]:
        cost.observe(n, t)
    assert not g.pays_at(0.018, cost) and DraftGate(yield_=3.0, depth=4.0).pays_at(0.0, cost)


class Always(DraftGate):
    """Every root drafted: the behaviour before the gate."""

    def pays(self, *costs) -> bool:
        return True


def _run(acceptance: float, gate: DraftGate | None) -> tuple[list[int], float, dict]:
    """Speculative mode on a simulated 2-rank job (target on rank 0, the
    draft on rank 1, 0.6 ms per draft step, 8 ms per target pass); returns
    tokens, virtual seconds and stats."""
    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.1 * MS, 0.0)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 2, LayerShape(100, 25), 8, 64)
    spec = SpecSettings(p_accept=None)
    cfg = SimConfig(prof, toy_model(6), draft, mode="speculative", ranks=2, acceptance=acceptance, spec=spec)
    clock, target, dpipe, busy, roles = build(cfg)
    dec = build_decoder(DecodingPlan.resolve("speculative", spec),
                        target, dpipe, n_ubatch=512, n_seq_max=32, is_eog=lambda t: False,
                        timeout_s=60, idle=idle_until_next(clock, [target, dpipe]))
    if gate is not None:
        dec.gate = gate
    t0 = clock.now
    out = dec.generate(np.arange(16, dtype=np.int32), 120, Sampler(SamplingParams(temperature=0.0)))
    return out, clock.now - t0, dec.stats


def test_a_draft_that_is_seldom_right_is_not_waited_for():
    out_a, t_always, _ = _run(0.02, Always())
    out_g, t_gated, stats = _run(0.02, None)
    assert out_g == out_a                        # the same tokens: a skipped root is verified alone
    assert stats["draft_skipped"] > 60 and t_gated < 0.97 * t_always
    assert t_gated / len(out_g) < 1.03 * 8.2 * MS   # about one target pass (and its links) per token


def test_a_good_draft_is_never_held_back():
    out_a, t_always, _ = _run(0.95, Always())
    out_g, t_gated, stats = _run(0.95, None)
    assert out_g == out_a and stats["draft_skipped"] == 0 and t_gated == pytest.approx(t_always)
    assert out_g == ToyLM(64).greedy(list(range(16)), 120) or len(out_g) == 120


def test_roots_are_timed_per_request_and_forgotten_when_asked():
    """root() times the last root when it was the same request's, rooted()
    remembers this one, forget_root() drops it: the wall-time arms get one
    request's roots only (speculative mode's requests, the scheduler's lone
    request)."""
    g = DraftGate()
    a, b = object(), object()
    g.root(a, 0.0, 0)
    g.rooted(a, 0.0, 0, True)
    g.root(a, 0.5, 3)                  # 3 tokens in 0.5 s, drafted
    g.rooted(a, 0.5, 3, False)
    g.root(b, 0.7, 0)                  # another request's root: a's last root is not timed
    g.rooted(b, 0.7, 0, False)
    g.forget_root()                    # b stopped generating alone
    g.root(b, 1.0, 2)
    assert g.rates == {"draft": (3.0, 0.5)}
    g.rooted(b, 1.0, 2, False)
    g.root(b, 1.25, 3)
    assert g.rates["plain"] == (1.0, 0.25)


def test_an_exploration_outweighs_drafted_roots_timed_before_a_run_of_plain_roots():
    """The arms age by roots of either kind: drafted roots timed slowly at a
    request's start (cold weights) and then 16 plain roots leave the drafted
    arm's old sums a fifth of their weight, so one exploration that pays
    (2 tokens in 0.11 s against 15 tok/s plain) turns the comparison; aged
    by their own samples only, the old sums kept 90% and it did not."""
    g = DraftGate()
    g.timed(True, 1, 0.095)
    g.timed(True, 2, 0.14)            # 3 tokens in 0.235 s: 12.8 tok/s
    for _ in range(16):
        g.timed(False, 1, 1 / 15)     # plain: 15 tok/s
    assert g.measured() is False
    g.timed(True, 2, 0.11)            # one exploration: 18 tok/s
    assert g.measured() is True
    td, sd = g.rates["draft"]
    assert td / sd > 15


def test_an_arm_counts_as_measured_by_its_tokens_without_decay():
    """An arm whose last sample lies 40 roots back still counts as
    measured: the rates decide, not the cost model, once both arms saw 3
    tokens."""
    g = DraftGate()
    g.timed(True, 3, 0.3)
    for _ in range(40):
        g.timed(False, 1, 0.05)
    assert g.measured() is False


def test_an_exploration_the_draft_declines_is_made_again_at_the_next_root_untimed():
    """An exploration whose chain came back empty (the draft's first token
    under the cutoff) verified nothing: the yield is not touched, its root
    is not timed, the wait does not double and the next root explores
    again, up to explore_retries declines in a row; then it counts."""
    g = DraftGate(yield_=0.0, depth=1.0)
    g.rates, g._arm = {"draft": (3.0, 0.3), "plain": (10.0, 0.5)}, {"draft": (3, 0), "plain": (10, 0)}
    decisions = [g.pays(0.02, 0.05, 0.06) for _ in range(8)]
    assert decisions == [False] * 7 + [True] and g._wait == 16     # the exploration
    g.rooted("r", 1.0, 10, True)
    g.observe(0, 0)                                  # declined
    assert g.yield_ == 0.0 and g._root is None and g._wait == 8
    g.root("r", 1.1, 11)
    assert g.rates["draft"] == (3.0, 0.3)            # not timed
    for _ in range(2):                               # declined again, twice: still made again
        assert g.pays(0.02, 0.05, 0.06) is True
        g.rooted("r", 1.2, 12, True)
        g.observe(0, 0)
    assert g.pays(0.02, 0.05, 0.06) is True          # the fourth in a row counts as an attempt that drafted nothing
    g.rooted("r", 1.3, 13, True)
    g.observe(0, 0)
    assert g._root is not None and g._wait == 16
    assert g.pays(0.02, 0.05, 0.06) is False


def test_a_declined_first_attempt_does_not_set_the_yield():
    """Before any attempt is counted, a declined one leaves the yield
    unknown, so the next root attempts again."""
    g = DraftGate()
    assert g.pays(0.02, 0.05, 0.06) is True
    g.observe(0, 0)
    assert g.yield_ is None and g.pays(0.02, 0.05, 0.06) is True
    g.observe(2, 3)
    assert g.yield_ == 2.0


def test_each_exploration_gets_its_own_retries():
    """A counted decline ends the row: the next exploration the draft
    declines is made again at the next root, as the first was."""
    g = DraftGate(yield_=0.0, depth=1.0, explore_retries=1)
    g.rates, g._arm = {"draft": (3.0, 0.3), "plain": (10.0, 0.5)}, {"draft": (3, 0), "plain": (10, 0)}
    for _ in range(2):
        while not g.pays(0.02, 0.05, 0.06):
            pass
        g.observe(0, 0)                              # declined: made again at the next root
        assert g.pays(0.02, 0.05, 0.06) is True
        g.observe(0, 0)                              # declined again: counted
        assert g.pays(0.02, 0.05, 0.06) is False
