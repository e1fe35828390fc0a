"""A lost rank costs a supervised batch job a pause, not an error: ``ggpipe
batch --ranks 3`` (no mpiexec; ggpipe/frontends/supervisor.py) with a
rank killed (SIGKILL, the head's too) or stopped (SIGSTOP) while requests
are in flight ends with every record written once, each greedy one's tokens
single-node llama.cpp's (bit for bit where the build's batch rows are exact,
else up to near-ties, as every batched run: tests/conftest.py
assert_greedy), and nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT, assert_greedy, end_job, wait_for_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.full]

PROMPTS = ["What is MPI?", "Write a haiku about pipelines.", "Explain what a KV cache is.",
           "List three uses of speculative decoding.", "Why do CPUs have caches?", "What is a Beowulf cluster?",
           "Name the planets.", "How does TCP retransmit?"]
N = 40


def _job_args(inp, out, model) -> list[str]:
    return ["batch", str(inp), "-o", str(out), "-m", str(model), "-n", str(N), "--parallel", "4", "-t", "1",
            "--no-progress", "--liveness-timeout", "2"]


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _start_until_written(args: list[str], out, n: int) -> subprocess.Popen:
    """Start ``ggpipe ARGS`` (its own session); return once ``out`` holds ``n``
    records (or the job ended, or 120 s passed)."""
    p = subprocess.Popen([sys.executable, "-m", "ggpipe", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        if out.exists() and out.read_text(encoding="utf-8").count("\n") >= n:
            break
        time.sleep(0.01)
    return p


@pytest.fixture
def requests(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.append({"id": "sampled", "prompt": "Tell me a story", "temperature": 0.8, "seed": 5})
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return inp


@pytest.mark.parametrize("rank,sig", [(1, signal.SIGKILL), (2, signal.SIGSTOP), (0, signal.SIGKILL)],
                         ids=["rank1-killed", "rank2-stopped", "head-killed"])
def test_a_lost_rank_costs_a_pause_not_an_error(tmp_path, smollm2, requests, rank, sig):
    inp = requests
    out = tmp_path / "out.jsonl"
    p = _start_until_written(_job_args(inp, out, smollm2) + ["--ranks", "3"], out, 2)
    seen: list[psutil.Process] = []
    try:
        assert p.poll() is None, p.communicate()[1][-2000:]
        procs = wait_for_ranks(p.pid, 3)
        seen = psutil.Process(p.pid).children(recursive=True)
        procs[rank].send_signal(sig)   # requests are in flight: some written, the others running or queued
        _, err = p.communicate(timeout=180)
    finally:
        end_job(p, seen)
    assert p.returncode == 0, err[-3000:]
    records = {r["id"]: r for r in _records(out)}
    assert len(records) == len(PROMPTS) + 1 == len(_records(out)), err[-2000:]   # every request, once
    for i, prompt in enumerate(PROMPTS):
        assert_greedy(records[i]["tokens"], smollm2, prompt, N, msg=prompt)
    assert records["sampled"]["finish_reason"] in ("stop", "length")
    who = "the head, rank 0" if rank == 0 else f"rank {rank}"
    assert f"ggpipe: {who} ({os.uname().nodename}) was lost; starting the job again on 3 ranks" in err, err[-2000:]
    assert "ggpipe: back " in err and "target layers" in err, err[-2000:]
    time.sleep(0.5)
    left = [c.pid for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, (left, err[-2000:])


def test_the_job_ends_with_its_supervisor(tmp_path, smollm2, requests):
    """kill -9 of the supervisor: its job gets SIGTERM (the launcher's
    parent-death signal) and stops as after Ctrl-C; the records written stay,
    and the same command finishes the rest."""
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "ggpipe", *_job_args(requests, out, smollm2), "--ranks", "2"]
    p = _start_until_written(cmd[3:], out, 1)
    seen: list[psutil.Process] = []
    try:
        wait_for_ranks(p.pid, 2)
        seen = psutil.Process(p.pid).children(recursive=True)
        p.kill()
        p.communicate(timeout=30)
        gone_by = time.monotonic() + 30
        while time.monotonic() < gone_by and any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in seen):
            time.sleep(0.1)
        left = [c.pid for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not left, left
    finally:
        end_job(p, seen)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert len(_records(out)) == len(PROMPTS) + 1
