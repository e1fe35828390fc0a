"""The options every job command shares (cluster, speculation, sampling),
and turning their values into a :class:`~ggpipe.service.job.JobSpec`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from ggpipe.cli.types import SECONDS, Finite, NumberOrAuto
from ggpipe.models.registry import DEFAULT_MODEL
from ggpipe.runtime.llama import KV_CACHE_TYPES, NUMA
from ggpipe.sampling_params import SamplingParams


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
                          "e.g. 0.5,0.5/1.0 (the draft gets one rank when there are 2+); "
                          "with several draft models one /DRAFT part each (1,1/1/1); "
                          "default: the weight bytes each token reads balanced, the LM head counted on the last "
                          "stage (generation); prompts: balanced without the head, for work that is mostly "
                          "prompt tokens (long prompts, short answers); "
                          "auto:PROFILE.json: balanced from measured costs (ggpipe calibrate)."),
        click.option("-t", "--threads", default="1", show_default=True,
                     help="Threads per rank: one value, or one per rank (2,1,1)."),
        click.option("-c", "--ctx-size", default=2048, show_default=True, type=int, help="KV cache size (tokens)."),
        click.option("-b", "--batch-size", default=None, type=int,
                     help="Most tokens of one micro-batch (llama.cpp's n_batch): the token budget a step shares "
                          "between generating requests and prompt chunks under --parallel, and the prompt chunk "
                          "sent down the pipeline. Default: --ubatch."),
        click.option("-ub", "--ubatch", default=512, show_default=True, type=int,
                     help="Tokens a stage computes at once (llama.cpp's n_ubatch); a larger micro-batch is split."),
        click.option("--n-seq-max", default=None, type=int,
                     help="KV sequence ids per target context (default: 1, or enough for the speculation settings)."),
        click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default="off",
                     show_default=True,
                     help="Flash attention, llama.cpp's meaning (its tools default to auto). off is "
                          "llama-cpp-python's default and the reference of ggpipe's exactness guarantee."),
        click.option("-ctk", "--cache-type-k", type=click.Choice(list(KV_CACHE_TYPES)), default="f16",
                     show_default=True, help="KV cache type for K, llama.cpp's names (q8_0 halves the KV cache)."),
        click.option("-ctv", "--cache-type-v", type=click.Choice(list(KV_CACHE_TYPES)), default="f16",
                     show_default=True, help="KV cache type for V; a quantized one (q8_0, q4_0, ...) needs -fa on."),
        click.option("-ctkd", "--cache-type-k-draft", type=click.Choice(list(KV_CACHE_TYPES)), default=None,
                     help="KV cache type for K of the draft models (default: -ctk's)."),
        click.option("-ctvd", "--cache-type-v-draft", type=click.Choice(list(KV_CACHE_TYPES)), default=None,
                     help="KV cache type for V of the draft models (default: -ctv's)."),
        click.option("--mlock", is_flag=True, help="Keep the weights in RAM (llama.cpp's --mlock; needs "
                                                   "RLIMIT_MEMLOCK room, llama.cpp warns if it fails)."),
        click.option("--no-mmap", is_flag=True, help="Read the weights into memory instead of mapping them "
                                                     "(llama.cpp's --no-mmap)."),
        click.option("--exact", is_flag=True, envvar="GGPIPE_EXACT",
                     help="Bit-exact speculation: verified rows equal lone-token rows bit for bit, so every "
                          "mode gives iterative's tokens in every run, also at near-ties. Needs llama-cpp-python "
                          "built with -DGGML_LLAMAFILE=OFF (README \"Exactness\"); turns repacking off."),
        click.option("-nr", "--no-repack", is_flag=True,
                     help="llama.cpp's --no-repack: no extra buffer types (repacked Q4_0/Q4_K/IQ4_NL/Q8_0 "
                          "weights) for the weights."),
        click.option("--numa", type=click.Choice(list(NUMA)), default=None,
                     help="llama.cpp's NUMA optimisations (llama_numa_init), per rank: distribute, isolate "
                          "(threads on the rank's starting node), numactl (numactl's CPU map)."),
        click.option("--timeout", default=60.0, show_default=True, type=SECONDS,
                     help="Seconds any wait for another rank may last inside a transaction."),
        click.option("--liveness-timeout", default=6.0, show_default=True, type=Finite(min=0.5),
                     help="Seconds of heartbeat silence after which a rank counts as dead or stuck "
                          "and the job stops, naming it."),
    ]
    return _apply(opts, f)


class ModeName(click.ParamType):
    """``--mode``: a name registered in ``ggpipe.decoding.mode.MODES`` (read
    when the value is checked, so a mode registered later is accepted)."""

    name = "MODE"

    def convert(self, value, param, ctx):
        from ggpipe.decoding.mode import MODES  # noqa: PLC0415

        if value not in MODES:
            self.fail(f"{value!r} is not one of {', '.join(map(repr, MODES))}", param, ctx)
        return value

    def get_metavar(self, param, ctx=None):
        from ggpipe.decoding.mode import MODES  # noqa: PLC0415

        return "[" + "|".join(MODES) + "]"


def speculation_options(f):
    """Speculation knobs (PipeInfer IV.B; defaults tuned in docs/benchmarks/one-stream.md). The
    drafting strategy's (``--spec-type``, ``--spec-vote``, ...) come from the
    registered proposers, through :class:`ggpipe.cli.strategies.JobCommand`."""
    from ggpipe.decoding.settings import SpecSettings  # noqa: PLC0415

    d = SpecSettings()
    opts = [
        click.option("--mode", type=ModeName(), default="iterative",
                     show_default=True, help="Scheduling mode: iterative (plain pipeline), speculative "
                                             "(synchronous), pipeinfer (PipeInfer), pipedec (PipeDec's dynamic "
                                             "prediction tree, one layer per pipeline step)."),
        click.option("--draft-max", "--draft", "n_draft", default=d.draft_max, show_default=True, type=click.IntRange(1, 64),
                     help="Most draft tokens per speculation tree / micro-batch."),
        click.option("--p-accept", default="default", type=PROBABILITY_OR_AUTO,
                     help=f"Confidence cutoff: drafting stops when the draft's probability of its next token is "
                          f"below it; auto: from the measured pass cost curve and the drafts' calibrated "
                          f"acceptance (docs/user-guide/speculative.md, Knobs). Default: {d.p_accept} in pipeinfer mode with "
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


#: --p-accept: a probability, auto (None), or "default" (chosen per --spec-type in _spec_settings).
PROBABILITY_OR_AUTO = NumberOrAuto(float, 0.0, 1.0, "P|auto", "a probability", keep=("default",))

_SAME = ("p_split", "p_recovery", "p_decay", "branches", "max_inflight", "tree_width", "max_children")
_NEGATED = {"no_continuous": "continuous", "no_cancel": "cancel", "no_wait_draft": "wait_draft"}


def _spec_settings(o: Mapping[str, Any]):
    """The :class:`~ggpipe.decoding.settings.SpecSettings` of the job
    options' values ``o`` (keyword names, as :func:`split_job_options` pops
    them; absent ones keep SpecSettings' defaults). ``--p-accept default``
    becomes auto where the strategy's class says so for the mode
    (``p_accept_auto``: measured better there, docs/user-guide/speculative.md, Knobs),
    else the fixed cutoff.

    Raises:
        ValueError: an unknown ``spec_type``."""
    from ggpipe.cli.strategies import strategy_options  # noqa: PLC0415
    from ggpipe.decoding.settings import SpecSettings  # noqa: PLC0415
    from ggpipe.speculation.proposers.base import canonical_name, proposer_class  # noqa: PLC0415

    mode = o.get("mode", "iterative")
    spec_type = canonical_name(o.get("spec_type", SpecSettings.spec_type))
    options = strategy_options(o)
    p_accept = o.get("p_accept", "default")
    if p_accept == "default":
        p_accept = None if proposer_class(spec_type).p_accept_auto(mode, options) else SpecSettings.p_accept
    kw = {k: o[k] for k in _SAME if k in o}
    kw.update({field: not o[flag] for flag, field in _NEGATED.items() if flag in o})
    if "n_draft" in o:
        kw["draft_max"] = o["n_draft"]
    return SpecSettings(spec_type=spec_type, p_accept=p_accept, strategy_options=options, **kw)


def sampling_options(f):
    """Per-request generation settings (llama.cpp's names and defaults)."""
    opts = [
        click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(min=1),
                     help="Tokens to generate (at most)."),
        click.option("--temp", default=0.0, show_default=True, type=Finite(min=0), help="Temperature; 0 = greedy."),
        click.option("--top-k", default=40, show_default=True, type=int, help="Top-k (0 = off)."),
        click.option("--top-p", default=0.95, show_default=True, type=Finite(0, 1, min_open=True), help="Top-p (1 = off)."),
        click.option("--seed", default=None, type=int, help="Sampling seed."),
        click.option("--min-p", default=0.0, show_default=True, type=Finite(0, 1),
                     help="Min-p: keep tokens at least this times as likely as the best (0 = off)."),
        click.option("--repeat-penalty", default=1.0, show_default=True, type=Finite(0, 10, min_open=True),
                     help="Penalise tokens among the last --repeat-last-n (1 = off)."),
        click.option("--repeat-last-n", default=64, show_default=True, type=click.IntRange(-1, 1 << 20),
                     help="Tokens the penalties look back on (0 = off, -1 = the whole context)."),
        click.option("--presence-penalty", default=0.0, show_default=True, type=Finite(-2, 2),
                     help="Subtracted from the logit of every token already there (0 = off)."),
        click.option("--frequency-penalty", default=0.0, show_default=True, type=Finite(-2, 2),
                     help="Subtracted per occurrence of a token already there (0 = off)."),
        click.option("-l", "--logit-bias", multiple=True, metavar="TOKEN_ID(+/-)BIAS",
                     help="Add BIAS to a token's logit, e.g. 15043+1 or 15043-100 (repeatable)."),
        click.option("--grammar", default=None, metavar="GBNF", help="Constrain the output to a GBNF grammar."),
        click.option("--grammar-file", default=None, type=click.Path(dir_okay=False, path_type=Path),
                     help="Read --grammar from a file."),
        click.option("-j", "--json-schema", default=None, metavar="SCHEMA",
                     help="Constrain the output to JSON valid under this JSON schema ('{}': any JSON object)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating after an end-of-generation token."),
    ]
    return _apply(opts, f)


