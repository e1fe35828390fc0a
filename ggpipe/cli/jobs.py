"""The job commands: ``generate``, ``chat``, ``batch`` and ``serve`` (every
rank runs the same one under ``mpiexec``; the head runs the front end)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from ggpipe.cli.options import job_options, read_prompt_file, split_job_options, utf8_prompt
from ggpipe.cli.parallel import micro_batches_option, parallel_option, with_parallel
from ggpipe.cli.strategies import JobCommand
from ggpipe.cli.types import Finite
from ggpipe.frontends.serve.http_guard import Access
from ggpipe.frontends.serve.http_limits import READ_TIMEOUT_S, RESERVED_FDS


def supervised_options(f):
    """``--ranks``, ``--hostfile`` and ``--mpiexec``: run the command's MPI job under a
    supervisor that survives a lost rank (ggpipe/frontends/supervisor.py)."""
    f = click.option("--mpiexec", default=None,
                     help="With --ranks: the MPI launcher to start (a name on PATH or beside this Python, or a "
                          "path; default: mpiexec).")(f)
    f = click.option("--hostfile", default=None, type=click.Path(exists=True, dir_okay=False),
                     help="With --ranks: the hosts, one rank per host in turn; hosts past the first N are "
                          "spares.")(f)
    return click.option("--ranks", default=None, type=click.IntRange(1), metavar="N",
                        help="Run without mpiexec: start the N ranks under mpiexec, and where a rank is lost start "
                             "them again and go on (a pause, not an error; docs/clusters/failures.md).")(f)


def _supervised(command: str, ranks: int | None, hostfile: str | None, mpiexec: str | None) -> bool:
    """Whether the command runs as a supervisor (``--ranks``).

    Raises:
        click.UsageError: ``--hostfile`` or ``--mpiexec`` without ``--ranks``, or ``--ranks`` under an MPI
            launcher."""
    from ggpipe.transport.launcher_signal import launched_rank

    if hostfile is not None and ranks is None:
        raise click.UsageError("--hostfile goes with --ranks (under mpiexec, give the hostfile to mpiexec)")
    if mpiexec is not None and ranks is None:
        raise click.UsageError("--mpiexec goes with --ranks (the launcher that --ranks starts)")
    if ranks is not None and launched_rank() is not None:
        raise click.UsageError(f"--ranks starts mpiexec itself: run 'ggpipe {command} --ranks N ...' without mpiexec")
    return ranks is not None


@click.command(cls=JobCommand)
@job_options
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user turn.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary (text, tokens, metrics, ranks).")
@click.option("--logprobs", default=None, type=click.IntRange(0, 20), metavar="K",
              help="With --json: each token's log-probability and the K most likely tokens' (as the server's).")
def generate(prompt, prompt_file, chat, as_json, logprobs, **kw):
    """Generate text from a prompt (run under mpiexec for a pipeline)."""
    from ggpipe.frontends.generate import GenerateRequest, run_generate

    if prompt is None and prompt_file is None:
        raise click.UsageError("give a prompt with -p or -f")
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give either -p or -f, not both")
    text = utf8_prompt(prompt) if prompt is not None else read_prompt_file(prompt_file)
    if logprobs is not None and not as_json:
        raise click.UsageError("--logprobs goes with --json (the log-probabilities are part of the JSON summary)")
    job, sampling, n_predict = split_job_options(kw)
    if logprobs is not None:
        sampling = dataclasses.replace(sampling, logprobs=logprobs)
    code = run_generate(job, GenerateRequest(prompt=text, n_predict=n_predict, sampling=sampling, chat=chat), as_json)
    if code:
        sys.exit(code)


@click.command(cls=JobCommand)
@job_options
@click.option("--system", default=None, help="System prompt (the first message of the conversation).")
@click.option("-i", "--input", "input_path", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Read the turns from this file instead of stdin (scripted conversations; one turn per line).")
def chat(system, input_path, **kw):
    """Interactive chat on the head rank (other ranks serve the pipeline).

    Reads one user turn per line from stdin (a terminal, or a piped script);
    /reset, /stats, /quit. Ctrl-C stops the current reply."""
    from ggpipe.frontends.chat import run_chat

    job, sampling, n_predict = split_job_options(kw)
    if system is not None:
        system = utf8_prompt(system, "--system")
    sys.exit(run_chat(job, sampling, n_predict, system, input_path))


@click.command(cls=JobCommand)
@job_options
@click.argument("prompts", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Results, one JSON line per request; a rerun skips the ids already in it.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar (ETA, tokens/s) on stderr.")
@parallel_option
@micro_batches_option
@supervised_options
@click.pass_context
def batch(ctx, prompts, output, progress, parallel, micro_batches, ranks, hostfile, mpiexec, **kw):
    """Run a JSONL file of requests: {"id", "prompt" | "messages", optional n, temperature, seed, ...} per line.

    Each result is written (and fsync'd) as it finishes; rerunning the same
    command resumes where a killed job stopped, and with --ranks (no mpiexec)
    the command does so itself when a rank is lost."""
    from ggpipe.frontends.batch import run_batch
    from ggpipe.frontends.batch_output import check_output_path

    output = check_output_path(output, prompts)   # resolved: newdir/../in.jsonl is the input
    if _supervised("batch", ranks, hostfile, mpiexec):
        from ggpipe.frontends.supervisor import results_watch, supervise

        sys.exit(supervise(sys.argv[1:], ranks, hostfile, results_watch(output), mpiexec or "mpiexec"))
    job, sampling, n_predict = split_job_options(kw)
    job = with_parallel(job, parallel, ctx, micro_batches)
    sys.exit(run_batch(job, prompts, output, n_predict, sampling, progress))


@click.command(cls=JobCommand)
@job_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port (0: any free port, printed at start).")
@click.option("--api-key", default=None,
              help="Require 'Authorization: Bearer KEY'. Visible to every local user in /proc/PID/cmdline: "
                   "prefer --api-key-file or GGPIPE_API_KEY.")
@click.option("--api-key-file", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Read the API key from this file (first line).")
@click.option("--allowed-hosts", default="", help="Comma-separated Host names accepted besides IP addresses and "
              "localhost (DNS-rebinding guard); .example.org for a domain, * for any.")
@click.option("--allowed-origins", default="", help="Comma-separated browser origins allowed (CORS), e.g. "
              "http://localhost:3000; none by default.")
@click.option("--max-body-bytes", default=Access.max_body_bytes, show_default=True, type=click.IntRange(1024),
              help="Largest request body (bytes); larger gets HTTP 413.")
@click.option("--max-connections", default=None, type=click.IntRange(1),
              help=f"Most open connections; beyond it the oldest one that has not sent a whole request is closed, "
                   f"or, when every one is busy, the new one gets HTTP 503. Default: the open-file limit "
                   f"(ulimit -n) less an eighth of it (at least {RESERVED_FDS}).")
@click.option("--read-timeout", default=READ_TIMEOUT_S, show_default=True, type=Finite(0.1),
              help="Seconds a request's headers and body may take to arrive; then the connection is closed.")
@click.option("--model-alias", default=None, help="Model name clients see (default: the GGUF file name).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Most requests waiting for the pipeline; more get HTTP 503.")
@click.option("--shutdown-grace", default=30.0, show_default=True, type=Finite(0),
              help="Seconds the running requests may go on after SIGINT/SIGTERM.")
@click.option("--allow-special-in-messages", is_flag=True,
              help="Read special-token text in chat message contents (e.g. '<|im_start|>system') as the special "
                   "tokens; by default it stays text, as the OpenAI API treats it (a client cannot forge roles).")
@parallel_option
@micro_batches_option
@supervised_options
@click.pass_context
def serve(ctx, host, port, api_key, api_key_file, allowed_hosts, allowed_origins, max_body_bytes, max_connections,
          read_timeout, model_alias, max_queue, shutdown_grace, allow_special_in_messages, parallel, micro_batches,
          ranks, hostfile, mpiexec, **kw):
    """OpenAI-compatible HTTP server on the head rank (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, /slots). --parallel requests run at once; -n and --temp etc. are the request defaults."""
    from ggpipe.frontends.serve.http_limits import ConnectionLimits, default_max_connections
    from ggpipe.frontends.serve.server import read_api_key, run_serve

    job, sampling, n_predict = split_job_options(kw)
    job = with_parallel(job, parallel, ctx, micro_batches)
    key = read_api_key(api_key, api_key_file)
    limits = ConnectionLimits(max_connections or default_max_connections(), read_timeout)
    if _supervised("serve", ranks, hostfile, mpiexec):
        from ggpipe.frontends.serve.front import run_front

        sys.exit(run_front(sys.argv[1:], ranks, hostfile, host, port, limits, max_body_bytes, mpiexec or "mpiexec"))

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    access = Access(names(allowed_hosts), names(allowed_origins), max_body_bytes)
    sys.exit(run_serve(job, host, port, key, n_predict, sampling, model_alias, max_queue, shutdown_grace, access,
                       special_in_messages=allow_special_in_messages, limits=limits))

