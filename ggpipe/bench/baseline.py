"""Single-node llama.cpp baseline: llama-cpp-python's low-level API, whole
model, one context, no ggpipe code.

The prompt is decoded in one batch, then one token per ``llama_decode``;
greedy = argmax of the logits. This is the reference the exactness tests
compare every mode and split with, and the baseline of the benchmarks.
The weights take the same kernels as ggpipe's stages: llama.cpp's extra
buffer types (repacking) unless ``extra_bufts=False`` (``--exact``,
``--no-repack``), the AMX one left out (ggpipe.runtime.kernels); flash
attention is off, as in llama-cpp-python's ``Llama`` default (and in
ggpipe's stages).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggpipe.runtime.kernels import use_extra_bufts
from ggpipe.runtime.llama import flash_attn_type, kv_cache_type


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
        """Generated tokens after the first / ``gen_s`` (tokens/s); None with
        fewer than two tokens or no measured time."""
        n = len(self.tokens) - 1
        return n / self.gen_s if n > 0 and self.gen_s > 0 else None


def _open(L, model_path, n_ctx: int, n_threads: int, flash_attn: str = "off", type_k: str = "f16",
          type_v: str = "f16", extra_bufts: bool = True):
    mp = L.llama_model_default_params()
    mp.use_extra_bufts = use_extra_bufts(extra_bufts)
    model = L.llama_model_load_from_file(str(model_path).encode(), mp)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    cp = L.llama_context_default_params()
    cp.n_ctx = n_ctx
    cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = n_threads
    cp.flash_attn_type = flash_attn_type(flash_attn)
    cp.type_k, cp.type_v = kv_cache_type(type_k), kv_cache_type(type_v)
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError(f"llama.cpp could not create a context (flash attention {flash_attn}, "
                           f"KV types {type_k}/{type_v})")
    return model, ctx


def _tokenize(L, vocab, text: str) -> list[int]:
    data = text.encode()
    buf = (ctypes.c_int32 * (len(data) + 16))()
    n = L.llama_tokenize(vocab, data, len(data), buf, len(buf), True, True)
    return list(buf[:n])


def _decode(L, ctx, arr, n: int, what: str = "decode") -> None:
    """``llama_decode`` of the first ``n`` ids of ctypes int32 array ``arr``
    at the end of sequence 0.

    Raises:
        RuntimeError: llama.cpp refused the batch ("``what`` failed")."""
    if L.llama_decode(ctx, L.llama_batch_get_one(arr, n)) != 0:
        raise RuntimeError(f"{what} failed")


def _greedy_after(L, ctx, vocab, tokens: list[int], n_predict: int, ignore_eos: bool,
                  t_prompt: list[float] | None = None, margins: list[float] | None = None) -> list[int]:
    """Decode ``tokens`` (one batch, at the end of sequence 0), then greedy
    one token per llama_decode. Appends the time the prompt was done to
    ``t_prompt`` (perf_counter seconds), and each step's top-1 minus top-2
    logit to ``margins``, if given."""
    _decode(L, ctx, (ctypes.c_int32 * len(tokens))(*tokens), len(tokens), "prompt decode")
    if t_prompt is not None:
        t_prompt.append(time.perf_counter())
    n_vocab = L.llama_vocab_n_tokens(vocab)
    one = (ctypes.c_int32 * 1)()
    out: list[int] = []
    while True:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(logits))
        out.append(tok)
        if margins is not None:
            top2 = np.partition(logits, -2)[-2:]
            margins.append(float(top2[1] - top2[0]))
        if len(out) >= n_predict or (not ignore_eos and L.llama_vocab_is_eog(vocab, tok)):
            return out
        one[0] = tok
        _decode(L, ctx, one, 1)


def greedy(model_path: str | Path, prompt: str, n_predict: int, n_threads: int = 1, n_ctx: int = 2048,
           ignore_eos: bool = False, flash_attn: str = "off", margins: list[float] | None = None,
           type_k: str = "f16", type_v: str = "f16", extra_bufts: bool = True) -> BaselineResult:
    """Greedy generation of up to ``n_predict`` tokens after ``prompt``
    (tokenized with BOS per the model and special tokens parsed, as ggpipe);
    ``flash_attn``: "off" (the reference configuration), "on" or "auto";
    ``type_k``/``type_v``: the KV cache types (llama.cpp's ``-ctk``/``-ctv``
    names; f16, its default, is the reference configuration);
    ``extra_bufts``: llama.cpp's extra buffer types (False: ``--exact``).
    With ``margins``, appends each step's top-1 minus top-2 logit (how close
    the greedy choice was to a tie)."""
    from ggpipe.runtime.llama import lib

    L = lib()
    model, ctx = _open(L, model_path, n_ctx, n_threads, flash_attn, type_k, type_v, extra_bufts)
    vocab = L.llama_model_get_vocab(model)
    try:
        toks = _tokenize(L, vocab, prompt)
        t0 = time.perf_counter()
        t_prompt: list[float] = []
        out = _greedy_after(L, ctx, vocab, toks, n_predict, ignore_eos, t_prompt, margins)
        t_end = time.perf_counter()
        return BaselineResult(out, len(toks), t_prompt[0] - t0, t_end - t_prompt[0])
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


def forced_gaps(model_path: str | Path, prompt: str, tokens: list[int], n_threads: int = 1, n_ctx: int = 2048,
                flash_attn: str = "off", type_k: str = "f16", type_v: str = "f16",
                extra_bufts: bool = True) -> list[float]:
    """How far each of ``tokens`` was from single-node llama.cpp's greedy
    choice, with the tokens themselves as the context (teacher forcing):
    after ``prompt`` (one batch), for each token its gap below the best
    logit of its step (logit units, 0.0 where it is the argmax), then the
    token is decoded alone. A lossless greedy run has gaps of 0, or below
    the build's row difference (ggpipe.models.row_probe) at near-ties."""
    from ggpipe.runtime.llama import lib

    L = lib()
    model, ctx = _open(L, model_path, n_ctx, n_threads, flash_attn, type_k, type_v, extra_bufts)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    try:
        toks = _tokenize(L, vocab, prompt)
        _decode(L, ctx, (ctypes.c_int32 * len(toks))(*toks), len(toks), "prompt decode")
        return _forced_gaps(L, ctx, n_vocab, tokens)
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


