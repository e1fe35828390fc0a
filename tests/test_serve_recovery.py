"""A lost rank costs ``ggpipe serve --ranks 3`` (no mpiexec; the front end
of ggpipe/frontends/serve/front.py) a pause, not an error: streaming and
non-streaming clients in flight when rank 1 is killed all get whole answers
(a stream goes on where it stopped), ``/health`` says ``recovering``
meanwhile, ``/metrics`` counts the recovery, and SIGTERM still ends the
server cleanly. A job's server goes on with a reply another job began
(ggpipe/frontends/serve/resume.py): prefilled prompt and tokens, the rest of
the text, and the request's bad inputs refused."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from tests.conftest import ROOT, assert_greedy, end_job, ggpipe_cmd, rows_exact, wait_for_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.full]

N = 48
STREAMED = ["The three laws of thermodynamics are", "A Beowulf cluster is"]
WHOLE = ["The capital of France is", "MPI stands for"]


def _start(cmd: list[str], env: dict) -> tuple[subprocess.Popen, list[str]]:
    """A server started with ``cmd`` (its own session; ``env`` added to
    ours), and the list its stderr's lines are read into."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", **env), start_new_session=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    return p, err


def _listening(p: subprocess.Popen, err: list[str]) -> str:
    """The server's base URL, from its "listening on" line (within 180 s)."""
    line, deadline = "", time.monotonic() + 180
    while "listening on" not in line:
        line = p.stdout.readline()
        assert (line or p.poll() is None) and time.monotonic() < deadline, "".join(err)[-3000:]
    return "http://127.0.0.1:" + re.search(r":(\d+)/v1", line).group(1)


