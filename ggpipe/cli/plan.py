"""``ggpipe plan``: the launcher command and the rank -> host -> layers ->
memory table of a job (ggpipe.cluster.plan), with ``--balance`` the split
chosen from measured costs (ggpipe.sim.placement)."""

from __future__ import annotations

from pathlib import Path

import click

from ggpipe.cli.types import Finite
from ggpipe.models.registry import DEFAULT_MODEL
from ggpipe.runtime.llama import KV_CACHE_TYPES


@click.command(context_settings={"allow_interspersed_args": False})
@click.option("-n", "--ranks", required=True, type=click.IntRange(1), help="MPI ranks of the job.")
@click.option("-m", "--model", default=None, help=f"Target model (default {DEFAULT_MODEL}).")
@click.option("-md", "--draft-model", default=None, help="Draft model.")
@click.option("--split", default=None, help="Layer split, as for generate.")
@click.option("-c", "--ctx-size", default=None, type=int, help="KV cache size (tokens; default 2048).")
@click.option("-t", "--threads", default=None, help="Threads per rank (default 1).")
@click.option("-ctk", "--cache-type-k", type=click.Choice(list(KV_CACHE_TYPES)), default=None,
              help="KV cache type for K, as for generate (default f16; q8_0 halves the KV cache).")
@click.option("-ctv", "--cache-type-v", type=click.Choice(list(KV_CACHE_TYPES)), default=None,
              help="KV cache type for V, as for generate (default f16; a quantized one needs -fa on).")
@click.option("-fa", "--flash-attn", type=click.Choice(["on", "off", "auto"]), default=None,
              help="Flash attention, as for generate (default off).")
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
def plan(ctx, ranks, model, draft_model, split, ctx_size, threads, cache_type_k, cache_type_v, flash_attn, hostfile,
         map_by, bind_to, launcher, mem_per_node, balance_profile, acceptance, no_command, as_json, command):
    """Print the launcher command and the rank -> host -> layers -> memory table of a job.

    Either give the model options here (ggpipe plan -n 4 -m MODEL --hostfile hosts), or the
    whole ggpipe command after -- (ggpipe plan -n 4 --hostfile hosts -- generate -m MODEL -p "…").
    Warns when a host's ranks need more memory than it has. With --balance PROFILE the split is
    chosen from measured costs (ggpipe calibrate) and put in the printed command."""
    import json as _json
    import shlex

    from ggpipe.cluster import plan as P
    from ggpipe.sim import placement

    own = {"-m": model, "-md": draft_model, "--split": split, "-c": ctx_size, "-t": threads, "-ctk": cache_type_k,
           "-ctv": cache_type_v, "-fa": flash_attn}
    if command:
        given = [k for k, v in own.items() if v is not None]
        if given:
            raise click.UsageError(f"give {', '.join(given)} in the ggpipe command after --, not to plan as well")
        sub = ctx.find_root().command.get_command(ctx, command[0])
        if sub is None or "model" not in {p.name for p in sub.params}:
            raise click.UsageError(f"{command[0]!r} is not a ggpipe job command (generate, chat, batch, serve)")
        from ggpipe.cli.parallel import given_ctx_size

        with sub.make_context(command[0], list(command[1:]), parent=ctx) as sctx:
            params = dict(sctx.params)
            given_c = given_ctx_size(sctx)
        argv = list(command)
    else:
        params = dict(model=model or DEFAULT_MODEL, draft_model=draft_model, split=split,
                      ctx_size=ctx_size or 2048, threads=threads or "1", cache_type_k=cache_type_k or "f16",
                      cache_type_v=cache_type_v or "f16", flash_attn=flash_attn or "off")
        argv = ["generate"] + [x for k, v in own.items() if v is not None for x in (k, str(v))] + ["-p", "…"]
    from ggpipe.cluster.config import ClusterConfig

    hosts = P.parse_hostfile(hostfile) if hostfile else None
    placed = P.place_ranks(ranks, hosts, map_by)
    mem = P.parse_bytes(mem_per_node) if mem_per_node else None
    balanced = None
    if balance_profile is not None:
        if params["split"] is not None:
            raise click.UsageError("--balance chooses the split: leave --split out of the command")
        balanced = placement.balanced_placement(balance_profile, params, ranks, placed, mem, acceptance)
        params["split"] = balanced.split
        argv = argv[:1] + ["--split", balanced.split] + argv[1:]
    elif params["split"] is not None:  # --split auto:PROFILE: the split the job will compute for itself
        params["split"] = placement.auto_split(params["split"], params, ranks)
    kv = {k: params[k] for k in ("cache_type_k", "cache_type_v", "cache_type_k_draft", "cache_type_v_draft",
                                 "flash_attn") if params.get(k) is not None}
    cfg = ClusterConfig(model=params["model"], draft_model=params["draft_model"], split=params["split"],
                        threads=str(params["threads"]), ctx_size=params["ctx_size"], **kv)
    n_slots = 1
    if "parallel" in params:      # batch, serve: the slots' KV streams, as the job will lay them out
        from ggpipe.cli.parallel import slot_config, slots
        from ggpipe.decoding.plan import DecodingPlan
        from ggpipe.decoding.settings import SpecSettings
        from ggpipe.speculation.proposers.base import canonical_name

        spec_type = canonical_name(params.get("spec_type") or SpecSettings.spec_type)
        decoding = DecodingPlan.resolve(params.get("mode", "iterative"), SpecSettings(spec_type=spec_type))
        n_slots = slots(params["parallel"], decoding, ranks)
        if n_slots > 1:
            cfg = slot_config(cfg, n_slots, given_c)
    result = P.plan_job(cfg, ranks, placed, mem)
    if n_slots > 1:
        result.slots = P.slot_summary(result, cfg, params.get("micro_batches"))
    if balanced is not None:
        result.balance = placement.balance_summary(balanced)
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
            click.echo(placement.format_balance(result.balance))
    for w in result.warnings:
        click.echo(f"ggpipe: warning: {w}", err=True)

