"""Iterative mode: one token per pass through the target pipeline, greedy or
sampled — the baseline every other mode is measured against, and the
prompt-processing (prefill) step every mode shares.

Prefill sends the prompt in ubatch-sized chunks down the pipeline back to
back, so stage k works on chunk i while stage k-1 works on chunk i+1; only
the last chunk asks for logits (of its last token).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.metrics import GenerationClock
from ggpipe.scheduling.pipeline import Pipeline
from ggpipe.scheduling.runs import Run
from ggpipe.scheduling.sampling import Sampler


def submit_prompt(pipe: Pipeline, tokens, start_pos: int, n_ubatch: int, seq: int = 0,
                  want_logits: bool = True) -> int:
    """Start ``tokens`` (int32 (n,)) at positions start_pos.. of sequence
    ``seq`` as chunks of at most ``n_ubatch`` tokens, back to back; with
    ``want_logits`` the last chunk asks for logits of its last token. Returns
    the number of runs started."""
    n = len(tokens)
    for i in range(0, n, n_ubatch):
        last = i + n_ubatch >= n
        pipe.submit(Run.linear(tokens[i:i + n_ubatch], start_pos + i, seq=seq, output_last=want_logits and last))
    return -(-n // n_ubatch)


def reusable_prefix(cached: list[int], tokens: list[int], need_logits: bool = True) -> int:
    """How many leading ``tokens`` a KV cache holding ``cached`` (positions
    0..) already has, so only the rest need decoding. With ``need_logits``
    the last token never counts: its logits are not kept, so it is decoded
    again. The caller removes every cell from that position on."""
    n, limit = 0, min(len(cached), len(tokens))
    while n < limit and cached[n] == tokens[n]:
        n += 1
    return n - 1 if need_logits and n == len(tokens) else n


def prefill(pipe: Pipeline, tokens: np.ndarray, start_pos: int, n_ubatch: int, seq: int = 0) -> np.ndarray:
    """:func:`submit_prompt`, then wait; returns float32 (n_vocab,) logits of
    the last token."""
    submit_prompt(pipe, tokens, start_pos, n_ubatch, seq)
    return pipe.drain()[-1].logits[0]


class IterativeDecoder:
    """Args:
        pipe: the target pipeline.
        n_ubatch: prefill chunk size (tokens).
        is_eog: token -> end of generation?
    """

    name = "iterative"

    def __init__(self, pipe: Pipeline, n_ubatch: int, is_eog: Callable[[int], bool]):
        self.pipe = pipe
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self.stats: dict = {}

    def generate(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int = 0,
                 emit: Callable[[list[int]], bool | None] = lambda toks: None,
                 clock: GenerationClock | None = None, history: list[int] | None = None) -> list[int]:
        """Generate up to ``n_predict`` tokens after ``prompt`` (int32 (n,)),
        whose first token goes at ``start_pos`` of sequence 0 (positions
        0..start_pos-1 of sequence 0 must already hold ``history``, the
        tokens before it; only the speculative modes read them). Stops after
        an end-of-generation token (included in the result). ``emit`` is
        called with each accepted token list as soon as it is accepted; a
        true return value stops the generation there (a stop string, Ctrl-C).

        Raises:
            RankTimeoutError, ProtocolError: from the pipeline."""
        clock = clock or GenerationClock()
        clock.start()
        logits = prefill(self.pipe, prompt, start_pos, self.n_ubatch)
        clock.prompt_done()
        pos = start_pos + int(prompt.shape[0])
        out: list[int] = []
        passes = 0
        while True:
            tok = sampler.sample(logits)
            out.append(tok)
            clock.token()
            stop = emit([tok])
            if stop or len(out) >= n_predict or self.is_eog(tok):
                break
            self.pipe.submit(Run.linear([tok], pos))
            pos += 1
            logits = self.pipe.wait().logits[0]
            passes += 1
        clock.finish()
        self.stats = {"target_passes": passes, "accepted_per_pass": 1.0 if passes else None}
        return out
