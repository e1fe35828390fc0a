"""Iterative mode: one token per pass through the target pipeline, greedy or
sampled — the baseline every other mode is measured against. Its prompt
processing (:meth:`Pipeline.prefill <ggpipe.pipeline.driver.Pipeline.prefill>`)
is the one every mode shares.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ggpipe.metrics import GenerationClock
from ggpipe.pipeline.driver import Pipeline
from ggpipe.sampling import Sampler


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

    def reset(self) -> None:
        """The KV cache was cleared (nothing is cached here)."""

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
        self.pipe.reply_k = sampler.params.reply_k()  # greedy reads the argmax, top-k sampling the top k
        logits = self.pipe.prefill(prompt, start_pos, self.n_ubatch)
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
            self.pipe.decode([tok], pos)
            pos += 1
            logits = self.pipe.wait().logits[0]
            passes += 1
        clock.finish()
        self.stats = {"target_passes": passes, "accepted_per_pass": 1.0 if passes else None}
        return out
