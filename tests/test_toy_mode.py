"""A new decoding mode is one class in one file: this file adds one, a
greedy mode that verifies its own next token twice ("echo"): each step sends
the last decided token, then sends it again in a second sequence and checks
that both logit rows agree. It declares what it needs (two KV sequence ids),
registers itself, and runs through the same builder the engine and the
simulator use, on the in-memory toy pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from ggpipe.decoding.factory import build_decoder
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.decoding.mode import MODES, BuildContext, Mode, mode_class, register_mode
from ggpipe.decoding.request import Request
from ggpipe.decoding.settings import SpecSettings
from ggpipe.errors import ConfigError, ProtocolError
from ggpipe.logits import argmax
from ggpipe.runs import Run
from ggpipe.sampling import Sampler
from ggpipe.sampling_params import SamplingParams
from ggpipe.sim.toy import FakePipeline, ToyLM


class Echo(Mode):
    """Greedy decoding that evaluates every token twice, in sequences 0 and 1."""

    name = "echo"

    def __init__(self, target, n_ubatch: int, is_eog):
        super().__init__()
        self.target, self.n_ubatch, self.is_eog = target, n_ubatch, is_eog

    @classmethod
    def seq_ids(cls, spec: SpecSettings) -> int:
        return 2

    @classmethod
    def build(cls, ctx: BuildContext) -> "Echo":
        return cls(ctx.target, ctx.n_ubatch, ctx.is_eog)

    def open(self, prompt, n_predict, sampler, start_pos, emit, clock, history):
        if not sampler.params.greedy:
            raise ConfigError("--mode echo is greedy only")
        self.r = Request(n_predict=n_predict, emit=emit, clock=clock, is_eog=self.is_eog,
                         context=history + [int(t) for t in prompt])
        n = len(prompt)
        self.target.submit_prompt(prompt, start_pos, self.n_ubatch)
        self.target.seq_cp(0, 1, 0, start_pos + n)   # the second sequence shares the prompt's cells
        logits = self.target.drain()[-1].logits[0]
        clock.prompt_done()
        self.r.accept([int(np.argmax(logits))])
        return self.r

    def step(self) -> None:
        r = self.r
        tok, pos = r.out[-1], len(r.context) - 1
        self.target.submit(Run(run_id=10**6 + pos, tokens=np.array([tok, tok], np.int32),
                               pos=np.array([pos, pos], np.int32), n_seq_id=np.ones(2, np.int32),
                               seq_ids=np.array([0, 1], np.int32), outputs=np.ones(2, np.int8)))
        rows = self.target.wait().logits
        a, b = argmax(rows[0]), argmax(rows[1])
        if a != b:
            raise ProtocolError(f"the two sequences disagree at position {pos}")
        r.accept([int(a)])

    def close(self) -> None:
        self.stats = {"echoed": len(self.r.out) - 1}


@pytest.fixture()
def echo_registered():
    register_mode("echo", Echo)
    yield
    del MODES["echo"]


def test_a_mode_in_one_file_runs_through_the_builder(echo_registered):
    target = FakePipeline(ToyLM(48))
    dec = build_decoder(DecodingPlan.resolve("echo", SpecSettings()),
                        target, None, n_ubatch=8, n_seq_max=2, is_eog=lambda t: False,
                        timeout_s=5)
    prompt = [3, 9, 4, 3, 9, 11]
    out = dec.generate(np.array(prompt, np.int32), 12, Sampler(SamplingParams()))
    assert out == ToyLM(48).greedy(prompt, 12)
    assert dec.stats == {"echoed": 11}
    assert mode_class("echo").seq_ids(SpecSettings()) == 2


def test_the_registry_names_the_modes_and_refuses_unknown_ones(echo_registered):
    assert {"iterative", "speculative", "pipeinfer", "pipedec", "echo"} <= set(MODES)
    with pytest.raises(ConfigError, match="unknown mode 'nope'"):
        mode_class("nope")
    with pytest.raises(ConfigError, match="unknown mode 'nope'"):
        DecodingPlan.resolve("nope")
    with pytest.raises(ConfigError, match="draft models"):    # the mode's own check, once, as the plan is made
        DecodingPlan.resolve("echo", SpecSettings(), n_draft_models=2)


def test_the_cli_offers_a_registered_mode(echo_registered):
    from click.testing import CliRunner

    from ggpipe.cli.main import cli

    shown = CliRunner().invoke(cli, ["generate", "--help"])
    assert shown.exit_code == 0 and "pipedec|echo]" in shown.output
    refused = CliRunner().invoke(cli, ["generate", "--mode", "nope", "-p", "x"])
    assert refused.exit_code == 2 and "'nope' is not one of 'iterative'" in refused.output


def test_the_simulator_placement_and_bench_read_the_modes_declarations(echo_registered):
    """The rest of the program asks the mode's declarations, never its
    name: the simulator runs echo on simulated ranks (its two sequences
    included) and gets the toy model's greedy tokens' speed; the placement
    balances its stages for one token per pass without a draft rank; the
    bench offers it as a row that needs no draft model."""
    from ggpipe.bench.grid import mode_args, variant_speculates
    from ggpipe.sim.placement import place
    from ggpipe.sim.model import ModelDesc
    from ggpipe.sim.profile import HostProfile, LayerShape, LinkProfile, Profile
    from ggpipe.sim.run import SimConfig, simulate

    host = HostProfile("h", layer_s=[1e-3] * 6, layer_bytes=1000, head_s=[2e-3] * 6, head_bytes=1000)
    prof = Profile("toy", None, [host], [LinkProfile(0, 1, 0.5e-3, 0.0)])
    model = ModelDesc("toy", (LayerShape(1000, 250),) * 4, LayerShape(1000, 250), n_embd=8, n_vocab=64)
    r = simulate(SimConfig(prof, model, mode="echo", ranks=2, n_prompt=8, n_predict=10, prompts=1))
    assert r["mode"] == "echo" and r["records"][0]["target_passes"] >= 10
    p = place(prof, model, model, 2, "echo")
    assert p.draft is None and len(p.target) == 2
    assert mode_args()["echo"] == ["--mode", "echo"] and not variant_speculates("echo")
    assert variant_speculates("pipeinfer-no-cancel") and "vote" in mode_args()


def test_each_mode_declares_what_it_becomes_beside_other_requests(echo_registered):
    """``in_slots``: None where --parallel runs the mode as one request at a
    time does (iterative, the toy mode); a sentence naming the mode and its
    strategy for the speculating modes, and for pipeinfer and pipedec what
    runs only with --parallel 1 (the engine prints it at start-up)."""
    spec = SpecSettings(spec_type="ngram")
    assert mode_class("iterative").in_slots(spec) is None and mode_class("echo").in_slots(spec) is None
    for name in ("speculative", "pipeinfer", "pipedec"):
        said = mode_class(name).in_slots(spec)
        assert said.startswith(f"--mode {name} under --parallel") and "--spec-type ngram" in said, said
        assert ("only with --parallel 1" in said) == (name != "speculative"), said


def test_no_code_outside_the_modes_and_strategies_compares_their_names():
    """A mode or a strategy is one module: no module outside
    ``ggpipe/decoding/`` and ``ggpipe/speculation/`` compares a registered
    mode's or strategy's name (``mode == "pipeinfer"``, ``spec_type !=
    "ngram"``, ``in ("iterative", ...)``); they ask the declarations."""
    import re
    from pathlib import Path

    from ggpipe.speculation.proposers.base import REGISTRY

    names = "|".join(sorted(set(MODES) | set(REGISTRY)))
    quoted = rf"[\"']({names})[\"']"
    compare = re.compile(rf"(==|!=|\bin\b)\s*[(\[{{]?\s*{quoted}|{quoted}\s*(==|!=|\bin\b)|{quoted}\s*,\s*{quoted}\s*[)\]}}]\s*:?$")
    root = Path(__file__).resolve().parents[1] / "ggpipe"
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in sorted(root.rglob("*.py"))
             if p.relative_to(root).parts[0] not in ("decoding", "speculation")
             for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
    assert not found, "\n".join(found)
