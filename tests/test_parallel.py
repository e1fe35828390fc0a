"""Many requests at once (``--parallel``) on real ranks and real weights:
every request's greedy tokens equal single-node llama.cpp on the same
prompt, whatever runs beside it, at 2 and 3 ranks, with requests of
different lengths joining and leaving mid-run; a seeded sampled request
gives the same tokens at any ``--parallel``; the server answers concurrent
clients exactly, keeps serving when one request cannot fit, and reports its
slots. The F16 goliath model is the sensitive case: its logits differ in
the last bits when another sequence's cells sit among a request's own
(``kv_unified``; docs/user-guide/parallel.md)."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import assert_greedy, rows_exact, run_ggpipe
from tests.test_batch import read_records, write_jsonl
from tests.test_serve import ServerProc, http

pytestmark = [pytest.mark.mpi, pytest.mark.full]  # the fast tier runs the one case marked smoke

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, a warrior named Goliath",
    "MPI stands for",
    "The three laws of thermodynamics are",
    "A haiku about autumn:",
    "In 1969, the first humans",
]
LENGTHS = [24, 40, 6, 17, 32, 3, 28]   # requests end at different times; later ones take their slots


def _batch(tmp_path, model, ranks: int, parallel: int, rows: list[dict], name: str, extra=(), env=None,
           stderr: list | None = None) -> dict:
    """The records of a ``batch`` job by id; ``stderr``: gets the job's stderr."""
    inp, out = tmp_path / f"{name}.in.jsonl", tmp_path / f"{name}.out.jsonl"
    write_jsonl(inp, rows)
    p = run_ggpipe(["batch", str(inp), "-o", str(out), "-m", str(model), "--parallel", str(parallel),
                    "--no-progress", "--ignore-eos", *extra], ranks, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    if stderr is not None:
        stderr.append(p.stderr)
    return {r["id"]: r for r in read_records(out)}


@pytest.mark.parametrize("ranks", [pytest.param(2, marks=pytest.mark.smoke), 3])  # 2: the fast tier's smoke test
def test_batch_requests_equal_single_node_at_any_parallel(tmp_path, goliath, reference, ranks):
    rows = [{"id": i, "prompt": p, "n": n} for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS))]
    got = _batch(tmp_path, goliath, ranks, 3, rows, "p3")
    assert sorted(got) == list(range(len(rows)))
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        assert_greedy(got[i]["tokens"], goliath, prompt, n, msg=(ranks, prompt))
        assert got[i]["finish_reason"] == "length"


SYSTEM = "You are a careful assistant. You answer in one short paragraph, plainly, without lists. Question: "


@pytest.mark.parametrize("ranks", [2, 3])
def test_requests_sharing_a_prefix_borrow_its_cells_and_stay_exact(tmp_path, goliath, reference, ranks):
    """A burst of requests behind one system prompt: later requests copy the
    stream of a slot that holds it (a whole-stream seq_cp on every stage)
    and decode only their own rest; each request's tokens are still
    single-node llama.cpp's."""
    rows = [{"id": i, "prompt": SYSTEM + p, "n": n} for i, (p, n) in enumerate(zip(PROMPTS[:5], LENGTHS[:5]))]
    got = _batch(tmp_path, goliath, ranks, 3, rows, "shared")
    for i, row in enumerate(rows):
        assert_greedy(got[i]["tokens"], goliath, row["prompt"], row["n"], msg=(ranks, row["prompt"]))
    assert sum(got[i]["n_reused"] >= 16 for i in got) >= 3, [got[i]["n_reused"] for i in got]


def test_seeded_sampling_is_the_same_at_any_parallel(tmp_path, goliath):
    rows = [{"id": i, "prompt": p, "n": n, "temperature": 0.8, "seed": 10 + i}
            for i, (p, n) in enumerate(zip(PROMPTS[:5], LENGTHS[:5]))]
    one = _batch(tmp_path, goliath, 2, 1, rows, "one")
    many = _batch(tmp_path, goliath, 2, 4, rows, "many")
    assert {k: v["tokens"] for k, v in many.items()} == {k: v["tokens"] for k, v in one.items()}


