"""``ggpipe generate``: one prompt in, text streamed out on the head rank.

Every rank runs the same command; rank 0 (the head) tokenizes, drives the
chosen mode and prints, the other ranks serve their stage until the head
shuts the pipeline down.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.metrics import GenerationClock
from ggpipe.runtime.vocab import Vocab, check_prompt_fits
from ggpipe.scheduling.iterative import IterativeDecoder
from ggpipe.scheduling.speculative import SpecSettings, SpeculativeDecoder
from ggpipe.scheduling.sampling import Sampler, SamplingParams
from ggpipe.scheduling.session import ClusterConfig, Session, open_session

MODES = ("iterative", "speculative", "pipeinfer")


@dataclass
class GenerateRequest:
    prompt: str
    n_predict: int = 128
    sampling: SamplingParams = SamplingParams()
    chat: bool = False
    mode: str = "iterative"
    ignore_eos: bool = False
    spec: SpecSettings = SpecSettings()


def make_decoder(session: Session, vocab: Vocab, req: GenerateRequest):
    """The scheduling policy for ``req.mode`` on the head."""
    is_eog = (lambda t: False) if req.ignore_eos else vocab.is_eog
    mode = req.mode
    if mode == "iterative":
        return IterativeDecoder(session.pipeline, session.config.ubatch, is_eog)
    if session.draft_pipeline is None:
        raise ConfigError(f"--mode {mode} needs a draft model: give one with -md (e.g. -md smollm2-135m)")
    return SpeculativeDecoder(session.pipeline, session.draft_pipeline, req.spec, session.config.n_seq_max,
                              session.config.ubatch, is_eog, timeout_s=session.config.timeout_s)


def prompt_tokens(vocab: Vocab, req: GenerateRequest) -> np.ndarray:
    text = vocab.apply_chat_template([{"role": "user", "content": req.prompt}]) if req.chat else req.prompt
    return vocab.tokenize(text)


def generate_on_head(session: Session, req: GenerateRequest, stream=None) -> dict:
    """Run one generation on the head rank; returns the summary (tokens, text,
    metrics). Streams text to ``stream`` as tokens are accepted, if given.

    Raises:
        ConfigError: prompt + n_predict does not fit the context.
    """
    vocab = Vocab(session.stage.model, session.stage.vocab)
    tokens = prompt_tokens(vocab, req)
    check_prompt_fits(int(tokens.shape[0]), req.n_predict, session.config.ctx_size)
    sampler = Sampler(req.sampling)
    decoder = make_decoder(session, vocab, req)
    detok = vocab.detokenizer()
    pieces: list[str] = []

    def emit(toks: list[int]) -> None:
        for t in toks:
            if vocab.is_eog(t):
                continue
            s = detok.push(t)
            pieces.append(s)
            if stream is not None and s:
                stream.write(s)
                stream.flush()

    clock = GenerationClock()
    out = decoder.generate(tokens, req.n_predict, sampler, emit=emit, clock=clock)
    tail = detok.flush()
    pieces.append(tail)
    if stream is not None:
        stream.write(tail + "\n")
        stream.flush()
    return {
        "mode": req.mode,
        "model": session.model_path,
        "n_prompt": int(tokens.shape[0]),
        "tokens": [int(t) for t in out],
        "text": "".join(pieces),
        "metrics": clock.as_dict(),
        "decoder": decoder.stats,
    }


def run_generate(config: ClusterConfig, req: GenerateRequest, as_json: bool) -> int:
    """Entry point of every rank; returns the process exit code."""
    session = open_session(config, async_head=req.mode == "pipeinfer")
    try:
        if not session.is_head:
            session.serve()
            return 0
        try:
            result = generate_on_head(session, req, stream=None if as_json else sys.stdout)
        except GGPipeError as exc:
            if not exc.abort_job:  # the pipeline is still in step: stop it cleanly
                session.shutdown()
            raise
        ranks = session.shutdown()
        if as_json:
            result["ranks"] = ranks
            result["n_ranks"] = session.size
            json.dump(result, sys.stdout, indent=1)
            sys.stdout.write("\n")
        return 0
    finally:
        session.close()
