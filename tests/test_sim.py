"""The simulator (ggpipe.sim): schedules checked against hand-computed
pipelines, determinism, profiles, balanced splits. No MPI, no model (the
calibration's real measurement is in test_calibrate.py)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggpipe.decoding.plan import DecodingPlan
from ggpipe.cluster.balance import balance_layers, stage_times
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError, SplitError
from ggpipe.runs import Run
from ggpipe.sim.backend import HEADER_BYTES, SimClock, SimPipeline, SimStage
from ggpipe.sim.calibrate import fit_link
from ggpipe.sim.model import ARCHITECTURES, ModelDesc, described, resolve_desc
from ggpipe.sim.profile import HostProfile, LayerShape, LinkProfile, Profile
from ggpipe.sim.run import SimConfig, simulate
from ggpipe.sim.toy import ToyLM

MS = 1e-3


def flat_host(layer_ms: float, head_ms: float, name: str = "h", **kw) -> HostProfile:
    """A host whose costs do not depend on batch size (hand-computable)."""
    return HostProfile(name, layer_s=[layer_ms * MS] * 6, layer_bytes=1000, head_s=[head_ms * MS] * 6,
                       head_bytes=1000, **kw)


def toy_model(n_layer: int = 4) -> ModelDesc:
    return ModelDesc("toy", (LayerShape(1000, 250),) * n_layer, LayerShape(1000, 250), n_embd=8, n_vocab=64)


def free_link(latency_ms: float):
    return lambda s, d: LinkProfile(s, d, latency_ms * MS, 0.0)


# -- schedules ---------------------------------------------------------------------


def test_iterative_matches_the_hand_computed_pipeline():
    """2 ranks, 4 layers of 1 ms, head 2 ms, 0.5 ms links, no overhead: each
    token is stage 0 (2 ms) + hop (0.5) + stage 1 (2 + 2 ms) + hop back (0.5) = 7 ms."""
    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.5 * MS, 0.0)])
    r = simulate(SimConfig(prof, toy_model(), mode="iterative", ranks=2, n_prompt=8, n_predict=20, prompts=2))
    assert r["tokens_per_s"] == pytest.approx(1 / (7 * MS), rel=1e-9)
    assert r["ttft_ms"] == pytest.approx(7.0, rel=1e-9)
    assert r["accepted_per_pass"] == 1.0
    # busy: 2 ms on rank 0 and 4 ms on rank 1 per 7 ms token (the prompt's pass included)
    assert r["busy_share"][0] == pytest.approx(2 / 7, rel=1e-6)
    assert r["busy_share"][1] == pytest.approx(4 / 7, rel=1e-6)


def run_of(n: int, pos0: int = 0) -> Run:
    return Run.linear(list(range(1, n + 1)), pos0, seq=0, output_last=True)


def two_stage(clock, s0_ms=2.0, s1_ms=3.0, hop_ms=1.0, async_local=True):
    stages = [SimStage(0, lambda n, kv, o: s0_ms * MS), SimStage(1, lambda n, kv, o: s1_ms * MS)]
    return SimPipeline(ToyLM(64), clock, stages, free_link(hop_ms), n_embd=8, n_vocab_real=64,
                       async_local=async_local)


def test_runs_in_flight_overlap_as_a_pipeline():
    """Three runs submitted at t=0 on stages of 2 and 3 ms with 1 ms hops:
    stage 0 runs [0,2] [2,4] [4,6]; stage 1 [3,6] [6,9] [9,12]; results at 7, 10, 13 ms."""
    clock = SimClock()
    pipe = two_stage(clock)
    pos = 0
    for _ in range(3):
        pipe.submit(run_of(1, pos))
        pos += 1
    assert clock.now == 0.0  # the head's stage runs on its executor: submit returns at once
    dues = []
    while pipe.inflight:
        dues.append(round(pipe.next_due() / MS, 9))
        assert not pipe.ready() or clock.now >= pipe.next_due()
        res = pipe.wait()
        assert not res.cancelled
        assert res.finished_at == pytest.approx(dues[-1] * MS)
    assert dues == [7.0, 10.0, 13.0]
    assert pipe.busy == {0: pytest.approx(6 * MS), 1: pytest.approx(9 * MS)}


def test_a_synchronous_head_stage_blocks_submit():
    clock = SimClock()
    pipe = two_stage(clock, async_local=False)
    pipe.submit(run_of(1))
    assert clock.now == pytest.approx(2 * MS)  # the head computed stage 0 itself
    assert pipe.head_idle()


def test_a_cancel_skips_a_run_not_started_and_later_runs_move_up():
    """As above; run 1 cancelled at t=4.5 ms reaches stage 1 at 5.5, before
    run 1 would start there (6): it is skipped, and run 2 takes stage 1 at 7
    (its activations' arrival) instead of 9."""
    clock = SimClock()
    pipe = two_stage(clock)
    runs = [run_of(1, p) for p in range(3)]
    for r in runs:
        pipe.submit(r)
    clock.now = 4.5 * MS
    pipe.cancel(runs[1].run_id)
    assert pipe.wait().run is runs[0] and clock.now == pytest.approx(7 * MS)
    res = pipe.wait()
    assert res.cancelled and res.finished_at == pytest.approx(7 * MS)  # the skip marker comes straight back
    res = pipe.wait()
    assert not res.cancelled and res.finished_at == pytest.approx(11 * MS)
    assert pipe.busy[1] == pytest.approx(6 * MS)  # runs 0 and 2 only


def test_a_cancel_mid_compute_aborts_at_its_arrival():
    clock = SimClock()
    pipe = two_stage(clock, s1_ms=10.0)
    r = run_of(1)
    pipe.submit(r)
    clock.now = 4.0 * MS        # stage 1 computes run 0 from 3 to 13 ms
    pipe.cancel(r.run_id)       # arrives at 5 ms
    res = pipe.wait()
    assert res.cancelled and res.finished_at == pytest.approx(6 * MS)
    assert pipe.busy[1] == pytest.approx(2 * MS)


def test_link_bandwidth_serializes_messages():
    """Logit rows of 64 floats + header back over a 1 MB/s link: (64*4+64) B = 0.32 ms each."""
    clock = SimClock()
    stages = [SimStage(0, lambda n, kv, o: 0.0), SimStage(1, lambda n, kv, o: 0.0)]
    pipe = SimPipeline(ToyLM(64), clock, stages, lambda s, d: LinkProfile(s, d, 0.0, 1e6), n_embd=8,
                       n_vocab_real=64, async_local=True)
    pipe.submit(run_of(1, 0))
    pipe.submit(run_of(1, 1))
    act = (HEADER_BYTES + 13 + 4 * 8) / 1e6
    row = (HEADER_BYTES + 4 * 64) / 1e6
    assert pipe.wait().finished_at == pytest.approx(act + row)
    assert pipe.wait().finished_at == pytest.approx(act + 2 * row)  # the second row waits for the first


def test_simulation_is_deterministic_and_speculation_is_exact():
    prof = Profile("toy", None, [flat_host(1.0, 2.0, overhead_s=50e-6, spec_overhead_s=200e-6)],
                   [LinkProfile(0, 1, 0.05 * MS, 1e9)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 4, LayerShape(100, 25), 8, 64)
    out = []
    for mode in ("speculative", "pipeinfer", "pipeinfer"):
        cfg = SimConfig(prof, toy_model(8), draft, mode=mode, ranks=3, acceptance=0.8, n_predict=64, prompts=2,
                        spec=SpecSettings())
        out.append(simulate(cfg))
    assert out[1] == out[2]
    for r in out:
        assert r["accepted_per_pass"] > 1.2 and 0.35 < r["acceptance_rate"] <= 1.0


@pytest.mark.parametrize("ranks", [3, 4])
def test_waiting_for_the_draft_where_it_pays_stays_exact_and_is_not_slower(ranks):
    """The per-pass decision (--wait-draft, the default): with the head's
    stage idle and the draft's next token due soon, the loop waits for it
    where the cost curve says so; tokens are the target's greedy ones either
    way, and waiting is at least as fast on this profile."""
    from ggpipe.sim.run import build
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
    from ggpipe.sim.backend import idle_until_next

    prof = Profile("toy", None, [flat_host(1.0, 2.0, overhead_s=50e-6, spec_overhead_s=200e-6)],
                   [LinkProfile(0, 1, 0.05 * MS, 1e9)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 4, LayerShape(100, 25), 8, 64)
    prompt = np.arange(20, dtype=np.int32) % 64
    out = {}
    for wait in (True, False):
        spec = SpecSettings(wait_draft=wait)
        cfg = SimConfig(prof, toy_model(8), draft, mode="pipeinfer", ranks=ranks, acceptance=0.8, spec=spec)
        clock, target, dpipe, busy, roles = build(cfg)
        dec = build_decoder(DecodingPlan.resolve("pipeinfer", spec),
                            target, dpipe, n_ubatch=512, n_seq_max=32, is_eog=lambda t: False,
                            timeout_s=60, idle=idle_until_next(clock, [target, dpipe]))
        toks = dec.generate(prompt, 64, Sampler(SamplingParams(temperature=0.0)))
        assert toks == target.model.greedy([int(t) for t in prompt], 64)
        out[wait] = (clock.now, dec.stats["waited_for_draft"])
    assert out[False][1] == 0 and out[True][1] > 0
    assert out[True][0] <= out[False][0] * 1.01


def test_the_real_loop_runs_against_the_simulated_pipelines_token_exact():
    """The decoders' greedy output over simulated pipelines is the toy
    target's greedy continuation, in every mode (the schedule changes timing,
    never tokens)."""
    from ggpipe.sim.run import build
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
    from ggpipe.sim.backend import idle_until_next

    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.1 * MS, 0.0)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 2, LayerShape(100, 25), 8, 64)
    prompt = np.arange(20, dtype=np.int32) % 64
    for mode in ("iterative", "speculative", "pipeinfer", "pipedec"):
        cfg = SimConfig(prof, toy_model(6), draft, mode=mode, ranks=3, acceptance=0.6, spec=SpecSettings())
        clock, target, dpipe, busy, roles = build(cfg)
        dec = build_decoder(DecodingPlan.resolve(mode, SpecSettings()), target, dpipe, n_ubatch=512, n_seq_max=32,
                            is_eog=lambda t: False, timeout_s=60,
                            idle=idle_until_next(clock, [p for p in (target, dpipe) if p]))
        toks = dec.generate(prompt, 40, Sampler(SamplingParams(temperature=0.0)))
        assert toks == target.model.greedy([int(t) for t in prompt], 40), mode


def test_pipedec_gains_grow_with_pipeline_depth():
    """PipeDec keeps every target stage on another layer of the tree: with a
    draft that keeps up and agrees 90% of the time, its speedup over the
    plain pipeline grows with the number of target stages, and each layer
    run decides at most one token."""
    prof = Profile("toy", None, [flat_host(1.0, 2.0, overhead_s=20e-6, spec_overhead_s=50e-6)],
                   [LinkProfile(0, 1, 0.05 * MS, 1e9)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 2, LayerShape(100, 25), 8, 64)
    ratios = []
    for stages in (2, 4, 8):
        base = simulate(SimConfig(prof, toy_model(16), mode="iterative", ranks=stages, n_predict=64, prompts=2))
        cfg = SimConfig(prof, toy_model(16), draft, mode="pipedec", ranks=stages + 1, acceptance=0.9, n_predict=64,
                        prompts=2, spec=SpecSettings())
        r = simulate(cfg)
        assert r == simulate(cfg)                    # deterministic
        assert r["accepted_per_pass"] == 1.0
        ratios.append(r["tokens_per_s"] / base["tokens_per_s"])
    assert 1.3 < ratios[0] < ratios[1] < ratios[2], ratios


def test_simulated_pipedec_trees_mask_dead_rows_exactly():
    """A wide PipeDec tree over 4 target stages: rows of layers in flight
    that a hit killed are masked by the stages a prune reaches before the
    run (ggpipe.pipeline.masking), the output equals plain greedy decoding,
    and the job is faster than the same job with masking off (rows
    computed and ignored, as with every prune arriving too late)."""
    from ggpipe.sim import backend
    from ggpipe.sim.run import build
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
    from ggpipe.sim.backend import idle_until_next

    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.05 * MS, 1e9)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 2, LayerShape(100, 25), 8, 64)
    prompt = np.arange(20, dtype=np.int32) % 64
    spec = SpecSettings(tree_width=8, max_children=4)

    def run():
        cfg = SimConfig(prof, toy_model(8), draft, mode="pipedec", ranks=5, acceptance=0.6, spec=spec)
        clock, target, dpipe, busy, roles = build(cfg)
        dec = build_decoder(DecodingPlan.resolve("pipedec", spec), target, dpipe, n_ubatch=512, n_seq_max=64,
                            is_eog=lambda t: False, timeout_s=60, idle=idle_until_next(clock, [target, dpipe]))
        toks = dec.generate(prompt, 40, Sampler(SamplingParams(temperature=0.0)))
        assert toks == target.model.greedy([int(t) for t in prompt], 40)
        return clock.now, target.stats["rows_masked"], dec.stats["rows_mask_sent"]

    t_masked, masked, sent = run()
    assert sent > 0 and 0 < masked <= sent
    real_prune = backend.SimPipeline.prune
    backend.SimPipeline.prune = lambda self, pairs: None      # every prune too late
    try:
        t_plain, masked_plain, _ = run()
    finally:
        backend.SimPipeline.prune = real_prune
    assert masked_plain == 0 and t_masked < t_plain, (t_masked, t_plain)


