"""Build the loop requests go through (:func:`build_loop`: the scheduler's
slots, or one slot running the mode's decoder) and the decoder of a mode
over a target pipeline, as a resolved decoding plan
(``ggpipe.decoding.plan.DecodingPlan``) says: the one place that wires
them, shared by the engine (real pipelines) and the simulator (ggpipe.sim,
simulated ones)."""

from __future__ import annotations

from typing import Callable, Sequence

from ggpipe.decoding.mode import BuildContext, Mode
from ggpipe.decoding.loop import RequestLoop
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.pipeline.waiting import Wait
from ggpipe.speculation.adaptive import Calibration
from ggpipe.speculation.proposers.base import proposer_class


def build_decoder(plan: DecodingPlan, target, draft, *, n_ubatch: int, n_seq_max: int,
                  is_eog: Callable[[int], bool], timeout_s: float,
                  idle: Wait | None = None, more_drafts: Sequence = ()) -> Mode:
    """The decoder of ``plan``'s mode, with its speculation settings.

    Args:
        target: the target pipeline (a ``ggpipe.backend.TargetBackend``:
            ``ggpipe.pipeline.driver.Pipeline``, ``ggpipe.sim.backend.SimPipeline``, ...).
        draft: the draft model's pipeline, or None (no draft model).
        more_drafts: further draft models' pipelines (``-md a,b``): only
            ``--spec-type vote`` drafts with several.
        n_ubatch: prefill chunk size (tokens).
        n_seq_max: KV sequence ids of the target contexts.
        timeout_s: bound of every wait for a result (seconds).
        idle: the speculative loops' wait for "any result" (see
            ``ggpipe.decoding.spec_core.SpecCore``): ``ggpipe.pipeline.waiting.EventWait``
            over the pipelines for real ones, the simulator's clock for
            simulated ones; None: back-off polling.

    Raises:
        ConfigError: a draft-model proposer without a draft model; a
            proposer that cannot be built from these settings.
    """
    return plan.mode.build(BuildContext(target=target, draft=draft, more_drafts=tuple(more_drafts), spec=plan.spec,
                                        n_ubatch=n_ubatch, n_seq_max=n_seq_max, is_eog=is_eog,
                                        timeout_s=timeout_s, idle=idle))


def build_chain_drafter(plan: DecodingPlan, target, draft, *, n_ubatch: int, timeout_s: float,
                        idle: Wait | None = None, more_drafts: Sequence = (), calibration: Calibration | None = None,
                        waited_for: bool = True):
    """The continuous-batching scheduler's drafting (``--parallel`` > 1 in a
    speculative mode): ``draft(context, k) -> tokens``, a chain below a
    request that generates alone (ggpipe.decoding.parallel.scheduler). A strategy
    that drafts from the context alone (``chain_lookup``: ``--spec-type
    ngram``'s prompt lookup) drafts instantly; any other (the draft model, ...), a
    :class:`~ggpipe.decoding.parallel.chain_draft.ChainDrafter` over the proposer
    :meth:`BuildContext.proposer <ggpipe.decoding.mode.BuildContext.proposer>` makes,
    cut as one request at a time cuts it (:meth:`SpecSettings.cutoff
    <ggpipe.decoding.settings.SpecSettings.cutoff>`: ``--p-accept``, or with
    ``auto`` adaptive depth over ``calibration``, charging the draft's steps
    where its chains are ``waited_for``).

    Raises:
        ConfigError: as :meth:`~ggpipe.decoding.mode.BuildContext.proposer`."""
    from ggpipe.decoding.parallel.chain_draft import ChainDrafter, LookupDrafter  # noqa: PLC0415
    spec = plan.spec
    lookup = proposer_class(spec.spec_type).chain_lookup(spec.strategy_options)
    if lookup is not None:
        return LookupDrafter(lookup)
    ctx = BuildContext(target=target, draft=draft, more_drafts=tuple(more_drafts), spec=spec, n_ubatch=n_ubatch,
                       n_seq_max=1, is_eog=lambda t: False, timeout_s=timeout_s, idle=idle)
    calibration = calibration or Calibration()
    proposer = ctx.proposer(plan.name)
    cutoff = spec.cutoff(calibration, (lambda: proposer.step_s) if waited_for else None)
    return ChainDrafter(proposer, cutoff, idle=idle, timeout_s=timeout_s,
                        acceptance=calibration.acceptance if spec.p_accept is None else None)


