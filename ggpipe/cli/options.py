"""The options every job command shares (cluster, speculation, sampling),
and turning their values into a :class:`~ggpipe.service.job.JobSpec`."""

from __future__ import annotations

from pathlib import Path

import click

from ggpipe.cli.types import SECONDS, Finite
from ggpipe.models.registry import DEFAULT_MODEL
from ggpipe.sampling import SamplingParams


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
        click.option("--draft-max", "--draft", "n_draft", default=d.draft_max, show_default=True, type=click.IntRange(1, 64),
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
        click.option("--branches", default=d.branches, show_default=True, type=click.IntRange(1, 16),
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

    from ggpipe.speculation.majority import check_members  # noqa: PLC0415

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
    return SpecSettings(mode=mode if mode != "iterative" else "pipeinfer", spec_type=spec_type, draft_max=n_draft,
                        p_accept=p_accept,
                        p_split=p_split, p_recovery=p_recovery, p_decay=p_decay, branches=branches,
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
    from ggpipe.service.job import JobSpec
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
        from ggpipe.sim.placement import auto_split
        from ggpipe.transport.launcher_signal import launched_size

        o["split"] = auto_split(o["split"], dict(o), launched_size() or 1)
    cfg = ClusterConfig(model=o["model"], draft_model=o["draft_model"], split=o["split"], threads=o["threads"],
                        ctx_size=o["ctx_size"], n_seq_max=n_seq_max, ubatch=o["ubatch"], timeout_s=o["timeout"],
                        liveness_timeout_s=o["liveness_timeout"], flash_attn=o["flash_attn"])
    check_draft_models(len(cfg.draft_models), o["mode"], spec)
    return JobSpec(cfg, o["mode"], spec, o["ignore_eos"]), sampling, o["n_predict"]

