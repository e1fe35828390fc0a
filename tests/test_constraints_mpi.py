"""Constrained sampling on real ranks: penalties and a logit bias give, token
for token, what llama.cpp's own sampler chain gives (llama-server's chain at
temperature 0) in iterative mode, and stay lossless under PipeInfer; a JSON
schema holds 20 sampled replies of ``serve`` in iterative and PipeInfer
mode; ``logprobs`` and ``n`` come back in OpenAI's shapes; a ``batch``
record takes the same fields."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from ggpipe.bench import baseline
from tests.conftest import EXACT, generate_json, row_difference, run_ggpipe
from tests.test_serve import ServerProc

pytestmark = [pytest.mark.mpi, pytest.mark.full]

PROMPT = "The three laws of thermodynamics are"
N = 40
PENALTIES = dict(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.5, repeat_last_n=32)


def _flags(bias: tuple) -> list[str]:
    out = ["--repeat-penalty", "1.3", "--frequency-penalty", "0.4", "--presence-penalty", "0.5",
           "--repeat-last-n", "32"]
    for t, b in bias:
        out += ["-l", f"{t}{b:+g}"]
    return out


@pytest.fixture(scope="module")
def banned(goliath):
    """The greedy run's first token, banned with a bias of -100."""
    plain = generate_json(goliath, PROMPT, N, 2)["tokens"]
    return plain, ((plain[0], -100.0),)


def test_penalties_and_bias_equal_llama_cpps_sampler_chain(goliath, banned):
    plain, bias = banned
    got = generate_json(goliath, PROMPT, N, 2, _flags(bias))["tokens"]
    ref = baseline.constrained_greedy(goliath, PROMPT, N, logit_bias=bias, extra_bufts=not EXACT, **PENALTIES)
    assert got == ref
    assert got[0] != plain[0] and len(set(got)) > len(set(plain)) - 3   # the bias and penalties acted


def test_constrained_pipeinfer_is_lossless(goliath, smollm2, banned):
    """Every token PipeInfer decides is the constrained argmax given its own
    earlier tokens, or within twice the build's row difference of it."""
    _, bias = banned
    got = generate_json(goliath, PROMPT, N, 2, ["--mode", "pipeinfer", "-md", str(smollm2), *_flags(bias)])
    gaps = baseline.constrained_greedy(goliath, PROMPT, N, logit_bias=bias, forced=got["tokens"],
                                       extra_bufts=not EXACT, **PENALTIES)
    assert max(gaps) <= 2 * row_difference(goliath), gaps
    assert got["decoder"]["drafted"] > 0


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"},
                                           "coastal": {"type": "boolean"}},
          "required": ["city", "population", "coastal"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["iterative", "pipeinfer"])
def server(request, goliath, smollm2):
    extra = ["--mode", "pipeinfer", "-md", str(smollm2)] if request.param == "pipeinfer" else []
    s = ServerProc(["-m", str(goliath), "-n", "64", *extra])
    s.mode = request.param
    yield s
    s.stop()
    assert "Traceback" not in "".join(s.err)