def test_impossible_jobs_are_refused_like_generate_refuses_them():
    prof = Profile("toy", None, [flat_host(1.0, 2.0)])
    with pytest.raises(SplitError):
        simulate(SimConfig(prof, toy_model(2), mode="iterative", ranks=3))
    with pytest.raises(ConfigError, match="draft"):
        simulate(SimConfig(prof, toy_model(4), toy_model(2), mode="pipeinfer", ranks=1))


# -- profiles ------------------------------------------------------------------------


def test_profile_round_trips(tmp_path):
    prof = Profile("m", "d", [flat_host(1.0, 2.0, rank=0, draft_s=[5e-3] * 6, draft_name="d"),
                             flat_host(2.0, 3.0, name="h2", rank=1)],
                   [LinkProfile(0, 1, 1e-5, 1e8)], {"created": "now"})
    path = tmp_path / "p.json"
    prof.save(path)
    assert Profile.load(path) == prof
    assert prof.link(1, 0).latency_s == 1e-5 and prof.link(1, 2).bandwidth_Bps == 1e8  # reverse, then uniform
    assert prof.host(3) is prof.hosts[1]


@pytest.mark.parametrize("text, msg", [
    ("not json", "cannot read"), ('{"format": "other"}', "not a ggpipe profile"),
    ('{"format": "ggpipe-profile/1", "hosts": []}', "no host records"),
    ('{"format": "ggpipe-profile/1", "hosts": [{"host": "a", "layer_s": [1]}]}', "one value per batch size"),
    ('{"format": "ggpipe-profile/1", "hosts": [{"bogus": 1}]}', "malformed"),
])
def test_bad_profiles_get_one_clear_error(tmp_path, text, msg):
    p = tmp_path / "p.json"
    p.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        Profile.load(p)
    with pytest.raises(ConfigError, match="does not exist"):
        Profile.load(tmp_path / "missing.json")