def _logit_bias(values: tuple[str, ...]) -> dict:
    """llama.cpp's ``--logit-bias TOKEN_ID(+/-)BIAS`` values as OpenAI's
    ``{"token id": bias}``.

    Raises:
        ConfigError: a value of another shape."""
    from ggpipe.errors import ConfigError  # noqa: PLC0415

    out: dict = {}
    for v in values:
        m = re.fullmatch(r"\s*(\d{1,9})\s*([+-]\s*[0-9.eE+-]+)\s*", v)
        try:
            bias = float(m.group(2).replace(" ", "")) if m else None
        except ValueError:
            bias = None
        if bias is None:
            raise ConfigError(f"--logit-bias {v!r}: give TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-100")
        out[m.group(1)] = out.get(m.group(1), 0.0) + bias
    return out


def _constraint_fields(o: dict) -> dict:
    """The request fields (ggpipe.frontends.request_fields) the command line's
    constraint options give.

    Raises:
        ConfigError: an unreadable --grammar-file, --json-schema that is not
            JSON, two grammars."""
    from ggpipe.errors import ConfigError  # noqa: PLC0415

    fields = {k: o[k] for k in ("min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty")}
    fields["logit_bias"] = _logit_bias(o["logit_bias"]) or None
    grammar = o["grammar"]
    if o["grammar_file"] is not None:
        if grammar is not None:
            raise ConfigError("give --grammar or --grammar-file, not both")
        try:
            grammar = o["grammar_file"].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --grammar-file {o['grammar_file']}: {getattr(e, 'strerror', None) or e}") \
                from None
    fields["grammar"] = grammar
    if o["json_schema"] is not None:
        try:
            fields["json_schema"] = json.loads(o["json_schema"])
        except ValueError as e:
            raise ConfigError(f"--json-schema is not JSON: {e}") from None
    return fields