def _forced_gaps(L, ctx, n_vocab: int, tokens: list[int], constrain=None) -> list[float]:
    """Teacher forcing after the prompt is decoded: for each of ``tokens``,
    its gap below the best logit of its step (after ``constrain``: logits ->
    (ids, logits) of the candidates kept, when given), then the token is
    decoded alone."""
    one = (ctypes.c_int32 * 1)()
    gaps = []
    for tok in tokens:
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        ids, kept = (np.arange(n_vocab), logits) if constrain is None else constrain(logits, tok)
        gaps.append(float(np.max(kept) - kept[ids == tok][0]))
        one[0] = tok
        _decode(L, ctx, one, 1)
    return gaps


def greedy_turns(model_path: str | Path, prompts: list[str], n_predict: int, n_ctx: int = 2048,
                 margins: list[list[float]] | None = None, extra_bufts: bool = True) -> list[list[int]]:
    """Greedy replies to successive prompts in one context, keeping the KV
    cache's common prefix between them (as llama-cpp-python's ``Llama`` and
    llama.cpp's server do): cells from the first differing token on are
    removed (``llama_memory_seq_rm``) and only the rest is decoded. The
    reference for multi-turn chat. Returns one token list per prompt; with
    ``margins``, appends per prompt the top-1 minus top-2 logit of each step
    (how close each greedy choice was to a tie)."""
    from ggpipe.runtime.llama import lib

    L = lib()
    model, ctx = _open(L, model_path, n_ctx, 1, extra_bufts=extra_bufts)
    vocab = L.llama_model_get_vocab(model)
    mem = L.llama_get_memory(ctx)
    kv: list[int] = []
    replies = []
    try:
        for prompt in prompts:
            toks = _tokenize(L, vocab, prompt)
            common = 0
            while common < min(len(kv), len(toks) - 1) and kv[common] == toks[common]:
                common += 1
            L.llama_memory_seq_rm(mem, -1, common, -1)
            m: list[float] = []
            out = _greedy_after(L, ctx, vocab, toks[common:], n_predict, False, margins=m)
            if margins is not None:
                margins.append(m)
            kv = toks + out[:-1]
            replies.append(out)
        return replies
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


def constrained_greedy(model_path: str | Path, prompt: str, n_predict: int, logit_bias: tuple = (),
                       repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       repeat_last_n: int = 64, forced: list[int] | None = None, n_ctx: int = 2048,
                       extra_bufts: bool = True) -> list[int] | list[float]:
    """Greedy generation through llama.cpp's own sampler chain, as
    llama-server builds it at temperature 0 for these settings
    (``common_sampler_init``: ``llama_sampler_init_logit_bias``, then
    ``llama_sampler_init_penalties``, then the argmax, ``llama_sampler_init_greedy``;
    the prompt's tokens accepted into the chain first, as llama-server's slot
    does). The reference of ggpipe's constrained greedy runs.

    ``logit_bias``: pairs (token id, bias). With ``forced`` (token ids)
    nothing is generated: each forced token is scored against the chain's
    constrained logits of its step (its gap below their maximum, logit units;
    0.0 where it is the argmax), then accepted and decoded, and the gaps are
    returned (teacher forcing, as :func:`forced_gaps`)."""
    from ggpipe.runtime.grammar import sampler_apply
    from ggpipe.runtime.llama import lib

    L = lib()
    model, ctx = _open(L, model_path, n_ctx, 1, extra_bufts=extra_bufts)
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    try:
        if logit_bias:
            arr = (L.llama_logit_bias * len(logit_bias))(*[L.llama_logit_bias(int(t), float(b)) for t, b in logit_bias])
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(n_vocab, len(logit_bias), arr))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(n_vocab, repeat_last_n, repeat_penalty,
                                                                         frequency_penalty, presence_penalty))
        toks = _tokenize(L, vocab, prompt)
        for t in toks:
            L.llama_sampler_accept(chain, t)
        _decode(L, ctx, (ctypes.c_int32 * len(toks))(*toks), len(toks), "prompt decode")
        if forced is None:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            one = (ctypes.c_int32 * 1)()
            out: list[int] = []
            while len(out) < n_predict:
                tok = int(L.llama_sampler_sample(chain, ctx, -1))   # applies the chain and accepts the token
                out.append(tok)
                if L.llama_vocab_is_eog(vocab, tok):
                    break
                one[0] = tok
                _decode(L, ctx, one, 1)
            return out

        def constrain(logits, tok):
            kept = sampler_apply(chain, logits)
            L.llama_sampler_accept(chain, int(tok))
            return kept

        return _forced_gaps(L, ctx, n_vocab, forced, constrain)
    finally:
        L.llama_sampler_free(chain)
        L.llama_free(ctx)
        L.llama_model_free(model)
