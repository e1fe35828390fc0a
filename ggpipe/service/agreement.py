"""How often a draft model's greedy token is the target's: the one input of
the simulator that a user cannot know before running the pair
(``ggpipe calibrate -md DRAFT`` measures it; ``ggpipe simulate`` reads it
as ``--acceptance``, ggpipe.sim.lm.CalibratedDraft's agreement rate), and
how the draft's confidence in its token tells that agreement
(``--confidence-exponent``: k in P(agreed | the draft's probability q of
its token) = q ** k, fitted at the same positions).

It is measured teacher-forced, on the job's own ranks: the target generates
greedily after each prompt, then the draft reads prompt and reply in one
run, and at every generated position its most likely next token is compared
with the target's. That is the agreement at a position whose context is
right, what a drafted token meets when the tokens before it were accepted;
a job's ``decoder.acceptance_rate`` (accepted over drafted) is lower, because
the tokens drafted after a rejected one count as drafted and are never
compared. It depends on the models and the text, not on the cluster, so the
prompts should be of the kind the job will see (``--agreement-prompts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.logits import best
from ggpipe.speculation.adaptive import fit_exponent

#: Prompts of several kinds (prose, explanation, lists, code), for a pair
#: measured without prompts of the user's own.
DEFAULT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "List ten things to pack for a week of hiking in the mountains, with one line on each.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins",
    "Q: Why is the sky blue?\nA:",
)


@dataclass(frozen=True)
class Agreement:
    """A measured draft agreement.

    Attributes:
        rate: ``agreed / positions`` (0..1).
        positions: generated positions compared (tokens).
        agreed: positions where the draft's most likely token was the
            target's greedy token (tokens).
        prompts: prompts run.
        tokens: tokens generated per prompt (at most).
        exponent: k in P(agreed | q) = q ** k, ``q`` the draft's probability
            of its most likely token at the position (maximum likelihood,
            ggpipe.speculation.adaptive.fit_exponent): 1 for a draft whose
            confidence is its agreement, below 1 for an under-confident
            one; None where it was not measured.
    """

    rate: float
    positions: int
    agreed: int
    prompts: int
    tokens: int
    exponent: float | None = None


def read_prompts(path: Path | None) -> tuple[str, ...]:
    """One prompt per non-empty line of ``path`` (UTF-8; ``\\n`` in a line
    stands for a line break), else :data:`DEFAULT_PROMPTS`.

    Raises:
        ConfigError: unreadable, not UTF-8, or no prompt in it."""
    if path is None:
        return DEFAULT_PROMPTS
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--agreement-prompts {path}: not UTF-8 text (one prompt per line)") from None
    except OSError as e:
        raise ConfigError(f"--agreement-prompts {path}: cannot read it ({e.strerror or e})") from None
    prompts = tuple(line.replace("\\n", "\n") for line in text.splitlines() if line.strip())
    if not prompts:
        raise ConfigError(f"--agreement-prompts {path}: no prompt in it (one prompt per line)")
    return prompts


MODE = "speculative"  # the job's mode: any with a draft pipeline; the target's greedy tokens are the same in all


def agreement_config(model: str, draft: str, threads: str, timeout_s: float, ctx_size: int = 2048):
    """The job that measures the pair: ``model`` split evenly over the
    ranks, ``draft`` placed as ``generate --mode speculative`` places it,
    default KV settings. Returns (ClusterConfig, DecodingPlan)."""
    from ggpipe.cluster.config import ClusterConfig  # noqa: PLC0415
    from ggpipe.decoding.plan import DecodingPlan  # noqa: PLC0415

    plan = DecodingPlan.resolve(MODE)
    cfg = ClusterConfig(model=model, draft_model=draft, threads=threads, ctx_size=ctx_size,
                        n_seq_max=plan.seq_ids, timeout_s=timeout_s)
    return cfg, plan


def agreed_positions(tokens: list[int], n_prompt: int, draft_best: np.ndarray) -> np.ndarray:
    """Whether the draft agreed at each generated position of one sequence:
    bool (len(tokens) - n_prompt,) (empty with no reply); ``tokens`` (prompt
    then reply, int), ``draft_best`` the draft's most likely next token after
    each of ``tokens`` (int (len(tokens),)); position i of the reply (i >=
    ``n_prompt``) agrees when ``draft_best[i - 1] == tokens[i]``."""
    if len(tokens) <= n_prompt:
        return np.zeros(0, dtype=bool)
    return np.asarray(draft_best[n_prompt - 1:len(tokens) - 1]) == np.asarray(tokens[n_prompt:])


def _draft_best(pipeline, tokens: list[int], n_ubatch: int) -> tuple[np.ndarray, np.ndarray]:
    """The draft pipeline's most likely next token after each of ``tokens``
    (int (n,)) and its probability (float (n,), softmax of the row:
    :func:`ggpipe.logits.best`, which reads full and compact rows alike),
    from an emptied KV cache: one run per ``n_ubatch`` tokens with a logit
    row per token."""
    pipeline.clear()
    ids, probs = [], []
    for start in range(0, len(tokens), n_ubatch):
        chunk = tokens[start:start + n_ubatch]
        pipeline.decode(np.asarray(chunk, dtype=np.int32), start, logits_all=True)
        rows = pipeline.drain()[-1].logits
        for i in range(len(rows)):
            top, p = best(rows[i], 1)
            ids.append(int(top[0]))
            probs.append(float(p[0]))
    return np.asarray(ids, dtype=np.int64), np.asarray(probs)


def summarize(agreed: np.ndarray, probs: np.ndarray, prompts: int, tokens: int) -> Agreement:
    """The :class:`Agreement` of the compared positions: ``agreed`` bool (n,),
    ``probs`` the draft's probability of its most likely token at each,
    float (n,)."""
    n, a = len(agreed), int(np.count_nonzero(agreed))
    return Agreement(a / n if n else 0.0, n, a, prompts, tokens,
                     round(fit_exponent(probs, agreed), 4) if n else None)


def measure_agreement(model: str, draft: str, threads: str, prompts: tuple[str, ...], n_predict: int,
                      timeout_s: float, say=lambda s: None) -> Agreement | None:
    """Run the measuring job (every rank calls this; the ranks meet as a
    job's do) and return, on the head, the pair's :class:`Agreement`; None
    on the other ranks.

    Args:
        threads: ``-t`` text (one count, or one per rank).
        prompts: the prompts; the target generates ``n_predict`` greedy
            tokens after each (an end-of-generation token ends it earlier).
        timeout_s: bound of every wait for another rank (seconds).

    Raises:
        GGPipeError: start-up or pipeline errors, as ``generate`` raises them.
    """
    from ggpipe.sampling_params import SamplingParams  # noqa: PLC0415
    from ggpipe.service.job import JobSpec, run_job  # noqa: PLC0415

    cfg, plan = agreement_config(model, draft, threads, timeout_s)
    got: dict = {}

    def head(engine) -> int:
        agreed, probs = [], []
        for i, prompt in enumerate(prompts):
            say(f"draft agreement: prompt {i + 1} of {len(prompts)}")
            engine.reset()
            toks = engine.tokenize(prompt)
            c = engine.generate(toks, n_predict, SamplingParams(temperature=0.0))
            seq = [*toks.tolist(), *c.tokens]
            ids, prob = _draft_best(engine.session.draft_pipelines[0], seq, cfg.n_batch)
            agreed.append(agreed_positions(seq, len(toks), ids))
            probs.append(prob[len(toks) - 1:len(seq) - 1])
        got["a"] = summarize(np.concatenate(agreed), np.concatenate(probs), len(prompts), n_predict)
        return 0

    run_job(JobSpec(cfg, plan), head)
    return got.get("a")
