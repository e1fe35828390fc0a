"""Toy language models with a chosen acceptance behaviour, for the
simulator: a target (:class:`~ggpipe.sim.toy.ToyLM`) and a draft whose
agreement with the target's greedy token follows its confidence.

:class:`CalibratedDraft`: at each context a probability of agreement p is
drawn from Beta(c a, c (1 - a)) (mean ``a``: the rate at which the draft's
greedy token is the target's; concentration ``c``); with probability p the
draft's top token is the target's greedy one, else another. The draft
reports a confidence (its top token's probability) q = p ** (1 / k), so
P(agreement | q) = q ** k: k = 1 is a calibrated draft, k < 1 an
under-confident one (SmolLM2-135M drafting for its self-merge: accepted
about half the time at q = 0.25, ggpipe.speculation.adaptive), k > 1 an
over-confident one. PipeInfer section V reports acceptance rates per model
pair; (a, k) reproduce an acceptance rate and, with the confidence cutoff,
how long drafted chains are. Deterministic: every draw is seeded from the
context.
"""

from __future__ import annotations

import numpy as np

from ggpipe.sim.toy import ToyLM


class CalibratedDraft(ToyLM):
    """Args:
        target: the target toy model the draft imitates.
        acceptance: mean acceptance rate of greedy drafts (0..1).
        concentration: Beta concentration of the agreement probability
            (higher: every token near ``acceptance``).
        exponent: k in P(agreement | confidence q) = q ** k."""

    def __init__(self, target: ToyLM, acceptance: float, concentration: float = 2.0, seed: int = 1,
                 exponent: float = 1.0):
        super().__init__(target.n_vocab, seed=seed)
        if not 0.0 < acceptance < 1.0:
            raise ValueError(f"acceptance must be in (0, 1), got {acceptance}")
        self.target = target
        self.a = acceptance
        self.c = concentration
        self.k = exponent

    def logits(self, context: list[int]) -> np.ndarray:
        """float32 (n_vocab,) logits: 0 everywhere but the draft's top token,
        whose softmax probability is the confidence q (see the module
        docstring); that token is the target's greedy one with probability p.
        Seeded from the last 8 tokens, the context length and ``seed``."""
        v = self.n_vocab
        key = (hash(tuple(context[-8:])) + 1000003 * len(context) + self.seed) % (2**32)
        rng = np.random.default_rng(key)
        p = float(np.clip(rng.beta(self.c * self.a, self.c * (1 - self.a)), 0.02, 0.98))
        q = float(np.clip(p ** (1.0 / self.k), 0.02, 0.98))
        best = int(np.argmax(self.target.logits(context)))
        if rng.random() >= p:
            best = (best + 1 + int(rng.integers(v - 1))) % v
        row = np.zeros(v, dtype=np.float32)
        row[best] = np.log(q * (v - 1) / (1 - q))
        return row