def test_costs_scale_by_bytes_and_interpolate():
    h = HostProfile("h", layer_s=[1.0, 1.5, 2.0, 3.0, 5.0, 9.0], layer_bytes=100, head_s=[1, 2, 4, 8, 16, 32],
                    head_bytes=10, kv_s_per_cell=0.001, kv_ref=10)
    assert h.layer_cost(LayerShape(200, 0), 1) == 2.0
    assert h.layer_cost(LayerShape(100, 0), 3) == 1.75
    assert h.layer_cost(LayerShape(100, 0), 64) == pytest.approx(9.0 + 4 / 16 * 32)  # extended past 32
    assert h.layer_cost(LayerShape(100, 0), 2, kv=20) == pytest.approx(1.5 + 0.001 * 2 * 10)
    assert h.head_cost(LayerShape(10, 0), 0) == 0.0
    roof = HostProfile("r", mem_bw_Bps=1e9, flops=1e9)
    assert roof.layer_cost(LayerShape(1000, 10), 1) == pytest.approx(1e-6)   # memory bound
    assert roof.layer_cost(LayerShape(1000, 10), 100) == pytest.approx(2e-6)  # compute bound


def test_described_models_have_the_published_sizes():
    m = described("llama2-70b", ARCHITECTURES["llama2-70b"], "Q3_K_M")
    params = sum(s.params for s in m.layers) + m.head.params + 32000 * 8192  # + token_embd
    assert 68e9 < params < 70e9            # Llama 2 70B: 69B weights
    assert 30e9 < m.bytes < 35e9           # a 70B Q3_K_M GGUF: ~33 GB
    assert resolve_desc("falcon-180b:Q3_K_M").n_layer == 80
    with pytest.raises(ConfigError, match="quantization"):
        resolve_desc("llama2-70b:Q9")


