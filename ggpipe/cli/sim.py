"""``ggpipe calibrate`` and ``ggpipe simulate`` (click commands; see
ggpipe/sim/calibrate.py and ggpipe/sim/run.py).

    mpiexec -n 2 ggpipe calibrate -m smollm2-goliath-40l-f32 -md smollm2-135m -o profile.json
    ggpipe simulate --profile profile.json -m smollm2-goliath-40l-f32 -md smollm2-135m \\
        --modes iterative,speculative,pipeinfer --ranks 2,3 --link shm --link 1gbit,200us --acceptance 0.7
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from pathlib import Path

import click

from ggpipe.errors import ConfigError, GGPipeError
from ggpipe.cli.types import Finite


DEFAULT_ACCEPTANCE = 0.7  # simulate's draft acceptance where neither --acceptance nor the profile gives one


def _say(msg: str) -> None:
    sys.stderr.write(f"ggpipe calibrate: {msg}\n")
    sys.stderr.flush()


@click.command("calibrate")
@click.option("-m", "--model", default="smollm2-135m", show_default=True,
              help="Target model the costs are measured on (registry name or .gguf path).")
@click.option("-md", "--draft-model", "draft", default=None, help="Draft model to measure as well.")
@click.option("-t", "--threads", default=1, show_default=True, type=click.IntRange(1, 1024),
              help="llama.cpp threads per rank (as the job will use).")
@click.option("--reps", default=5, show_default=True, type=click.IntRange(1, 100), help="Timed calls per figure.")
@click.option("--concurrent", is_flag=True,
              help="Ranks on the same host measure at the same time (default: one after another).")
@click.option("-o", "--output", default="profile.json", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path),
              help="Profile to write (JSON); an existing file is replaced only if it is a ggpipe profile.")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, type=Finite(1.0, 3600.0),
              help="Bound of every wait for another rank (s).")
@click.option("--agreement-prompts", "agreement_prompts", default=None,
              type=click.Path(dir_okay=False, path_type=Path),
              help="With -md: prompts (one per line) the draft's agreement is measured on; default: a few "
                   "built-in ones. Use text of the kind the job will see.")
@click.option("--agreement-tokens", default=64, show_default=True, type=click.IntRange(0, 4096),
              help="With -md: tokens generated per prompt to measure the draft's agreement (0: skip it).")
def calibrate_command(model, draft, threads, reps, concurrent, output, timeout_s, agreement_prompts,
                      agreement_tokens):
    """Measure every rank's layer, head and draft costs and its links; write a profile.

    Run it under the job's launcher (mpiexec -n R ggpipe calibrate ...), or alone for this host.
    With a draft model it ends with a short job that measures how often the draft's token is the
    target's (simulate's --acceptance). ggpipe simulate and ggpipe plan --balance read the profile.
    """
    from ggpipe.cluster.startup import enter_startup
    from ggpipe.models.registry import resolve
    from ggpipe.models.sizes import model_sizes
    from ggpipe.sim.calibrate import calibrate_job
    from ggpipe.output_paths import check_output, make_parent
    from ggpipe.transport.launcher_signal import launched_rank
    from ggpipe.service.agreement import measure_agreement, read_prompts
    from ggpipe.transport.mpi import Transport, mpi_world

    output = check_output(output, foreign=_not_a_profile, what="the profile")   # before any measuring
    prompts = read_prompts(agreement_prompts) if draft is not None and agreement_tokens else ()
    for name in (model, draft):  # every rank checks its inputs before the ranks meet
        if name is not None:
            resolve(name)
            model_sizes(name)
    if launched_rank() in (None, 0):
        make_parent(output, "the profile")   # only the head writes it
    world = mpi_world()
    if world is None or world[2] == 1:
        transport = _Solo()
    else:
        enter_startup()
        transport = Transport(world[0], timeout_s=timeout_s)
    try:
        prof = calibrate_job(transport, model, draft, threads, concurrent=concurrent, reps=reps,
                             say=_say if transport.rank == 0 else (lambda s: None))
    except GGPipeError as exc:
        exc.abort_job = True  # other ranks wait for this one: end the job
        raise
    if prompts:
        # the ranks meet again as a job's do: a short job over the prompts
        agreement = measure_agreement(model, draft, str(threads), prompts, agreement_tokens, timeout_s,
                                      say=_say if prof is not None else (lambda s: None))
        if prof is not None and agreement is not None:
            prof.agreement = dataclasses.asdict(agreement)
            _say(f"draft agreement {agreement.rate:.3f} (the draft's most likely token was the target's greedy "
                 f"token at {agreement.agreed} of {agreement.positions} positions, {agreement.prompts} prompts); "
                 f"confidence exponent {agreement.exponent} (P(agreed | the draft's probability q) = q^k)")
    if prof is None:
        return
    prof.meta["command"] = " ".join(sys.argv)
    try:
        prof.save(output)
    except OSError as e:
        raise ConfigError(f"cannot write the profile {output}: {e.strerror or e}") from None
    _say(f"wrote {output} ({len(prof.hosts)} rank(s), {len(prof.links)} link(s))")
    h = prof.hosts[0]
    if h.cached_layer_s:
        _say(f"a block at batch 1: {1e3 * h.layer_s[0]:.3f} ms streamed from memory ({h.stream_layers} blocks in "
             f"sequence, as a job's stage), {1e3 * h.cached_layer_s:.3f} ms timed alone from the cache "
             f"({h.layer_s[0] / h.cached_layer_s:.2f}x): the profile uses the streamed cost")
    click.echo(json.dumps({"output": str(output), "layer_ms_b1": round(1e3 * h.layer_s[0], 4),
                           "layer_ms_b1_cached": None if h.cached_layer_s is None else round(1e3 * h.cached_layer_s, 4),
                           "stream_layers": h.stream_layers,
                           "head_ms_b1": round(1e3 * h.head_s[0], 4),
                           "draft_ms_b1": None if h.draft_s is None else round(1e3 * h.draft_s[0], 4),
                           "overhead_ms": round(1e3 * h.overhead_s, 4),
                           "acceptance": None if prof.agreement is None else round(prof.agreement["rate"], 4),
                           "confidence_exponent": None if prof.agreement is None else prof.agreement.get("exponent"),
                           "links": [[ln.src, ln.dst, round(1e6 * ln.latency_s, 1), round(ln.bandwidth_Bps / 1e6, 1)]
                                     for ln in prof.links]}))


def _not_a_profile(path: Path) -> str | None:
    """Why an existing ``path`` is not a profile ggpipe may replace, or None."""
    from ggpipe.sim.profile import Profile  # noqa: PLC0415

    try:
        Profile.load(path)
    except ConfigError:
        return "exists and is not a ggpipe profile: not overwriting it"
    return None


class _Solo:
    rank, size, timeout_s = 0, 1, 60.0


def _split(text):
    from ggpipe.cluster.split import parse_split

    return parse_split(text)


@click.command("simulate")
@click.option("--profile", "profile_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Profile from ggpipe calibrate.")
@click.option("-m", "--model", "target", required=True,
              help="Target model: a GGUF (registry name or path; only its header is read) or ARCH:QUANT, "
                   "e.g. llama2-70b:Q3_K_M.")
@click.option("-md", "--draft-model", "draft", default=None, help="Draft model (as -m).")
@click.option("--modes", default="iterative,speculative,pipeinfer", show_default=True,
              help="Comma-separated modes (iterative, speculative, pipeinfer, pipedec).")
@click.option("--ranks", default="2", show_default=True, help="Comma-separated rank counts.")
@click.option("--link", "links", multiple=True, help="Emulated link added to every hop, as ggpipe bench --link.")
@click.option("--split", default=None, help="Layer split, as ggpipe generate --split.")
@click.option("--acceptance", default=None, type=Finite(0.01, 0.99),
              help="How often the draft's greedy token is the target's (0.01-0.99). Default: the rate "
                   "calibrate -md measured for this pair, else 0.7.")
@click.option("--confidence-exponent", default=None, type=Finite(0.05, 20.0),
              help="k in P(draft token accepted | draft confidence q) = q^k (1: a calibrated draft, "
                   "<1: under-confident). Default: the k calibrate -md measured for this pair, else 1.")
@click.option("--draft", "n_draft", default=6, show_default=True, type=click.IntRange(1, 64),
              help="Most draft tokens per micro-batch.")
@click.option("--p-accept", default="0.3", show_default=True, help="Confidence cutoff, or auto.")
@click.option("--tree-width", default=1, show_default=True, type=click.IntRange(1, 64),
              help="pipedec: most nodes per prediction-tree layer.")
@click.option("--max-children", default=4, show_default=True, type=click.IntRange(1, 64),
              help="pipedec: most children per tree node.")
@click.option("--no-wait-draft", is_flag=True,
              help="pipeinfer: hand over what is drafted at once (as ggpipe generate).")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(1, 1 << 16))
@click.option("--n-prompt", default=128, show_default=True, type=click.IntRange(1, 1 << 16))
@click.option("--prompts", default=3, show_default=True, type=click.IntRange(1, 1000), help="Requests per configuration.")
@click.option("--parallel", default="1", show_default=True,
              help="Comma-separated slot counts of the continuous-batching scheduler; above 1 the --prompts "
                   "requests are submitted at once, as to 'ggpipe serve --parallel N' (a speculative mode "
                   "drafts for a request that generates alone).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per configuration instead of a table.")
@click.option("--timeline", "timeline_dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="Write each configuration's per-rank traces to DIR/<link>_r<ranks>_<mode>/ "
                   "(draw them with ggpipe timeline).")
def simulate_command(profile_path, target, draft, modes, ranks, links, split, acceptance, confidence_exponent,
                     n_draft, p_accept, tree_width, max_children, no_wait_draft, n_predict, n_prompt, prompts, parallel,
                     as_json, timeline_dir):
    """Simulate jobs on a virtual clock: the real decoding loops against measured costs.

    Reports tokens/s, TTFT, ITL, tokens per target pass, acceptance and per-rank busy share for every
    mode x ranks x link, as ggpipe bench measures them.
    """
    from ggpipe.decoding.mode import mode_class
    from ggpipe.decoding.settings import SpecSettings
    from ggpipe.cli.bench import _int_list, _links
    from ggpipe.sim.model import resolve_desc
    from ggpipe.sim.profile import Profile
    from ggpipe.sim.run import SimConfig, simulate
    from ggpipe.transport.link import format_link, parse_link

    prof = Profile.load(profile_path)
    if acceptance is None:
        acceptance = prof.acceptance_for(target, draft)
        if acceptance is None:
            acceptance = DEFAULT_ACCEPTANCE
            if draft is not None and any(mode_class(m.strip()).speculates for m in modes.split(",") if m.strip()):
                sys.stderr.write(f"ggpipe simulate: the profile has no measured acceptance for this model pair "
                                 f"(ggpipe calibrate -m TARGET -md DRAFT measures it); assuming "
                                 f"{DEFAULT_ACCEPTANCE} (--acceptance sets it)\n")
        acceptance = min(0.99, max(0.01, acceptance))
    if confidence_exponent is None:
        confidence_exponent = prof.confidence_exponent_for(target, draft) or 1.0
    tdesc = resolve_desc(target)
    ddesc = resolve_desc(draft) if draft else None
    spec = SpecSettings(draft_max=n_draft, p_accept=None if p_accept == "auto" else float(p_accept),
                        tree_width=tree_width, max_children=max_children, wait_draft=not no_wait_draft)
    rows = []
    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for link_text in _links(links):
        link = parse_link(link_text)
        for n_ranks, mode, n_par in itertools.product(_int_list(ranks, "--ranks"), mode_list,
                                                      _int_list(parallel, "--parallel")):
            cfg = SimConfig(prof, tdesc, ddesc, mode=mode, ranks=n_ranks, split=_split(split), spec=spec, link=link,
                            acceptance=acceptance, confidence_exponent=confidence_exponent, n_prompt=n_prompt,
                            n_predict=n_predict, prompts=prompts, parallel=n_par)
            tdir = None
            if timeline_dir is not None:
                tdir = timeline_dir / f"{format_link(link).replace(',', '-')}_r{n_ranks}_{mode}_p{n_par}"
            r = simulate(cfg, trace_dir=tdir)
            r["link"] = format_link(link)
            if tdir is not None:
                r["timeline"] = str(tdir)
            r.pop("records")
            rows.append(r)
            if as_json:
                click.echo(json.dumps(r))
    if not as_json:
        click.echo(format_table(rows))


def format_table(rows: list[dict]) -> str:
    """The Markdown table ``ggpipe simulate`` prints: one row per simulated
    configuration (link, ranks, mode, parallel, tokens/s, aggregate tokens/s,
    TTFT and ITL in ms, accepted tokens per pass, acceptance rate, each rank's
    busy share); ``-`` where a value is None."""
    head = ("| link | ranks | mode | parallel | tokens/s | aggregate tokens/s | TTFT ms | ITL ms | tokens/pass | "
            "acceptance | busy share per rank |")
    out = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def f(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    for r in rows:
        busy = " ".join(f"{v:.2f}" for _, v in sorted(r["busy_share"].items()))
        out.append(f"| {r['link']} | {r['ranks']} | {r['mode']} | {r.get('parallel', 1)} | {f(r['tokens_per_s'])} | "
                   f"{f(r.get('aggregate_tokens_per_s'))} | {f(r['ttft_ms'])} | "
                   f"{f(r['itl_mean_ms'], 2)} | {f(r['accepted_per_pass'], 2)} | {f(r['acceptance_rate'], 2)} "
                   f"| {busy} |")
    return "\n".join(out)