@pytest.mark.parametrize("ranks,mode", [(2, "speculative"), (3, "pipeinfer")])
def test_a_draft_model_drafts_for_a_request_alone_and_stays_exact(tmp_path, goliath, goliath_f32, smollm2, reference,
                                                                  ranks, mode):
    """-md with --parallel: the draft model drafts a chain below the token of
    a request that generates alone (ggpipe.decoding.parallel.chain_draft), verified
    in a micro-batch of its own (speculative), or sent as look-ahead rows
    drafted without the head waiting (pipeinfer: every drafted token then
    travels in one); beside other generating requests, plain tokens. Every
    request's tokens: single-node llama.cpp's.

    Look-ahead rows go only where the draft has drafted beyond the tokens
    sent before the target's row comes back: a draft that outruns the
    target's round trip. At one thread per rank the F16 goliath is barely
    slower per token than the Q4_1 draft (the draft then seldom gets ahead,
    and a run may send no row at all); the F32 goliath is about twice as
    slow, and rows go in every run."""
    target = goliath_f32 if mode == "pipeinfer" else goliath
    rows = [{"id": 0, "prompt": PROMPTS[0], "n": 40}, {"id": 1, "prompt": PROMPTS[3], "n": 12},
            {"id": 2, "prompt": PROMPTS[2], "n": 6}]
    # --p-accept 0: the first chain, drafted once the draft has caught up, is never cut short by the cutoff
    err: list[str] = []
    got = _batch(tmp_path, target, ranks, 3, rows, "md", ["-md", str(smollm2), "--mode", mode, "--p-accept", "0"],
                 stderr=err)
    for r in rows:
        assert_greedy(got[r["id"]]["tokens"], target, r["prompt"], r["n"], msg=r)
    m = got[0]["metrics"]      # the longest request generates alone at the end
    assert m["drafted"] > 0 and 0 < m["draft_accepted"] <= m["drafted"], m
    # what the mode becomes beside other requests is said once, at start-up
    said = [ln for ln in err[0].splitlines() if ln.startswith(f"ggpipe: --mode {mode} under --parallel")]
    assert len(said) == 1 and "--spec-type draft" in said[0], err[0][-2000:]
    assert ("only with --parallel 1" in said[0]) == (mode == "pipeinfer")


@pytest.mark.parametrize("ranks,mode,spec_type", [(3, "pipedec", "draft"), (2, "speculative", "staged"),
                                                  (3, "speculative", "vote")])
def test_every_other_mode_and_strategy_under_parallel_stays_exact(tmp_path, goliath, smollm2, reference,
                                                                   ranks, mode, spec_type):
    """The modes and strategies the tests above leave out, under --parallel
    with requests of different lengths joining and leaving: PipeDec (its
    tree runs only with --parallel 1: here, chains drafted by the draft
    model, said once at start-up), Staged SD's draft-of-draft and Minions'
    vote (draft model and n-gram lookup), each through the scheduler's
    chains for the longest request once it generates alone (chains the head
    waits for: ``--p-accept 0`` lets the first go whole). Every request's
    tokens: single-node llama.cpp's."""
    rows = [{"id": 0, "prompt": CODE, "n": 64}, {"id": 1, "prompt": PROMPTS[3], "n": 10},
            {"id": 2, "prompt": PROMPTS[0], "n": 4}, {"id": 3, "prompt": PROMPTS[5], "n": 14}]
    err: list[str] = []
    got = _batch(tmp_path, goliath, ranks, 2, rows, f"{mode}-{spec_type}",
                 ["-md", str(smollm2), "--mode", mode, "--spec-type", spec_type, "--p-accept", "0"], stderr=err)
    assert sorted(got) == [0, 1, 2, 3]
    for r in rows:
        assert_greedy(got[r["id"]]["tokens"], goliath, r["prompt"], r["n"], msg=(mode, spec_type, r))
        assert got[r["id"]]["finish_reason"] == "length"
    m = got[0]["metrics"]
    assert m["drafted"] > 0 and 0 < m["draft_accepted"] <= m["drafted"], m
    said = [ln for ln in err[0].splitlines() if ln.startswith(f"ggpipe: --mode {mode} under --parallel")]
    assert len(said) == 1 and f"--spec-type {spec_type}" in said[0], err[0][-2000:]


