"""A lost rank costs ``ggpipe serve --ranks 3`` (no mpiexec; the front end
of ggpipe/frontends/serve/front.py) a pause, not an error: streaming and
non-streaming clients in flight when rank 1 is killed all get whole answers
(a stream goes on where it stopped), ``/health`` says ``recovering``
meanwhile, ``/metrics`` counts the recovery, and SIGTERM still ends the
server cleanly."""

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

from tests.conftest import ROOT, assert_greedy, end_job, rows_exact, wait_for_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.full]

N = 48
STREAMED = ["The three laws of thermodynamics are", "A Beowulf cluster is"]
WHOLE = ["The capital of France is", "MPI stands for"]


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
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    seen: list[psutil.Process] = []
    try:
        line, deadline = "", time.monotonic() + 180
        while "listening on" not in line:
            line = p.stdout.readline()
            assert line or p.poll() is None, "".join(err)[-3000:]
            assert time.monotonic() < deadline, "".join(err)[-3000:]
        url = "http://127.0.0.1:" + re.search(r":(\d+)/v1", line).group(1)
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
