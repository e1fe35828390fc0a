"""Are a batch's rows bit-identical to single-token rows? Measured, once per
model, llama.cpp build and setting, and remembered.

A speculative mode verifies drafted tokens in a batch; iterative decoding
(and single-node llama.cpp) computes each token alone. Greedy speculation
is lossless either way (every accepted token is the target's argmax on its
verified row), but it gives *the same tokens as iterative decoding in every
run* only where the verified row's logits equal the single-token row's bit
for bit. Whether they do depends on the kernels: llamafile's sgemm (llama.cpp's
default build) declines one-column products, so F16/F32 weights use another
kernel for a lone token than inside a batch; repacked Q4_0/Q8_0 weights use a
GEMM kernel for groups of 4 rows and the GEMV kernel for the rest; Q4_1 runs
``ggml_vec_dot`` either way (NOTES on llama.cpp's numerics).

:func:`probe` measures it on the model itself: after a prompt, 5 tokens
decoded one by one (``llama_decode`` of one token each), then the same 5
tokens decoded again as one batch at the same positions and cells; it
compares the 5 rows of logits bit for bit, after a short prompt (about 40
tokens) and after a longer one (about 300): attention's own products take
llamafile's sgemm only from some context length on. :func:`batch_rows_exact` caches
the answer beside the model's other remembered facts (ggpipe.models.cache),
keyed by the llama.cpp libraries loaded and the settings that choose kernels.
It probes in a child process (:func:`probe_in_child`): the model the probe
loads, its KV cache, llama.cpp's log lines and a crash stay out of the
rank that asked, whose peak memory and log report only its own work.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pathlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggpipe.models.cache import remembered
from ggpipe.runtime import kernels
from ggpipe.runtime import llama as _llama

PROBE_TEXT = ("The three laws of thermodynamics are the rules that every engine, refrigerator and living cell obeys. "
              "They were found in the nineteenth century by engineers who wanted better steam engines. ")
PROBE_CONTEXTS = (1, 8)  # the probe text repeated: about 40 and about 300 tokens of context before the rows
PROBE_VERSION = 2  # part of the cache key: a changed probe measures again
N_ROWS = 5  # one more than the repacked GEMM's group of 4: both of its kernels are in the batch


@dataclass(frozen=True)
class RowSetting:
    """What chooses the kernels of a probe: threads, flash attention
    (``off``/``on``/``auto``), KV cache types (llama.cpp's names), and
    whether the extra buffer types are on (:func:`ggpipe.runtime.kernels.use_extra_bufts`)."""

    n_threads: int = 1
    flash_attn: str = "off"
    type_k: str = "f16"
    type_v: str = "f16"
    extra_bufts: bool = True


def _build_id() -> str:
    """A short hash of the llama.cpp libraries this process loaded (paths,
    sizes, modification times) and of whether llamafile's sgemm is in."""
    _llama.lib()
    import llama_cpp._ggml as ggml_mod  # noqa: PLC0415

    libdir = pathlib.Path(ggml_mod.libggml_base_path)
    facts = [str(_llama.llamafile_sgemm()), repr(kernels.LEFT_OUT)]
    for f in sorted(libdir.glob("lib*.so*")):
        st = f.stat()
        facts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(facts).encode()).hexdigest()[:16]


def _decode(L, ctx, batch, tokens: list[int], pos0: int, n_vocab: int, every_row: bool = True) -> np.ndarray:
    """Decode ``tokens`` at positions pos0.. of sequence 0; float32 logits
    (n, n_vocab) of every row, or (1, n_vocab) of the last one."""
    n = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i] = t
        batch.pos[i] = pos0 + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = 1 if every_row or i == n - 1 else 0
    batch.n_tokens = n
    rc = L.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc} in the row probe")
    if not every_row:
        return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(1, n_vocab)).copy()
    return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, n_vocab)).copy()