def test_fit_link():
    lat, bw = fit_link([64, 1064], [1e-5, 1e-5 + 1e-6])
    assert lat == pytest.approx(1e-5) and bw == pytest.approx(1e9)
    assert fit_link([64, 1064], [1e-5, 1e-5])[1] == 0.0


# -- balanced splits -------------------------------------------------------------------


def brute(cost, extra, fits, objective="bottleneck"):
    n_stages, n_layer = len(cost), len(cost[0])
    best = None
    for cuts in itertools.combinations(range(1, n_layer), n_stages - 1):
        b = (0,) + cuts + (n_layer,)
        ranges = list(zip(b[:-1], b[1:]))
        if not all(fits(s, a, z) for s, (a, z) in enumerate(ranges)):
            continue
        t = stage_times(ranges, cost, extra)
        key = (max(t), sum(t)) if objective == "bottleneck" else (sum(t), max(t))
        if best is None or key < best[0]:
            best = (key, ranges)
    return best


@pytest.mark.parametrize("objective", ["bottleneck", "latency"])
def test_balance_is_optimal_against_brute_force(objective):
    rng = np.random.default_rng(0)
    for trial in range(60):
        n_stages = int(rng.integers(1, 5))
        n_layer = int(rng.integers(n_stages, 10))
        speed = rng.uniform(0.5, 3.0, n_stages)
        cost = [list(speed[s] * rng.uniform(0.9, 1.1, n_layer)) for s in range(n_stages)]
        extra = list(rng.uniform(0, 2, n_stages))
        cap = rng.integers(1, n_layer + 1, n_stages)
        fits = (lambda s, a, b, cap=cap: b - a <= cap[s])
        want = brute(cost, extra, fits, objective)
        if want is None:
            with pytest.raises(SplitError, match="memory"):
                balance_layers(cost, extra, fits, objective)
            continue
        got = balance_layers(cost, extra, fits, objective)
        t = stage_times(got, cost, extra)
        key = (max(t), sum(t)) if objective == "bottleneck" else (sum(t), max(t))
        assert key == pytest.approx(want[0]), trial


