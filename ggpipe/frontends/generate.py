"""``ggpipe generate``: one prompt in, text streamed out on the head rank.

Every rank runs the same command; rank 0 (the head) tokenizes, drives the
chosen mode and prints, the other ranks serve their stage until the head
shuts the pipeline down.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from ggpipe.service.engine import Engine
from ggpipe.service.job import JobSpec, run_job
from ggpipe.service.workload import workload
from ggpipe.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """What ``ggpipe generate`` asks for: the prompt text, the most tokens to
    generate, the sampling settings, and ``chat``: render the prompt as one
    user message with the model's chat template."""

    prompt: str
    n_predict: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    chat: bool = False

    def messages(self) -> list[dict] | None:
        """The prompt as one user message (``chat``), or None (a plain prompt)."""
        return [{"role": "user", "content": self.prompt}] if self.chat else None


def generate_on_head(engine: Engine, req: GenerateRequest, stream=None) -> dict:
    """Run one generation on the head rank; returns the summary (tokens, text,
    metrics). Streams text to ``stream`` as tokens are accepted, if given.

    Raises:
        ConfigError: prompt + n_predict does not fit the context.
    """
    tokens = engine.tokenize(req.prompt, req.messages())

    def write(text: str) -> None:
        stream.write(text)
        stream.flush()

    done = engine.generate(tokens, req.n_predict, req.sampling, on_text=write if stream is not None else None)
    if stream is not None:
        write("\n")
    # kernels: the build, the buffer types and whether a batch's rows equal a lone token's (docs/user-guide/exactness.md)
    return {"mode": engine.mode, "model": engine.session.model_path, "kernels": engine.kernels,
            **done.as_dict()}


def run_generate(job: JobSpec, req: GenerateRequest, as_json: bool) -> int:
    """Entry point of every rank; returns the process exit code. Without
    ``--split``, a prompt that is most of the job's tokens gets the layers
    split for prompts (``ggpipe.service.workload``; the head says so)."""
    result: dict = {}

    def head(engine: Engine) -> int:
        result.update(generate_on_head(engine, req, stream=None if as_json else sys.stdout))
        return 0

    def report(session, ranks: list[dict]) -> None:
        if as_json:
            result["ranks"] = ranks
            result["n_ranks"] = session.size
            json.dump(result, sys.stdout, indent=1)
            sys.stdout.write("\n")

    counted = lambda: [(req.prompt, req.messages(), req.n_predict)]  # noqa: E731
    return run_job(job, head, report, workload=lambda: workload(job.config.model, counted, job.config.request_cells))
