"""``ggpipe batch``: a JSONL file of requests in, one JSON record out per request.

Input, one JSON object per line (blank lines are skipped)::

    {"id": "q1", "prompt": "The capital of France is"}
    {"id": 2, "messages": [{"role": "user", "content": "What is MPI?"}], "n": 64, "temperature": 0.7, "seed": 1}

``id`` (string or integer, unique), exactly one of ``prompt`` (text) or
``messages`` (chat turns rendered with the GGUF's chat template), and
optionally ``n`` or ``max_tokens`` (tokens to generate), ``temperature``,
``top_p``, ``top_k``, ``seed``, ``stop`` (a string or a list of strings),
the server's constraint fields (``min_p``, ``repeat_penalty``,
``frequency_penalty``, ``presence_penalty``, ``repeat_last_n``,
``logit_bias``, ``response_format``, ``json_schema``, ``grammar``:
ggpipe.frontends.request_fields) and ``logprobs`` (a count of top tokens
per token, as the server's completions: the record gets ``logprobs``);
what a line leaves out comes from the command line (``-n``, ``--temp``, ...).
The whole file is checked before anything is generated: a bad line stops the
job with one error naming its line number.

Output, one line per finished request, in input order::

    {"id": "q1", "text": "...", "tokens": [...], "finish_reason": "length",
     "n_prompt": 6, "metrics": {"tokens_per_s": ..., "ttft_wall_s": ..., ...}}

Each record is written (one write of the whole line) and fsync'd as soon as
its request finishes, so a job killed at any moment loses nothing already
written. Running the same command again with the same output file skips every
id already there and appends the rest; a last record cut short by the kill is
dropped (and its id done again). ggpipe only ever appends to a file of its own
records: an output that holds anything else, is the input file, or is not a
regular file (a device, a pipe, ``/dev/stdout`` on a pipe) is refused with one
line and left as it is; a write that fails (disk full) is cut back, so no half
record stays (:mod:`ggpipe.frontends.batch_output`).

Ctrl-C or SIGTERM (Slurm's ``scancel``; ``mpiexec`` forwards both to every
rank): worker ranks ignore them, the head stops the request in progress
(it is not written), shuts the pipeline down cleanly and exits 130 (SIGINT)
or 143 (SIGTERM); rerun the same command to finish.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ggpipe.errors import ConfigError
from ggpipe.frontends import request_fields
from ggpipe.frontends.batch_output import RecordWriter, check_output_path, id_key, record, repair, scan_output
from ggpipe.service.engine import Engine
from ggpipe.frontends.request_limits import MESSAGES_MAX, ROLES, STOP_MAX, TEMPERATURE_MAX, template_role
from ggpipe.service.job import JobSpec, head_signals, ignore_signals, run_job
from ggpipe.service.workload import WorkloadRequest, workload
from ggpipe.jsonl import iter_jsonl
from ggpipe.sampling_params import SamplingParams

_FIELDS = {"id", "prompt", "messages", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
           "logprobs", *request_fields.FIELDS}


@dataclass
class BatchItem:
    """One validated input line.

    Attributes:
        line: 1-based line number in the input file.
        id: the request's id (str or int), unique in the file.
        prompt / messages: exactly one is set.
        n_predict: most tokens to generate.
        sampling: the request's sampling settings (validated).
        stop: stop strings.
    """

    line: int
    id: str | int
    prompt: str | None
    messages: list[dict] | None
    n_predict: int
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        """The item's id as canonical JSON text (:func:`id_key`: ``1`` and ``"1"``
        stay different ids)."""
        return id_key(self.id)


def _int(v, name: str, where: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        raise ConfigError(f"{where}: {name} must be an integer >= {minimum}, got {json.dumps(v)}")
    return int(v)


def _number(v, name: str, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise ConfigError(f"{where}: {name} must be a number, got {json.dumps(v)}")
    return float(v)


def check_messages(messages, where: str) -> list[dict]:
    """Validate chat ``messages`` ([{"role": str, "content": str}, ...], not
    empty); returns them. Raises ConfigError naming ``where``."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} objects")
    if len(messages) > MESSAGES_MAX:
        raise ConfigError(f"{where}: {len(messages)} messages; at most {MESSAGES_MAX} (the server's limit too)")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ConfigError(f"{where}: messages[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(msg.get("content"), str):
            raise ConfigError(f"{where}: messages[{i}].content must be a string")
    return [dict(m, role=template_role(m["role"])) for m in messages]


def parse_item(obj, line: int, path: str, n_predict: int, sampling: SamplingParams) -> BatchItem:
    """Validate one decoded input line; defaults come from the command line.

    Raises:
        ConfigError: ``path:line: what is wrong``.
    """
    where = f"{path}:{line}"
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    if "id" not in obj:
        raise ConfigError(f"{where}: missing \"id\"")
    rid = obj["id"]
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ConfigError(f"{where}: id must be a non-empty string or an integer, got {json.dumps(rid)}")
    has_p, has_m = "prompt" in obj, "messages" in obj
    if has_p == has_m:
        raise ConfigError(f"{where}: give exactly one of \"prompt\" or \"messages\"")
    prompt = messages = None
    if has_p:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ConfigError(f"{where}: prompt must be a non-empty string")
    else:
        messages = check_messages(obj["messages"], where)
    if "n" in obj and "max_tokens" in obj:
        raise ConfigError(f"{where}: give \"n\" or \"max_tokens\", not both")
    n = n_predict
    for k in ("n", "max_tokens"):
        if k in obj:
            n = _int(obj[k], k, where, 1)
    s = sampling
    over = {}
    if "temperature" in obj:
        over["temperature"] = _number(obj["temperature"], "temperature", where)
        if over["temperature"] > TEMPERATURE_MAX:  # as the server (request_limits.py)
            raise ConfigError(f"{where}: temperature must be at most {TEMPERATURE_MAX:g}, "
                              f"got {json.dumps(obj['temperature'])}")
    if "top_p" in obj:
        over["top_p"] = _number(obj["top_p"], "top_p", where)
    if "top_k" in obj:
        over["top_k"] = _int(obj["top_k"], "top_k", where, 0)
    if "seed" in obj:
        over["seed"] = None if obj["seed"] is None else _int(obj["seed"], "seed", where, 0)
    if "logprobs" in obj and obj["logprobs"] is not None:   # as the server's completions: a count of top tokens
        over["logprobs"] = _int(obj["logprobs"], "logprobs", where, 0)
    if over:
        s = dataclasses.replace(s, **over)
    try:
        s = request_fields.constraints(obj, s)   # the server's checks of the same fields
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    stop = obj.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise ConfigError(f"{where}: stop must be a non-empty string or a list of them")
    if len(stop) > STOP_MAX:
        raise ConfigError(f"{where}: stop holds {len(stop)} strings, at most {STOP_MAX}")
    return BatchItem(line, rid, prompt, messages, n, s, stop)


def load_items(path: str | os.PathLike, n_predict: int, sampling: SamplingParams) -> list[BatchItem]:
    """Read and validate the whole input file (see the module docstring).

    Raises:
        ConfigError: unreadable file, no requests, or a bad line (naming it).
    """
    p = Path(path)
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    for i, obj in iter_jsonl(p):
        item = parse_item(obj, i, str(p), n_predict, sampling)
        if item.key in seen:
            raise ConfigError(f"{p}:{i}: id {item.key} already used on line {seen[item.key]}")
        seen[item.key] = i
        items.append(item)
    if not items:
        raise ConfigError(f"{p} has no requests (one JSON object per line)")
    return items


def done_ids(path: str | os.PathLike) -> set[str]:
    """Ids (id_key) already in an existing output file; a last record cut
    short by a killed run is removed so that its request runs again (the only
    change ever made to the file). A missing file -> empty set. See
    :mod:`ggpipe.frontends.batch_output` for what counts as ggpipe's.

    Raises:
        ConfigError: the file cannot be read or repaired, is not a regular
            file, or holds anything that is not a ggpipe batch record
            (refused; the file is left as it is).
    """
    done, cut_at = scan_output(path)
    if cut_at is not None:
        repair(path, cut_at)
    return done


class BatchRunner:
    """The head's side of a batch job.

    Args:
        engine: the head's engine.
        input_path: the JSONL requests.
        output_path: the JSONL results (appended to; existing ids skipped).
        n_predict, sampling: defaults of requests that do not set them.
        progress: show a tqdm progress bar on stderr.
        items: the input's requests (:func:`load_items` of ``input_path``
            by default; ``run_batch`` passes the ones it read before loading).
    """

    def __init__(self, engine: Engine, input_path, output_path, n_predict: int, sampling: SamplingParams,
                 progress: bool = True, items: Callable[[], list[BatchItem]] | None = None):
        self.engine = engine
        self.input_path = Path(input_path)
        self.output_path = Path(output_path)
        self.n_predict = n_predict
        self.sampling = sampling
        self.progress = progress
        self.items = items or (lambda: load_items(self.input_path, self.n_predict, self.sampling))
        self.signal: int | None = None

    def on_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        """Signal handler (SIGINT, SIGTERM): remember ``signum``; the run drops
        the queued requests, stops the running ones at their next token, and
        returns 128 + ``signum``."""
        self.signal = signum

    def prepare(self) -> list[tuple[BatchItem, object]]:
        """Validate everything before generating: input lines, chat template,
        prompt lengths, logit biases and grammars; returns the (item, tokens) still to do."""
        check_output_path(self.output_path, self.input_path)
        items = self.items()
        has_template = bool(self.engine.vocab.chat_template())
        todo = []
        done = done_ids(self.output_path)
        for it in items:
            where = f"{self.input_path}:{it.line}"
            if it.messages is not None and not has_template:
                raise ConfigError(f"{where}: messages need a chat template, and this model has none; use \"prompt\"")
            if it.key in done:
                continue
            try:
                tokens = self.engine.tokenize(it.prompt, it.messages)
                self.engine.check_fits(int(tokens.shape[0]), it.n_predict)
                if it.sampling.constrained:   # a bias outside the vocabulary, a grammar llama.cpp cannot parse
                    self.engine.sampler(it.sampling, [])
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
            todo.append((it, tokens))
        return todo

    def _stopping(self) -> bool:
        return self.signal is not None

    def _run(self, todo, finished) -> None:
        """Requests are queued as slots free up (at most ``--parallel``
        waiting; one at a time with one slot), and records are written in
        the order the requests finish. A signal drops the queued ones and
        stops the running ones at their next token."""
        engine, pending, queued = self.engine, iter(todo), []
        while True:
            while not self._stopping() and engine.queued < engine.parallel:
                item, tokens = next(pending, (None, None))
                if item is None:
                    break
                queued.append(engine.submit(tokens, item.n_predict, item.sampling, stop=item.stop,
                                            should_stop=self._stopping,
                                            on_done=lambda done, item=item: finished(item, done)))
            if not engine.busy:
                break
            if self._stopping():
                for job in queued:
                    job.cancelled = True
            engine.step()
            queued = [j for j in queued if j.request is None and not j.cancelled]
        engine.drain()

    def run(self) -> int:
        """Run every pending request; returns the exit code (0, or 128 + signal)."""
        from tqdm import tqdm  # noqa: PLC0415

        todo = self.prepare()
        if not todo:
            sys.stderr.write(f"ggpipe: every request is already in {self.output_path}: nothing to do\n")
            return 0
        out = RecordWriter(self.output_path)
        self._n_tokens, self._t0, self._written = 0, time.perf_counter(), 0
        bar = tqdm(total=len(todo), unit="req", file=sys.stderr, disable=not self.progress, dynamic_ncols=True,
                   desc="batch")

        def finished(item: BatchItem, done) -> None:
            """A request ended: its record, unless it was cut by a signal."""
            if done is None or done.finish_reason == "interrupted":
                return
            out.write(record(item.id, done))
            self._written += 1
            self._n_tokens += len(done.tokens)
            bar.set_postfix_str(f"{self._n_tokens / max(time.perf_counter() - self._t0, 1e-9):.1f} tokens/s",
                                refresh=False)
            bar.update(1)

        try:
            self._run(todo, finished)
        finally:
            bar.close()
            out.close()
        written = self._written
        if self.signal is not None:
            left = len(todo) - written
            sys.stderr.write(f"ggpipe: interrupted: {written} written, {left} left; "
                             f"run the same command again to finish\n")
            return 128 + self.signal
        return 0


def run_batch(job: JobSpec, input_path, output_path, n_predict: int, sampling: SamplingParams,
              progress: bool = True) -> int:
    """Entry point of every rank; returns the exit code.

    Raises:
        ConfigError: a bad input line (naming it), an unwritable output file,
            an output file that is not a batch result.
    """
    ignore_signals()

    read: dict[str, list[BatchItem]] = {}   # the head reads the input once: before loading, kept for prepare

    def items() -> list[BatchItem]:
        if "items" not in read:
            read["items"] = load_items(input_path, n_predict, sampling)
        return read["items"]

    def head(engine: Engine) -> int:
        runner = BatchRunner(engine, input_path, output_path, n_predict, sampling, progress, items)
        with head_signals(runner.on_signal):
            return runner.run()

    return run_job(job, head, workload=lambda: workload(job.config.model, workload_of(items),
                                                        job.config.request_cells))


#: Requests whose workload is counted at most (the first ones of the file): enough to tell long prompts from short.
WORKLOAD_ITEMS = 1000


def workload_of(items: Callable[[], list[BatchItem]]) -> Callable[[], list[WorkloadRequest]]:
    """The first :data:`WORKLOAD_ITEMS` requests of ``items()`` (the
    input's) as :func:`ggpipe.service.workload.workload` counts them."""
    return lambda: [(it.prompt, it.messages, it.n_predict) for it in items()[:WORKLOAD_ITEMS]]