def build_scheduler(plan: DecodingPlan, target, drafts: Sequence = (), *, n_ctx_slot: int, n_batch: int,
                    is_eog: Callable[[int], bool], depth: int | None, timeout_s: float, idle: Wait | None = None,
                    target_hosts: Sequence[str] = (), partial_reuse: bool = True,
                    doing: Callable[..., None] | None = None):
    """The continuous-batching scheduler of ``plan.slots`` slots in
    ``plan``'s mode (ggpipe.decoding.parallel.scheduler), as ``serve``, ``batch``
    and ``simulate`` run it: in a speculative mode with the chain drafter of
    :func:`build_chain_drafter` over ``drafts`` (the draft pipelines, the
    first drafting), and in a mode that declares ``lookahead_in_slots``
    with look-ahead rows where
    :func:`~ggpipe.decoding.parallel.lone_drafts.lookahead_wanted` says
    (``target_hosts``: each target rank's host); a draft model's chains
    then travel in look-ahead rows, drafted without being waited for.

    Args:
        n_ctx_slot: KV cells of one slot (tokens).
        n_batch: most tokens per micro-batch (``-b``; also the chain
            drafter's prefill chunk).
        depth: micro-batches in flight (None: the target's stages).
        timeout_s: bound of every wait (seconds).
        partial_reuse: the target's KV cells can be kept up to any position
            (False for recurrent and hybrid models; see the scheduler).
        doing: tells what the job is doing (see the scheduler), or None.

    Raises:
        ConfigError: as :func:`build_chain_drafter`; a bad ``GGPIPE_LOOKAHEAD``."""
    from ggpipe.decoding.parallel.lone_drafts import lookahead_wanted  # noqa: PLC0415
    from ggpipe.decoding.parallel.scheduler import Scheduler  # noqa: PLC0415
    drafter, lookahead, calibration = None, False, Calibration()
    if plan.speculates:
        spec = plan.spec
        has_ranks = proposer_class(spec.spec_type).chain_lookup(spec.strategy_options) is None
        lookahead = plan.mode.lookahead_in_slots and lookahead_wanted(list(target_hosts), has_ranks)
        drafter = build_chain_drafter(plan, target, drafts[0] if drafts else None, more_drafts=drafts[1:],
                                      n_ubatch=n_batch, timeout_s=timeout_s, idle=idle, calibration=calibration,
                                      waited_for=not (lookahead and has_ranks))
    return Scheduler(target, plan.slots, n_ctx_slot, n_batch, is_eog, depth=depth, timeout_s=timeout_s, idle=idle,
                     draft=drafter, draft_max=plan.spec.draft_max, lookahead=lookahead, partial_reuse=partial_reuse,
                     doing=doing, calibration=calibration)


def build_loop(plan: DecodingPlan, target, drafts: Sequence = (), *, n_ctx: int, n_batch: int, n_seq_max: int,
               is_eog: Callable[[int], bool], depth: int | None, timeout_s: float, idle: Wait | None = None,
               target_hosts: Sequence[str] = (), partial_reuse: bool = True,
               reuse_kv: bool = True, recover: Callable[[], None] = lambda: None,
               doing: Callable[..., None] | None = None) -> RequestLoop:
    """The one loop every front end's requests go through
    (:class:`~ggpipe.decoding.loop.RequestLoop`): with ``plan.slots`` > 1 the
    continuous-batching scheduler (:func:`build_scheduler`; ``n_ctx``: the
    cells of one slot); with one slot,
    :class:`~ggpipe.decoding.one_at_a_time.OneAtATime` over the mode's own
    decoder (:func:`build_decoder`), each request run to its end in full
    (``n_ctx``: the context; ``reuse_kv``: keep a shared prefix's cells;
    ``recover``: after a request failed unexpectedly). ``n_batch``: the
    most tokens of one micro-batch (``-b``): the scheduler's token budget,
    and the decoders' prefill chunk.

    Raises:
        ConfigError: as :func:`build_scheduler` and :func:`build_decoder`."""
    if plan.in_slots:
        return build_scheduler(plan, target, drafts, n_ctx_slot=n_ctx, n_batch=n_batch,
                               is_eog=is_eog, depth=depth, timeout_s=timeout_s, idle=idle,
                               target_hosts=target_hosts, partial_reuse=partial_reuse, doing=doing)
    from ggpipe.decoding.one_at_a_time import OneAtATime  # noqa: PLC0415
    decoder = build_decoder(plan, target, drafts[0] if drafts else None, more_drafts=drafts[1:],
                            n_ubatch=n_batch, n_seq_max=n_seq_max, is_eog=is_eog, timeout_s=timeout_s, idle=idle)
    return OneAtATime(decoder, n_ctx, target, reuse_kv=reuse_kv, partial_reuse=partial_reuse, recover=recover,
                      doing=doing, n_batch=n_batch)