def _stream(url: str, prompt: str, got: dict) -> None:
    text, events, reason = "", [], None
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": prompt, "max_tokens": N, "stream": True},
                      timeout=300) as r:
        got[prompt + ":status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            events.append(obj)
            if "error" in obj:
                continue
            text += obj["choices"][0]["text"]
            reason = obj["choices"][0]["finish_reason"] or reason
            got[prompt + ":chunks"] = got.get(prompt + ":chunks", 0) + 1
    got[prompt] = (text, reason, [e for e in events if "error" in e], {e.get("id") for e in events})


def _whole(url: str, prompt: str, got: dict) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": N}, timeout=300)
    got[prompt] = (r.status_code, r.json())


def test_a_lost_rank_is_a_pause_for_every_client(smollm2):
    cmd = [sys.executable, "-m", "ggpipe", "serve", "--ranks", "3", "-m", str(smollm2), "--parallel", "2", "-t", "1",
           "--port", "0", "--liveness-timeout", "2"]
    p, err = _start(cmd, {})
    seen: list[psutil.Process] = []
    try:
        url = _listening(p, err)
        got: dict = {}
        clients = [threading.Thread(target=_stream, args=(url, q, got)) for q in STREAMED] + \
                  [threading.Thread(target=_whole, args=(url, q, got)) for q in WHOLE]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 120
        while got.get(STREAMED[0] + ":chunks", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        procs = wait_for_ranks(p.pid, 3)
        seen = psutil.Process(p.pid).children(recursive=True)
        procs[1].send_signal(signal.SIGKILL)   # streams half sent, the other requests running or queued
        health = set()
        while any(c.is_alive() for c in clients) and time.monotonic() < deadline + 120:
            try:
                health.add(httpx.get(url + "/health", timeout=5).json().get("status"))
            except httpx.HTTPError:
                health.add("unreachable")
            time.sleep(0.05)
        for c in clients:
            c.join(60)
        assert "recovering" in health and "unreachable" not in health, health
        for q in WHOLE:
            status, body = got[q]
            assert status == 200, body
            assert_greedy(body["ggpipe"]["tokens"], smollm2, q, N, msg=q)
        for q in STREAMED:
            text, reason, errors, ids = got[q]
            assert not errors and reason in ("stop", "length") and len(ids) == 1, (errors, reason, ids)
            alone = httpx.post(url + "/v1/completions", json={"prompt": q, "max_tokens": N}, timeout=300).json()
            assert_greedy(alone["ggpipe"]["tokens"], smollm2, q, N, msg=q)
            if rows_exact(smollm2):
                assert text == alone["choices"][0]["text"]
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert re.search(r"^ggpipe_recoveries_total 1\.0$", metrics, re.M), metrics[-2000:]
        assert float(re.search(r"^ggpipe_requests_resumed_total (\S+)$", metrics, re.M).group(1)) >= 2
        assert float(re.search(r"^ggpipe_seconds_without_service_total (\S+)$", metrics, re.M).group(1)) > 0
        assert "ggpipe: rank 1 (" in "".join(err) and "starting the job again on 3 ranks" in "".join(err)
        seen = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(90) == 0, "".join(err)[-3000:]
    finally:
        end_job(p, seen)
    time.sleep(0.5)
    left = [c.pid for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left and "Traceback" not in "".join(err), (left, "".join(err)[-3000:])


def _events(url: str, body: dict, key: str | None) -> tuple[int, list[dict]]:
    """A streamed completion's status and data events (``[DONE]`` left out)."""
    headers = {"x-ggpipe-front": key} if key else {}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(r.read())]
        return 200, [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_a_job_goes_on_with_a_reply_another_job_began(smollm2):
    key, n, prompt = "front-key", 32, STREAMED[0]
    p, err = _start(ggpipe_cmd(["serve", "-m", str(smollm2), "--parallel", "2", "-t", "1", "--port", "0"], 2),
                    {"GGPIPE_FRONT_KEY": key})
    seen: list[psutil.Process] = []
    try:
        url = _listening(p, err)
        seen = psutil.Process(p.pid).children(recursive=True)
        body = {"prompt": prompt, "max_tokens": n, "stream": True}
        status, whole = _events(url, body, key)
        chunks = [e for e in whole if e["choices"] and e["choices"][0]["text"]]
        text = "".join(e["choices"][0]["text"] for e in chunks)
        tokens = [t for e in whole for t in e.get("ggpipe_tokens", [])]
        assert status == 200 and len(chunks) > 4 and len(tokens) == n, whole
        assert _events(url, body, None)[1][0].keys() == {"id", "object", "created", "model", "choices"}
        # a job lost after the 4th chunk: the tokens and text sent so far
        begun = [t for e in chunks[:4] for t in e["ggpipe_tokens"]]
        sent = len("".join(e["choices"][0]["text"] for e in chunks[:4]))
        status, rest = _events(url, {**body, "ggpipe_resume": {"tokens": begun, "sent": sent}}, key)
        more = [t for e in rest for t in e.get("ggpipe_tokens", [])]
        assert status == 200 and rest[-1]["choices"][0]["finish_reason"] == "length", rest
        assert_greedy(begun + more, smollm2, prompt, n, msg="resumed")
        if rows_exact(smollm2):
            assert text[:sent] + "".join(e["choices"][0]["text"] for e in rest) == text and begun + more == tokens
        # seeded sampling: the keyed noise goes on at the output index where the other job stopped
        sampled = {**body, "temperature": 0.9, "seed": 7}
        status, whole_s = _events(url, sampled, key)
        chunks_s = [e for e in whole_s if e["choices"] and e["choices"][0]["text"]]
        text_s = "".join(e["choices"][0]["text"] for e in chunks_s)
        begun_s = [t for e in chunks_s[:4] for t in e["ggpipe_tokens"]]
        sent_s = len("".join(e["choices"][0]["text"] for e in chunks_s[:4]))
        status, rest_s = _events(url, {**sampled, "ggpipe_resume": {"tokens": begun_s, "sent": sent_s}}, key)
        assert status == 200 and rest_s[-1]["choices"][0]["finish_reason"] in ("stop", "length"), rest_s
        if rows_exact(smollm2):
            assert text_s[:sent_s] + "".join(e["choices"][0]["text"] for e in rest_s) == text_s
        # a reply that had ended: the text not yet sent, at once
        status, last = _events(url, {**body, "ggpipe_resume": {"tokens": tokens, "sent": sent}}, key)
        assert "".join(e["choices"][0]["text"] for e in last) == text[sent:]
        assert last[-1]["choices"][0]["finish_reason"] == "length"
        # what the front end could get wrong is refused, with the reason
        for bad, code, words in [
                ({**body, "ggpipe_resume": {"tokens": tokens + [1], "sent": 0}}, 200, "more than its max_tokens 32"),
                ({**body, "ggpipe_resume": {"tokens": begun, "sent": 10 ** 6}}, 200, "characters were sent"),
                ({**body, "ggpipe_resume": {"tokens": [10 ** 7], "sent": 0}}, 400, "outside the vocabulary"),
                ({**body, "stream": False, "ggpipe_resume": {"tokens": begun, "sent": 0}}, 400, "a streamed reply only")]:
            status, got = _events(url, bad, key)
            assert status == code and words in got[-1]["error"]["message"], got
        status, got = _events(url, {**body, "ggpipe_resume": {"tokens": begun, "sent": 0}}, "wrong-key")
        assert status == 400 and "unknown field 'ggpipe_resume'" in got[0]["error"]["message"]
        p.send_signal(signal.SIGTERM)
        p.wait(90)
    finally:
        end_job(p, seen)
    assert "Traceback" not in "".join(err), "".join(err)[-3000:]
