"""``--mode iterative``: one token per pass through the target pipeline,
greedy or sampled: the baseline every other mode is measured against. Its
prompt processing (:meth:`Pipeline.prefill <ggpipe.pipeline.driver.Pipeline.prefill>`)
is the one every mode shares.
"""

from __future__ import annotations

import numpy as np

from ggpipe.backend import TargetBackend
from ggpipe.decoding.mode import BuildContext, Mode
from ggpipe.decoding.request import Emit, Request
from ggpipe.metrics import GenerationClock
from ggpipe.sampling import Sampler


class Iterative(Mode):
    """Args:
        pipe: the target pipeline.
        n_ubatch: prefill chunk size (tokens).
        is_eog: token -> end of generation?
    """

    name = "iterative"

    def __init__(self, pipe: TargetBackend, n_ubatch: int, is_eog):
        super().__init__()
        self.pipe = pipe
        self.n_ubatch = n_ubatch
        self.is_eog = is_eog
        self._sampler: Sampler | None = None
        self._passes = 0

    @classmethod
    def build(cls, ctx: BuildContext) -> "Iterative":
        """The iterative loop over ``ctx.target`` (draft pipelines and speculation
        settings unused)."""
        return cls(ctx.target, ctx.n_ubatch, ctx.is_eog)

    def open(self, prompt: np.ndarray, n_predict: int, sampler: Sampler, start_pos: int, emit: Emit,
             clock: GenerationClock, history: list[int]) -> Request:
        """The prompt in chunks of ``n_ubatch``, then the first token."""
        self.pipe.reply_k = sampler.params.reply_k()  # greedy reads the argmax, top-k sampling the top k
        r = self.r = Request(n_predict=n_predict, emit=emit, clock=clock, is_eog=self.is_eog,
                             context=history + [int(t) for t in prompt])
        self._sampler, self._passes = sampler, 0
        logits = self.pipe.prefill(prompt, start_pos, self.n_ubatch)
        clock.prompt_done()
        r.accept([sampler.sample(logits)])
        return r

    def step(self) -> None:
        """The last token through the pipeline, the next one from its logits."""
        r = self.r
        self.pipe.decode([r.out[-1]], len(r.context) - 1)
        logits = self.pipe.wait().logits[0]
        self._passes += 1
        r.accept([self._sampler.sample(logits)])

    def close(self) -> None:
        self.stats = {"target_passes": self._passes, "accepted_per_pass": 1.0 if self._passes else None}
