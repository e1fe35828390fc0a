"""A stage that fails or computes non-finite values ends the job at once with
one line naming the rank, its host and its layers (docs/ERRORS.md, "Ranks
that fail").

* The head's own stage runs on an executor thread in the asynchronous modes
  and under ``--parallel``: an error there used to leave every wait to run
  into its time-out ("no rank answered") and, in ``serve``, a dead thread
  behind a server that said it was healthy. The fault is injected with
  ``GGPIPE_FAULT`` (ggpipe/runtime/faults.py) the way llama.cpp reports a
  full KV cache.
* Damaged weights (8 MB of a GGUF overwritten with 0xFF: NaN) used to give a
  traceback, "internal error on rank 1", or empty output and exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

from conftest import ggpipe_cmd, run_ggpipe, stderr_lines
from ggpipe.errors import ConfigError
from ggpipe.runtime import faults

pytestmark = [pytest.mark.mpi, pytest.mark.full]


def test_fault_spec_parsing():
    assert faults.planned(1, True, {"GGPIPE_FAULT": "1:kvfull:3"}).at == 3
    assert faults.planned(0, True, {"GGPIPE_FAULT": "1:kvfull:3"}) is None
    assert faults.planned(1, False, {"GGPIPE_FAULT": "1:kvfull:3"}) is None  # draft stages: never
    assert faults.planned(1, True, {}) is None
    for bad in ("x", "1:oops:3", "1:nan:0", "1:nan"):
        with pytest.raises(ConfigError, match="GGPIPE_FAULT"):
            faults.planned(1, True, {"GGPIPE_FAULT": bad})


def _error_lines(p) -> list[str]:
    return [ln for ln in stderr_lines(p.stderr) if ln.startswith("ggpipe: error")]


@pytest.mark.parametrize("mode,extra", [
    ("iterative", []),                                   # the head's stage on the main thread
    ("pipeinfer", ["-md", "{draft}"]),                   # on its executor thread
])
def test_head_stage_error_ends_the_job_at_once(smollm2, mode, extra):
    extra = [str(smollm2) if a == "{draft}" else a for a in extra]
    args = ["generate", "-m", str(smollm2), "-p", "The capital of France is", "-n", "24", "--mode", mode,
            "--timeout", "60", *extra]
    t0 = time.monotonic()
    p = run_ggpipe(args, ranks=2, timeout=120, env={"GGPIPE_FAULT": "0:kvfull:4"})
    took = time.monotonic() - t0
    assert p.returncode != 0
    lines = _error_lines(p)
    assert len(lines) == 1, p.stderr[-3000:]
    assert "rank 0 (" in lines[0] and "target layers 0-" in lines[0], lines[0]
    assert "the KV cache is full" in lines[0] and "injected" in lines[0], lines[0]
    assert "no rank answered" not in p.stderr and "Traceback" not in p.stderr
    assert took < 45, f"the error took {took:.0f} s to surface (the wait's time-out is 60 s)"


def _get(url: str, timeout: float = 10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _post(url: str, body: dict, timeout: float = 60):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.mark.parametrize("parallel", ["1", "2"])
def test_serve_head_stage_error_is_not_a_healthy_server(smollm2, tmp_path, parallel):
    """The request that meets the failure gets an error, and the job ends with
    the named line: no server that says "ok" and fails every later request."""
    extra = ["--mode", "pipeinfer", "-md", str(smollm2)] if parallel == "1" else ["--parallel", parallel]
    env = dict(os.environ, GGPIPE_FAULT="0:kvfull:6", PYTHONUNBUFFERED="1")
    p = subprocess.Popen(ggpipe_cmd(["serve", "-m", str(smollm2), "--port", "0", "--timeout", "60", *extra], 2),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        line = p.stdout.readline()
        assert "listening on" in line, line + p.stderr.read()
        base = line.split("listening on ")[1].split()[0].removesuffix("/v1")
        assert _get(base + "/health")[0] == 200
        codes = []
        t0 = time.monotonic()
        for _ in range(3):
            code, _body = _post(base + "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 16})
            codes.append(code)
            if code != 200:
                break
        assert codes[-1] >= 500, codes
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 50
        assert p.returncode != 0
        lines = [ln for ln in stderr_lines(err) if ln.startswith("ggpipe: error")]
        assert len(lines) == 1 and "the KV cache is full" in lines[0] and "rank 0 (" in lines[0], err[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture(scope="module")
def damaged(smollm2, tmp_path_factory):
    """smollm2 with 8 MB in the middle of its tensor data overwritten by 0xFF
    (NaN in float16/quantized scales), as a bad copy gives."""
    path = tmp_path_factory.mktemp("damaged") / "damaged.gguf"
    shutil.copy(smollm2, path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\xff" * (8 << 20))
    return path


@pytest.mark.parametrize("ranks,extra", [
    (None, []),
    (2, []),
    (2, ["--temp", "0.8", "--seed", "3"]),
    (2, ["--mode", "speculative", "-md", "{good}"]),
    (2, ["--mode", "pipeinfer", "-md", "{good}"]),
    (2, ["--mode", "pipedec", "-md", "{good}"]),
    (3, []),
])
def test_damaged_weights_named_in_one_line(damaged, smollm2, ranks, extra):
    extra = [str(smollm2) if a == "{good}" else a for a in extra]
    p = run_ggpipe(["generate", "-m", str(damaged), "-p", "hello there", "-n", "8", *extra], ranks=ranks, timeout=180)
    assert p.returncode != 0, (p.stdout, p.stderr[-2000:])
    lines = _error_lines(p)
    assert len(lines) == 1, p.stderr[-3000:]
    assert "non-finite values (NaN or inf)" in lines[0] and "of damaged.gguf" in lines[0], lines[0]
    assert "Traceback" not in p.stderr
    if ranks:
        assert "target layers" in lines[0]


def test_nan_hidden_states_named_on_the_first_stage(smollm2):
    """Non-finite hidden states (not only logits) are caught by the stage
    that made them, not a later one."""
    p = run_ggpipe(["generate", "-m", str(smollm2), "-p", "hello there", "-n", "8"], ranks=3, timeout=180,
                   env={"GGPIPE_FAULT": "1:nan:2"})
    assert p.returncode != 0
    lines = _error_lines(p)
    assert len(lines) == 1, p.stderr[-3000:]
    assert "hidden states of rank 1 (" in lines[0] and "target layers 15-28" in lines[0], lines[0]  # the default split: 15, 14, 1 + the LM head
