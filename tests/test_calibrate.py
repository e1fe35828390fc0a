"""``ggpipe calibrate`` on real weights and real MPI ranks, and what reads its
profile: ``plan --balance`` and ``generate --split auto:PROFILE``."""

from __future__ import annotations

import json

import pytest
from conftest import generate_json, run_ggpipe

from ggpipe.sim.profile import Profile

pytestmark = pytest.mark.full


def calibrate(out, smollm2, draft=True):
    """``ggpipe calibrate`` of 2 ranks on this host into ``out``, on SmolLM2
    (as target, and as draft where ``draft``); returns ``out``."""
    extra = ["-md", str(smollm2), "--agreement-tokens", "24"] if draft else []
    p = run_ggpipe(["calibrate", "-m", str(smollm2), *extra, "--reps", "2", "-o", str(out)], ranks=2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    assert summary["output"] == str(out)
    assert "rank 0" in p.stderr and "contention" in p.stderr  # progress, on rank 0 only
    return out


@pytest.fixture(scope="module")
def profile(tmp_path_factory, smollm2):
    """A profile of 2 ranks on this host, measured on SmolLM2 (target and draft)."""
    return calibrate(tmp_path_factory.mktemp("cal") / "profile.json", smollm2)


@pytest.mark.mpi
def test_calibrate_measures_every_rank_and_link(profile):
    prof = Profile.load(profile)
    assert [h.rank for h in prof.hosts] == [0, 1]
    for h in prof.hosts:
        assert len(h.layer_s) == len(h.batch_sizes) == 6 and all(t > 0 for t in h.layer_s)
        assert h.layer_s[-1] > h.layer_s[0]           # 32 tokens cost more than one
        assert all(t > 0 for t in h.head_s) and h.head_bytes > 0
        assert h.draft_s is not None and h.draft_s[0] > h.layer_s[0]
        assert len(h.busy_slowdown) == len(h.wait_slowdown) == 1   # two ranks share this host
    assert prof.hosts[0].overhead_s > 0 and prof.hosts[0].spec_overhead_s > 0
    assert [(ln.src, ln.dst) for ln in prof.links] == [(0, 1)]
    assert 0 < prof.links[0].latency_s < 0.01
    # the file round-trips
    assert Profile.from_dict(json.loads(profile.read_text())) == prof


def simulated_and_measured(profile, smollm2, n=64):
    """Iterative decoding of ``n`` tokens at 2 ranks x 1 thread: ``simulate``'s
    tokens/s from ``profile``, and the mean of two runs of the job measured now."""
    measured = [generate_json(smollm2, "Describe a walk through a quiet forest in autumn.", n, 2,
                              ["-t", "1", "--ignore-eos"]) for _ in range(2)]
    tps = sum(m["metrics"]["tokens_per_s"] for m in measured) / len(measured)
    p = run_ggpipe(["simulate", "--profile", str(profile), "-m", str(smollm2), "--modes", "iterative", "--ranks", "2",
                    "-n", str(n), "--n-prompt", str(measured[0]["n_prompt"]), "--prompts", "1", "--json"])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])["tokens_per_s"], tps


@pytest.mark.mpi
def test_simulate_predicts_the_job_it_was_calibrated_for(profile, smollm2, tmp_path):
    """The toy cluster (2 ranks x 1 thread on this host): ``simulate``'s
    tokens/s for iterative decoding from the profile against the same job
    measured right after, within 30% (the simulator's validation on this
    machine, docs/benchmarks/simulator.md, gives a few percent; a profile
    timed from the CPU's cache, as calibration once was, predicted 50-60%
    too fast).

    A shared VM's speed can change by a third between the module's
    calibration and this job (the same job was seen at 115 and 51 tokens/s),
    so a miss is judged once more on a profile calibrated right before the
    job, as the validation does: a simulator that is wrong misses both."""
    simulated, tps = simulated_and_measured(profile, smollm2)
    if abs(simulated / tps - 1) >= 0.30:
        simulated, tps = simulated_and_measured(calibrate(tmp_path / "again.json", smollm2, draft=False), smollm2)
    assert abs(simulated / tps - 1) < 0.30, (simulated, tps)


@pytest.mark.mpi
def test_calibrate_measures_how_often_the_drafts_token_is_the_targets(profile):
    """SmolLM2 drafting for itself, teacher-forced: its most likely token is
    the target's greedy token at (nearly) every generated position (a near-tie
    may go the other way where batch rows differ from lone-token rows)."""
    a = Profile.load(profile).agreement
    assert a is not None and a["prompts"] == 6 and a["tokens"] == 24
    assert 0 < a["positions"] <= 6 * 24 and a["agreed"] <= a["positions"]
    assert a["rate"] == a["agreed"] / a["positions"] >= 0.95, a
    assert 0.1 <= a["exponent"] <= 1.0, a      # it agrees even where it is unsure: under-confident, k <= 1


def test_calibrate_refuses_to_overwrite_a_file_it_did_not_write(tmp_path, smollm2):
    victim = tmp_path / "notes.json"
    victim.write_text("my notes\n")
    p = run_ggpipe(["calibrate", "-m", str(smollm2), "-o", str(victim)])
    assert p.returncode != 0 and "not overwriting" in p.stderr
    assert victim.read_text() == "my notes\n"


@pytest.mark.mpi
def test_plan_balance_and_split_auto_use_the_profile(profile, smollm2):
    p = run_ggpipe(["plan", "-n", "2", "--balance", str(profile), "--json", "--", "generate", "-m", str(smollm2),
                    "-p", "x"])
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    split = plan["balance"]["split"]
    counts = [int(x) for x in split.split(",")]
    assert sum(counts) == 30 and len(counts) == 2
    # plan shows the split a job with --split auto:PROFILE will compute for itself
    p = run_ggpipe(["plan", "-n", "2", "--json", "--", "generate", "-m", str(smollm2), "--split", f"auto:{profile}",
                    "-p", "x"])
    assert p.returncode == 0, p.stderr
    assert [r["layers"] for r in json.loads(p.stdout)["ranks"]] == [[0, counts[0]], [counts[0], 30]]
    # the same split when the job balances itself from the profile
    out = generate_json(smollm2, "Hello", 8, 2, ["--split", f"auto:{profile}"])
    layers = [r["layers"] for r in out["ranks"]]
    assert layers == [[0, counts[0]], [counts[0], 30]]


@pytest.mark.mpi  # the profile is measured on 2 ranks
def test_simulate_reads_the_profile(profile, smollm2):
    p = run_ggpipe(["simulate", "--profile", str(profile), "-m", str(smollm2), "-md", str(smollm2),
                    "--ranks", "2", "-n", "32", "--prompts", "1"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("| shm | 2 |") == 3


@pytest.mark.mpi
def test_split_auto_without_a_profile_is_one_clear_error(smollm2):
    p = run_ggpipe(["generate", "-m", str(smollm2), "--split", "auto", "-p", "x", "-n", "2"], ranks=2, timeout=120)
    assert p.returncode != 0
    assert "--split auto needs the profile" in p.stderr and "Traceback" not in p.stderr