def test_ngram_chains_of_a_request_alone_are_exact(tmp_path, goliath, reference):
    """--spec-type ngram with --parallel: a request that generates alone sends
    n-gram chains below its tokens, verified in micro-batches of its own;
    others beside it decode plainly. Tokens: single-node llama.cpp's."""
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
    rows = [{"id": 0, "prompt": text, "n": 40}, {"id": 1, "prompt": PROMPTS[0], "n": 8}]
    got = _batch(tmp_path, goliath, 2, 2, rows, "ngram", ["--mode", "speculative", "--spec-type", "ngram"])
    assert_greedy(got[0]["tokens"], goliath, text, 40)
    assert_greedy(got[1]["tokens"], goliath, PROMPTS[0], 8)


CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def test_a_sampled_request_alone_drafts_and_gives_its_seeded_tokens(tmp_path, goliath):
    """A seeded sampled request that generates alone under --parallel gets
    n-gram chains too: each position one draw from the target's
    distribution, the drafted token kept where the draw is that token
    (ggpipe.speculation.verify, chosen candidates). Its tokens: those of the
    same request with --mode iterative at --parallel 1, where the build's
    batch rows are bit-identical to lone-token rows (the exact build with
    ``--exact``: scripts/test_exact_build.sh runs this test). Elsewhere a
    verified row's logits differ from a lone row's in the last bits
    (docs/user-guide/exactness.md), and unlike a greedy choice, which only a
    near-tie can turn, every draw can: there the tokens are the same up to
    their first difference, and as many."""
    rows = [{"id": 0, "prompt": CODE, "n": 40, "temperature": 0.5, "seed": 7},
            {"id": 1, "prompt": PROMPTS[0], "n": 6, "temperature": 0.5, "seed": 8}]
    plain = _batch(tmp_path, goliath, 2, 1, rows, "plain")
    spec = _batch(tmp_path, goliath, 2, 2, rows, "spec", ["--mode", "speculative", "--spec-type", "ngram"])
    assert sorted(spec) == sorted(plain)
    for k in plain:
        assert len(spec[k]["tokens"]) == len(plain[k]["tokens"]), k
        if rows_exact(goliath):
            assert spec[k]["tokens"] == plain[k]["tokens"], k
    m = spec[0]["metrics"]
    assert m["drafted"] > 0 and 0 < m["draft_accepted"] <= m["drafted"], m


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("prompt", [CODE, PROMPTS[2]], ids=["kept", "dropped"])
def test_pipeinfer_lookahead_rows_of_a_request_alone_are_exact(tmp_path, goliath, reference, ranks, prompt):
    """--mode pipeinfer --spec-type ngram with --parallel: once a request
    generates alone, look-ahead rows follow its row through the pipeline
    (PipeInfer's continuation: a guess of its next token with a chain below,
    placed at the next positions of its stream before its row's logits are
    back); refused ones are dropped and their cells removed. Tokens:
    single-node llama.cpp's, for it and for the requests beside it. Counted
    by hand at 2 and 3 ranks (how many follows the measured gate that lets
    chains go): the code prompt sends 7 look-ahead rows, all kept; the story
    2, both dropped."""
    rows = [{"id": 0, "prompt": prompt, "n": 48}, {"id": 1, "prompt": PROMPTS[3], "n": 10},
            {"id": 2, "prompt": PROMPTS[5], "n": 5}]
    got = _batch(tmp_path, goliath, ranks, 3, rows, f"la{ranks}", ["--mode", "pipeinfer", "--spec-type", "ngram"],
                 env={"GGPIPE_LOOKAHEAD": "on"})       # auto: off where stages share a host, as here
    for r in rows:
        assert_greedy(got[r["id"]]["tokens"], goliath, r["prompt"], r["n"], msg=r)
    assert got[0]["metrics"]["drafted"] > 0, got[0]["metrics"]