def job_options(f):
    """Everything that starts a job: cluster, speculation and sampling options."""
    return cluster_options(speculation_options(sampling_options(f)))


_JOB_KEYS = ("model", "draft_model", "split", "threads", "ctx_size", "batch_size", "ubatch", "n_seq_max", "timeout", "flash_attn",
             "cache_type_k", "cache_type_v", "cache_type_k_draft", "cache_type_v_draft", "mlock", "no_mmap", "numa",
             "exact", "no_repack",
             "liveness_timeout", "mode", "spec_type",
             "n_draft", "p_accept", "p_split", "p_recovery", "p_decay", "branches", "max_inflight", "no_continuous",
             "no_cancel", "no_wait_draft", "tree_width", "max_children", "n_predict", "temp", "top_k", "top_p", "seed",
             "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "logit_bias",
             "grammar", "grammar_file", "json_schema", "ignore_eos")


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
        ConfigError: impossible sampling settings; a quantized V cache
            without flash attention.
    """
    from ggpipe.service.job import JobSpec
    from ggpipe.cluster.config import ClusterConfig, draft_model_list
    from ggpipe.decoding.plan import DecodingPlan
    from ggpipe.cli.strategies import strategy_keys

    o = {k: kw.pop(k) for k in _JOB_KEYS}
    o.update({k: kw.pop(k) for k in strategy_keys() if k in kw})
    from ggpipe.errors import ConfigError
    from ggpipe.frontends.request_fields import FieldError, constraints

    sampling = SamplingParams(temperature=o["temp"], top_k=o["top_k"], top_p=o["top_p"], seed=o["seed"]).validate()
    try:
        sampling = constraints(_constraint_fields(o), sampling)
    except FieldError as e:
        flag = "--" + (e.param or "").replace("_", "-")
        raise ConfigError(f"{flag}: {e}" if e.param else str(e)) from None
    spec = _spec_settings(o)
    plan = DecodingPlan.resolve(o["mode"], spec, n_draft_models=len(draft_model_list(o["draft_model"])))
    n_seq_max = o["n_seq_max"] if o["n_seq_max"] is not None else plan.seq_ids
    if o["split"] is not None and o["split"].startswith("auto"):
        from ggpipe.sim.placement import auto_split
        from ggpipe.transport.launcher_signal import launched_size

        o["split"] = auto_split(o["split"], dict(o), launched_size() or 1)
    cfg = ClusterConfig(model=o["model"], draft_model=o["draft_model"], split=o["split"], threads=o["threads"],
                        ctx_size=o["ctx_size"], n_seq_max=n_seq_max, ubatch=o["ubatch"],
                        batch_size=o["batch_size"], timeout_s=o["timeout"],
                        liveness_timeout_s=o["liveness_timeout"], flash_attn=o["flash_attn"],
                        cache_type_k=o["cache_type_k"], cache_type_v=o["cache_type_v"],
                        cache_type_k_draft=o["cache_type_k_draft"], cache_type_v_draft=o["cache_type_v_draft"],
                        mlock=o["mlock"], no_mmap=o["no_mmap"], numa=o["numa"], exact=o["exact"],
                        repack=not o["no_repack"])
    cfg.check_cache_types()
    cfg.check_build()
    return JobSpec(cfg, plan, o["ignore_eos"]), sampling, o["n_predict"]

