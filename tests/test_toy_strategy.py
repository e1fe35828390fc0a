"""A drafting strategy is one class: this file adds one ("repeat": the
anchor token k times, with its own option --spec-repeat) without touching
ggpipe, registers it, and checks that the command line offers and parses
its option, that the factory builds it and greedy output stays exact
(in-memory toy pipelines, no MPI), and that the registration is undone."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
from click.testing import CliRunner

from ggpipe.cli.main import cli
from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.settings import SpecSettings
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM
from ggpipe.speculation.proposers.base import (REGISTRY, Cuttable, Draining, InstantProposer, Proposer, ProposerConfig,
                                               implements, make_proposer, register, unregister)
from ggpipe.speculation.proposers.options import StrategyOptions, option
from ggpipe.speculation.tree import SpecTree

V = 48
PROMPT = [3, 9, 4, 3, 9, 4, 3, 9, 11, 5, 3, 9]


class RepeatProposer(InstantProposer):
    """Drafts the anchor token ``times`` times (greedy only: no draft
    distribution is carried)."""

    name = "repeat"
    summary = "the anchor token, again and again"
    p_accept_auto_in = ("speculative",)
    bench_variants = {"repeat": ["--mode", "pipeinfer", "--spec-type", "repeat"]}

    @classmethod
    def chain_lookup(cls, options):
        """From the context alone: the anchor, ``times`` times at most."""
        times = options.of(cls).times
        return lambda context, k: [context[-1]] * min(times, k)

    @dataclass(frozen=True)
    class Options:
        times: int = option(3, flag="--spec-repeat", range=(1, 16), help="Tokens --spec-type repeat drafts.")

    def __init__(self, cfg: ProposerConfig):
        super().__init__()
        self.times = cfg.options.of(RepeatProposer).times
        self.stats = {"repeat_drafts": 0, "repeat_tokens": 0}

    def propose(self, context: list[int], max_nodes: int) -> SpecTree:
        tree = SpecTree(anchor_pos=len(context) - 1)
        parent = -1
        for _ in range(min(self.times, max_nodes)):
            parent = tree.add(context[-1], parent, 0.5)
        self.stats["repeat_drafts"] += 1
        self.stats["repeat_tokens"] += len(tree)
        return tree


@contextmanager
def registered():
    register("repeat", RepeatProposer)
    try:
        yield
    finally:
        unregister("repeat")


@pytest.fixture
def repeat():
    with registered():
        yield


def _help() -> str:
    r = CliRunner().invoke(cli, ["generate", "--help"])
    assert r.exit_code == 0, r.output
    return r.output


def _parse(*args: str):
    """What ``ggpipe generate ARGS -p hi`` would run: (JobSpec, sampling, n_predict)."""
    from ggpipe.cli.jobs import generate
    from ggpipe.cli.options import split_job_options

    ctx = generate.make_context("generate", [*args, "-p", "hi"])
    return split_job_options(dict(ctx.params))


def test_the_cli_offers_and_parses_its_option(repeat):
    text = _help()
    assert "--spec-repeat" in text and "Tokens --spec-type repeat drafts." in text
    assert "repeat (the anchor token, again and again)" in " ".join(text.split())
    job, _, _ = _parse("--mode", "speculative", "--spec-type", "repeat", "--spec-repeat", "5")
    assert job.plan.spec.spec_type == "repeat" and job.plan.spec.strategy_options.of(RepeatProposer).times == 5
    assert job.plan.spec.p_accept is None                      # its declared default in speculative mode
    job, _, _ = _parse("--mode", "pipeinfer", "--spec-type", "repeat")
    spec = job.plan.spec
    assert spec.strategy_options.of(RepeatProposer).times == 3 and spec.p_accept == SpecSettings.p_accept
    assert not job.plan.spec.uses_draft_model
    r = CliRunner().invoke(cli, ["generate", "--spec-type", "repeat", "--spec-repeat", "0", "-p", "hi"])
    assert r.exit_code == 2 and "Invalid value for '--spec-repeat'" in r.output


def test_the_factory_builds_it_and_greedy_output_is_exact(repeat):
    spec = SpecSettings(spec_type="repeat",
                        strategy_options=StrategyOptions(repeat=RepeatProposer.Options(times=2)))
    target = FakePipeline(ToyLM(V), latency=2, cell_order=True)
    dec = build_decoder(DecodingPlan.resolve("speculative", spec),
                        target, None, n_ubatch=8, n_seq_max=64, is_eog=lambda t: False,
                        timeout_s=5)
    out = dec.generate(np.array(PROMPT, np.int32), 30, Sampler(SamplingParams()))
    assert out == ToyLM(V).greedy(list(PROMPT), 30)
    assert dec.stats["spec_type"] == "repeat" and dec.stats["repeat_drafts"] > 0
    assert dec.stats["repeat_tokens"] <= 2 * dec.stats["repeat_drafts"]   # its option reached it


def test_the_scheduler_slots_and_bench_read_its_declarations(repeat):
    """It drafts from the context alone (``chain_lookup``): ``--parallel
    auto`` gives a speculative job many slots, the scheduler drafts with it
    (greedy tokens stay the target's), and the bench offers its row."""
    from ggpipe.bench.grid import mode_args, variant_speculates
    from ggpipe.cli.parallel import slots
    from ggpipe.decoding.factory import build_chain_drafter
    from ggpipe.decoding.parallel.scheduler import Scheduler
    from ggpipe.decoding.loop import Job

    assert slots(None, DecodingPlan.resolve("pipeinfer", SpecSettings(spec_type="repeat")), 2) == 8
    assert slots(None, DecodingPlan.resolve("pipeinfer", SpecSettings(spec_type="draft")), 2) == 1
    assert mode_args()["repeat"] == ["--mode", "pipeinfer", "--spec-type", "repeat"] and variant_speculates("repeat")
    lm = ToyLM(V)
    target = FakePipeline(lm, latency=2, cell_order=True, streams=True)
    draft = build_chain_drafter(DecodingPlan.resolve("pipeinfer", SpecSettings(spec_type="repeat")),
                                target, None, n_ubatch=8, timeout_s=5)
    assert not draft.has_ranks
    sched = Scheduler(target, 2, n_ctx_slot=256, n_batch=16, is_eog=lambda t: False, draft=draft, draft_max=4)
    job = Job(list(PROMPT), 24, Sampler(SamplingParams()))
    sched.submit(job)
    sched.run()
    assert job.request.out == lm.greedy(PROMPT, 24)


def test_it_implements_the_core_and_no_capability(repeat):
    p = make_proposer("repeat", ProposerConfig(n_vocab=V))
    assert isinstance(p, Proposer) and not implements(p, Cuttable) and not implements(p, Draining)
    assert not p.can_cut() and not p.busy() and p.due_in() is None   # the base class's "none" defaults
    draft = make_proposer("draft", ProposerConfig(backend=FakePipeline(ToyLM(V), name="draft"), n_vocab=V))
    assert implements(draft, Cuttable) and implements(draft, Draining)


def test_registration_is_checked_and_undone():
    from ggpipe.cli.options import _spec_settings

    with registered():
        assert "repeat" in REGISTRY
        with pytest.raises(ValueError, match="taken"):
            register("repeat", RepeatProposer)
    assert "repeat" not in REGISTRY and "--spec-repeat" not in _help()
    with pytest.raises(ValueError, match="unknown speculation type"):
        _spec_settings({"mode": "speculative", "spec_type": "repeat"})
    with pytest.raises(ValueError, match="not 'other'"):
        register("other", RepeatProposer)
    with pytest.raises(ValueError, match="no proposer registered"):
        unregister("repeat")
