"""The draft agreement that ``calibrate -md`` measures and ``simulate`` reads
(ggpipe.service.agreement, Profile.agreement): the counting, the prompts
file, the profile field, and simulate taking the measured rate for its pair.
No MPI (the measurement on real ranks is in test_calibrate.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggpipe.errors import ConfigError
from ggpipe.service.agreement import DEFAULT_PROMPTS, agreed_positions, read_prompts
from ggpipe.sim.profile import HostProfile, LinkProfile, Profile


def test_each_generated_position_is_compared_with_the_drafts_token_before_it():
    tokens = [5, 6, 7, 8, 9, 10]       # a 2-token prompt, then 4 generated tokens
    best = np.array([0, 7, 1, 9, 10, 11])  # the draft's next token after each: right after 6, 8 and 9
    assert agreed_positions(tokens, 2, best).tolist() == [True, False, True, True]
    assert agreed_positions(tokens[:2], 2, best[:2]).tolist() == []   # nothing generated


def test_the_confidence_exponent_is_fitted_to_the_drafts_confidence_and_agreement():
    """A draft that agrees with probability q ** 0.5 at confidence q (an
    under-confident one, as SmolLM2-135M is for its self-merge) is measured
    with k near 0.5; one whose confidence is its agreement, near 1."""
    from ggpipe.service.agreement import summarize

    rng = np.random.default_rng(3)
    q = rng.uniform(0.05, 0.95, 4000)
    for k in (0.5, 1.0):
        agreed = rng.random(q.size) < q ** k
        a = summarize(agreed, q, 6, 128)
        assert a.positions == 4000 and a.agreed == int(agreed.sum()) and abs(a.rate - agreed.mean()) < 1e-12
        assert abs(a.exponent - k) < 0.1
    assert summarize(np.zeros(0, dtype=bool), np.zeros(0), 1, 8).exponent is None


def test_prompts_come_one_per_line_or_built_in(tmp_path):
    assert read_prompts(None) == DEFAULT_PROMPTS
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n  \nsecond\\nwith a break\n")
    assert read_prompts(f) == ("first prompt", "second\nwith a break")
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_prompts(f)
    f.write_text("\n \n")
    with pytest.raises(ConfigError, match="no prompt in it"):
        read_prompts(f)
    with pytest.raises(ConfigError, match="cannot read it"):
        read_prompts(tmp_path / "missing.txt")


def _profile(agreement=None, draft="smollm2-135m") -> Profile:
    node = HostProfile("node", mem_bw_Bps=100e9, flops=1e12)
    return Profile("llama2-70b:Q3_K_M", draft, [node], [LinkProfile(0, 1, 1e-5, 10e9)], agreement=agreement)


def test_the_agreement_round_trips_and_belongs_to_its_pair(tmp_path):
    a = {"rate": 0.62, "positions": 100, "agreed": 62, "prompts": 2, "tokens": 50}
    _profile(a).save(tmp_path / "p.json")
    prof = Profile.load(tmp_path / "p.json")
    assert prof.agreement == a
    assert prof.acceptance_for("llama2-70b:Q3_K_M", "smollm2-135m") == 0.62
    assert prof.acceptance_for("/models/llama2-70b:Q3_K_M.gguf", "/x/smollm2-135m.gguf") == 0.62  # by file name
    assert prof.acceptance_for("llama2-70b:Q3_K_M", "another-draft") is None
    assert prof.acceptance_for("llama2-70b:Q3_K_M", None) is None
    assert _profile(None).acceptance_for("llama2-70b:Q3_K_M", "smollm2-135m") is None
    assert prof.confidence_exponent_for("llama2-70b:Q3_K_M", "smollm2-135m") is None   # not measured by then
    _profile({**a, "exponent": 0.55}).save(tmp_path / "k.json")
    assert Profile.load(tmp_path / "k.json").confidence_exponent_for("llama2-70b:Q3_K_M", "smollm2-135m") == 0.55
    assert Profile.load(tmp_path / "k.json").confidence_exponent_for("llama2-70b:Q3_K_M", "another") is None
    for bad in ({"rate": 1.5}, {"rate": "high"}, {"positions": 3}, ["0.5"], {"rate": 0.5, "exponent": 0.0}):
        d = _profile().to_dict()
        d["agreement"] = bad
        with pytest.raises(ConfigError, match="malformed profile record"):
            Profile.from_dict(d)


def test_simulate_takes_the_measured_agreement_for_its_pair(tmp_path):
    """Without --acceptance, simulate runs the pair at the profile's measured
    rate (the same figures as --acceptance RATE); another pair gets 0.7 and a
    note saying so."""
    from ggpipe.cli.main import cli

    _profile({"rate": 0.45, "positions": 100, "agreed": 45, "prompts": 2, "tokens": 50},
             draft="tinyllama-1.1b:Q4_K_M").save(tmp_path / "p.json")
    base = ["simulate", "--profile", str(tmp_path / "p.json"), "-m", "llama2-70b:Q3_K_M", "--modes", "pipeinfer",
            "--ranks", "3", "-n", "32", "--prompts", "1", "--json"]

    def run(*more):
        r = CliRunner().invoke(cli, [*base, *more])
        assert r.exit_code == 0, r.output
        return r

    measured = run("-md", "tinyllama-1.1b:Q4_K_M")
    assert json.loads(measured.stdout) == json.loads(run("-md", "tinyllama-1.1b:Q4_K_M", "--acceptance",
                                                         "0.45").stdout)
    assert json.loads(measured.stdout) != json.loads(run("-md", "tinyllama-1.1b:Q4_K_M", "--acceptance",
                                                         "0.7").stdout)
    other = run("-md", "llama3.2-1b:Q4_K_M")
    assert "no measured acceptance for this model pair" in other.stderr and "assuming 0.7" in other.stderr
    assert "no measured acceptance" not in measured.stderr


def test_simulate_takes_the_measured_confidence_exponent_for_its_pair(tmp_path):
    """Without --confidence-exponent, simulate runs the pair with the k its
    calibration measured (the same figures as --confidence-exponent K);
    without one measured, k = 1."""
    from ggpipe.cli.main import cli

    agreement = {"rate": 0.7, "positions": 100, "agreed": 70, "prompts": 2, "tokens": 50, "exponent": 0.4}
    _profile(agreement, draft="tinyllama-1.1b:Q4_K_M").save(tmp_path / "p.json")
    base = ["simulate", "--profile", str(tmp_path / "p.json"), "-m", "llama2-70b:Q3_K_M", "-md",
            "tinyllama-1.1b:Q4_K_M", "--modes", "pipeinfer", "--ranks", "3", "-n", "32", "--prompts", "1", "--json"]

    def run(*more):
        r = CliRunner().invoke(cli, [*base, *more])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    measured = run()
    assert measured == run("--confidence-exponent", "0.4")
    assert measured != run("--confidence-exponent", "1")