def test_balance_gives_a_faster_host_more_layers():
    cost = [[1.0] * 30, [2.0] * 30]     # rank 1 twice as slow
    assert balance_layers(cost) == [(0, 20), (20, 30)]
    assert balance_layers(cost, [0.0, 10.0]) == [(0, 24), (24, 30)]  # the head on the last stage; ties: least sum
    with pytest.raises(SplitError, match="only 2 layers"):
        balance_layers([[1.0, 1.0]] * 3)
    # one run at a time: the slow rank gets the fewest layers it can
    assert balance_layers(cost, objective="latency") == [(0, 29), (29, 30)]


# -- the commands -------------------------------------------------------------------------


def test_simulate_command_prints_every_configuration(tmp_path):
    from ggpipe.cli.main import cli

    node = HostProfile("node", mem_bw_Bps=100e9, flops=1e12)  # a described host: roofline costs
    Profile("described", None, [node], [LinkProfile(0, 1, 1e-5, 10e9)]).save(tmp_path / "p.json")
    r = CliRunner().invoke(cli, ["simulate", "--profile", str(tmp_path / "p.json"), "-m", "llama2-70b:Q3_K_M",
                                 "-md", "tinyllama-1.1b:Q4_K_M", "--ranks", "2,3", "--link", "shm",
                                 "--link", "1gbit,200us", "-n", "32", "--prompts", "1", "--json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["link"], x["ranks"], x["mode"]) for x in rows][:3] == [
        ("shm", 2, "iterative"), ("shm", 2, "speculative"), ("shm", 2, "pipeinfer")]
    assert len(rows) == 12 and all(x["tokens_per_s"] > 0 for x in rows)
    slow = {(x["ranks"], x["mode"]): x["tokens_per_s"] for x in rows if x["link"] != "shm"}
    fast = {(x["ranks"], x["mode"]): x["tokens_per_s"] for x in rows if x["link"] == "shm"}
    assert all(slow[k] < fast[k] for k in fast if k[1] != "pipeinfer")  # pipeinfer's timing changes its drafts
    # pipedec, PipeDec's own pair (README's example), with its tree knobs
    r = CliRunner().invoke(cli, ["simulate", "--profile", str(tmp_path / "p.json"), "-m", "llama3.1-70b:Q4_K_M",
                                 "-md", "llama3.2-1b:Q4_K_M", "--ranks", "5", "--modes", "pipeinfer,pipedec",
                                 "--tree-width", "2", "--acceptance", "0.8", "-n", "24", "--prompts", "1"])
    assert r.exit_code == 0, r.output
    assert "| shm | 5 | pipedec |" in r.output, r.output


def test_plan_balance_puts_fewer_layers_on_a_slow_rank(tmp_path):
    from ggpipe.cli.main import cli
    from ggpipe.sim.model import from_gguf

    m = from_gguf("smollm2-135m")
    fast = HostProfile("a", layer_s=[1e-3] * 6, layer_bytes=m.layers[0].bytes, head_s=[3e-3] * 6,
                       head_bytes=m.head.bytes, rank=0)
    slow = HostProfile("b", layer_s=[3e-3] * 6, layer_bytes=m.layers[0].bytes, head_s=[9e-3] * 6,
                       head_bytes=m.head.bytes, rank=1)
    Profile("smollm2-135m", None, [fast, slow]).save(tmp_path / "p.json")
    def plan(*job):
        r = CliRunner().invoke(cli, ["plan", "-n", "2", "--balance", str(tmp_path / "p.json"), "--launcher", "mpich",
                                     "--json", "--", "generate", "-m", "smollm2-135m", *job, "-p", "hi"])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    # one run at a time (iterative): the fewest layers on the slow rank (29 + 3 + 9 ms < 25 + 15 + 9 ms)
    d = plan()
    assert d["balance"]["split"] == "29,1"
    assert d["ranks"][0]["layers"] == [0, 29] and "--split" in d["command"]
    # runs overlapping (pipeinfer): stages as even as the costs allow (25 ms against 5 x 3 + 9 ms)
    assert plan("--mode", "pipeinfer", "--spec-type", "ngram")["balance"]["split"] == "25,5"
    r = CliRunner().invoke(cli, ["plan", "-n", "2", "--balance", str(tmp_path / "p.json"), "--", "generate", "-m",
                                 "smollm2-135m", "--split", "1,1", "-p", "hi"])
    assert r.exit_code != 0 and "leave --split out" in r.output


def test_speculative_auto_depth_charges_the_measured_draft_step():
    """In synchronous speculation the draft model proposer measures its
    one-token round trip (virtual time here: 2 layers x 0.1 ms + head
    0.2 ms + 0.1 ms each way = 0.6 ms), and --p-accept auto charges it to
    the look at a chain's next token (the decode rate times the step, in
    tokens); a token is kept at the decode rate times its marginal pass
    cost. Pipeinfer does not charge the step (drafting overlaps)."""
    from ggpipe.decoding.factory import build_decoder
    from ggpipe.sampling import Sampler
    from ggpipe.sampling_params import SamplingParams
    from ggpipe.sim.backend import idle_until_next
    from ggpipe.sim.run import build
    from ggpipe.speculation.adaptive import look_threshold

    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.1 * MS, 0.0)])
    draft = ModelDesc("d", (LayerShape(100, 25),) * 2, LayerShape(100, 25), 8, 64)
    for mode in ("speculative", "pipeinfer"):
        spec = SpecSettings(p_accept=None)
        cfg = SimConfig(prof, toy_model(6), draft, mode=mode, ranks=2, acceptance=0.7, spec=spec)
        clock, target, dpipe, busy, roles = build(cfg)
        dec = build_decoder(DecodingPlan.resolve(mode, spec),
                            target, dpipe, n_ubatch=512, n_seq_max=32, is_eog=lambda t: False,
                            timeout_s=60, idle=idle_until_next(clock, [target, dpipe]))
        dec.generate(np.arange(16, dtype=np.int32), 40, Sampler(SamplingParams(temperature=0.0)))
        assert dec.proposer.step_s == pytest.approx(0.6 * MS)
        assert dec.stats["draft_step_ms"] == pytest.approx(0.6, abs=1e-3)
        c1, c2 = dec.pass_cost.cost(1), dec.pass_cost.cost(2)
        if mode == "speculative":
            lam = dec.decode_rate.rate()
            want = min(0.6, max(0.05, lam * (c2 - c1)))
            assert dec.stats["look_threshold"] == pytest.approx(
                look_threshold(dec.acceptance.looked(), want, lam * 0.6 * MS), abs=1e-4)   # (rounded)
            assert dec.stats["looks_skipped"] > 0
        else:
            want = min(0.6, max(0.05, (c2 - c1) / c1))
            assert dec.stats["look_threshold"] == 0.0
        assert dec.stats["draft_threshold"] == pytest.approx(want)