def test_json_schema_holds_sampled_replies(server, whole_matrix):
    """8 seeded replies (20 with --all) at temperature 0.8, each valid under the schema."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(20 if whole_matrix else 8):
        r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Describe a city."}],
                                           max_tokens=64, temperature=0.8, seed=seed, response_format=fmt)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_logprobs_and_n(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert content and "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:   # greedy: each token the most likely (the model's own log-probabilities)
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob <= 0
    t = client.completions.create(model="any", prompt=PROMPT, max_tokens=5, temperature=0.9, seed=4, n=3, logprobs=2)
    assert [c.index for c in t.choices] == [0, 1, 2] and t.usage.completion_tokens >= 3
    assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in t.choices)
    if server.mode == "iterative":   # (a seeded speculative run repeats where batch rows are exact)
        again = client.completions.create(model="any", prompt=PROMPT, max_tokens=5, temperature=0.9, seed=4, n=3)
        assert [c.text for c in again.choices] == [c.text for c in t.choices]   # choice i: seed + i


def test_batch_records_take_the_constraint_fields(goliath, tmp_path, banned):
    _, bias = banned
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": PROMPT, "n": N, "logprobs": 1,
                               "logit_bias": {str(t): b for t, b in bias}, **PENALTIES}) + "\n"
                   + json.dumps({"id": 2, "prompt": "A city as JSON:", "n": 48, "json_schema": SCHEMA,
                                 "temperature": 0.7, "seed": 1}) + "\n", encoding="utf-8")
    p = run_ggpipe(["batch", "-m", str(goliath), str(inp), "-o", str(out)], 2)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    ref = baseline.constrained_greedy(goliath, PROMPT, N, logit_bias=bias, extra_bufts=not EXACT, **PENALTIES)
    assert recs[1]["tokens"] == ref and len(recs[1]["logprobs"]) == len(ref)
    jsonschema.validate(json.loads(recs[2]["text"]), SCHEMA)


def test_constraints_in_continuous_batching(goliath, tmp_path):
    """--parallel 2: each slot's sampler follows its own sequence (its
    grammar, its penalties), beside another slot's."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": i, "prompt": "A city as JSON:", "n": 48, "json_schema": SCHEMA, "temperature": 0.7, "seed": i}
            for i in range(3)] + [{"id": 9, "prompt": PROMPT, "n": 24, "repeat_penalty": 1.5}]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    p = run_ggpipe(["batch", "-m", str(goliath), str(inp), "-o", str(out), "--parallel", "2"], 2)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i in range(3):
        jsonschema.validate(json.loads(recs[i]["text"]), SCHEMA)
    assert recs[9]["finish_reason"] == "length"


def test_penalties_equal_llama_server(goliath, banned):
    """Against llama-server itself (the peer build of scripts/peer_llamacpp.py;
    skipped where it was not built): ``/completion`` at temperature 0 with
    the same penalties and bias returns the same token ids."""
    import importlib.util
    import socket
    import subprocess
    import time
    import urllib.request

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("peer_llamacpp", ROOT / "scripts" / "peer_llamacpp.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    server = peer.bin_path("llama-server")
    if EXACT or not server.exists():
        pytest.skip("llama-server of llama.cpp's default build is not built (python scripts/peer_llamacpp.py build)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([str(server), "-m", str(goliath), "-t", "1", "--port", str(port), "-c", "2048",
                          "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _, bias = banned
        body = json.dumps({"prompt": PROMPT, "n_predict": N, "temperature": 0, "return_tokens": True,
                           "cache_prompt": False, "logit_bias": [list(b) for b in bias], **PENALTIES}).encode()
        deadline = time.monotonic() + 120
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    theirs = json.load(r)["tokens"]
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        p.terminate()
        p.wait(30)
    ours = generate_json(goliath, PROMPT, N, 2, _flags(bias))["tokens"]
    assert ours == theirs


@pytest.mark.parametrize("mode", ["speculative", "pipedec"])
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_every_mode_under_a_json_schema(goliath, smollm2, mode, temp):
    got = generate_json(goliath, "A city as JSON:", 64, 2, ["--mode", mode, "-md", str(smollm2), "--temp", temp,
                                                           "--seed", "2", "--repeat-penalty", "1.2",
                                                           "-j", json.dumps(SCHEMA)])
    jsonschema.validate(json.loads(got["text"]), SCHEMA)


def test_generate_reports_logprobs(goliath):
    got = generate_json(goliath, PROMPT, 6, 2, ["--logprobs", "2"])
    assert [lp["token"] for lp in got["logprobs"]] == got["tokens"]
    for lp in got["logprobs"]:   # greedy: each token the most likely, by the model's own log-probabilities
        assert lp["top"][0][0] == lp["token"] and len(lp["top"]) == 2 and lp["logprob"] <= 0