def test_serve_answers_concurrent_clients_exactly(goliath, reference):
    # --micro-batches 3: three groups of one slot in flight on 2 stages (any count gives the same tokens)
    s = ServerProc(["-m", str(goliath), "--parallel", "3", "-c", "1536", "--api-key", "k", "--micro-batches", "3"])
    try:
        def ask(i: int) -> dict:
            body = json.dumps({"prompt": PROMPTS[i], "max_tokens": LENGTHS[i], "temperature": 0,
                               "stream": i % 2 == 1, "stream_options": {"include_usage": True}})
            status, text = http(s, "POST", "/v1/completions", body, key="k")
            assert status == 200, text
            if i % 2 == 0:
                return json.loads(text)
            events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
            return {"text": "".join(e["choices"][0]["text"] for e in events if e.get("choices")),
                    "usage": events[-1]["usage"]}

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, range(len(PROMPTS))))
        for i, a in enumerate(answers):
            if i % 2 == 0:
                assert_greedy(a["ggpipe"]["tokens"], goliath, PROMPTS[i], LENGTHS[i], msg=PROMPTS[i])
            assert a["usage"]["completion_tokens"] == LENGTHS[i]
        # one slot holds 1536 / 3 = 512 cells: a request that cannot fit gets 400, the others go on
        status, text = http(s, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 600}), key="k")
        assert status == 400 and "context" in text
        status, text = http(s, "GET", "/slots", key="k")
        slots = json.loads(text)
        assert status == 200 and [x["id"] for x in slots] == [0, 1, 2] and all(x["n_ctx"] == 512 for x in slots)
        status, text = http(s, "GET", "/metrics", key="k")
        assert "ggpipe_slots 3.0" in text and "ggpipe_aggregate_tokens_per_second" in text
        assert "ggpipe_inter_token_latency_p90_seconds_count 7.0" in text
        models = json.loads(http(s, "GET", "/v1/models", key="k")[1])["data"][0]["meta"]
        assert models["parallel"] == 3 and models["n_ctx"] == 512 and "continuous batching" in models["scheduling"]
        assert models["micro_batches"] == 3
        assert urllib.request.urlopen(s.url + "/health").status == 200
    finally:
        assert s.stop() == 0


def test_a_killed_draft_rank_under_parallel_is_named_and_ends_the_job(tmp_path, goliath, smollm2):
    """--parallel 2 with the draft model on a rank of its own: kill -9 of
    that rank while a request generates alone (the draft following it).
    The draft rank's guard names it in one line within 10 s, the job ends
    non-zero, and nothing of it is left running (docs/ERRORS.md)."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from tests.conftest import ROOT, end_job, guard_line, kill_and_wait, mpiexec, wait_for_ranks

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(inp, [{"id": 0, "prompt": PROMPTS[3], "n": 4}, {"id": 1, "prompt": PROMPTS[2], "n": 1500}])
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "ggpipe", "batch", str(inp), "-o", str(out), "-m", str(goliath),
           "-md", str(smollm2), "--mode", "speculative", "--parallel", "2", "-c", "4096", "--ignore-eos",
           "--no-progress"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    procs, everything = {}, []
    try:
        procs = wait_for_ranks(p.pid, 2)
        assert sorted(procs) == [0, 1]
        end = time.monotonic() + 120
        while not (out.exists() and out.read_text().strip()) and time.monotonic() < end and p.poll() is None:
            time.sleep(0.05)   # the short request has finished: the long one generates alone, drafted for
        assert p.poll() is None and out.read_text().strip(), "the job ended or wrote nothing"
        everything = psutil.Process(p.pid).children(recursive=True)
        victim = procs[1]
        _, err, took = kill_and_wait(p, victim)
        assert p.returncode != 0, err[-2000:]
        line = guard_line(err, 1, victim.pid)
        assert line and "draft" in line.group(0), err[-2000:]
        assert took < 10, (took, err[-2000:])
        assert "Traceback" not in err
        time.sleep(1)
        alive = [c.pid for c in everything if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, (alive, err[-2000:])
        assert [r["id"] for r in read_records(out)] == [0]   # what was written stays; nothing half-written
    finally:
        end_job(p, [*procs.values(), *everything])
