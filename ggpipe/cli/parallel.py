"""``-np/--parallel N|auto`` of ``batch`` and ``serve``: how many requests
run at once through the continuous-batching scheduler
(ggpipe.decoding.parallel.scheduler), with llama.cpp's meaning of slots and of ``-c``.

* ``N`` slots, each a KV sequence with a KV stream of its own
  (``kv_unified = false``); ``-c`` is the KV size *shared* by the slots,
  ``-c / N`` cells each (rounded up to a multiple of 256 by llama.cpp), as
  in llama-server without ``--kv-unified``. Without ``-c`` it is 2048 per
  slot.
* ``auto`` (the default): ``max(8, 4 x ranks)`` in ``--mode iterative``
  and with ``--spec-type ngram`` (enough requests for every micro-batch in
  flight to hold several; docs/user-guide/parallel.md); 1
  with a draft model: one stream at a time is what
  its modes are for (pipeinfer overlaps drafting and verification only
  there).
* A speculative mode with ``N`` > 1 drafts a chain below a request's token
  while it generates alone, with its ``--spec-type`` (the draft model, an
  n-gram lookup, ...; ggpipe.decoding.parallel.chain_draft), verified in a
  micro-batch of its own; beside other generating requests it decodes
  plainly (ggpipe.decoding.parallel.scheduler). In ``--mode pipeinfer`` with
  ``--spec-type ngram``, look-ahead rows follow a request that generates
  alone through the stages that would idle (PipeInfer's continuation:
  a guess of its next token with a chain below, kept only when everything
  before it is accepted), where the measured gate says chains pay.
* ``1``: one request at a time, as ``generate`` and ``chat`` run them.

``--micro-batches N|auto``: how many micro-batches the scheduler keeps in
flight, the slots falling into that many groups that take turns. ``auto``
(the default): as many as the target's stages can compute at once (its
ranks, at most as many per host as the host's CPUs hold their threads;
``ggpipe.cluster.plan.concurrent_stages``).
"""

from __future__ import annotations

import dataclasses

import click

from ggpipe.service.job import JobSpec
from ggpipe.transport.launcher_signal import launched_size

CTX_PER_SLOT = 2048   # -c when not given: this many cells per slot


class Parallel(click.ParamType):
    """A count in [1, 256] (llama.cpp's LLAMA_MAX_SEQ: slots, or groups of
    them), or ``auto`` (None)."""

    name = "N|auto"

    def __init__(self, what: str = "slot count"):
        self.what = what

    def convert(self, value, param, ctx):
        if value is None or value == "auto" or isinstance(value, int):
            return None if value == "auto" else value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a {self.what} nor 'auto'", param, ctx)
        if not 1 <= n <= 256:
            self.fail(f"{n} is not in [1, 256] (llama.cpp's most sequences per context)", param, ctx)
        return n


parallel_option = click.option(
    "-np", "--parallel", default="auto", type=Parallel(), show_default=True,
    help="Requests served at once (slots), each with a KV stream of its own; -c is shared among them (-c/N cells "
         "each; without -c, 2048 per slot). auto: max(8, 4 x ranks) in --mode iterative and with --spec-type "
         "ngram, 1 with a draft model (above 1, it drafts for a request while it generates alone). 1: one at a time.")


micro_batches_option = click.option(
    "--micro-batches", default="auto", type=Parallel("micro-batch count"), show_default=True,
    help="Micro-batches in flight under --parallel > 1 (the slots take turns in that many groups). auto: as many as "
         "the target's stages can compute at once (per host, as many as its CPUs hold their threads).")


def with_parallel(job: JobSpec, parallel: int | None, ctx: click.Context, micro_batches: int | None = None) -> JobSpec:
    """``job`` with ``--parallel`` and ``--micro-batches`` applied: the
    slots, one KV stream per slot, ``-c`` per slot when not given.

    Raises:
        click.UsageError: ``--parallel`` > 1 with ``--n-seq-max`` (the slots
            are the sequences); ``--micro-batches`` with one slot."""
    n = slots(parallel, job.plan, launched_size() or 1)
    if n == 1:
        if micro_batches is not None:
            raise click.UsageError("--micro-batches needs --parallel above 1 (one request at a time is one "
                                   "micro-batch)")
        return job
    if ctx.get_parameter_source("n_seq_max") == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("--n-seq-max is set by --parallel (one KV sequence per slot): leave it out")
    return dataclasses.replace(job, config=slot_config(job.config, n, given_ctx_size(ctx)),
                               plan=job.plan.with_slots(n, micro_batches))


def given_ctx_size(ctx: click.Context) -> bool:
    """``-c`` was given on the command line (not its default)."""
    return ctx.get_parameter_source("ctx_size") == click.core.ParameterSource.COMMANDLINE


def slots(parallel: int | None, plan, n_ranks: int) -> int:
    """``--parallel`` (None: ``auto``) -> slots, for a job of ``n_ranks``
    decoding as ``plan`` (a ``ggpipe.decoding.plan.DecodingPlan``): many
    where drafting costs nothing (a mode that does not speculate, or a
    strategy that drafts by lookup: ``chain_lookup``), else one, so that a
    request gets its mode's own speculation."""
    if parallel is not None:
        return parallel
    from ggpipe.speculation.proposers.base import proposer_class  # noqa: PLC0415
    from ggpipe.speculation.proposers.options import StrategyOptions  # noqa: PLC0415

    costly = plan.speculates and proposer_class(plan.spec.spec_type).chain_lookup(StrategyOptions()) is None
    return 1 if costly else max(8, 4 * n_ranks)


def slot_config(config, n: int, given_c: bool):
    """``config`` (a ClusterConfig) with ``n`` > 1 slots: one KV sequence
    and stream per slot, ``-c`` shared by them (``CTX_PER_SLOT`` each when
    ``-c`` was not given). ``ggpipe plan`` sizes a job's KV with it too."""
    return dataclasses.replace(config, n_seq_max=n, kv_unified=False,
                               ctx_size=config.ctx_size if given_c else CTX_PER_SLOT * n)