def probe(model_path: str | Path, setting: RowSetting = RowSetting()) -> dict:
    """Measure whether batch rows equal single-token rows for this model.

    Loads the whole model (mmap), decodes :data:`PROBE_TEXT`, then
    :data:`N_ROWS` greedy tokens one by one, removes their cells
    (``llama_memory_seq_rm``) and decodes them again as one batch.

    Returns:
        {"batch_rows_exact": bool, "max_abs_diff": float (logit units),
        "rows": int}.

    Raises:
        RuntimeError: llama.cpp cannot load the model or decode.
    """
    L = _llama.lib()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = kernels.use_extra_bufts(setting.extra_bufts)
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    ctx = None
    batch = None
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx = 1024
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = setting.n_threads
        cp.flash_attn_type = _llama.flash_attn_type(setting.flash_attn)
        cp.type_k, cp.type_v = _llama.kv_cache_type(setting.type_k), _llama.kv_cache_type(setting.type_v)
        cp.no_perf = True
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {model_path}")
        vocab = L.llama_model_get_vocab(model)
        n_vocab = int(L.llama_vocab_n_tokens(vocab))
        batch = L.llama_batch_init(512, 0, 1)
        mem = L.llama_get_memory(ctx)
        diff, exact = 0.0, True
        for reps in PROBE_CONTEXTS:
            data = (PROBE_TEXT * reps).encode()
            buf = (ctypes.c_int32 * (len(data) + 16))()
            n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
            prompt = list(buf[:min(n, 400)]) if n >= 2 else [i % n_vocab for i in range(1, 9 * reps)]
            L.llama_memory_clear(mem, True)
            last = _decode(L, ctx, batch, prompt, 0, n_vocab, every_row=False)[0]
            p0 = len(prompt)
            toks, single = [], []
            for i in range(N_ROWS):
                toks.append(int(np.argmax(last)))
                last = _decode(L, ctx, batch, [toks[-1]], p0 + i, n_vocab)[0]
                single.append(last)
            L.llama_memory_seq_rm(mem, 0, p0, -1)
            rows = _decode(L, ctx, batch, toks, p0, n_vocab)
            single = np.stack(single)
            diff = max(diff, float(np.max(np.abs(rows.astype(np.float64) - single.astype(np.float64)))))
            exact = exact and bool(np.array_equal(rows.view(np.uint32), single.view(np.uint32)))
        return {"batch_rows_exact": exact, "max_abs_diff": diff, "rows": N_ROWS}
    finally:
        if batch is not None:
            L.llama_batch_free(batch)
        if ctx is not None:
            L.llama_free(ctx)
        L.llama_model_free(model)


#: Seconds a child probe may take: loading the model (or the stage's slice) and
#: decoding about 350 tokens with it.
CHILD_TIMEOUT = 1800.0
#: Launcher variables the child does not inherit: it is no MPI rank.
_RANK_ENV = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")


def probe_in_child(model_path: str | Path, setting: RowSetting = RowSetting(),
                   timeout: float = CHILD_TIMEOUT) -> dict:
    """:func:`probe` in a fresh Python process (``python -m
    ggpipe.models.row_probe``), so that its model load, KV cache and log
    stay out of this process; same return value. The child is started
    the way ggpipe starts its children (ggpipe.child_process).

    Raises:
        RuntimeError: the child failed, crashed or ran past ``timeout``
            seconds (the message carries the last line it printed).
    """
    from ggpipe.child_process import child_env, python_command  # noqa: PLC0415

    env = {k: v for k, v in child_env().items() if not k.startswith(_RANK_ENV)}
    cmd = [*python_command(), "-m", __name__, str(model_path), json.dumps(setting.__dict__)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the row probe of {model_path} took more than {timeout:.0f} s") from None
    lines = p.stdout.strip().splitlines()
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
    raise RuntimeError(f"the row probe of {model_path} failed: {why}")


def describe_rows(model_path: str | Path) -> str:
    """One line for ``ggpipe models info``: whether this build's batch rows
    equal lone-token rows for the model (1 thread, flash attention off, f16
    KV, repacking on: ggpipe's defaults), and with ``--exact``'s settings
    where the build allows it."""
    try:
        r = batch_rows_exact(model_path)
    except RuntimeError as e:
        return f"not measured ({e})"
    if r["batch_rows_exact"]:
        return "bit-identical to lone-token rows: speculation gives iterative's tokens in every run"
    line = (f"differ from lone-token rows by up to {r['max_abs_diff']:.3g} in the logits: speculation is lossless "
            f"(the target's argmax) but may differ from iterative at near-ties")
    if _llama.llamafile_sgemm():
        return line + "; --exact needs the build without llamafile's sgemm"
    ex = batch_rows_exact(model_path, RowSetting(extra_bufts=False))
    return line + ("; bit-identical with --exact" if ex["batch_rows_exact"] else "; also with --exact")


def batch_rows_exact(model_path: str | Path, setting: RowSetting = RowSetting()) -> dict:
    """:func:`probe`'s answer, computed once per (model file, llama.cpp
    build, setting) and remembered in ggpipe's cache (a cache that cannot
    be written means probing again, never an error).

    Raises:
        RuntimeError: as :func:`probe`.
    """
    key = hashlib.sha256(json.dumps([PROBE_VERSION, _build_id(), setting.__dict__], sort_keys=True).encode()
                         ).hexdigest()[:16]
    return remembered(Path(os.path.realpath(model_path)), f"rows-{key}", lambda: probe_in_child(model_path, setting),
                      valid=lambda v: isinstance(v, dict) and "batch_rows_exact" in v, strict=False)


def _main(argv: list[str]) -> int:
    """``python -P -m ggpipe.models.row_probe MODEL SETTING_JSON``: print
    :func:`probe`'s answer as one JSON line (:func:`probe_in_child`)."""
    try:
        out = probe(argv[0], RowSetting(**json.loads(argv[1])))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
