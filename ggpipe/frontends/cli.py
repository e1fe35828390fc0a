"""The ``ggpipe`` command (click).

    mpiexec -n 2 ggpipe generate -p "Tell me about MPI" -n 64
    ggpipe models list | fetch NAME | path NAME
    ggpipe split MODEL --split 0.3,0.7 -o DIR

Errors a user can cause print one line, ``ggpipe: error: ...``, and exit 1
(usage errors: 2; a traceback only with ``-v``). Under MPI only the head
prints it; a worker that fails on its own prints its line (naming its rank)
and aborts the job so nothing hangs. An error before the ranks have met is
carried to the head by the start-up exchange (``cluster/session.py``).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click

from ggpipe.errors import GGPipeError, RankFailedError
from ggpipe.frontends.cli_types import SECONDS, Finite
from ggpipe.frontends.http_guard import Access
from ggpipe.frontends.cli_bench import bench_command, timeline_command
from ggpipe.frontends.cli_sim import calibrate_command, simulate_command
from ggpipe.frontends.cli_models import models_group, split_command
from ggpipe.models.registry import DEFAULT_MODEL
from ggpipe.sampling import SamplingParams
from ggpipe.transport.launcher_signal import launched_rank

_state = {"verbose": 0}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="Show llama.cpp's log, per-rank details and tracebacks.")
@click.version_option(package_name="ggpipe")
def cli(verbose: int) -> None:
    """Pipeline-parallel GGUF inference over MPI (PipeInfer)."""
    _state["verbose"] = verbose
    if verbose:
        os.environ["GGPIPE_VERBOSE"] = "1"  # per-rank details (CPU affinity) at start-up
    from ggpipe.runtime import llama  # noqa: PLC0415

    llama.set_verbose(verbose > 1)


def _apply(opts, f):
    """Decorate ``f`` with click options, first listed shown first in --help."""
    for o in reversed(opts):
        f = o(f)
    return f


def cluster_options(f):
    """Options every rank must share (compared at start-up)."""
    opts = [
        click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True,
                     help="Target model: registry name (models.toml) or path to a .gguf file."),
        click.option("-md", "--draft-model", default=None,
                     help="Draft model for --mode speculative|pipeinfer|pipedec (name or path; same vocabulary); "
                          "several, comma-separated, each on ranks of its own, for --spec-type vote (-md a,b)."),
        click.option("--split", default=None,
                     help="Layer split weights per rank, e.g. 0.3,0.7; with a draft model TARGET/DRAFT, "
                          "e.g. 0.5,0.5/1.0 (default: even; the draft gets one rank when there are 2+); "
                          "with several draft models one /DRAFT part each (1,1/1/1); "
                          "auto:PROFILE.json: balanced from measured costs (ggpipe calibrate)."),
        click.option("-t", "--threads", default="1", show_default=True,
                     help="Threads per rank: one value, or one per rank (2,1,1)."),
        click.option("-c", "--ctx-size", default=2048, show_default=True, type=int, help="KV cache size (tokens)."),
        click.option("--ubatch", default=512, show_default=True, type=int,
                     help="Micro-batch size (tokens): prompt chunk sent down the pipeline."),
        click.option("--n-seq-max", default=None, type=int,
                     help="KV sequence ids per target context (default: 1, or enough for the speculation settings)."),
        click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="off",
                     show_default=True,
                     help="Flash attention, llama.cpp's meaning (its tools default to auto). off is "
                          "llama-cpp-python's default and the reference of ggpipe's exactness guarantee."),
        click.option("--timeout", default=60.0, show_default=True, type=SECONDS,
                     help="Seconds any wait for another rank may last inside a transaction."),
        click.option("--liveness-timeout", default=6.0, show_default=True, type=Finite(min=0.5),
                     help="Seconds of heartbeat silence after which a rank counts as dead or stuck "
                          "and the job stops, naming it."),
    ]
    return _apply(opts, f)


def speculation_options(f):
    """Speculation knobs (PipeInfer IV.B; defaults tuned in docs/BENCHMARKS.md)."""
    from ggpipe.decoding.settings import MODES, SPEC_TYPES, SpecSettings  # noqa: PLC0415

    d = SpecSettings()
    opts = [
        click.option("--mode", type=click.Choice(list(MODES)), default="iterative",
                     show_default=True, help="Scheduling mode: iterative (plain pipeline), speculative "
                                             "(synchronous), pipeinfer (PipeInfer), pipedec (PipeDec's dynamic "
                                             "prediction tree, one layer per pipeline step)."),
        click.option("--spec-type", type=click.Choice(list(SPEC_TYPES) + list(SPEC_TYPE_ALIASES)),
                     default=d.spec_type, show_default=True,
                     help="Drafting strategy of the speculative modes: draft (the draft model, -md) or ngram "
                          "(prompt lookup in the request's own tokens, no draft model). llama.cpp's names "
                          "draft-simple and ngram-simple are accepted. vote: Minions' weighted majority vote "
                          "of the --spec-vote proposers. staged: the draft model, each draft run also checking "
                          "n-gram guesses (Staged SD's draft-of-draft)."),
        click.option("--spec-vote", "vote", default=",".join(d.vote), show_default=True, callback=_vote_members,
                     help="Proposers --spec-type vote merges, comma-separated, ties going to the first "
                          "(at most one that drafts with the draft model: draft or staged)."),
        click.option("--spec-ngram-min", "ngram_min", default=d.ngram_min, show_default=True,
                     type=click.IntRange(1, 64), help="Shortest suffix the n-gram proposer matches (tokens)."),
        click.option("--spec-ngram-max", "ngram_max", default=d.ngram_max, show_default=True,
                     type=click.IntRange(1, 64), help="Longest suffix the n-gram proposer matches (tokens)."),
        click.option("--spec-guesses", "guesses", default="auto", type=CountOrAuto(), show_default=True,
                     help="--spec-type staged: most n-gram guesses a draft run checks after its tip; auto: those "
                          "worth their measured cost (docs/BENCHMARKS.md section 9), N: up to N whatever they "
                          "cost, 0: none."),
        click.option("--draft", "n_draft", default=d.draft, show_default=True, type=click.IntRange(1, 64),
                     help="Most draft tokens per speculation tree / micro-batch."),
        click.option("--p-accept", default="default", type=ProbabilityOrAuto(),
                     help=f"Confidence cutoff: drafting stops when the draft's probability of its next token is "
                          f"below it; auto: from the measured pass cost curve and the drafts' calibrated "
                          f"acceptance (docs/BENCHMARKS.md section 4). Default: {d.p_accept} in pipeinfer mode with "
                          f"a draft model (draft, staged, vote), auto in speculative mode with draft or staged "
                          f"and with ngram (each measured better there)."),
        click.option("--p-split", default=d.p_split, show_default=True, type=Finite(0, 1),
                     help="Runner-up draft probability that adds a sibling branch (greedy)."),
        click.option("--p-recovery", default=d.p_recovery, show_default=True, type=Finite(0, 1),
                     help="Cutoff increase per continued micro-batch (with a numeric --p-accept)."),
        click.option("--p-decay", default=d.p_decay, show_default=True, type=Finite(0, 1),
                     help="Cutoff decrease per failed attempt while the pipeline waits (with a numeric --p-accept)."),
        click.option("--branches", default=d.width, show_default=True, type=click.IntRange(1, 16),
                     help="Most branches (KV sequences) per speculation tree."),
        click.option("--max-inflight", default=d.max_inflight, show_default=True, type=click.IntRange(1, 128),
                     help="Most speculative runs in flight (pipeinfer)."),
        click.option("--tree-width", default=d.tree_width, show_default=True, type=click.IntRange(1, 64),
                     help="pipedec: most nodes per prediction-tree layer (the best by cumulative draft probability); "
                          "1 (a chain) is exact in every run, wider trees carry the near-tie caveat (README)."),
        click.option("--max-children", default=d.max_children, show_default=True, type=click.IntRange(1, 64),
                     help="pipedec: most children per prediction-tree node."),
        click.option("--no-continuous", is_flag=True, help="pipeinfer without continuous speculation (ablation)."),
        click.option("--no-cancel", is_flag=True, help="pipeinfer without early inference cancellation (ablation)."),
        click.option("--no-wait-draft", is_flag=True,
                     help="pipeinfer: when the head's target stage runs out of work, hand over what is drafted at "
                          "once, instead of waiting for the draft's next token where the measured costs say it "
                          "pays."),
    ]
    return _apply(opts, f)


class NumberOrAuto(click.ParamType):
    """A number in [``lo``, ``hi``] of type ``cast``, or ``auto`` (None);
    the words in ``keep`` pass through as they are."""

    cast, lo, hi, noun, keep = float, 0.0, 1.0, "a number", ()

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        if value in self.keep or isinstance(value, self.cast):
            return value
        try:
            v = self.cast(value)
        except ValueError:
            self.fail(f"{value!r} is neither {self.noun} nor 'auto'", param, ctx)
        if not self.lo <= v <= self.hi:
            self.fail(f"{v} is not in [{self.lo:g}, {self.hi:g}]", param, ctx)
        return v


class ProbabilityOrAuto(NumberOrAuto):
    """A probability in [0, 1], or ``auto`` (None); ``default`` is chosen
    per --spec-type in _spec_settings."""

    name, noun, keep = "P|auto", "a probability", ("default",)


class CountOrAuto(NumberOrAuto):
    """A count in [0, 64], or ``auto`` (None)."""

    name, cast, lo, hi, noun = "N|auto", int, 0, 64, "a whole number"


SPEC_TYPE_ALIASES = {"draft-simple": "draft", "ngram-simple": "ngram"}  # llama.cpp's --spec-type names


def _vote_members(ctx, param, value: str) -> tuple[str, ...]:
    """``--spec-vote``: registered proposer names, distinct (at least two
    members once ``draft`` stands for each draft model: checked with -md)."""
    from ggpipe.decoding.settings import SPEC_TYPES  # noqa: PLC0415

    from ggpipe.speculation.vote import check_members  # noqa: PLC0415

    names = tuple(SPEC_TYPE_ALIASES.get(v.strip(), v.strip()) for v in value.split(",") if v.strip())
    bad = [n for n in names if n not in SPEC_TYPES or n == "vote"]
    if bad:
        raise click.BadParameter(f"unknown proposer {bad[0]!r}: choose from "
                                 f"{', '.join(t for t in SPEC_TYPES if t != 'vote')}")
    try:
        return names if names == ("draft",) else tuple(check_members(names))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _spec_settings(mode, spec_type, n_draft, p_accept, p_split, p_recovery, p_decay, branches, max_inflight,
                   no_continuous, no_cancel, ngram_min, ngram_max, vote, tree_width=1, max_children=4,
                   no_wait_draft=False, guesses=None):
    from ggpipe.decoding.settings import SpecSettings  # noqa: PLC0415

    spec_type = SPEC_TYPE_ALIASES.get(spec_type, spec_type)
    uses_draft = SpecSettings(spec_type=spec_type, vote=vote).uses_draft_model
    if p_accept == "default":   # auto where it measured better (docs/BENCHMARKS.md section 4)
        auto = not uses_draft or (mode == "speculative" and spec_type in ("draft", "staged"))
        p_accept = None if auto else SpecSettings.p_accept
    return SpecSettings(mode=mode if mode != "iterative" else "pipeinfer", spec_type=spec_type, draft=n_draft,
                        p_accept=p_accept,
                        p_split=p_split, p_recovery=p_recovery, p_decay=p_decay, width=branches,
                        continuous=not no_continuous, cancel=not no_cancel, max_inflight=max_inflight,
                        ngram_min=ngram_min, ngram_max=ngram_max, vote=vote, tree_width=tree_width,
                        max_children=max_children, wait_draft=not no_wait_draft, guesses=guesses)


def sampling_options(f):
    """Per-request generation settings (llama.cpp's names and defaults)."""
    opts = [
        click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(min=1),
                     help="Tokens to generate (at most)."),
        click.option("--temp", default=0.0, show_default=True, type=Finite(min=0), help="Temperature; 0 = greedy."),
        click.option("--top-k", default=40, show_default=True, type=int, help="Top-k (0 = off)."),
        click.option("--top-p", default=0.95, show_default=True, type=Finite(0, 1, min_open=True), help="Top-p (1 = off)."),
        click.option("--seed", default=None, type=int, help="Sampling seed."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating after an end-of-generation token."),
    ]
    return _apply(opts, f)


def job_options(f):
    """Everything that starts a job: cluster, speculation and sampling options."""
    return cluster_options(speculation_options(sampling_options(f)))


_JOB_KEYS = ("model", "draft_model", "split", "threads", "ctx_size", "ubatch", "n_seq_max", "timeout", "flash_attn",
             "liveness_timeout", "mode", "spec_type", "ngram_min", "ngram_max", "vote", "guesses",
             "n_draft", "p_accept", "p_split", "p_recovery", "p_decay", "branches", "max_inflight", "no_continuous",
             "no_cancel", "no_wait_draft", "tree_width", "max_children", "n_predict", "temp", "top_k", "top_p", "seed",
             "ignore_eos")


def utf8_prompt(text: str, what: str = "-p") -> str:
    """``text`` from the command line, refused if it is not valid UTF-8 (Python
    keeps undecodable argv bytes as lone surrogates).

    Raises:
        click.BadParameter: naming the byte position.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise click.BadParameter(f"the prompt is not valid UTF-8 (character {e.start + 1})", param_hint=what) from None
    return text


def read_prompt_file(path: Path) -> str:
    """The prompt file's text (UTF-8).

    Raises:
        ConfigError: unreadable, or not valid UTF-8 (naming the byte offset).
    """
    from ggpipe.errors import ConfigError  # noqa: PLC0415

    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read the prompt file {path}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"the prompt file {path} is not valid UTF-8 (byte {e.start + 1})") from None


def split_job_options(kw: dict):
    """Pop the job_options values out of a command's keyword arguments;
    returns (JobSpec, SamplingParams, n_predict).

    Raises:
        ConfigError: impossible sampling settings.
    """
    from ggpipe.frontends.job import JobSpec
    from ggpipe.cluster.session import ClusterConfig
    from ggpipe.decoding.settings import auto_n_seq_max, check_draft_models

    o = {k: kw.pop(k) for k in _JOB_KEYS}
    sampling = SamplingParams(temperature=o["temp"], top_k=o["top_k"], top_p=o["top_p"], seed=o["seed"]).validate()
    spec = _spec_settings(o["mode"], o["spec_type"], o["n_draft"], o["p_accept"], o["p_split"], o["p_recovery"],
                          o["p_decay"], o["branches"], o["max_inflight"], o["no_continuous"], o["no_cancel"],
                          o["ngram_min"], o["ngram_max"], o["vote"], o["tree_width"], o["max_children"],
                          o["no_wait_draft"], o["guesses"])
    n_seq_max = o["n_seq_max"] if o["n_seq_max"] is not None else auto_n_seq_max(o["mode"], spec)
    if o["split"] is not None and o["split"].startswith("auto"):
        from ggpipe.frontends.plan import auto_split
        from ggpipe.transport.launcher_signal import launched_size

        o["split"] = auto_split(o["split"], dict(o), launched_size() or 1)
    cfg = ClusterConfig(model=o["model"], draft_model=o["draft_model"], split=o["split"], threads=o["threads"],
                        ctx_size=o["ctx_size"], n_seq_max=n_seq_max, ubatch=o["ubatch"], timeout_s=o["timeout"],
                        liveness_timeout_s=o["liveness_timeout"], flash_attn=o["flash_attn"])
    check_draft_models(len(cfg.draft_models), o["mode"], spec)
    return JobSpec(cfg, o["mode"], spec, o["ignore_eos"]), sampling, o["n_predict"]


@cli.command()
@job_options
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Read the prompt from a file.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user turn.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary (text, tokens, metrics, ranks).")
def generate(prompt, prompt_file, chat, as_json, **kw):
    """Generate text from a prompt (run under mpiexec for a pipeline)."""
    from ggpipe.frontends.generate import GenerateRequest, run_generate

    if prompt is None and prompt_file is None:
        raise click.UsageError("give a prompt with -p or -f")
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give either -p or -f, not both")
    text = utf8_prompt(prompt) if prompt is not None else read_prompt_file(prompt_file)
    job, sampling, n_predict = split_job_options(kw)
    code = run_generate(job, GenerateRequest(prompt=text, n_predict=n_predict, sampling=sampling, chat=chat), as_json)
    if code:
        sys.exit(code)


@cli.command()
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


@cli.command()
@job_options
@click.argument("prompts", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Results, one JSON line per request; a rerun skips the ids already in it.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress bar (ETA, tokens/s) on stderr.")
def batch(prompts, output, progress, **kw):
    """Run a JSONL file of requests: {"id", "prompt" | "messages", optional n, temperature, seed, ...} per line.

    Each result is written (and fsync'd) as it finishes; rerunning the same
    command resumes where a killed job stopped."""
    from ggpipe.frontends.batch import run_batch

    job, sampling, n_predict = split_job_options(kw)
    sys.exit(run_batch(job, prompts, output, n_predict, sampling, progress))


@cli.command()
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
@click.option("--model-alias", default=None, help="Model name clients see (default: the GGUF file name).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1),
              help="Most requests waiting for the pipeline; more get HTTP 503.")
@click.option("--shutdown-grace", default=30.0, show_default=True, type=Finite(0),
              help="Seconds the running request may go on after SIGINT/SIGTERM.")
def serve(host, port, api_key, api_key_file, allowed_hosts, allowed_origins, max_body_bytes, model_alias, max_queue,
          shutdown_grace, **kw):
    """OpenAI-compatible HTTP server on the head rank (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics). Requests run one at a time; -n and --temp etc. are the request defaults."""
    from ggpipe.frontends.serve import read_api_key, run_serve

    job, sampling, n_predict = split_job_options(kw)
    key = read_api_key(api_key, api_key_file)

    def names(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    access = Access(names(allowed_hosts), names(allowed_origins), max_body_bytes)
    sys.exit(run_serve(job, host, port, key, n_predict, sampling, model_alias, max_queue, shutdown_grace, access))


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("-n", "--ranks", required=True, type=click.IntRange(1), help="MPI ranks of the job.")
@click.option("-m", "--model", default=None, help=f"Target model (default {DEFAULT_MODEL}).")
@click.option("-md", "--draft-model", default=None, help="Draft model.")
@click.option("--split", default=None, help="Layer split, as for generate.")
@click.option("-c", "--ctx-size", default=None, type=int, help="KV cache size (tokens; default 2048).")
@click.option("-t", "--threads", default=None, help="Threads per rank (default 1).")
@click.option("--hostfile", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Open MPI (host slots=N) or MPICH (host:N) hostfile.")
@click.option("--map-by", type=click.Choice(["node", "slot"]), default="node", show_default=True,
              help="node: one rank per host round-robin; slot: fill each host's slots first.")
@click.option("--bind-to", type=click.Choice(["none", "core", "socket", "numa"]), default="none",
              show_default=True, help="Launcher CPU binding (core: threads cores per rank).")
@click.option("--launcher", type=click.Choice(["auto", "mpich", "openmpi", "srun"]), default="auto",
              show_default=True, help="Command syntax (auto: from mpiexec --version).")
@click.option("--mem-per-node", default=None, help="Memory of the other hosts (e.g. 64G), for the fit warning.")
@click.option("--balance", "balance_profile", default=None, type=click.Path(dir_okay=False, path_type=Path),
              help="Choose the split from this profile (ggpipe calibrate): no stage a bottleneck, no rank out of "
                   "memory; speculative modes: also how many ranks the draft gets (simulated).")
@click.option("--acceptance", default=0.7, show_default=True, type=Finite(0.01, 0.99),
              help="With --balance: draft acceptance rate the draft rank choice is simulated with.")
@click.option("--no-command", is_flag=True, help="Print only the table.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def plan(ctx, ranks, model, draft_model, split, ctx_size, threads, hostfile, map_by, bind_to, launcher,
         mem_per_node, balance_profile, acceptance, no_command, as_json, command):
    """Print the launcher command and the rank -> host -> layers -> memory table of a job.

    Either give the model options here (ggpipe plan -n 4 -m MODEL --hostfile hosts), or the
    whole ggpipe command after -- (ggpipe plan -n 4 --hostfile hosts -- generate -m MODEL -p "…").
    Warns when a host's ranks need more memory than it has. With --balance PROFILE the split is
    chosen from measured costs (ggpipe calibrate) and put in the printed command."""
    import json as _json
    import shlex

    from ggpipe.frontends import plan as P

    own = {"-m": model, "-md": draft_model, "--split": split, "-c": ctx_size, "-t": threads}
    if command:
        given = [k for k, v in own.items() if v is not None]
        if given:
            raise click.UsageError(f"give {', '.join(given)} in the ggpipe command after --, not to plan as well")
        sub = cli.get_command(ctx, command[0])
        if sub is None or "model" not in {p.name for p in sub.params}:
            raise click.UsageError(f"{command[0]!r} is not a ggpipe job command (generate, chat, batch, serve)")
        with sub.make_context(command[0], list(command[1:]), parent=ctx) as sctx:
            params = dict(sctx.params)
        argv = list(command)
    else:
        params = dict(model=model or DEFAULT_MODEL, draft_model=draft_model, split=split,
                      ctx_size=ctx_size or 2048, threads=threads or "1")
        argv = ["generate"] + [x for k, v in own.items() if v is not None for x in (k, str(v))] + ["-p", "…"]
    from ggpipe.cluster.session import ClusterConfig

    hosts = P.parse_hostfile(hostfile) if hostfile else None
    placed = P.place_ranks(ranks, hosts, map_by)
    mem = P.parse_bytes(mem_per_node) if mem_per_node else None
    balanced = None
    if balance_profile is not None:
        if params["split"] is not None:
            raise click.UsageError("--balance chooses the split: leave --split out of the command")
        balanced = P.balanced_placement(balance_profile, params, ranks, placed, mem, acceptance)
        params["split"] = balanced.split
        argv = argv[:1] + ["--split", balanced.split] + argv[1:]
    elif params["split"] is not None:  # --split auto:PROFILE: the split the job will compute for itself
        params["split"] = P.auto_split(params["split"], params, ranks)
    cfg = ClusterConfig(model=params["model"], draft_model=params["draft_model"], split=params["split"],
                        threads=str(params["threads"]), ctx_size=params["ctx_size"])
    result = P.plan_job(cfg, ranks, placed, mem)
    if balanced is not None:
        result.balance = P.balance_summary(balanced)
    flavor = P.detect_flavor() if launcher == "auto" else launcher
    result.command = P.launcher_command(flavor, ranks, hostfile, map_by, bind_to,
                                        max(r.threads for r in result.ranks)) + ["ggpipe", *argv]
    if as_json:
        click.echo(_json.dumps(result.as_dict(), indent=1))
    else:
        if not no_command:
            click.echo(shlex.join(result.command))
            click.echo()
        click.echo(P.format_table(result))
        if balanced is not None:
            click.echo(P.format_balance(result.balance))
    for w in result.warnings:
        click.echo(f"ggpipe: warning: {w}", err=True)


cli.add_command(models_group)
cli.add_command(split_command)
cli.add_command(bench_command)
cli.add_command(timeline_command)
cli.add_command(calibrate_command)
cli.add_command(simulate_command)


def _abort_mpi(code: int) -> None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.COMM_WORLD.Get_size() > 1:
        from ggpipe.transport.mpi import abort_world

        abort_world(mpi.COMM_WORLD, code)


def _usage_line(exc: click.ClickException) -> str:
    """A click error as one line, with where to find help."""
    msg = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if isinstance(exc, click.UsageError) and ctx is not None:
        msg += f" (see '{ctx.command_path} --help')"
    return msg


def _fail(message: str, code: int, abort_job: bool = False) -> None:
    """Print ``message`` as this rank's one error line (if it is this rank's
    to print) and exit with ``code``."""
    rank = launched_rank() or 0
    if launched_rank() is not None:
        from ggpipe.cluster.session import report_startup_error, startup_entered  # noqa: PLC0415

        if not startup_entered():  # before the ranks have met: meet them with it, so no rank waits for this one
            line = report_startup_error(message)
            if line is not None:
                sys.stderr.write(f"ggpipe: error: {line}\n")
                if rank != 0:
                    _abort_mpi(code)
            sys.exit(code)
    if rank == 0:
        sys.stderr.write(f"ggpipe: error: {message}\n")
        if abort_job:
            _abort_mpi(code)
        sys.exit(code)
    sys.stderr.write(f"ggpipe: error: rank {rank}: {message}\n")
    _abort_mpi(code)
    sys.exit(code)


def main(argv=None) -> None:
    """Runs the click CLI and turns errors into one line (the console entry
    point is :func:`ggpipe.__main__.main`, which calls this).

    An error before the ranks have met (a usage error, a bad option value on
    any rank) still meets them, so the job ends within seconds with one line
    from the head naming the rank, instead of leaving the others in
    ``MPI_Init``."""
    rank = launched_rank() or 0
    try:
        cli.main(args=argv, prog_name="ggpipe", standalone_mode=False)
    except click.exceptions.Abort:
        sys.stderr.write("ggpipe: interrupted\n")
        sys.exit(130)
    except click.ClickException as exc:
        _fail(_usage_line(exc), exc.exit_code)
    except RankFailedError:
        # The head reports the error that stopped the job; workers exit quietly.
        if _state["verbose"]:
            traceback.print_exc()
        sys.exit(1)
    except GGPipeError as exc:
        if _state["verbose"]:
            traceback.print_exc()
        _fail(str(exc), exc.exit_code, exc.abort_job)
    except KeyboardInterrupt:
        sys.stderr.write("ggpipe: interrupted\n")
        _abort_mpi(130)
        sys.exit(130)
    except SystemExit:
        raise
    except BaseException:  # a bug: show it, and never leave the other ranks hanging
        sys.stderr.write(f"ggpipe: internal error on rank {rank}:\n")
        traceback.print_exc()
        _abort_mpi(2)
        sys.exit(2)
    sys.exit(0)


if __name__ == "__main__":
    main()
