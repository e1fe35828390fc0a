"""Single-node llama.cpp baseline: llama-cpp-python's low-level API, whole
model, one context, no ggpipe code.

The prompt is decoded in one batch, then one token per ``llama_decode``;
greedy = argmax of the logits. This is the reference the exactness tests
compare every mode and split with, and the baseline of the benchmarks.
``use_extra_bufts=False`` only avoids the AMX crash on multi-token batches of
Q4_1 models (NOTES-llamacpp); flash attention is off, as in
llama-cpp-python's ``Llama`` default (and in ggpipe's stages).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class BaselineResult:
    """tokens: generated ids (end-of-generation token included if hit);
    prompt_s: prompt decode time (s); gen_s: time from the end of prompt
    processing to the last token (s); tokens_per_s: generated tokens after
    the prompt's own token / gen_s (PipeInfer V.A, as ggpipe's metrics)."""

    tokens: list[int]
    n_prompt: int
    prompt_s: float
    gen_s: float

    @property
    def tokens_per_s(self) -> float | None:
        n = len(self.tokens) - 1
        return n / self.gen_s if n > 0 and self.gen_s > 0 else None


def greedy(model_path: str | Path, prompt: str, n_predict: int, n_threads: int = 1, n_ctx: int = 2048,
           ignore_eos: bool = False) -> BaselineResult:
    """Greedy generation of up to ``n_predict`` tokens after ``prompt``
    (tokenized with BOS per the model and special tokens parsed, as ggpipe)."""
    from ggpipe.runtime.llama import lib

    L = lib()
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = False
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    data = prompt.encode()
    buf = (ctypes.c_int32 * (len(data) + 16))()
    n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    out: list[int] = []
    try:
        t0 = time.perf_counter()
        if L.llama_decode(ctx, L.llama_batch_get_one(buf, n)) != 0:
            raise RuntimeError("prompt decode failed")
        one = (ctypes.c_int32 * 1)()
        t_prompt = time.perf_counter()
        while True:
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) >= n_predict or (not ignore_eos and L.llama_vocab_is_eog(vocab, tok)):
                break
            one[0] = tok
            if L.llama_decode(ctx, L.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("decode failed")
        t_end = time.perf_counter()
        return BaselineResult(out, n, t_prompt - t0, t_end - t_prompt)
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