def test_simulated_timelines_are_traces_ggpipe_timeline_draws(tmp_path):
    """--timeline: per-rank traces in ggpipe.trace's files; every computed
    stage span is a ``run`` event on its rank, matching the busy time."""
    from ggpipe.bench.timeline import load_traces

    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.5 * MS, 0.0)])
    r = simulate(SimConfig(prof, toy_model(), mode="iterative", ranks=2, n_prompt=8, n_predict=10, prompts=1),
                 trace_dir=tmp_path / "tl")
    headers, events, meta = load_traces(tmp_path / "tl")
    assert sorted(headers) == [0, 1] and meta["roles"]["0"].startswith("target")
    for rank, ms in ((0, 2.0), (1, 4.0)):
        runs = [e for e in events[rank] if e["name"] == "run"]
        assert len(runs) == 10 and all(e["dur"] == pytest.approx(ms * MS) for e in runs)  # prompt + 9 tokens
    assert r["busy_share"][0] == pytest.approx(2 / 7, rel=1e-6)


def test_simulated_parallel_requests_share_the_pipeline():
    """--parallel on the virtual clock: the scheduler's micro-batches of
    several slots, depth = stages in flight. With costs that do not grow with
    the batch (flat_host), 4 slots in 2 groups over 2 stages keep the slower
    stage (4 ms a micro-batch of 2) busy: 500 tokens/s at most, against 161
    for one request at a time (6.2 ms per token through both stages and
    links); prompts and tails cost the rest."""
    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.1 * MS, 0.0)])
    base = dict(mode="iterative", ranks=2, n_prompt=8, n_predict=20, prompts=4)
    one = simulate(SimConfig(prof, toy_model(), **base), rounds=1)
    many = simulate(SimConfig(prof, toy_model(), parallel=4, **base), rounds=1)
    assert many["parallel"] == 4 and len(many["records"]) == 4
    assert 2.5 * one["tokens_per_s"] < many["aggregate_tokens_per_s"] <= 500.0
    assert all(r["tokens_per_s"] > 0 for r in many["records"])


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer", "pipedec"])
def test_simulated_parallel_speculates_for_a_request_alone(mode):
    """A speculative mode under --parallel on the virtual clock, built as
    serve and batch build it (build_scheduler): a request alone in its job
    gets chains or look-ahead rows from the simulated draft; pipeinfer's
    look-ahead rows, drafted while its row is in flight on 2 target stages,
    make it faster than iterative decoding in the same slots."""
    prof = Profile("toy", None, [flat_host(1.0, 2.0)], [LinkProfile(0, 1, 0.1 * MS, 0.0)])
    base = dict(ranks=3, n_prompt=8, n_predict=40, prompts=1, parallel=2)
    plain = simulate(SimConfig(prof, toy_model(), **base), rounds=1)
    spec = simulate(SimConfig(prof, toy_model(), toy_model(2), mode=mode, **base), rounds=1)
    rec = spec["records"][0]
    assert 0.0 < rec["acceptance_rate"] <= 1.0, rec
    if mode == "pipeinfer":
        assert spec["tokens_per_s"] > 1.1 * plain["tokens_per_s"], (spec["tokens_per_s"], plain["tokens_per_s"])


def test_the_timed_stage_streams_its_weights_from_memory():
    """The calibration's middle stage holds enough blocks that their weights
    are twice the last-level cache (as a job's stage streams them every
    token); 256 MiB where the cache size is unknown; within the model."""
    from ggpipe.sim.measure import last_level_cache_bytes, stream_layers

    mib = 1 << 20
    assert stream_layers(17 * mib, 40, 32 * mib) == 4          # 68 MiB >= 64 MiB
    assert stream_layers(8 * mib, 40, 32 * mib) == 8
    assert stream_layers(2 * mib, 40, 105 * mib) == 38         # capped: all blocks but the first and last
    assert stream_layers(130 * mib, 32, 32 * mib) == 4         # a 7B block: the minimum already streams
    assert stream_layers(1 * mib, 30, None) == 28              # unknown cache: 256 MiB, capped
    assert stream_layers(64 * mib, 2, 32 * mib) == 1
    llc = last_level_cache_bytes()
    assert llc is None or llc >= 1 << 16
